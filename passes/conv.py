"""Convolution folding: BatchNormalization and per-channel bias Adds folded into Conv weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.patterns import Decline, PatternPass, Rule, Site
from fusectl.registry import Category, Numerics, PassSpec, register_pass


def _conv_attributes(site: Site) -> dict[str, ir.Attr]:
    return dict(site.node("Conv").attributes)


def _conv_bias(site: Site) -> ir.Value | None:
    """The Conv's optional third input; exporters omit it or pass an empty name."""
    inputs = site.node("Conv").inputs
    return inputs[2] if len(inputs) > 2 else None


def _per_channel(array: np.ndarray, channels: int, out_rank: int, what: str) -> np.ndarray:
    """Flatten a tensor added to a conv output to one value per output channel, if it is one.

    Broadcasting aligns trailing axes, so [C,1,1] or [1,C,1,1] (or a scalar) add per channel
    of an NCHW output, while a bare [C] would add along the last spatial axis.
    """
    if array.ndim > out_rank:
        raise Decline(f"{what} has more axes than the conv output")
    padded = (1,) * (out_rank - array.ndim) + array.shape
    if padded[0] != 1 or any(d != 1 for d in padded[2:]) or padded[1] not in (1, channels):
        raise Decline(
            f"{what} of rank {array.ndim} does not broadcast per output channel "
            "(it must be [C,1,..], [1,C,1,..] or a scalar)"
        )
    return np.broadcast_to(array.reshape(-1), (channels,))


def _fold_dtype(reference: np.ndarray) -> Any:
    """Fold in at least double precision, then store in the weights' own type."""
    return np.float64 if reference.dtype.itemsize <= 8 else reference.dtype


def _check_batchnorm(site: Site, **_: Any) -> str | None:
    batchnorm = site.node("BatchNormalization")
    if batchnorm.attributes.get_int("training_mode", 0) != 0:
        return "BatchNormalization is in training mode"
    if batchnorm.attributes.get_int("spatial", 1) != 1:
        return "BatchNormalization has spatial=0"
    return None


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
    **_: Any,
) -> ir.Value:
    """Conv -> BatchNormalization (-> per-channel Add) as one Conv with new weights and bias."""
    weight = site.require_constant(w, "Conv weight")
    if not np.issubdtype(weight.dtype, np.floating):
        raise Decline(f"Conv weight has non-float type {weight.dtype}")
    params = [
        site.require_constant(v, f"BatchNormalization {n}")
        for v, n in ((scale, "scale"), (shift, "bias"), (mean, "mean"), (var, "variance"))
    ]
    channels = weight.shape[0]
    if any(p.size != channels for p in params):
        raise Decline("BatchNormalization parameters do not match the Conv's output channels")
    bias = _conv_bias(site)
    conv_bias = np.zeros(channels) if bias is None else site.require_constant(bias, "Conv bias")
    epsilon = site.node("BatchNormalization").attributes.get_float("epsilon", 1e-5)
    dtype = _fold_dtype(weight)
    g, beta, mu, sigma2 = (p.astype(dtype).reshape(-1) for p in params)
    factor = g / np.sqrt(sigma2 + np.asarray(epsilon, dtype))
    new_weight = weight.astype(dtype) * factor.reshape((-1,) + (1,) * (weight.ndim - 1))
    new_bias = (conv_bias.astype(dtype).reshape(-1) - mu) * factor + beta
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


@register_pass
class ConvBatchnormFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvBatchnormFusionPass",
        category=Category.GRAPH,
        description="Conv followed by inference BatchNormalization (and a per-channel Add) "
        "-> Conv with folded weights",
        aliases=("conv_bn_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=4060,
        emits=("Conv",),
    )
    rules = (
        Rule("ConvBatchnormAdd", _conv_bn_add, _fold_batchnorm, _check_batchnorm),
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


@register_pass
class ConvBiasAddFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvBiasAddFusionPass",
        category=Category.GRAPH,
        description="Conv followed by a per-channel constant Add -> Conv with that bias",
        aliases=("AABiasaddConvFusion", "conv_bias_add_fusion"),
        numerics=Numerics.REASSOCIATING,
        priority=4010,
        emits=("Conv",),
    )
    rules = (Rule("ConvBiasAdd", _conv_add, _fold_bias_add),)
