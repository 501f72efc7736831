"""A Concat of tensors transposed alike, transposed back: the Concat alone, on the axis moved.

Dynamo writes a slice assignment with the assigned axis moved first, so once the assignment is a
Concat (SliceAssignmentCanonicalization) its parts are joined along the moved axis and moved
back; joined along their own axis instead, no Transpose is left. (An element-wise op between
Transposes, ConvNeXt's channels-first residual between channels-last blocks, is
TransposePushCanonicalizationPass's.)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    inverse_perm,
    new_constant,
    node_label,
    producer_of,
    replace_subgraph,
    transpose_perm,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, NodeByNodePass, PassSpec, register_pass


@register_pass
class TransposeSinkFusionPass(FusionPass):
    """Not a pattern: each Concat of Transposes is judged alone."""

    spec = PassSpec(
        name="TransposeSinkFusionPass",
        category=Category.UB,
        description="Transpose(Concat(T(a), T(b), ...), inverse) for Transposes of one perm "
        "-> a Concat of a, b, ... on the axis the perm moves (dynamo's slice assignment)",
        aliases=("transpose_sink_fusion",),
        priority=5940,  # the down band, before the layout chains
        emits=(),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        for node in ctx.op_index.of_type(graph, "Concat"):
            if node.graph is graph:
                self._sink(ctx, node)

    @staticmethod
    def _sink(ctx: PassContext, node: ir.Node) -> None:
        result = node.outputs[0]
        uses = result.uses()
        if result.is_graph_output() or len(uses) != 1:
            return
        after = uses[0][0]
        if after.op_type != "Transpose" or after.domain not in ("", "ai.onnx"):
            return
        transposes = [producer_of(value, "Transpose") for value in node.inputs]
        shapes = [ctx.shape(value) for value in node.inputs if value is not None]
        if None in transposes or len(shapes) != len(node.inputs) or None in shapes:
            return
        rank = len(shapes[0])  # type: ignore[arg-type]
        if any(len(shape) != rank for shape in shapes):  # type: ignore[arg-type]
            return
        perms = {tuple(transpose_perm(t, rank)) for t in transposes}  # type: ignore[arg-type]
        perm = list(perms.pop())
        if perms or transpose_perm(after, rank) != inverse_perm(perm):
            return
        operands = [t.inputs[0] for t in transposes]  # type: ignore[union-attr]
        axis = {"axis": perm[node.attributes.get_int("axis", 0) % rank]}
        fused = ir.node(node.op_type, operands, attributes=axis)
        typed(fused.outputs[0], ctx.dtype(after.outputs[0]), ctx.shape(after.outputs[0]))
        # The Transposes go too where the op was their only reader.
        alone = [t for t in transposes if t is not None and len(t.outputs[0].uses()) == 1]
        old = [after, node, *dict.fromkeys(alone)]
        replace_subgraph(ctx, "TransposeSink", after, old, [fused], after.outputs, fused.outputs)


@register_pass
class LeadingSplitTransposeCanonicalizationPass(NodeByNodePass):
    """Not a pattern: each Reshape of a Transpose is judged on the sizes around it."""

    spec = PassSpec(
        name="LeadingSplitTransposeCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: Reshape(Transpose(x, perm), [a, b, ...]) splitting only the "
        "leading axis, which perm keeps -> Transpose(Reshape(x, [a, b, ...]), perm shifted): "
        "a key transposed with its heads folded into the batch and split afterwards (SAM's "
        "vision attention) becomes transposed heads, as the attention fusions read a key",
        aliases=("leading_split_transpose_canonicalization",),
        priority=3047,  # before the attention fusions read the key
        emits=(),
    )
    counts_changes = True
    anchor, pattern = "Reshape", "LeadingSplitTranspose"

    def judge(self, ctx: PassContext, reshape: ir.Node) -> str | None:
        """Rewrite at ``reshape`` if it splits the leading axis of a Transpose that keeps it;
        why not where it does but cannot move; None where it is no candidate."""
        transpose = producer_of(reshape.inputs[0], "Transpose")
        if transpose is None or transpose.inputs[0] is None:
            return None
        x = transpose.inputs[0]
        shape, result = ctx.shape(x), ctx.shape(reshape.outputs[0])
        if shape is None or result is None or len(result) != len(shape) + 1:
            return None
        perm = transpose_perm(transpose, len(shape))
        if perm is None or perm[0] != 0:
            return None
        split, rest = result[1], [shape[axis] for axis in perm[1:]]
        static = [split, *shape[1:]]
        if not all(isinstance(d, int) for d in static) or list(result[2:]) != rest:
            return None  # not a split of the leading axis alone, as far as the sizes tell
        if isinstance(shape[0], int) and shape[0] % split:  # type: ignore[operator]
            return None
        moving = transpose.outputs[0]
        if len(moving.uses()) != 1 or moving.is_graph_output():
            return "the transposed value is also read elsewhere"
        graph = reshape.graph
        assert graph is not None
        target = new_constant(
            graph, f"{node_label(reshape)}/heads", np.array([-1, *static], np.int64)
        )
        heads = ir.node("Reshape", [x, target])
        typed(heads.outputs[0], ctx.dtype(x), ir.Shape([result[0], *static]))
        moved = ir.node(
            "Transpose", heads.outputs, attributes={"perm": [0, 1, *(p + 1 for p in perm[1:])]}
        )
        typed(moved.outputs[0], ctx.dtype(x), result)
        replace_subgraph(
            ctx,
            "LeadingSplitTranspose",
            reshape,
            [reshape, transpose],
            [heads, moved],
            reshape.outputs,
            moved.outputs,
        )
        return None
