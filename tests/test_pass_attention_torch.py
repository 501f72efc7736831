"""Attention as PyTorch's own nn.MultiheadAttention lays it out, fused by MultiHeadAttention.

The module works sequence-first: its context [B, N, S, H] is read back through [S, B, N, H]
(the fused op's output is split back into heads, one Transpose composed with the reader's), and
with need_weights it computes the scores 3-D, [B*N, S, L] (read as one head over a batch of
B*N). Fixtures: tests/fixtures/make_torch_attention_fixtures.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.pass_helpers import (
    assert_declined,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    save_model,
    value,
)

MHA = "MultiHeadAttentionFusionPass"
HIDDEN, HEADS, SEQUENCE = 32, 4, 6  # as the fixtures were exported

# fixture: (matched = effected, num_heads of the fused op)
EXPECTED = {
    "torch_encoder_ts17": (2, HEADS),
    "torch_encoder_dynamo": (2, HEADS),
    "torch_pool_ts17": (1, 1),
    "torch_pool_dynamo": (1, 1),
}


def _feeds(name: str, seed: int) -> dict[str, np.ndarray]:
    """Two sequences; for the pooling head, the second one's last two positions padded."""
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.normal(size=(2, SEQUENCE, HIDDEN)).astype(np.float32)}
    if "pool" in name:
        padding = np.zeros((2, SEQUENCE), bool)
        padding[1, -2:] = True
        feeds["padding"] = padding
    return feeds


def _nodes(path: Path, op_type: str) -> list[onnx.NodeProto]:
    return [node for node in onnx.load(str(path)).graph.node if node.op_type == op_type]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_torch_attention_fused_in_every_layer(name: str, tmp_path: Path) -> None:
    count, heads = EXPECTED[name]
    model = fixture_path(name)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(MHA) == (count, count)
    fused = _nodes(run.output, "MultiHeadAttention")
    assert len(fused) == count
    assert {
        helper.get_attribute_value(a) for n in fused for a in n.attribute if a.name == "num_heads"
    } == {heads}
    assert run.op_counts()["Softmax"] == 0
    for seed in (0, 1):
        compare_on_feeds(model, run.output, _feeds(name, seed))


@pytest.mark.parametrize("name", ["torch_encoder_ts17", "torch_encoder_dynamo"])
def test_context_read_sequence_first_is_one_transpose(name: str, tmp_path: Path) -> None:
    """The fused op's [B, S, N*H] output goes back to the [S, B, N*H] the module reads: split
    into heads, transposed to [S, B, N, H] and merged again by the module, that is one
    Transpose([1, 0, 2]) (LayoutChainFusionPass), read by the output projection."""
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    graph = onnx.load(str(run.output)).graph
    readers = {name: node for node in graph.node for name in node.input}
    fused = _nodes(run.output, "MultiHeadAttention")
    assert fused
    for node in fused:
        swap = readers[node.output[0]]
        assert swap.op_type == "Transpose"
        assert list(helper.get_attribute_value(swap.attribute[0])) == [1, 0, 2]
        assert readers[swap.output[0]].op_type == "MatMul"


def _three_d(path: Path, *, head_size: int | str = 8, weights_out: bool = False) -> Path:
    """3-D attention on [X, S, H] inputs (heads folded into the batch): Softmax(q k^T * s +
    bias [X, 1, L]) v, the key transposed as torch.bmm(q, k.transpose(1, 2)) writes it."""
    shape = ["x", 5, head_size]
    inputs = [value(n, shape) for n in ("q", "k", "v")] + [value("bias", ["x", 1, 5])]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kT"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kT"], ["product"]),
        helper.make_node("Mul", ["product", "s"], ["scaled"]),
        helper.make_node("Add", ["scaled", "bias"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["y"]),
    ]
    outputs = [value("y", shape)] + ([value("probs", ["x", 5, 5])] if weights_out else [])
    return save_model(path, nodes, inputs, outputs, [const("s", np.array(8**-0.5))])


def test_three_d_attention_is_one_head_over_the_folded_batch(tmp_path: Path) -> None:
    model = _three_d(tmp_path / "three_d.onnx")
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(MHA) == (1, 1)
    (fused,) = _nodes(run.output, "MultiHeadAttention")
    assert fused.input[:3] == ["q", "k", "v"]  # the key read from before its Transpose
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(size=(6, 5, 8)).astype(np.float32) for n in ("q", "k", "v")}
    feeds["bias"] = np.where(rng.random((6, 1, 5)) < 0.3, -1e9, 0.0).astype(np.float32)
    compare_on_feeds(model, run.output, feeds)


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ({"weights_out": True}, "an intermediate value (Softmax output) is a graph output"),
        ({"head_size": "h"}, "the number of heads or the head size is unknown"),
    ],
)
def test_three_d_attention_near_misses(variant: dict, reason: str, tmp_path: Path) -> None:
    model = _three_d(tmp_path / "three_d_miss.onnx", **variant)
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(run, MHA, reason, "Softmax")
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(size=(6, 5, 8)).astype(np.float32) for n in ("q", "k", "v")}
    feeds["bias"] = np.zeros((6, 1, 5), np.float32)
    compare_on_feeds(model, run.output, feeds)
