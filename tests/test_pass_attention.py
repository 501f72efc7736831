"""MultiHeadAttentionFusionPass on real exports (tiny BERT, GPT-2, ViT, T5 encoder, TorchScript
opsets 14/17 and dynamo): every layer's attention becomes com.microsoft MultiHeadAttention."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.conftest import random_feeds, run_model
from tests.pass_helpers import fixture_path, optimize_checked, reasons

MHA = "MultiHeadAttentionFusionPass"

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
    run = optimize_checked(fixture_path(name), tmp_path)
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
    run = optimize_checked(path, tmp_path)
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


def test_llama_grouped_query_attention_is_not_claimed(tmp_path: Path) -> None:
    """LLaMA's grouped K/V (Expand-repeated heads) and rotary embedding are not this pattern."""
    run = optimize_checked(fixture_path("llama_tiny_dynamo"), tmp_path)
    assert run.counts(MHA) == (0, 0)
    assert run.op_counts()["Softmax"] == 2
