"""Rotary embedding computed half by half, made the whole-tensor form the rotary pass reads.

GPT-OSS (and code written after the RoPE paper) rotates the two halves of a head separately:

    x1, x2 = halves of x along the last axis (Split, or two Slices)
    out = Concat(x1 * c - x2 * s, x2 * c + x1 * s, axis=-1)       c, s: [..., H/2]

which is, exactly, x * Concat(c, c) + Concat(-x2, x1) * Concat(s, s): LLaMA's rotate_half
form, which RotaryEmbeddingFusionPass proves and fuses (its caches are then c and s
themselves). Every product and sum is the same floating-point operation as before (a - b is
a + (-b)), so the rewrite is exact; the Split's halves become the rotate_half Slices.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import last_axis_slice
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_value,
    new_constant,
    node_label,
    producer_of,
    replace_subgraph,
    typed,
    uses_outside,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_DEFAULT_DOMAINS = ("", "ai.onnx")


def _products(value: ir.Value) -> list[tuple[ir.Value, ir.Value]] | None:
    """The two (a, b) operand orders of Mul(a, b) producing ``value``."""
    mul = producer_of(value, "Mul")
    if mul is None or None in mul.inputs:
        return None
    a, b = mul.inputs
    assert a is not None and b is not None
    return [(a, b), (b, a)]


def _halves(ctx: PassContext, low: ir.Value, high: ir.Value) -> tuple[ir.Value, int] | None:
    """(x, H/2) when ``low`` and ``high`` are the first and second half of x's last axis: the
    two outputs of an even Split, or Slices [0, H/2) and [H/2, H)."""
    split = low.producer()
    if split is None or split.domain not in _DEFAULT_DOMAINS:
        return None
    x = split.inputs[0]
    shape = ctx.shape(x) if x is not None else None
    if x is None or shape is None or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    half, rank = shape[-1] // 2, len(shape)
    if split.op_type == "Split":
        sizes = constant_value(split.inputs[1]) if len(split.inputs) > 1 else None
        even = sizes is None or [int(v) for v in np.ravel(sizes)] == [half, half]
        if (
            split.attributes.get_int("axis", 0) % rank == rank - 1
            and list(split.outputs) == [low, high]
            and even
        ):
            return x, half
        return None
    other = high.producer()
    if split.op_type != "Slice" or other is None or other.op_type != "Slice":
        return None
    if other.inputs[0] is not x:
        return None
    ranges = [last_axis_slice(node, rank) for node in (split, other)]
    if None in ranges:
        return None
    clamped = [(start, min(end, 2 * half)) for start, end in ranges]  # type: ignore[misc]
    return (x, half) if clamped == [(0, half), (half, 2 * half)] else None


def _rotation(
    ctx: PassContext, concat: ir.Node
) -> tuple[ir.Value, int, ir.Value, ir.Value, list[ir.Node]] | str | None:
    """(x, H/2, c, s, matched nodes) of Concat(x1*c - x2*s, x2*c + x1*s) on the last axis;
    why not, where it is that sum of products but x1, x2 are not the halves of one x."""
    if len(concat.inputs) != 2 or None in concat.inputs:
        return None
    first, second = concat.inputs
    assert first is not None and second is not None
    sub, add = producer_of(first, "Sub"), producer_of(second, "Add")
    if sub is None or add is None or None in (*sub.inputs, *add.inputs):
        return None
    minuend, subtrahend = (_products(v) for v in sub.inputs)  # type: ignore[arg-type]
    summands = [_products(v) for v in add.inputs]  # type: ignore[arg-type]
    if minuend is None or subtrahend is None or None in summands:
        return None
    for x1, c in minuend:
        for x2, s in subtrahend:
            for left, right in (summands, summands[::-1]):
                assert left is not None and right is not None
                if (x2, c) not in left or (x1, s) not in right:
                    continue
                halves = _halves(ctx, x1, x2)
                if halves is None:
                    return (
                        "the rotated parts are not the two halves of one tensor's last axis "
                        "(every second element, say: RotaryEmbedding would interleave the "
                        "output too)"
                    )
                muls = [v.producer() for v in (*sub.inputs, *add.inputs)]
                return halves[0], halves[1], c, s, [concat, sub, add, *muls]  # type: ignore[list-item]
    return None


@register_pass
class RotaryHalvesCanonicalizationPass(FusionPass):
    spec = PassSpec(
        name="RotaryHalvesCanonicalizationPass",
        category=Category.GRAPH,
        description="rotary embedding computed half by half, Concat(x1*c - x2*s, x2*c + x1*s) "
        "(GPT-OSS) -> x * Concat(c, c) + Concat(-x2, x1) * Concat(s, s), the rotate_half form "
        "RotaryEmbeddingFusionPass reads",
        aliases=("RotaryHalvesToRotateHalf",),
        priority=3045,
        canonical=True,
        emits=("Concat", "Neg", "Slice", "Mul", "Add"),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("RotaryHalves")
        graph = model.graph
        for concat in ctx.op_index.of_type(graph, "Concat", _DEFAULT_DOMAINS):
            if concat.graph is not graph:
                continue
            found = _rotation(ctx, concat)  # op types first: most Concats fail there
            if found is None:
                continue
            rank = len(shape) if (shape := ctx.shape(concat.outputs[0])) is not None else None
            if rank is None or concat.attributes.get_int("axis", 0) % rank != rank - 1:
                continue
            if isinstance(found, str):
                stats.decline(found, node_label(concat))
                continue
            x, half, c, s, nodes = found
            reason = uses_outside(nodes, concat.outputs)
            for angle in (c, s):
                angle_shape = ctx.shape(angle)
                if angle_shape is None or len(angle_shape) != rank or angle_shape[-1] != half:
                    reason = reason or "cos / sin do not span the half head on the last axis"
            if reason is not None:
                stats.decline(reason, node_label(concat))
                continue
            built = self._whole(ctx, graph, concat, x, half, c, s)
            replace_subgraph(
                ctx, "RotaryHalves", concat, nodes, built, concat.outputs, built[-1].outputs
            )

    def _whole(
        self,
        ctx: PassContext,
        graph: ir.Graph,
        concat: ir.Node,
        x: ir.Value,
        half: int,
        c: ir.Value,
        s: ir.Value,
    ) -> list[ir.Node]:
        """x * Concat(c, c) + Concat(-x[..., H/2:], x[..., :H/2]) * Concat(s, s)."""
        name = f"{self.spec.name}/{node_label(concat)}"

        def ints(suffix: str, values: list[int]) -> ir.Value:
            return new_constant(graph, f"{name}/{suffix}", np.array(values, np.int64))

        last, middle = ints("axis", [-1]), ints("half", [half])
        low = ir.node("Slice", [x, ints("zero", [0]), middle, last])
        high = ir.node("Slice", [x, middle, ints("end", [2 * half]), last])
        negated = ir.node("Neg", [high.outputs[0]])
        turned = ir.node("Concat", [negated.outputs[0], low.outputs[0]], attributes={"axis": -1})
        cos = ir.node("Concat", [c, c], attributes={"axis": -1})
        sin = ir.node("Concat", [s, s], attributes={"axis": -1})
        direct = ir.node("Mul", [x, cos.outputs[0]])
        rotated = ir.node("Mul", [turned.outputs[0], sin.outputs[0]])
        total = ir.node("Add", [direct.outputs[0], rotated.outputs[0]])
        dtype, shape = ctx.dtype(x), ctx.shape(x)
        for node in (low, high, negated):
            halved = None if shape is None else ir.Shape([*list(shape)[:-1], half])
            typed(node.outputs[0], dtype, halved)
        for node in (turned, direct, rotated, total):
            typed(node.outputs[0], dtype, shape)
        for node, angle in ((cos, c), (sin, s)):
            angle_shape = ctx.shape(angle)
            assert angle_shape is not None
            typed(node.outputs[0], ctx.dtype(angle), ir.Shape([*list(angle_shape)[:-1], 2 * half]))
        return [low, high, negated, turned, cos, sin, direct, rotated, total]
