"""What shape and layout ops do to axes: static sizes derived through the ops that produced a
value, where onnx shape inference does not know them (contrib ops on the way, shapes computed
at run time). Passes use it to prove a layout ([batch, heads, length, head size]) from what the
graph computes rather than from one exporter's spelling."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_value,
    node_axes,
    producer_of,
    shape_of,
    transpose_perm,
)
from fusectl.rewrite.shapes import named
from fusectl.rewrite.sizes import Size, of_dim, product, quotient

MS = "com.microsoft"
_INT64_MAX = np.iinfo(np.int64).max


def slice_operands(node: ir.Node, rank: int) -> list[tuple[int, int, int, int]] | None:
    """(axis, start, end, step) for every sliced axis, if all are constants."""
    if len(node.inputs) >= 3:  # opset 10+: starts, ends, axes, steps as inputs
        operands = [*node.inputs[1:], None, None][:4]
        starts, ends = constant_value(operands[0]), constant_value(operands[1])
        axes = constant_value(operands[2]) if operands[2] is not None else None
        steps = constant_value(operands[3]) if operands[3] is not None else None
        if starts is None or ends is None:
            return None
        given = zip(operands[2:], (axes, steps), strict=True)
        if any(value is not None and array is None for value, array in given):
            return None
    else:
        starts = node.attributes.get_ints("starts", None)
        ends = node.attributes.get_ints("ends", None)
        axes = node.attributes.get_ints("axes", None)
        steps = None
        if starts is None or ends is None:
            return None
    starts, ends = np.ravel(starts).tolist(), np.ravel(ends).tolist()
    axes = np.ravel(axes).tolist() if axes is not None else list(range(len(starts)))
    steps = np.ravel(steps).tolist() if steps is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps) or 0 in steps:
        return None
    return [
        (int(axis) % rank, int(start), int(end), int(step))
        for axis, start, end, step in zip(axes, starts, ends, steps, strict=True)
    ]


def last_axis_slice(node: ir.Node, rank: int, step: int = 1) -> tuple[int, int] | None:
    """(start, end) of a Slice of one axis, the last, with this step (ends not clamped)."""
    sliced = slice_operands(node, rank)
    if sliced is None or len(sliced) != 1 or sliced[0][0] != rank - 1 or sliced[0][3] != step:
        return None
    return sliced[0][1], sliced[0][2]


def kept_length(start: int, end: int, step: int, size: int) -> int:
    """How many elements ONNX Slice keeps of an axis of ``size`` (Python's slice clamps the
    same way, INT64_MAX ends included)."""
    return len(range(*slice(start, min(end, _INT64_MAX), step).indices(size)))


def shape_element(ctx: PassContext, value: ir.Value, index: int, depth: int = 8) -> int | None:
    """Element ``index`` of a 1-D integer tensor that spells a shape, where it is a constant:
    through Concat, Reshape, Unsqueeze, TorchScript's Where(Equal(s, -1), 1, s) and sizes
    copied from a tensor whose size there is static (a whole ``Shape(x)`` included)."""
    array = constant_value(value)
    if array is not None:
        flat = array.reshape(-1)
        known = array.dtype.kind in "iu" and 0 <= index < flat.size
        return int(flat[index]) if known else None
    node = value.producer()
    if node is None or depth == 0 or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in ("Reshape", "Unsqueeze", "Identity"):  # the elements in the same order
        return shape_element(ctx, node.inputs[0], index, depth - 1)
    if node.op_type == "Concat":
        for part in node.inputs:
            size = ctx.shape(part)
            if size is None or len(size) != 1 or not isinstance(size[0], int):
                return None
            if index < size[0]:
                return shape_element(ctx, part, index, depth - 1)
            index -= size[0]
        return None
    if node.op_type == "Where":  # -1 (keep the dim) becomes 1: only the other elements count
        test = producer_of(node.inputs[0], "Equal")
        minus = constant_value(test.inputs[1]) if test is not None else None
        if test is None or test.inputs[0] is not node.inputs[2] or minus is None:
            return None
        element = shape_element(ctx, node.inputs[2], index, depth - 1)
        return element if bool(np.all(minus == -1)) and element != -1 else None
    copied = copied_dimensions(value)
    if copied is not None:  # sizes read from a tensor at run time: static there, perhaps
        return axis_size(ctx, *copied[index], depth - 1) if 0 <= index < len(copied) else None
    if node.op_type in ("Mul", "Div") and len(node.inputs) == 2 and None not in node.inputs:
        left, right = (_broadcast_element(ctx, v, index, depth - 1) for v in node.inputs)  # type: ignore[arg-type]
        if left is None or right is None:
            return None
        if node.op_type == "Mul":
            return left * right
        return left // right if right > 0 and left % right == 0 else None
    return None


def _broadcast_element(ctx: PassContext, value: ir.Value, index: int, depth: int) -> int | None:
    """Element ``index`` of an operand of an element-wise op on shape tensors: its only
    element where it holds one (a scalar broadcasts)."""
    shape = ctx.shape(value)
    single = shape is not None and (len(shape) == 0 or (len(shape) == 1 and shape[0] == 1))
    return shape_element(ctx, value, 0 if single else index, depth)


# Ops whose (first) output has their first input's shape: unary element-wise ops, softmaxes,
# scatters (their data's shape), Clip (its bounds are scalars).
_SAME_SHAPE = frozenset(
    {"Neg", "Cast", "Relu", "Identity", "Sqrt", "Exp", "Softmax", "Tanh"}
    | {"Abs", "Reciprocal", "Sigmoid", "Erf", "Log", "Sin", "Cos", "Floor", "Ceil", "Round"}
    | {"Sign", "Not", "IsNaN", "IsInf", "Softplus", "Softsign", "Elu", "Selu", "Celu"}
    | {"LeakyRelu", "HardSigmoid", "HardSwish", "Mish", "Gelu", "LogSoftmax", "Clip"}
    | {"ScatterND", "ScatterElements"}
    # quantized models: output 0 is the input's shape (DynamicQuantizeLinear's scale and zero
    # point are outputs 1 and 2)
    | {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}
)
# Ops whose first output has their first input's shape beyond the element-wise ones: the norms
# (onnxruntime's contrib RotaryEmbedding too, the one contrib op axis_size reads through).
_SHAPE_KEEPING = frozenset({"LayerNormalization", "RMSNormalization", "RotaryEmbedding"})
# Matrix products: MatMulInteger's inputs 2 and 3 are zero points, not operands.
_MATMULS = frozenset({"MatMul", "MatMulInteger"})
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Pow"})


def axis_size(ctx: PassContext, value: ir.Value, axis: int, depth: int = 12) -> int | None:
    """The static size of one axis of ``value``, derived from what produced it where shape
    inference does not know it (contrib ops on the way, shapes computed at run time): through
    element-wise ops, broadcasting, Concat, Slice, Split, Transpose, Reshape targets and
    onnxruntime's shape-preserving contrib ops (RotaryEmbedding); else the size traced as a
    product (symbolic_size) where its named factors cancel: ViTDet's TorchScript head split
    ``reshape(3, B*N, H*W, -1)`` counts its -1 from sizes multiplied at run time."""
    size = _walked_size(ctx, value, axis, depth)
    if size is not None:
        return size
    traced = symbolic_size(ctx, value, axis)
    return traced[0] if traced is not None and not traced[1] and traced[0] > 0 else None


def _walked_size(ctx: PassContext, value: ir.Value, axis: int, depth: int = 12) -> int | None:
    """axis_size through the ops that produced the value, step by step."""
    shape = ctx.shape(value)
    if shape is not None and not -len(shape) <= axis < len(shape):
        return None
    if shape is not None and isinstance(shape[axis], int):
        return int(shape[axis])
    node = value.producer()
    if node is None or depth == 0:
        return None
    op, contrib = node.op_type, node.domain == MS
    if node.domain not in ("", "ai.onnx") and not (contrib and op == "RotaryEmbedding"):
        return None
    inputs = [v for v in node.inputs if v is not None]
    same = (op in _SAME_SHAPE or op in _SHAPE_KEEPING) and value is node.outputs[0]
    if shape is None and (same or op == "Slice") and inputs:
        shape = ctx.shape(inputs[0])  # these keep their input's rank
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    rank = len(shape)
    axis %= rank
    if same:
        return _walked_size(ctx, inputs[0], axis, depth - 1)
    if op in _BROADCASTING:
        sizes = []
        for operand in inputs:
            operand_shape = ctx.shape(operand)
            if operand_shape is None:
                return None
            position = axis - (rank - len(operand_shape))
            if position >= 0:
                sizes.append(_walked_size(ctx, operand, position, depth - 1))
        known = {size for size in sizes if size is not None and size != 1}
        return known.pop() if len(known) == 1 else None
    if op == "Concat":
        if node.attributes.get_int("axis", 0) % rank != axis:
            return _walked_size(ctx, inputs[0], axis, depth - 1)
        parts = [_walked_size(ctx, part, axis, depth - 1) for part in inputs]
        return None if None in parts else sum(parts)  # type: ignore[arg-type]
    if op == "Transpose":
        perm = transpose_perm(node, rank)
        return _walked_size(ctx, inputs[0], perm[axis], depth - 1)
    if op == "Slice":
        operands = slice_operands(node, rank)
        if operands is None:
            return None
        bounds = {a: (start, end, step) for a, start, end, step in operands}
        size = _walked_size(ctx, inputs[0], axis, depth - 1)
        if axis not in bounds or size is None:
            return size
        return kept_length(*bounds[axis], size)
    if op == "Split":
        return _split_size(ctx, node, value, axis, rank, depth)
    if op == "Tile" and len(inputs) == 2:
        size, times = (
            _walked_size(ctx, inputs[0], axis, depth - 1),
            shape_element(ctx, inputs[1], axis, max(depth, 8)),
        )
        return size * times if size is not None and times is not None else None
    if op == "Reshape":
        # The target's walk shares this one's reach: a size it copies from a tensor may be
        # as far up as the walk to this Reshape (a per-head norm between the head split and
        # the key's repeat).
        element = shape_element(ctx, inputs[1], axis, max(depth, 8))
        if element == 0 and not node.attributes.get_int("allowzero", 0):
            return _walked_size(ctx, inputs[0], axis, depth - 1)
        if element == -1:  # an axis size is all it answers: the sizes may also be traced
            return inferred_dimension(ctx, node)
        return element if element is not None and element > 0 else None
    return None


def _split_size(
    ctx: PassContext, node: ir.Node, value: ir.Value, axis: int, rank: int, depth: int
) -> int | None:
    """One output's size along an axis of Split: its constant part on the split axis (the
    split input or attribute, else an even share), the data's size on the others."""
    whole = axis_size(ctx, node.inputs[0], axis, depth - 1)
    if node.attributes.get_int("axis", 0) % rank != axis:
        return whole
    index = list(node.outputs).index(value)
    parts = constant_value(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    if parts is None and "split" in node.attributes:
        parts = np.array(node.attributes.get_ints("split"))
    if parts is not None:
        return int(parts.reshape(-1)[index])
    count = len(node.outputs)
    return whole // count if whole is not None and whole % count == 0 else None


@dataclass(frozen=True)
class Selection:
    """``value`` is ``data`` with only ``positions`` of its static axis ``axis`` kept, in this
    order; ``kept`` is False where the axis goes with them (a Gather of one scalar index)."""

    data: ir.Value
    axis: int
    positions: list[int]
    kept: bool = True


def axis_positions(ctx: PassContext, value: ir.Value) -> Selection | None:
    """Which positions of which axis ``value`` keeps of the tensor it is selected from. Split
    outputs, Slices of one axis (any step) and Gathers of constant indices are all such
    selections; a pass reads which elements it gets, not the op."""
    node = value.producer()
    data = node.inputs[0] if node is not None and node.inputs else None
    shape = ctx.shape(data) if data is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or data is None or shape is None:
        return None
    rank = len(shape)
    if node.op_type == "Split":
        axis = node.attributes.get_int("axis", 0) % rank
        size = shape[axis]
        sizes = [_split_size(ctx, node, output, axis, rank, 8) for output in node.outputs]
        known = [part for part in sizes if part is not None]
        if not isinstance(size, int) or len(known) != len(sizes) or sum(known) != size:
            return None
        index = list(node.outputs).index(value)
        start = sum(known[:index])
        return Selection(data, axis, list(range(start, start + known[index])))
    if node.op_type == "Slice":
        operands = slice_operands(node, rank)
        if operands is None or len(operands) != 1 or not isinstance(shape[operands[0][0]], int):
            return None
        axis, start, end, step = operands[0]
        kept = range(*slice(start, min(end, _INT64_MAX), step).indices(shape[axis]))  # type: ignore[arg-type]
        return Selection(data, axis, list(kept))
    if node.op_type == "Gather":
        axis = node.attributes.get_int("axis", 0) % rank
        size = shape[axis]
        indices = constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
        if (
            not isinstance(size, int)
            or indices is None
            or indices.ndim > 1
            or not np.all((-size <= indices) & (indices < size))
        ):
            return None
        positions = [int(index) % size for index in indices.reshape(-1)]
        return Selection(data, axis, positions, kept=indices.ndim == 1)
    return None


def last_axis_positions(ctx: PassContext, value: ir.Value) -> tuple[ir.Value, list[int]] | None:
    """(x, positions): ``value`` is x with only these positions of its static last axis kept,
    in this order (axis_positions, of the last axis, the axis kept)."""
    selection = axis_positions(ctx, value)
    shape = ctx.shape(selection.data) if selection is not None else None
    if selection is None or shape is None or not selection.kept:
        return None
    if selection.axis != len(shape) - 1:
        return None
    return selection.data, selection.positions


# The perm that moves [B, S, N, H] heads to [B, N, S, H] and back.
HEADS_PERM = [0, 2, 1, 3]


def head_split(ctx: PassContext, x: ir.Value) -> tuple[ir.Node, ir.Node] | None:
    """(Reshape, Transpose) when x = Transpose(Reshape(X [B,S,N*H], [B,S,N,H]), [0,2,1,3]).

    The Reshape must keep X's batch and sequence axes and only split the last one: a Reshape
    of [B, S*N, H] to [B, S, N, H] has the same ranks, but X's rows are not the positions."""
    transpose = producer_of(x, "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != HEADS_PERM:
        return None
    reshape = producer_of(transpose.inputs[0], "Reshape")
    if reshape is None or reshape.inputs[0] is None:
        return None
    before, after = ctx.shape(reshape.inputs[0]), ctx.shape(reshape.outputs[0])
    if before is None or after is None or len(before) != 3 or len(after) != 4:
        return None
    if not (same_dim(before[0], after[0]) and same_dim(before[1], after[1])):
        return None
    return reshape, transpose


def repeat_kv(value: ir.Value | None) -> tuple[ir.Value, list[ir.Node]] | None:
    """(kv, [Unsqueeze, Expand, Reshape]) where ``value`` is transformers' repeat_kv of kv,
    Reshape(Expand(Unsqueeze(kv, 2), ..), ..): the ops only; what they repeat the caller
    proves from the sizes."""
    reshape = producer_of(value, "Reshape")
    expand = producer_of(reshape.inputs[0], "Expand") if reshape is not None else None
    unsqueeze = producer_of(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if unsqueeze is None or unsqueeze.inputs[0] is None or node_axes(unsqueeze) != [2]:
        return None  # its axes an input, or before opset 13 an attribute
    assert reshape is not None and expand is not None
    return unsqueeze.inputs[0], [unsqueeze, expand, reshape]


def inferred_dimension(ctx: PassContext, reshape: ir.Node) -> int | None:
    """The size a Reshape infers for its -1: the data's element count over the target's other
    sizes, where the symbolic sizes cancel (the target copies them from the data with
    Shape -> Gather, or with 0); or 1 where the data provably holds no more elements than
    the other sizes multiply to (_at_most_the_rest); or the same count over sizes traced
    through the ops where inference left them unnamed (_traced_count)."""
    data, target = reshape.inputs[0], reshape.inputs[1]
    source, parts = ctx.shape(data), target_parts(ctx, target)
    if source is None or parts is None or parts.count(-1) != 1:
        return None
    counted = _counted_dimension(ctx, reshape, source, parts)
    if counted is None and _at_most_the_rest(ctx, data, source, parts):  # type: ignore[arg-type]
        return 1
    return counted if counted is not None else _traced_count(ctx, reshape)


def _at_most_the_rest(ctx: PassContext, data: ir.Value, source: ir.Shape, parts: list) -> bool:
    """Whether ``data`` holds at most as many elements as the target's sizes other than its -1
    multiply to, so that the -1 is 1 wherever the Reshape runs: the data is a Slice from 0,
    step 1, along one axis to a size read at run time that the target holds too (torchtune
    views its rotary cache, sliced to the sequence length, as [-1, L, 1, H/2, 2]: at most L
    rows), its other sizes static and multiplying to at most the target's static ones."""
    node = data.producer()
    if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx"):
        return False
    operands = [*node.inputs[1:], None, None][:4]
    if len(node.inputs) < 3 or operands[0] is None or operands[1] is None:
        return False
    starts = constant_value(operands[0])
    axes = constant_value(operands[2]) if operands[2] is not None else None
    steps = constant_value(operands[3]) if operands[3] is not None else np.ones(1, np.int64)
    ends = copied_dimensions(operands[1])
    if starts is None or steps is None or ends is None or len(ends) != 1:
        return False
    if starts.size != 1 or int(starts.reshape(-1)[0]) != 0 or int(steps.reshape(-1)[0]) != 1:
        return False
    if operands[2] is not None and (axes is None or axes.size != 1):
        return False
    axis = int(axes.reshape(-1)[0]) % len(source) if axes is not None else 0
    end = read_size(ctx, ends[0])
    ours = [
        i
        for i, p in enumerate(parts)
        if isinstance(p, tuple) and (p == ends[0] or same_dim(read_size(ctx, p), end))
    ]
    if not ours:
        return False
    others = [
        read_size(ctx, p) if isinstance(p, tuple) else p
        for i, p in enumerate(parts)
        if i != ours[0] and p != -1
    ]
    sliced = ctx.shape(node.inputs[0]) if node.inputs[0] is not None else None
    if sliced is None or len(sliced) != len(source):
        return False
    rest = [size for i, size in enumerate(sliced) if i != axis]  # the Slice keeps them
    if not all(isinstance(p, int) and p > 0 for p in others):
        return False
    if not all(isinstance(size, int) for size in rest):
        return False
    return int(np.prod(rest, dtype=np.int64)) <= int(np.prod(others, dtype=np.int64))


def read_size(ctx: PassContext, read: tuple[ir.Value, int]) -> int | ir.SymbolicDim | None:
    """The size a target part ``(value, axis)`` reads at run time, as the value's shape says;
    None where the shape or the axis is unknown."""
    shape = ctx.shape(read[0])
    return shape[read[1]] if shape is not None and -len(shape) <= read[1] < len(shape) else None


def _counted_dimension(
    ctx: PassContext, reshape: ir.Node, source: ir.Shape, parts: list
) -> int | None:
    """inferred_dimension by the element count, where the symbolic sizes cancel."""
    return _count(
        reshape, parts, [of_dim(dim) for dim in source], lambda read: of_dim(read_size(ctx, read))
    )


def _traced_count(ctx: PassContext, reshape: ir.Node) -> int | None:
    """A Reshape's -1 by the element count, every size traced (symbolic_size) where shape
    inference left it unnamed: a key projection plus a short convolution of itself (Inkling's
    TorchScript export) has [?, ?, 32] from inference, [batch, sequence, 32] traced; SAM's
    TorchScript vision encoder merges heads of windows padded at run time with a -1."""
    data, source = reshape.inputs[0], ctx.shape(reshape.inputs[0])
    parts = target_parts(ctx, reshape.inputs[1])
    if source is None or parts is None or parts.count(-1) != 1:
        return None
    sizes = [symbolic_size(ctx, data, axis) for axis in range(len(source))]  # type: ignore[arg-type]
    return _count(reshape, parts, sizes, lambda read: symbolic_size(ctx, *read))


def _count(
    reshape: ir.Node,
    parts: list,
    sizes: list[Size | None],
    read: Callable[[tuple[ir.Value, int]], Size | None],
) -> int | None:
    """A Reshape's -1: the data's element count (``sizes``, one per axis) over the target's
    other parts (a 0 copies the data's size there, a (value, axis) is ``read``), where the
    symbolic sizes cancel one for one; None where one is unknown or left over."""
    copying_zero = not reshape.attributes.get_int("allowzero", 0)
    known: Size | None = (1, ())
    for index, part in enumerate(parts):
        if part == -1:
            continue
        if part == 0 and copying_zero and index < len(sizes):
            size = sizes[index]
        elif isinstance(part, tuple):  # a size copied from some value's shape
            size = read(part)
        else:
            size = (part, ()) if part > 0 else None
        known = product(known, size)
    total = functools.reduce(product, sizes, (1, ()))
    left = quotient(total, known)
    return left[0] if left is not None and not left[1] else None


def target_parts(ctx: PassContext, target: ir.Value, depth: int = 4) -> list | None:
    """A Reshape or Expand target element by element: an int, or (value, axis) for a size read
    from a value's shape at run time (a run of its sizes, Concat of Unsqueeze(Gather(Shape(value),
    axis)), a Concat of such Concats read as one), looked at through views of it (TorchScript
    flattens the Concat with a Reshape to [-1]) and through TorchScript's -1 test of expand
    sizes."""
    array = constant_value(target)
    if array is not None:
        return [int(v) for v in array.reshape(-1)]
    where = producer_of(target, "Where")
    if where is not None and depth > 0:
        return _selected_parts(ctx, where, depth - 1)
    whole = copied_dimensions(target)  # another tensor's shape (TorchScript's broadcast_to)
    if whole is not None:
        return whole
    concat = producer_of(_viewed(target), "Concat")
    if concat is None or depth == 0 or concat.attributes.get_int("axis", 0) not in (0, -1):
        return None
    parts: list = []
    for part in concat.inputs:
        array = constant_value(part) if part is not None else None
        if array is not None:
            parts += [int(v) for v in array.reshape(-1)]
            continue
        copied = copied_dimensions(part)
        if copied is None and producer_of(part, "Concat") is not None:
            copied = target_parts(ctx, part, depth - 1)  # type: ignore[arg-type]
        if copied is None:
            return None
        parts += copied
    return parts


def _selected_parts(ctx: PassContext, where: ir.Node, depth: int) -> list | None:
    """target_parts of Where(Equal(s, c), t, s) with c and t constants, element by element:
    t's element where s's is c, else s's; a size read at run time is never a negative c
    (TorchScript writes ``expand(sizes)`` as Where(Equal(sizes, -1), 1, sizes))."""
    equal = producer_of(where.inputs[0], "Equal")
    sizes = where.inputs[2] if len(where.inputs) == 3 else None
    if equal is None or sizes is None or sizes not in equal.inputs:
        return None
    flag_input = equal.inputs[1] if equal.inputs[0] is sizes else equal.inputs[0]
    flag = constant_value(flag_input) if flag_input is not None else None
    taken = constant_value(where.inputs[1]) if where.inputs[1] is not None else None
    parts = target_parts(ctx, sizes, depth)
    if flag is None or taken is None or parts is None:
        return None
    try:
        flags = np.broadcast_to(flag.reshape(-1), (len(parts),))
        takens = np.broadcast_to(taken.reshape(-1), (len(parts),))
    except ValueError:
        return None
    selected: list = []
    for part, c, t in zip(parts, flags, takens, strict=True):
        if isinstance(part, int):
            selected.append(int(t) if part == c else part)
        elif c < 0:
            selected.append(part)
        else:
            return None
    return selected


def same_dimension(
    copied: tuple[ir.Value, int],
    size: int | ir.SymbolicDim | None,
    data: ir.Value,
    position: int,
    source: ir.Shape,
) -> bool:
    """Whether a size read from ``copied`` is, at run time, the data's size at ``position``:
    read from that very axis, or named alike (a name onnx shape inference did not make up)."""
    value, axis = copied
    if value is data and axis % len(source) == position:
        return True
    mine = source[position]
    return named(size) and isinstance(mine, ir.SymbolicDim) and mine.value == size.value  # type: ignore[union-attr]


def same_traced_size(
    ctx: PassContext, copied: tuple[ir.Value, int], data: ir.Value, position: int
) -> bool:
    """Whether a size read from ``copied`` is the data's at ``position``, the two traced to
    one product of named dimensions (symbolic_size) where inference named them apart: a fused
    op's output keeps a batch inference made up before the fusion (BEAM's gate viewed as the
    attention output's whole shape), Gemma 3n's expand_as of a sliced stream."""
    traced = symbolic_size(ctx, *copied)
    return traced is not None and traced == symbolic_size(ctx, data, position)


def same_dim(a: int | ir.SymbolicDim | None, b: int | ir.SymbolicDim | None) -> bool:
    """Equal sizes, or one named symbol (an unnamed dim proves nothing: ir compares it equal
    to any other unnamed one); an unknown size (None) equals nothing."""
    if isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim):
        return a.value is not None and a.value == b.value
    return isinstance(a, int) and isinstance(b, int) and a == b


def keeps_leading(
    ctx: PassContext, reshape: ir.Node, before: ir.Shape, after: ir.Shape, count: int
) -> bool:
    """Whether the Reshape keeps its data's first ``count`` sizes: the same size or name on
    both sides, or a target element 0 that copies it."""
    target = reshape.inputs[1]
    copying = not reshape.attributes.get_int("allowzero", 0) and target is not None

    def copied(axis: int) -> bool:
        return copying and shape_element(ctx, target, axis) == 0  # type: ignore[arg-type]

    return all(same_dim(before[axis], after[axis]) or copied(axis) for axis in range(count))


def copied_dimensions(value: ir.Value | None) -> list[tuple[ir.Value, int]] | None:
    """[(x, i), (x, i+1), ...] when ``value`` is a run of x's sizes: one copied size (below),
    Shape(x, start, end) (the end x's rank unless given, where that is known), or
    Slice(Shape(x), start, end) with constant bounds on axis 0 and step 1 (``x.flatten(2)``:
    the leading sizes kept); any of them viewed through ops that keep the elements in order
    (paddle2onnx reads one size as Unsqueeze(Reshape(Squeeze(Slice(Shape(x))), []))."""
    found = _copied_run(value)
    viewed = _viewed(value)
    return found if found is not None or viewed is value else _copied_run(viewed)


# Ops whose output holds their first input's elements in the same order.
_VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _viewed(value: ir.Value | None) -> ir.Value | None:
    """The value a chain of views (_VIEWS) of ``value`` starts from."""
    node = value.producer() if value is not None else None
    while (
        node is not None
        and node.op_type in _VIEWS
        and node.domain in ("", "ai.onnx")
        and node.inputs
        and node.inputs[0] is not None
    ):
        value = node.inputs[0]
        node = value.producer()
    return value


def _copied_run(value: ir.Value | None) -> list[tuple[ir.Value, int]] | None:
    """copied_dimensions without looking through views."""
    single = _copied_dimension(value)
    if single is not None:
        return [single]
    picked = _gathered_dimensions(value)
    if picked is not None:
        return picked
    shape = producer_of(value, "Shape")
    slice_ = producer_of(value, "Slice")
    if slice_ is not None and len(slice_.inputs) >= 3:
        shape = producer_of(slice_.inputs[0], "Shape")
        if shape is None or shape.attributes.get_int("start", 0) != 0:
            return None
        if shape.attributes.get_int("end", None) is not None:
            return None
        bounds = [constant_value(v) if v is not None else None for v in slice_.inputs[1:5]]
        start, end = bounds[0], bounds[1]
        axes = bounds[2] if len(bounds) > 2 else None
        steps = bounds[3] if len(bounds) > 3 else None
        if start is None or end is None or start.size != 1 or end.size != 1:
            return None
        if (axes is not None and int(axes.reshape(-1)[0]) != 0) or (
            steps is not None and int(steps.reshape(-1)[0]) != 1
        ):
            return None
        first, last = int(start.reshape(-1)[0]), int(end.reshape(-1)[0])
    elif shape is not None:
        first = shape.attributes.get_int("start", 0)
        last = shape.attributes.get_int("end", None)
    else:
        return None
    data = shape.inputs[0]
    if data is None or data.shape is None:  # the bounds are read against the rank
        return None
    rank = len(data.shape)
    last = rank if last is None else last
    first, last = (min(max(b + rank if b < 0 else b, 0), rank) for b in (first, last))
    return [(data, axis) for axis in range(first, last)] if last > first else None


def _gathered_dimensions(value: ir.Value | None) -> list[tuple[ir.Value, int]] | None:
    """[(x, i), (x, j), ...] for Gather(Shape(x), [i, j, ...]), the Shape possibly cast to
    another integer type: tf2onnx's batch axes of an einsum, read together to be multiplied,
    and the leading axes of a Keras Dense layer's tensordot."""
    gather = producer_of(value, "Gather")
    shape = shape_of(gather.inputs[0]) if gather is not None else None
    if shape is None or shape.inputs[0] is None or shape.inputs[0].shape is None:
        return None
    index = constant_value(gather.inputs[1])  # type: ignore[union-attr]
    if index is None or index.ndim != 1 or shape.attributes.get_int("start", 0) != 0:
        return None
    rank = len(shape.inputs[0].shape)
    if shape.attributes.get_int("end", rank) != rank or not all(-rank <= i < rank for i in index):
        return None
    return [(shape.inputs[0], int(i) % rank) for i in index]


def _copied_dimension(value: ir.Value | None) -> tuple[ir.Value, int] | None:
    """(x, i) when ``value`` is x's size along axis i as a 1-element tensor: Gather(Shape(x), i)
    unsqueezed (TorchScript), or Shape(x, start=i, end=i+1) (dynamo)."""
    sliced = producer_of(value, "Shape")
    if sliced is not None and sliced.inputs[0] is not None:
        start = sliced.attributes.get_int("start", 0)
        end = sliced.attributes.get_int("end", None)
        return (sliced.inputs[0], start) if start >= 0 and end == start + 1 else None
    unsqueeze = producer_of(value, "Unsqueeze")
    gather = producer_of(unsqueeze.inputs[0] if unsqueeze else value, "Gather")
    shape = producer_of(gather.inputs[0], "Shape") if gather is not None else None
    index = constant_value(gather.inputs[1]) if gather is not None else None
    if shape is None or index is None or index.size != 1 or shape.inputs[0] is None:
        return None
    if shape.attributes.get_int("start", 0) != 0:
        return None
    return shape.inputs[0], int(index.reshape(-1)[0])


def symbolic_size(ctx: PassContext, value: ir.Value, axis: int, depth: int = 48) -> Size | None:
    """One axis's size as a product of static sizes and named dimensions, traced through the
    ops that produced it where shape inference made up a name (TorchScript's run-time Reshape
    targets): two axes of equal products have equal sizes at run time.

    The walk reaches as deep as the model (the last layer's query size is the input's batch),
    so each answer is kept for the pass (``ctx.sizes``): a None with the depth it was sought
    at, as more depth may find it."""
    shape = ctx.shape(value)
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    dim = shape[axis]
    if isinstance(dim, int) or named(dim):
        return of_dim(dim)
    if value.is_graph_input():  # a size nothing names but the input it is given with
        return 1, (input_axis_name(value, axis),)
    key = (value, axis)
    known = ctx.sizes.get(key)
    if known is not None and (known[0] is not None or known[1] >= depth):
        return known[0]
    size = _traced_size(ctx, value, axis, shape, depth)
    ctx.sizes[key] = (size, depth)
    return size


def input_axis_name(value: ir.Value, axis: int) -> str:
    """The name symbolic sizes give a graph input's axis that has no name of its own (tf2onnx
    writes ``unk__N``, which reads as made up by shape inference)."""
    return f"{value.name}:{axis}"


def _traced_size(
    ctx: PassContext, value: ir.Value, axis: int, shape: ir.Shape, depth: int
) -> Size | None:
    """symbolic_size of an axis shape inference left unnamed, from the op that produced it."""
    node = value.producer()
    if node is None or depth == 0:
        return None
    inputs = list(node.inputs)
    standard = node.domain in ("", "ai.onnx")
    matrices = standard and node.op_type == "MatMul"  # its batch axes broadcast, not the last two
    if standard and (node.op_type in _BROADCASTING or (matrices and axis < len(shape) - 2)):
        for operand in inputs:  # sizes agree or are 1: the first other than 1
            operand_shape = ctx.shape(operand) if operand is not None else None
            position = axis - len(shape) + len(operand_shape) if operand_shape else -1
            if operand is None or position < 0 or (matrices and position >= len(operand_shape) - 2):
                continue
            size = symbolic_size(ctx, operand, position, depth - 1)
            if size is not None and size != (1, ()):
                return size
        return None
    if standard and node.op_type == "Reshape" and None not in inputs[:2]:
        return _reshaped_size(ctx, node, axis, len(shape), depth - 1)
    if standard and node.op_type == "Expand" and None not in inputs[:2]:
        return _expanded_size(ctx, node, axis, len(shape), depth - 1)
    if standard and node.op_type == "ConstantOfShape" and inputs and inputs[0] is not None:
        return _element_size(ctx, inputs[0], axis, depth - 1)
    joined = standard and node.op_type == "Concat" and None not in inputs
    if joined and node.attributes.get_int("axis", 0) % len(shape) != axis:
        for part in inputs:  # every part has the size off the joined axis: any that says
            size = symbolic_size(ctx, part, axis, depth - 1)  # type: ignore[arg-type]
            if size is not None:
                return size
        return None
    if joined:  # the joined axis: the parts' sizes added, where each is static
        sizes = [symbolic_size(ctx, part, axis, depth - 1) for part in inputs]  # type: ignore[arg-type]
        if any(size is None or size[1] for size in sizes):
            return None
        return sum(size[0] for size in sizes), ()  # type: ignore[index]
    if standard and node.op_type == "Split" and inputs and inputs[0] is not None:
        part = _split_size(ctx, node, value, axis, len(shape), 1)  # a constant part, if one
        if part is not None:
            return part, ()
    if standard and node.op_type == "Tile" and None not in inputs[:2] and len(inputs) == 2:
        times = shape_element(ctx, inputs[1], axis)  # type: ignore[arg-type]
        size = symbolic_size(ctx, inputs[0], axis, depth - 1) if times is not None else None  # type: ignore[arg-type]
        return (size[0] * times, size[1]) if size is not None else None  # type: ignore[operator]
    if standard and node.op_type == "GatherElements" and len(inputs) > 1 and inputs[1]:
        return symbolic_size(ctx, inputs[1], axis, depth - 1)  # the indices' shape
    # Ops that copy the size: one path, followed at no cost in depth (a residual stream runs
    # through every layer before it reaches a named size), to the first size it is known by.
    chain = size_sources(ctx, value, axis)
    for source, index in chain[1:]:
        found = ctx.shape(source)[index]  # type: ignore[index]
        if isinstance(found, int) or named(found):
            return of_dim(found)
    return symbolic_size(ctx, *chain[-1], depth - 1) if len(chain) > 1 else None


def size_sources(ctx: PassContext, value: ir.Value, axis: int) -> list[tuple[ir.Value, int]]:
    """``(value, axis)`` and, nearest first, every (value, axis) its size is copied from as it
    is: through the ops that keep an axis (element-wise, norms, Transpose, a MatMul's rows or
    columns, Concat, Slice and Split off their axis, a Reshape's 0 or run-time copied size,
    attention's batch and sequence from its query), broadcasting only against sizes of 1.
    Two axes whose lists share an entry have one size at run time, whatever shape inference
    named them; the walk is one path, so it follows a residual stream through every layer."""
    chain: list[tuple[ir.Value, int]] = []
    seen: set[tuple[int, int]] = set()
    source: tuple[ir.Value, int] | None = (value, axis)
    while source is not None:
        value, axis = source
        shape = ctx.shape(value)
        if shape is None or not -len(shape) <= axis < len(shape):
            break
        axis %= len(shape)
        if (id(value), axis) in seen:
            break
        seen.add((id(value), axis))
        chain.append((value, axis))
        node = value.producer()
        source = None if node is None else _copied_axis(ctx, node, value, axis, len(shape))
    return chain


def _copied_axis(
    ctx: PassContext, node: ir.Node, value: ir.Value, axis: int, rank: int
) -> tuple[ir.Value, int] | None:
    """The input and axis whose size ``node``'s output ``value`` has along ``axis`` (of
    ``rank``), where the op copies it unchanged; None where it computes or may broadcast it."""
    if node.domain == MS:
        return _contrib_source(ctx, node, value, axis, rank)
    if node.domain not in ("", "ai.onnx"):
        return None
    inputs = list(node.inputs)
    op = node.op_type
    first = inputs[0] if inputs else None
    if first is None:
        return None
    if (op in _SAME_SHAPE or op in _SHAPE_KEEPING) and value is node.outputs[0]:
        return first, axis
    if op == "Gather" and len(inputs) > 1 and inputs[1] is not None:
        # data[..., indices, ...]: the indices' axes replace the gathered one (none for a
        # scalar index: an embedding lookup's [B, S] ids give its [B, S, H] rows theirs)
        indices = ctx.shape(inputs[1])
        if indices is None:
            return None
        count = len(indices)
        gathered = node.attributes.get_int("axis", 0) % (rank - count + 1)
        if axis < gathered:
            return first, axis
        if axis < gathered + count:
            return inputs[1], axis - gathered
        return first, axis - count + 1
    if op == "Transpose":
        perm = transpose_perm(node, rank)
        return first, perm[axis]
    if op == "GatherElements" and len(inputs) > 1 and inputs[1] is not None:
        return inputs[1], axis  # the output has the indices' shape
    if op == "Conv" and len(inputs) > 1 and inputs[1] is not None:
        return _conv_source(ctx, node, first, inputs[1], axis)
    if op == "Einsum":
        return _einsum_source(node, axis)
    if op == "Gemm" and len(inputs) > 1 and inputs[1] is not None and rank == 2:
        # rows from A, columns from B, each as the operand is transposed
        if axis == 0:
            return first, 1 if node.attributes.get_int("transA", 0) else 0
        return inputs[1], 0 if node.attributes.get_int("transB", 0) else 1
    if op in _MATMULS:
        inputs = inputs[:2]
        if not _matrices(ctx, inputs):
            return None
        if axis >= rank - 2:
            return inputs[0 if axis == rank - 2 else 1], axis - rank  # type: ignore[return-value]
    if op in _BROADCASTING or op in _MATMULS:
        return _unbroadcast(ctx, inputs, axis, rank, matrices=op in _MATMULS)
    if op == "Reshape" and len(inputs) > 1 and inputs[1] is not None:
        parts = target_parts(ctx, inputs[1])
        part = parts[axis] if parts is not None and len(parts) == rank else None
        if part == 0 and not node.attributes.get_int("allowzero", 0):
            return first, axis
        return part if isinstance(part, tuple) else None
    if op == "Unsqueeze":  # GPT-BigCode's x.unsqueeze(1)
        operand = constant_value(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
        axes = operand if operand is not None else node.attributes.get_ints("axes", None)
        if axes is None:
            return None
        inserted = {int(a) % rank for a in np.asarray(axes).reshape(-1)}
        if axis in inserted:
            return None
        return first, axis - sum(a < axis for a in inserted)
    if op == "Squeeze":  # the axes it keeps, in order
        removed = node_axes(node)
        source = ctx.shape(first)
        if removed is None or source is None:
            return None
        dropped = {a % len(source) for a in removed}
        return first, [a for a in range(len(source)) if a not in dropped][axis]
    if op in ("Concat", "Slice", "Split"):
        # an axis they do not cut or join keeps the (first) input's size
        if op == "Slice":
            given = inputs[3] if len(inputs) > 3 else None
            axes = constant_value(given) if given is not None else None
            if given is not None and axes is None:
                return None
            sliced = range(rank) if axes is None else [int(a) % rank for a in np.ravel(axes)]
            return None if axis in sliced else (first, axis)
        return None if node.attributes.get_int("axis", 0) % rank == axis else (first, axis)
    return None


def _einsum_source(node: ir.Node, axis: int) -> tuple[ir.Value, int] | None:
    """The operand axis an Einsum's output axis has its label from (equal labels, equal
    sizes); None for an ellipsis, which may broadcast."""
    equation = (node.attributes.get_string("equation", "") or "").replace(" ", "")
    terms, _, output = equation.partition("->")
    if "." in equation or not 0 <= axis < len(output):
        return None
    for term, operand in zip(terms.split(","), node.inputs, strict=False):
        if output[axis] in term and operand is not None:
            return operand, term.index(output[axis])
    return None


def _conv_source(
    ctx: PassContext, node: ir.Node, data: ir.Value, weight: ir.Value, axis: int
) -> tuple[ir.Value, int] | None:
    """A Conv keeps the batch, and a spatial size where it slides by 1 over padding that
    makes up for its reach (PyTorch's padding='same', a conformer's depthwise and pointwise
    convolutions over time)."""
    if axis == 0:
        return data, 0
    kernel = node.attributes.get_ints("kernel_shape", None)
    if kernel is None:
        shape = ctx.shape(weight)
        kernel = list(shape[2:]) if shape is not None else None
    spatial = axis - 2
    if axis < 2 or kernel is None or spatial >= len(kernel) or not isinstance(kernel[spatial], int):
        return None
    count = len(kernel)
    strides = node.attributes.get_ints("strides", None) or [1] * count
    dilations = node.attributes.get_ints("dilations", None) or [1] * count
    if strides[spatial] != 1:
        return None
    reach = dilations[spatial] * (kernel[spatial] - 1)
    auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return data, axis
    pads = [0] * (2 * count) if auto_pad == "VALID" else node.attributes.get_ints("pads", None)
    pads = pads or [0] * (2 * count)
    return (data, axis) if pads[spatial] + pads[spatial + count] == reach else None


def _unbroadcast(
    ctx: PassContext, inputs: list[ir.Value | None], axis: int, rank: int, matrices: bool
) -> tuple[ir.Value, int] | None:
    """The one operand of a broadcasting op (a MatMul's batch axes) that reaches ``axis`` with
    a size other than a static 1, the others having 1 there or no such axis: the output has its
    size. None where two may differ (one may be 1 at run time)."""
    found = None
    for operand in inputs:
        shape = ctx.shape(operand) if operand is not None else None
        if operand is None or shape is None:
            return None
        position = axis - rank + len(shape)
        if position < 0 or (matrices and position >= len(shape) - 2) or shape[position] == 1:
            continue
        if found is not None:
            return None
        found = (operand, position)
    return found


# onnxruntime contrib ops the passes emit, by what their outputs' axes are: the first input's
# shape (outputs listed; the skip norms' fourth output is the sum, the input's shape), or the
# query's batch and sequence axes (attention on a 3-D query has a 3-D output).
_SHAPE_OF_INPUT = {
    "RotaryEmbedding": (0,),
    "SkipLayerNormalization": (0, 3),
    "SkipSimplifiedLayerNormalization": (0, 3),
    "FastGelu": (0,),
    "BiasGelu": (0,),
    "Gelu": (0,),
    "QuickGelu": (0,),
}
_QUERY_LED = frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention"})


def _contrib_source(
    ctx: PassContext, node: ir.Node, value: ir.Value, axis: int, rank: int
) -> tuple[ir.Value, int] | None:
    """The input and axis a com.microsoft op's output ``axis`` (of ``rank``) has its size
    from, where the op's definition fixes it; None elsewhere."""
    first = node.inputs[0] if node.inputs else None
    if first is None:
        return None
    index = list(node.outputs).index(value)
    if index in _SHAPE_OF_INPUT.get(node.op_type, ()):
        return first, axis
    if node.op_type == "MatMulNBits" and index == 0 and axis < rank - 1:
        return first, axis  # A [..., K] times the dequantized [K, N]: every axis but the last
    if node.op_type in _QUERY_LED and index == 0 and rank == 3 and axis < 2:
        query = ctx.shape(first)
        return (first, axis) if query is not None and len(query) == 3 else None
    if node.op_type == "FusedMatMul" and index == 0 and axis >= rank - 2:
        if any(node.attributes.get_int(f"transBatch{side}", 0) for side in "AB"):
            return None
        if not _matrices(ctx, list(node.inputs)):
            return None
        row = axis == rank - 2  # the rows come from A, the columns from B
        transposed = node.attributes.get_int("transA" if row else "transB", 0)
        return node.inputs[0 if row else 1], (-1 if row == bool(transposed) else -2)  # type: ignore[return-value]
    return None


def _matrices(ctx: PassContext, inputs: list[ir.Value | None]) -> bool:
    """Whether a matrix product's two operands are known to be at least 2-D (a 1-D operand
    drops an axis of the output)."""
    if len(inputs) < 2 or inputs[0] is None or inputs[1] is None:
        return False
    shapes = [ctx.shape(operand) for operand in inputs[:2]]  # type: ignore[arg-type]
    return all(shape is not None and len(shape) >= 2 for shape in shapes)


def _reshaped_size(
    ctx: PassContext, node: ir.Node, axis: int, rank: int, depth: int
) -> Size | None:
    """A Reshape's output size: its target element, the data's size for 0, and for -1 the
    data's sizes over the target's others (as products, the named factors cancelling)."""
    data, target = node.inputs[0], node.inputs[1]
    assert data is not None and target is not None
    copying = not node.attributes.get_int("allowzero", 0)

    def element(index: int) -> Size | None:
        size = _element_size(ctx, target, index, depth)
        if size == (0, ()) and copying:
            return symbolic_size(ctx, data, index, depth)
        return size if size is None or size[0] > 0 or size == (-1, ()) else None

    size = element(axis)
    if size != (-1, ()):
        return size
    source = ctx.shape(data)
    if source is None:
        return None
    total: Size | None = (1, ())
    for index in range(len(source)):
        total = product(total, symbolic_size(ctx, data, index, depth))
    others: Size | None = (1, ())
    for index in range(rank):
        if index != axis:
            others = product(others, element(index))
    return quotient(total, others)


def _expanded_size(
    ctx: PassContext, node: ir.Node, axis: int, rank: int, depth: int
) -> Size | None:
    """An Expand's output size: the data's where it is not 1 (the target then is 1 or the
    same), else the target element's (DeBERTa's position index expanded to the query's
    [B*N, S, 2k])."""
    data, target = node.inputs[0], node.inputs[1]
    assert data is not None and target is not None
    source, elements = ctx.shape(data), ctx.shape(target)
    if source is None or elements is None or len(elements) != 1:
        return None
    position = axis - rank + len(source)
    size = symbolic_size(ctx, data, position, depth) if position >= 0 else (1, ())
    if size is not None and size != (1, ()):
        return size
    index = axis - rank + elements[0] if isinstance(elements[0], int) else -1
    element = _element_size(ctx, target, index, depth) if index >= 0 else None
    if element is not None and element != (1, ()):
        return element
    return size if element == (1, ()) else None


def _element_size(ctx: PassContext, value: ir.Value, index: int, depth: int) -> Size | None:
    """Element ``index`` of a 1-D shape tensor as a product: through Concat, Unsqueeze, a 1-D
    Reshape, expand's ``Where(Equal(t, -1), 1, t)``, Mul of such sizes and runs of copied
    sizes (Gather(Shape(x), i), Shape(x, i, j), Slice(Shape(x), i, j))."""
    array = constant_value(value)
    if array is not None:
        flat = array.reshape(-1)
        return (int(flat[index]), ()) if 0 <= index < flat.size else None
    copied = copied_dimensions(value)
    if copied is not None:
        if not 0 <= index < len(copied):
            return None
        return symbolic_size(ctx, *copied[index], depth - 1)
    node = value.producer()
    if node is None or depth == 0 or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in ("Unsqueeze", "Identity", "Cast") and node.inputs[0] is not None:
        return _element_size(ctx, node.inputs[0], index, depth - 1)
    if node.op_type == "Reshape" and node.inputs[0] is not None:  # 1-D to 1-D
        shape = ctx.shape(node.inputs[0])
        if shape is not None and len(shape) == 1:
            return _element_size(ctx, node.inputs[0], index, depth - 1)
    if node.op_type == "Where" and len(node.inputs) == 3 and node.inputs[2] is not None:
        # TorchScript's expand(sizes): Where(Equal(sizes, -1), 1, sizes) keeps every size,
        # and a -1 written in the sizes (expand(B, -1, -1)) is the other operand's element
        equal = producer_of(node.inputs[0], "Equal")
        flag = [constant_value(v) for v in equal.inputs if v is not node.inputs[2]] if equal else []
        if equal is not None and node.inputs[2] in equal.inputs and len(flag) == 1:
            size = _element_size(ctx, node.inputs[2], index, depth - 1)
            negative = flag[0] is not None and bool(np.all(flag[0] < 0))
            if not negative or size is None:
                return None
            if size[0] > 0:
                return size
            if size != (_broadcast_item(flag[0], index), ()):
                return None
            chosen = constant_value(node.inputs[1])
            item = _broadcast_item(chosen, index) if chosen is not None else None
            return (item, ()) if item is not None else None
    if node.op_type == "Mul" and len(node.inputs) == 2 and None not in node.inputs:
        parts = [_element_size(ctx, v, index, depth - 1) for v in node.inputs]  # type: ignore[arg-type]
        return product(*parts)
    if node.op_type == "Max" and node.inputs and None not in node.inputs:
        # sizes that broadcast (tf2onnx's batch axes of an einsum): equal, or 1 and another
        sizes = {_element_size(ctx, v, index, depth - 1) for v in node.inputs}  # type: ignore[arg-type]
        if len(sizes) > 1:
            sizes.discard((1, ()))
        return sizes.pop() if len(sizes) == 1 and None not in sizes else None
    if node.op_type == "ReduceProd" and index == 0 and node.inputs[0] is not None:
        return _shape_product(ctx, node, depth - 1)
    if node.op_type == "Concat":
        for part in node.inputs:
            size = ctx.shape(part) if part is not None else None
            if part is None or size is None or len(size) != 1 or not isinstance(size[0], int):
                return None
            if index < size[0]:
                return _element_size(ctx, part, index, depth - 1)
            index -= size[0]
    return None


def _broadcast_item(array: np.ndarray, index: int) -> int | None:
    """Element ``index`` of a 1-D operand as it broadcasts (one element stands for all)."""
    flat = array.reshape(-1)
    if flat.size == 1:
        return int(flat[0])
    return int(flat[index]) if 0 <= index < flat.size else None


def _shape_product(ctx: PassContext, node: ir.Node, depth: int) -> Size | None:
    """ReduceProd of a 1-D shape tensor over its one axis: the product of its sizes."""
    data = node.inputs[0]
    length = ctx.shape(data) if data is not None else None
    axes = node.inputs[1] if len(node.inputs) > 1 else None
    reduced = constant_value(axes) if axes is not None else node.attributes.get_ints("axes", None)
    if axes is not None and reduced is None:
        return None
    whole = reduced is None or np.ravel(reduced).tolist() in ([0], [-1])
    if data is None or length is None or len(length) != 1 or not isinstance(length[0], int):
        return None
    if not whole or (reduced is None and node.attributes.get_int("noop_with_empty_axes", 0)):
        return None
    total: Size | None = (1, ())
    for index in range(length[0]):
        total = product(total, _element_size(ctx, data, index, depth))
    return total
