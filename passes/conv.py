"""Convolution folding: BatchNormalization and per-channel bias Adds folded into Conv weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.batchnorm import affine, inference_refusal, per_channel
from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import Category, Numerics, PassSpec, register_pass


def _conv_attributes(site: Site) -> dict[str, ir.Attr]:
    return dict(site.node("Conv").attributes)


def _conv_bias(site: Site) -> ir.Value | None:
    """The Conv's optional third input; exporters omit it or pass an empty name."""
    inputs = site.node("Conv").inputs
    return inputs[2] if len(inputs) > 2 else None


def _per_channel(array: np.ndarray, channels: int, out_rank: int, what: str) -> np.ndarray:
    """A tensor added to (or multiplying) a conv output as one value per output channel, or
    the reason it is not one."""
    if array.ndim > out_rank:
        raise Decline(f"{what} has more axes than the conv output")
    found = per_channel(array, channels, out_rank)
    if found is None:
        raise Decline(
            f"{what} of rank {array.ndim} does not broadcast per output channel "
            "(it must be [C,1,..], [1,C,1,..] or a scalar)"
        )
    return found


def _fold_dtype(reference: np.ndarray) -> Any:
    """Fold in at least double precision, then store in the weights' own type."""
    return np.float64 if reference.dtype.itemsize <= 8 else reference.dtype


def _check_batchnorm(site: Site, **_: Any) -> str | None:
    return inference_refusal(site.node("BatchNormalization"))


def _batchnorm_affine(
    site: Site, params: tuple[ir.Value, ...], channels: int, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Inference BatchNormalization as y = x * factor + offset, one pair per channel."""
    arrays = [
        site.require_constant(v, f"BatchNormalization {n}")
        for v, n in zip(params, ("scale", "bias", "mean", "variance"), strict=True)
    ]
    if any(a.size != channels for a in arrays):
        raise Decline("BatchNormalization parameters do not match the output channels")
    return affine(site.node("BatchNormalization"), arrays, dtype)


def _fold_batchnorm(
    op: Any,
    site: Site,
    x: ir.Value,
    w: ir.Value,
    scale: ir.Value,
    shift: ir.Value,
    mean: ir.Value,
    var: ir.Value,
    added: ir.Value | None = None,
    pre_added: ir.Value | None = None,
    **_: Any,
) -> ir.Value:
    """Conv (-> per-channel Add) -> BatchNormalization (-> per-channel Add) as one Conv."""
    weight = site.require_constant(w, "Conv weight")
    if not np.issubdtype(weight.dtype, np.floating):
        raise Decline(f"Conv weight has non-float type {weight.dtype}")
    channels = weight.shape[0]
    dtype = _fold_dtype(weight)
    factor, offset = _batchnorm_affine(site, (scale, shift, mean, var), channels, dtype)
    bias = _conv_bias(site)
    conv_bias = np.zeros(channels) if bias is None else site.require_constant(bias, "Conv bias")
    if pre_added is not None:
        extra = site.require_constant(pre_added, "added bias")
        conv_bias = conv_bias + _per_channel(extra, channels, weight.ndim, "added bias")
    new_weight = weight.astype(dtype) * factor.reshape((-1,) + (1,) * (weight.ndim - 1))
    new_bias = conv_bias.astype(dtype).reshape(-1) * factor + offset
    if added is not None:
        extra = site.require_constant(added, "added bias")
        new_bias = new_bias + _per_channel(extra, channels, weight.ndim, "added bias")
    return op.Conv(
        x,
        site.initializer(op, new_weight.astype(weight.dtype), "weight"),
        site.initializer(op, new_bias.astype(weight.dtype), "bias"),
        **_conv_attributes(site),
    )


def _conv(op, x, w):
    # The bias input is optional, so the pattern allows it and the rewrite reads it off the node.
    return op.Conv(x, w, _allow_other_inputs=True)


def _conv_bn(op, x, w, scale, shift, mean, var):
    return op.BatchNormalization(_conv(op, x, w), scale, shift, mean, var)


def _conv_bn_add(op, x, w, scale, shift, mean, var, added):
    return op.Add(_conv_bn(op, x, w, scale, shift, mean, var), added)


def _conv_add_bn(op, x, w, pre_added, scale, shift, mean, var):
    return op.BatchNormalization(op.Add(_conv(op, x, w), pre_added), scale, shift, mean, var)


@register_pass
class ConvBatchnormFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvBatchnormFusionPass",
        category=Category.GRAPH,
        description="Conv followed by inference BatchNormalization (with a per-channel Add "
        "before or after it) -> Conv with folded weights",
        aliases=("conv_bn_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=4060,
        emits=("Conv",),
    )
    rules = (
        Rule(
            "ConvBatchnormAdd",
            _conv_bn_add,
            _fold_batchnorm,
            _check_batchnorm,
            candidate=lambda site, added, **_: site.constant(added) is not None,
        ),
        Rule(
            "ConvAddBatchnorm",
            _conv_add_bn,
            _fold_batchnorm,
            _check_batchnorm,
            candidate=lambda site, pre_added, **_: site.constant(pre_added) is not None,
        ),
        Rule("ConvBatchnorm", _conv_bn, _fold_batchnorm, _check_batchnorm),
    )


def _fold_bias_add(op: Any, site: Site, x: ir.Value, w: ir.Value, bias: ir.Value) -> ir.Value:
    if w.shape is None or not isinstance(w.shape[0], int):
        raise Decline("Conv weight shape is unknown")
    channels, out_rank = w.shape[0], len(w.shape)
    added = site.require_constant(bias, "added bias")
    per_channel = _per_channel(added, channels, out_rank, "added bias")
    if w.dtype is not None and added.dtype != w.dtype.numpy():
        raise Decline("added bias and Conv weight have different element types")
    total = per_channel.astype(_fold_dtype(added))
    conv_bias = _conv_bias(site)
    if conv_bias is not None:
        total = total + site.require_constant(conv_bias, "Conv bias").astype(total.dtype)
    new_bias = site.initializer(op, total.astype(added.dtype), "bias")
    return op.Conv(x, w, new_bias, **_conv_attributes(site))


def _conv_add(op, x, w, bias):
    return op.Add(_conv(op, x, w), bias)


def _bias_like(site: Site, w: ir.Value, bias: ir.Value, **_: Any) -> bool:
    """A bias Add adds a constant or something shaped like one; a residual Add of another
    activation map is a different pattern (ConvActivation's), not a near miss of this one."""
    if bias.is_initializer() or bias.is_graph_input() or site.constant(bias) is not None:
        return True
    shape, weight = site.shape(bias), w.shape
    if shape is None or weight is None or not all(isinstance(d, int) for d in shape):
        return False
    padded = (1,) * (len(weight) - len(shape)) + tuple(shape)
    return len(padded) == len(weight) and padded[0] == 1 and all(d == 1 for d in padded[2:])


@register_pass
class ConvBiasAddFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvBiasAddFusionPass",
        category=Category.GRAPH,
        description="Conv followed by a per-channel constant Add -> Conv with that bias",
        aliases=("AABiasaddConvFusion", "conv_bias_add_fusion"),
        numerics=Numerics.REASSOCIATING,
        # After BatchNormalization and scale folding, so Conv -> BN -> Mul -> Add folds whole.
        priority=4080,
        emits=("Conv",),
    )
    rules = (Rule("ConvBiasAdd", _conv_add, _fold_bias_add, candidate=_bias_like),)


def _fold_scale(op: Any, site: Site, x: ir.Value, w: ir.Value, scale: ir.Value) -> ir.Value:
    """Conv -> Mul(per-channel constant): scale each output channel's filter and bias."""
    weight = site.require_constant(w, "Conv weight")
    if not np.issubdtype(weight.dtype, np.floating):
        raise Decline(f"Conv weight has non-float type {weight.dtype}")
    factors = site.require_constant(scale, "scale")
    if factors.dtype != weight.dtype:
        raise Decline("scale and Conv weight have different element types")
    channels = weight.shape[0]
    per_channel = _per_channel(factors, channels, weight.ndim, "scale").astype(_fold_dtype(weight))
    new_weight = weight.astype(per_channel.dtype) * per_channel.reshape(
        (-1,) + (1,) * (weight.ndim - 1)
    )
    inputs = [x, site.initializer(op, new_weight.astype(weight.dtype), "weight")]
    bias = _conv_bias(site)
    if bias is not None:
        scaled = site.require_constant(bias, "Conv bias").astype(per_channel.dtype) * per_channel
        inputs.append(site.initializer(op, scaled.astype(weight.dtype), "bias"))
    return op.Conv(*inputs, **_conv_attributes(site))


def _conv_mul(op, x, w, scale):
    return op.Mul(_conv(op, x, w), scale)


@register_pass
class ConvScaleFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvScaleFusionPass",
        category=Category.GRAPH,
        description="Conv followed by a per-channel constant Mul -> Conv with scaled weights",
        aliases=("conv_scale_fusion", "ConvMulFusion"),
        numerics=Numerics.REASSOCIATING,
        priority=4070,
        emits=("Conv",),
    )
    rules = (Rule("ConvScale", _conv_mul, _fold_scale),)


def _pad_amounts(site: Site, pad: ir.Node) -> np.ndarray:
    """The Pad's begin/end amounts, from the attribute (opset < 11) or the constant input."""
    if pad.attributes.get_string("mode", "constant") != "constant":
        raise Decline("Pad mode is not constant")
    if len(pad.inputs) > 3 and pad.inputs[3] is not None:
        raise Decline("Pad has an axes input")
    if len(pad.inputs) > 1:
        amounts = site.require_constant(pad.inputs[1], "Pad amounts").astype(np.int64)
        value = site.constant(pad.inputs[2]) if len(pad.inputs) > 2 and pad.inputs[2] else None
        fill = 0.0 if value is None and (len(pad.inputs) < 3 or not pad.inputs[2]) else value
        if fill is None:
            raise Decline("Pad value is not a constant")
    else:
        amounts = np.asarray(pad.attributes.get_ints("pads", []), dtype=np.int64)
        fill = pad.attributes.get_float("value", 0.0)
    if np.any(np.asarray(fill) != 0):
        raise Decline("Pad value is not zero")
    return amounts


def _pad_conv(op, x, w):
    return op.Conv(
        op.Pad(x, _allow_other_inputs=True, _allow_other_attributes=True),
        w,
        _allow_other_inputs=True,
    )


def _merge_pad(op: Any, site: Site, x: ir.Value, w: ir.Value) -> ir.Value:
    """Zero padding on spatial axes becomes the Conv's own pads."""
    conv = site.node("Conv")
    if conv.attributes.get_string("auto_pad", "NOTSET") != "NOTSET":
        raise Decline("Conv uses auto_pad")
    amounts = _pad_amounts(site, site.node("Pad"))
    rank = len(amounts) // 2
    begin, end = amounts[:rank], amounts[rank:]
    if np.any(amounts < 0):
        raise Decline("Pad crops (negative amounts)")
    if np.any(begin[:2] != 0) or np.any(end[:2] != 0):
        raise Decline("Pad pads the batch or channel axis")
    spatial = rank - 2
    current = list(conv.attributes.get_ints("pads", [0] * 2 * spatial))
    pads = [int(p) for p in np.asarray(current) + np.concatenate([begin[2:], end[2:]])]
    attributes = {k: v for k, v in conv.attributes.items() if k != "pads"}
    bias = _conv_bias(site)
    inputs = [x, w] if bias is None else [x, w, bias]
    return op.Conv(*inputs, pads=pads, **attributes)


@register_pass
class PadConv2dFusionPass(PatternPass):
    spec = PassSpec(
        name="PadConv2dFusionPass",
        category=Category.GRAPH,
        description="Zero constant Pad on spatial axes followed by Conv -> Conv with those pads",
        aliases=("pad_conv_fusion", "PadFusion"),
        priority=4000,
        emits=("Conv",),
    )
    rules = (Rule("PadConv", _pad_conv, _merge_pad),)


def _fold_transpose_batchnorm(
    op: Any,
    site: Site,
    x: ir.Value,
    w: ir.Value,
    scale: ir.Value,
    shift: ir.Value,
    mean: ir.Value,
    var: ir.Value,
) -> ir.Value:
    """ConvTranspose weights are [C_in, C_out/group, k...]: scale along the output channels."""
    conv = site.node("ConvTranspose")
    weight = site.require_constant(w, "ConvTranspose weight")
    if not np.issubdtype(weight.dtype, np.floating):
        raise Decline(f"ConvTranspose weight has non-float type {weight.dtype}")
    group = conv.attributes.get_int("group", 1)
    channels = weight.shape[1] * group
    dtype = _fold_dtype(weight)
    factor, offset = _batchnorm_affine(site, (scale, shift, mean, var), channels, dtype)
    inputs = conv.inputs
    bias = inputs[2] if len(inputs) > 2 else None
    old_bias = np.zeros(channels) if bias is None else site.require_constant(bias, "bias")
    grouped = weight.astype(dtype).reshape((group, -1, weight.shape[1], *weight.shape[2:]))
    spatial = (1,) * (weight.ndim - 2)
    grouped = grouped * factor.reshape((group, 1, weight.shape[1], *spatial))
    new_bias = old_bias.astype(dtype).reshape(-1) * factor + offset
    return op.ConvTranspose(
        x,
        site.initializer(op, grouped.reshape(weight.shape).astype(weight.dtype), "weight"),
        site.initializer(op, new_bias.astype(weight.dtype), "bias"),
        **dict(conv.attributes),
    )


def _convtranspose_bn(op, x, w, scale, shift, mean, var):
    deconv = op.ConvTranspose(x, w, _allow_other_inputs=True)
    return op.BatchNormalization(deconv, scale, shift, mean, var)


@register_pass
class Conv2DTransposeBatchnormFusionPass(PatternPass):
    spec = PassSpec(
        name="Conv2DTransposeBatchnormFusionPass",
        category=Category.GRAPH,
        description="ConvTranspose followed by inference BatchNormalization -> ConvTranspose "
        "with folded weights",
        aliases=("deconv_bn_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=4061,
        emits=("ConvTranspose",),
    )
    rules = (
        Rule(
            "ConvTransposeBatchnorm", _convtranspose_bn, _fold_transpose_batchnorm, _check_batchnorm
        ),
    )


def _covers_input(site: Site, x: ir.Value, w: ir.Value) -> bool:
    """The pattern proper: a Conv whose kernel spans its whole (static) spatial input."""
    kernel = list(w.shape or [])[2:]
    spatial = list(site.shape(x) or [])[2:]
    return bool(kernel) and all(isinstance(d, int) for d in spatial) and spatial == kernel


def _fully_connected(op: Any, site: Site, x: ir.Value, w: ir.Value) -> Any:
    """A Conv whose kernel covers its whole (unpadded) input is a matrix product."""
    conv = site.root
    kernel = list(w.shape)[2:]
    attrs = conv.attributes
    if attrs.get_int("group", 1) != 1:
        raise Decline("grouped Conv")
    if any(d != 1 for d in attrs.get_ints("dilations", [1] * len(kernel))):
        raise Decline("dilated Conv")
    if any(p != 0 for p in attrs.get_ints("pads", [0])) or attrs.get_string(
        "auto_pad", "NOTSET"
    ) not in ("NOTSET", "VALID"):
        raise Decline("padded Conv")
    site.require_kernel("Gemm", x.dtype)
    weight = site.require_constant(w, "Conv weight")
    channels = weight.shape[0]
    matrix = site.initializer(op, weight.reshape(channels, -1), "weight")
    bias = _conv_bias(site)
    flat = op.Flatten(x, axis=1)
    product = op.Gemm(flat, matrix, bias, transB=1) if bias else op.Gemm(flat, matrix, transB=1)
    shape = np.array([-1, channels] + [1] * len(kernel), dtype=np.int64)
    return op.Reshape(product, site.initializer(op, shape, "shape"))


@register_pass
class ConvToFullyConnectionFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvToFullyConnectionFusionPass",
        category=Category.GRAPH,
        description="Conv whose kernel covers the whole input -> Flatten + Gemm + Reshape "
        "(same output shape)",
        aliases=("conv_to_fully_connection",),
        numerics=Numerics.REASSOCIATING,
        priority=4100,
        min_opset=7,
        # onnxruntime already runs such a Conv as one GEMM; the rewrite only adds nodes there
        # (and keeps the Conv's activation from fusing), so it is for other runtimes.
        default_on=False,
        emits=("Gemm", "Flatten", "Reshape"),
    )
    rules = (Rule("ConvToFullyConnection", _conv, _fully_connected, candidate=_covers_input),)
