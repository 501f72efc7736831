"""LinearBatchnormFusionPass: inference BatchNormalization folded into the MatMul or Gemm in front
of it, directly or through a reshape to [rows, columns], or into the one that reads it
(tests/fixtures/make_fixtures.py's linear_bn: a LeViT LinearNorm on [B, N, C], Linear +
BatchNorm1d, then BatchNorm1d + Linear)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
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
        # TorchScript keeps all three normalizations: LinearNorm's (MatMul -> Flatten -> BN, a
        # Reshape back to Shape(MatMul)), the embedding's (Gemm -> BN, a graph output) and the
        # classifier's (BN -> Gemm), which folds into the Gemm that reads it.
        ("ts17", 3, {"MatMul": 1, "Add": 1, "Flatten": 1, "Shape": 1, "Reshape": 1, "Gemm": 2}),
        # dynamo folds the embedding's into its Gemm itself; LinearNorm's reads a Reshape.
        ("dynamo", 2, {"MatMul": 1, "Add": 1, "Reshape": 1, "Gemm": 2}),
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


def _batchnorm(source: str, target: str) -> onnx.NodeProto:
    """An inference BatchNormalization 'bn' over 4 channels (conv_batchnorm_params)."""
    parameters = ["bn_scale", "bn_bias", "bn_mean", "bn_var"]
    return helper.make_node("BatchNormalization", [source, *parameters], [target], name="bn")


def _bn_linear(path: Path, op: str = "MatMul", rank: int = 2, **attrs: float) -> Path:
    """BatchNormalization over [3, 4] (or [3, 4, 5]) -> MatMul by W [4, 6], or Gemm."""
    rng = np.random.default_rng(1)
    shape = [3, 4] if rank == 2 else [3, 4, 5]
    inits = conv_batchnorm_params(4)
    if op == "Gemm":
        transposed = attrs.get("transB", 0)
        inits += [
            const("w", rng.normal(size=(6, 4) if transposed else (4, 6))),
            const("c", rng.normal(size=6)),
        ]
        linear = helper.make_node("Gemm", ["n", "w", "c"], ["y"], name="map", **attrs)
        out = [3, 6]
    else:
        inits.append(const("w", rng.normal(size=(shape[-1], 6))))
        linear = helper.make_node("MatMul", ["n", "w"], ["y"], name="map")
        out = [*shape[:-1], 6]
    nodes = [
        _batchnorm("x", "n"),
        linear,
    ]
    return save_model(path, nodes, [value("x", shape)], [value("y", out)], inits)


@pytest.mark.parametrize(
    ("op", "attrs", "left"),
    [
        ("MatMul", {}, {"Gemm": 1}),  # its MatMul + bias Add, 2-D: a Gemm (MatMulBiasAdd)
        ("Gemm", {"transB": 1, "alpha": 0.5, "beta": 2.0}, {"Gemm": 1}),
        ("Gemm", {"alpha": 1.5}, {"Gemm": 1}),
    ],
)
def test_folds_into_the_map_that_reads_it(
    tmp_path: Path, op: str, attrs: dict, left: dict[str, int]
) -> None:
    """(x * f + o) @ W = x @ (f W) + o @ W: the shift joins the map's bias."""
    run = optimize_checked(_bn_linear(tmp_path / "before.onnx", op, **attrs), tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.op_counts() == Counter(left)


@pytest.mark.parametrize(
    ("op", "options", "reason"),
    [
        (
            "MatMul",
            {"rank": 3},
            "the BatchNormalization's channels are not the map's input columns ([rows, columns])",
        ),
        ("Gemm", {"transA": 1}, "the Gemm reads the normalized [rows, channels] transposed"),
    ],
)
def test_near_misses_before_a_map(tmp_path: Path, op: str, options: dict, reason: str) -> None:
    rank = options.pop("rank", 2)
    if op == "Gemm":  # transA reads the [4, 3]-shaped normalized input as [3, 4]: square it
        model = _square_gemm(tmp_path / "trans.onnx")
    else:
        model = _bn_linear(tmp_path / "near.onnx", op, rank, **options)
    run = optimize_checked(model, tmp_path)
    assert_declined(run, PASS, reason, "bn")
    assert run.op_counts()["BatchNormalization"] == 1


def _square_gemm(path: Path) -> Path:
    """BatchNormalization over [4, 4] read transposed by a Gemm (transA): the normalized
    channels are the Gemm's rows there, not its contraction."""
    rng = np.random.default_rng(2)
    nodes = [
        _batchnorm("x", "n"),
        helper.make_node("Gemm", ["n", "w"], ["y"], name="map", transA=1),
    ]
    inits = [*conv_batchnorm_params(4), const("w", rng.normal(size=(4, 6)))]
    return save_model(path, nodes, [value("x", [4, 4])], [value("y", [4, 6])], inits)
