"""Transposes moved down through the layout-agnostic ops after them, until they meet their inverse.

tf2onnx converts a channels-last Keras model by putting every Conv between two Transposes
(channels-last to channels-first before it, back after it) and leaves it to its own transpose
optimizer to cancel them. Where that optimizer gives up (tf2onnx 1.16 raises on the scalar
``+ 3`` of Keras's hard-sigmoid and keeps the graph as it was: Keras's MobileNetV3-Small keeps
106 Transposes), every activation, pad, batch-norm scale, squeeze-excite gate and residual Add
between two Convs runs channels-last between a pair of them.

``X(Transpose(a, p))`` is ``Transpose(X'(a), p)`` for an element-wise op ``X`` (its constant
operands permuted by the inverse of ``p``, its other operands Transposes of the same perm), a
Pad (its pads permuted) and a reduction that keeps its axes (the axes mapped through ``p``).
Moved down one op at a time, a Transpose meets its inverse, and both go. A Transpose moves only
where every copy it leaves reaches such an inverse (looked ahead, not tried), so the count of
Transposes never grows and one that would only move stays where the exporter put it; nor does
one merge into another Transpose, which another fusion may read as it is (a key transposed for
MatMul's ``transB``: MaxViT's FusedMatMul). onnxruntime does the same at session creation (its
transpose optimizer, at every level but ``ORT_DISABLE_ALL``); done offline, the Convs'
batch-norm scales and pads then sit next to them for the Conv fusions.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_value,
    inverse_perm,
    new_constant,
    node_axes,
    node_label,
    producer_of,
    replace_subgraph,
    transpose_perm,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

# One value in, the same shape out, each element on its own.
_UNARY = frozenset(
    {
        *("Abs", "Cast", "Ceil", "Celu", "Clip", "Cos", "Elu", "Erf", "Exp", "Floor"),
        *("Gelu", "HardSigmoid", "HardSwish", "Identity", "LeakyRelu", "Log", "Mish", "Neg"),
        *("Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softplus"),
        *("Softsign", "Sqrt", "Tanh", "ThresholdedRelu"),
    }
)
# Element-wise with broadcasting: every operand permuted alike gives the result permuted.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu"})
_REDUCTIONS = frozenset(
    {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2"}
)
_MOVABLE = _UNARY | _BROADCASTING | _REDUCTIONS | {"Pad"}
_TRANSPOSE = frozenset({"Transpose"})
# How far ahead a Transpose read several times is followed (values it would move past).
_LOOKAHEAD = 64


def _standard(node: ir.Node, op_types: frozenset[str]) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in op_types


@dataclass
class _Move:
    """How ``reader`` reads its operands once the Transpose is below it: a value as it is, or
    a constant to write (permuted back); the other Transposes of the same perm it consumes."""

    reader: ir.Node
    operands: list[ir.Value | np.ndarray | None]
    attributes: dict[str, ir.Attr]
    gone: list[ir.Node]


def _plan(
    moving: ir.Value,
    source: ir.Value | None,
    perm: list[int],
    reader: ir.Node,
    transposed: frozenset[ir.Value] = frozenset(),
) -> _Move | str:
    """How a Transpose of ``perm`` computing ``moving`` from ``source`` moves below
    ``reader``, or why it cannot. A dry run (``source`` None) takes the values in
    ``transposed`` for values Transposes of ``perm`` will compute by then."""
    if not _standard(reader, _MOVABLE) or len(reader.outputs) != 1:
        return ""
    rank, back = len(perm), inverse_perm(perm)
    attributes = dict(reader.attributes.items())
    axes = node_axes(reader) if reader.op_type in _REDUCTIONS else None
    if reader.op_type in _REDUCTIONS:
        if reader.attributes.get_int("keepdims", 1) != 1:
            return "the reduction drops axes"
        if axes is None and (len(reader.inputs) > 1 or "axes" in attributes):
            return "the reduced axes are not constant"
        mapped_axes = {perm[a % rank] for a in axes} if axes else set(range(rank))
        if mapped_axes != set(range(rank - len(mapped_axes), rank)):
            # A layer norm over the channels of a channels-last value would become one over
            # axis 1, which the normalization fusions do not read.
            return "the reduction would no longer be over trailing axes"
        if "axes" in attributes:  # before opset 18, an attribute
            mapped = sorted(perm[a % rank] for a in axes or [])
            attributes["axes"] = ir.AttrInt64s("axes", mapped)
    operands: list[ir.Value | np.ndarray | None] = []
    gone: list[ir.Node] = []
    for index, value in enumerate(reader.inputs):
        other = producer_of(value, "Transpose")
        if value is None:
            operands.append(None)
        elif value is moving or (source is None and _will_be_transposed(value, perm, transposed)):
            operands.append(source)
        elif other is not None and transpose_perm(other, rank) == perm:
            operands.append(other.inputs[0])
            # It goes with the move unless something else reads it (ConvNeXt's residual
            # stream, read by the next block's Conv too).
            if len(value.uses()) == 1 and not value.is_graph_output() and other not in gone:
                gone.append(other)
        elif reader.op_type == "Pad" and index == 1:
            pads = constant_value(value)
            if pads is None or pads.shape != (2 * rank,) or len(reader.inputs) > 3:
                return "the pads are not a constant over every axis"
            operands.append(np.concatenate([pads[:rank][back], pads[rank:][back]]))
        elif reader.op_type in _REDUCTIONS and index == 1:
            operands.append(np.array(sorted(perm[a % rank] for a in axes or []), np.int64))
        else:
            array = constant_value(value)
            if array is None:
                return "an operand is neither a constant nor a Transpose of the same perm"
            if array.ndim == 0 or reader.op_type == "Pad" or reader.op_type in _UNARY:
                operands.append(value)  # a scalar (Clip's bounds, Pad's fill) reads alike
            elif array.ndim > rank:
                return "a constant operand has more axes than the transposed value"
            else:
                full = array.reshape((1,) * (rank - array.ndim) + array.shape)
                operands.append(np.ascontiguousarray(full.transpose(back)))
    return _Move(reader, operands, attributes, gone)


def _will_be_transposed(
    value: ir.Value, perm: list[int], transposed: frozenset[ir.Value], depth: int = 8
) -> bool:
    """Whether moving the Transposes of ``perm`` above ``value`` down leaves one computing it:
    it is in ``transposed`` (followed already), or a Transpose of ``perm`` computes it, or an
    op a Transpose moves past does, from such values and constants."""
    if value in transposed:
        return True
    producer = value.producer()
    if producer is not None and _standard(producer, _TRANSPOSE):
        return transpose_perm(producer, len(perm)) == perm
    if producer is None or depth == 0 or len(value.uses()) != 1:
        return False
    if not _standard(producer, _MOVABLE) or len(producer.outputs) != 1:
        return False
    operands = [v for v in producer.inputs if v is not None and constant_value(v) is None]
    return bool(operands) and all(
        _will_be_transposed(v, perm, transposed, depth - 1) for v in operands
    )


def _reaches_transposes(value: ir.Value, perm: list[int]) -> str | None:
    """None where a Transpose of ``perm`` computing ``value`` moves down past every reader
    until each copy meets a Transpose that undoes it, else why not ("": it would meet an op
    no Transpose moves past, or another Transpose): a dry run of the moves, over at most
    _LOOKAHEAD values. Paths that part and join again (``x`` read by ``x + 3`` and by
    ``x * relu6(x + 3)``) are followed until the join's operands are all transposed."""
    transposed = [value]
    passed: set[ir.Node] = set()
    blocked: dict[ir.Node, str] = {}
    progress = True
    while progress:
        progress = False
        for current in list(transposed):
            if current.is_graph_output():
                return "a value it would move past is a graph output"
            for reader in dict.fromkeys(user for user, _ in current.uses()):
                if reader in passed:
                    continue
                if _standard(reader, _TRANSPOSE) and not _undoes(reader, perm):
                    # Merged, the two would be one Transpose another fusion may not read
                    # (a key transposed for MatMul's transB): left as they are.
                    blocked[reader] = ""
                    continue
                if not _standard(reader, _TRANSPOSE):
                    move = _plan(current, None, perm, reader, frozenset(transposed))
                    if isinstance(move, str):
                        blocked[reader] = move  # perhaps until another path reaches it
                        continue
                    transposed.append(reader.outputs[0])
                    if len(transposed) > _LOOKAHEAD:
                        return f"more than {_LOOKAHEAD} values to move it past"
                passed.add(reader)
                blocked.pop(reader, None)
                progress = True
    # The first reason a reader gives, or "" where the readers left are no candidates (a
    # Conv, a MatMul: the Transpose would only move).
    return next((reason for reason in blocked.values() if reason), "" if blocked else None)


@register_pass
class TransposePushCanonicalizationPass(FusionPass):
    """Not a pattern: each op after a Transpose is judged on its operands."""

    spec = PassSpec(
        name="TransposePushCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: X(Transpose(a, p), ...) -> Transpose(X(a, ...), p) for "
        "element-wise ops (constants permuted back, other operands Transposes of the same "
        "perm), Pad and reductions that keep their axes, moved down until the Transpose meets "
        "its inverse and both go, only where every copy it leaves gets that far: tf2onnx's "
        "channels-last Keras models where its own transpose optimizer gave up",
        aliases=("transpose_push", "transpose_push_canonicalization"),
        priority=3048,  # before the Conv fusions, which then meet the Conv's scale and pad
        emits=(),
        again_after_fusions=True,  # fused attention leaves its head Transposes side by side
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        stats = ctx.pattern("TransposePush")
        if not ctx.op_index.holds(graph, {"Transpose"}):
            return
        # Round after round: a Transpose that cannot move past an op until the op's other
        # operand is a Transpose too (a squeeze-excite gate) moves once that one has. What the
        # last round (which moved nothing) left, and why, are the near misses: a move that
        # waited for another Transpose to arrive is none.
        created: set[ir.Node] = set()
        left: dict[ir.Node, str] = {}
        while _round(ctx, graph, created, left):
            left.clear()
        for transpose, reason in left.items():
            stats.decline(reason, node_label(transpose))


def _round(
    ctx: PassContext, graph: ir.Graph, created: set[ir.Node], left: dict[ir.Node, str]
) -> bool:
    """Move every Transpose as far as it goes; whether anything moved. ``created``: the
    Transposes moves left; two Transposes the exporter wrote one after the other are left to
    TransposeTransposeFusionPass. ``left``: the Transposes that stay, with why."""
    changed = False
    # Each move leaves a Transpose one op further down, which may move again.
    work = collections.deque(node for node in graph if _standard(node, _TRANSPOSE))
    while work:
        transpose = work.popleft()
        if transpose.graph is not graph or transpose.inputs[0] is None:
            continue
        value = transpose.outputs[0]
        source = ctx.shape(transpose.inputs[0])
        perm = transpose_perm(transpose, len(source) if source is not None else None)
        readers = list(dict.fromkeys(user for user, _ in value.uses()))
        if perm is None or not readers or value.is_graph_output():
            continue
        if any(reader.graph is not graph for reader in readers):
            continue  # read inside a subgraph
        if transpose not in created and all(_standard(r, _TRANSPOSE) for r in readers):
            continue
        reason = _reaches_transposes(value, perm)
        if reason is not None:
            if reason:  # "": it would only move, not go
                left[transpose] = reason
            continue
        for reader in readers:
            if _standard(reader, _TRANSPOSE):
                changed |= _cancel(ctx, transpose, reader)
                continue
            move = _plan(value, transpose.inputs[0], perm, reader)
            if isinstance(move, str):
                continue
            moved = _move(ctx, transpose, perm, move)
            if moved is not None:
                changed = True
                created.add(moved)
                work.append(moved)
        if not value.uses() and transpose.graph is graph:
            graph.remove(transpose, safe=True)
    return changed


def _undoes(node: ir.Node, perm: list[int]) -> bool:
    """Whether ``node`` is a Transpose that undoes ``perm``."""
    return _standard(node, _TRANSPOSE) and transpose_perm(node, len(perm)) == inverse_perm(perm)


def _cancel(ctx: PassContext, first: ir.Node, second: ir.Node) -> bool:
    """Transpose(Transpose(a, p), inverse of p) is a: its readers read a. ``first`` stays
    while something else reads it."""
    source = first.inputs[0]
    if source is None or second.outputs[0].is_graph_output():
        return False  # the graph output keeps its name: left to TransposeTransposeFusion
    if not ctx.may_rewrite("TransposeCancel", node_label(second)):
        return False
    alone = all(user is second for user, _ in first.outputs[0].uses())
    for user, index in list(second.outputs[0].uses()):
        user.replace_input_with(index, source)
    ctx.record_fusion("TransposeCancel", [first, second] if alone else [second], [])
    second.graph.remove(second, safe=True)  # type: ignore[union-attr]
    return True


def _move(ctx: PassContext, transpose: ir.Node, perm: list[int], move: _Move) -> ir.Node | None:
    """Rewrite ``move.reader`` to read below ``transpose``; the Transpose now after it."""
    reader = move.reader
    graph = reader.graph
    assert graph is not None
    inputs = [
        new_constant(graph, f"{node_label(reader)}/{index}", operand)
        if isinstance(operand, np.ndarray)
        else operand
        for index, operand in enumerate(move.operands)
    ]
    result = reader.outputs[0]
    moved = ir.node(reader.op_type, inputs, attributes=move.attributes)
    shape = ctx.shape(result)
    unpermuted = None if shape is None else ir.Shape([shape[a] for a in inverse_perm(perm)])
    typed(moved.outputs[0], ctx.dtype(result), unpermuted)
    after = ir.node("Transpose", moved.outputs, attributes={"perm": perm})
    typed(after.outputs[0], ctx.dtype(result), shape)
    alone = len(transpose.outputs[0].uses()) == 1
    old = [reader, *([transpose] if alone else []), *move.gone]
    refused = replace_subgraph(
        ctx, "TransposePush", reader, old, [moved, after], reader.outputs, after.outputs
    )
    return None if refused is not None else after
