"""UB fusion: constant scalar scaling around a MatMul folded into onnxruntime's FusedMatMul.

Attention scores are the common case: exporters scale q and k by d**-0.25 each (or divide the
product by sqrt(d)); FusedMatMul applies one alpha inside the product.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from fusectl.patterns import PatternPass, Rule, Site
from fusectl.registry import Category, Numerics, PassSpec, register_pass

MS = "com.microsoft"


def _scalar(site: Site, value: ir.Value) -> float:
    return float(site.require_constant(value, "the scale").reshape(-1)[0])


def _fused(alpha_of: Any) -> Any:
    """A rewrite to FusedMatMul(a, b, alpha) with alpha computed from the bound scales."""

    def rewrite(op: Any, site: Site, a: ir.Value, b: ir.Value, **scales: ir.Value) -> ir.Value:
        alpha = alpha_of(**{name: _scalar(site, v) for name, v in scales.items()})
        site.require_kernel("FusedMatMul", site.dtype(a), MS)
        return op.FusedMatMul(a, b, _domain=MS, alpha=alpha)

    return rewrite


def _constant_scales(site: Site, a: ir.Value, b: ir.Value, **scales: ir.Value) -> bool:
    """Only a constant scalar is a scale: a Mul by an activation (SwiGLU's gate) or by a norm's
    weight vector is a different thing, not a near miss."""
    for value in scales.values():
        array = site.constant(value)
        if array is None or array.size != 1:
            return False
    return True


@register_pass
class MatMulScaleFusionPass(PatternPass):
    spec = PassSpec(
        name="MatMulScaleFusionPass",
        category=Category.UB,
        description="MatMul scaled by constant scalars (on an input, both inputs, or the "
        "product; Mul or Div) -> com.microsoft FusedMatMul with alpha",
        aliases=("matmul_scale_fusion", "MatMulScaleFusion"),
        numerics=Numerics.REASSOCIATING,
        priority=5900,
        targets=("ort",),
        emits=("FusedMatMul",),
        emits_domain=MS,
    )
    rules = (
        Rule(
            "ScaleBoth",
            lambda op, a, b, s, t: op.MatMul(op.Mul(a, s), op.Mul(b, t)),
            _fused(lambda s, t: s * t),
            candidate=_constant_scales,
        ),
        Rule(
            "ScaleA",
            lambda op, a, b, s: op.MatMul(op.Mul(a, s), b),
            _fused(lambda s: s),
            candidate=_constant_scales,
        ),
        Rule(
            "ScaleB",
            lambda op, a, b, s: op.MatMul(a, op.Mul(b, s)),
            _fused(lambda s: s),
            candidate=_constant_scales,
        ),
        Rule(
            "ScaleProduct",
            lambda op, a, b, s: op.Mul(op.MatMul(a, b), s),
            _fused(lambda s: s),
            candidate=_constant_scales,
        ),
        Rule(
            "DivideProduct",
            lambda op, a, b, s: op.Div(op.MatMul(a, b), s),
            _fused(lambda s: 1.0 / s),
            candidate=_constant_scales,
        ),
    )
