"""Canonical form: a variance as the mean square less the squared mean, written centred.

Flax's LayerNorm (its default, ``use_fast_variance``) computes the variance as
``mean(x * x) - mean(x) ** 2``, clamped at 0 because rounding can make it negative; jax2onnx
writes it so, with a ``Max(variance, 0)``. The norm passes read a variance as the mean of the
centred value squared, ``mean((x - mean(x)) ** 2)``, and found no norm in any layer of a Flax
transformer. The two are the same quantity: the raw-moment one is written centred, on the
centring the norm already computes where it has one, and the clamp goes (a mean of squares is
never negative). The centred form is the more accurate (no cancellation between two large
means): a reassociating rewrite.

MindSpore writes a layer norm's variance as ``ReduceSumSquare(x - mean) / n``, n the count of
the elements summed: a mean, and it is written as one (``ReduceSum(x) / n`` too), where the
reduced sizes are static and n is their product.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_scalar,
    new_reduce_mean,
    node_axes,
    node_label,
    producer_of,
    remove_dead,
    replace_subgraph,
    squared,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass

_PATTERN = "RawMomentVariance"


class _Declined(Exception):
    """A raw-moment candidate that is not a variance, with the reason the report gives."""


def _kept_axes(ctx: PassContext, reduction: ir.Node) -> tuple[int, ...]:
    """The axes a Reduce* reduces and keeps (every axis where none are given), negative where
    its input's rank is known; raises _Declined where it drops them or its axes are unknown."""
    if reduction.attributes.get_int("keepdims", 1) != 1:
        raise _Declined("a mean does not keep its axes")
    x = reduction.inputs[0]
    shape = ctx.shape(x) if x is not None else None
    axes = node_axes(reduction)
    if axes is None and len(reduction.inputs) > 1 and reduction.inputs[1] is not None:
        raise _Declined("a mean's axes are computed at run time")
    if not axes:  # none given: every axis, unless the op then reduces nothing
        if reduction.attributes.get_int("noop_with_empty_axes", 0) or shape is None:
            raise _Declined("a mean reduces no known axes")
        axes = list(range(len(shape)))
    if shape is not None:
        if not all(-len(shape) <= a < len(shape) for a in axes):
            raise _Declined("a mean's axes are out of its input's rank")
        axes = [a % len(shape) - len(shape) for a in axes]
    return tuple(sorted(set(axes)))


def _variance(ctx: PassContext, difference: ir.Node) -> tuple[ir.Value, ir.Node, ir.Node] | None:
    """(x, the mean of x, the mean of x squared) where ``difference`` is ``mean(x * x) -
    mean(x) * mean(x)``; None where it is no such difference (most Subs); raises _Declined
    where it nearly is."""
    second = producer_of(difference.inputs[0], "ReduceMean")
    first = producer_of(squared(_producer(difference.inputs[1])), "ReduceMean")
    x = squared(_producer(second.inputs[0])) if second is not None else None
    if second is None or first is None or x is None:
        return None
    if first.inputs[0] is not x:
        raise _Declined("the squared mean is not of the value whose square is averaged")
    if _kept_axes(ctx, first) != _kept_axes(ctx, second):
        raise _Declined("the two means average different axes")
    return x, first, second


def _producer(value: ir.Value | None) -> ir.Node | None:
    return value.producer() if value is not None else None


def _clamp(difference: ir.Node) -> ir.Node | None:
    """The ``Max(variance, 0)``, ``Relu(variance)`` or ``Clip(variance, 0)`` (no upper bound)
    that alone reads the difference."""
    value = difference.outputs[0]
    readers = [user for user, _ in value.uses()]
    if len(readers) != 1 or value.is_graph_output():
        return None
    (reader,) = readers
    if reader.domain not in ("", "ai.onnx"):
        return None
    if reader.op_type == "Relu":
        return reader
    if reader.op_type == "Clip" and reader.inputs[0] is value:  # torch's clamp(min=0)
        low = reader.inputs[1] if len(reader.inputs) > 1 else None
        high = reader.inputs[2] if len(reader.inputs) > 2 else None
        if low is None and high is None:  # before opset 11: the bounds are attributes
            bounded = "max" in reader.attributes
            return None if bounded or reader.attributes.get_float("min", 1.0) != 0.0 else reader
        return reader if high is None and constant_scalar(low) == 0.0 else None
    if reader.op_type == "Max" and len(reader.inputs) == 2:
        other = reader.inputs[1] if reader.inputs[0] is value else reader.inputs[0]
        return reader if constant_scalar(other) == 0.0 else None
    return None


# The sums a count divides into a mean: op -> whether it sums squares.
_SUMS = {"ReduceSumSquare": True, "ReduceSum": False}
_MEAN = "SumOverCount"


def _count(ctx: PassContext, total: ir.Node) -> tuple[list[int], int] | None:
    """(the axes, as negative indices, and how many elements each output element adds up)
    for a Reduce* that keeps its axes, over static sizes; None otherwise."""
    shape = ctx.shape(total.inputs[0]) if total.inputs[0] is not None else None
    try:
        axes = list(_kept_axes(ctx, total))
    except _Declined:
        return None
    sizes = [shape[a] for a in axes] if shape is not None else [None]
    if not all(isinstance(size, int) for size in sizes):
        return None
    return axes, math.prod(sizes)  # type: ignore[arg-type]


def _over_count(total: ir.Node, count: int) -> ir.Node | None:
    """The Div by ``count`` (or Mul by its reciprocal) that alone reads ``total``."""
    value = total.outputs[0]
    readers = [user for user, _ in value.uses()]
    if len(readers) != 1 or value.is_graph_output() or readers[0].domain not in ("", "ai.onnx"):
        return None
    (reader,) = readers
    if reader.op_type == "Div" and reader.inputs[0] is value:
        return reader if constant_scalar(reader.inputs[1]) == count else None
    if reader.op_type == "Mul":
        factor = constant_scalar(
            reader.inputs[1] if reader.inputs[0] is value else reader.inputs[0]
        )
        return reader if factor is not None and abs(factor * count - 1) <= 1e-6 else None
    return None


@register_pass
class VarianceCanonicalizationPass(FusionPass):
    """Not a pattern: each Sub is asked whether it is a mean square less a squared mean."""

    spec = PassSpec(
        name="VarianceCanonicalizationPass",
        category=Category.GRAPH,
        description="mean(x * x) - mean(x) ** 2 (clamped at 0) -> mean((x - mean(x)) ** 2), "
        "ReduceSumSquare(d) / n -> mean(d * d): Flax's LayerNorm through jax2onnx and "
        "MindSpore's, read by the norm passes",
        aliases=("variance_canonicalization",),
        numerics=Numerics.REASSOCIATING,
        priority=3037,  # before PowerCanonicalization squares the centred value
        emits=("Sub", "Mul", "ReduceMean"),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        for op_type in _SUMS:
            for total in list(ctx.op_index.of_type(graph, op_type, ("", "ai.onnx"))):
                if total.graph is graph and total.inputs and total.inputs[0] is not None:
                    self._as_mean(ctx, graph, total)
        for difference in list(ctx.op_index.of_type(graph, "Sub", ("", "ai.onnx"))):
            if difference.graph is not graph or None in difference.inputs:
                continue
            try:
                found = _variance(ctx, difference)
            except _Declined as declined:
                ctx.pattern(_PATTERN).decline(str(declined), node_label(difference))
                continue
            if found is None:
                continue
            x, first, second = found
            mean = first.outputs[0]
            clamp = _clamp(difference)
            root = clamp or difference
            # The centring the norm computes anyway, where it has one.
            centring = next(
                (
                    user
                    for user, index in mean.uses()
                    if user.op_type == "Sub" and index == 1 and user.inputs[0] is x
                ),
                None,
            )
            nodes = [] if centring is not None else [ir.node("Sub", [x, mean])]
            centred = (centring or nodes[0]).outputs[0]
            square = ir.node("Mul", [centred, centred])
            average = ir.node(
                "ReduceMean",
                [square.outputs[0], *second.inputs[1:]],
                attributes=dict(second.attributes),
            )
            nodes += [square, average]
            dtype = ctx.dtype(difference.outputs[0])
            for node in nodes:
                typed(node.outputs[0], dtype, ctx.shape(x) if node is not average else None)
            typed(average.outputs[0], dtype, ctx.shape(root.outputs[0]))
            old = [difference] if clamp is None else [clamp, difference]
            spent = [_producer(difference.inputs[1]), second]
            refused = replace_subgraph(
                ctx, _PATTERN, root, old, nodes, root.outputs, average.outputs
            )
            if refused is None:  # the squared mean and the mean square, unless read elsewhere
                remove_dead(graph, spent)
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()

    @staticmethod
    def _as_mean(ctx: PassContext, graph: ir.Graph, total: ir.Node) -> None:
        """A sum divided by the count of what it adds up -> ReduceMean (of the squares)."""
        counted = _count(ctx, total)
        divided = _over_count(total, counted[1]) if counted is not None else None
        if counted is None or divided is None:
            return
        x = total.inputs[0]
        assert x is not None
        nodes = []
        if _SUMS[total.op_type]:
            nodes.append(ir.node("Mul", [x, x]))
            typed(nodes[0].outputs[0], ctx.dtype(x), ctx.shape(x))
            x = nodes[0].outputs[0]
        axes = "_".join(str(-a) for a in counted[0])
        name = f"{VarianceCanonicalizationPass.spec.name}/axes_{axes}"
        nodes.append(new_reduce_mean(ctx, graph, x, counted[0], name))
        output = divided.outputs[0]
        typed(nodes[-1].outputs[0], ctx.dtype(output), ctx.shape(output))
        spent = [total.inputs[1].producer()] if len(total.inputs) > 1 and total.inputs[1] else []
        replaced = replace_subgraph(
            ctx, _MEAN, divided, [divided, total], nodes, divided.outputs, nodes[-1].outputs
        )
        if replaced is None:
            remove_dead(graph, spent)
