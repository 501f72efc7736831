"""LinearBatchnormFusionPass: inference BatchNormalization folded into the MatMul or Gemm in front
of it, directly or through a reshape to [rows, columns] (tests/fixtures/make_fixtures.py's
linear_bn: a LeViT LinearNorm on [B, N, C], then Linear + BatchNorm1d)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tests.conftest import FIXTURES
from tests.pass_helpers import (
    assert_declined,
    const,
    conv_batchnorm_params,
    optimize_checked,
    save_model,
    value,
)

PASS = "LinearBatchnormFusionPass"


@pytest.mark.parametrize(
    ("exporter", "folded", "left"),
    [
        # TorchScript keeps both normalizations: LinearNorm's (MatMul -> Flatten -> BN, a
        # Reshape back to Shape(MatMul)) and the head's (Gemm -> BN).
        ("ts17", 2, {"MatMul": 1, "Add": 1, "Flatten": 1, "Shape": 1, "Reshape": 1, "Gemm": 1}),
        # dynamo folds the head's into its Gemm itself; LinearNorm's reads a Reshape to [-1, C].
        ("dynamo", 1, {"MatMul": 1, "Add": 1, "Reshape": 1, "Gemm": 1}),
    ],
)
def test_folds_into_the_map_on_both_exporters(
    tmp_path: Path, exporter: str, folded: int, left: dict[str, int]
) -> None:
    run = optimize_checked(FIXTURES / f"linear_bn_{exporter}.onnx", tmp_path)
    assert run.counts(PASS) == (folded, folded)
    ops = run.op_counts()
    assert ops["BatchNormalization"] == 0
    assert {op: ops[op] for op in left} == left


def _linear_bn(
    path: Path,
    *,
    extra_reader: bool = False,
    rank: int = 2,
    training: bool = False,
    gemm_c: tuple[int, ...] | None = None,
) -> Path:
    """x @ W (or Gemm(x, W, C)) -> BatchNormalization over its 4 columns."""
    rng = np.random.default_rng(0)
    shape = [3, 4] if rank == 2 else [3, 4, 5]
    if gemm_c is not None:
        nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="map")]
        inits = [const("w", rng.normal(size=(6, 4))), const("c", rng.normal(size=gemm_c))]
    else:
        inner = [6, 4] if rank == 2 else [6, 5]  # rank 3: the normalized axis 1 is not W's
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="map")]
        inits = [const("w", rng.normal(size=inner))]
    attrs = {"training_mode": 1} if training else {}
    nodes.append(
        helper.make_node(
            "BatchNormalization",
            ["y", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
            ["z", "running_mean", "running_var"] if training else ["z"],
            name="bn",
            **attrs,
        )
    )
    outputs = [value("z", shape)]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["y"], ["r"], name="other"))
        outputs.append(value("r", shape))
    x_shape = [3, 6] if rank == 2 else [3, 4, 6]
    return save_model(path, nodes, [value("x", x_shape)], outputs, inits + conv_batchnorm_params(4))


def test_a_gemm_with_a_bias_per_column_folds(tmp_path: Path) -> None:
    run = optimize_checked(_linear_bn(tmp_path / "gemm.onnx", gemm_c=(4,)), tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.op_counts() == Counter({"Gemm": 1})


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"extra_reader": True}, "the map's output is also read by another node"),
        (
            {"rank": 3},
            "the BatchNormalization's channels are not the map's columns ([rows, columns])",
        ),
        ({"gemm_c": (3, 4)}, "the Gemm's C is not a constant with one value per column"),
        ({"training": True}, "BatchNormalization is in training mode"),
    ],
)
def test_near_misses(tmp_path: Path, options: dict, reason: str) -> None:
    model = _linear_bn(tmp_path / "near.onnx", **options)
    run = optimize_checked(model, tmp_path, compare=not options.get("training"))
    assert_declined(run, PASS, reason, "bn")
    assert run.op_counts()["BatchNormalization"] == 1


def test_a_product_of_two_activations_is_no_candidate(tmp_path: Path) -> None:
    """Scores normalized per column are not a linear map of one input: no near miss."""
    model = save_model(
        tmp_path / "scores.onnx",
        [
            helper.make_node("MatMul", ["a", "b"], ["y"]),
            helper.make_node(
                "BatchNormalization", ["y", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["z"]
            ),
        ],
        [value("a", [3, 6]), value("b", [6, 4])],
        [value("z", [3, 4])],
        conv_batchnorm_params(4),
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (0, 0)
