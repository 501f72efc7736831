"""Canonical layout: Slices and Concats that change nothing once shapes are known.

Exporters write shape-generic code: ``q[..., :rotary_dim]`` and ``q[..., rotary_dim:]`` with
``rotary_dim`` read from a tensor at run time (Phi-3, partial-rotary models under the
TorchScript exporter), then ``Concat(rotated, q_pass)`` where ``q_pass`` is empty whenever the
rotary covers the whole head. Once constant folding has turned the read dimension into a
number, these are a Slice over a whole axis (the tensor itself), a Slice of nothing, and a
Concat with an empty operand. Removing them gives every later pass the canonical form (full
rotary, one tensor) instead of one more spelling to enumerate.
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.axes import kept_length, slice_operands
from fusectl.context import PassContext
from fusectl.patterns import bypass, bypass_refusal, replace_subgraph, typed
from fusectl.registry import Category, FusionPass, PassSpec, register_pass


def _sliced_lengths(ctx: PassContext, node: ir.Node) -> list[tuple[int, int, bool]] | None:
    """For each sliced axis of a Slice: (axis, length kept, whether it keeps the axis whole
    in order), where the axis has a static size; None if any of that is unknown."""
    data = node.inputs[0]
    shape = ctx.shape(data) if data is not None else None
    if shape is None:
        return None
    operands = slice_operands(node, len(shape))
    if operands is None:
        return None
    lengths = []
    for axis, start, end, step in operands:
        size = shape[axis]
        if not isinstance(size, int):
            return None
        kept = kept_length(start, end, step, size)
        lengths.append((axis, kept, step == 1 and kept == size))
    return lengths


def _static_length(ctx: PassContext, value: ir.Value, axis: int) -> int | None:
    """The value's size along ``axis`` when it is known before run time."""
    producer = value.producer()
    if producer is not None and producer.op_type == "Slice" and producer.domain == "":
        lengths = _sliced_lengths(ctx, producer)
        shape = ctx.shape(producer.inputs[0]) if lengths else None
        if lengths and shape is not None:
            axis %= len(shape)
            kept = dict((a, n) for a, n, _ in lengths)
            if axis in kept:
                return kept[axis]
            size = shape[axis]
            return size if isinstance(size, int) else None
    shape = ctx.shape(value)
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    size = shape[axis]
    return size if isinstance(size, int) else None


@register_pass
class NoOpSliceConcatEliminationPass(FusionPass):
    """Not a pattern: each Slice and Concat is judged alone, by the shapes around it."""

    spec = PassSpec(
        name="NoOpSliceConcatEliminationPass",
        category=Category.GRAPH,
        description="Slices that keep a whole tensor, empty Concat operands and one-operand "
        "Concats removed (shape-generic exporter code made canonical)",
        aliases=("SliceConcatCanonicalization",),
        priority=3020,
        emits=(),
        canonical=True,
    )

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for node in model.graph:
            if node.domain != "":
                continue
            if node.op_type == "Slice":
                self._whole_slice(ctx, node)
            elif node.op_type == "Concat":
                self._concat(ctx, node)
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()

    @staticmethod
    def _whole_slice(ctx: PassContext, node: ir.Node) -> None:
        lengths = _sliced_lengths(ctx, node)
        if not lengths or not all(whole for _, _, whole in lengths):
            return
        site = node.name or "Slice"
        reason = bypass_refusal(node)
        if reason is not None:
            ctx.pattern("WholeSlice").decline(reason, site)
        elif ctx.may_rewrite("WholeSlice", site):
            bypass(node)
            ctx.record_fusion("WholeSlice", [node], [])

    @staticmethod
    def _concat(ctx: PassContext, node: ir.Node) -> None:
        """Concat(a, empty, ...) -> Concat(a, ...); a Concat left with one operand -> it."""
        axis = node.attributes.get_int("axis", 0)
        kept = [v for v in node.inputs if v is None or _static_length(ctx, v, axis) != 0]
        if (len(kept) == len(node.inputs) and len(kept) != 1) or not kept or None in kept:
            return
        pattern = "EmptyConcatOperand" if len(kept) < len(node.inputs) else "SingleOperandConcat"
        if len(kept) == 1:
            replacement = ir.node("Identity", kept)
        else:
            replacement = ir.node("Concat", kept, attributes={"axis": axis})
        output = replacement.outputs[0]
        typed(output, node.outputs[0].dtype, node.outputs[0].shape)
        replace_subgraph(ctx, pattern, node, [node], [replacement], node.outputs, [output])
