"""Canonical form: a two-operand Einsum that is a matrix product -> Transpose + MatMul.

Models written with ``torch.einsum`` (Funnel's and LongT5's attention, many research models:
``bind,bjnd->bnij`` for the scores, ``bnij,bjnd->bind`` for the context) export it as one
Einsum node, which no pass reads: the attention around it stays written out. An Einsum whose
labels are batch labels (in both operands and the output), one contracted label (in both
operands only) and one free label per operand is MatMul(Transpose(A), Transpose(B)) with the
output transposed into place; so is a linear layer ``bsd,df->bsf`` (several free labels of A,
none shared). The Transposes are the layouts the attention passes already read (the head split,
K^T, the context merge), so the attention fuses as if written with matmul.
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.einsum import plan
from fusectl.rewrite.graph import new_transpose, replace_subgraph, typed
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass


def _permuted(ctx: PassContext, value: ir.Value, perm: list[int], nodes: list[ir.Node]):
    """``value`` transposed by ``perm``, itself where that is the identity."""
    if perm == sorted(perm):
        return value
    result, swap = new_transpose(ctx, value, perm)
    nodes.append(swap)
    return result


@register_pass
class EinsumMatMulCanonicalizationPass(FusionPass):
    """Not a pattern: each Einsum's equation is read for what it computes."""

    spec = PassSpec(
        name="EinsumMatMulCanonicalizationPass",
        category=Category.GRAPH,
        description="two-operand Einsum that is a matrix product (batch labels, one "
        "contracted label, one free label of B) -> Transpose + MatMul (+ Transpose), the "
        "form the attention and linear passes read",
        aliases=("EinsumToMatMul",),
        priority=3025,
        emits=("MatMul",),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for node in ctx.op_index.of_type(model.graph, "Einsum"):
            if node.graph is not model.graph or len(node.inputs) != 2 or None in node.inputs:
                continue
            shapes = [ctx.shape(value) for value in node.inputs]
            ranks = tuple(len(s) if s is not None else None for s in shapes)
            found = plan(node.attributes.get_string("equation", ""), ranks)  # type: ignore[arg-type]
            if isinstance(found, str):
                ctx.pattern("EinsumMatMul").decline(found, node.name or "Einsum")
                continue
            a_perm, b_perm, _, out_perm = found
            nodes: list[ir.Node] = []
            a = _permuted(ctx, node.inputs[0], a_perm, nodes)  # type: ignore[arg-type]
            b = _permuted(ctx, node.inputs[1], b_perm, nodes)  # type: ignore[arg-type]
            product = ir.node("MatMul", [a, b])
            nodes.append(product)
            typed(product.outputs[0], ctx.dtype(node.outputs[0]), None)
            result = _permuted(ctx, product.outputs[0], out_perm, nodes)
            typed(result, ctx.dtype(node.outputs[0]), ctx.shape(node.outputs[0]))
            replace_subgraph(ctx, "EinsumMatMul", node, [node], nodes, node.outputs, [result])
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()
