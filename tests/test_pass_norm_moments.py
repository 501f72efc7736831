"""MomentsNormCanonicalizationPass: Keras's layer norm in TensorFlow's moments form, through
tf2onnx, written out as the layer norm passes read it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import digest, optimize
from tests.pass_helpers import (
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

PASS = "MomentsNormCanonicalizationPass"
ENCODER = fixture_path("keras_encoder_tf2onnx")


def test_keras_layer_norms_through_tf2onnx_fuse(tmp_path: Path) -> None:
    """A Keras encoder block (tests/fixtures/make_keras_fixtures.py): one norm with a shift,
    one without (center=False). Each was 13 nodes (11 without the shift)."""
    run = optimize_checked(ENCODER, tmp_path)
    assert pattern_counts(run, PASS) == {"MomentsLayerNorm": (2, 2), "MomentsMean": (4, 4)}
    assert reasons(run, PASS) == {}
    assert pattern_counts(run, "LayerNormFusionPass") == {
        "LayerNormPow": (1, 1),
        "LayerNormPowNoShift": (1, 1),
        "LayerNormPowNoScale": (0, 0),
    }
    ops = run.op_counts()
    # both norms follow a residual Add, now that the einsums around them are recognized
    # (tests/test_pass_einsum_recognition.py) and the sums' shapes known
    assert (ops["LayerNormalization"], ops["SkipLayerNormalization"]) == (0, 2)
    assert {op: ops[op] for op in ("GlobalAveragePool", "Reciprocal", "Sqrt", "Neg")} == {
        "GlobalAveragePool": 0,
        "Reciprocal": 0,
        "Sqrt": 0,
        "Neg": 0,
    }
    folders = [tmp_path / "second", tmp_path / "third"]
    for folder in folders:
        folder.mkdir()
    second = optimize(run.output, folders[0])
    assert second.counts(PASS) == (0, 0)
    assert digest(optimize(second.output, folders[1]).output) == digest(second.output)


def _moments_norm(
    path: Path,
    *,
    mean_sign: int = -1,
    gamma_input: bool = False,
    variance_axes: list[int] | None = None,
    shape: tuple[int, ...] = (2, 5, 8),
    opset: int = 17,
    mean_twice: bool = False,
) -> Path:
    """Keras's LayerNormalization as tf2onnx writes it: GlobalAveragePool means (ReduceMean
    over ``variance_axes`` for the variance, if given), Sqrt + Reciprocal, and
    ``x * m + (mean_sign * mean * m + beta)``."""
    hidden = shape[-1]
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["mean"]),
        helper.make_node("Sub", ["x", "mean"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["squared"]),
        (
            helper.make_node("GlobalAveragePool", ["squared"], ["variance"])
            if variance_axes is None
            else helper.make_node(
                "ReduceMean", ["squared"], ["variance"], axes=variance_axes, keepdims=1
            )
        ),
        helper.make_node("Add", ["variance", "eps"], ["shifted"]),
        helper.make_node("Sqrt", ["shifted"], ["std"]),
        helper.make_node("Reciprocal", ["std"], ["rstd"], name="rsqrt"),
        helper.make_node("Mul", ["rstd", "gamma"], ["m"]),
        helper.make_node("Mul", ["x", "m"], ["x_m"]),
    ]
    if mean_sign < 0:
        nodes += [
            helper.make_node("Neg", ["mean"], ["neg_mean"]),
            helper.make_node("Mul", ["neg_mean", "m"], ["mean_m"]),
        ]
    else:
        nodes.append(helper.make_node("Mul", ["mean", "m"], ["mean_m"]))
    if mean_twice:  # x * m - 2 * mean * m + beta: not a norm
        nodes.append(helper.make_node("Add", ["mean_m", "mean_m"], ["mean_m2"]))
    nodes += [
        helper.make_node("Add", ["mean_m2" if mean_twice else "mean_m", "beta"], ["offset"]),
        helper.make_node("Add", ["x_m", "offset"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    inputs = [value("x", list(shape))]
    initializers = [
        const("eps", np.array(1e-6)),
        const("beta", rng.normal(size=(1, 1, hidden))),
    ]
    if gamma_input:
        inputs.append(value("gamma", [hidden]))
    else:
        initializers.append(const("gamma", rng.normal(size=(1, 1, hidden))))
    if opset >= 18 and variance_axes is not None:
        nodes[3] = helper.make_node("ReduceMean", ["squared", "axes"], ["variance"], keepdims=1)
        initializers.append(const("axes", np.array(variance_axes), np.int64))
    return save_model(path, nodes, inputs, [value("y", list(shape))], initializers, opset=opset)


@pytest.mark.parametrize("opset", [17, 18])
def test_a_helper_built_moments_norm_fuses(opset: int, tmp_path: Path) -> None:
    """From opset 18 the means take their axes as an input."""
    run = optimize_checked(_moments_norm(tmp_path / "norm.onnx", opset=opset), tmp_path)
    assert pattern_counts(run, PASS) == {"MomentsLayerNorm": (1, 1), "MomentsMean": (2, 2)}
    assert run.op_counts() == Counter({"LayerNormalization": 1})


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"mean_sign": 1}, "the output is not x * m - mean * m: a sign differs"),
        ({"gamma_input": True}, "gamma is not a constant"),
        ({"mean_twice": True}, "a summand is added twice"),
        ({"variance_axes": [1]}, "the variance is not a mean over the trailing axes"),
        (
            {"shape": (2, 3, 4, 8)},  # a 4-D GlobalAveragePool averages two axes, not one
            "the variance is not a mean over the trailing axes",
        ),
    ],
)
def test_near_misses_stay_with_their_reason(options: dict, reason: str, tmp_path: Path) -> None:
    model = _moments_norm(tmp_path / "near.onnx", **options)
    run = optimize_checked(model, tmp_path)
    assert reasons(run, PASS) == {reason: 1}
    assert run.counts(PASS) == (1, 0)
    assert run.op_counts()["Reciprocal"] == 1
    assert "LayerNormalization" not in run.op_counts()


def test_the_shift_is_the_one_constant_added_next(tmp_path: Path) -> None:
    """A sum that goes on past the norm (a residual added to its output) is not the norm's."""
    model = _moments_norm(tmp_path / "norm.onnx")
    residual = tmp_path / "residual.onnx"
    proto = onnx.load(str(model))
    proto.graph.node.append(helper.make_node("Add", ["y", "x"], ["z"]))
    proto.graph.output[0].CopyFrom(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 5, 8]))
    onnx.save(proto, str(residual))
    run = optimize_checked(residual, tmp_path)
    assert pattern_counts(run, PASS)["MomentsLayerNorm"] == (1, 1)
    assert run.op_counts() == Counter({"LayerNormalization": 1, "Add": 1})
