"""Fusion that generalizes: the canonicalization group, attention on query heads that are not a
plain head split (fused QKV projections, partial rotary), and the coverage report that names
every written-out attention, norm, GELU and rotary that stayed unfused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.pass_helpers import (
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

CANONICAL = "NoOpSliceConcatEliminationPass"
MHA = "MultiHeadAttentionFusionPass"
ROTARY = "RotaryEmbeddingFusionPass"


# ---------------------------------------------------------------------------------------------
# Real exports from tests/fixtures/arch (tests/fixtures/make_arch_matrix.py): Phi-3 (fused QKV
# sliced into q/k/v; TorchScript keeps a run-time rotary_dim split of each head) and GPT-NeoX
# (fused QKV split per head after the head split, rotary over a quarter of each head), two
# layers each.
# ---------------------------------------------------------------------------------------------


def test_phi3_torchscript_canonical_form_exposes_rotary_and_attention(tmp_path: Path) -> None:
    """The run-time rotary_dim folds to the head size: q[..., :16] is q (4 whole Slices),
    q[..., 16:] is empty (4 Concat operands dropped), and the Concats left with one operand
    go (with the single-operand Concats of the empty KV cache: 5 in all). Then the rotary and
    attention fuse in both layers, and the shapes re-derived after the rewrites prove the
    residual of layer 1 for its skip norm."""
    original = fixture_path("arch/phi3_ts17")
    run = optimize_checked(original, tmp_path)
    assert run.counts(CANONICAL) == (13, 13)
    assert pattern_counts(run, CANONICAL) == {
        "WholeSlice": (4, 4),
        "EmptyConcatOperand": (4, 4),
        "SingleOperandConcat": (5, 5),
    }
    assert run.counts(ROTARY) == (4, 4)
    assert run.counts(MHA) == (2, 2)
    assert run.counts("AddRmsNormFusionPass") == (4, 4)
    ops = run.op_counts()
    assert (ops["Softmax"], ops["Neg"], ops["MultiHeadAttention"]) == (0, 0, 2)
    coverage = run.report["coverage"]
    assert {k: (v["fused"], v["total"]) for k, v in coverage.items()} == {
        "attention": (2, 2),
        "norms": (5, 5),
        "GELU": (2, 2),
        "rotary": (4, 4),
    }
    # The first layer's input norm reads the embedding (no residual Add): below opset 23 it is
    # SkipSimplifiedLayerNormalization(x, x) with 4x the epsilon.
    assert run.counts("DoubledRmsNormFusionPass") == (1, 1)


@pytest.mark.parametrize("name", ["arch/gpt_neox_ts17", "arch/gpt_neox_dynamo"])
def test_gpt_neox_fused_qkv_and_partial_rotary(name: str, tmp_path: Path) -> None:
    """GPT-NeoX's query heads are a per-head slice of the fused QKV projection with the
    partial rotary applied to a quarter of each head: not a head split of a [B, S, N*H]
    projection. The fused op reads them merged back (Transpose + Reshape to [B, S, N*H]); the
    head count comes from the projection's Reshape target, whose -1 it computes (3 * hidden /
    3 * head size)."""
    original = fixture_path(name)
    run = optimize_checked(original, tmp_path)
    assert run.counts(MHA) == (2, 2)
    assert run.counts(ROTARY) == (4, 4)
    assert reasons(run, MHA) == {}
    ops = run.op_counts()
    assert (ops["Softmax"], ops["MultiHeadAttention"], ops["RotaryEmbedding"]) == (0, 2, 4)
    assert {k: (v["fused"], v["total"]) for k, v in run.report["coverage"].items()} == {
        "attention": (2, 2),
        "norms": (5, 5),
        "GELU": (2, 2),
        "rotary": (4, 4),
    }


def test_target_onnx_reports_attention_unfused_with_reasons(tmp_path: Path) -> None:
    """--target onnx keeps standard ops: attention stays written out below opset 23, and the
    coverage says why for each layer instead of staying silent."""
    run = optimize_checked(fixture_path("arch/gpt_neox_ts17"), tmp_path, "--target", "onnx")
    attention = run.report["coverage"]["attention"]
    assert (attention["fused"], attention["total"]) == (0, 2)
    assert {site["reason"] for site in attention["unfused"]} == {
        "AttentionFusionPass: Attention needs opset >= 23, model has 17"
    }


# ---------------------------------------------------------------------------------------------
# Never silent: a Softmax between two MatMuls that no attention pass fuses is a near-miss.
# ---------------------------------------------------------------------------------------------


def _scores_model(tmp_path: Path, *, softcap: bool, reread: bool) -> Path:
    """softmax(q @ k^T) @ v on [B, 2, S, 4] heads; the scores optionally capped by their sign
    (cap * sign(s / cap): no fused attention op computes that, unlike Gemma-2's tanh, which is
    GroupQueryAttention's softcap), the probabilities optionally not read by a MatMul."""
    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="kt"),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="scores"),
    ]
    scores = "scores"
    if softcap:
        nodes.append(helper.make_node("Div", ["scores", "cap"], ["ratio"]))
        nodes.append(helper.make_node("Sign", ["ratio"], ["capped"]))
        nodes.append(helper.make_node("Mul", ["capped", "cap"], ["softcapped"]))
        scores = "softcapped"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=-1, name="softmax"))
    if reread:
        nodes.append(helper.make_node("MatMul", ["p", "v"], ["y"], name="context"))
    else:
        nodes.append(helper.make_node("ReduceMax", ["p"], ["y"], name="peak"))
    heads = ["batch", 2, "sequence", 4]
    inputs = [value("q", heads), value("k", heads), value("v", heads)]
    output = value("y", ["b", "n", "s", "h"], f32)
    cap = [const("cap", 30.0)] if softcap else []
    return save_model(tmp_path / "scores.onnx", nodes, inputs, [output], cap)


def test_unfused_attention_shaped_softmax_is_a_near_miss(tmp_path: Path) -> None:
    run = optimize_checked(_scores_model(tmp_path, softcap=True, reread=True), tmp_path)
    reason = (
        "the scores are not MatMul(query, key^T) with additive biases and a constant scale "
        "(they come from Sign)"
    )
    assert reasons(run, MHA) == {reason: 1}
    attention = run.report["coverage"]["attention"]
    assert attention == {
        "fused": 0,
        "total": 1,
        "unfused": [{"node": "softmax", "reason": f"AttentionFusionPass: {reason}"}],
    }
    assert "coverage: attention 0/1" in run.stderr


def test_softmax_not_between_matmuls_is_not_attention(tmp_path: Path) -> None:
    """A Softmax whose weights no MatMul reads (a classifier head, a router) is not reported."""
    run = optimize_checked(_scores_model(tmp_path, softcap=False, reread=False), tmp_path)
    assert reasons(run, MHA) == {}
    assert "attention" not in run.report["coverage"]


def test_a_router_softmax_is_not_reported_as_attention(tmp_path: Path) -> None:
    """A mixture-of-experts router: Softmax of the tokens times the gate weights, its top
    experts picked by TopK, the picked weights then used in a MatMul. It sits between two
    MatMuls but is no attention: no attention pass reports it and coverage has no attention."""
    nodes = [
        helper.make_node("MatMul", ["x", "gate"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("TopK", ["probs", "k"], ["weights", "experts"], axis=-1),
        helper.make_node("MatMul", ["weights", "mix"], ["y"]),
    ]
    inits = [
        const("gate", [[0.5, -0.25, 1.0, 0.0]] * 8),
        const("k", [2], dtype=np.int64),
        const("mix", [[1.0] * 8, [0.5] * 8]),
    ]
    model = save_model(
        tmp_path / "router.onnx",
        nodes,
        [value("x", ["tokens", 8])],
        [value("y", ["tokens", 8]), value("experts", ["tokens", 2], TensorProto.INT64)],
        inits,
    )
    run = optimize_checked(model, tmp_path)
    assert "attention" not in run.report["coverage"]
    assert reasons(run, MHA) == {}
    assert run.counts(MHA) == (0, 0)
