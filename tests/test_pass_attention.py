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
    "t5_tiny_dynamo": (2, 2, 4, 1.0),  # T5 does not scale; its position bias is added
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


def test_t5_torchscript_second_layer_shares_the_key_reshape(tmp_path: Path) -> None:
    """TorchScript's T5 reads one layer's key Reshape output outside the attention; that
    layer is declined with the reason, the other fuses."""
    run = optimize_checked(fixture_path("t5_tiny_ts14"), tmp_path)
    assert run.counts(MHA) == (2, 1)
    assert reasons(run, MHA) == {
        "an intermediate value (Reshape output) is also used by Transpose outside the match": 1
    }


def test_target_onnx_keeps_attention_written_out(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("bert_tiny_dynamo"), tmp_path, "--target", "onnx")
    assert run.passed(MHA)["state"] == "off"
    assert run.op_counts()["Softmax"] == 2


def test_llama_grouped_query_attention_is_not_claimed(tmp_path: Path) -> None:
    """LLaMA's grouped K/V (Expand-repeated heads) and rotary embedding are not this pattern."""
    run = optimize_checked(fixture_path("llama_tiny_dynamo"), tmp_path)
    assert run.counts(MHA) == (0, 0)
    assert run.op_counts()["Softmax"] == 2
