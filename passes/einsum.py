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
from fusectl.rewrite.graph import new_transpose, replace_subgraph, typed
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_ELLIPSIS = "..."


def _labels(term: str, rank: int | None, spare: str) -> list[str] | str:
    """The term's labels, one per axis, an ellipsis spelled out with ``spare`` labels for the
    axes it covers (which needs the operand's rank); or why it cannot be read."""
    if _ELLIPSIS not in term:
        return list(term)
    before, after = term.split(_ELLIPSIS)
    if rank is None:
        return "an ellipsis over an operand of unknown rank"
    covered = rank - len(before) - len(after)
    if covered < 0:
        return "an ellipsis over more axes than the operand has"
    return [*before, *spare[:covered], *after]


def _perm(source: list[str], order: list[str]) -> list[int]:
    return [source.index(label) for label in order]


def plan(equation: str, ranks: tuple[int | None, int | None]) -> tuple | str:
    """(perm of A, perm of B, the MatMul output's labels, the output's perm from them) for a
    matrix-product equation, or why it is not one."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        return "the equation has no explicit output"
    terms, output = equation.split("->")
    operands = terms.split(",")
    if len(operands) != 2:
        return "not two operands"
    used = set(equation) - set(".,->")
    spare = "".join(c for c in "0123456789" if c not in used)
    a, b = (_labels(term, rank, spare) for term, rank in zip(operands, ranks, strict=True))
    if isinstance(a, str) or isinstance(b, str):
        return a if isinstance(a, str) else b  # type: ignore[return-value]
    covered = [len(labels) - len(term.replace(_ELLIPSIS, "")) for labels, term in
               zip((a, b), operands, strict=True)]  # fmt: skip
    if _ELLIPSIS in operands[0] and _ELLIPSIS in operands[1] and covered[0] != covered[1]:
        return "the operands' ellipses cover different numbers of axes"
    before, _, after = output.partition(_ELLIPSIS)
    out = [*before, *spare[: max(covered)], *after] if _ELLIPSIS in output else list(output)
    if any(len(set(labels)) != len(labels) for labels in (a, b, out)):
        return "a label repeats within a term (a diagonal)"
    batch = [label for label in a if label in b and label in out]
    contracted = [label for label in a if label in b and label not in out]
    a_free = [label for label in a if label not in b]
    b_free = [label for label in b if label not in a]
    if any(label not in out for label in a_free + b_free) or set(out) - set(a) - set(b):
        return "a label is summed over in one operand only"
    if len(contracted) != 1 or len(b_free) != 1 or not a_free:
        return "not one matrix product (one contracted label, one free label of B)"
    if len(a_free) > 1 and batch:
        return "several free labels of A besides batch labels"
    k, n = contracted[0], b_free[0]
    product = [*batch, *a_free, n]
    return _perm(a, [*batch, *a_free, k]), _perm(b, [*batch, k, n]), product, _perm(product, out)


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
