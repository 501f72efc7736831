"""The canonical form every pattern pass sees: exporter-generic shape code made static.

Slices and Concats that change nothing once shapes are known:

Exporters write shape-generic code: ``q[..., :rotary_dim]`` and ``q[..., rotary_dim:]`` with
``rotary_dim`` read from a tensor at run time (Phi-3, partial-rotary models under the
TorchScript exporter), then ``Concat(rotated, q_pass)`` where ``q_pass`` is empty whenever the
rotary covers the whole head. Once constant folding has turned the read dimension into a
number, these are a Slice over a whole axis (the tensor itself), a Slice of nothing, and a
Concat with an empty operand. Removing them gives every later pass the canonical form (full
rotary, one tensor) instead of one more spelling to enumerate.

Reshape targets computed at run time (TorchScript: Shape -> Gather -> Unsqueeze -> Concat per
use) become constants with 0 / -1, and repeated computations are merged: the shape arithmetic
disappears instead of hiding the layouts from the fusion passes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import (
    axis_size,
    inferred_dimension,
    kept_length,
    read_size,
    same_dimension,
    same_traced_size,
    slice_operands,
    target_parts,
)
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    bypass,
    bypass_refusal,
    computation_key,
    constant_value,
    element_count,
    new_constant,
    node_label,
    remove_dead,
    replace_subgraph,
    shape_of,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass
from fusectl.rewrite.shapes import keep_proven_dims, named
from fusectl.rewrite.spread import (
    ARITHMETIC,
    BROADCASTING,
    SHAPE_KEEPING,
    splat,
    spread_sources,
    uniform,
)


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
    """The value's size along ``axis`` (negative counts from the end) when it is known before
    run time, derived through the ops that produced it."""
    producer = value.producer()
    shape = ctx.shape(value)
    if shape is None and producer is not None and producer.inputs:
        shape = ctx.shape(producer.inputs[0]) if producer.inputs[0] is not None else None
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    return axis_size(ctx, value, axis % len(shape))


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
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        if not ctx.op_index.holds(model.graph, ("Slice", "Concat")):
            return
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


@register_pass
class ReshapeTargetCanonicalizationPass(FusionPass):
    """Not a pattern: each Reshape whose target is computed at run time is judged alone."""

    spec = PassSpec(
        name="ReshapeTargetCanonicalizationPass",
        category=Category.GRAPH,
        description="Reshape targets computed from Shape -> Gather -> Concat at run time -> "
        "constant targets, with 0 for a size copied from the same position of the data and "
        "-1 for the one size left, a -1 already there counted from the element count (its "
        "sizes traced through the ops where inference left them unnamed) or bounded to 1 "
        "(the shape arithmetic goes with them)",
        aliases=("ReshapeShapeFolding",),
        priority=3030,
        emits=("Reshape",),
        canonical=True,
        # A fused op's output has the sizes its inputs prove: a target read from it becomes a
        # constant only then (LeViT after onnx-simplifier changed on a second run).
        again_after_fusions=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        if not ctx.op_index.holds(model.graph, ("Reshape",)):
            return
        for node in model.graph:
            if node.op_type != "Reshape" or node.domain != "" or len(node.inputs) < 2:
                continue
            if constant_value(node.inputs[1]) is not None:
                continue
            found = _constant_target(ctx, node)
            if found is None:
                continue
            site = node.name or "Reshape"
            if isinstance(found, str):
                ctx.pattern("ReshapeTarget").decline(found, site)
                continue
            target, dims = found
            if not ctx.may_rewrite("ReshapeTarget", site):
                continue
            ctx.pattern("ReshapeTarget").settle(site)
            graph = model.graph
            constant = new_constant(graph, f"{ctx.spec.name}/{site}/shape", target)
            computed = node.inputs[1]
            node.replace_input_with(1, constant)
            keep_proven_dims(node.outputs[0], dims)
            ctx.record_fusion("ReshapeTarget", [node], [node])
            remove_dead(graph, [computed.producer() if computed is not None else None])
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()


def _constant_target(
    ctx: PassContext, reshape: ir.Node
) -> tuple[np.ndarray, list[int | ir.SymbolicDim | None]] | str | None:
    """The run-time target of this Reshape as a constant: each size copied from a dimension
    the data has at the same position becomes 0 (allowzero=0 only), a static one its value,
    and one size left unknown -1 (the reshape keeps the element count, so that size is what
    -1 computes; a -1 the target has already is counted from the element count, where the
    symbols cancel or bounded to 1, to free it: ``flatten(1, 2)`` of a repeat, torchtune's
    view of its sliced rotary cache, SAM's head merge over windows padded at run time); why
    not when more than one size stays unknown; None when the target is not built from
    constants and sizes read with Shape. With the target, the output's dimensions as the
    computed target proved them (a size copied from another tensor keeps that tensor's
    symbol, which the constant target no longer shows; a -1 the size it counts to)."""
    data = reshape.inputs[0]
    source = ctx.shape(data) if data is not None else None
    parts = target_parts(ctx, reshape.inputs[1])
    if source is None or parts is None:
        return None
    copying_zero = not reshape.attributes.get_int("allowzero", 0)
    resolved: list[int | None] = []
    dims: list[int | ir.SymbolicDim | None] = []
    for position, part in enumerate(parts):
        if isinstance(part, int):
            resolved.append(part)
            dims.append(part if part > 0 else None)
            continue
        size = read_size(ctx, part)
        if not isinstance(size, int):  # static where the sizes traced to it cancel
            size = axis_size(ctx, *part) or size
        dims.append(size)
        if isinstance(size, int):
            resolved.append(size)
        elif (
            copying_zero
            and position < len(source)
            and (
                same_dimension(part, size, data, position, source)
                or same_traced_size(ctx, part, data, position)
            )
        ):
            resolved.append(0)
            if not isinstance(size, int) and not named(size):  # proven the same size: keep
                dims[-1] = source[position]  # the name that says more
        else:
            resolved.append(None)
    unknown = resolved.count(None)
    if unknown == 1 and -1 in resolved:
        # The -1 counted from the element count frees the -1 for the size left unknown.
        counted = inferred_dimension(ctx, reshape)
        if counted is not None:
            position = resolved.index(-1)
            resolved[position] = dims[position] = counted
    elif unknown == 0 and -1 in resolved:
        dims[resolved.index(-1)] = inferred_dimension(ctx, reshape)  # what the -1 is
    if unknown > 1 or (unknown == 1 and -1 in resolved):
        return (
            "more than one size of the target is read at run time from another tensor than "
            "the data, at another position"
        )
    target = np.array([-1 if size is None else size for size in resolved], dtype=np.int64)
    return target, dims


@register_pass
class CommonSubexpressionEliminationPass(FusionPass):
    """Exporters repeat shape arithmetic and small constants per use (TorchScript: each
    layer's own Shape -> Gather -> Unsqueeze chains and Constant nodes). Merged here, in the
    canonicalization group, before any fusion: computations on activations are left alone, so
    no fusion finds a value it would absorb suddenly shared with another site."""

    spec = PassSpec(
        name="CommonSubexpressionEliminationPass",
        category=Category.GRAPH,
        description="repeated shape arithmetic and small constants (same op, attributes and "
        "inputs) merged into one",
        aliases=("CSE", "CommonSubexpressionElimination"),
        priority=3040,
        emits=(),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        repeats = _repeats(model.graph)
        # One rewrite for the whole graph (a bisection leaves the merging out as a whole),
        # numbered only where there is something to merge.
        if not repeats or not ctx.may_rewrite("CommonSubexpression", "graph"):
            return
        graph = model.graph
        for node, first in repeats:
            for old, new in zip(node.outputs, first.outputs, strict=True):
                ir.convenience.replace_all_uses_with(old, new)
            graph.remove(node, safe=True)
        ctx.record_fusion("CommonSubexpression", [], [])
        stats = ctx.pattern("CommonSubexpression")
        stats.matched += len(repeats) - 1
        stats.effected += len(repeats) - 1


@register_pass
class LateCommonSubexpressionEliminationPass(CommonSubexpressionEliminationPass):
    """The same merging after every fusion: a fused op reading sizes again from the values that
    stay (XLNet's key length, once read from each layer's scores, is the input's sequence)
    leaves each layer's shape arithmetic computing the same thing. Nothing is fused after it,
    so no fusion can lose a value it would have absorbed; without it, a second run would merge
    them in its canonicalization."""

    spec = PassSpec(
        name="LateCommonSubexpressionEliminationPass",
        category=Category.UB,
        description="shape arithmetic and small constants the fusions leave repeated (same op, "
        "attributes and inputs) merged into one, after every fusion",
        aliases=("late_cse",),
        priority=9900,  # after every fusion
        emits=(),
    )


_SHAPE_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL})


def _repeats(graph: ir.Graph) -> list[tuple[ir.Node, ir.Node]]:
    """(repeat, first) for each node computing what an earlier node computes from the same
    inputs: small Constants, and integer shape arithmetic (every output an index type), never
    a graph output or a random op. Graph order is topological, so each first comes earlier
    and its inputs are already merged."""
    seen: dict[tuple, ir.Node] = {}
    found: list[tuple[ir.Node, ir.Node]] = []
    merged: dict[ir.Value, ir.Value] = {}
    for node in graph:
        constant = node.op_type == "Constant" and node.domain == ""
        # Types as known (declared, or inferred for an earlier pass): asking here would run
        # shape inference on graphs no pass needed it for. (First: it turns most nodes down.)
        if not constant and not all(v.dtype in _SHAPE_TYPES for v in node.outputs):
            continue
        if any(v.is_graph_output() for v in node.outputs):
            continue
        key = computation_key(node, merged)
        if key is None:  # not compared: random, a subgraph, a large constant
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            found.append((node, first))
            merged.update(zip(node.outputs, first.outputs, strict=True))
    return found


@register_pass
class BroadcastExpandEliminationPass(FusionPass):
    """Not a pattern: each Expand to another tensor's run-time shape is judged alone."""

    spec = PassSpec(
        name="BroadcastExpandEliminationPass",
        category=Category.GRAPH,
        description="Expand(x, Shape(y)) read (through element-wise ops) by an element-wise op "
        "that also reads y -> x: the op broadcasts to y's shape anyway (masked_fill with "
        "expand_as, Keras's causal mask)",
        aliases=("ExpandAsElimination",),
        priority=3035,
        emits=(),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for expand in ctx.op_index.of_type(model.graph, "Expand"):
            if expand.graph is not model.graph:
                continue
            shape = shape_of(expand.inputs[1])
            if shape is None or shape.attributes:
                continue
            first = _broadcast_reader(expand.outputs[0], shape.inputs[0])
            if first is None or expand.outputs[0].is_graph_output():
                continue
            site = expand.name or "Expand"
            if not ctx.may_rewrite("BroadcastExpand", site):
                continue
            reader, index, between = first
            reader.replace_input_with(index, expand.inputs[0])
            for value in between:  # narrower now: their shapes are inferred again
                value.shape = None
            ctx.record_fusion("BroadcastExpand", [expand], [])
            remove_dead(model.graph, [expand])
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()


def _broadcast_reader(
    value: ir.Value, target: ir.Value | None
) -> tuple[ir.Node, int, list[ir.Value]] | None:
    """(the node reading ``value``, its input index, the values on the way) when ``value`` is
    read only through element-wise ops (shape-keeping or broadcasting, each the only reader of
    the last) by a broadcasting op that also reads ``target``: the Expand to ``target``'s
    shape changes nothing that op computes, since every op on the way broadcasts too (the
    values on the way get narrower)."""
    current, reader, between = value, None, []
    for _ in range(4):
        uses = list(current.uses())
        if len(uses) != 1 or current.is_graph_output():
            return None
        node, index = uses[0]
        reader = reader or (node, index)
        if node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type in BROADCASTING and target is not None and target in node.inputs:
            return (*reader, between)
        if node.op_type not in BROADCASTING and node.op_type not in SHAPE_KEEPING:
            return None
        current = node.outputs[0]  # broadcast with others first (Keras's And of a mask)
        between.append(current)
    return None


@register_pass
class BroadcastZeroEliminationPass(FusionPass):
    """Not a pattern: each Add of a zero spread at run time is judged alone."""

    spec = PassSpec(
        name="BroadcastZeroEliminationPass",
        category=Category.GRAPH,
        description="x + zeros spread to other tensors' shapes (zeros_like(a) + zeros_like(b)"
        "), read (through Casts) by an element-wise op that reads those tensors too -> x: the "
        "op broadcasts to their shape anyway (paddle's where, as paddle2onnx writes it)",
        aliases=("ZeroBroadcastElimination",),
        priority=3036,
        emits=(),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        seen: dict[ir.Value, np.ndarray | None] = {}
        reached = _spread_readers(ctx, graph)
        for add in list(ctx.op_index.of_type(graph, "Add", ("", "ai.onnx"))):
            if add not in reached or len(add.inputs) != 2 or None in add.inputs:
                continue
            for index, zeros in enumerate(add.inputs):
                if not _is_zero(zeros, seen) or add.outputs[0].is_graph_output():  # type: ignore[arg-type]
                    continue
                if _is_zero(add.inputs[1 - index], seen):  # type: ignore[arg-type]
                    break  # the zeros' own sum, which goes once nothing reads it
                sources = spread_sources(zeros)  # type: ignore[arg-type]
                ranks = [len(shape) for shape in map(ctx.shape, sources or []) if shape]
                if not ranks:
                    break  # a constant zero (NeutralOperandElimination's), or one of rank 0
                site = node_label(add)
                found = _broadcasting_reader(add.outputs[0])
                if found is None or not _covered(sources, found[0]):
                    ctx.pattern("BroadcastZero").decline(
                        "the zeros widen the value to a shape its reader does not broadcast to",
                        site,
                    )
                    break
                if not ctx.may_rewrite("BroadcastZero", site):
                    break
                for value_on_the_way in found[1]:  # narrower now: inferred again
                    value_on_the_way.shape = None
                bypass(add, 1 - index)
                ctx.record_fusion("BroadcastZero", [add], [])
                remove_dead(graph, [zeros.producer()])  # type: ignore[union-attr]
                break
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()


def _spread_readers(ctx: PassContext, graph: ir.Graph) -> set[ir.Node]:
    """The nodes of ``graph`` that read a value spread at run time (an Expand's or a
    ConstantOfShape's, through Casts and arithmetic): where a zero spread can be added, found
    from the few spreads rather than by asking each Add of the graph."""
    pending = [
        node.outputs[0]
        for op_type in ("Expand", "ConstantOfShape")
        for node in ctx.op_index.of_type(graph, op_type, ("", "ai.onnx"))
        if node.graph is graph
    ]
    reached: set[ir.Node] = set()
    while pending:
        for user, _ in pending.pop().uses():
            if user not in reached and user.graph is graph:
                reached.add(user)
                if user.op_type in ("Cast", "Identity", *ARITHMETIC):
                    pending.append(user.outputs[0])
    return reached


def _covered(sources: list[ir.Value], reader: ir.Node) -> bool:
    """Whether ``reader`` reads each source, or what it computes with shape-keeping ops, widened
    by nothing but shape-keeping ops and Adds: its output is then no narrower than any source,
    and a zero spread to their shapes adds nothing to its shape."""
    read = {_origin(value, widening=True) for value in reader.inputs if value is not None}
    return all(_origin(source, widening=False) in read for source in sources)


def _broadcasting_reader(value: ir.Value) -> tuple[ir.Node, list[ir.Value]] | None:
    """(the broadcasting op that reads ``value`` through shape-keeping ops only, each the only
    reader of the last; the values on the way)."""
    between: list[ir.Value] = []
    for _ in range(4):
        uses = list(value.uses())
        if len(uses) != 1 or value.is_graph_output():
            return None
        node = uses[0][0]
        if node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type in BROADCASTING:
            return node, between
        if node.op_type not in SHAPE_KEEPING:
            return None
        value = node.outputs[0]
        between.append(value)
    return None


def _origin(value: ir.Value, *, widening: bool) -> ir.Value:
    """The value ``value`` is computed from by shape-keeping ops (and, ``widening``, by Adds of
    a zero spread at run time, which can only widen it)."""
    seen: dict[ir.Value, np.ndarray | None] = {}
    for _ in range(8):
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            break
        if node.op_type in SHAPE_KEEPING and node.inputs and node.inputs[0] is not None:
            value = node.inputs[0]
            continue
        if not widening or node.op_type != "Add" or len(node.inputs) != 2 or None in node.inputs:
            break
        zero = [_is_zero(operand, seen) for operand in node.inputs]  # type: ignore[arg-type]
        if zero[0] == zero[1]:
            break
        value = node.inputs[1 if zero[0] else 0]  # type: ignore[assignment]
    return value


def _is_zero(value: ir.Value, seen: dict[ir.Value, np.ndarray | None]) -> bool:
    found = splat(value, seen)
    return found is not None and found == 0


# Constants larger than this are not read to test whether their elements are all equal.
_SPLAT_ELEMENTS = 1 << 24


@register_pass
class SplatConstantCanonicalizationPass(FusionPass):
    """Not a pattern: each Where reading a constant whose elements are all equal is judged
    alone, input by input. (Only Where: a constant of one value read by arithmetic is a scale
    or a bias the fusions take as it is, or NeutralOperandElimination's.)"""

    spec = PassSpec(
        name="SplatConstantCanonicalizationPass",
        category=Category.GRAPH,
        description="a Where's constant whose elements are all equal, where its other inputs "
        "broadcast to the constant's shape or larger -> its one element: MindSpore's masked "
        "fill, Where(mask, full([2, 4, 16, 16], -1e9), scores), which the attention passes read "
        "with a scalar fill",
        aliases=("ScalarSplatConstant",),
        priority=3036,
        emits=(),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        inputs = {value.name for value in graph.inputs}
        # Asked from the few Wheres, not from every initializer (23k at 100k nodes).
        elements: dict[ir.Value, np.ndarray | None] = {}
        scalars: dict[ir.Value, ir.Value] = {}
        for where in list(ctx.op_index.of_type(graph, "Where", ("", "ai.onnx"))):
            if where.graph is not graph:
                continue
            for index, constant in enumerate(where.inputs):
                tensor = constant.const_value if constant is not None else None
                if tensor is None or constant.name in inputs or constant.is_graph_output():
                    continue
                if constant not in elements:
                    splatted = 1 < element_count(tensor) <= _SPLAT_ELEMENTS and uniform(tensor)
                    elements[constant] = splat(constant, {}) if splatted else None
                element = elements[constant]
                others = [ctx.shape(v) for i, v in enumerate(where.inputs) if i != index and v]
                if element is None or not _static_cover(others, list(tensor.shape)):
                    continue
                if not ctx.may_rewrite("SplatConstant", node_label(where)):
                    continue
                if constant not in scalars:
                    name = f"{constant.name}/element"
                    scalars[constant] = new_constant(graph, name, element)
                where.replace_input_with(index, scalars[constant])
                ctx.record_fusion("SplatConstant", [where], [where])
                if not constant.uses():
                    graph.initializers.pop(constant.name)


def _static_cover(shapes: list[ir.Shape | None], target: list[int]) -> bool:
    """Whether the broadcast of ``shapes`` has ``target``'s shape or a larger one: each axis of
    ``target`` larger than 1 is, counted from the end, that static size in one of them."""
    known = [list(shape) for shape in shapes if shape is not None]
    for offset, size in enumerate(reversed(target), 1):
        if size == 1:
            continue
        if not any(len(shape) >= offset and shape[-offset] == size for shape in known):
            return False
    return any(len(shape) >= len(target) for shape in known)
