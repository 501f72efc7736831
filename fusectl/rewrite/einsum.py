"""Which Einsums are matrix products, and the Transposes around the MatMul that compute one.

EinsumMatMulCanonicalizationPass lowers such an Einsum; EinsumRecognitionPass writes one only
where that lowering will take it.
"""

from __future__ import annotations

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
