"""PowerCanonicalizationPass: Pow(s, -0.5) and Pow(s, 0.5) written as Reciprocal(Sqrt(s)) and
Sqrt(s), so Gemma-3n's RMS norm (``x * pow(mean(x^2) + eps, -0.5) * w``, after a residual
Add) becomes the skip norm LLaMA's does, and a square written x * x that only means read as
Pow(x, 2) (ImageGPT's norm); the powers and products it leaves, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tests.pass_helpers import (
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    save_model,
    value,
)

POWER = "PowerCanonicalizationPass"
HIDDEN = 16


def _rms_norm(path: Path, exponent: float, *, product: bool = False, read: bool = False) -> Path:
    """y = h * Pow(ReduceMean(Pow(h, 2)) + eps, exponent) * w with h = a + b (a residual);
    the square as h * h with ``product``, also read by the output's Add with ``read``."""
    square = ["h", "h"] if product else ["h", "two"]
    nodes = [
        helper.make_node("Add", ["a", "b"], ["h"]),
        helper.make_node("Mul" if product else "Pow", square, ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["mean"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["variance"]),
        helper.make_node("Pow", ["variance", "exponent"], ["scale"]),
        helper.make_node("Mul", ["h", "scale"], ["normed"]),
        helper.make_node("Mul", ["normed", "w"], ["wy" if read else "y"]),
    ]
    if read:
        nodes.append(helper.make_node("Add", ["wy", "squared"], ["y"]))
    rng = np.random.default_rng(0)
    initializers = [
        const("two", 2.0),
        const("eps", 1e-6),
        const("exponent", exponent),
        const("w", rng.normal(size=HIDDEN)),
    ]
    inputs = [value("a", ["B", "S", HIDDEN]), value("b", ["B", "S", HIDDEN])]
    return save_model(path, nodes, inputs, [value("y", ["B", "S", HIDDEN])], initializers)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {name: rng.normal(size=(2, 5, HIDDEN)).astype(np.float32) for name in "ab"}


def test_gemma3n_rms_norm_becomes_a_skip_norm(tmp_path: Path) -> None:
    model = _rms_norm(tmp_path / "rms.onnx", -0.5)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, POWER) == {"RsqrtPower": (1, 1)}
    ops = run.op_counts()
    assert ops["SkipSimplifiedLayerNormalization"] == 1 and ops["Pow"] == 0
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize("exponent", [0.5, 2.0, -1.0])
def test_other_powers(tmp_path: Path, exponent: float) -> None:
    """A square root becomes Sqrt; any other power stays a Pow (and the norm is no norm)."""
    model = _rms_norm(tmp_path / "other.onnx", exponent)
    run = optimize_checked(model, tmp_path, compare=False)
    expected = {"SqrtPower": (1, 1)} if exponent == 0.5 else {}
    assert pattern_counts(run, POWER) == expected
    assert run.op_counts()["SkipSimplifiedLayerNormalization"] == 0
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_imagegpt_norm_squared_as_a_product(exporter: str, tmp_path: Path) -> None:
    """ImageGPT's RMS-style norm: TorchScript writes its square x * x, dynamo Pow(x, 2). Both
    fuse all five norms (four after a residual Add), the product made a Pow first."""
    run = optimize_checked(fixture_path(f"arch/imagegpt_{exporter}"), tmp_path)
    squares = {"SquareProduct": (5, 5)} if exporter == "ts17" else {}
    assert pattern_counts(run, POWER) == squares
    assert run.op_counts()["SkipSimplifiedLayerNormalization"] == 5
    assert run.op_counts()["ReduceMean"] == 0


@pytest.mark.parametrize("read", [False, True])
def test_a_product_of_a_value_with_itself_is_a_square_where_only_means_read_it(
    read: bool, tmp_path: Path
) -> None:
    """h * h read by the mean alone becomes Pow(h, 2) and the norm fuses; read by something
    else too (here the output's Add), it stays a product: GELU's x * x * x, a gate."""
    model = _rms_norm(tmp_path / "product.onnx", -0.5, product=True, read=read)
    run = optimize_checked(model, tmp_path, compare=False)
    expected = {"RsqrtPower": (1, 1)} | ({} if read else {"SquareProduct": (1, 1)})
    assert pattern_counts(run, POWER) == expected
    assert run.op_counts()["SkipSimplifiedLayerNormalization"] == (0 if read else 1)
    compare_on_feeds(model, run.output, _feeds())
