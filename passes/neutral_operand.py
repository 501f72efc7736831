"""Arithmetic with a neutral operand removed: ``x * 1``, ``x / 1``, ``x + 0``, ``x - 0`` -> ``x``.

TorchScript keeps diffusers' ``output_scale_factor`` and ``rescale_output_factor`` (1.0 by
default) as ``Div(x, 1.0)``: 16 in a Stable Diffusion UNet, one between each attention's output
projection and the residual norm, where it hides the projection's bias from the norm. The
attention processor diffusers used before sdpa computes the scores as
``baddbmm(empty, q, k^T, beta=0, alpha=scale)``, exported as ``Expand(0, [B*N, S, L]) * 0``
added to the scaled product: a zero the attention fusions would pass on as a dense
``[B*N, 1, S, L]`` bias (512 MiB per attention at Stable Diffusion 1.5's 4096 tokens).

The neutral operand is a constant, or a constant spread at run time (Expand or ConstantOfShape
of a constant, and element-wise arithmetic of such), every element the neutral value. The op
goes where it provably leaves ``x``'s shape: a constant operand no larger than ``x`` along any
axis, and of no more axes; a run-time one where the op's result provably has ``x``'s shape. Exact:
``x * 1``, ``x / 1`` and ``x - 0`` are ``x`` bit for bit, ``x + 0`` too but that a negative zero
becomes a positive one.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import MAIN_GRAPH, PassContext
from fusectl.rewrite.graph import (
    bypass,
    bypass_refusal,
    constant_value,
    element_count,
    node_label,
    remove_dead,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass
from fusectl.rewrite.shapes import equal_shapes

# op -> (its neutral value, the input positions that value may take)
_NEUTRAL = {"Mul": (1, (0, 1)), "Div": (1, (1,)), "Add": (0, (0, 1)), "Sub": (0, (1,))}
_ARITHMETIC: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Mul": operator.mul,
    "Add": operator.add,
    "Sub": operator.sub,
    "Div": operator.truediv,
}
_SPLAT_DEPTH = 6
# The ops whose output is a spread constant when their inputs are (splat follows them).
_SPREADING = frozenset(
    {"Expand", "Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", *_ARITHMETIC}
)
# Initializers larger than this are weights, not the constants exporters write for a scale
# (walks start from small initializers of zeros or ones).
_SEED_ELEMENTS = 1 << 16


def splat(
    value: ir.Value | None, seen: dict[ir.Value, np.ndarray | None], depth: int = 0
) -> np.ndarray | None:
    """The one value every element of ``value`` has (0-d, of its element type) where that is
    known before run time, whatever the shape: a constant, an Expand or ConstantOfShape of one,
    a Cast or element-wise arithmetic of such; else None. ``seen`` holds the answers so far
    (a chain of arithmetic is walked once, not from each of its nodes)."""
    if value is None or depth > _SPLAT_DEPTH:
        return None
    if value not in seen:
        seen[value] = _splat(value, seen, depth)
    return seen[value]


def _splat(
    value: ir.Value, seen: dict[ir.Value, np.ndarray | None], depth: int
) -> np.ndarray | None:
    array = constant_value(value)
    if array is not None:
        flat = array.reshape(-1)
        if flat.size == 0 or not (flat == flat[0]).all():
            return None
        return flat[:1].reshape(())
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return None
    inputs = producer.inputs
    if producer.op_type == "Expand":
        return splat(inputs[0], seen, depth + 1)
    if producer.op_type == "ConstantOfShape":
        attribute = producer.attributes.get("value")
        if attribute is None:
            return np.zeros((), np.float32)
        return attribute.as_tensor().numpy().reshape(-1)[:1].reshape(())
    if producer.op_type == "Cast":
        inner = splat(inputs[0], seen, depth + 1)
        target = ir.DataType(producer.attributes.get_int("to", 0)).numpy()
        return None if inner is None else inner.astype(target)
    if producer.op_type in _ARITHMETIC and len(inputs) == 2:
        a = splat(inputs[0], seen, depth + 1)
        b = None if a is None else splat(inputs[1], seen, depth + 1)
        if a is None or b is None or a.dtype != b.dtype or a.dtype.kind != "f":
            return None  # integer Div truncates; keep to what numpy computes alike
        with np.errstate(all="ignore"):
            return np.asarray(_ARITHMETIC[producer.op_type](a, b), dtype=a.dtype)
    return None


def _keeps_shape(ctx: PassContext, node: ir.Node, x: ir.Value, operand: ir.Value) -> bool:
    """Whether ``node`` gives ``x``'s shape: the operand broadcasts to nothing larger."""
    array = constant_value(operand)
    if array is not None:
        if array.ndim == 0:
            return True
        shape = ctx.shape(x)
        if shape is None or array.ndim > len(shape):
            return False
        aligned = list(shape)[len(shape) - array.ndim :]
        return all(c == 1 or c == d for c, d in zip(array.shape, aligned, strict=True))
    result = node.outputs[0]
    if ctx.shapes is None:
        return equal_shapes(result.shape, x.shape)
    return ctx.shapes.same_shape(result, x)


def _seeds(ctx: PassContext, initializer: ir.Value) -> bool:
    """Whether the initializer is a small constant of zeros or ones to walk from. The answer
    is kept across rounds, and read from the stored bytes where it can: converting each of a
    100k-node graph's 23k initializers to an array took 0.9 s, most of it naming its type."""
    key = ("neutral operand seed", initializer)
    found = ctx.facts.get(key)
    if found is None:
        found = ctx.facts[key] = _zeros_or_ones(initializer.const_value)
    return bool(found)


def _zeros_or_ones(tensor: ir.TensorProtocol | None) -> bool:
    """Whether the tensor is small and all zeros or all ones."""
    if tensor is None or not 0 < element_count(tensor) <= _SEED_ELEMENTS:
        return False
    if isinstance(tensor, ir.serde.TensorProtoTensor):
        proto, size = tensor.raw, element_count(tensor)
        raw = proto.raw_data
        if raw:  # each element's bytes alike, and those of a 0 or a 1
            width, remainder = divmod(len(raw), size)
            first = raw[:width]
            return (
                not remainder and first in _neutral_bytes(proto.data_type) and raw == first * size
            )
    try:
        array = tensor.numpy()
    except Exception:  # stored data that does not match its type (a fuzzed or broken input)
        return False
    return (
        array.dtype.kind in "fiub"
        and (array.flat[0] == 0 or array.flat[0] == 1)
        and bool((array == array.flat[0]).all())
    )


@functools.cache
def _neutral_bytes(data_type: int) -> tuple[bytes, ...]:
    """How a 0 and a 1 of this element type are stored (none for types numpy lacks)."""
    try:
        dtype = ir.DataType(data_type).numpy()
    except (TypeError, ValueError):
        return ()
    if np.dtype(dtype).kind not in "fiub":
        return ()
    return tuple(np.array([value], dtype).tobytes() for value in (0, 1))


@register_pass
class NeutralOperandEliminationPass(FusionPass):
    """Not a pattern: walks forward from the constants that could be neutral (small
    initializers, Constant and ConstantOfShape outputs) through the ops that keep a spread
    constant one, and judges each arithmetic op they reach, so that a graph is not walked
    node by node."""

    spec = PassSpec(
        name="NeutralOperandEliminationPass",
        category=Category.GRAPH,
        description="x * 1, x / 1, x + 0, x - 0 -> x, the neutral operand a constant or a "
        "constant spread at run time (Expand, ConstantOfShape), where the op keeps x's shape: "
        "TorchScript's Div by diffusers' output scale factors, the zero baddbmm term of "
        "diffusers' classic attention scores",
        aliases=("neutral_operand_elimination", "EliminateNeutralOperand"),
        priority=3012,  # beside IdentityElimination, before any fusion reads through them
        canonical=True,
        emits=(),
    )
    counts_changes = True
    pattern = "NeutralOperand"

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        stats = ctx.pattern(self.pattern)
        seen: dict[ir.Value, np.ndarray | None] = {}
        pending = [value for value in graph.initializers.values() if _seeds(ctx, value)]
        if ctx.graph_id != MAIN_GRAPH:  # a branch or body reads its enclosing graphs' too
            pending += [
                value
                for node in graph
                for value in node.inputs
                if value is not None and value.is_initializer() and _seeds(ctx, value)
            ]
        for op_type in ("Constant", "ConstantOfShape"):
            pending += [node.outputs[0] for node in ctx.op_index.of_type(graph, op_type)]
        judged: set[ir.Node] = set()
        while pending:
            value = pending.pop()
            if splat(value, seen) is None:
                continue
            for user, _ in list(value.uses()):
                if user in judged or user.graph is not graph or user.domain not in ("", "ai.onnx"):
                    continue
                judged.add(user)
                if user.op_type in _NEUTRAL:
                    reason = self.judge(ctx, user, seen)
                    if reason is not None:
                        stats.decline(reason, node_label(user))
                if user.graph is graph and user.op_type in _SPREADING:
                    pending.append(user.outputs[0])

    def judge(
        self, ctx: PassContext, node: ir.Node, seen: dict[ir.Value, np.ndarray | None]
    ) -> str | None:
        """Bypass ``node`` where an operand is neutral; why not where one is but the shape is
        not provably kept; None elsewhere."""
        if len(node.inputs) != 2:
            return None
        neutral, positions = _NEUTRAL[node.op_type]
        for position in positions:
            operand, x = node.inputs[position], node.inputs[1 - position]
            value = splat(operand, seen)
            if value is None or x is None or value != neutral:
                continue
            assert operand is not None
            if not _keeps_shape(ctx, node, x, operand):
                return "the neutral operand is not provably no larger than the other"
            reason = bypass_refusal(node, 1 - position)
            if reason is not None:
                return reason
            if not ctx.may_rewrite(self.pattern, node_label(node)):
                return None
            graph = node.graph
            assert graph is not None
            source = operand.producer()
            bypass(node, 1 - position)
            if source is not None:
                remove_dead(graph, [source])
            ctx.record_fusion(self.pattern, [node], [])
            return None
        return None
