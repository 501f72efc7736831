"""MatMulScaleFusionPass: constant scalar scaling around a MatMul -> FusedMatMul(alpha)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.pass_helpers import (
    assert_declined,
    const,
    fixture_path,
    optimize_checked,
    save_model,
    value,
)

SCALE = "MatMulScaleFusionPass"


def _n(op: str, inputs: list[str], output: str) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output)


FORMS = {
    # name: (nodes, expected alpha)
    "ScaleBoth": (
        [_n("Mul", ["q", "s"], "qs"), _n("Mul", ["k", "t"], "ks"), _n("MatMul", ["qs", "ks"], "y")],
        0.5 * 0.25,
    ),
    "ScaleA": ([_n("Mul", ["s", "q"], "qs"), _n("MatMul", ["qs", "k"], "y")], 0.5),
    "ScaleB": ([_n("Mul", ["k", "t"], "ks"), _n("MatMul", ["q", "ks"], "y")], 0.25),
    "ScaleProduct": ([_n("MatMul", ["q", "k"], "p"), _n("Mul", ["p", "s"], "y")], 0.5),
    "DivideProduct": ([_n("MatMul", ["q", "k"], "p"), _n("Div", ["p", "t"], "y")], 4.0),
}


def _model(path: Path, nodes: list, *, s: object = 0.5, dtype: int = TensorProto.FLOAT):
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    return save_model(
        path,
        nodes,
        [value("q", [2, 2, 3, 4], dtype), value("k", [2, 2, 4, 3], dtype)],
        [value("y", [2, 2, 3, 3], dtype)],
        [const("s", np.asarray(s, np_type), np_type), const("t", np.array(0.25, np_type), np_type)],
    )


@pytest.mark.parametrize("form", sorted(FORMS))
def test_scales_fold_into_alpha(form: str, tmp_path: Path) -> None:
    nodes, alpha = FORMS[form]
    run = optimize_checked(_model(tmp_path / f"{form}.onnx", nodes), tmp_path)
    assert run.counts(SCALE) == (1, 1)
    assert run.passed(SCALE)["patterns"][form] == {"matched": 1, "effected": 1}
    (node,) = onnx.load(str(run.output)).graph.node
    assert (node.op_type, node.domain) == ("FusedMatMul", "com.microsoft")
    assert next(a.f for a in node.attribute if a.name == "alpha") == pytest.approx(alpha)


def test_a_vector_or_activation_is_no_scale(tmp_path: Path) -> None:
    nodes, _ = FORMS["ScaleA"]
    vector = _model(tmp_path / "vector.onnx", nodes, s=[1.0, 2.0, 3.0, 4.0])
    run = optimize_checked(vector, tmp_path)
    assert run.counts(SCALE) == (0, 0)
    gated = save_model(
        tmp_path / "gate.onnx",
        [_n("Mul", ["q", "g"], "qs"), _n("MatMul", ["qs", "k"], "y")],
        [value("q", [3, 4]), value("g", [3, 4]), value("k", [4, 3])],
        [value("y", [3, 3])],
        [],
    )
    assert optimize_checked(gated, tmp_path).counts(SCALE) == (0, 0)


def test_shared_scaled_input_and_missing_kernel_decline(tmp_path: Path) -> None:
    """A scaled input read outside the match, and a type no provider runs FusedMatMul for
    (bfloat16: onnxruntime's CPU provider runs float16 in float32, casting around it)."""
    nodes, _ = FORMS["ScaleA"]
    shared = save_model(
        tmp_path / "shared.onnx",
        [*nodes, _n("Neg", ["qs"], "leak")],
        [value("q", [3, 4]), value("k", [4, 3])],
        [value("y", [3, 3]), value("leak", [3, 4])],
        [const("s", np.array(0.5, np.float32))],
    )
    run = optimize_checked(shared, tmp_path)
    assert_declined(
        run, SCALE, "an intermediate value (Mul output) is also used by Neg outside the match", "y"
    )
    half = _model(tmp_path / "half.onnx", nodes, dtype=TensorProto.FLOAT16)
    assert optimize_checked(half, tmp_path, atol=1e-2).counts(SCALE) == (1, 1)
    bf16 = _model(tmp_path / "bf16.onnx", nodes, dtype=TensorProto.BFLOAT16)
    run = optimize_checked(bf16, tmp_path, compare=False)
    assert_declined(
        run, SCALE, "onnxruntime has no com.microsoft.FusedMatMul kernel for BFLOAT16", "y"
    )


# Attention scores in the transformer fixtures: q and k each scaled by head_dim ** -0.25.
@pytest.mark.parametrize(
    "name",
    [
        "bert_tiny_ts14",
        "bert_tiny_dynamo",
        "gpt2_tiny_ts17",
        "llama_tiny_dynamo",
        "vit_tiny_ts14",
    ],
)
def test_attention_scores_in_exported_transformers(name: str, tmp_path: Path) -> None:
    # With attention fusion on, the packed-QKV Attention or MultiHeadAttention
    # (GroupQueryAttention for LLaMA's shared key/value heads) takes these MatMuls first (it
    # runs earlier); here all are off to see the scale fusion on its own.
    attention = "MultiHeadAttentionFusionPass,GroupQueryAttentionFusionPass,QkvAttentionFusionPass"
    run = optimize_checked(fixture_path(name), tmp_path, "--disable_pass", attention)
    assert run.counts(SCALE) == (2, 2)
    assert run.passed(SCALE)["patterns"]["ScaleBoth"] == {"matched": 2, "effected": 2}
    assert Counter(n.op_type for n in onnx.load(str(run.output)).graph.node)["FusedMatMul"] == 2
    alphas = {
        round(next(a.f for a in n.attribute if a.name == "alpha"), 6)
        for n in onnx.load(str(run.output)).graph.node
        if n.op_type == "FusedMatMul"
    }
    head = 16 if name.startswith(("gpt2", "llama")) else 8
    assert alphas == {round(1 / math.sqrt(head), 6)}


def test_t5_scores_scaled_by_one_need_no_fused_matmul(tmp_path: Path) -> None:
    """T5 does not scale its scores; its TorchScript export still multiplies q and k by 1.0
    in both layers (and adds a zero mask to the position bias). Those go
    (NeutralOperandEliminationPass), and the plain MatMuls need no FusedMatMul."""
    attention = "MultiHeadAttentionFusionPass,GroupQueryAttentionFusionPass,QkvAttentionFusionPass"
    run = optimize_checked(fixture_path("t5_tiny_ts14"), tmp_path, "--disable_pass", attention)
    assert run.counts(SCALE) == (0, 0)
    assert run.counts("NeutralOperandEliminationPass") == (5, 5)
    assert Counter(n.op_type for n in onnx.load(str(run.output)).graph.node)["FusedMatMul"] == 0


def test_attention_fusion_runs_first(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("bert_tiny_dynamo"), tmp_path)
    assert run.counts("QkvAttentionFusionPass") == (2, 2)
    assert run.counts(SCALE) == (0, 0)


# ---------------------------------------------------------------------------------------------
# MatMulTransposeFusionPass: a transposed operand read in place.
# ---------------------------------------------------------------------------------------------

TRANSPOSE = "MatMulTransposeFusionPass"


def test_tied_weight_is_read_transposed_not_copied(tmp_path: Path) -> None:
    """GPT-2's lm_head: logits = h @ E^T with E also the embedding table of a Gather."""
    table = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    model = save_model(
        tmp_path / "tied.onnx",
        [
            _n("Gather", ["table", "ids"], "h"),
            helper.make_node("Transpose", ["table"], ["table_t"], name="t", perm=[1, 0]),
            _n("MatMul", ["h", "table_t"], "y"),
        ],
        [value("ids", [2, 3], TensorProto.INT64)],
        [value("y", [2, 3, 10])],
        [const("table", table)],
    )
    run = optimize_checked(model, tmp_path, "--disable_pass", "ConstantFoldingPass")
    assert run.counts(TRANSPOSE) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    fused = next(n for n in graph.node if n.op_type == "FusedMatMul")
    assert list(fused.input) == ["h", "table"]
    assert next(a.i for a in fused.attribute if a.name == "transB") == 1
    assert len(graph.initializer) == 1  # one table, no transposed copy


@pytest.mark.parametrize(
    ("perm", "fires"), [([0, 2, 1], True), ([1, 0, 2], False)], ids=["last_two", "batch_axes"]
)
def test_only_a_swap_of_the_last_two_axes(perm: list[int], fires: bool, tmp_path: Path) -> None:
    model = save_model(
        tmp_path / "t.onnx",
        [
            helper.make_node("Transpose", ["a"], ["at"], name="t", perm=perm),
            _n("MatMul", ["at", "b"], "y"),
        ],
        [value("a", [3, 3, 3]), value("b", [3, 3, 2])],
        [value("y", [3, 3, 2])],
        [],
    )
    run = optimize_checked(model, tmp_path)
    if fires:
        assert run.counts(TRANSPOSE) == (1, 1)
        assert run.op_counts() == Counter({"FusedMatMul": 1})
    else:
        assert_declined(run, TRANSPOSE, "the Transpose does not just swap the last two axes", "y")
