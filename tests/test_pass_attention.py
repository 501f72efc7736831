"""MultiHeadAttentionFusionPass and GroupQueryAttentionFusionPass on real exports (tiny BERT,
GPT-2, ViT, T5 encoder, LLaMA, with and without a KV cache; TorchScript opsets 14/17 and dynamo)
and on small onnx.helper models: every layer's attention becomes com.microsoft
MultiHeadAttention, or GroupQueryAttention where LLaMA's repeat_kv shares key/value heads."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import (
    FIXTURES,
    Run,
    assert_same_outputs,
    named_dim_feeds,
    optimize,
    random_feeds,
    run_model,
)
from tests.pass_helpers import (
    assert_declined,
    check_output,
    compare_on_feeds,
    const,
    edited_fixture,
    feed_scalar,
    fixture_path,
    lineage,
    node_named,
    optimize_checked,
    reasons,
    save_model,
    value,
)

MHA = "MultiHeadAttentionFusionPass"
GQA = "GroupQueryAttentionFusionPass"
QKV = "QkvAttentionFusionPass"
MS = "com.microsoft"
# MultiHeadAttention's own recognition, on self-attention the packed-QKV Attention would take.
MHA_ONLY = ("--disable_pass", QKV)

# name: (matched, effected, heads, scale) — two layers each.
EXPECTED = {
    "bert_tiny_ts14": (2, 2, 4, 8**-0.5),
    "bert_tiny_ts17": (2, 2, 4, 8**-0.5),
    "bert_tiny_dynamo": (2, 2, 4, 8**-0.5),
    "gpt2_tiny_ts14": (2, 2, 2, 16**-0.5),
    "gpt2_tiny_ts17": (2, 2, 2, 16**-0.5),
    "gpt2_tiny_dynamo": (2, 2, 2, 16**-0.5),
    "vit_tiny_ts14": (2, 2, 4, 8**-0.5),
    "vit_tiny_ts17": (2, 2, 4, 8**-0.5),
    "vit_tiny_dynamo": (2, 2, 4, 8**-0.5),
    "t5_tiny_ts14": (2, 2, 4, 1.0),  # T5 does not scale; its position bias is added
    "t5_tiny_ts17": (2, 2, 4, 1.0),
    "t5_tiny_dynamo": (2, 2, 4, 1.0),
    # Eager attention scales the product (Div or Mul by a constant) instead of q and kT.
    "bert_tiny_eager_ts17": (2, 2, 4, 8**-0.5),
    "bert_tiny_eager_dynamo": (2, 2, 4, 8**-0.5),
    "gpt2_tiny_eager_dynamo": (2, 2, 2, 16**-0.5),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attention_fused_in_every_layer(name: str, tmp_path: Path) -> None:
    matched, effected, heads, scale = EXPECTED[name]
    run = optimize_checked(fixture_path(name), tmp_path, *MHA_ONLY)
    assert run.counts(MHA) == (matched, effected)
    assert reasons(run, MHA) == {}
    nodes = onnx.load(str(run.output)).graph.node
    fused = [n for n in nodes if n.op_type == "MultiHeadAttention"]
    assert len(fused) == effected and all(n.domain == "com.microsoft" for n in fused)
    for node in fused:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["num_heads"] == heads
        assert attrs["scale"] == pytest.approx(scale, rel=1e-5)
    counts = Counter(n.op_type for n in nodes)
    assert counts["Softmax"] == 0 and counts["IsNaN"] <= effected


@pytest.mark.parametrize(
    "name", ["bert_tiny_ts14", "bert_tiny_dynamo", "gpt2_tiny_ts14", "gpt2_tiny_dynamo"]
)
def test_padding_and_fully_masked_rows_match(name: str, tmp_path: Path) -> None:
    """Padded keys, and a batch row with every key masked (the original's NaN guard zeroes
    it; with TorchScript's -inf mask the fused graph keeps an equivalent guard)."""
    run = optimize_checked(fixture_path(name), tmp_path)
    feeds = random_feeds(fixture_path(name))
    mask = np.ones_like(feeds["attention_mask"])
    mask[0, 3:] = 0
    mask[1, :] = 0
    feeds["attention_mask"] = mask
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", ["t5_tiny_ts14", "t5_tiny_ts17"])
def test_t5_torchscript_key_reshape_read_outside_stays(name: str, tmp_path: Path) -> None:
    """TorchScript's T5 takes the key length for its position bias from a transposed copy of
    layer 0's key head split: that Reshape stays beside the fused op, which reads the key
    projection itself; the outputs agree at another batch and sequence length too."""
    run = optimize_checked(fixture_path(name), tmp_path)
    graph = onnx.load(str(run.output)).graph
    fused = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    producers = {out: n for n in graph.node for out in n.output}
    readers = Counter(value for n in graph.node for value in n.input)
    kept = [
        n
        for n in graph.node
        if n.op_type == "Reshape" and n.input[0] in {f.input[1] for f in fused}
    ]
    assert len(kept) == 1 and readers[kept[0].output[0]] == 1
    (transpose,) = [n for n in graph.node if kept[0].output[0] in n.input]
    assert transpose.op_type == "Transpose"
    assert [n.op_type for n in graph.node if transpose.output[0] in n.input] == ["Shape"]
    assert producers[kept[0].input[0]].op_type == "MatMul"  # the key projection
    feeds = random_feeds(fixture_path(name), dims={"batch": 3, "sequence": 5})
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_probabilities_read_outside_keep_the_attention_written_out(tmp_path: Path) -> None:
    """With layer 0's attention probabilities also a graph output (output_attentions), only
    data movement may stay beside a fused op: that layer is declined with the reason."""
    model = onnx.load(str(fixture_path("t5_tiny_ts17")))
    (softmax,) = [n for n in model.graph.node if n.op_type == "Softmax" and "block.0" in n.name]
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(softmax.output[0], onnx.TensorProto.FLOAT, None)
    )
    path = tmp_path / "t5_probabilities.onnx"
    onnx.save(model, str(path))
    run = optimize_checked(path, tmp_path, *MHA_ONLY)
    assert run.counts(MHA) == (2, 1)
    assert reasons(run, MHA) == {"an intermediate value (Softmax output) is a graph output": 1}


def test_fused_output_has_the_query_batch_and_sequence(tmp_path: Path) -> None:
    """onnx cannot infer the contrib op, and the replaced output's batch is a fresh symbol (the
    scores broadcast against the mask's): the fused output gets the query's batch and
    sequence, which the residual Add's shape proof relies on."""
    run = optimize_checked(fixture_path("gpt2_tiny_ts17"), tmp_path)
    graph = onnx.load(str(run.output)).graph
    shapes = {
        info.name: [d.dim_param or d.dim_value for d in info.type.tensor_type.shape.dim]
        for info in graph.value_info
    }
    fused = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert len(fused) == 2
    for node in fused:
        assert shapes[node.output[0]][:2] == shapes[node.input[0]][:2]


def test_target_onnx_keeps_attention_written_out(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("bert_tiny_dynamo"), tmp_path, "--target", "onnx")
    assert run.passed(MHA)["state"] == "off"
    assert run.op_counts()["Softmax"] == 2


# ---------------------------------------------------------------------------------------------
# LLaMA (4 query heads, 2 key/value heads, head size 16): repeat_kv -> GroupQueryAttention;
# with a KV cache, and with GroupQueryAttention off, MultiHeadAttention reads the 4-D key/value.
# ---------------------------------------------------------------------------------------------

LLAMA = ["llama_tiny_ts14", "llama_tiny_ts17", "llama_tiny_dynamo"]
LLAMA_PAST = ["llama_tiny_past_ts17", "llama_tiny_past_dynamo"]
GPT2_PAST = ["gpt2_tiny_past_ts17", "gpt2_tiny_past_dynamo"]
# The ops GroupQueryAttention's seqlens_k / total_sequence_length are computed with, once.
SEQLENS_CHAIN = Counter({"Shape": 1, "Gather": 2, "Cast": 1, "Sub": 1, "Expand": 1})


def _assert_one_seqlens_chain(run: Run, graph: onnx.GraphProto) -> dict:
    """GroupQueryAttention's seqlens_k / total_sequence_length computed once for the model,
    not once per layer; the lineage of the output's nodes."""
    made = lineage(run)
    chain = Counter(
        n.op_type
        for n in graph.node
        if GQA in made.get(n.name, ([], []))[0] and n.op_type in SEQLENS_CHAIN
    )
    assert chain == SEQLENS_CHAIN
    return made


def _graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path)).graph


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def _softmaxes(path: Path) -> list[str]:
    return [n.name for n in _graph(path).node if n.op_type == "Softmax"]


def _repeat_kv_expands(graph: onnx.GraphProto) -> list[str]:
    """repeat_kv's Expand nodes: Expand(Unsqueeze(x, axes=[2])) read by a Reshape."""
    producers = _producers(graph)
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    constants |= {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t)
        for n in graph.node
        if n.op_type == "Constant" and n.attribute[0].name == "value"
    }
    reshaped = {n.input[0] for n in graph.node if n.op_type == "Reshape"}
    found = []
    for node in graph.node:
        unsqueeze = producers.get(node.input[0]) if node.op_type == "Expand" else None
        if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.input) < 2:
            continue
        axes = constants.get(unsqueeze.input[1])
        repeats = axes is not None and axes.reshape(-1).tolist() == [2]
        if repeats and node.output[0] in reshaped:
            found.append(node.name)
    return found


def _left_padded(batch: int, length: int, padding: list[int]) -> np.ndarray:
    """An attention mask whose row i masks its first padding[i] positions."""
    mask = np.ones((batch, length), np.int64)
    for row, pad in enumerate(padding):
        mask[row, :pad] = 0
    return mask


def _text_feeds(name: str, batch: int, sequence: int, padding: list[int]) -> dict[str, np.ndarray]:
    feeds = random_feeds(fixture_path(name), seed=1, dims={"batch": batch, "sequence": sequence})
    feeds["input_ids"] = np.random.default_rng(1).integers(0, 100, (batch, sequence))
    feeds["attention_mask"] = _left_padded(batch, sequence, padding)
    return feeds


def _past_feeds(
    name: str, batch: int, past: int, sequence: int, padding: list[int]
) -> dict[str, np.ndarray]:
    dims = {"batch": batch, "sequence": sequence, "past_sequence": past}
    dims["total_sequence"] = past + sequence
    feeds = random_feeds(fixture_path(name), seed=2, dims=dims)
    feeds["input_ids"] = np.random.default_rng(2).integers(0, 100, (batch, sequence))
    feeds["attention_mask"] = _left_padded(batch, past + sequence, padding)
    return feeds


@pytest.mark.parametrize("name", LLAMA)
def test_llama_grouped_query_attention_fused_in_every_layer(name: str, tmp_path: Path) -> None:
    """repeat_kv's 2 key/value heads for 4 query heads become GroupQueryAttention on the
    projections (the rotated q and k, v's MatMul): no Softmax and no repeat is left; the model's
    causal + padding mask is its attention_bias (causal=0); seqlens_k / total_sequence_length
    are computed once from the query's shape for both layers."""
    assert len(_repeat_kv_expands(_graph(fixture_path(name)))) == 4  # k and v, two layers
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(GQA) == (2, 2)
    assert reasons(run, GQA) == {}
    assert run.passed(GQA)["layers"] is None  # every layer
    assert run.counts(MHA) == (0, 0)
    graph = _graph(run.output)
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["GroupQueryAttention"], ops["MultiHeadAttention"], ops["Softmax"]) == (2, 0, 0)
    assert _repeat_kv_expands(graph) == []
    producers = _producers(graph)
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    for node in fused:
        assert node.domain == MS
        attributes = _attributes(node)
        assert attributes.pop("scale") == pytest.approx(16**-0.5, rel=1e-5)
        assert attributes == {"num_heads": 4, "kv_num_heads": 2, "causal": 0}
        assert len(node.input) == 11
        sources = [producers[v].op_type for v in node.input[:3]]
        assert sources == ["RotaryEmbedding", "RotaryEmbedding", "MatMul"]
        assert list(node.input[3:5]) == ["", ""]  # no KV cache
        assert list(node.input[7:10]) == ["", "", ""]  # rotary stays outside
        assert producers[node.input[10]].op_type == "Where"  # the model's mask
    assert len({tuple(n.input[5:7]) for n in fused}) == 1
    seqlens, total = (producers[v] for v in fused[0].input[5:7])
    assert (seqlens.op_type, total.op_type) == ("Expand", "Cast")
    made = _assert_one_seqlens_chain(run, graph)
    (shape,) = [n for n in graph.node if n.op_type == "Shape" and n.name in made]
    assert shape.input[0] == fused[0].input[0]
    # The export shape (batch 2, sequence 8), then batch 3, sequence 5, left-padded: row 1
    # loses 2 tokens, row 2 all but the last, so their first query rows see no key at all.
    compare_on_feeds(fixture_path(name), run.output, _text_feeds(name, 2, 8, [0, 0]))
    compare_on_feeds(fixture_path(name), run.output, _text_feeds(name, 3, 5, [0, 2, 4]))


@pytest.mark.parametrize("name", LLAMA)
def test_llama_target_onnx_keeps_grouped_attention_written_out(name: str, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path, "--target", "onnx")
    for fusion in (GQA, MHA):
        assert (run.passed(fusion)["state"], run.passed(fusion)["reason"]) == ("off", "target")
    model = onnx.load(str(run.output))
    assert [n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")] == []
    assert MS not in {o.domain for o in model.opset_import}
    assert Counter(n.op_type for n in model.graph.node)["Softmax"] == 2
    assert len(_repeat_kv_expands(model.graph)) == 4


def test_layer_left_unfused_is_reported(tmp_path: Path) -> None:
    """With layer 1's attention probabilities also a graph output, GroupQueryAttention fuses
    layer 0 only: the report and the summary say which layer it missed."""
    model = onnx.load(str(fixture_path("llama_tiny_ts17")))
    (softmax,) = [n for n in model.graph.node if n.op_type == "Softmax" and "layers.1" in n.name]
    model.graph.output.append(
        helper.make_tensor_value_info(softmax.output[0], TensorProto.FLOAT, None)
    )
    path = tmp_path / "llama_probabilities.onnx"
    onnx.save(model, str(path))
    run = optimize_checked(path, tmp_path)
    assert run.counts(GQA) == (2, 1)
    assert reasons(run, GQA) == {"an intermediate value (Softmax output) is a graph output": 1}
    assert run.passed(GQA)["layers"] == {"fused": 1, "total": 2, "missing": ["layers.1"]}
    assert "GroupQueryAttentionFusionPass fused in 1 of 2 layers; none in layers.1" in run.stderr
    assert run.passed(MHA)["layers"] is None  # it fused nowhere: no partial coverage
    assert run.op_counts()["GroupQueryAttention"] == 1


def _compare_past_feeds(name: str, output: Path) -> None:
    """The export shape (batch 2, past 4, sequence 3), then past 3 + sequence 5 and past 6 +
    sequence 1; left padding, in the first check long enough to mask query row 0 entirely."""
    for batch, past, sequence, padding in [(2, 4, 3, [0, 2]), (2, 3, 5, [0, 4]), (2, 6, 1, [0, 2])]:
        feeds = _past_feeds(name, batch, past, sequence, padding)
        compare_on_feeds(fixture_path(name), output, feeds)


@pytest.mark.parametrize("name", LLAMA_PAST)
def test_kv_cache_attention_reads_the_joined_key_and_value(name: str, tmp_path: Path) -> None:
    """Concat(past, new) keys and values ([B, KV, P+S, 16], graph outputs as the presents)
    repeated by LLaMA's repeat_kv are read as they are by MultiHeadAttention (4 heads).
    GroupQueryAttention declines them: onnxruntime's kernel takes a past only for one sequence
    or one new token, and batch and sequence are free here."""
    original = _graph(fixture_path(name))
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    assert run.counts(MHA) == (2, 2)
    assert reasons(run, MHA) == {}
    reason = (
        "onnxruntime's GroupQueryAttention takes a past only for one sequence or one new token "
        "at a time, and the batch and sequence are not fixed to 1 (--input_shape can fix them)"
    )
    assert_declined(run, GQA, reason, _softmaxes(fixture_path(name))[0], count=2)
    graph = _graph(run.output)
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["MultiHeadAttention"], ops["GroupQueryAttention"], ops["Softmax"]) == (2, 0, 0)
    assert [o.name for o in graph.output] == [o.name for o in original.output]
    producers = _producers(graph)
    for output in graph.output[1:]:
        assert producers[output.name].op_type == "Concat"  # the presents stay
    for layer, node in enumerate(_multi_head_attentions(graph, heads=4)):
        assert len(node.output) == 1
        presents = [f"present_key_{layer}", f"present_value_{layer}"]
        for read, present in zip(node.input[1:3], presents, strict=True):
            reshape = producers[read]
            expand = producers[reshape.input[0]]
            unsqueeze = producers[expand.input[0]]
            assert [reshape.op_type, expand.op_type, unsqueeze.op_type] == [
                "Reshape",
                "Expand",
                "Unsqueeze",
            ]
            assert unsqueeze.input[0] == present
    _compare_past_feeds(name, run.output)


def _multi_head_attentions(graph: onnx.GraphProto, *, heads: int) -> list[onnx.NodeProto]:
    """The fused MultiHeadAttention nodes, in order, each com.microsoft with this many heads
    and the 1/sqrt(16) scale of the 16-wide heads of the KV-cache fixtures."""
    fused = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    for node in fused:
        assert node.domain == MS
        attributes = _attributes(node)
        assert attributes.pop("scale") == pytest.approx(16**-0.5, rel=1e-5)
        assert attributes == {"num_heads": heads}
    return fused


@pytest.mark.parametrize("name", GPT2_PAST)
def test_kv_cache_appended_to_by_multi_head_attention(name: str, tmp_path: Path) -> None:
    """GPT-2's cache, Concat(past, split(new)) per key and value, is MultiHeadAttention's own:
    it reads the new key/value projections (3-D), takes the pasts as past_key / past_value and
    makes the graph's presents (its outputs 1 and 2); no Concat, head split or Transpose of
    the key and value is left."""
    original = _graph(fixture_path(name))
    before = Counter(n.op_type for n in original.node)
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    assert run.counts(MHA) == (2, 2)
    assert reasons(run, MHA) == {}
    assert run.counts(GQA) == (0, 0)
    graph = _graph(run.output)
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["MultiHeadAttention"], ops["GroupQueryAttention"], ops["Softmax"]) == (2, 0, 0)
    assert before["Transpose"] > 0 and ops["Transpose"] == 0
    assert [o.name for o in graph.output] == [o.name for o in original.output]
    producers = _producers(graph)
    for layer, node in enumerate(_multi_head_attentions(graph, heads=2)):
        assert [producers[v].op_type for v in node.input[:3]] == ["Split"] * 3
        assert list(node.input[6:]) == [f"past_key_{layer}", f"past_value_{layer}"]
        assert list(node.output[1:]) == [f"present_key_{layer}", f"present_value_{layer}"]
    for output in graph.output[1:]:
        assert producers[output.name].op_type == "MultiHeadAttention"
    _compare_past_feeds(name, run.output)


BART_PAST = ["arch/bart_past_ts17", "arch/bart_past_dynamo"]


@pytest.mark.parametrize("name", BART_PAST)
def test_bart_decoder_cache_appended_to_by_multi_head_attention(name: str, tmp_path: Path) -> None:
    """BART's decoder: both self-attentions append to their cache inside MultiHeadAttention
    (the k/v projections read 3-D, their biases added by the op, the presents its outputs); the
    cross-attentions, which read the encoder's states and have no cache, read their
    projections. No Concat of a past, and no Transpose, is left."""
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(MHA) == (4, 4)
    assert reasons(run, MHA) == {}
    graph = _graph(run.output)
    producers = _producers(graph)
    fused = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    cached = [n for n in fused if len(n.input) > 6]
    assert len(fused) == 4 and len(cached) == 2
    for layer, node in enumerate(cached):
        assert list(node.input[6:]) == [f"past_key_{layer}", f"past_value_{layer}"]
        assert list(node.output[1:]) == [f"present_key_{layer}", f"present_value_{layer}"]
        # the projections' MatMuls: their biases are the op's bias input
        assert [producers[v].op_type for v in node.input[1:3]] == ["MatMul", "MatMul"]
        assert node.input[3] in {t.name for t in graph.initializer}
    pasts = {i.name for i in graph.input if i.name.startswith("past_")}
    assert not [n for n in graph.node if n.op_type == "Concat" and pasts & set(n.input)]
    assert Counter(n.op_type for n in graph.node)["Transpose"] == 0
    dims = {"batch": 3, "sequence": 2, "past_sequence": 5, "encoder_sequence": 4}
    feeds = named_dim_feeds(fixture_path(name), dims)
    compare_on_feeds(fixture_path(name), run.output, feeds)


def test_cache_of_split_heads_appended_to_by_multi_head_attention(tmp_path: Path) -> None:
    """Concat(past [B, 4, P, 16], split(K)) read by the MatMuls as it is: MultiHeadAttention
    takes K and the past, and its present replaces the Concat."""
    model = _grouped(tmp_path / "cache.onnx", kv_heads=4, past=True, broadcast=True)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(MHA) == (1, 1)
    assert _fused_ops(run) == Counter({"MultiHeadAttention": 1})
    assert run.op_counts() == Counter({"MatMul": 3, "MultiHeadAttention": 1})
    (node,) = [n for n in _graph(run.output).node if n.op_type == "MultiHeadAttention"]
    assert list(node.input) == ["Q", "K", "V", "", "", "mask", "past_k", "past_v"]
    assert len(node.output) == 3
    for batch, seq, past in [(2, 2, 3), (3, 5, 1), (1, 1, 6)]:
        feeds = _grouped_feeds(model, batch=batch, seq=seq, kv_len=seq + past, past=past)
        compare_on_feeds(model, run.output, feeds)


def _decode_shapes(batch: int, sequence: int, past: int) -> str:
    """--input_shape for the qwen2_past fixtures: ``sequence`` new tokens after ``past``."""
    cache = ";".join(
        f"past_{kind}_{layer}:{batch},2,{past},16" for layer in (0, 1) for kind in ("key", "value")
    )
    return f"input_ids:{batch},{sequence};attention_mask:{batch},{past + sequence};{cache}"


@pytest.mark.parametrize(
    ("exporter", "batch", "sequence"),
    [
        ("ts17", 3, 1),
        ("dynamo", 3, 1),
        ("ts17", 1, 3),
        ("dynamo", 1, 3),
    ],
)
def test_grouped_cache_becomes_group_query_attention_with_its_past(
    exporter: str, batch: int, sequence: int, tmp_path: Path
) -> None:
    """Qwen2 with a KV cache, its shapes fixed to one new token per sequence (a decode step)
    or one sequence: the cache Concat(past, new heads) that repeat_kv repeats is
    GroupQueryAttention's past; the op repeats the heads and its presents replace the
    Concats. Padding stays in the mask (causal 0, every key counted in seqlens_k)."""
    name = f"arch/qwen2_past_{exporter}"
    past = 4
    shapes = _decode_shapes(batch, sequence, past)
    run = optimize_checked(fixture_path(name), tmp_path, "--input_shape", shapes, compare=False)
    assert run.counts(GQA) == (2, 2)
    assert reasons(run, GQA) == {}
    graph = _graph(run.output)
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(fused) == 2
    for layer, node in enumerate(fused):
        assert list(node.input[3:5]) == [f"past_key_{layer}", f"past_value_{layer}"]
        assert list(node.output[1:]) == [f"present_key_{layer}", f"present_value_{layer}"]
        assert _attributes(node)["kv_num_heads"] == 2 and _attributes(node)["num_heads"] == 4
    assert len({tuple(node.input[5:7]) for node in fused}) == 1  # seqlens_k, total: shared
    dims = {"batch": batch, "sequence": sequence, "past_sequence": past}
    feeds = named_dim_feeds(fixture_path(name), dims | {"total_sequence": past + sequence})
    feeds["attention_mask"] = _left_padded(batch, past + sequence, [0, 2, 4][:batch])
    compare_on_feeds(fixture_path(name), run.output, feeds)


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_grouped_cache_of_any_batch_and_length_stays_multi_head_attention(
    exporter: str, tmp_path: Path
) -> None:
    """onnxruntime's GroupQueryAttention runs a past only for one sequence or one new token:
    with batch and sequence free, the cache goes to MultiHeadAttention, with the reason."""
    name = f"arch/qwen2_past_{exporter}"
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    reason = (
        "onnxruntime's GroupQueryAttention takes a past only for one sequence or one new token "
        "at a time, and the batch and sequence are not fixed to 1 (--input_shape can fix them)"
    )
    assert reasons(run, GQA) == {reason: 2}
    assert run.counts(MHA) == (2, 2)


@pytest.mark.parametrize("name", LLAMA)
def test_llama_without_grouped_query_attention(name: str, tmp_path: Path) -> None:
    """GroupQueryAttention off: MultiHeadAttention reads the repeated key/value [B, 4, S, 16]
    as they are. In TorchScript's export the repeat's shapes are computed from Shape() of the
    rotated key: the canonical form (constant Reshape targets) and the shapes re-derived after
    the rotary rewrite prove them there too."""
    run = optimize_checked(fixture_path(name), tmp_path, "--disable_pass", GQA)
    assert run.passed(GQA)["state"] == "off"
    graph = _graph(run.output)
    assert run.counts(MHA) == (2, 2)
    assert reasons(run, MHA) == {}
    producers = _producers(graph)
    fused = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert len(fused) == 2
    for node in fused:
        assert _attributes(node)["num_heads"] == 4
        assert producers[node.input[0]].op_type == "RotaryEmbedding"
        assert [producers[v].op_type for v in node.input[1:3]] == ["Reshape", "Reshape"]
    assert len(_repeat_kv_expands(graph)) == 4  # the repeats stay, read by the fused ops
    compare_on_feeds(fixture_path(name), run.output, _text_feeds(name, 3, 5, [0, 2, 4]))


# ---------------------------------------------------------------------------------------------
# onnx.helper models: LLaMA-style grouped attention without rotary, x [B, S, 32]:
#   Q, K, V = MatMul(x, W)  ->  Transpose(Reshape(., [0, 0, -1, H]), [0, 2, 1, 3])
#   k, v = Reshape(Expand(Unsqueeze(., [2]), [1, 1, r, 1, 1]), [0, N, -1, H])     repeat_kv
#   y = Reshape(Transpose(Softmax(MatMul(q, Transpose(k, [0,1,3,2])) * s + mask) @ v), [0,0,N*H])
# ---------------------------------------------------------------------------------------------

HIDDEN = 32


def _n(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output, **attrs)


def _grouped(
    path: Path,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head: int = 16,
    repeat: int | None = None,
    scale: str = "mul",
    kv: str = "matmul",
    target: str = "constant",
    past: bool = False,
    broadcast: bool = False,
    key_gain: bool = False,
) -> Path:
    """``repeat``: copies of each key/value head (heads / kv_heads); ``scale``: Mul by
    1/sqrt(H) or Div by sqrt(H); ``kv``: K and V projected (MatMul) and split into heads, fed
    as inputs of unknown width, or "one_head": projected to one head [B, 1, S, H] by an
    Unsqueeze, no split (GPT-BigCode); ``target``: repeat_kv's Reshape target a constant or a
    graph input ``kv_shape``; ``past``: the heads appended to a cache ``past_k`` / ``past_v``
    [B, KV, P, H]; ``broadcast``: no repeat_kv, the MatMuls broadcast the key/value heads;
    ``key_gain``: the key heads scaled per element of the head after the split (a per-head
    norm's weight), so that they are no plain split."""
    rng = np.random.default_rng(0)
    nodes = [
        _n("MatMul", ["x", "wq"], "Q"),
        _n("Reshape", ["Q", "split"], "q_heads"),
        _n("Transpose", ["q_heads"], "q", perm=[0, 2, 1, 3]),
    ]
    inputs = [value("x", ["batch", "seq", HIDDEN]), value("mask", ["batch", 1, "seq", "kv_len"])]
    initializers = [
        const("wq", rng.normal(size=(HIDDEN, heads * head)) * 0.3),
        const("split", [0, 0, -1, head], np.int64),
        const("axis1", [1], np.int64),
        const("axis2", [2], np.int64),
        const("copies", [1, 1, repeat or heads // kv_heads, 1, 1], np.int64),
        const("merge", [0, 0, heads * head], np.int64),
        const("s", np.array(head**0.5 if scale == "div" else head**-0.5)),
    ]
    reshape = "kv_shape" if target == "input" else "kv_target"
    if target == "input":
        inputs.append(value("kv_shape", [4], TensorProto.INT64))
    else:
        initializers.append(const("kv_target", [0, heads, -1, head], np.int64))
    for name in ("K", "V"):
        if kv == "input":
            inputs.append(value(name, ["batch", "seq", "kv_hidden"]))
        else:
            width = kv_heads * head
            initializers.append(const(f"w{name}", rng.normal(size=(HIDDEN, width)) * 0.3))
            nodes.append(_n("MatMul", ["x", f"w{name}"], name))
        t = name.lower()
        if kv == "one_head":
            nodes.append(_n("Unsqueeze", [name, "axis1"], f"{t}_split"))
        else:
            nodes += [
                _n("Reshape", [name, "split"], f"{t}_heads"),
                _n("Transpose", [f"{t}_heads"], f"{t}_split", perm=[0, 2, 1, 3]),
            ]
        read = f"{t}_split"
        if key_gain and t == "k":
            initializers.append(const("k_gain", rng.uniform(0.5, 1.5, head)))
            nodes.append(_n("Mul", [read, "k_gain"], "k_scaled"))
            read = "k_scaled"
        if past:
            inputs.append(value(f"past_{t}", ["batch", kv_heads, "past", head]))
            nodes.append(_n("Concat", [f"past_{t}", read], f"{t}_cache", axis=2))
            read = f"{t}_cache"
        if broadcast:
            nodes.append(_n("Identity", [read], f"{t}_all"))
            continue
        nodes += [
            _n("Unsqueeze", [read, "axis2"], f"{t}_5d"),
            _n("Expand", [f"{t}_5d", "copies"], f"{t}_copies"),
            _n("Reshape", [f"{t}_copies", reshape], f"{t}_all"),
        ]
    nodes += [
        _n("Transpose", ["k_all"], "kT", perm=[0, 1, 3, 2]),
        _n("MatMul", ["q", "kT"], "scores"),
        _n("Div" if scale == "div" else "Mul", ["scores", "s"], "scaled"),
        _n("Add", ["scaled", "mask"], "masked"),
        _n("Softmax", ["masked"], "probs", axis=-1),
        _n("MatMul", ["probs", "v_all"], "context"),
        _n("Transpose", ["context"], "merged", perm=[0, 2, 1, 3]),
        _n("Reshape", ["merged", "merge"], "y"),
    ]
    output = value("y", ["batch", "seq", heads * head])
    return save_model(path, nodes, inputs, [output], initializers)


def _grouped_feeds(
    path: Path,
    *,
    batch: int = 3,
    seq: int = 5,
    kv_len: int = 5,
    past: int = 0,
    **fixed: np.ndarray,
) -> dict[str, np.ndarray]:
    """Random x, an arbitrary additive mask [B, 1, S, kv_len] (so the bias is really read),
    K / V of width 32 where they are inputs, caches of ``past`` positions."""
    dims = {"batch": batch, "seq": seq, "kv_len": kv_len, "kv_hidden": 32, "past": past}
    return random_feeds(path, seed=3, dims=dims) | fixed


def _fused_ops(run: Run) -> Counter[str]:
    graph = _graph(run.output)
    return Counter(n.op_type for n in graph.node if n.domain == MS)


def test_grouped_cache_of_transformed_heads_is_read_merged(tmp_path: Path) -> None:
    """A grouped KV cache whose new key heads are transformed after the split (Qwen3's
    per-head key norm; here a gain per head element): with the batch fixed to 1,
    GroupQueryAttention reads them merged back to [B, L, KV*H] and takes the cache as its
    past; with free shapes the cache stays MultiHeadAttention's, with the reason."""
    model = _grouped(tmp_path / "gain.onnx", past=True, key_gain=True)
    shapes = "x:1,3,32;mask:1,1,3,7;past_k:1,2,4,16;past_v:1,2,4,16"
    (tmp_path / "fixed").mkdir()
    run = optimize_checked(model, tmp_path / "fixed", "--input_shape", shapes, compare=False)
    assert run.counts(GQA) == (1, 1)
    (node,) = [n for n in _graph(run.output).node if n.op_type == "GroupQueryAttention"]
    assert list(node.input[3:5]) == ["past_k", "past_v"]
    producers = _producers(_graph(run.output))
    merge = producers[node.input[1]]  # the scaled heads, back to [B, L, KV*H]
    # The merge's Transpose and the split's cancel around the per-head gain (moved below it
    # by TransposePushCanonicalizationPass): the heads are scaled in [B, L, KV, H].
    scaled = producers[merge.input[0]]
    assert (merge.op_type, scaled.op_type, producers[scaled.input[0]].op_type) == (
        "Reshape",
        "Mul",
        "Reshape",
    )
    feeds = _grouped_feeds(model, batch=1, seq=3, kv_len=7, past=4)
    compare_on_feeds(model, run.output, feeds)
    (tmp_path / "free").mkdir()
    free = optimize_checked(model, tmp_path / "free", compare=False)
    assert free.counts(MHA) == (1, 1)
    assert list(reasons(free, GQA)) == [
        "onnxruntime's GroupQueryAttention takes a past only for one sequence or one new token "
        "at a time, and the batch and sequence are not fixed to 1 (--input_shape can fix them)"
    ]


def test_grouped_transformed_heads_are_read_merged(tmp_path: Path) -> None:
    """Key heads transformed after the split and before repeat_kv (a per-head norm's weight),
    no cache: GroupQueryAttention reads them merged back to [B, L, KV*H] and repeats them
    itself; the value is its plain projection."""
    model = _grouped(tmp_path / "gain.onnx", key_gain=True)
    run = optimize_checked(model, tmp_path)
    assert run.counts(GQA) == (1, 1)
    assert run.counts(MHA) == (0, 0)
    node = _group_query_attention(run, model, kv_heads=2)
    assert list(node.input[::2][:3]) == ["Q", "V", ""]
    producers = _producers(_graph(run.output))
    merge = producers[node.input[1]]
    # The merge's Transpose and the split's cancel around the per-head gain (moved below it
    # by TransposePushCanonicalizationPass): the heads are scaled in [B, L, KV, H].
    scaled = producers[merge.input[0]]
    assert (merge.op_type, scaled.op_type, producers[scaled.input[0]].op_type) == (
        "Reshape",
        "Mul",
        "Reshape",
    )
    assert _repeat_kv_expands(_graph(run.output)) == []


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_per_head_key_norms_give_group_query_attention(
    name: str, exporter: str, tmp_path: Path
) -> None:
    """Exports whose keys are normed per head after the split (Qwen3, Gemma-3; OLMo-2 and
    EXAONE-4 in the matrix): GroupQueryAttention in both layers, no repeat_kv left."""
    model = fixture_path(f"arch/{name}_{exporter}")
    run = optimize_checked(model, tmp_path)
    assert run.counts(GQA) == (2, 2)
    ops = run.op_counts()
    assert (ops["GroupQueryAttention"], ops["MultiHeadAttention"], ops["Softmax"]) == (2, 0, 0)
    assert _repeat_kv_expands(_graph(run.output)) == []


@pytest.mark.parametrize("scale", ["mul", "div"])
def test_grouped_attention_becomes_group_query_attention(scale: str, tmp_path: Path) -> None:
    model = _grouped(tmp_path / f"{scale}.onnx", scale=scale)
    run = optimize_checked(model, tmp_path)
    assert run.counts(GQA) == (1, 1)
    assert reasons(run, GQA) == {}
    assert run.counts(MHA) == (0, 0)
    assert run.op_counts() == Counter({"MatMul": 3, "GroupQueryAttention": 1}) + SEQLENS_CHAIN
    node = _group_query_attention(run, model, kv_heads=2)
    assert node.domain == MS
    assert list(node.input[:5]) == ["Q", "K", "V", "", ""]
    assert node.input[10] == "mask"


def _group_query_attention(run: Run, model: Path, *, kv_heads: int) -> onnx.NodeProto:
    """The one GroupQueryAttention (4 query heads, scale 1/4, not causal), its outputs equal
    to the original's at three batch and sequence sizes."""
    (node,) = [n for n in _graph(run.output).node if n.op_type == "GroupQueryAttention"]
    attributes = _attributes(node)
    assert attributes.pop("scale") == pytest.approx(0.25, rel=1e-6)
    assert attributes == {"num_heads": 4, "kv_num_heads": kv_heads, "causal": 0}
    for batch, seq in [(3, 5), (1, 1), (2, 7)]:
        feeds = _grouped_feeds(model, batch=batch, seq=seq, kv_len=seq)
        compare_on_feeds(model, run.output, feeds)
    return node


# name: (builder options, GroupQueryAttention's reason, key length per query position)
GROUPED_MISSES = {
    "head_size_8": (
        {"head": 8},
        "head size 8: onnxruntime's GroupQueryAttention takes multiples of 16",
        1,
    ),
    # 4 copies of each of 2 heads, read as 4 heads of twice the length: not repeat_kv
    "repeat_does_not_match": (
        {"repeat": 4},
        "the repeat_kv is not provably 2 copies of each of the 2 key/value heads",
        2,
    ),
    # 3 key/value heads for 4 query heads, 4 copies each: 4 heads of three times the length
    "kv_heads_do_not_divide": (
        {"kv_heads": 3, "repeat": 4},
        "the key/value heads do not divide the query heads",
        3,
    ),
    "unknown_projection_width": (
        {"kv": "input"},
        "the key/value projections' hidden size is unknown or differs",
        1,
    ),
    # the same with key heads transformed after the split: read merged, then declined
    "transformed_heads_repeat_does_not_match": (
        {"key_gain": True, "repeat": 4},
        "the repeat_kv is not provably 2 copies of each of the 2 key/value heads",
        2,
    ),
}


@pytest.mark.parametrize("miss", sorted(GROUPED_MISSES))
def test_grouped_near_misses_go_to_multi_head_attention(miss: str, tmp_path: Path) -> None:
    """GroupQueryAttention declines with the reason; the key/value, [B, 4, L, H] as inferred,
    are read as they are by MultiHeadAttention, which computes what the graph did."""
    options, reason, ratio = GROUPED_MISSES[miss]
    model = _grouped(tmp_path / f"{miss}.onnx", **options)
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(run, GQA, reason, "probs")
    assert run.counts(MHA) == (1, 1)
    assert reasons(run, MHA) == {}
    assert _fused_ops(run) == Counter({"MultiHeadAttention": 1})
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert list(node.input) == ["Q", "k_all", "v_all", "", "", "mask"]
    assert _attributes(node)["num_heads"] == 4
    assert len(_repeat_kv_expands(graph)) == 2
    for batch, seq in [(2, 2), (3, 5)]:
        feeds = _grouped_feeds(model, batch=batch, seq=seq, kv_len=seq * ratio)
        compare_on_feeds(model, run.output, feeds)


def test_unprovable_key_heads_keep_the_attention(tmp_path: Path) -> None:
    """repeat_kv reshaped to a target fed at run time: nothing proves the 4-D key/value
    [batch, heads, length, head size] MultiHeadAttention would read (and GroupQueryAttention
    declines head size 8): the attention stays written out."""
    model = _grouped(tmp_path / "fed_target.onnx", head=8, target="input")
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(
        run, GQA, "head size 8: onnxruntime's GroupQueryAttention takes multiples of 16", "probs"
    )
    reason = "the key or value is not provably [batch, heads, length, head size]"
    assert_declined(run, MHA, reason, "probs")
    assert _fused_ops(run)["MultiHeadAttention"] == 0
    assert run.op_counts()["Softmax"] == 1
    target = np.array([0, 4, -1, 8], np.int64)
    compare_on_feeds(model, run.output, _grouped_feeds(model, kv_shape=target))


def test_grouped_attention_with_gqa_off_is_multi_head_attention(tmp_path: Path) -> None:
    model = _grouped(tmp_path / "off.onnx")
    run = optimize_checked(model, tmp_path, "--disable_pass", GQA)
    assert run.passed(GQA)["state"] == "off"
    assert run.counts(MHA) == (1, 1)
    assert _fused_ops(run) == Counter({"MultiHeadAttention": 1})
    compare_on_feeds(model, run.output, _grouped_feeds(model))


# ---------------------------------------------------------------------------------------------
# Multi-query attention: one key/value head for every query head, however it is spelled out
# (repeat_kv of it or the MatMuls' broadcast; a plain head split or not) -> GroupQueryAttention
# with kv_num_heads=1 on the one head merged to [B, L, H].
# ---------------------------------------------------------------------------------------------

GPT_BIGCODE = ["arch/gpt_bigcode_ts17", "arch/gpt_bigcode_dynamo"]


@pytest.mark.parametrize("name", GPT_BIGCODE)
def test_gpt_bigcode_multi_query_attention_is_group_query_attention(
    name: str, tmp_path: Path
) -> None:
    """GPT-BigCode slices its one key/value head [B, 1, S, 16] out of the fused QKV projection
    (Linear, unsqueeze(1), split) and sdpa repeats it for the 2 query heads: GroupQueryAttention
    with kv_num_heads=1 reads it as [B, S, 16] (one Reshape each), and no repeat is left."""
    assert len(_repeat_kv_expands(_graph(fixture_path(name)))) == 4  # k and v, two layers
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(GQA) == (2, 2)
    assert reasons(run, GQA) == {}
    assert run.counts(MHA) == (0, 0)
    graph = _graph(run.output)
    assert _fused_ops(run)["GroupQueryAttention"] == 2
    assert _fused_ops(run)["MultiHeadAttention"] == 0
    assert _repeat_kv_expands(graph) == []
    producers = _producers(graph)
    for node in (n for n in graph.node if n.op_type == "GroupQueryAttention"):
        attributes = _attributes(node)
        assert attributes.pop("scale") == pytest.approx(0.25, rel=1e-6)
        assert attributes == {"num_heads": 2, "kv_num_heads": 1, "causal": 0}
        for read in node.input[1:3]:
            merge = producers[read]
            assert merge.op_type == "Reshape"
            assert producers[merge.input[0]].op_type == "Split"  # the one head, as sliced
    # Another batch and length than the export's, the last row padded (named_dim_feeds)
    feeds = named_dim_feeds(fixture_path(name), {"batch": 3, "sequence": 5})
    compare_on_feeds(fixture_path(name), run.output, feeds)


@pytest.mark.parametrize("broadcast", [False, True], ids=["repeated", "broadcast"])
def test_one_key_value_head_becomes_group_query_attention(broadcast: bool, tmp_path: Path) -> None:
    """One key/value head that is no head split (an Unsqueeze of a [B, S, 16] projection),
    repeated by repeat_kv or broadcast by the MatMuls: GroupQueryAttention, kv_num_heads=1."""
    model = _grouped(tmp_path / "one_head.onnx", kv_heads=1, kv="one_head", broadcast=broadcast)
    run = optimize_checked(model, tmp_path)
    assert run.counts(GQA) == (1, 1)
    assert reasons(run, GQA) == {}
    assert _fused_ops(run) == Counter({"GroupQueryAttention": 1})
    _group_query_attention(run, model, kv_heads=1)
    # x's three MatMuls, the one head merged back by one Reshape each (the Unsqueeze stays)
    plain = Counter({"MatMul": 3, "Unsqueeze": 2, "Reshape": 2})
    assert run.op_counts() == plain + SEQLENS_CHAIN + Counter({"GroupQueryAttention": 1})


# name: (builder options, GroupQueryAttention's reason, past positions)
ONE_HEAD_MISSES = {
    "head_size_8": (
        {"head": 8},
        "head size 8: onnxruntime's GroupQueryAttention takes multiples of 16",
        0,
    ),
    # GroupQueryAttention takes a past only for one sequence or one new token at a time
    "kv_cache": (
        {"past": True},
        "onnxruntime's GroupQueryAttention takes a past only for one sequence or one new token "
        "at a time, and the batch and sequence are not fixed to 1 (--input_shape can fix them)",
        3,
    ),
}


@pytest.mark.parametrize("miss", sorted(ONE_HEAD_MISSES))
def test_one_key_value_head_near_misses_go_to_multi_head_attention(
    miss: str, tmp_path: Path
) -> None:
    """GroupQueryAttention declines the one repeated key/value head with the reason; the
    repeated [B, 4, L, H] key/value are read as they are by MultiHeadAttention."""
    options, reason, past = ONE_HEAD_MISSES[miss]
    model = _grouped(tmp_path / f"{miss}.onnx", kv_heads=1, kv="one_head", **options)
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(run, GQA, reason, "probs")
    assert run.counts(MHA) == (1, 1)
    assert _fused_ops(run) == Counter({"MultiHeadAttention": 1})
    (node,) = [n for n in _graph(run.output).node if n.op_type == "MultiHeadAttention"]
    assert list(node.input) == ["Q", "k_all", "v_all", "", "", "mask"]
    for batch, seq in [(2, 2), (3, 5)]:
        feeds = _grouped_feeds(model, batch=batch, seq=seq, kv_len=seq + past, past=past)
        compare_on_feeds(model, run.output, feeds)


GEMMA2 = ["arch/gemma2_ts17", "arch/gemma2_dynamo"]


@pytest.mark.parametrize("name", GEMMA2)
def test_soft_capped_scores_become_group_query_attention_softcap(name: str, tmp_path: Path) -> None:
    """Gemma-2 caps the scaled scores, 50 * tanh(s / 50), before adding the mask: that is
    GroupQueryAttention's softcap attribute (applied before attention_bias, as onnxruntime's
    kernel does), in every layer, with the scale of the product kept apart."""
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(GQA) == (2, 2)
    graph = _graph(run.output)
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(fused) == 2
    for node in fused:
        attrs = _attributes(node)
        assert (attrs["num_heads"], attrs["kv_num_heads"]) == (4, 2)
        assert attrs["softcap"] == pytest.approx(50.0)
        assert attrs["scale"] == pytest.approx(256**-0.5, rel=1e-5)  # query_pre_attn_scalar
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["Tanh"], ops["Softmax"]) == (0, 0)


@pytest.mark.parametrize("name", GEMMA2)
def test_soft_capped_scores_are_a_multi_head_attention_near_miss(name: str, tmp_path: Path) -> None:
    """GroupQueryAttention off: MultiHeadAttention has no softcap, so every layer stays written
    out and the report says why (never silent)."""
    run = optimize_checked(fixture_path(name), tmp_path, "--disable_pass", GQA)
    reason = (
        "the scores are soft-capped (tanh), which MultiHeadAttention cannot express "
        "(GroupQueryAttention and the opset-23 Attention have a softcap attribute)"
    )
    assert run.counts(MHA) == (2, 0)
    assert reasons(run, MHA) == {reason: 2}
    assert run.op_counts()["Softmax"] == 2


# Self-attention whose query, key and value are projections of one input by constant weights:
# the packed-QKV com.microsoft Attention, one [hidden, 3 * hidden] GEMM in the op.
# name: (heads, hidden, scale, biased projections)
PACKED = {
    "bert_tiny_dynamo": (4, 32, 8**-0.5, True),
    "vit_tiny_ts17": (4, 32, 8**-0.5, True),
    "t5_tiny_dynamo": (4, 32, 1.0, False),  # no projection biases: zeros in the packed bias
}


@pytest.mark.parametrize("name", sorted(PACKED))
def test_self_attention_becomes_packed_qkv_attention(name: str, tmp_path: Path) -> None:
    heads, hidden, scale, biased = PACKED[name]
    original = onnx.load(str(fixture_path(name))).graph
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(QKV) == (2, 2)
    assert reasons(run, QKV) == {}
    assert run.counts(MHA) == (0, 0)
    graph = _graph(run.output)
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    fused = [n for n in graph.node if n.op_type == "Attention"]
    assert len(fused) == 2 and {n.domain for n in fused} == {MS}
    for node in fused:
        assert _attributes(node)["num_heads"] == heads
        assert _attributes(node)["scale"] == pytest.approx(scale, rel=1e-5)
        assert weights[node.input[1]].shape == (hidden, 3 * hidden)
        assert weights[node.input[2]].shape == (3 * hidden,)
        assert bool(np.any(weights[node.input[2]])) == biased
    # the three projection GEMMs of each layer are one inside the op
    matmuls = Counter(n.op_type for n in original.node)["MatMul"]
    assert Counter(n.op_type for n in graph.node)["MatMul"] == matmuls - 2 * (3 + 2)


@pytest.mark.parametrize(
    ("name", "mha"),
    [("gpt2_tiny_ts17", 2), ("arch/bart_dynamo", 2), ("llama_tiny_past_dynamo", 2)],
)
def test_unpackable_attention_is_left_to_multi_head_attention(
    name: str, mha: int, tmp_path: Path
) -> None:
    """GPT-2's one fused c_attn projection split three ways, BART's cross-attention (key and
    value from the encoder) and a KV cache are no three projections of one input: the packed
    pass leaves them silently (no near-miss) to MultiHeadAttention."""
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    assert reasons(run, QKV) == {}
    assert run.counts(MHA) == (mha, mha)


@pytest.mark.parametrize(("name", "packed"), [("arch/bart_dynamo", 4), ("arch/whisper_ts17", 2)])
def test_query_scaled_before_the_split_goes_into_the_scale(
    name: str, packed: int, tmp_path: Path
) -> None:
    """BART and Whisper multiply the query projection by head_size ** -0.5 before the head
    split: the packed Attention reads the unscaled projection's weights and takes the factor
    as its scale, in the self-attentions; the two cross-attentions stay MultiHeadAttention, and
    so do Whisper TorchScript's decoder self-attentions, whose key split's Shape feeds the
    causal mask (the split stays, reading the projection)."""
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(QKV) == (packed, packed)
    assert reasons(run, QKV) == {}
    assert run.counts(MHA) == (6 - packed, 6 - packed)
    graph = _graph(run.output)
    fused = [n for n in graph.node if n.op_type == "Attention"]
    assert len(fused) == packed
    for node in fused:
        assert _attributes(node)["scale"] == pytest.approx(8**-0.5, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Heads split from one fused projection with Split (LeViT): key head size 4, value head size 8,
# a learned [heads, S, S] position bias added to the scaled scores.

FUSED_HEADS, KEY_SIZE, VALUE_SIZE, SEQ = 2, 4, 8, 6


def _split_projection(path: Path, *, sizes: str = "constant") -> Path:
    """``sizes``: the Split sizes a constant, or a graph input ``parts`` (known at run time)."""
    rng = np.random.default_rng(0)
    width = FUSED_HEADS * (2 * KEY_SIZE + VALUE_SIZE)
    inputs = [value("x", ["batch", SEQ, HIDDEN])]
    initializers = [
        const("w", rng.normal(size=(HIDDEN, width)) * 0.3),
        const("heads", [0, 0, FUSED_HEADS, -1], np.int64),
        const("s", np.array(KEY_SIZE**-0.5)),
        const("pos", rng.normal(size=(FUSED_HEADS, SEQ, SEQ))),
        const("merge", [0, 0, FUSED_HEADS * VALUE_SIZE], np.int64),
    ]
    if sizes == "input":
        inputs.append(value("parts", [3], TensorProto.INT64))
    else:
        initializers.append(const("parts", [KEY_SIZE, KEY_SIZE, VALUE_SIZE], np.int64))
    nodes = [
        _n("MatMul", ["x", "w"], "qkv"),
        _n("Reshape", ["qkv", "heads"], "qkv_heads"),
        helper.make_node("Split", ["qkv_heads", "parts"], ["q4", "k4", "v4"], axis=3),
        _n("Transpose", ["q4"], "q", perm=[0, 2, 1, 3]),
        _n("Transpose", ["k4"], "kT", perm=[0, 2, 3, 1]),
        _n("Transpose", ["v4"], "v", perm=[0, 2, 1, 3]),
        _n("MatMul", ["q", "kT"], "scores"),
        _n("Mul", ["scores", "s"], "scaled"),
        _n("Add", ["scaled", "pos"], "biased"),
        _n("Softmax", ["biased"], "probs", axis=-1),
        _n("MatMul", ["probs", "v"], "context"),
        _n("Transpose", ["context"], "merged", perm=[0, 2, 1, 3]),
        _n("Reshape", ["merged", "merge"], "y"),
    ]
    output = value("y", ["batch", SEQ, FUSED_HEADS * VALUE_SIZE])
    return save_model(path, nodes, inputs, [output], initializers)


def test_split_projection_with_wider_values_becomes_multi_head_attention(tmp_path: Path) -> None:
    """Query and key merged back from the Split's heads (key head size 4), the value heads
    (size 8) merged too, as MultiHeadAttention reads key and value in one layout; the learned
    [N, S, S] bias is attention_bias [1, N, S, S] (the Unsqueeze the fusion writes for it is
    folded by constant folding's run after the fusions)."""
    model = _split_projection(tmp_path / "split.onnx")
    run = optimize_checked(model, tmp_path, *MHA_ONLY)
    assert run.counts(MHA) == (1, 1)
    assert _fused_ops(run) == Counter({"MultiHeadAttention": 1})
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert _attributes(node)["num_heads"] == FUSED_HEADS
    assert _attributes(node)["scale"] == pytest.approx(KEY_SIZE**-0.5, rel=1e-6)
    assert node.input[5] not in _producers(graph)
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    assert "pos" not in weights
    pos = onnx.numpy_helper.to_array(
        next(i for i in onnx.load(str(model)).graph.initializer if i.name == "pos")
    )
    np.testing.assert_array_equal(weights[node.input[5]], pos[np.newaxis])
    for batch in (1, 3):
        compare_on_feeds(model, run.output, random_feeds(model, seed=batch, dims={"batch": batch}))


def test_split_sizes_fed_at_run_time_keep_the_attention(tmp_path: Path) -> None:
    """Split sizes fed at run time: nothing proves the heads' layout the fused op needs."""
    model = _split_projection(tmp_path / "fed_split.onnx", sizes="input")
    run = optimize_checked(model, tmp_path, *MHA_ONLY, compare=False)
    assert_declined(run, MHA, "the query or key heads are not provably 4-D", "probs")
    assert run.op_counts()["Softmax"] == 1
    parts = np.array([KEY_SIZE, KEY_SIZE, VALUE_SIZE], np.int64)
    compare_on_feeds(
        model, run.output, random_feeds(model, seed=1, dims={"batch": 2}) | {"parts": parts}
    )


@pytest.mark.parametrize(("name", "nodes"), [("levit_ts17", 151), ("levit_dynamo", 121)])
def test_levit_attention_with_learned_bias_fused_in_every_layer(
    name: str, nodes: int, tmp_path: Path
) -> None:
    """LeViT: five attentions (two subsampling the query, whose projection is a flattened
    [B*S, C] Linear), each with a learned position bias: all MultiHeadAttention. The query and
    value heads, split as [B, S, N, H] and permuted to [B, N, S, H], are merged back from
    before the permute: no Transpose is left but the classifier's one. The shapes the fused
    ops make static are folded after the fusions (182 -> 177 and 160 -> 154 nodes). The dynamo
    export keeps its Linear + BatchNorm1d layers (MLPLayerWithBN), which LinearBatchnormFusionPass
    folds into their MatMuls: 154 -> 128 nodes. The last stage's query has one position: its
    bias has every row already, so none is spread to the rows (177 -> 171, 128 -> 121: in the
    dynamo export MultiHeadAttentionBiasFusionPass then takes one more bias Add, 2 sites).
    TorchScript's reshapes to another tensor's whole shape (``Reshape(x, Shape(y))``) are read
    as that shape's sizes, constant targets: its 20 Shapes go (171 -> 151)."""
    run = optimize_checked(FIXTURES / "arch" / f"{name}.onnx", tmp_path)
    assert run.counts(MHA) == (5, 5)
    assert reasons(run, MHA) == {}
    assert _fused_ops(run)["MultiHeadAttention"] == 5
    counts = run.op_counts()
    assert (counts["Softmax"], counts["Transpose"]) == (0, 1)
    assert run.report["model"]["after"]["nodes"] == nodes


# ---------------------------------------------------------------------------------------------
# Heads folded into the batch (Bloom's baddbmm): scores [B*N, S, L] = alibi + s * q @ k^T on
# folded heads, unfolded to [B, N, S, L] for the mask and Softmax, folded again for the context.

FOLD_BATCH, FOLD_HEADS, FOLD_SIZE, FOLD_SEQ = 2, 4, 8, 5


def _folded_heads(path: Path, *, bias: str = "static", unfold: str = "constant") -> Path:
    """``bias``: the ALiBi-like bias [B*N, 1, L] of static size, or led by a symbolic size
    ``bn``; ``unfold``: the scores' Reshape to 4-D a constant or fed at run time."""
    rng = np.random.default_rng(0)
    hidden = FOLD_HEADS * FOLD_SIZE
    folded = FOLD_BATCH * FOLD_HEADS
    shape = [FOLD_BATCH, FOLD_SEQ, HIDDEN]
    leading = folded if bias == "static" else "bn"
    inputs = [
        value("x", shape),
        value("alibi", [leading, 1, FOLD_SEQ]),
        value("mask", [FOLD_BATCH, 1, FOLD_SEQ, FOLD_SEQ]),
    ]
    initializers = [
        const("split", [0, 0, FOLD_HEADS, FOLD_SIZE], np.int64),
        const("fold", [-1, FOLD_SEQ, FOLD_SIZE], np.int64),
        const("fold_scores", [-1, FOLD_SEQ, FOLD_SEQ], np.int64),
        const("unfold_context", [-1, FOLD_HEADS, FOLD_SEQ, FOLD_SIZE], np.int64),
        const("merge", [0, 0, hidden], np.int64),
        const("s", np.array(FOLD_SIZE**-0.5)),
    ]
    if unfold == "input":
        inputs.append(value("unfold_scores", [4], TensorProto.INT64))
    else:
        target = [-1, FOLD_HEADS, FOLD_SEQ, FOLD_SEQ]
        initializers.append(const("unfold_scores", target, np.int64))
    nodes = []
    for name in ("q", "k", "v"):
        initializers.append(const(f"w{name}", rng.normal(size=(HIDDEN, hidden)) * 0.3))
        nodes += [
            _n("MatMul", ["x", f"w{name}"], name.upper()),
            _n("Reshape", [name.upper(), "split"], f"{name}_bsnh"),
            _n("Transpose", [f"{name}_bsnh"], f"{name}4", perm=[0, 2, 1, 3]),
            _n("Reshape", [f"{name}4", "fold"], f"{name}3"),
        ]
    nodes += [
        _n("Transpose", ["k3"], "kT3", perm=[0, 2, 1]),
        _n("MatMul", ["q3", "kT3"], "product"),
        _n("Mul", ["product", "s"], "scaled"),
        _n("Add", ["alibi", "scaled"], "scores3"),
        _n("Reshape", ["scores3", "unfold_scores"], "scores4"),
        _n("Add", ["scores4", "mask"], "masked"),
        _n("Softmax", ["masked"], "probs", axis=-1),
        _n("Reshape", ["probs", "fold_scores"], "probs3"),
        _n("MatMul", ["probs3", "v3"], "context3"),
        _n("Reshape", ["context3", "unfold_context"], "context4"),
        _n("Transpose", ["context4"], "merged", perm=[0, 2, 1, 3]),
        _n("Reshape", ["merged", "merge"], "y"),
    ]
    return save_model(path, nodes, inputs, [value("y", [*shape[:2], hidden])], initializers)


def _folded_feeds(path: Path, seed: int, **fixed: np.ndarray) -> dict[str, np.ndarray]:
    return random_feeds(path, seed=seed, dims={"bn": FOLD_BATCH * FOLD_HEADS}) | fixed


def test_heads_folded_into_the_batch_become_multi_head_attention(tmp_path: Path) -> None:
    """The folded bias [B*N, 1, L] becomes attention_bias Reshape(Unsqueeze(b, 1), [-1, N, 0,
    0]) [B, N, 1, L], summed with the mask; every fold and unfold is gone."""
    model = _folded_heads(tmp_path / "folded.onnx")
    run = optimize_checked(model, tmp_path, *MHA_ONLY)
    assert run.counts(MHA) == (1, 1)
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert _attributes(node)["num_heads"] == FOLD_HEADS
    producers = _producers(graph)
    total = producers[node.input[5]]
    assert total.op_type == "Add"
    assert total.input[0] == "mask"
    unfold = producers[total.input[1]]
    assert unfold.op_type == "Reshape"
    assert producers[unfold.input[0]].op_type == "Unsqueeze"
    assert producers[unfold.input[0]].input[0] == "alibi"
    assert run.op_counts()["Softmax"] == 0
    for seed in (1, 2):
        compare_on_feeds(model, run.output, _folded_feeds(model, seed))


@pytest.mark.parametrize(
    ("bias", "unfold", "reason"),
    [
        (
            "symbolic",
            "constant",
            "a bias added to the [batch*heads, ...] scores is not provably led by 1 or "
            "batch*heads (its leading size is bn)",
        ),
        (
            "static",
            "input",
            "a Reshape between [batch, heads, X, Y] and [batch*heads, X, Y] does not provably "
            "keep X and Y (sizes unknown)",
        ),
    ],
)
def test_unprovable_folded_heads_keep_the_attention(
    bias: str, unfold: str, reason: str, tmp_path: Path
) -> None:
    model = _folded_heads(tmp_path / f"{bias}_{unfold}.onnx", bias=bias, unfold=unfold)
    run = optimize_checked(model, tmp_path, *MHA_ONLY, compare=False)
    assert_declined(run, MHA, reason, "probs")
    target = np.array([-1, FOLD_HEADS, FOLD_SEQ, FOLD_SEQ], np.int64)
    feeds = _folded_feeds(model, 1) | ({"unfold_scores": target} if unfold == "input" else {})
    compare_on_feeds(model, run.output, feeds)


@pytest.mark.parametrize("name", ["arch/bloom_ts17", "arch/bloom_dynamo", "bloom_ts11"])
def test_bloom_alibi_fused_in_every_layer(name: str, tmp_path: Path) -> None:
    """Bloom: ALiBi on heads folded into the batch; both layers fused. Under TorchScript the
    folds' sizes are computed at run time (Reshape targets of Shape -> Gather, Mul and -1):
    they are proven by tracing those sizes to named dimensions. At opset 11
    (``make_arch_matrix.py --torchscript-opset 11``) the bias's Unsqueeze takes its axes as an
    attribute (an axes input was an internal error there). Its QKV, viewed [B, L, N, 3, H]
    and taken apart by index, is cut into three projections
    (ProjectionPieceCanonicalizationPass), which the packed Attention op takes with their
    weights (MultiHeadAttention on the sliced heads before)."""
    run = optimize_checked(FIXTURES / f"{name}.onnx", tmp_path)
    assert run.counts(QKV) == (2, 2)
    assert reasons(run, QKV) == {}
    assert _fused_ops(run)["Attention"] == 2
    assert run.op_counts()["Softmax"] == 0


def test_bloom_layer_declined_after_building_its_shared_bias_leaves_no_dangling_value(
    tmp_path: Path,
) -> None:
    """The first layer's QKV view target (a Concat) also a graph output: its projection stays
    whole, and QkvAttentionFusionPass builds the unfolded ALiBi bias the layers share, then
    leaves that layer. The second layer must not take the bias from the site that did not
    land, whose nodes never entered the graph (saving the model failed: a node read a value of
    no graph); it builds its own, and the first layer is MultiHeadAttention's (found by fuzzing
    graph outputs)."""
    concat = "/inner/h.0/self_attention/Concat_output_0"

    def expose(model: onnx.ModelProto) -> None:
        model.graph.output.append(helper.make_tensor_value_info(concat, TensorProto.INT64, [None]))

    path = edited_fixture("arch/bloom_ts17", tmp_path, expose, "bloom_concat_output")
    run = optimize_checked(path, tmp_path, compare=False)
    assert run.counts(QKV) == (1, 1) and run.counts(MHA) == (1, 1)
    assert _fused_ops(run)["Attention"] == 1 and _fused_ops(run)["MultiHeadAttention"] == 1
    assert run.op_counts()["Softmax"] == 0
    dims = json.loads((FIXTURES / "arch" / "manifest.json").read_text())["dims"]
    compare_on_feeds(path, run.output, named_dim_feeds(path, dims))


def test_an_identity_before_a_layers_axes_keeps_its_heads_provable(tmp_path: Path) -> None:
    """GPT-BigCode (TorchScript) with an Identity between the second layer's Unsqueeze and the
    constant axes it reads: the Unsqueeze's shape is inferred only once the Identity is folded,
    and its sequence dimension then has the name the first inference gave it elsewhere, so the
    query's heads are proven and both layers fuse (1/2 before: a second inference's made-up
    name differed; found by fuzzing with Identity nodes on random edges)."""

    def through_identity(model: onnx.ModelProto) -> None:
        unsqueeze = node_named(model, "/inner/h.1/attn/Unsqueeze")
        model.graph.node.insert(
            list(model.graph.node).index(unsqueeze),
            helper.make_node("Identity", [unsqueeze.input[1]], ["axes_copy"]),
        )
        unsqueeze.input[1] = "axes_copy"

    path = edited_fixture("arch/gpt_bigcode_ts17", tmp_path, through_identity, "bigcode_identity")
    run = optimize_checked(path, tmp_path, compare=False)
    (tmp_path / "plain").mkdir()
    plain = optimize_checked(fixture_path("arch/gpt_bigcode_ts17"), tmp_path / "plain")
    assert run.report["coverage"]["attention"]["fused"] == 2
    assert _fused_ops(run) == _fused_ops(plain)
    dims = json.loads((FIXTURES / "arch" / "manifest.json").read_text())["dims"]
    compare_on_feeds(path, run.output, named_dim_feeds(path, dims))


@pytest.mark.parametrize(
    ("reader", "index"),
    [
        # The position Unsqueeze's axes: onnxruntime's symbolic inference stopped at that
        # Unsqueeze on the graph as loaded (axes not a constant); it reads the graph as it is
        # once the Identity is folded.
        ("/inner/embed_positions/Unsqueeze_1", 1),
        # A size the first layer's head split reads: the symbolic inference stopped at the
        # Identity too (a fresh symbol, not the size it copies); it reads past Identities.
        ("/inner/layers.0/self_attn/Unsqueeze_1", 0),
    ],
)
def test_an_identity_in_the_shape_arithmetic_keeps_the_folds_provable(
    reader: str, index: int, tmp_path: Path
) -> None:
    """XGLM (TorchScript) with an Identity before one input of a node of its shape arithmetic:
    the folds of its heads into the batch went unproven (0/2); both layers fuse as without it
    (found by fuzzing with Identity nodes on random edges)."""

    def through_identity(model: onnx.ModelProto) -> None:
        node = node_named(model, reader)
        model.graph.node.insert(
            list(model.graph.node).index(node),
            helper.make_node("Identity", [node.input[index]], ["copied"]),
        )
        node.input[index] = "copied"

    path = edited_fixture("arch/xglm_ts17", tmp_path, through_identity, "xglm_identity")
    run = optimize_checked(path, tmp_path, compare=False)
    assert run.report["coverage"]["attention"]["fused"] == 2
    assert _fused_ops(run)["Attention"] == 2  # the packed QKV op, as without the Identity
    dims = json.loads((FIXTURES / "arch" / "manifest.json").read_text())["dims"]
    compare_on_feeds(path, run.output, named_dim_feeds(path, dims))


def test_latent_attention_with_smaller_value_heads_reads_both_merged(tmp_path: Path) -> None:
    """DeepSeek-V3's multi-head latent attention (dynamo): the key joins a plain and a rotary
    part per head ([B, N, L, 16]), the value heads are smaller ([B, N, L, 8]). The op reads
    4-D key and value of one shape only, so both are merged to [B, L, N*H] (before, the
    output did not load in onnxruntime)."""
    model = FIXTURES / "arch" / "deepseek_v3_dynamo.onnx"
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(MHA) == (2, 2)
    graph = _graph(run.output)
    shapes = {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}
    for node in (n for n in graph.node if n.op_type == "MultiHeadAttention"):
        for name in node.input[1:3]:
            dims = shapes[name].type.tensor_type.shape.dim if name in shapes else None
            assert dims is None or len(dims) == 3, name
        assert _producers(graph)[node.input[1]].op_type == "Reshape"
        assert _producers(graph)[node.input[2]].op_type == "Reshape"
    dims = json.loads((FIXTURES / "arch" / "manifest.json").read_text())["dims"]
    compare_on_feeds(model, run.output, named_dim_feeds(model, dims))


CONTEXT_RESHAPED = "the context [batch, heads, sequence, head size] is not provably kept by the Reshape before its Transpose"  # noqa: E501


@pytest.mark.parametrize(
    ("name", "constant", "index", "pass_name"),
    [
        ("arch/modernbert_ts17", "/inner/layers.0/attn/Constant_29", 1, MHA),
        ("arch/roberta_ts17", "/inner/encoder/layer.1/attention/self/Constant_14", 1, QKV),
    ],
)
def test_context_reshaped_to_other_sizes_keeps_the_attention(
    name: str, constant: str, index: int, pass_name: str, tmp_path: Path
) -> None:
    """TorchScript reshapes the context [B, N, S, H] before its Transpose to sizes it reads
    from shapes at run time: a no-op while they are the context's own. Read from another
    axis (the heads where the sequence was), the Reshape reorders the elements, and that
    layer's attention stays written out."""
    unchanged = optimize_checked(fixture_path(name), tmp_path)
    assert unchanged.counts(pass_name) == (2, 2)

    def read_another_axis(model: onnx.ModelProto) -> None:
        array = np.array(index, np.int64)
        node_named(model, constant).attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(array))

    path = edited_fixture(name, tmp_path, read_another_axis, f"{Path(name).name}_changed")
    run = optimize_checked(path, tmp_path)
    assert run.counts(pass_name) == (2, 1)
    assert reasons(run, pass_name) == {CONTEXT_RESHAPED: 1}


def test_a_mask_with_one_column_for_every_key_keeps_the_attention(tmp_path: Path) -> None:
    """CLIP-text's dynamo export unsqueezes its padding mask to [B, 1, 1, L]. Unsqueezed to
    [B, 1, L, 1] instead, one column broadcasts over every key: the written-out scores add it,
    onnxruntime's attention ops refuse it when they run (attention_bias takes a column per
    key). The attention stays written out, with the reason, and the output runs."""
    unchanged = optimize_checked(fixture_path("arch/clip_text_dynamo"), tmp_path)
    assert unchanged.counts(QKV) == (2, 2)

    def unsqueeze_last(model: onnx.ModelProto) -> None:
        (axes,) = [t for t in model.graph.initializer if t.name == "val_36"]
        axes.CopyFrom(onnx.numpy_helper.from_array(np.array([3], np.int64), "val_36"))
        # The shapes the exporter recorded after it no longer hold ([1, 1, 1, L] is now
        # [1, 1, L, 1]); an exporter writing this mask would record the new ones.
        del model.graph.value_info[:]

    path = edited_fixture("arch/clip_text_dynamo", tmp_path, unsqueeze_last, "clip_mask_column")
    run = optimize_checked(path, tmp_path)
    reason = (
        "the additive mask has one column for every key ([.., 1]): onnxruntime's attention ops "
        "take attention_bias with a column per key"
    )
    assert run.counts(QKV) == (2, 0)
    assert reasons(run, QKV) == {reason: 2}
    assert run.op_counts()["Softmax"] == 2


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_scores_folded_only_for_their_product(exporter: str, tmp_path: Path) -> None:
    """GPT-NeoX-Japanese computes the scores with baddbmm on heads folded to [B*N, S, H],
    unfolds them to [B, N, S, L] before the mask and the Softmax, and multiplies the
    probabilities with the value as 4-D heads: the fold proves itself on the query and key
    side, and the value and context are the unfolded layout's. Both layers fuse."""
    run = optimize_checked(fixture_path(f"arch/gpt_neox_japanese_{exporter}"), tmp_path)
    assert run.counts(MHA) == (2, 2)
    assert not run.passed(MHA).get("near_misses")
    assert run.op_counts()["MultiHeadAttention"] == 2
    assert run.op_counts()["Softmax"] == 0


def test_scores_scaled_by_zero_keep_the_attention(tmp_path: Path) -> None:
    """Gemma's dynamo export scales q and K^T by sqrt(scale) each. With K^T's factor 0 every
    score is 0 (uniform probabilities), but onnxruntime's attention ops read a scale of 0 as
    unset (1/sqrt(head size)): layer 1's attention stays written out, with the reason."""
    path = edited_fixture(
        "arch/gemma_dynamo",
        tmp_path,
        lambda model: feed_scalar(model, "node_Mul_348", 1, 0.0),
        "gemma_zero_scale",
    )
    run = optimize_checked(path, tmp_path)
    reason = "the scores are scaled by 0, which the fused ops read as 1/sqrt(head size)"
    assert run.counts(GQA) == (2, 1)
    assert reasons(run, GQA) == {reason: 1}
    assert reasons(run, MHA) == {reason: 1}
    assert run.op_counts()["GroupQueryAttention"] == 1
    assert run.op_counts()["Softmax"] == 1


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_repeated_heads_of_unequal_sizes_are_read_merged(exporter: str, tmp_path: Path) -> None:
    """MiMo-V2-Flash repeats key heads of 16 and value heads of 8 for 4/2 grouped attention:
    MultiHeadAttention reads 4-D key and value of one shape only, so both are merged to
    [B, L, N*H] with the repeat in them. Its sliding layer (a sink per head) stays written
    out: GroupQueryAttention, which has the sink, takes equal head sizes only."""
    run = optimize_checked(fixture_path(f"arch/mimo_v2_flash_{exporter}"), tmp_path)
    assert run.counts(MHA) == (2, 1)
    graph = onnx.load(str(run.output)).graph
    (fused,) = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    shapes = {v.name: v.type.tensor_type.shape for v in graph.value_info}
    assert [len(shapes[name].dim) for name in fused.input[:3]] == [3, 3, 3]
    assert [shapes[name].dim[2].dim_value for name in fused.input[1:3]] == [4 * 16, 4 * 8]
    assert run.op_counts()["Softmax"] == 1


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_context_gated_per_head_is_read_split_back(exporter: str, tmp_path: Path) -> None:
    """LFM3 gates the context per head in [B, S, N, H], after TorchScript's no-op Reshape and
    the Transpose, before the merge: the fused op's output is split back into that layout for
    the gate, in both the sliding and the full layer."""
    run = optimize_checked(fixture_path(f"arch/lfm3_{exporter}"), tmp_path)
    assert run.counts(GQA) == (2, 2)
    assert reasons(run, GQA) == {}
    assert run.op_counts()["Softmax"] == 0


@pytest.mark.parametrize("model", ["lfm3_ts17", "lfm2_ts17"])
def test_per_head_norms_as_the_opset_23_op_keep_the_heads_known(model: str, tmp_path: Path) -> None:
    """LFM2 and LFM3 norm q and k per head. Converted to opset 23 (onnx's version converter),
    those norms fuse to the standard RMSNormalization on [B, S, N, H], whose output TorchScript's
    run-time head split leaves without static sizes: the head count and size are read through
    it as through any op that keeps its input's shape (attention 0/2 and 0/1 before)."""
    from onnx import version_converter

    source = tmp_path / f"{model}_23.onnx"
    original = onnx.load(str(fixture_path(f"arch/{model}")))
    onnx.save(version_converter.convert_version(original, 23), str(source))
    run = optimize_checked(source, tmp_path)
    # LFM2's heads of 8 are no GroupQueryAttention's (multiples of 16): MultiHeadAttention's
    fusion, layers = {"lfm3_ts17": (GQA, 2), "lfm2_ts17": (MHA, 1)}[model]
    assert run.counts(fusion) == (layers, layers)
    assert run.report["coverage"]["attention"] == {"fused": layers, "total": layers, "unfused": []}
    assert run.op_counts()["RMSNormalization"] >= 2 * layers  # the per-head q and k norms


def test_heads_counted_through_sizes_inference_left_unnamed(tmp_path: Path) -> None:
    """Inkling's TorchScript export adds to its key projection a short convolution of that
    projection masked by attention_mask[:, -S:], a Slice with a run-time start that onnx's
    inference gives no sizes: the sum is [?, ?, 32] to inference, and the head split's -1 was
    not counted (attention 0/2: "the number of heads or the head size of the query or key is
    unknown"). Each size traced to what it is ([batch, sequence, 32]), the -1 is 2 heads."""
    model = fixture_path("arch/inkling_text_ts17")
    run = optimize_checked(model, tmp_path)
    assert run.counts(GQA) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    for batch, length in ((1, 1), (2, 8), (3, 13)):  # the last row padded (named_dim_feeds)
        feeds = named_dim_feeds(model, {"batch": batch, "sequence": length})
        compare_on_feeds(model, run.output, feeds)


def test_head_merge_counted_through_sizes_inference_left_unnamed(tmp_path: Path) -> None:
    """SAM's TorchScript vision encoder merges its heads back with a -1 over a context whose
    sizes inference leaves unnamed (its windows are padded to sizes computed at run time): the
    merge's target stayed computed and the head size unknown (attention 0/2: "the context's
    head size is unknown"). ReshapeTargetCanonicalizationPass counts that -1 from the sizes
    traced through the attention, so the merge reads a constant head size and both layers
    fuse. The batch is fed at two sizes."""
    model = fixture_path("arch/sam_vision_ts17")
    run = optimize_checked(model, tmp_path)
    assert run.counts(MHA) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    assert run.op_counts()["Softmax"] == 0
    for batch in (1, 3):
        compare_on_feeds(model, run.output, named_dim_feeds(model, {"batch": batch}))


@pytest.mark.parametrize("name", ["arch/qwen3_ts17", "arch/gemma3_ts17", "arch/nanochat_ts17"])
def test_seqlens_shared_where_only_traced_sizes_tie_the_layers(name: str, tmp_path: Path) -> None:
    """Per-head query norms (Qwen3, Gemma 3, nanochat) leave each layer's query with sizes
    inference made up for it alone: the layers' seqlens_k / total_sequence_length were
    computed once per layer. Traced through the ops, both queries are [batch, sequence, ...]:
    one chain serves both layers."""
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(GQA) == (2, 2)
    graph = _graph(run.output)
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(fused) == 2 and len({tuple(n.input[5:7]) for n in fused}) == 1
    _assert_one_seqlens_chain(run, graph)
    for batch, length in ((1, 1), (3, 7)):
        feeds = named_dim_feeds(fixture_path(name), {"batch": batch, "sequence": length})
        compare_on_feeds(fixture_path(name), run.output, feeds)


def test_key_folded_to_other_sizes_keeps_the_attention(tmp_path: Path) -> None:
    """Dynamo transposes K by folding [B, N, L, H] to [B*N, L, H], swapping the last two and
    unfolding. With layer 0's fold target reordered ([L, B*N, H]: the same count, other
    elements) that is no K^T, and that layer stays written out; layer 1 still fuses."""

    def reorder_fold(model: onnx.ModelProto) -> None:
        concat = node_named(model, "node_Concat_90")
        concat.input[0], concat.input[1] = concat.input[1], concat.input[0]

    path = edited_fixture("arch/roberta_dynamo", tmp_path, reorder_fold, "roberta_refolded")
    unchanged = optimize_checked(fixture_path("arch/roberta_dynamo"), tmp_path)
    assert unchanged.counts(QKV) == (2, 2)
    run = optimize_checked(path, tmp_path)
    assert run.counts(QKV) == (2, 1)
    reason = "the key is not transposed heads [batch, heads, head size, length] of a tensor"
    assert reasons(run, QKV) == reasons(run, MHA) == {reason: 1}
    assert run.op_counts()["Softmax"] == 1


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_sink_applied_after_the_attention_is_the_head_sink(exporter: str, tmp_path: Path) -> None:
    """Granite-SWA scales the context by sigmoid(logsumexp(scores) - sink), a learned logit
    per head: that is e^s @ v / (sum(e^s) + e^sink), GroupQueryAttention's head_sink. Both
    layers fuse with the model's sinks; MultiHeadAttention, which has none, says so."""
    model = fixture_path(f"arch/granite_swa_{exporter}")
    run = optimize_checked(model, tmp_path)
    assert run.counts(GQA) == (2, 2)
    graph = onnx.load(str(run.output)).graph
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    sinks = {
        t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer if "head_sink" in t.name
    }
    assert len(fused) == 2 and all(n.input[11] in sinks for n in fused)
    source = onnx.load(str(model)).graph
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in source.initializer}
    lse = {n.output[0] for n in source.node if n.op_type == "ReduceLogSumExp"}
    subs = [n for n in source.node if n.op_type == "Sub" and n.input[0] in lse]
    learned = [weights[n.input[1]].reshape(-1) for n in subs]  # [1, N, 1] per layer
    assert len(learned) == 2
    for node, expected in zip(fused, learned, strict=True):
        np.testing.assert_array_equal(sinks[node.input[11]], expected)
    counts = run.op_counts()
    assert counts["ReduceLogSumExp"] == counts["Sigmoid"] == counts["Softmax"] == 0


def _cast_sinks(graph: onnx.GraphProto) -> list[str]:
    """The initializers behind each sink column: Concat(scores, Cast(Expand(sink, ...)))."""
    producers = _producers(graph)
    found = []
    for concat in (n for n in graph.node if n.op_type == "Concat" and len(n.input) == 2):
        cast = producers.get(concat.input[1])
        if cast is None or cast.op_type != "Cast":
            continue
        expand = producers.get(cast.input[0])
        if expand is not None and expand.op_type == "Expand":
            found.append(expand.input[0])
    return found


def test_a_sink_cast_with_promoted_scores_is_the_head_sink(tmp_path: Path) -> None:
    """Flint in float16 (TorchScript): the scores are promoted to float32, and its sink
    column, a float16 logit per head expanded to every row, is cast to float32 with them
    before the Concat. The logits as cast are GroupQueryAttention's head_sink (0/2 before:
    "the scores ... come from Concat"); the op computes in float32 as the scores did."""
    model = fixture_path("flint_ts17_fp16")
    source = onnx.load(str(model)).graph
    sinks = _cast_sinks(source)
    assert len(sinks) == 2
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(GQA) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    graph = onnx.load(str(run.output)).graph
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    originals = {t.name: onnx.numpy_helper.to_array(t) for t in source.initializer}
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    for node, sink in zip(fused, sinks, strict=True):
        head_sink = weights[node.input[11]]
        assert head_sink.dtype == np.float32
        np.testing.assert_array_equal(head_sink, originals[sink].astype(np.float32).reshape(-1))
    for batch, length in ((1, 1), (2, 8)):
        feeds = named_dim_feeds(model, {"batch": batch, "sequence": length})
        for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-2, rtol=1e-2)  # float16 outputs


def test_a_sink_column_computed_at_run_time_keeps_the_attention(tmp_path: Path) -> None:
    """Near miss: the sink logits fed as a graph input, not constants, are no head_sink (the
    op takes constants per head): both layers stay written out, and say why."""

    def feed_the_sinks(model: onnx.ModelProto) -> None:
        for name in _cast_sinks(model.graph):
            (init,) = [t for t in model.graph.initializer if t.name == name]
            model.graph.initializer.remove(init)
            model.graph.input.append(
                helper.make_tensor_value_info(name, init.data_type, list(init.dims))
            )

    path = edited_fixture("flint_ts17_fp16", tmp_path, feed_the_sinks, "flint_fed_sinks")
    run = optimize(path, tmp_path)
    check_output(run)
    assert run.counts(GQA) == (2, 0)
    reason = (
        "the scores are not MatMul(query, key^T) with additive biases and a constant scale "
        "(they come from Concat)"
    )
    assert reasons(run, GQA) == {reason: 2}


def test_sink_scale_of_other_scores_keeps_the_attention(tmp_path: Path) -> None:
    """The log-sum-exp of scores other than those the Softmax reads (here the Add before the
    mask) is no sink: Granite-SWA's layer 0 then stays written out."""

    def unmasked_scores(model: onnx.ModelProto) -> None:
        producers = {o: n for n in model.graph.node for o in n.output}
        lse = next(n for n in model.graph.node if n.op_type == "ReduceLogSumExp")
        lse.input[0] = producers[lse.input[0]].input[0]  # the scaled scores, before the mask

    path = edited_fixture("arch/granite_swa_dynamo", tmp_path, unmasked_scores, "granite_other")
    run = optimize_checked(path, tmp_path)
    assert run.counts(GQA) == (2, 1)
    assert run.op_counts()["Softmax"] == 1


def test_attention_promoted_to_float32_from_half_precision(tmp_path: Path) -> None:
    """The fp16 LLaMA exported by TorchScript: its sdpa adds the float32 mask to the float16
    product, so the exporter casts the product and the value to float32 and the Softmax and
    context run in float32. GroupQueryAttention computes the same in float32 from the rotated
    query and key and the value's projection, each cast to float32 (compared at float16
    tolerance: the original rounds q @ k^T to float16 before the cast)."""
    run = optimize(fixture_path("fp16_llama_tiny_ts17"), tmp_path)
    check_output(run)
    assert_same_outputs(fixture_path("fp16_llama_tiny_ts17"), run.output, atol=1e-2, rtol=1e-2)
    assert run.counts(GQA) == (2, 2)
    assert reasons(run, GQA) == {}
    graph = _graph(run.output)
    producers = _producers(graph)
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(fused) == 2 and run.op_counts()["Softmax"] == 0
    for node in fused:
        casts = [producers[v] for v in node.input[:3]]
        assert [c.op_type for c in casts] == ["Cast"] * 3
        assert all(_attributes(c) == {"to": TensorProto.FLOAT} for c in casts)
        sources = [producers[c.input[0]].op_type for c in casts]
        assert sources == ["RotaryEmbedding", "RotaryEmbedding", "MatMul"]


def test_attention_promoted_but_its_value_not_is_declined(tmp_path: Path) -> None:
    """The same export with layer 0's value cast to float32 and then doubled: the context's
    value is no longer the promoted value heads, so that layer stays written out. (Not by 1: a
    Mul by 1 is no Mul, NeutralOperandEliminationPass.)"""

    def unpromote_value(model: onnx.ModelProto) -> None:
        context = node_named(model, "/inner/layers.0/self_attn/MatMul_1")
        model.graph.initializer.append(const("two_f32", np.array(2.0, np.float32)))
        doubled = helper.make_node("Mul", [context.input[1], "two_f32"], ["value_doubled"])
        model.graph.node.insert(list(model.graph.node).index(context), doubled)
        context.input[1] = "value_doubled"

    path = edited_fixture("fp16_llama_tiny_ts17", tmp_path, unpromote_value, "fp16_value_mul")
    run = optimize(path, tmp_path)
    check_output(run)
    assert_same_outputs(path, run.output, atol=1e-2, rtol=1e-2)
    reason = "the scores are promoted to float32, the value not from their type"
    assert run.counts(GQA) == (2, 1)
    assert reasons(run, GQA) == {reason: 1}


def test_promoted_attention_does_not_append_to_a_narrower_cache(tmp_path: Path) -> None:
    """The fp16 LLaMA with a KV cache (TorchScript), one sequence at a time: GroupQueryAttention
    could take the cache as its past, but it would append float32 heads to the float16 presents
    the graph returns. It declines with the reason, and MultiHeadAttention reads the joined key
    and value, each cast to float32 as the original computes with them."""
    name, past, sequence = "fp16_llama_tiny_past_ts17", 4, 3
    shapes = _decode_shapes(1, sequence, past)
    run = optimize(fixture_path(name), tmp_path, "--input_shape", shapes)
    check_output(run)
    reason = (
        "the attention computes in FLOAT from promoted operands, but the cache it appends to "
        "keeps their type"
    )
    assert run.counts(GQA) == (2, 0)
    assert reasons(run, GQA) == {reason: 2}
    assert run.counts(MHA) == (2, 2)
    graph = _graph(run.output)
    producers = _producers(graph)
    for node in (n for n in graph.node if n.op_type == "MultiHeadAttention"):
        assert [producers[v].op_type for v in node.input[:3]] == ["Cast"] * 3
    dims = {"batch": 1, "sequence": sequence, "past_sequence": past}
    feeds = named_dim_feeds(fixture_path(name), dims | {"total_sequence": past + sequence})
    expected, actual = run_model(fixture_path(name), feeds), run_model(run.output, feeds)
    for want, got in zip(expected, actual, strict=True):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=1e-2)


def _promoted_self_attention(path: Path) -> Path:
    """BERT-style self-attention in float16 (q, k, v projections of one input by constant
    weights, 2 heads of 4) whose product and value are cast to float32 before a float32 mask
    and the Softmax, as TorchScript's sdpa writes it in half precision."""
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    rng = np.random.default_rng(0)

    def heads(name: str, perm: list[int]) -> list[onnx.NodeProto]:
        return [
            helper.make_node("MatMul", ["x", f"w_{name}"], [f"{name}_proj"]),
            helper.make_node("Reshape", [f"{name}_proj", "split"], [f"{name}_split"]),
            helper.make_node("Transpose", [f"{name}_split"], [name], perm=perm),
        ]

    nodes = [
        *heads("q", [0, 2, 1, 3]),
        *heads("k", [0, 2, 3, 1]),
        *heads("v", [0, 2, 1, 3]),
        helper.make_node("MatMul", ["q", "k"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scaled"]),
        helper.make_node("Cast", ["scaled"], ["scores"], to=f32),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("Cast", ["v"], ["v32"], to=f32),
        helper.make_node("MatMul", ["probs", "v32"], ["context"]),
        helper.make_node("Transpose", ["context"], ["merged"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["merged", "merge"], ["y"]),
    ]
    inits = [
        *(const(f"w_{n}", rng.normal(0, 0.3, (8, 8)), np.float16) for n in "qkv"),
        const("split", [0, 0, 2, 4], np.int64),
        const("merge", [0, 0, 8], np.int64),
        const("scale", np.array(0.5), np.float16),
    ]
    inputs = [value("x", ["batch", "seq", 8], f16), value("mask", ["batch", 1, 1, "seq"], f32)]
    return save_model(path, nodes, inputs, [value("y", ["batch", "seq", 8], f32)], inits)


def test_promoted_self_attention_is_not_packed(tmp_path: Path) -> None:
    """Packed into Attention, the float16 weights would be cast to float32 at every run: the
    promoted self-attention goes to MultiHeadAttention on the projections, each cast."""
    model = _promoted_self_attention(tmp_path / "promoted.onnx")
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(QKV) == (0, 0)
    assert run.counts(MHA) == (1, 1)
    graph = _graph(run.output)
    producers = _producers(graph)
    (node,) = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    casts = [producers[v] for v in node.input[:3]]
    assert [c.op_type for c in casts] == ["Cast"] * 3
    assert [producers[c.input[0]].op_type for c in casts] == ["MatMul"] * 3
    feeds = {
        "x": np.random.default_rng(1).normal(size=(2, 3, 8)).astype(np.float16),
        "mask": np.zeros((2, 1, 1, 3), np.float32),
    }
    expected, actual = run_model(model, feeds), run_model(run.output, feeds)
    for want, got in zip(expected, actual, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-2)
