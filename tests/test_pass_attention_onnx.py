"""AttentionFusionPass: written-out attention -> the standard Attention op at opset >= 23."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from tests.conftest import random_feeds, run_model
from tests.pass_helpers import IR_VERSION, fixture_path, optimize_checked, reasons

MS = "com.microsoft"
ATTENTION = "AttentionFusionPass"
MHA = "MultiHeadAttentionFusionPass"


def _attention_nodes(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "Attention"]


# BERT exported by dynamo at opset 23 with eager attention: GELU, LayerNorm come out native,
# the attention stays written out (sdpa would have been exported as Attention already).
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_standard_attention_at_opset_23(target: str, tmp_path: Path) -> None:
    model = fixture_path("bert_tiny_eager_dynamo23")
    run = optimize_checked(model, tmp_path, "--target", target)
    assert run.counts(ATTENTION) == (2, 2)
    assert run.passed(MHA)["state"] == ("on" if target == "ort" else "off")
    assert run.counts(MHA) == (0, 0)
    nodes = _attention_nodes(run.output)
    assert len(nodes) == 2
    for node in nodes:
        assert node.domain == ""
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["q_num_heads"] == attributes["kv_num_heads"] == 4
        assert attributes["scale"] == pytest.approx(8**-0.5)
        assert len(node.input) == 4  # Q, K, V and the additive padding mask
    # The export masks with -FLT_MAX, which the kernel takes for -inf (a fully masked row would
    # get zero weights, not the uniform ones of the softmax): one shared Where masks with -1e30.
    graph = onnx.load(str(run.output)).graph
    (mask,) = {node.input[3] for node in nodes}
    (where,) = [n for n in graph.node if mask in n.output]
    assert where.op_type == "Where"
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    assert min(float(constants[name].min()) for name in where.input[1:]) == pytest.approx(-1e30)
    counts = run.op_counts()
    assert counts["Softmax"] == 0
    if target == "onnx":
        assert {n.domain for n in onnx.load(str(run.output)).graph.node} == {""}
    # another batch and sequence length, with a padded row
    feeds = random_feeds(model, dims={"batch": 3, "sequence": 5})
    feeds["attention_mask"][-1, -2:] = 0
    for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


# Below opset 23 the standard op does not exist: the pass matches, says why, and onnxruntime's
# ops take every layer: BERT's self-attention on three biased projections of one input the
# packed-QKV com.microsoft Attention, GPT-2's (one fused projection, split) MultiHeadAttention.
@pytest.mark.parametrize(
    ("name", "packed"),
    [("bert_tiny_ts17", True), ("bert_tiny_eager_dynamo", True), ("gpt2_tiny_ts14", False)],
)
def test_below_opset_23_left_to_the_contrib_ops(name: str, packed: bool, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path)
    opset = next(o.version for o in onnx.load(str(fixture_path(name))).opset_import if not o.domain)
    assert run.counts(ATTENTION) == (2, 0)
    assert reasons(run, ATTENTION) == {f"Attention needs opset >= 23, model has {opset}": 2}
    assert run.counts(MHA) == ((0, 0) if packed else (2, 2))
    assert run.counts("QkvAttentionFusionPass") == ((2, 2) if packed else (0, 0))
    assert {n.domain for n in _attention_nodes(run.output)} == ({MS} if packed else set())


# A KV cache joined with Concat(past, new) is not a plain projection: at opset 23 the standard
# pass declines it and MultiHeadAttention reads the joined [B, N, L, H] key and value.
def test_kv_cache_left_to_multi_head_attention(tmp_path: Path) -> None:
    model = onnx.load(str(fixture_path("gpt2_tiny_past_dynamo")))
    for opset in model.opset_import:
        if not opset.domain:
            opset.version = 23  # the ops this export uses mean the same at 23
    model.ir_version = IR_VERSION
    upgraded = tmp_path / "gpt2_past_opset23.onnx"
    onnx.save(model, str(upgraded))
    run = optimize_checked(upgraded, tmp_path, compare=False)
    assert run.counts(ATTENTION) == (2, 0)
    assert reasons(run, ATTENTION) == {
        "the key/value are not plain head splits of projections (a KV cache, heads "
        "transformed after the split): MultiHeadAttention's": 2
    }
    assert run.counts(MHA) == (2, 2)
    dims = {"batch": 2, "sequence": 3, "past_sequence": 4, "total_sequence": 7}
    feeds = random_feeds(upgraded, dims=dims)
    feeds["attention_mask"][-1, :2] = 0  # a left-padded row
    want, got = run_model(upgraded, feeds), run_model(run.output, feeds)
    assert len(got) == 5  # last_hidden_state and the present key/value of both layers
    for expected, actual in zip(want, got, strict=True):
        np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=1e-3)


# A float16 mask promoted with the scores: the standard op's mask is the promoted (Cast) mask,
# whose values are the float16 branches' cast to float32 (none near -FLT_MAX: no clamp).
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_a_promoted_half_precision_mask_at_opset_23(target: str, tmp_path: Path) -> None:
    """XLM (dynamo, float16) adds its mask in float16 and promotes the scores to float32 for
    the Softmax. Converted to opset 23 (onnx's version converter), the standard op takes that
    mask promoted; reading its values failed on the Cast (an internal error, the pass lost)."""
    from onnx import version_converter

    upgraded = tmp_path / "xlm_fp16_opset23.onnx"
    original = onnx.load(str(fixture_path("xlm_dynamo_fp16")))
    onnx.save(version_converter.convert_version(original, 23), str(upgraded))
    run = optimize_checked(upgraded, tmp_path, "--target", target, atol=1e-2)
    assert run.counts(ATTENTION) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    graph = onnx.load(str(run.output)).graph
    made = {output: node for node in graph.node for output in node.output}
    masks = {node.input[3] for node in _attention_nodes(run.output)}
    assert [made[mask].op_type for mask in masks] == ["Cast"]  # one promoted mask, not clamped
    assert run.op_counts()["Softmax"] == 0
