"""GELU family: GeluFusionPass (standard Gelu, opset 20) and the onnxruntime BiasGelu, Gelu,
FastGelu and QuickGelu fusions, on every association order exporters write."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from tests.conftest import optimize
from tests.pass_helpers import (
    assert_declined,
    check_output,
    const,
    fixture_path,
    optimize_checked,
    reasons,
    save_model,
    value,
)

GELU, BIAS_GELU = "GeluFusionPass", "BiasGeluFusionPass"
FAST, QUICK = "FastGeluFusionPass", "QuickGeluFusionPass"
SHAPE = [2, 3, 8]


def _n(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output, **attrs)


def _erf(x: str, *, order: str, scale: str, out: str = "y") -> list[onnx.NodeProto]:
    """0.5 * x * (1 + erf(x / sqrt2)) in one of the exporters' association orders."""
    inner = (
        _n("Div", [x, "root2"], "scaled")
        if scale == "div"
        else _n("Mul", [x, "inv_root2"], "scaled")
    )
    nodes = [inner, _n("Erf", ["scaled"], "erf"), _n("Add", ["erf", "one"], "bracket")]
    if order == "MulMul":
        nodes += [_n("Mul", [x, "bracket"], "xb"), _n("Mul", ["xb", "half"], out)]
    elif order == "HalfFirst":
        nodes += [_n("Mul", ["half", x], "hx"), _n("Mul", ["hx", "bracket"], out)]
    else:
        nodes += [_n("Mul", ["bracket", "half"], "bh"), _n("Mul", [x, "bh"], out)]
    return nodes


def _tanh(x: str, *, cube: str, out: str = "y") -> list[onnx.NodeProto]:
    """GPT-2's gelu_new: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    if cube == "pow":
        nodes = [_n("Pow", [x, "three"], "cubed")]
    else:
        nodes = [_n("Mul", [x, x], "squared"), _n("Mul", ["squared", x], "cubed")]
    return [
        *nodes,
        _n("Mul", ["coefficient", "cubed"], "term"),
        _n("Add", [x, "term"], "inner"),
        _n("Mul", ["inner", "tanh_scale"], "scaled"),
        _n("Tanh", ["scaled"], "tanh"),
        _n("Add", ["one", "tanh"], "bracket"),
        _n("Mul", [x, "half"], "hx"),
        _n("Mul", ["hx", "bracket"], out),
    ]


CONSTANTS = {
    "root2": math.sqrt(2),
    "inv_root2": 1 / math.sqrt(2),
    "one": 1.0,
    "half": 0.5,
    "three": 3.0,
    "coefficient": 0.044715,
    "tanh_scale": math.sqrt(2 / math.pi),
}


def _model(
    path: Path,
    nodes: list,
    *,
    opset: int = 17,
    bias: bool = False,
    dtype: type = np.float32,
    **overrides: float,
) -> Path:
    constants = {**CONSTANTS, **overrides}
    inits = [const(k, np.array(v), dtype) for k, v in constants.items()]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if bias:
        nodes = [_n("Add", ["a", "bias"], "x"), *nodes]
        inits.append(const("bias", np.linspace(-1, 1, SHAPE[-1]), dtype))
        inputs = [value("a", SHAPE, elem)]
    else:
        inputs = [value("x", SHAPE, elem)]
    return save_model(path, nodes, inputs, [value("y", SHAPE, elem)], inits, opset=opset)


ERF_CASES = [
    (order, scale) for order in ("MulMul", "HalfFirst", "BracketHalf") for scale in ("div", "mul")
]


@pytest.mark.parametrize(("order", "scale"), ERF_CASES)
def test_erf_gelu_becomes_bias_gelu_or_gelu(order: str, scale: str, tmp_path: Path) -> None:
    biased = _model(tmp_path / "biased.onnx", _erf("x", order=order, scale=scale), bias=True)
    run = optimize_checked(biased, tmp_path)
    # Below opset 20 the standard Gelu does not exist: the graph pass says so and the UB
    # pass fuses the bias Add with it.
    assert_declined(run, GELU, "Gelu needs opset >= 20, model has 17", "y")
    assert run.counts(BIAS_GELU) == (1, 1)
    assert run.op_counts() == Counter({"BiasGelu": 1})
    plain = _model(tmp_path / "plain.onnx", _erf("x", order=order, scale=scale))
    run = optimize_checked(plain, tmp_path)
    assert run.counts(BIAS_GELU) == (1, 1)
    assert run.op_counts() == Counter({"Gelu": 1})
    assert {n.domain for n in onnx.load(str(run.output)).graph.node} == {"com.microsoft"}


@pytest.mark.parametrize("cube", ["pow", "mul"])
def test_tanh_gelu_becomes_fast_gelu(cube: str, tmp_path: Path) -> None:
    run = optimize_checked(_model(tmp_path / "t.onnx", _tanh("x", cube=cube), bias=True), tmp_path)
    assert run.counts(FAST) == (1, 1)
    assert run.op_counts() == Counter({"FastGelu": 1})
    fused = onnx.load(str(run.output)).graph.node[0]
    assert list(fused.input) == ["a", "bias"]


def test_opset_20_gets_the_standard_gelu(tmp_path: Path) -> None:
    """Both forms side by side on one input; the tanh form's names get a t_ prefix."""
    erf_nodes = _erf("x", order="MulMul", scale="div", out="y0")
    tanh_nodes = [
        _n(
            n.op_type,
            [i if i in ("x", *CONSTANTS) else f"t_{i}" for i in n.input],
            "t" if n.output[0] == "y" else f"t_{n.output[0]}",
        )
        for n in _tanh("x", cube="pow")
    ]
    nodes = [*erf_nodes, *tanh_nodes, _n("Add", ["y0", "t"], "y")]
    model = _model(tmp_path / "opset20.onnx", nodes, opset=20)
    run = optimize_checked(model, tmp_path)
    assert run.counts(GELU) == (2, 2)
    assert run.op_counts() == Counter({"Gelu": 2, "Add": 1})
    approximations = sorted(
        next((a.s.decode() for a in n.attribute if a.name == "approximate"), "none")
        for n in onnx.load(str(run.output)).graph.node
        if n.op_type == "Gelu"
    )
    assert approximations == ["none", "tanh"]
    portable = optimize_checked(model, tmp_path, "--target", "onnx")
    assert portable.op_counts() == Counter({"Gelu": 2, "Add": 1})


def test_wrong_constant_is_declined(tmp_path: Path) -> None:
    model = _model(tmp_path / "wrong.onnx", _erf("x", order="MulMul", scale="div"), half=0.6)
    run = optimize_checked(model, tmp_path)
    assert_declined(run, BIAS_GELU, "the halving constant is 0.6, the GELU formula needs 0.5", "y")
    assert run.op_counts()["Erf"] == 1


def test_float16_constants_are_the_formula_rounded_to_float16(tmp_path: Path) -> None:
    """A float16 model stores sqrt(2) as 1.41406 and 0.044715 as 0.0447083: each constant is
    compared with the formula's value in its own type. onnxruntime has no float16 kernel of
    any GELU op on the CPU, so for --target onnx (opset 20) the standard Gelu is what fuses,
    checked against the ONNX reference implementation."""
    nodes = [*_erf("x", order="MulMul", scale="div", out="y0")]
    nodes += [
        _n(
            n.op_type,
            [i if i in ("x", *CONSTANTS) else f"t_{i}" for i in n.input],
            "t" if n.output[0] == "y" else f"t_{n.output[0]}",
        )
        for n in _tanh("x", cube="pow")
    ]
    nodes.append(_n("Add", ["y0", "t"], "y"))
    model = _model(tmp_path / "fp16.onnx", nodes, opset=20, dtype=np.float16)
    run = optimize_checked(model, tmp_path, "--target", "onnx", compare=False)
    assert run.counts(GELU) == (2, 2)
    assert run.op_counts() == Counter({"Gelu": 2, "Add": 1})
    x = np.random.default_rng(0).normal(0, 2, SHAPE).astype(np.float16)
    (want,) = ReferenceEvaluator(str(model)).run(None, {"x": x})
    (got,) = ReferenceEvaluator(str(run.output)).run(None, {"x": x})
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=1e-2)
    # onnxruntime's CPU provider runs the float16 contrib op in float32, casting around it.
    biased = _erf("x", order="MulMul", scale="div")
    half = _model(tmp_path / "biased.onnx", biased, bias=True, dtype=np.float16)
    run = optimize_checked(half, tmp_path, atol=1e-2)
    assert run.counts(BIAS_GELU) == (1, 1)
    assert run.op_counts() == Counter({"BiasGelu": 1})
    # No provider runs a bfloat16 BiasGelu: declined for the kernel, not for the constants.
    bf16 = _model(tmp_path / "biased_bf16.onnx", biased, bias=True, dtype=ml_dtypes.bfloat16)
    run = optimize_checked(bf16, tmp_path, compare=False)
    assert_declined(
        run, BIAS_GELU, "onnxruntime has no com.microsoft.BiasGelu kernel for BFLOAT16", "y"
    )


def test_bfloat16_constants_are_the_formula_rounded_to_bfloat16(tmp_path: Path) -> None:
    """bfloat16 (ml_dtypes' numpy type) holds sqrt(2) as 1.41406 too; the standard Gelu fuses
    (neither onnxruntime nor the reference implementation runs a bfloat16 Gelu here)."""
    nodes = _erf("x", order="MulMul", scale="div")
    model = _model(tmp_path / "bf16.onnx", nodes, opset=20, dtype=ml_dtypes.bfloat16)
    run = optimize(model, tmp_path, "--target", "onnx")
    check_output(run)
    assert run.counts(GELU) == (1, 1)
    assert run.op_counts() == Counter({"Gelu": 1})


def test_float16_export_gelu_fuses(tmp_path: Path) -> None:
    """BERT exported in half precision (dynamo): its erf divisor is float16's sqrt(2), and
    onnxruntime's CPU provider runs the float16 BiasGelu in float32."""
    run = optimize_checked(fixture_path("fp16_bert_tiny_dynamo"), tmp_path, atol=1e-2)
    assert run.counts(BIAS_GELU) == (2, 2)
    ops = run.op_counts()
    assert ops["BiasGelu"] == 2 and ops["Erf"] == 0
    # the rest of the encoder fuses alike (the embedding sum and norm: EmbedLayerNormalization)
    rest = {"Attention": 2, "SkipLayerNormalization": 4, "EmbedLayerNormalization": 1}
    assert {op: ops[op] for op in rest} == rest


@pytest.mark.parametrize(
    ("dtype", "root2", "shown"),
    [
        (np.float16, 1.5, "1.5"),  # float16, but not sqrt(2) in float16
        (np.float32, float(np.float16(math.sqrt(2))), "1.41406"),  # float16's sqrt(2) in float32
    ],
)
def test_constant_not_the_formula_in_its_own_type_is_declined(
    dtype: type, root2: float, shown: str, tmp_path: Path
) -> None:
    nodes = _erf("x", order="MulMul", scale="div")
    model = _model(tmp_path / "off.onnx", nodes, opset=20, dtype=dtype, root2=root2)
    run = optimize_checked(model, tmp_path, "--target", "onnx", compare=False)
    assert_declined(run, GELU, f"the erf divisor is {shown}, the GELU formula needs 1.41421", "y")


def test_shared_intermediate_is_declined(tmp_path: Path) -> None:
    nodes = [*_erf("x", order="MulMul", scale="div"), _n("Neg", ["erf"], "leak")]
    model = save_model(
        tmp_path / "shared.onnx",
        nodes,
        [value("x", SHAPE)],
        [value("y", SHAPE), value("leak", SHAPE)],
        [const(k, np.array(v, np.float32)) for k, v in CONSTANTS.items()],
    )
    run = optimize_checked(model, tmp_path)
    reason = "an intermediate value (Erf output) is also used by Neg outside the match"
    assert reasons(run, BIAS_GELU) == {reason: 1}
    assert run.counts(BIAS_GELU) == (1, 0)


def test_bias_that_is_not_a_vector_keeps_the_add(tmp_path: Path) -> None:
    nodes = [_n("Add", ["a", "bias"], "x"), *_erf("x", order="MulMul", scale="div")]
    model = save_model(
        tmp_path / "bias2d.onnx",
        nodes,
        [value("a", SHAPE)],
        [value("y", SHAPE)],
        [const(k, np.array(v, np.float32)) for k, v in CONSTANTS.items()]
        + [const("bias", np.ones((3, 8), np.float32))],
    )
    run = optimize_checked(model, tmp_path)
    # The bias form declines; the plain erf GELU behind the Add still fuses, as one candidate.
    assert run.counts(BIAS_GELU) == (1, 1)
    assert run.op_counts() == Counter({"Add": 1, "Gelu": 1})


@pytest.mark.parametrize(("alpha", "expected"), [(None, 1.0), (1.702, 1.702)])
def test_silu_and_quick_gelu(alpha: float | None, expected: float, tmp_path: Path) -> None:
    if alpha is None:
        nodes = [_n("Sigmoid", ["x"], "s"), _n("Mul", ["x", "s"], "y")]
        inits = []
    else:
        nodes = [
            _n("Mul", ["x", "alpha"], "ax"),
            _n("Sigmoid", ["ax"], "s"),
            _n("Mul", ["s", "x"], "y"),
        ]
        inits = [const("alpha", np.array(alpha, np.float32))]
    model = save_model(
        tmp_path / "quick.onnx", nodes, [value("x", SHAPE)], [value("y", SHAPE)], inits
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(QUICK) == (1, 1)
    (node,) = onnx.load(str(run.output)).graph.node
    assert node.op_type == "QuickGelu"
    assert next(a.f for a in node.attribute if a.name == "alpha") == pytest.approx(expected)


def test_target_onnx_leaves_decomposed_gelu(tmp_path: Path) -> None:
    model = _model(tmp_path / "t.onnx", _erf("x", order="HalfFirst", scale="mul"), bias=True)
    run = optimize_checked(model, tmp_path, "--target", "onnx")
    assert run.passed(BIAS_GELU)["state"] == "off"
    assert run.op_counts()["Erf"] == 1
