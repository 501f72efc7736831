"""Arithmetic with a neutral operand removed: ``x * 1``, ``x / 1``, ``x + 0``, ``x - 0`` -> ``x``;
and with a sign operand, ``x * -1`` and ``x / -1`` -> ``Neg(x)``.

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

paddle2onnx writes ``paddle.scale`` as a Mul and an Add, so a negation is ``x * -1 + 0``: the
rotate-half of a rotary embedding then has no Neg for the rotary passes to find. ``x * -1`` is
``-x`` bit for bit, and is written so.
"""

from __future__ import annotations

import functools

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
    replace_subgraph,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass
from fusectl.rewrite.shapes import equal_shapes
from fusectl.rewrite.spread import ARITHMETIC, splat

# op -> (its neutral value, the input positions that value may take)
_NEUTRAL = {"Mul": (1, (0, 1)), "Div": (1, (1,)), "Add": (0, (0, 1)), "Sub": (0, (1,))}
# op -> the input positions where a -1 makes it a negation
_NEGATING = {"Mul": (0, 1), "Div": (1,)}
_NEGATION = "SignProduct"
# The ops whose output is a spread constant when their inputs are (splat follows them).
_SPREADING = frozenset(
    {"Expand", "Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", *ARITHMETIC}
)
# Initializers larger than this are weights, not the constants exporters write for a scale
# (walks start from small initializers of zeros, ones or minus ones).
_SEED_ELEMENTS = 1 << 16


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
    """Whether the initializer is a small constant of zeros, ones or minus ones to walk from.
    The answer is kept across rounds, and read from the stored bytes where it can: converting
    each of a 100k-node graph's 23k initializers to an array took 0.9 s, most of it naming
    its type."""
    key = ("neutral operand seed", initializer)
    found = ctx.facts.get(key)
    if found is None:
        found = ctx.facts[key] = _seed_values(initializer.const_value)
    return bool(found)


def _seed_values(tensor: ir.TensorProtocol | None) -> bool:
    """Whether the tensor is small and all zeros, all ones or all minus ones."""
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
        and array.flat[0] in (0, 1, -1)
        and bool((array == array.flat[0]).all())
    )


@functools.cache
def _neutral_bytes(data_type: int) -> tuple[bytes, ...]:
    """How a 0, a 1 and (signed types) a -1 of this element type are stored (none for types
    numpy lacks)."""
    try:
        dtype = ir.DataType(data_type).numpy()
    except (TypeError, ValueError):
        return ()
    kind = np.dtype(dtype).kind
    if kind not in "fiub":
        return ()
    values = (0, 1, -1) if kind in "fi" else (0, 1)
    return tuple(np.array([value], dtype).tobytes() for value in values)


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
        "diffusers' classic attention scores; x * -1 -> Neg(x) (paddle2onnx's negation)",
        aliases=("neutral_operand_elimination", "EliminateNeutralOperand"),
        priority=3012,  # beside IdentityElimination, before any fusion reads through them
        canonical=True,
        emits=("Neg",),
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
        for position in _NEGATING.get(node.op_type, ()):
            operand, x = node.inputs[position], node.inputs[1 - position]
            value = splat(operand, seen)
            if value is None or x is None or value != -1:
                continue
            assert operand is not None
            if _keeps_shape(ctx, node, x, operand):
                self._negate(ctx, node, x, operand)
            return None
        return None

    @staticmethod
    def _negate(ctx: PassContext, node: ir.Node, x: ir.Value, operand: ir.Value) -> None:
        """``node`` (x * -1, x / -1) written as Neg(x)."""
        graph = node.graph
        assert graph is not None
        negation = ir.node("Neg", [x])
        output = node.outputs[0]
        typed(negation.outputs[0], ctx.dtype(output), output.shape)
        source = operand.producer()
        replaced = replace_subgraph(
            ctx, _NEGATION, node, [node], [negation], node.outputs, negation.outputs
        )
        if replaced is None and source is not None:
            remove_dead(graph, [source])
