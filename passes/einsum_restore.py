"""An Einsum taken apart for the fusions, and used by none, is written back as the Einsum.

EinsumMatMulCanonicalizationPass writes a matrix-product Einsum as Transposes around a
MatMul so that the attention passes read it. Where no pass fused it after all (XLNet's
relative attention, whose scores no fused op computes), the model is left with three nodes
for its one. This pass, late in the down band, finds such a MatMul still as the
canonicalization wrote it (its nodes carry that lineage and nothing else reads between them)
and writes the Einsum back, its equation read from the Transposes' perms.
"""

from __future__ import annotations

import json
import string

import onnx_ir as ir

from fusectl.rewrite.context import LINEAGE_NAMES, LINEAGE_PASSES, LINEAGE_TYPES, PassContext
from fusectl.rewrite.graph import replace_subgraph, transpose_perm
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_CANONICAL = "EinsumMatMulCanonicalizationPass"
_RESTORATION = "EinsumRestorationPass"


def _origin(node: ir.Node) -> str | None:
    """The Einsum a node was written for, when only the canonicalization wrote it (and this
    pass, in an earlier run: an Einsum restored then is taken apart and restored again, so a
    second run leaves the output as it is)."""
    props = node.metadata_props
    passes = props.get(LINEAGE_PASSES)
    written = set(json.loads(passes)) if passes is not None else set()
    if _CANONICAL not in written or not written <= {_CANONICAL, _RESTORATION}:
        return None
    return props.get(LINEAGE_NAMES)


def _transpose(value: ir.Value | None, origin: str) -> ir.Node | None:
    """The Transpose producing ``value`` for the same Einsum, read only there."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Transpose" or _origin(node) != origin:
        return None
    if value.is_graph_output() or len(value.uses()) != 1:  # type: ignore[union-attr]
        return None
    return node


def _perm(node: ir.Node | None, rank: int) -> list[int]:
    """The Transpose's perm; the identity where there is none."""
    perm = transpose_perm(node, rank) if node is not None else None
    return perm if perm is not None else list(range(rank))


def equation(
    a_rank: int, b_rank: int, a_perm: list[int], b_perm: list[int], out_perm: list[int]
) -> str:
    """The Einsum computing Transpose(MatMul(Transpose(A, a_perm), Transpose(B, b_perm)),
    out_perm) for the layouts the canonicalization writes: A' [batch, A's free, k], B'
    [batch, k, n], the product [batch, A's free, n]."""
    batch = b_rank - 2
    labels = iter(string.ascii_lowercase)
    shared = [next(labels) for _ in range(batch)]
    free = [next(labels) for _ in range(a_rank - 1 - batch)]
    k, n = next(labels), next(labels)
    a_labels = [""] * a_rank
    for position, label in zip(a_perm, [*shared, *free, k], strict=True):
        a_labels[position] = label
    b_labels = [""] * b_rank
    for position, label in zip(b_perm, [*shared, k, n], strict=True):
        b_labels[position] = label
    product = [*shared, *free, n]
    output = [product[axis] for axis in out_perm]
    return f"{''.join(a_labels)},{''.join(b_labels)}->{''.join(output)}"


@register_pass
class EinsumRestorationPass(FusionPass):
    """Not a pattern: each MatMul the Einsum canonicalization wrote is judged alone."""

    spec = PassSpec(
        name=_RESTORATION,
        category=Category.UB,
        description="Transposes + MatMul that EinsumMatMulCanonicalizationPass wrote for an "
        "Einsum no fusion took -> the Einsum again (one node, the model's own spelling)",
        aliases=("einsum_restoration",),
        priority=5960,  # the down band, after every fusion that could read the MatMul
        emits=("Einsum",),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for matmul in ctx.op_index.of_type(model.graph, "MatMul"):
            origin = _origin(matmul) if matmul.graph is model.graph else None
            if origin is not None:
                self._restore(ctx, matmul, origin)

    @staticmethod
    def _restore(ctx: PassContext, matmul: ir.Node, origin: str) -> None:
        a, b = (_transpose(value, origin) for value in matmul.inputs)
        result = matmul.outputs[0]
        uses = result.uses()
        after = uses[0][0] if len(uses) == 1 and not result.is_graph_output() else None
        if after is not None and (after.op_type != "Transpose" or _origin(after) != origin):
            after = None  # the product is read as it is
        group = [node for node in (a, b, after) if node is not None]
        if not group:
            return  # a MatMul alone: one node either way, and the faster kernel
        operands = [
            node.inputs[0] if node else value
            for node, value in zip((a, b), matmul.inputs, strict=True)
        ]
        shapes = [ctx.shape(value) for value in matmul.inputs]
        if None in operands or any(shape is None for shape in shapes):
            return
        a_rank, b_rank = (len(shape) for shape in shapes)  # type: ignore[arg-type]
        rank = len(ctx.shape(result) or ()) or max(a_rank, b_rank)
        formula = equation(a_rank, b_rank, _perm(a, a_rank), _perm(b, b_rank), _perm(after, rank))
        einsum = ir.node("Einsum", operands, attributes={"equation": formula})
        final = (after or matmul).outputs[0]
        einsum.outputs[0].dtype = final.dtype
        einsum.outputs[0].shape = final.shape
        root = after or matmul
        refused = replace_subgraph(
            ctx,
            "EinsumRestoration",
            root,
            [root, *([matmul] if after else []), *[n for n in (a, b) if n]],
            [einsum],
            [final],
            einsum.outputs,
        )
        if refused is None:
            _as_taken_apart(einsum)


def _as_taken_apart(einsum: ir.Node) -> None:
    """The Einsum is the one taken apart: its name back (where nothing took it since) and its
    lineage that one Einsum's, not one per node it was written as. A second run, which takes
    it apart and restores it again, then writes the same model."""
    graph = einsum.graph
    props = einsum.metadata_props
    pairs = zip(json.loads(props[LINEAGE_NAMES]), json.loads(props[LINEAGE_TYPES]), strict=True)
    names, types = zip(*dict.fromkeys(pairs), strict=True)
    props[LINEAGE_NAMES], props[LINEAGE_TYPES] = json.dumps(names), json.dumps(types)
    if graph is not None and all(node.name != names[0] for node in graph):
        einsum.name = names[0]


def _absorbed(equation: str, index: int, perm: list[int]) -> str | None:
    """The equation with operand ``index`` read before Transpose(perm): its labels permuted
    back. None for an equation with an ellipsis or without an explicit output."""
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    operands = inputs.split(",")
    labels = operands[index]
    if len(labels) != len(perm):
        return None
    before = [""] * len(perm)
    for position, axis in enumerate(perm):
        before[axis] = labels[position]
    operands[index] = "".join(before)
    return f"{','.join(operands)}->{output}"


@register_pass
class TransposeEinsumFusionPass(FusionPass):
    """Not a pattern: each Einsum operand is judged alone."""

    spec = PassSpec(
        name="TransposeEinsumFusionPass",
        category=Category.UB,
        description="Einsum of a Transpose read only there -> the Einsum of the Transpose's "
        "input, its labels permuted back (a fused op's output moved back to the layout an "
        "Einsum reads: XLNet's sequence-first attention)",
        aliases=("transpose_einsum_fusion",),
        priority=5965,  # the down band, after the Einsums are restored
        emits=("Einsum",),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for einsum in ctx.op_index.of_type(model.graph, "Einsum"):
            # each operand's Transpose in turn: a second run finds none left
            while einsum.graph is model.graph and (fused := self._absorb(ctx, einsum)):
                einsum = fused

    @staticmethod
    def _absorb(ctx: PassContext, einsum: ir.Node) -> ir.Node | None:
        """The Einsum with its first absorbable operand Transpose absorbed, if it has one."""
        for index, operand in enumerate(einsum.inputs):
            transpose = operand.producer() if operand is not None else None
            if transpose is None or transpose.op_type != "Transpose":
                continue
            if transpose.domain not in ("", "ai.onnx"):
                continue
            if operand.is_graph_output() or len(operand.uses()) != 1:  # type: ignore[union-attr]
                continue
            perm = transpose_perm(transpose, len(ctx.shape(operand) or ()) or None)
            formula = _absorbed(einsum.attributes.get_string("equation", ""), index, perm or [])
            if perm is None or formula is None:
                continue
            inputs = list(einsum.inputs)
            inputs[index] = transpose.inputs[0]
            fused = ir.node("Einsum", inputs, attributes={"equation": formula})
            fused.outputs[0].dtype = einsum.outputs[0].dtype
            fused.outputs[0].shape = einsum.outputs[0].shape
            refused = replace_subgraph(
                ctx,
                "TransposeEinsum",
                einsum,
                [einsum, transpose],
                [fused],
                einsum.outputs,
                fused.outputs,
            )
            return None if refused is not None else fused
        return None
