"""A per-channel affine map folded into the convolutions that read it.

``Conv(x * s + t, W, b)``, with ``s`` and ``t`` one value per input channel, is ``Conv(x, W', b')``
for ``W'[m, c] = W[m, c] * s[c]`` and ``b'[m] = b[m] + sum over c and the kernel of
W[m, c] * t[c]``. The map is whatever chain of inference BatchNormalization and Mul, Div, Add,
Sub by per-channel constants computes it: MaxViT's and CoAtNet's pre-norm BatchNorm before a 1x1
Conv, an input normalization ``(x - mean) / std`` or ``x / 255`` baked in front of the stem. (A
BatchNormalization after a Conv is ConvBatchnormFusionPass's.) It runs after every other fusion,
so that the Mul or Add of an activation or norm the others fuse (a GELU's ``* 0.5`` before a
Conv) is theirs, and reads the FusedConv of ConvActivationFusionPass as a Conv.

The shift moves into the bias only where the Conv does not pad: a padded border is zeros after
the map in the original, and would be ``t`` folded. The scale folds across padding (``0 * s`` is
zero), so a padded Conv takes the part of the chain nearest to it that shifts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.batchnorm import inference_affine, per_channel
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_value, new_constant, node_label, replace_subgraph, typed
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass
from fusectl.rewrite.sites import op_name

PATTERN = "ChannelAffineConv"
_ARITHMETIC = frozenset({"Mul", "Div", "Add", "Sub"})
# The convolutions whose first three inputs are X, W and B (FusedConv's fourth, Z, is added to
# the result after the convolution).
_CONVS = frozenset({"Conv", "com.microsoft.FusedConv"})


@dataclass(frozen=True)
class _Step:
    """One node of the chain as ``y = x * scale + shift`` per channel (float64), ``x`` being
    the activation it reads (``source``)."""

    node: ir.Node
    source: ir.Value
    scale: np.ndarray
    shift: np.ndarray


def _step(node: ir.Node, value: ir.Value, channels: int, rank: int) -> _Step | None:
    """``node`` (which computes ``value`` from one activation) as a per-channel affine step."""
    if node.domain not in ("", "ai.onnx") or not node.outputs or node.outputs[0] is not value:
        return None
    if node.op_type == "BatchNormalization":
        found = inference_affine(node, channels)
        return None if isinstance(found, str) else _Step(node, node.inputs[0], *found)  # type: ignore[arg-type]
    if node.op_type not in _ARITHMETIC or len(node.inputs) != 2:
        return None
    constants = [constant_value(v) if v is not None else None for v in node.inputs]
    if (constants[0] is None) == (constants[1] is None):
        return None  # both activations, or folded already by constant folding
    constant_first = constants[0] is not None
    source = node.inputs[1 if constant_first else 0]
    array = per_channel(constants[0 if constant_first else 1], channels, rank)  # type: ignore[arg-type]
    if source is None or array is None or not np.issubdtype(array.dtype, np.floating):
        return None
    array = array.astype(np.float64)
    ones, zeros = np.ones(channels), np.zeros(channels)
    if node.op_type == "Mul":
        return _Step(node, source, array, zeros)
    if node.op_type == "Add":
        return _Step(node, source, ones, array)
    if node.op_type == "Sub":  # c - x or x - c
        return (
            _Step(node, source, -ones, array)
            if constant_first
            else _Step(node, source, ones, -array)
        )
    if constant_first or np.any(array == 0):
        return None  # c / x is no affine map; x / 0 is no scale
    return _Step(node, source, 1.0 / array, zeros)


def _only_read_by(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and all(user is reader for user, _ in value.uses())


def _unbroadcast(ctx: PassContext, source: ir.Value, value: ir.Value, rank: int) -> bool:
    """Whether the step's activation ``source`` provably has the shape of its result
    ``value`` (the constant does not broadcast it up: [N, 1, H, W] times [1, C, 1, 1] has C
    channels where the activation has one): by the inferred shapes, else by onnxruntime's
    symbolic inference (GroupNorm's Reshape back to Shape(x) leaves onnx's dims unknown)."""
    shape, result = ctx.shape(source), ctx.shape(value)
    if shape is None or len(shape) != rank:
        return False
    if result is not None and isinstance(shape[1], int) and shape[1] == result[1]:
        return True
    return ctx.shapes is not None and ctx.shapes.same_shape(source, value)


def _chain(
    ctx: PassContext, start: ir.Value, channels: int, rank: int
) -> tuple[ir.Value, list[_Step]]:
    """The affine steps that compute ``start``, nearest first, each read only by the next and
    reading an activation of its result's shape; and the value the first of them reads."""
    steps: list[_Step] = []
    value = start
    while (node := value.producer()) is not None:
        step = _step(node, value, channels, rank)
        if step is None:
            break
        if steps and not _only_read_by(value, steps[-1].node):
            break
        if node.op_type != "BatchNormalization" and not _unbroadcast(ctx, step.source, value, rank):
            break
        steps.append(step)
        value = step.source
    return value, steps


def _composed(steps: Sequence[_Step]) -> tuple[np.ndarray, np.ndarray]:
    """The steps (nearest first) as one ``x * scale + shift``."""
    scale, shift = np.ones_like(steps[0].scale), np.zeros_like(steps[0].shift)
    for step in reversed(steps):  # the earliest first
        scale, shift = scale * step.scale, shift * step.scale + step.shift
    return scale, shift


def _pads(conv: ir.Node) -> bool:
    """Whether the Conv pads its input (auto_pad SAME_* may, explicit pads do)."""
    if conv.attributes.get_string("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
        return True
    return any(p != 0 for p in conv.attributes.get_ints("pads", []))


def _layout(ctx: PassContext, conv: ir.Node, value: ir.Value) -> tuple[int, int] | None:
    """(channels, rank) of the Conv's input [N, C, ...]: from its shape, else its weight."""
    shape = ctx.shape(value)
    if shape is not None and len(shape) >= 3 and isinstance(shape[1], int):
        return shape[1], len(shape)
    weight = constant_value(conv.inputs[1]) if len(conv.inputs) > 1 and conv.inputs[1] else None
    if weight is None or weight.ndim < 3:
        return None
    return weight.shape[1] * conv.attributes.get_int("group", 1), weight.ndim


def _conv_refusal(conv: ir.Node, value: ir.Value, channels: int, rank: int) -> str | None:
    """Why the map cannot fold into ``conv`` whatever it shifts, if it cannot."""
    if op_name(conv.domain, conv.op_type) not in _CONVS or conv.inputs[0] is not value:
        return f"the mapped input is also read by {conv.op_type} {node_label(conv)!r}"
    if any(v is value for v in conv.inputs[1:]):
        return "the Conv reads the mapped input again (as its weight, bias or sum)"
    weight = constant_value(conv.inputs[1]) if conv.inputs[1] is not None else None
    if weight is None or not np.issubdtype(weight.dtype, np.floating):
        return "the Conv's weight is not a floating-point constant"
    if weight.ndim != rank or weight.shape[1] * conv.attributes.get_int("group", 1) != channels:
        return "the Conv's weight does not match its input's channels"
    bias = conv.inputs[2] if len(conv.inputs) > 2 else None
    if bias is not None and constant_value(bias) is None:
        return "the Conv's bias is not a constant"
    return None


def _folded(
    ctx: PassContext, conv: ir.Node, source: ir.Value, scale: np.ndarray, shift: np.ndarray
) -> ir.Node:
    """The Conv reading ``source`` with the map ``x * scale + shift`` in its weights and bias."""
    graph = conv.graph
    assert graph is not None
    weight = constant_value(conv.inputs[1])
    assert weight is not None
    bias_input = conv.inputs[2] if len(conv.inputs) > 2 else None
    bias = constant_value(bias_input) if bias_input is not None else None
    outputs, per_group = weight.shape[0], weight.shape[1]
    groups = conv.attributes.get_int("group", 1)
    # Input channel of weight[m, c]: group (m // (outputs / groups)) times per_group, plus c.
    channel = (np.arange(outputs) // (outputs // groups))[:, None] * per_group + np.arange(
        per_group
    )
    wide = (outputs, per_group) + (1,) * (weight.ndim - 2)
    scaled = weight.astype(np.float64) * scale[channel].reshape(wide)
    added = np.zeros(outputs) if bias is None else bias.astype(np.float64).reshape(-1)
    added = added + (weight.astype(np.float64) * shift[channel].reshape(wide)).reshape(
        outputs, -1
    ).sum(axis=1)
    name = f"{ctx.spec.name}/{node_label(conv)}"
    inputs = [
        source,
        new_constant(graph, f"{name}/weight", scaled.astype(weight.dtype)),
        new_constant(graph, f"{name}/bias", added.astype(weight.dtype)),
        *conv.inputs[3:],
    ]
    folded = ir.node(conv.op_type, inputs, attributes=dict(conv.attributes), domain=conv.domain)
    typed(folded.outputs[0], ctx.dtype(conv.outputs[0]), ctx.shape(conv.outputs[0]))
    return folded


@register_pass
class ChannelAffineConvFusionPass(FusionPass):
    spec = PassSpec(
        name="ChannelAffineConvFusionPass",
        category=Category.UB,
        description="a per-channel affine map (inference BatchNormalization, Mul / Div / Add / "
        "Sub by per-channel constants, chained) read only by Convs or FusedConvs: MaxViT's and "
        "CoAtNet's pre-norm BatchNorm before a 1x1 Conv, an input normalization before the "
        "stem -> the Convs with folded weights and bias (a Conv that pads takes the scale only)",
        aliases=("bn_conv_fusion", "channel_affine_conv_fusion"),
        numerics=Numerics.REASSOCIATING,
        priority=5930,  # the down band: after every fusion that could read the Mul or Add
        emits=("Conv",),  # or the FusedConv it read
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern(PATTERN)
        graph = model.graph
        seen: set[ir.Value] = set()
        convs = ctx.op_index.of_type(graph, "Conv") + ctx.op_index.of_type(
            graph, "FusedConv", ("com.microsoft",)
        )
        for conv in convs:
            value = conv.inputs[0] if conv.inputs else None
            if conv.graph is not graph or value is None or value in seen:
                continue
            seen.add(value)
            layout = _layout(ctx, conv, value)
            if layout is None:
                continue
            source, steps = _chain(ctx, value, *layout)
            if not steps:
                continue
            readers = list(dict.fromkeys(user for user, _ in value.uses()))
            reason = "the mapped input is a graph output" if value.is_graph_output() else None
            reason = reason or next(
                filter(None, (_conv_refusal(r, value, *layout) for r in readers)), None
            )
            if reason is None and any(_pads(r) for r in readers):
                # Only the steps nearest the Convs that shift nothing fold across padding.
                while steps and np.any(_composed(steps)[1] != 0):
                    steps.pop()
                if not steps:
                    reason = (
                        "the map shifts and the Conv pads its input: the padded border is "
                        "zeros after the map, and would be the shift folded into the bias"
                    )
                else:
                    source = steps[-1].source
            if reason is not None:
                stats.decline(reason, node_label(conv))
                continue
            scale, shift = _composed(steps)
            made = [_folded(ctx, reader, source, scale, shift) for reader in readers]
            replace_subgraph(
                ctx,
                PATTERN,
                conv,
                [step.node for step in reversed(steps)] + readers,
                made,
                [reader.outputs[0] for reader in readers],
                [node.outputs[0] for node in made],
            )
