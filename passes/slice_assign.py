"""Slice assignment into a tensor, made the Concat it is.

PyTorch code fills a tensor part by part; DeepSeek-V3 builds its attention key as

    key = k_nope.new_empty(...); key[..., :a].copy_(k_nope); key[..., a:].copy_(k_rot)

and TorchScript writes each assignment as ``ScatterND(data, indices, updates)`` whose index
grid is computed from shapes at run time (Range, Expand, Unsqueeze, Concat). Whatever spells
the grid, it is evaluated at two sets of probe sizes (fusectl.rewrite.evaluate). Where it is
every position of ``data`` with one axis kept to a constant range [a, b) (b may be the axis's
end), in row-major order, the ScatterND is ``Concat(data[.., :a], updates, data[.., b:])`` on
that axis: data movement, exact. A part of ``data`` that is itself such a Concat's part is taken
from it directly, so a tensor filled completely keeps no Slice of what it started as, and the
attention passes then see the key for what it is. Where ``data`` is computed (not a tensor made
to be filled) and a part of it beside the range stays, the ScatterND stays too: Slices of it
around the new part would be more nodes for nothing a fusion reads.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.evaluate import (
    Unevaluable,
    dimension_names,
    evaluate,
    probe_shape,
    probes,
    run_node,
)
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    constant_value,
    new_constant,
    node_label,
    producer_of,
    replace_subgraph,
    transpose_perm,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_INT64_MAX = np.iinfo(np.int64).max
_END = -1  # the range runs to the axis's end, whatever its size


def _box(indices: np.ndarray, shape: list[int]) -> tuple[int, int, int] | None:
    """(axis, a, b) when ``indices`` is the row-major grid of every position of a tensor of
    ``shape`` with one axis kept to [a, b); b is _END where the range reaches the end. Indices
    of m < rank elements address the first m axes, the rest whole (dynamo's slice_scatter)."""
    depth = indices.shape[-1] if indices.ndim else 0
    if not 0 < depth <= len(shape) or indices.ndim != depth + 1:
        return None
    grid, addressed = list(indices.shape[:-1]), shape[:depth]
    narrowed = [axis for axis in range(depth) if grid[axis] != addressed[axis]]
    if len(narrowed) > 1 or 0 in grid:
        return None
    axis = narrowed[0] if narrowed else depth - 1
    start = int(indices.reshape(-1, depth)[0, axis])
    if start < 0:  # a negative index counts from the end: -1, 0, 1 wraps, it is no range
        return None
    ranges = [np.arange(size) for size in grid]
    ranges[axis] = ranges[axis] + start
    expected = np.stack(np.meshgrid(*ranges, indexing="ij"), axis=-1)
    if not np.array_equal(indices, expected):
        return None
    end = start + grid[axis]
    return axis, start, _END if end == addressed[axis] else end


def _shapers(updates: ir.Value) -> list[ir.Node]:
    """The Reshapes and Expands the updates come out of, outermost first: TorchScript expands
    the source to the assigned part's shape and reshapes it to the grid's, each target read
    from shapes at run time."""
    chain: list[ir.Node] = []
    node = updates.producer()
    while node is not None and node.op_type in ("Reshape", "Expand") and len(node.inputs) > 1:
        if node.domain not in DEFAULT_DOMAINS or node.inputs[0] is None or node.inputs[1] is None:
            break
        chain.append(node)
        node = node.inputs[0].producer()
    return chain


def _keeps_shape(ctx: PassContext, node: ir.Node, probe: dict[str, int]) -> bool:
    """Whether the Reshape or Expand gives its data's own shape at these probe sizes (run on
    zeros of that shape, so its 0, -1 and broadcast rules are the op's own)."""
    data, target = node.inputs[0], node.inputs[1]
    assert data is not None and target is not None
    try:
        shape = probe_shape(ctx, data, probe)
        sizes = evaluate(ctx, target, {}, probe)
        result = run_node(node, [np.zeros(shape, np.float32), sizes], ctx.opset)
    except Exception:  # Unevaluable, or the reference's own error where the sizes do not fit
        return False
    return result is not None and list(result[0].shape) == shape


def _assigned_range(
    ctx: PassContext, scatter: ir.Node
) -> tuple[tuple[int, int, int], ir.Value] | str:
    """((axis, a, b), source): the range the ScatterND writes, the same at both probes, and
    the updates without the Reshapes and Expands on them that keep the shape at both; or why
    not."""
    data, indices, updates = scatter.inputs[0], scatter.inputs[1], scatter.inputs[2]
    assert data is not None and indices is not None and updates is not None
    shapers = _shapers(updates)
    found = set()
    try:
        names = dimension_names(ctx, indices, [data])
        for node in shapers:
            names += dimension_names(ctx, node.inputs[1], [node.inputs[0]])  # type: ignore[arg-type]
        sized = probes(list(dict.fromkeys(names)))
        if isinstance(sized, str):
            return f"the index grid's sizes cannot be probed: {sized}"
        kept = len(shapers)
        for probe in sized:
            box = _box(evaluate(ctx, indices, {}, probe), probe_shape(ctx, data, probe))
            if box is None:
                return "the indices are not every position of one constant range of one axis"
            found.add(box)
            kept = next(
                (i for i, node in enumerate(shapers[:kept]) if not _keeps_shape(ctx, node, probe)),
                kept,
            )
    except Unevaluable as why:
        return f"the indices cannot be evaluated: {why}"
    if len(found) != 1:
        return "the assigned range depends on the sizes"
    source = shapers[kept - 1].inputs[0] if kept else updates
    assert source is not None
    return found.pop(), source


def _behind_cancelling_transposes(value: ir.Value) -> ir.Value:
    """The tensor ``value`` is, behind Transposes that together move nothing (dynamo moves the
    assigned axis first for ScatterND and back after)."""
    if value.shape is None:
        return value
    rank = len(value.shape)
    order = list(range(rank))
    source = value
    while (node := producer_of(source, "Transpose")) is not None and node.inputs[0] is not None:
        perm = transpose_perm(node, rank)
        if perm is None:
            break
        order = [perm[axis] for axis in order]
        source = node.inputs[0]
        if order == sorted(order):
            value = source
    return value


def _joined_parts(
    ctx: PassContext, data: ir.Value, axis: int, bounds: tuple[int, int]
) -> list[ir.Value] | None:
    """data[.., lo:hi, ..] on ``axis`` (hi _END: to the end) as parts of the Concat on that
    axis that data is, where the range falls on their boundaries."""
    lo, hi = bounds
    concat = _behind_cancelling_transposes(data).producer()
    if concat is None or concat.op_type != "Concat" or concat.domain not in DEFAULT_DOMAINS:
        return None
    rank = len(ctx.shape(data))  # type: ignore[arg-type]
    widths = [ctx.shape(part) for part in concat.inputs if part is not None]
    static = [w[axis] if w is not None and len(w) == rank else None for w in widths]
    same_axis = concat.attributes.get_int("axis", 0) % rank == axis
    if not same_axis or None in concat.inputs or not all(isinstance(w, int) for w in static):
        return None
    edges = np.cumsum([0, *static]).tolist()
    end = edges[-1] if hi == _END else hi
    if lo not in edges or end not in edges:
        return None
    return [part for part in concat.inputs[edges.index(lo) : edges.index(end)] if part]


def _fresh(value: ir.Value) -> bool:
    """Whether ``value`` is a tensor made to be filled: a ConstantOfShape or a constant, maybe
    expanded, reshaped, transposed or cast (``new_empty``, ``new_zeros``, dynamo's moved axis)."""
    node = value.producer()
    while node is not None and node.op_type in ("Expand", "Reshape", "Transpose", "Cast"):
        if node.inputs[0] is None:
            return False
        value, node = node.inputs[0], node.inputs[0].producer()
    return constant_value(value) is not None or (
        node is not None and node.op_type == "ConstantOfShape"
    )


def _slice(
    ctx: PassContext, graph: ir.Graph, name: str, data: ir.Value, axis: int, bounds: tuple[int, int]
) -> ir.Node:
    """A new Slice data[.., lo:hi, ..] on ``axis`` (hi _END: to the end)."""
    lo, hi = bounds
    starts = new_constant(graph, f"{name}/starts_{lo}", np.array([lo], np.int64))
    ends = new_constant(
        graph, f"{name}/ends_{hi}", np.array([_INT64_MAX if hi == _END else hi], np.int64)
    )
    axes = new_constant(graph, f"{name}/axes", np.array([axis], np.int64))
    node = ir.node("Slice", [data, starts, ends, axes])
    shape = ctx.shape(data)
    if shape is not None:
        size = shape[axis]
        end = size if hi == _END else hi
        dims = list(shape)
        dims[axis] = end - lo if isinstance(end, int) else None
        shape = ir.Shape(dims)
    typed(node.outputs[0], ctx.dtype(data), shape)
    return node


@register_pass
class SliceAssignmentCanonicalizationPass(FusionPass):
    spec = PassSpec(
        name="SliceAssignmentCanonicalizationPass",
        category=Category.GRAPH,
        description="slice assignment x[..., a:b] = y (TorchScript's ScatterND with an index "
        "grid computed from shapes, evaluated at probe sizes) -> Concat(x[..., :a], y, "
        "x[..., b:]) on that axis, taking a Concat's own parts where the range meets them",
        aliases=("ScatterNDToConcat",),
        priority=3034,
        canonical=True,
        emits=("Concat", "Slice", "Identity"),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("SliceAssignment")
        graph = model.graph
        for scatter in ctx.op_index.of_type(graph, "ScatterND", DEFAULT_DOMAINS):
            if scatter.graph is not graph or None in scatter.inputs[:3]:
                continue
            data = scatter.inputs[0]
            assert data is not None
            shape = ctx.shape(data)
            if scatter.attributes.get_string("reduction", "none") != "none" or shape is None:
                continue
            found = _assigned_range(ctx, scatter)
            if isinstance(found, str):
                stats.decline(found, node_label(scatter))
                continue
            (axis, lo, hi), source = found
            ranges = ([(0, lo)] if lo > 0 else []) + ([(hi, _END)] if hi != _END else [])
            kept = {r: _joined_parts(ctx, data, axis, r) for r in ranges}
            if not all(kept.values()) and not _fresh(data):
                stats.decline(
                    "the tensor assigned into is computed and keeps a part beside the range: "
                    "a Slice of it each side is no fewer nodes than the ScatterND",
                    node_label(scatter),
                )
                continue
            name = f"{self.spec.name}/{node_label(scatter)}"
            built: list[ir.Node] = []
            parts: dict[tuple[int, int], list[ir.Value]] = {}
            for bounds, joined in kept.items():
                if joined is None:
                    built.append(_slice(ctx, graph, name, data, axis, bounds))
                    joined = list(built[-1].outputs)
                parts[bounds] = joined
            ordered = [*parts.get((0, lo), []), source, *parts.get((hi, _END), [])]
            if len(ordered) == 1:  # the whole tensor assigned
                result = ir.node("Identity", ordered)
            else:
                result = ir.node("Concat", ordered, attributes={"axis": axis})
            typed(result.outputs[0], ctx.dtype(data), shape)
            built.append(result)
            replace_subgraph(
                ctx,
                "SliceAssignment",
                scatter,
                [scatter],
                built,
                scatter.outputs,
                result.outputs,
            )
