"""VarianceCanonicalizationPass: a variance written as the mean square less the squared mean
(Flax's LayerNorm through jax2onnx) written centred, which the norm passes read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tests.pass_helpers import (
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

PASS = "VarianceCanonicalizationPass"
FLAX = fixture_path("flax_encoder_jax2onnx")


def _activations(batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {"x": (3 + 2 * rng.standard_normal((batch, 8, 32))).astype(np.float32)}


def test_flax_layer_norms_fuse(tmp_path: Path) -> None:
    """Flax's encoder block (tests/fixtures/make_jax_fixtures.py): its three LayerNorms'
    variances are written centred, and every norm fuses (two with their residual Add)."""
    run = optimize_checked(FLAX, tmp_path)
    assert pattern_counts(run, PASS) == {"RawMomentVariance": (3, 3)}
    assert reasons(run, PASS) == {}
    assert run.counts("LayerNormFusionPass") == (3, 3)
    assert run.counts("AddLayerNormFusionPass") == (2, 2)
    ops = run.op_counts()
    assert (ops["LayerNormalization"], ops["SkipLayerNormalization"]) == (1, 2)
    for gone in ("ReduceMean", "Max", "Sqrt", "Sub"):
        assert gone not in ops
    for batch in (1, 3):  # activations far from zero: where the raw moments cancel
        compare_on_feeds(FLAX, run.output, _activations(batch))
    assert_second_run_changes_nothing(run, tmp_path, PASS)


def _raw_moment_norm(
    path: Path,
    *,
    clamp: str | None = "Max",
    squared_mean_of: str = "x",
    second_axes: tuple[int, ...] = (-1,),
    keepdims: int = 1,
    norm: bool = True,
) -> Path:
    """A layer norm over the last axis of x [2, 5, 8] whose variance is mean(x * x) -
    mean(x)^2 (clamped by ``clamp``), or that variance alone where not ``norm``."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1], keepdims=keepdims),
        helper.make_node("ReduceMean", ["w"], ["mean_w"], axes=[-1], keepdims=keepdims),
        helper.make_node("Mul", ["x", "x"], ["square"]),
        helper.make_node(
            "ReduceMean", ["square"], ["second"], axes=list(second_axes), keepdims=keepdims
        ),
        helper.make_node("Mul", [f"mean{'' if squared_mean_of == 'x' else '_w'}"] * 2, ["msq"]),
        helper.make_node("Sub", ["second", "msq"], ["raw"]),
    ]
    variance = "raw"
    if clamp == "Max":
        nodes.append(helper.make_node("Max", ["raw", "zero"], ["variance"]))
    elif clamp == "Relu":
        nodes.append(helper.make_node("Relu", ["raw"], ["variance"]))
    elif clamp == "Clip":
        nodes.append(helper.make_node("Clip", ["raw", "zero"], ["variance"]))
    if clamp is not None:
        variance = "variance"
    shape = [2, 5, 8]
    output = value("y", shape if norm else [2, 5, 1][: 3 - (1 - keepdims)])
    if norm:
        nodes += [
            helper.make_node("Sub", ["x", "mean"], ["centred"]),
            helper.make_node("Add", [variance, "eps"], ["shifted"]),
            helper.make_node("Sqrt", ["shifted"], ["deviation"]),
            helper.make_node("Div", ["centred", "deviation"], ["normalised"]),
            helper.make_node("Mul", ["normalised", "gamma"], ["scaled"]),
            helper.make_node("Add", ["scaled", "beta"], ["y"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", [variance], ["y"]))
    rng = np.random.default_rng(0)
    initializers = [
        const("zero", 0.0),
        const("eps", 1e-5),
        const("gamma", 1 + 0.1 * rng.standard_normal(8)),
        const("beta", 0.1 * rng.standard_normal(8)),
    ]
    inputs = [value("x", shape), value("w", shape)]
    return save_model(path, nodes, inputs, [output], initializers)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "x": (5 + rng.standard_normal((2, 5, 8))).astype(np.float32),
        "w": rng.standard_normal((2, 5, 8)).astype(np.float32),
    }


@pytest.mark.parametrize("clamp", ["Max", "Relu", "Clip", None])
def test_raw_moment_layer_norm_fuses(tmp_path: Path, clamp: str | None) -> None:
    """However the variance is clamped (or not), the norm becomes one LayerNormalization."""
    model = _raw_moment_norm(tmp_path / "norm.onnx", clamp=clamp)
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.counts("LayerNormFusionPass") == (1, 1)
    assert run.op_counts() == {"LayerNormalization": 1}
    compare_on_feeds(model, run.output, _feeds())


def test_variance_alone_is_centred_with_a_new_subtraction(tmp_path: Path) -> None:
    """A variance no norm reads (no centring to share): one Sub is written for it."""
    model = _raw_moment_norm(tmp_path / "variance.onnx", norm=False)
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    ops = run.op_counts()
    assert (ops["Sub"], ops["ReduceMean"], ops.get("Max", 0)) == (1, 2, 0)
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            {"squared_mean_of": "w"},
            "the squared mean is not of the value whose square is averaged",
        ),
        ({"second_axes": (-2, -1), "norm": False}, "the two means average different axes"),
        ({"keepdims": 0, "norm": False}, "a mean does not keep its axes"),
    ],
)
def test_near_misses_are_declined(tmp_path: Path, edit: dict, reason: str) -> None:
    """A difference of a mean square and a squared mean that is no variance stays, with why."""
    model = _raw_moment_norm(tmp_path / "near.onnx", **edit)
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 0)
    assert reasons(run, PASS) == {reason: 1}
    assert run.counts("LayerNormFusionPass")[1] == 0
    compare_on_feeds(model, run.output, _feeds())


def test_a_raw_moment_norm_left_written_out_is_counted(tmp_path: Path) -> None:
    """The coverage line counts a norm whose variance is the mean square less a squared mean
    (its Sqrt four ops below the mean square) even where it is not fused: not a silent gap."""
    model = _raw_moment_norm(tmp_path / "near.onnx", squared_mean_of="w")
    run = optimize_checked(model, tmp_path)
    norms = run.report["coverage"]["norms"]
    assert (norms["fused"], norms["total"]) == (0, 1)


MINDSPORE = fixture_path("mindspore_bert_ms")


def test_mindspore_layer_norms_fuse(tmp_path: Path) -> None:
    """A BERT layer through MindSpore's exporter (tests/fixtures/make_mindspore_fixtures.py):
    its three LayerNorms' variances are ReduceSumSquare(x - mean) / 32, means written as sums
    over their count. As means, every norm fuses (opset 11: the skip forms); before, none was
    even counted."""
    run = optimize_checked(MINDSPORE, tmp_path)
    assert pattern_counts(run, PASS) == {"SumOverCount": (3, 3)}
    assert run.report["coverage"]["norms"] == {"fused": 3, "total": 3, "unfused": []}
    ops = run.op_counts()
    assert (ops["SkipLayerNormalization"], ops["SkipSimplifiedLayerNormalization"]) == (2, 1)
    assert "ReduceSumSquare" not in ops
    rng = np.random.default_rng(3)
    feeds = {
        "input_ids": rng.integers(0, 64, (2, 8)).astype(np.int32),
        "attention_mask": np.array([[1] * 8, [1] * 5 + [0] * 3], np.int32),
    }
    compare_on_feeds(MINDSPORE, run.output, feeds)


def _sum_over_count(
    path: Path, *, op: str = "ReduceSumSquare", divisor: float = 8.0, multiply: bool = False
) -> Path:
    """y = op(x [2, "seq", 8], axes [-1], keepdims) / divisor (or * divisor)."""
    nodes = [
        helper.make_node(op, ["x"], ["total"], axes=[-1], keepdims=1)
        if op == "ReduceSumSquare"
        else helper.make_node(op, ["x", "axes"], ["total"], keepdims=1),
        helper.make_node("Mul" if multiply else "Div", ["total", "n"], ["y"]),
    ]
    initializers = [const("n", divisor)]
    if op != "ReduceSumSquare":
        initializers.append(const("axes", [-1], np.int64))
    inputs = [value("x", [2, "seq", 8])]
    return save_model(path, nodes, inputs, [value("y", [2, "seq", 1])], initializers)


@pytest.mark.parametrize(
    ("options", "ops"),
    [
        ({}, {"Pow": 1, "ReduceMean": 1}),  # the square as the norm passes read it
        ({"divisor": 0.125, "multiply": True}, {"Pow": 1, "ReduceMean": 1}),
        ({"op": "ReduceSum"}, {"ReduceMean": 1}),
    ],
)
def test_a_sum_over_its_count_is_a_mean(tmp_path: Path, options: dict, ops: dict) -> None:
    model = _sum_over_count(tmp_path / "mean.onnx", **options)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {"SumOverCount": (1, 1)}
    assert run.op_counts() == ops


@pytest.mark.parametrize(
    "options", [{"divisor": 4.0}, {"op": "ReduceSum", "divisor": 2.0, "multiply": True}]
)
def test_a_sum_over_another_number_stays(tmp_path: Path, options: dict) -> None:
    """Divided by 4 (or times 2), the sum of 8 elements is no mean: it stays as written."""
    model = _sum_over_count(tmp_path / "scaled.onnx", **options)
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert run.op_counts()[options.get("op", "ReduceSumSquare")] == 1


@pytest.mark.parametrize(
    ("axes", "divisor", "means"), [(None, 48.0, 1), ([], 48.0, 1), ([], 8.0, 0)]
)
def test_a_sum_over_every_axis_counts_them_all(
    tmp_path: Path, axes: list[int] | None, divisor: float, means: int
) -> None:
    """ReduceSum without axes (or with an empty list) adds up every element of x [2, 3, 8]:
    divided by 48 it is the mean of all, by 8 (one axis's size) no mean."""
    inputs = ["x"] if axes is None else ["x", "axes"]
    nodes = [
        helper.make_node("ReduceSum", inputs, ["total"], keepdims=1),
        helper.make_node("Div", ["total", "n"], ["y"]),
    ]
    initializers = [const("n", divisor), const("axes", np.array(axes or [], np.int64), np.int64)]
    model = save_model(
        tmp_path / "all.onnx",
        nodes,
        [value("x", [2, 3, 8])],
        [value("y", [1, 1, 1])],
        initializers if axes is not None else initializers[:1],
    )
    run = optimize_checked(model, tmp_path)
    assert run.op_counts().get("ReduceMean", 0) == means
    assert run.counts(PASS) == (means, means)
