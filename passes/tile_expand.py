"""A Tile that repeats only axes of size 1 is an Expand.

TorchScript exports ``torch.repeat_interleave(k, r, dim=2)`` with a static r as
``Reshape(Tile(Unsqueeze(k, 3), [1, 1, 1, r, 1]), [0, 0, -1, H])`` (gemma_pytorch's repeat of
key/value heads), where dynamo writes an Expand. Tiling an axis of size 1 r times makes r
copies of its one slice, which is what broadcasting it to r does: ``Expand(x, repeats)`` gives
the same tensor wherever every repeated axis of x has size 1 (the other repeats are 1, which
Expand keeps). Exact. The repeat then reads as the head repeat the attention passes know
(HeadRepeatTransposeCanonicalizationPass, repeat_kv).

The node becomes an Expand where it is, its name kept. A Tile of a constant is left to
ConstantFoldingPass, which folds it or not by the size it makes.
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import DEFAULT_DOMAINS, constant_tensor, constant_value, node_label
from fusectl.rewrite.registry import Category, NodeByNodePass, PassSpec, register_pass


@register_pass
class TileExpandCanonicalizationPass(NodeByNodePass):
    """Not a pattern: each Tile is judged on its input's sizes."""

    spec = PassSpec(
        name="TileExpandCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: a Tile whose repeats are above 1 only on axes of size 1 -> "
        "an Expand to the repeats (TorchScript's repeat_interleave of key/value heads, which "
        "dynamo writes as an Expand)",
        aliases=("tile_expand_canonicalization",),
        priority=3033,  # before ExpandTargetCanonicalizationPass and the head repeats
        min_opset=8,  # Expand
        emits=("Expand",),
        canonical=True,
    )
    counts_changes = True
    anchor, pattern = "Tile", "TileExpand"

    def judge(self, ctx: PassContext, tile: ir.Node) -> str | None:
        """Rewrite ``tile`` as an Expand where it only spreads axes of size 1; else None."""
        repeats = constant_value(tile.inputs[1]) if len(tile.inputs) > 1 else None
        data = tile.inputs[0]
        shape = ctx.shape(data) if data is not None else None
        if (
            tile.domain not in DEFAULT_DOMAINS
            or repeats is None
            or shape is None
            or repeats.ndim != 1
            or len(repeats) != len(shape)
            or not (repeats >= 1).all()
            or not (repeats > 1).any()
        ):
            return None
        if any(count > 1 and shape[axis] != 1 for axis, count in enumerate(repeats.tolist())):
            return None  # copies of more than one slice: a tiling, not a broadcast
        if data is not None and constant_tensor(data) is not None:
            return None  # a constant's tiling is ConstantFoldingPass's, by the size it makes
        site = node_label(tile)
        if not ctx.may_rewrite("TileExpand", site):
            return None
        # The same inputs, the same output: the node becomes an Expand where it is, its name
        # kept (what other passes said of it still names it).
        ctx.record_fusion("TileExpand", [tile], [tile])  # the lineage names the Tile
        tile.op_type = "Expand"
        return None
