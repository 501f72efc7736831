"""UB fusion into onnxruntime kernels: Conv and Gemm with their activation in one kernel
(com.microsoft FusedConv / FusedGemm), Conv with a residual Add as FusedConv's sum input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import Category, Numerics, PassSpec, register_pass
from fusectl.rewrite.shapes import equal_shapes

MS = "com.microsoft"
_FLOAT_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Activation:
    """An activation node as the fused kernels take it."""

    name: str
    params: tuple[float, ...] = ()  # FusedConv's activation_params
    attributes: dict[str, float] = field(default_factory=dict)  # FusedGemm's activation_*


def _scalar(site: Site, value: ir.Value | None, default: float, what: str) -> float:
    if value is None:
        return default
    array = site.require_constant(value, what)
    if array.size != 1:
        raise Decline(f"{what} is not a scalar")
    return float(array.reshape(-1)[0])


def describe_activation(site: Site, node: ir.Node) -> Activation:
    attrs = node.attributes
    if node.op_type == "LeakyRelu":
        alpha = attrs.get_float("alpha", 0.01)
        return Activation("LeakyRelu", (alpha,), {"alpha": alpha})
    if node.op_type == "HardSigmoid":
        alpha, beta = attrs.get_float("alpha", 0.2), attrs.get_float("beta", 0.5)
        return Activation("HardSigmoid", (alpha, beta), {"alpha": alpha, "beta": beta})
    if node.op_type == "Clip":
        if len(node.inputs) > 1:  # opset 11+: optional min and max inputs
            inputs = [*node.inputs, None, None]
            low = _scalar(site, inputs[1], -_FLOAT_MAX, "Clip min")
            high = _scalar(site, inputs[2], _FLOAT_MAX, "Clip max")
        else:
            low, high = attrs.get_float("min", -_FLOAT_MAX), attrs.get_float("max", _FLOAT_MAX)
        return Activation("Clip", (low, high))
    return Activation(node.op_type)


CONV_ACTIVATIONS = ("Relu", "LeakyRelu", "Sigmoid", "Tanh", "Clip", "HardSigmoid")
GEMM_ACTIVATIONS = ("Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid")


def _activation_of(producer: Callable[..., Any], activation: str) -> Callable[..., Any]:
    """The pattern `activation(producer(...))` with the producer's own variables."""

    def pattern(op: Any, x: Any, w: Any) -> Any:
        return getattr(op, activation)(
            producer(op, x, w), _allow_other_inputs=True, _allow_other_attributes=True
        )

    return pattern


def _conv(op: Any, x: Any, w: Any) -> Any:
    return op.Conv(x, w, _allow_other_inputs=True)


def _fused_conv(
    op: Any, site: Site, x: ir.Value, w: ir.Value, z: ir.Value | None = None, **_: Any
) -> ir.Value:
    conv = site.node("Conv")
    site.require_kernel("FusedConv", x.dtype, MS)
    activation = describe_activation(site, site.root)
    bias = conv.inputs[2] if len(conv.inputs) > 2 else None
    inputs: list[ir.Value | None] = [x, w, bias]
    if z is not None:
        if z is conv.outputs[0]:
            raise Decline("the residual is the Conv output itself")
        shapes = site.ctx.shapes
        same = (
            shapes.same_shape(conv.outputs[0], z)
            if shapes is not None
            else equal_shapes(site.shape(conv.outputs[0]), site.shape(z))
        )
        if not same:
            raise Decline("the residual is not known to have the Conv output's shape")
        inputs.append(z)
    while inputs and inputs[-1] is None:
        inputs.pop()
    params = {"activation_params": list(activation.params)} if activation.params else {}
    return op.FusedConv(
        *inputs, _domain=MS, activation=activation.name, **params, **dict(conv.attributes)
    )


def _conv_residual_relu(join: str) -> Callable[..., Any]:
    """Relu(join(Conv(x, w), z)) for join = Add, or a two-input Sum (older exporters)."""

    def pattern(op: Any, x: Any, w: Any, z: Any) -> Any:
        return op.Relu(getattr(op, join)(_conv(op, x, w), z))

    return pattern


@register_pass
class ConvActivationFusionPass(PatternPass):
    spec = PassSpec(
        name="ConvActivationFusionPass",
        category=Category.UB,
        description="Conv + Relu/LeakyRelu/Sigmoid/Tanh/Clip/HardSigmoid (and Conv + residual "
        "Add + Relu) -> com.microsoft FusedConv",
        aliases=("conv_activation_fusion", "TbeConv2DReluv2Pass"),
        # The kernel adds the residual in another order than Conv, then Add: torchvision's
        # FCN-ResNet-50 output (magnitude 90) moves by 1e-4, past the exact tolerance.
        numerics=Numerics.REASSOCIATING,
        targets=("ort",),
        emits=("FusedConv",),
        emits_domain=MS,
    )
    rules = (
        Rule("ConvAddRelu", _conv_residual_relu("Add"), _fused_conv),
        Rule("ConvSumRelu", _conv_residual_relu("Sum"), _fused_conv),
        *(
            Rule(f"Conv{name}", _activation_of(_conv, name), _fused_conv)
            for name in CONV_ACTIVATIONS
        ),
    )


def _gemm(op: Any, x: Any, w: Any) -> Any:
    return op.Gemm(x, w, _allow_other_inputs=True, _allow_other_attributes=True)


def _fused_gemm(op: Any, site: Site, x: ir.Value, w: ir.Value) -> ir.Value:
    gemm = site.node("Gemm")
    site.require_kernel("FusedGemm", x.dtype, MS)
    activation = describe_activation(site, site.root)
    extra = {f"activation_{key}": value for key, value in activation.attributes.items()}
    return op.FusedGemm(
        *gemm.inputs, _domain=MS, activation=activation.name, **extra, **dict(gemm.attributes)
    )


@register_pass
class GemmActivationFusionPass(PatternPass):
    spec = PassSpec(
        name="GemmActivationFusionPass",
        category=Category.UB,
        description="Gemm + Relu/LeakyRelu/Sigmoid/Tanh/HardSigmoid -> com.microsoft FusedGemm",
        aliases=("matmul_elem_relu_fusion", "GemmActivationFusion"),
        targets=("ort",),
        emits=("FusedGemm",),
        emits_domain=MS,
    )
    rules = tuple(
        Rule(f"Gemm{name}", _activation_of(_gemm, name), _fused_gemm) for name in GEMM_ACTIVATIONS
    )
