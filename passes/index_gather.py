"""Indexing by a constant list along one axis, as dynamo spells it: a Gather on that axis.

``x[:, :, :, [k]]`` (Falcon's new decoder architecture takes each group's key and value so)
is exported by dynamo as advanced indexing: the indexed axis moved first, a GatherND of
constant indices ``[[k]]``, the axis moved back,

    Transpose(GatherND(Transpose(x, p), I), inverse(p))

A GatherND (batch_dims 0) whose indices end in an axis of 1 picks whole slices along the first
axis, which is Gather(data, I[..., 0], axis=0); between a Transpose and its inverse, that is
Gather(x, I[..., 0], axis=p[0]) of x itself. Exact: the same elements, in the same places. The
passes that read selections (``axis_positions``) then see which positions of which axis are
kept.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    constant_value,
    inverse_perm,
    new_constant,
    node_label,
    producer_of,
    remove_dead,
    replace_subgraph,
    transpose_perm,
    typed,
)
from fusectl.rewrite.registry import Category, NodeByNodePass, PassSpec, register_pass


@register_pass
class IndexGatherCanonicalizationPass(NodeByNodePass):
    """Not a pattern: each GatherND of constant indices is judged alone."""

    spec = PassSpec(
        name="IndexGatherCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: GatherND of constant indices picking slices of the first axis "
        "-> Gather on it; between a Transpose and its inverse (dynamo's x[..., [k]]), a Gather "
        "on the axis indexed",
        aliases=("index_gather_canonicalization",),
        priority=3031,  # before ProjectionPieceCanonicalizationPass reads the selections
        emits=("Gather",),
        canonical=True,
    )
    counts_changes = True
    anchor, pattern = "GatherND", "IndexGather"

    def judge(self, ctx: PassContext, gather: ir.Node) -> str | None:
        """Rewrite ``gather`` as a Gather where its indices pick whole slices; else None."""
        indices = constant_value(gather.inputs[1]) if len(gather.inputs) > 1 else None
        data = gather.inputs[0]
        shape = ctx.shape(data) if data is not None else None
        if (
            gather.domain not in DEFAULT_DOMAINS
            or gather.attributes.get_int("batch_dims", 0) != 0
            or indices is None
            or indices.ndim < 1
            or indices.shape[-1] != 1
            or data is None
            or shape is None
        ):
            return None
        picked = indices[..., 0].astype(np.int64)
        axis, source, old, result = 0, data, [gather], gather.outputs[0]
        moved = producer_of(data, "Transpose")
        uses = result.uses()
        back = uses[0].node if len(uses) == 1 and not result.is_graph_output() else None
        perm = transpose_perm(moved, len(shape)) if moved is not None else None
        if (
            picked.ndim == 1
            and perm is not None
            and back is not None
            and back.op_type == "Transpose"
            and back.domain in DEFAULT_DOMAINS
            and transpose_perm(back, len(shape)) == inverse_perm(perm)
        ):
            axis, source, old, result = perm[0], moved.inputs[0], [gather, back], back.outputs[0]  # type: ignore[union-attr]
        graph = gather.graph
        assert graph is not None and source is not None
        positions = new_constant(graph, f"{ctx.spec.name}/{node_label(gather)}/indices", picked)
        node = ir.node("Gather", [source, positions], attributes={"axis": axis})
        typed(node.outputs[0], ctx.dtype(result), ctx.shape(result))
        replaced = replace_subgraph(ctx, "IndexGather", gather, old, [node], [result], node.outputs)
        if replaced is None:
            remove_dead(graph, [moved])
        return None
