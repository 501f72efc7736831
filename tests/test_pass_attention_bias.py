"""MultiHeadAttentionBiasFusionPass: the Q/K/V projection biases in front of a
MultiHeadAttention move into its bias input. Cross-attention of BART (both exporters, with
and without a KV cache) and Whisper (a key projection without bias), models holding the op
already, the operands it must leave, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.pass_helpers import (
    ARCH_FIXTURES,
    compare_on_feeds,
    const,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

BIAS = "MultiHeadAttentionBiasFusionPass"


def _bias_adds(path: Path) -> int:
    """Adds of a constant 1-D bias read by a MultiHeadAttention."""
    graph = onnx.load(str(path)).graph
    producers = {out: node for node in graph.node for out in node.output}
    constants = {t.name for t in graph.initializer if len(t.dims) == 1}
    return sum(
        1
        for node in graph.node
        if node.op_type == "MultiHeadAttention"
        for name in node.input[:3]
        if name in producers
        and producers[name].op_type == "Add"
        and constants & set(producers[name].input)
    )


@pytest.mark.parametrize(
    ("model", "sites"),
    [
        ("bart_ts17", 2),  # the decoder's cross-attention, one per layer
        ("bart_dynamo", 2),
        ("bart_past_ts17", 4),  # self-attention on the cache too: new projections + pasts
        ("bart_past_dynamo", 4),
    ],
)
def test_projection_biases_move_into_the_attention(tmp_path: Path, model: str, sites: int) -> None:
    run = optimize_checked(ARCH_FIXTURES / f"{model}.onnx", tmp_path)
    assert pattern_counts(run, BIAS) == {"MultiHeadAttentionBias": (sites, sites)}
    assert reasons(run, BIAS) == {}
    assert run.op_counts()["MultiHeadAttention"] == sites
    assert _bias_adds(run.output) == 0


HEADS, HEAD, HIDDEN = 4, 8, 32


def _attention(
    path: Path, *, biased: tuple[bool, bool, bool], cache: bool = False, shared: bool = False
) -> Path:
    """A model holding a MultiHeadAttention already: query from x, key and value from an
    encoder output e ([B, L, D] projections, or [B, N, L, H] cached heads), each projection
    with or without a bias Add; ``shared`` also returns the query's biased projection."""
    rng = np.random.default_rng(0)
    nodes, initializers, inputs = [], [], [value("x", ["B", "S", HIDDEN])]
    operands = []
    for name, has_bias in zip("qkv", biased, strict=True):
        if cache and name != "q":
            inputs.append(value(f"past_{name}", ["B", HEADS, "L", HEAD]))
            operands.append(f"past_{name}")
            continue
        source = "x" if name == "q" else "e"
        initializers.append(const(f"w{name}", rng.normal(size=(HIDDEN, HIDDEN)) * 0.3))
        nodes.append(helper.make_node("MatMul", [source, f"w{name}"], [f"{name}_mm"]))
        operands.append(f"{name}_mm")
        if has_bias:
            initializers.append(const(f"b{name}", rng.normal(size=HIDDEN)))
            nodes.append(helper.make_node("Add", [f"{name}_mm", f"b{name}"], [f"{name}_proj"]))
            operands[-1] = f"{name}_proj"
    if not cache:
        inputs.append(value("e", ["B", "L", HIDDEN]))
    nodes.append(
        helper.make_node(
            "MultiHeadAttention", operands, ["y"], domain="com.microsoft", num_heads=HEADS
        )
    )
    outputs = [value("y", ["B", "S", HIDDEN])]
    if shared:
        outputs.append(value("q_proj", ["B", "S", HIDDEN]))
    return save_model(path, nodes, inputs, outputs, initializers, contrib=True)


def _feeds(cache: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {"x": rng.normal(size=(2, 5, HIDDEN)).astype(np.float32)}
    if cache:
        for name in ("past_k", "past_v"):
            feeds[name] = rng.normal(size=(2, HEADS, 7, HEAD)).astype(np.float32)
    else:
        feeds["e"] = rng.normal(size=(2, 7, HIDDEN)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("biased", [(True, True, True), (True, False, True), (False, False, True)])
def test_missing_biases_are_zeros(tmp_path: Path, biased: tuple[bool, bool, bool]) -> None:
    """Whisper's key projection has no bias: its third of the op's bias is zeros."""
    model = _attention(tmp_path / "cross.onnx", biased=biased)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, BIAS) == {"MultiHeadAttentionBias": (1, 1)}
    assert run.op_counts()["Add"] == 0
    compare_on_feeds(model, run.output, _feeds())


def test_projection_read_elsewhere_keeps_its_add(tmp_path: Path) -> None:
    """The query's biased projection is also a graph output: its Add stays (its share of the
    bias is zeros), the key's and value's move in."""
    model = _attention(tmp_path / "shared.onnx", biased=(True, True, True), shared=True)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, BIAS) == {"MultiHeadAttentionBias": (1, 1)}
    assert run.op_counts()["Add"] == 1
    compare_on_feeds(model, run.output, _feeds())


def test_cached_heads_are_declined(tmp_path: Path) -> None:
    """Key and value as [B, N, L, H] heads (a cross-attention cache): the op adds no bias to
    those, so the query's bias stays where it is, and the report says why."""
    model = _attention(tmp_path / "cached.onnx", biased=(True, False, False), cache=True)
    run = optimize_checked(model, tmp_path, compare=False)
    assert reasons(run, BIAS) == {
        "the key and value are not 3-D (heads or a cache): the op adds no bias to them": 1
    }
    assert run.op_counts()["Add"] == 1
    compare_on_feeds(model, run.output, _feeds(cache=True))


def test_no_bias_no_candidate(tmp_path: Path) -> None:
    model = _attention(tmp_path / "plain.onnx", biased=(False, False, False))
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(BIAS) == (0, 0)
    assert reasons(run, BIAS) == {}
