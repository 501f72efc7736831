"""UB fusions into onnxruntime's FusedMatMul: constant scalar scaling around a MatMul (alpha),
and a Transpose of the last two axes of an operand (transA / transB).

Attention scores are the common case for the scale: exporters scale q and k by d**-0.25 each
(or divide the product by sqrt(d)). A transposed operand is typical of tied weights (GPT-2's
lm_head reads the embedding table through a Transpose): folding that Transpose would copy the
table, reading it transposed costs nothing.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import Category, Numerics, PassSpec, register_pass

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


def _swaps_last_two(node: ir.Node, rank: int | None) -> bool:
    perm = node.attributes.get_ints("perm", None)
    if perm is None:  # default: reverse all axes, the last two swapped only when rank is 2
        return rank == 2
    perm = list(perm)
    return (
        len(perm) >= 2
        and perm[-2:] == [len(perm) - 1, len(perm) - 2]
        and perm[:-2] == list(range(len(perm) - 2))
    )


def _transposed(side: str) -> Any:
    def rewrite(op: Any, site: Site, a: ir.Value, b: ir.Value) -> ir.Value:
        transpose = site.node("Transpose")
        source = b if side == "B" else a
        shape = site.shape(source)
        if not _swaps_last_two(transpose, None if shape is None else len(shape)):
            raise Decline("the Transpose does not just swap the last two axes")
        site.require_kernel("FusedMatMul", site.dtype(a), MS)
        return op.FusedMatMul(a, b, _domain=MS, alpha=1.0, **{f"trans{side}": 1})

    return rewrite


@register_pass
class MatMulTransposeFusionPass(PatternPass):
    spec = PassSpec(
        name="MatMulTransposeFusionPass",
        category=Category.UB,
        description="MatMul of an operand transposed in its last two axes -> com.microsoft "
        "FusedMatMul with transA / transB (no transposed copy)",
        aliases=("matmul_transpose_fusion", "MatmulTransposeFusion"),
        priority=5910,
        targets=("ort",),
        emits=("FusedMatMul",),
        emits_domain=MS,
    )
    rules = (
        Rule(
            "TransposeB",
            lambda op, a, b: op.MatMul(a, op.Transpose(b, _allow_other_attributes=True)),
            _transposed("B"),
            commute=False,
        ),
        Rule(
            "TransposeA",
            lambda op, a, b: op.MatMul(op.Transpose(a, _allow_other_attributes=True), b),
            _transposed("A"),
            commute=False,
        ),
    )
