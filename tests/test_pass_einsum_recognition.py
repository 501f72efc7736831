"""EinsumRecognitionPass: a MatMul between chains of layout ops (tf2onnx's decomposed Einsum)
written as the Einsum it computes, which the attention passes then read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import optimize
from tests.pass_helpers import (
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    reasons,
    save_model,
    value,
)

PASS = "EinsumRecognitionPass"
LOWERING = "EinsumMatMulCanonicalizationPass"
# Ops tf2onnx's decomposition computes with, none of which the recognized sites keep.
DECOMPOSITION = ("Unsqueeze", "Squeeze", "ReduceProd", "Max")


def _ids(batch: int, length: int, vocabulary: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(0, vocabulary, (batch, length)).astype(np.int32)}


def test_keras_encoder_attention_and_dense_layers_through_tf2onnx(tmp_path: Path) -> None:
    """Keras's MultiHeadAttention and Dense layers (tests/fixtures/make_keras_fixtures.py):
    the scores and the context (``aecd,abcd->acbe``, ``acbe,aecd->abcd``, through 5-D
    Transposes) and the two Dense layers' tensordots (flattened to 2-D) are recognized. The
    output projection, a head merge (4-D to 3-D) and a MatMul, is read by the fusions as it
    is: no candidate."""
    run = optimize_checked(fixture_path("keras_encoder_tf2onnx"), tmp_path)
    assert run.counts(PASS) == (4, 4)
    assert reasons(run, PASS) == {}
    assert run.counts(LOWERING) == (4, 4)
    ops = run.op_counts()
    assert ops["Attention"] == 1
    assert ops["SkipLayerNormalization"] == 2
    assert {op: ops[op] for op in DECOMPOSITION} == dict.fromkeys(DECOMPOSITION, 0)
    assert ops["Einsum"] == 0  # every recognized Einsum was lowered
    assert_second_run_changes_nothing(run, tmp_path, PASS)


def test_keras_attention_with_dynamic_batch_and_length(tmp_path: Path) -> None:
    """Batch and sequence length dynamic: every fold and unfold is computed at run time (Shape,
    Gather of two axes, ReduceProd, the Max of both operands' batch sizes), and the Dense
    projections (a Gemm between Reshapes) give the sizes the attention's chains start from."""
    model = fixture_path("keras_attention_dynamic_tf2onnx")
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (2, 2)
    assert reasons(run, PASS) == {}
    ops = run.op_counts()
    assert ops["MultiHeadAttention"] == 1
    assert ops["SkipLayerNormalization"] == 1
    assert ops["Softmax"] == ops["MatMul"] == ops["ReduceProd"] == ops["Max"] == 0
    for batch, length in ((1, 3), (3, 11)):
        compare_on_feeds(model, run.output, _ids(batch, length, 50))


AXES = ("one", "two", "three", "four")  # 1-element axis constants, by their value


def _folded_scores(
    path: Path,
    *,
    key_perm: tuple[int, ...] = (0, 3, 1, 4, 2),
    merged: bool = False,
    read: str | None = None,
    length: int | str = "seq",
) -> Path:
    """Attention scores as tf2onnx writes them: query [B, T, 4, 8] and key [B, S, 4, 8] each
    unsqueezed to 5-D and transposed to [B, 4, T, 1, 8] and [B, 4, 1, 8, S] (or ``key_perm``),
    their first two axes folded into one by targets read at run time, a 3-D MatMul, and the
    product unfolded by the Max of both batch sizes and the two lengths, then squeezed
    (``merged``: unfolded to [B, 4 * T, S] instead). ``read``: a value whose Shape the graph
    also returns."""
    nodes = [
        helper.make_node("Unsqueeze", ["q", "three"], ["q5"]),
        helper.make_node("Unsqueeze", ["k", "one"], ["k5"]),
        helper.make_node("Transpose", ["q5"], ["qt"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Transpose", ["k5"], ["kt"], perm=list(key_perm)),
        helper.make_node("Shape", ["qt"], ["q_shape"]),
        helper.make_node("Shape", ["kt"], ["k_shape"]),
        helper.make_node("Gather", ["q_shape", "batch_axes"], ["q_batch"]),
        helper.make_node("Gather", ["k_shape", "batch_axes"], ["k_batch"]),
        helper.make_node("ReduceProd", ["q_batch"], ["q_folded"], keepdims=1),
        helper.make_node("ReduceProd", ["k_batch"], ["k_folded"], keepdims=1),
        helper.make_node("Concat", ["q_folded", "minus_one", "eight"], ["q_target"], axis=0),
        helper.make_node("Concat", ["k_folded", "eight", "minus_one"], ["k_target"], axis=0),
        helper.make_node("Reshape", ["qt", "q_target"], ["q3"]),
        helper.make_node("Reshape", ["kt", "k_target"], ["k3"]),
        helper.make_node("MatMul", ["q3", "k3"], ["scores3"]),
    ]
    unfold = [
        helper.make_node("Max", ["q_batch", "k_batch"], ["batch"]),
        helper.make_node("Gather", ["q_shape", "two"], ["q_length"]),
        helper.make_node("Gather", ["k_shape", "four"], ["k_length"]),
        helper.make_node("Concat", ["batch", "q_length", "k_length", "one"], ["to"], axis=0),
    ]
    if merged:  # [B, -1, S, 1]: the heads and the query length in one axis
        unfold[0] = helper.make_node("Gather", ["q_shape", "zero"], ["batch"])
        unfold[1] = helper.make_node("Identity", ["minus_one"], ["q_length"])
    nodes += [
        *unfold,
        helper.make_node("Reshape", ["scores3", "to"], ["scores5"]),
        helper.make_node("Squeeze", ["scores5", "three" if merged else "four"], ["scores"]),
    ]
    outputs = [value("scores", [None] * (3 if merged else 4))]
    if read is not None:
        nodes.append(helper.make_node("Shape", [read], ["read_shape"]))
        outputs.append(value("read_shape", [None], TensorProto.INT64))
    initializers = [
        const("batch_axes", [0, 1], np.int64),
        const("zero", [0], np.int64),
        const("minus_one", [-1], np.int64),
        const("eight", [8], np.int64),
        *(const(name, [index], np.int64) for index, name in enumerate(AXES, start=1)),
    ]
    inputs = [value("q", ["batch", length, 4, 8]), value("k", ["batch", "keys", 4, 8])]
    return save_model(path, nodes, inputs, outputs, initializers)


def _feeds(batch: int, length: int, keys: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "q": rng.standard_normal((batch, length, 4, 8)).astype(np.float32),
        "k": rng.standard_normal((batch, keys, 4, 8)).astype(np.float32),
    }


def test_folded_batch_matmul_is_the_scores_einsum(tmp_path: Path) -> None:
    model = _folded_scores(tmp_path / "folded.onnx")
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.counts(LOWERING) == (1, 1)
    ops = run.op_counts()
    assert (ops["MatMul"], ops["Transpose"], ops["Reshape"], ops["Shape"]) == (1, 2, 0, 0)
    assert ops["Unsqueeze"] == ops["Squeeze"] == ops["ReduceProd"] == ops["Max"] == 0
    graph = onnx.load(str(run.output)).graph
    (product,) = [node for node in graph.node if node.op_type == "MatMul"]
    assert product.output[0] == "scores"  # [B, 4, T, S] as the unfold left it
    for sizes in ((1, 1, 2), (2, 5, 3), (3, 7, 7)):
        compare_on_feeds(model, run.output, _feeds(*sizes))


def test_a_size_read_elsewhere_is_read_from_the_operands(tmp_path: Path) -> None:
    """The graph also returns the Shape of the transposed query [B, 4, T, 1, 8]: each size is
    one of the query's axes or static, so it is read from the query, which stays."""
    model = _folded_scores(tmp_path / "read.onnx", read="qt")
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.op_counts()["Transpose"] == 2
    for sizes in ((1, 2, 3), (3, 5, 2)):
        compare_on_feeds(model, run.output, _feeds(*sizes))


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        pytest.param(
            {"key_perm": (3, 0, 1, 4, 2)},
            "a batch axis of the MatMul is different axes of the two operands",
            id="batch-axes-in-another-order",
        ),
        pytest.param(
            {"merged": True},
            "the product's axes are not the operands' axes",
            id="product-unfolded-to-merged-axes",
        ),
        pytest.param(
            {"read": "q3"},
            "a size read outside the site is no axis of an operand (axes merged)",
            id="folded-size-read-outside",
        ),
        pytest.param(
            {"length": 1},
            "an operand has an axis of size 1",
            id="unit-length",
        ),
    ],
)
def test_near_misses_are_left_with_the_reason(tmp_path: Path, options: dict, reason: str) -> None:
    """The key's batch axes folded in the other order (a product over other pairs, which
    runs where the batch is the 4 heads: no Einsum of whole axes), a product unfolded to
    [B, 4 * T, S], the size of the folded query that the graph returns (the batch times the
    heads: no one axis to read it from), and a query of static length 1 (unit axes are not
    given labels). Compared at a batch of 4, where the first runs."""
    model = _folded_scores(tmp_path / "near.onnx", **options)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(PASS) == (1, 0)
    assert reasons(run, PASS) == {reason: 1}
    assert run.counts(LOWERING) == (0, 0)
    length = 1 if options.get("length") == 1 else 5
    compare_on_feeds(model, run.output, _feeds(4, length, 3))


@pytest.mark.parametrize("model", ["bert_tiny_ts17", "arch/xglm_ts17"])
def test_attention_the_fusions_read_as_it_is_is_not_a_candidate(model: str, tmp_path: Path) -> None:
    """TorchScript's BERT (a MatMul between Transposes, a context Reshape and head merge, all
    4-D) and XGLM's fairseq-style attention (heads folded into the batch for 3-D MatMuls and
    unfolded for the mask, the Softmax on the folded scores): the attention passes follow
    those layouts, and a partial rewrite of one of its two products would break what they
    follow. Not candidates; the fused models are the ones fusectl gives without this pass."""
    path = fixture_path(model)
    run = optimize_checked(path, tmp_path)
    assert run.counts(PASS) == (0, 0)
    without = tmp_path / "without"
    without.mkdir()
    alone = optimize(path, without, "--disable_pass", PASS)
    assert run.op_counts() == alone.op_counts()
    ops = run.op_counts()
    assert ops["Attention"] + ops["MultiHeadAttention"] == 2
