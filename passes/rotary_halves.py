"""Rotary embedding computed half by half, made the whole-tensor form the rotary pass reads.

GPT-OSS (and code written after the RoPE paper) rotates the two halves of a head separately:

    x1, x2 = halves of x along the last axis (Split, or two Slices)
    out = Concat(x1 * c - x2 * s, x2 * c + x1 * s, axis=-1)       c, s: [..., H/2]

which is, exactly, x * Concat(c, c) + Concat(-x2, x1) * Concat(s, s): LLaMA's rotate_half
form, which RotaryEmbeddingFusionPass proves and fuses (its caches are then c and s
themselves). Every product and sum is the same floating-point operation as before (a - b is
a + (-b)), so the rewrite is exact; the Split's halves become the rotate_half Slices.

x1 and x2 need not be halves: any two equal parts that take each element of x's last axis
once will do, since then they are the halves of x[..., order] for one fixed order. DeepSeek
rotates x[..., 0::2] and x[..., 1::2] this way; one Gather puts x in that order first.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import last_axis_positions
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    lossless,
    new_constant,
    node_label,
    producer_of,
    replace_subgraph,
    typed,
    uses_outside,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass


def _products(value: ir.Value) -> list[tuple[ir.Value, ir.Value]] | None:
    """The two (a, b) operand orders of Mul(a, b) producing ``value``."""
    mul = producer_of(value, "Mul")
    if mul is None or None in mul.inputs:
        return None
    a, b = mul.inputs
    assert a is not None and b is not None
    return [(a, b), (b, a)]


def _widened_parts(
    ctx: PassContext, low: ir.Value, high: ir.Value
) -> tuple[ir.Value, ir.Value, ir.DataType | None, list[ir.Node]]:
    """The parts behind one widening Cast each, to one type (a float16 partial rotary whose
    halves are cast to float32 one by one: dots.llm3), with that type and the Casts; else
    the parts themselves. Casting the whole of x converts the same elements, exactly."""
    casts = [producer_of(part, "Cast") for part in (low, high)]
    if casts[0] is None or casts[1] is None or None in (casts[0].inputs[0], casts[1].inputs[0]):
        return low, high, None, []
    types = {ir.DataType(cast.attributes.get_int("to", 0)) for cast in casts}  # type: ignore[union-attr]
    sources = [cast.inputs[0] for cast in casts]  # type: ignore[union-attr]
    to = types.pop() if len(types) == 1 else None
    if to is None or any(not lossless(ctx.dtype(v), to) for v in sources):  # type: ignore[arg-type]
        return low, high, None, []
    return sources[0], sources[1], to, casts  # type: ignore[return-value]


def _selection(
    ctx: PassContext, low: ir.Value, high: ir.Value
) -> tuple[ir.Value, list[int], ir.DataType | None, list[ir.Node]] | None:
    """(x, order, cast, casts) where ``low`` and ``high`` are equal parts of x's last axis
    that together take every element once: x[..., order] is Concat(low, high), each part
    possibly widened to ``cast`` by its own Cast (``casts``). The two halves (an even Split,
    two Slices) take them in order; DeepSeek's x[..., 0::2] and x[..., 1::2] do not."""
    low, high, to, casts = _widened_parts(ctx, low, high)
    parts = [last_axis_positions(ctx, part) for part in (low, high)]
    if parts[0] is None or parts[1] is None or parts[0][0] is not parts[1][0]:
        return None
    x, order = parts[0][0], parts[0][1] + parts[1][1]
    size = ctx.shape(x)[-1]  # type: ignore[index]  (static: last_axis_positions proved it)
    if len(parts[0][1]) != len(parts[1][1]) or sorted(order) != list(range(size)):
        return None
    return x, order, to, casts


_Rotation = tuple[ir.Value, list[int], ir.DataType | None, ir.Value, ir.Value, list[ir.Node]]


def _rotation_in(ctx: PassContext, concat: ir.Node) -> tuple[int, _Rotation | str] | None:
    """(i, rotation) for the first two adjacent Concat inputs i, i+1 that are one; a nested
    cat (TorchScript flattens DeepSeek's Concat(q_pass, Concat(rotated halves))) counts."""
    inputs = list(concat.inputs)
    for index, (first, second) in enumerate(itertools.pairwise(inputs)):
        found = None if first is None or second is None else _rotation(ctx, first, second)
        if found is not None:
            return index, found
    return None


def _rotation(ctx: PassContext, first: ir.Value, second: ir.Value) -> _Rotation | str | None:
    """(x, order, cast, c, s, matched nodes) of the two Concat parts x1*c - x2*s and
    x2*c + x1*s, x1 and x2 the two parts of x[..., order] (each cast to ``cast`` where not
    None); why not, where it is that sum of products but x1, x2 are not such parts of one x."""
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
                selection = _selection(ctx, x1, x2)
                if selection is None:
                    return (
                        "the rotated parts are not one tensor's last axis taken in two equal "
                        "parts, each element once"
                    )
                x, order, to, casts = selection
                muls = [v.producer() for v in (*sub.inputs, *add.inputs)]
                return x, order, to, c, s, [sub, add, *muls, *casts]  # type: ignore[list-item]
    return None


@register_pass
class RotaryHalvesCanonicalizationPass(FusionPass):
    spec = PassSpec(
        name="RotaryHalvesCanonicalizationPass",
        category=Category.GRAPH,
        description="rotary embedding computed half by half, Concat(x1*c - x2*s, x2*c + x1*s) "
        "(GPT-OSS; DeepSeek's even and odd elements after one Gather) -> "
        "x * Concat(c, c) + Concat(-x2, x1) * Concat(s, s), the rotate_half form "
        "RotaryEmbeddingFusionPass reads",
        aliases=("RotaryHalvesToRotateHalf",),
        priority=3045,
        canonical=True,
        emits=("Gather", "Concat", "Neg", "Slice", "Mul", "Add"),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("RotaryHalves")
        graph = model.graph
        for concat in ctx.op_index.of_type(graph, "Concat", DEFAULT_DOMAINS):
            if concat.graph is not graph:
                continue
            located = _rotation_in(ctx, concat)  # op types first: most Concats fail there
            if located is None:
                continue
            index, found = located
            rank = len(shape) if (shape := ctx.shape(concat.outputs[0])) is not None else None
            if rank is None or concat.attributes.get_int("axis", 0) % rank != rank - 1:
                continue
            if isinstance(found, str):
                stats.decline(found, node_label(concat))
                continue
            x, order, to, c, s, nodes = found
            half = len(order) // 2
            reason = uses_outside([concat, *nodes], concat.outputs)
            for angle in (c, s):
                angle_shape = ctx.shape(angle)
                if angle_shape is None or len(angle_shape) != rank or angle_shape[-1] != half:
                    reason = reason or "cos / sin do not span the half head on the last axis"
            if reason is not None:
                stats.decline(reason, node_label(concat))
                continue
            built = self._whole(ctx, graph, concat, x, order, to, c, s)
            if len(concat.inputs) > 2:  # the other parts around the rotation stay
                parts = list(concat.inputs)
                parts[index : index + 2] = [built[-1].outputs[0]]
                whole = ir.node("Concat", parts, attributes={"axis": -1})
                built.append(whole)
                typed(whole.outputs[0], ctx.dtype(concat.outputs[0]), shape)
            replace_subgraph(
                ctx,
                "RotaryHalves",
                concat,
                [concat, *nodes],
                built,
                concat.outputs,
                built[-1].outputs,
            )

    def _whole(
        self,
        ctx: PassContext,
        graph: ir.Graph,
        concat: ir.Node,
        source: ir.Value,
        order: list[int],
        to: ir.DataType | None,
        c: ir.Value,
        s: ir.Value,
    ) -> list[ir.Node]:
        """x * Concat(c, c) + Concat(-x[..., H/2:], x[..., :H/2]) * Concat(s, s), where x is
        the source with its last axis in ``order`` (a Gather, unless that is the identity),
        cast to ``to`` first where the parts were (widening is exact, and commutes with the
        moves)."""
        name = f"{self.spec.name}/{node_label(concat)}"
        half = len(order) // 2

        def ints(suffix: str, values: list[int]) -> ir.Value:
            return new_constant(graph, f"{name}/{suffix}", np.array(values, np.int64))

        dtype, shape = ctx.dtype(source), ctx.shape(source)
        ordered: list[ir.Node] = []
        if to is not None:
            widen = ir.node("Cast", [source], attributes={"to": to})
            ordered, dtype = [widen], to
            source = typed(widen.outputs[0], to, shape)
        x = source
        if order != sorted(order):
            gather = ir.node("Gather", [source, ints("order", order)], attributes={"axis": -1})
            ordered, x = [*ordered, gather], typed(gather.outputs[0], dtype, shape)

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
        for node in (low, high, negated):
            halved = None if shape is None else ir.Shape([*list(shape)[:-1], half])
            typed(node.outputs[0], dtype, halved)
        for node in (turned, direct, rotated, total):
            typed(node.outputs[0], dtype, shape)
        for node, angle in ((cos, c), (sin, s)):
            angle_shape = ctx.shape(angle)
            assert angle_shape is not None
            typed(node.outputs[0], ctx.dtype(angle), ir.Shape([*list(angle_shape)[:-1], 2 * half]))
        return [*ordered, low, high, negated, turned, cos, sin, direct, rotated, total]
