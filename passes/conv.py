"""Convolution folding: BatchNormalization and per-channel bias Adds folded into Conv weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.patterns import Decline, PatternPass, Rule, Site
from fusectl.registry import Category, Numerics, PassSpec, register_pass


def _conv_attributes(site: Site) -> dict[str, ir.Attr]:
    return dict(site.node("Conv").attributes)


def _per_channel(array: np.ndarray, channels: int, out_rank: int, what: str) -> np.ndarray:
    """Flatten a tensor added to a conv output to one value per output channel, if it is one.

    Broadcasting aligns trailing axes, so [C,1,1] or [1,C,1,1] (or a scalar) add per channel
    of an NCHW output, while a bare [C] would add along the last spatial axis.
    """
    if array.ndim > out_rank:
        raise Decline(f"{what} of shape {list(array.shape)} has more axes than the conv output")
    padded = (1,) * (out_rank - array.ndim) + array.shape
    if padded[0] != 1 or any(d != 1 for d in padded[2:]) or padded[1] not in (1, channels):
        raise Decline(f"{what} of shape {list(array.shape)} does not broadcast per output channel")
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
    b: ir.Value | None = None,
    **_: Any,
) -> ir.Value:
    weight = site.require_constant(w, "Conv weight")
    if not np.issubdtype(weight.dtype, np.floating):
        raise Decline(f"Conv weight has non-float type {weight.dtype}")
    params = [
        site.require_constant(v, f"BatchNormalization {n}")
        for v, n in ((scale, "scale"), (shift, "bias"), (mean, "mean"), (var, "variance"))
    ]
    channels = weight.shape[0]
    if any(p.size != channels for p in params):
        raise Decline(f"BatchNormalization parameters do not have {channels} channels")
    conv_bias = np.zeros(channels) if b is None else site.require_constant(b, "Conv bias")
    epsilon = site.node("BatchNormalization").attributes.get_float("epsilon", 1e-5)
    dtype = _fold_dtype(weight)
    g, beta, mu, sigma2 = (p.astype(dtype).reshape(-1) for p in params)
    factor = g / np.sqrt(sigma2 + np.asarray(epsilon, dtype))
    new_weight = weight.astype(dtype) * factor.reshape((-1,) + (1,) * (weight.ndim - 1))
    new_bias = (conv_bias.astype(dtype).reshape(-1) - mu) * factor + beta
    return op.Conv(
        x,
        site.initializer(op, new_weight.astype(weight.dtype), "weight"),
        site.initializer(op, new_bias.astype(weight.dtype), "bias"),
        **_conv_attributes(site),
    )


def _conv_bn_with_bias(op, x, w, b, scale, shift, mean, var):
    return op.BatchNormalization(op.Conv(x, w, b), scale, shift, mean, var)


def _conv_bn(op, x, w, scale, shift, mean, var):
    return op.BatchNormalization(op.Conv(x, w), scale, shift, mean, var)


@register_pass
class ConvBatchnormFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvBatchnormFusionPass",
        category=Category.GRAPH,
        description="Conv followed by inference BatchNormalization -> Conv with folded weights",
        aliases=("conv_bn_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=4060,
        emits=("Conv",),
    )
    rules = (
        Rule("ConvBiasBatchnorm", _conv_bn_with_bias, _fold_batchnorm, _check_batchnorm),
        Rule("ConvBatchnorm", _conv_bn, _fold_batchnorm, _check_batchnorm),
    )


def _fold_bias_add(
    op: Any, site: Site, x: ir.Value, w: ir.Value, bias: ir.Value, b: ir.Value | None = None
) -> ir.Value:
    if w.shape is None or not isinstance(w.shape[0], int):
        raise Decline("Conv weight shape is unknown")
    channels, out_rank = w.shape[0], len(w.shape)
    added = site.require_constant(bias, "added bias")
    per_channel = _per_channel(added, channels, out_rank, "added bias")
    if w.dtype is not None and added.dtype != w.dtype.numpy():
        raise Decline(f"added bias has type {added.dtype}, weight has {w.dtype.numpy()}")
    total = per_channel.astype(_fold_dtype(added))
    if b is not None:
        total = total + site.require_constant(b, "Conv bias").astype(total.dtype)
    return op.Conv(
        x, w, site.initializer(op, total.astype(added.dtype), "bias"), **_conv_attributes(site)
    )


def _conv_add_with_bias(op, x, w, b, bias):
    return op.Add(op.Conv(x, w, b), bias)


def _conv_add(op, x, w, bias):
    return op.Add(op.Conv(x, w), bias)


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
    rules = (
        Rule("ConvBiasAdd", _conv_add, _fold_bias_add),
        Rule("ConvWithBiasAdd", _conv_add_with_bias, _fold_bias_add),
    )
