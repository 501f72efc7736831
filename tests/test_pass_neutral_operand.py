"""NeutralOperandEliminationPass: ``x * 1``, ``x / 1``, ``x + 0``, ``x - 0`` -> ``x``.

On a Stable Diffusion UNet block from diffusers (tests/fixtures/make_diffusers_fixtures.py):
TorchScript keeps the ResnetBlock2D's ``output_scale_factor`` and each attention's
``rescale_output_factor`` as ``Div(x, 1.0)``, which hid the output projection's bias from the
residual norm; diffusers' classic attention processor adds ``baddbmm``'s zero term
``Expand(0, [B*N, S, L]) * 0`` to the scores, which the attention fusion passed on as a dense
``attention_bias``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import optimize, random_feeds, run_model
from tests.pass_helpers import fixture_path, optimize_checked, reasons, save_model

PASS = "NeutralOperandEliminationPass"
F = TensorProto.FLOAT

# fixture -> (Divs by one, zero score terms, nodes left: the transformer's GroupNorm affine Mul
# and Add folded into its proj_in Conv by ChannelAffineConvFusionPass)
# Nodes left: three fewer Shapes each since a reshape to another tensor's whole shape reads as
# that shape's sizes, a constant target (TorchScript's GroupNorm, an InstanceNormalization of
# the input viewed as groups, reshaped back with ``Reshape(y, Shape(x))``).
EXPECTED = {
    "sd_block_ts17": (3, 0, 49),
    "sd_block_classic_ts17": (3, 2, 118),
    "sd_block_classic_dynamo": (0, 2, 74),  # dynamo folds x / 1.0 itself
}


def _fused(path: Path, op_type: str) -> list[onnx.NodeProto]:
    return [node for node in onnx.load(str(path)).graph.node if node.op_type == op_type]


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_diffusers_neutral_operands_go(fixture: str, tmp_path: Path) -> None:
    divisions, zeros, nodes = EXPECTED[fixture]
    source = fixture_path(fixture)
    run = optimize_checked(source, tmp_path)
    assert run.counts(PASS) == (divisions + zeros, divisions + zeros)
    assert run.passed(PASS)["near_misses"] == []
    assert run.report["model"]["after"]["nodes"] == nodes
    # Each residual norm takes its projection's bias, which the Div by one hid.
    norms = _fused(run.output, "SkipLayerNormalization")
    assert len(norms) == 2 and all(len(norm.input) == 5 for norm in norms)
    # No attention reads a bias: the zero term is gone, not a dense [B*N, 1, S, L] input.
    attentions = _fused(run.output, "MultiHeadAttention") + _fused(run.output, "Attention")
    assert len(attentions) == 2
    assert all(len(node.input) <= 3 for node in attentions)
    for batch in (1, 3):
        dims = {"batch": batch}
        feeds = random_feeds(source, dims=dims)
        for want, got in zip(run_model(source, feeds), run_model(run.output, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_without_the_pass_the_zero_term_is_a_dense_bias(tmp_path: Path) -> None:
    run = optimize(fixture_path("sd_block_classic_dynamo"), tmp_path, "--disable_pass", PASS)
    attentions = _fused(run.output, "MultiHeadAttention")
    assert len(attentions) == 2 and all(node.input[5] for node in attentions)


def _model(
    tmp_path: Path,
    op: str,
    operands: list[str],
    constant: np.ndarray,
    shape: tuple[int, ...] = (2, 3, 4),
) -> Path:
    """``op(operands)`` over ``x`` and the constant ``c``, then a Relu, so that the op does
    not make the graph output."""
    return save_model(
        tmp_path / "neutral.onnx",
        [
            helper.make_node(op, operands, ["t"], name="site"),
            helper.make_node("Relu", ["t"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", F, list(shape))],
        [helper.make_tensor_value_info("y", F, [2, 3, 4])],
        [numpy_helper.from_array(constant, "c")],
    )


@pytest.mark.parametrize(
    ("op", "operands", "constant"),
    [
        ("Mul", ["x", "c"], np.ones((1, 4), np.float32)),
        ("Mul", ["c", "x"], np.array(1.0, np.float32)),
        ("Div", ["x", "c"], np.ones((3, 1), np.float32)),
        ("Add", ["c", "x"], np.zeros((2, 3, 4), np.float32)),
        ("Sub", ["x", "c"], np.zeros((4,), np.float32)),
    ],
)
def test_a_neutral_constant_goes(
    op: str, operands: list[str], constant: np.ndarray, tmp_path: Path
) -> None:
    source = _model(tmp_path, op, operands, constant)
    run = optimize_checked(source, tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert [node.op_type for node in onnx.load(str(run.output)).graph.node] == ["Relu"]
    feeds = random_feeds(source)
    np.testing.assert_array_equal(run_model(run.output, feeds)[0], run_model(source, feeds)[0])


@pytest.mark.parametrize(
    ("op", "operands", "constant"),
    [
        ("Mul", ["x", "c"], np.array([1, 1, 1, 1.0001], np.float32)),  # not every element 1
        ("Sub", ["c", "x"], np.array(0.0, np.float32)),  # 0 - x is -x
        ("Div", ["c", "x"], np.array(1.0, np.float32)),  # 1 / x
        ("Mul", ["x", "c"], np.array(0.0, np.float32)),  # absorbing, not neutral
    ],
)
def test_what_is_not_neutral_stays(
    op: str, operands: list[str], constant: np.ndarray, tmp_path: Path
) -> None:
    run = optimize_checked(_model(tmp_path, op, operands, constant), tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert [node.op_type for node in onnx.load(str(run.output)).graph.node] == [op, "Relu"]


def test_a_neutral_operand_that_broadcasts_x_larger_stays(tmp_path: Path) -> None:
    """``x [2, 3, 1] * ones [1, 4]`` is ``x`` spread to [2, 3, 4]: no Mul to drop."""
    source = _model(tmp_path, "Mul", ["x", "c"], np.ones((1, 4), np.float32), shape=(2, 3, 1))
    run = optimize_checked(source, tmp_path)
    assert run.counts(PASS) == (1, 0)
    assert reasons(run, PASS) == {"the neutral operand is not provably no larger than the other": 1}


def test_a_run_time_zero_goes_where_its_shape_is_the_other_operands(tmp_path: Path) -> None:
    """``s + Expand(0, Shape(s)) * 0`` is ``s`` (the classic baddbmm term, spelled with the
    scores' own shape); ``s + Expand(0, Shape(z))`` broadcasts s [b, ...] to z's [w, ...] where
    b is 1 and w is not, so that Add stays."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Expand", ["zero", "shape"], ["spread"]),
        helper.make_node("Mul", ["spread", "zero"], ["term"]),
        helper.make_node("Add", ["x", "term"], ["t"], name="scores"),
        helper.make_node("Shape", ["z"], ["other"]),
        helper.make_node("Expand", ["zero", "other"], ["wide"]),
        helper.make_node("Add", ["t", "wide"], ["u"], name="wider_scores"),
        helper.make_node("Softmax", ["u"], ["y"]),
    ]
    source = save_model(
        tmp_path / "zero_term.onnx",
        nodes,
        [
            helper.make_tensor_value_info("x", F, ["b", 2, 3, 3]),
            helper.make_tensor_value_info("z", F, ["w", 2, 3, 3]),
        ],
        [helper.make_tensor_value_info("y", F, ["v", 2, 3, 3])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )
    run = optimize_checked(source, tmp_path)
    assert run.counts(PASS) == (2, 1)
    assert reasons(run, PASS) == {"the neutral operand is not provably no larger than the other": 1}
    ops = [node.op_type for node in onnx.load(str(run.output)).graph.node]
    assert ops == ["Shape", "Expand", "Add", "Softmax"]
    for b, w in ((1, 3), (2, 2)):
        feeds = random_feeds(source, dims={"b": b, "w": w})
        got, want = run_model(run.output, feeds)[0], run_model(source, feeds)[0]
        assert got.shape == (w, 2, 3, 3)
        np.testing.assert_array_equal(got, want)


def test_a_graph_input_straight_to_a_graph_output_stays(tmp_path: Path) -> None:
    source = save_model(
        tmp_path / "straight.onnx",
        [helper.make_node("Mul", ["x", "c"], ["y"], name="site")],
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, [2, 3])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "c")],
    )
    run = optimize_checked(source, tmp_path)
    assert reasons(run, PASS) == {
        "it links a graph input or initializer straight to a graph output": 1
    }


@pytest.mark.parametrize(
    ("op", "operands", "constant"),
    [
        ("Mul", ["x", "c"], np.array(-1.0, np.float32)),
        ("Mul", ["c", "x"], -np.ones((1, 4), np.float32)),
        ("Div", ["x", "c"], np.array([-1.0], np.float32)),
    ],
)
def test_a_product_with_minus_one_is_a_negation(
    op: str, operands: list[str], constant: np.ndarray, tmp_path: Path
) -> None:
    """``x * -1`` (paddle2onnx's ``paddle.scale`` by -1) and ``x / -1`` are Neg(x), bit for bit."""
    source = _model(tmp_path, op, operands, constant)
    run = optimize_checked(source, tmp_path)
    assert run.passed(PASS)["patterns"]["SignProduct"] == {"matched": 1, "effected": 1}
    assert [node.op_type for node in onnx.load(str(run.output)).graph.node] == ["Neg", "Relu"]
    feeds = random_feeds(source)
    np.testing.assert_array_equal(run_model(run.output, feeds)[0], run_model(source, feeds)[0])


@pytest.mark.parametrize(
    ("operands", "constant", "shape"),
    [
        (["c", "x"], np.array(-1.0, np.float32), (2, 3, 4)),  # -1 / x is no negation
        (["x", "c"], -np.ones((1, 4), np.float32), (2, 3, 1)),  # x spread to [2, 3, 4]
    ],
)
def test_what_is_no_negation_stays(
    operands: list[str], constant: np.ndarray, shape: tuple[int, ...], tmp_path: Path
) -> None:
    op = "Div" if operands[0] == "c" else "Mul"
    run = optimize_checked(_model(tmp_path, op, operands, constant, shape=shape), tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert [node.op_type for node in onnx.load(str(run.output)).graph.node] == [op, "Relu"]


def test_paddle_rotate_half_negation_becomes_neg(tmp_path: Path) -> None:
    """A LLaMA block through paddle2onnx (tests/fixtures/make_paddle_fixtures.py): each
    rotate_half negates its half as ``x * -1 + 0``; both become Neg, and the rotary
    embeddings of q and k fuse (tests/test_pass_rotary.py)."""
    run = optimize_checked(fixture_path("paddle_llama_paddle2onnx"), tmp_path)
    patterns = run.passed(PASS)["patterns"]
    assert patterns["SignProduct"] == {"matched": 2, "effected": 2}
    assert patterns["NeutralOperand"] == {"matched": 5, "effected": 5}
    assert reasons(run, PASS) == {}
