"""Every tiny transformer fixture, every exporter: what the default run leaves in the graph.

The issue's bar, per model x exporter: attention fused in every layer, every residual Add +
norm in its skip form, every GELU fused; outputs equal on onnxruntime; the checker passes;
``--target onnx`` leaves only standard ops. Each fixture has two layers. The first layer's
norm, over the embeddings, has the position embeddings added in front in GPT-2 and ViT (a
broadcast skip), becomes EmbedLayerNormalization in BERT, and has no residual Add in front in
LLaMA and T5: an RMS norm below opset 23, SkipSimplifiedLayerNormalization(x, x) with 4x the
epsilon (DoubledRmsNormFusionPass).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.conftest import Run, random_feeds, reference_outputs, run_model
from tests.pass_helpers import fixture_path, optimize_checked

MHA, GQA, ROPE = "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding"
SKIP, SKIP_RMS, LN = (
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "LayerNormalization",
)
# Skip norms that also add the projection's bias in the kernel (the bias variant): BERT's and
# ViT's dense layers have one, and so has GPT-2's Conv1D once it is MatMul + Add on the 3-D
# input (FlattenedGemmCanonicalizationPass); LLaMA and T5 have none.
SKIP_BIAS = "SkipLayerNormalization with bias"
# Self-attention on three projections of one input: the packed-QKV com.microsoft Attention
# (counted with the standard Attention: the op type); GPT-2's fused c_attn and LLaMA's rotary
# leave no three projections to pack.
QKV = "Attention"
BERT = {QKV: 2, SKIP: 4, SKIP_BIAS: 4, "EmbedLayerNormalization": 1, "BiasGelu": 2}
GPT2 = {MHA: 2, SKIP: 4, SKIP_BIAS: 4, LN: 1, "FastGelu": 2}
LLAMA = {GQA: 2, ROPE: 4, SKIP_RMS: 5, "QuickGelu": 2, "ReduceMean": 0}
LLAMA_OPSET23 = {QKV: 2, ROPE: 4, SKIP_RMS: 4, "RMSNormalization": 1, "QuickGelu": 2}
T5 = {QKV: 2, SKIP_RMS: 5, "ReduceMean": 0}
VIT = {QKV: 2, SKIP: 4, SKIP_BIAS: 4, LN: 1, "BiasGelu": 2}
POSITIONS_SKIP = {SKIP: 5, LN: 0}

EXPECTED = {
    "bert_tiny_ts14": BERT,
    "bert_tiny_ts17": BERT,
    "bert_tiny_dynamo": BERT,
    "bert_tiny_eager_ts17": BERT,
    "bert_tiny_eager_dynamo": BERT,
    "bert_tiny_eager_dynamo23": BERT,  # the standard op (opset 23)
    # Before opset 14 onnx's Reshape inference drops a computed target's rank: shapes are
    # inferred on the model converted to opset 14 (and repeat_kv's Unsqueeze takes its axes
    # as an attribute before opset 13).
    "bert_tiny_eager_ts11": BERT,
    # The position embeddings are a [1, S, H] broadcast skip of the first norm: dynamo's
    # shapes say so; TorchScript's computes their sizes at run time, which onnxruntime's
    # symbolic inference traces (a Range over the sequence, or past to past + sequence).
    "gpt2_tiny_ts14": GPT2 | POSITIONS_SKIP,
    "gpt2_tiny_ts17": GPT2 | POSITIONS_SKIP,
    "gpt2_tiny_dynamo": GPT2 | POSITIONS_SKIP,
    "gpt2_tiny_eager_dynamo": GPT2 | POSITIONS_SKIP,
    "gpt2_tiny_eager_ts13": GPT2 | POSITIONS_SKIP,
    "gpt2_tiny_past_ts17": GPT2 | POSITIONS_SKIP,
    "gpt2_tiny_past_dynamo": GPT2 | POSITIONS_SKIP,
    "llama_tiny_ts14": LLAMA,
    "llama_tiny_ts17": LLAMA,
    "llama_tiny_dynamo": LLAMA,
    "llama_tiny_eager_ts11": LLAMA,
    # with a KV cache the grouped key/value are the joined cache: MultiHeadAttention reads them
    "llama_tiny_past_ts17": {**LLAMA, GQA: 0, MHA: 2},
    "llama_tiny_past_dynamo": {**LLAMA, GQA: 0, MHA: 2},
    # opset 23: the export's standard Attention, RotaryEmbedding (its caches spread to the
    # batch) and RMSNormalization stay; the norms after a residual Add become skip norms
    "llama_tiny_dynamo23": LLAMA_OPSET23,
    "llama_tiny_past_dynamo23": LLAMA_OPSET23,
    # TorchScript's T5 reads layer 0's key split for its position bias: MultiHeadAttention there
    "t5_tiny_ts14": {**T5, QKV: 1, MHA: 1},
    "t5_tiny_ts17": {**T5, QKV: 1, MHA: 1},
    "t5_tiny_dynamo": T5,
    # the class token joined to the patches (Concat), plus the position table: proven alike
    "vit_tiny_ts14": VIT | POSITIONS_SKIP,
    "vit_tiny_ts17": VIT | POSITIONS_SKIP,
    "vit_tiny_dynamo": VIT | POSITIONS_SKIP,
}
# Written-out pieces that must all be gone: the softmax of every attention, GELU's erf / tanh
# (and the poolers' Tanh, now FusedGemm's activation), SiLU's sigmoid, rotate_half's Neg.
GONE = ("Softmax", "Erf", "Tanh", "Sigmoid", "Neg")
COUNTED = sorted({op for ops in EXPECTED.values() for op in ops} | {MHA, GQA, "Attention"})
# Exports onnxruntime runs at batch 1 only (their RotaryEmbedding's caches have batch 1).
BATCH_ONE_ON_ORT = {"llama_tiny_dynamo23", "llama_tiny_past_dynamo23"}
# Shapes at which the KV-cache fixtures run: the mask covers past + new positions.
PAST_DIMS = {"batch": 2, "sequence": 3, "past_sequence": 4, "total_sequence": 7}


def test_every_fixture_is_covered() -> None:
    names = {p.stem for p in fixture_path("bert_tiny_ts14").parent.glob("*.onnx")}
    transformers = {n for n in names if n.split("_")[0] in ("bert", "gpt2", "llama", "t5", "vit")}
    assert transformers == set(EXPECTED)


def _optimize(name: str, tmp_path: Path, *args: str) -> Run:
    """Optimize with the full checker and compare outputs on onnxruntime, at shapes that fit
    the KV-cache fixtures' mask where needed (a left-padded row included). The opset-23
    LLaMA exports run on onnxruntime at batch 1 only: the original's outputs there are onnx's
    reference evaluator's."""
    model = fixture_path(name)
    past, opset23 = "_past_" in name, name in BATCH_ONE_ON_ORT
    run = optimize_checked(model, tmp_path, *args, compare=not (past or opset23))
    if past or opset23:
        feeds = random_feeds(model, dims=PAST_DIMS if past else {"batch": 2, "sequence": 5})
        feeds["attention_mask"] = np.ones_like(feeds["attention_mask"])
        feeds["attention_mask"][-1, :2] = 0
        want = (reference_outputs if opset23 else run_model)(model, feeds)
        got = run_model(run.output, feeds)
        assert len(got) == (5 if past else 1)  # the hidden state (and the presents)
        assert not any(np.isnan(array).any() for array in (*want, *got))
        for expected, actual in zip(want, got, strict=True):
            np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=1e-3)
    return run


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fused_in_every_layer(name: str, tmp_path: Path) -> None:
    run = _optimize(name, tmp_path)
    counts = run.op_counts()
    graph = onnx.load(str(run.output)).graph
    counts[SKIP_BIAS] = sum(n.op_type == SKIP and len(n.input) > 4 for n in graph.node)
    assert {op: counts[op] for op in COUNTED} == {op: EXPECTED[name].get(op, 0) for op in COUNTED}
    assert {op: counts[op] for op in GONE} == dict.fromkeys(GONE, 0)
    for entry in run.report["passes"]:
        assert entry.get("layers") is None, f"{entry['name']}: {entry['layers']}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_target_onnx_has_only_standard_ops(name: str, tmp_path: Path) -> None:
    run = _optimize(name, tmp_path, "--target", "onnx")
    model = onnx.load(str(run.output))
    assert {node.domain for node in model.graph.node} == {""}
    assert {o.domain for o in model.opset_import} == {""}
    contrib = {MHA, GQA, SKIP} | ({ROPE} if model.opset_import[0].version < 23 else set())
    assert not Counter(n.op_type for n in model.graph.node).keys() & contrib
