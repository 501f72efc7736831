"""GELU spelled out by exporters, in every association order they use, fused into one op.

    erf form   0.5 * x * (1 + erf(x / sqrt(2)))                       (BERT, ViT, nn.GELU)
    tanh form  0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))   (GPT-2 "gelu_new")
    sigmoid    x * sigmoid(alpha * x)                                   (QuickGELU; SiLU at 1)

GraphFusion emits the standard Gelu (opset 20); UBFusion emits onnxruntime's Gelu, BiasGelu,
FastGelu and QuickGelu, which also absorb the bias Add in front (a standard Gelu is only
rewritten when there is such a bias to absorb).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import Category, Numerics, PassSpec, register_pass

MS = "com.microsoft"
_TOLERANCE = 1e-4


def _erf_by_div(op: Any, x: Any, root2: Any) -> Any:
    return op.Erf(op.Div(x, root2))


def _erf_by_mul(op: Any, x: Any, inv_root2: Any) -> Any:
    return op.Erf(op.Mul(x, inv_root2))


def _cube_by_pow(op: Any, x: Any, three: Any) -> Any:
    return op.Pow(x, three)


def _cube_by_mul(op: Any, x: Any) -> Any:
    return op.Mul(op.Mul(x, x), x)


# Each "half" builder takes x, the bracket (1 + f(x)) and the 0.5, and forms 0.5 * x * bracket
# the way one exporter or another associates it.
_HALVES: dict[str, Callable[..., Any]] = {
    "MulMul": lambda op, x, bracket, half: op.Mul(op.Mul(x, bracket), half),
    "HalfFirst": lambda op, x, bracket, half: op.Mul(op.Mul(x, half), bracket),
    "BracketHalf": lambda op, x, bracket, half: op.Mul(x, op.Mul(bracket, half)),
}


def _erf_forms(half: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def by_div(op, x, root2, one, half_value):
        return half(op, x, op.Add(_erf_by_div(op, x, root2), one), half_value)

    def by_mul(op, x, inv_root2, one, half_value):
        return half(op, x, op.Add(_erf_by_mul(op, x, inv_root2), one), half_value)

    return by_div, by_mul


def _tanh_forms(half: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def by_pow(op, x, three, cube_coefficient, tanh_scale, one, half_value):
        inner = op.Add(x, op.Mul(_cube_by_pow(op, x, three), cube_coefficient))
        return half(op, x, op.Add(op.Tanh(op.Mul(inner, tanh_scale)), one), half_value)

    def by_cube(op, x, cube_coefficient, tanh_scale, one, half_value):
        inner = op.Add(x, op.Mul(_cube_by_mul(op, x), cube_coefficient))
        return half(op, x, op.Add(op.Tanh(op.Mul(inner, tanh_scale)), one), half_value)

    return by_pow, by_cube


def _erf_patterns() -> dict[str, Callable[..., Any]]:
    patterns: dict[str, Callable[..., Any]] = {}
    for name, half in _HALVES.items():
        patterns[f"ErfGelu{name}Div"], patterns[f"ErfGelu{name}Mul"] = _erf_forms(half)
    return patterns


def _tanh_patterns() -> dict[str, Callable[..., Any]]:
    patterns: dict[str, Callable[..., Any]] = {}
    for name, half in _HALVES.items():
        patterns[f"TanhGelu{name}Pow"], patterns[f"TanhGelu{name}Cube"] = _tanh_forms(half)
    return patterns


def _scalar(site: Site, value: ir.Value | None, what: str) -> np.ndarray:
    array = site.require_constant(value, what)
    if array.size != 1:
        raise Decline(f"{what} is not a scalar")
    return array.reshape(-1)[:1]


def _expect(site: Site, value: ir.Value | None, want: float, what: str) -> None:
    """The constant is the formula's value as its element type holds it: a float16 model
    stores sqrt(2) as 1.41406 and 0.044715 as 0.0447083 (bfloat16, ml_dtypes' numpy type,
    1.41406 too)."""
    got = _scalar(site, value, what)
    floating = got.dtype.kind == "f" or got.dtype.name == "bfloat16"
    held = float(np.asarray(want).astype(got.dtype)[()]) if floating else want
    if not math.isclose(float(got[0]), held, rel_tol=_TOLERANCE):
        raise Decline(f"{what} is {float(got[0]):g}, the GELU formula needs {want:g}")


def check_erf_gelu(site: Site, **bindings: Any) -> str | None:
    """The constants of the erf form: 0.5, 1 and sqrt(2) (or its inverse as a Mul)."""
    _expect(site, bindings["half_value"], 0.5, "the halving constant")
    _expect(site, bindings["one"], 1.0, "the added constant")
    if "root2" in bindings:
        _expect(site, bindings["root2"], math.sqrt(2), "the erf divisor")
    else:
        _expect(site, bindings["inv_root2"], 1 / math.sqrt(2), "the erf scale")
    return None


def check_tanh_gelu(site: Site, **bindings: Any) -> str | None:
    _expect(site, bindings["half_value"], 0.5, "the halving constant")
    _expect(site, bindings["one"], 1.0, "the added constant")
    _expect(site, bindings["cube_coefficient"], 0.044715, "the cube coefficient")
    _expect(site, bindings["tanh_scale"], math.sqrt(2 / math.pi), "the tanh scale")
    if "three" in bindings:
        _expect(site, bindings["three"], 3.0, "the exponent")
    return None


def _standard_gelu(approximate: str) -> Callable[..., Any]:
    def rewrite(op: Any, site: Site, x: ir.Value, **_: Any) -> ir.Value:
        return op.Gelu(x, approximate=approximate)

    return rewrite


@register_pass
class GeluFusionPass(PatternPass):
    spec = PassSpec(
        name="GeluFusionPass",
        category=Category.GRAPH,
        description="Decomposed GELU (erf form, or tanh form as approximate='tanh') -> Gelu "
        "(opset 20)",
        aliases=("GeluONNXFusionPass", "gelu_fusion"),
        numerics=Numerics.REASSOCIATING,
        min_opset=20,
        emits=("Gelu",),
    )
    rules = (
        *(
            Rule(name, p, _standard_gelu("none"), check_erf_gelu)
            for name, p in _erf_patterns().items()
        ),
        *(
            Rule(name, p, _standard_gelu("tanh"), check_tanh_gelu)
            for name, p in _tanh_patterns().items()
        ),
    )


def _with_bias(pattern: Callable[..., Any]) -> Callable[..., Any]:
    """The same GELU pattern over x = Add(a, bias): the bias Add the kernel absorbs."""
    names = [p for p in inspect.signature(pattern).parameters if p not in ("op", "x")]
    parameters = ["a", "bias", *names]

    def biased(op: Any, *args: Any, **kwargs: Any) -> Any:
        values = {**dict(zip(parameters, args, strict=False)), **kwargs}
        rest = {name: values[name] for name in names}
        return pattern(op, op.Add(values["a"], values["bias"]), **rest)

    biased.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("op", *parameters)]
    )
    return biased


def _bias_vector(site: Site, a: ir.Value, bias: ir.Value) -> None:
    """The contrib kernels take a 1-D bias over the last axis of the other operand."""
    array = site.require_constant(bias, "bias")
    shape = site.shape(a)
    if array.ndim != 1 or shape is None or shape[-1] != array.shape[0]:
        raise Decline("the bias is not a 1-D vector over the last axis")


def _contrib(op_type: str, biased: bool, **attributes: Any) -> Callable[..., Any]:
    def rewrite(op: Any, site: Site, **bindings: Any) -> ir.Value:
        if biased:
            a, bias = bindings["a"], bindings["bias"]
            _bias_vector(site, a, bias)
            site.require_kernel(op_type, site.dtype(a), MS)
            return getattr(op, op_type)(a, bias, _domain=MS, **attributes)
        x = bindings["x"]
        site.require_kernel(op_type, site.dtype(x), MS)
        return getattr(op, op_type)(x, _domain=MS, **attributes)

    return rewrite


def _gelu_op(op: Any, x: Any) -> Any:
    return op.Gelu(x, _allow_other_attributes=True)


def _check_standard(approximate: str) -> Callable[..., str | None]:
    def check(site: Site, **_: Any) -> str | None:
        gelu = site.node("Gelu")
        if gelu.attributes.get_string("approximate", "none") != approximate:
            return f"Gelu is not approximate='{approximate}'"
        return None

    return check


@register_pass
class BiasGeluFusionPass(PatternPass):
    spec = PassSpec(
        name="BiasGeluFusionPass",
        category=Category.UB,
        description="bias Add + erf GELU -> com.microsoft BiasGelu (a lone erf GELU -> Gelu)",
        aliases=("matmul_elem_gelu_fusion", "BiasGeluFusion"),
        numerics=Numerics.REASSOCIATING,
        targets=("ort",),
        emits=("BiasGelu", "Gelu"),
        emits_domain=MS,
    )
    rules = (
        *(
            Rule(f"Bias{name}", _with_bias(p), _contrib("BiasGelu", True), check_erf_gelu)
            for name, p in _erf_patterns().items()
        ),
        Rule("BiasGelu", _with_bias(_gelu_op), _contrib("BiasGelu", True), _check_standard("none")),
        *(
            Rule(name, p, _contrib("Gelu", False), check_erf_gelu)
            for name, p in _erf_patterns().items()
        ),
    )


@register_pass
class FastGeluFusionPass(PatternPass):
    spec = PassSpec(
        name="FastGeluFusionPass",
        category=Category.UB,
        description="(bias Add +) tanh-form GELU -> com.microsoft FastGelu",
        aliases=("fast_gelu_fusion", "FastGeluFusion"),
        numerics=Numerics.REASSOCIATING,
        targets=("ort",),
        emits=("FastGelu",),
        emits_domain=MS,
    )
    rules = (
        *(
            Rule(f"Bias{name}", _with_bias(p), _contrib("FastGelu", True), check_tanh_gelu)
            for name, p in _tanh_patterns().items()
        ),
        Rule(
            "BiasGeluTanh",
            _with_bias(_gelu_op),
            _contrib("FastGelu", True),
            _check_standard("tanh"),
        ),
        *(
            Rule(name, p, _contrib("FastGelu", False), check_tanh_gelu)
            for name, p in _tanh_patterns().items()
        ),
    )


def _silu(op: Any, x: Any) -> Any:
    return op.Mul(x, op.Sigmoid(x))


def _quick_gelu(op: Any, x: Any, alpha: Any) -> Any:
    return op.Mul(x, op.Sigmoid(op.Mul(x, alpha)))


def _to_quick_gelu(op: Any, site: Site, x: ir.Value, alpha: ir.Value | None = None) -> Any:
    value = 1.0 if alpha is None else float(_scalar(site, alpha, "alpha")[0])
    site.require_kernel("QuickGelu", site.dtype(x), MS)
    return op.QuickGelu(x, _domain=MS, alpha=value)


@register_pass
class QuickGeluFusionPass(PatternPass):
    spec = PassSpec(
        name="QuickGeluFusionPass",
        category=Category.UB,
        description="x * sigmoid(alpha * x) (SiLU when alpha is 1) -> com.microsoft QuickGelu",
        aliases=("quick_gelu_fusion", "QuickGeluFusion"),
        targets=("ort",),
        emits=("QuickGelu",),
        emits_domain=MS,
    )
    rules = (
        Rule("QuickGelu", _quick_gelu, _to_quick_gelu),
        Rule("Silu", _silu, _to_quick_gelu),
    )
