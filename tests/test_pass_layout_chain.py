"""LayoutChainFusionPass: Reshape/Transpose chains that only move whole axes become one
Transpose, one Reshape or nothing. SqueezeBERT's channel-first attention (the fused op's
layout next to the exporter's head split) under both exporters, chains built with
onnx.helper, the chains it must leave, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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

CHAIN = "LayoutChainFusionPass"
CANONICAL = "LayoutChainCanonicalizationPass"


@pytest.mark.parametrize(("exporter", "chains", "transposes"), [("ts17", 4, 16), ("dynamo", 4, 16)])
def test_squeezebert_heads_merged_back_become_one_transpose(
    tmp_path: Path, exporter: str, chains: int, transposes: int
) -> None:
    """SqueezeBERT projects with Conv1d ([B, C, S]): the fused attention reads [B, S, C]
    and returns it, so the exporter's head split and the lowering's merge meet, per layer on
    the query and on the output: Reshape -> Transpose (-> Transpose) -> Reshape, each one
    Transpose([0, 2, 1]) of the convolution's output."""
    run = optimize_checked(ARCH_FIXTURES / f"squeezebert_{exporter}.onnx", tmp_path)
    assert pattern_counts(run, CHAIN) == {"LayoutChain": (chains, chains)}
    assert reasons(run, CHAIN) == {}
    counts = run.op_counts()
    assert counts["MultiHeadAttention"] == 2
    assert counts["Transpose"] == transposes


def _chain(path: Path, steps: list[tuple[str, object]], source: list, result: list) -> Path:
    """x -> the steps (("Reshape", target) or ("Transpose", perm)) -> y, each step read by
    the next only."""
    nodes, initializers, current = [], [], "x"
    for index, (op, argument) in enumerate(steps):
        out = "y" if index == len(steps) - 1 else f"t{index}"
        if op == "Reshape":
            initializers.append(const(f"shape{index}", argument, np.int64))
            nodes.append(helper.make_node("Reshape", [current, f"shape{index}"], [out]))
        else:
            nodes.append(helper.make_node("Transpose", [current], [out], perm=argument))
        current = out
    nodes.append(helper.make_node("Relu", ["y"], ["z"]))
    return save_model(path, nodes, [value("x", source)], [value("z", result)], initializers)


def _feeds(shape: list[int]) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).normal(size=shape).astype(np.float32)}


@pytest.mark.parametrize(
    ("steps", "source", "result", "ops", "feed"),
    [
        # channel-first heads merged back: [B, C, S] -> [B, N, H, S] -> [B, S, N, H] -> [B, S, C]
        ([("Reshape", [0, 4, 8, -1]), ("Transpose", [0, 3, 1, 2]), ("Reshape", [0, 0, 32])],
         ["B", 32, "S"], ["B", "S", 32], {"Transpose": 1, "Reshape": 0}, [2, 32, 5]),
        # the output split back, then channel-first: [B, S, C] -> [B, S, N, H] -> [B, N, H, S]
        ([("Reshape", [0, 0, 4, 8]), ("Transpose", [0, 2, 3, 1]), ("Reshape", [0, 32, -1])],
         ["B", "S", 32], ["B", 32, "S"], {"Transpose": 1, "Reshape": 0}, [2, 5, 32]),
        # a transpose of unit axes keeps the order of the elements: one Reshape
        ([("Reshape", [0, 1, 1, 32]), ("Transpose", [0, 2, 1, 3]), ("Reshape", [0, 4, 8])],
         ["B", 32], ["B", 4, 8], {"Transpose": 0, "Reshape": 1}, [3, 32]),
        # a unit axis added and moved: nothing left
        ([("Reshape", [0, 0, 1, 32]), ("Transpose", [0, 2, 1, 3]), ("Reshape", [0, -1, 32])],
         ["B", "S", 32], ["B", "S", 32], {"Transpose": 0, "Reshape": 0}, [2, 5, 32]),
    ],
)  # fmt: skip
def test_chains_that_move_whole_axes_collapse(
    tmp_path: Path, steps: list, source: list, result: list, ops: dict, feed: list
) -> None:
    """Three ops: collapsed before the fusions (the canonical pass), not left for after."""
    model = _chain(tmp_path / "chain.onnx", steps, source, result)
    run = optimize_checked(model, tmp_path, "--disable_pass", "ReshapeReshapeFusionPass")
    assert pattern_counts(run, CANONICAL) == {"LayoutChain": (1, 1)}
    assert run.counts(CHAIN) == (0, 0)
    counts = run.op_counts()
    assert {op: counts[op] for op in ops} == ops
    compare_on_feeds(model, run.output, _feeds(feed))


def test_a_two_op_chain_is_left_for_after_the_fusions(tmp_path: Path) -> None:
    """A unit axis added and moved, [B, S, 32] -> [B, S, 1, 32] -> [B, 1, S, 32]: two ops,
    which the fusions may read as they are; afterwards, one Reshape."""
    steps = [("Reshape", [0, 0, 1, 32]), ("Transpose", [0, 2, 1, 3])]
    model = _chain(tmp_path / "two.onnx", steps, ["B", "S", 32], ["B", 1, "S", 32])
    run = optimize_checked(model, tmp_path)
    assert run.counts(CANONICAL) == (0, 0)
    assert pattern_counts(run, CHAIN) == {"LayoutChain": (1, 1)}
    assert run.op_counts()["Transpose"] == 0 and run.op_counts()["Reshape"] == 1
    compare_on_feeds(model, run.output, _feeds([2, 5, 32]))


def test_repeated_heads_folded_for_a_batched_matmul_become_a_head_split(tmp_path: Path) -> None:
    """Dynamo's K^T of repeated KV heads: [B, 2, 2, 6, 8] folded to [B*4, 6, 8], transposed
    in 3-D and unfolded to [B, 4, 8, 6] is Reshape([B, 4, 6, 8]) then Transpose([0, 1, 3,
    2]), the form the attention passes read."""
    steps = [("Reshape", [-1, 6, 8]), ("Transpose", [0, 2, 1]), ("Reshape", [-1, 4, 8, 6])]
    model = _chain(tmp_path / "kt.onnx", steps, ["B", 2, 2, 6, 8], ["B", 4, 8, 6])
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, CANONICAL) == {"LayoutChain": (1, 1)}
    counts = run.op_counts()
    assert counts["Reshape"] == counts["Transpose"] == 1
    compare_on_feeds(model, run.output, _feeds([3, 2, 2, 6, 8]))


def test_a_batch_of_one_stays_in_front_of_the_heads(tmp_path: Path) -> None:
    """The same K^T with the batch fixed to 1 (a decode graph, --input_shape): the unit axis
    holds no piece of the source, and goes just before the heads in the head split, Reshape([1,
    4, 6, 8]) then Transpose([0, 1, 3, 2])."""
    steps = [
        ("Reshape", [1, 4, 6, 8]),
        ("Reshape", [4, 6, 8]),
        ("Transpose", [0, 2, 1]),
        ("Reshape", [1, 4, 8, 6]),
    ]
    model = _chain(tmp_path / "kt1.onnx", steps, [1, 2, 2, 6, 8], [1, 4, 8, 6])
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, CANONICAL) == {"LayoutChain": (1, 1)}
    counts = run.op_counts()
    assert counts["Reshape"] == counts["Transpose"] == 1
    compare_on_feeds(model, run.output, _feeds([1, 2, 2, 6, 8]))


def test_head_split_stays(tmp_path: Path) -> None:
    """A head split [B, S, C] -> [B, N, S, H] interleaves pieces of two axes: no single op
    computes it, and it is no near miss either."""
    steps = [("Reshape", [0, 0, 4, 8]), ("Transpose", [0, 2, 1, 3])]
    model = _chain(tmp_path / "split.onnx", steps, ["B", "S", 32], ["B", 4, "S", 8])
    run = optimize_checked(model, tmp_path)
    assert run.counts(CHAIN) == (0, 0)
    assert reasons(run, CHAIN) == {}
    assert run.op_counts()["Transpose"] == 1


def test_chain_whose_sizes_are_not_proven_stays(tmp_path: Path) -> None:
    """Splitting a sequence S into [3, -1] holds only for S a multiple of 3: the chain is
    not proven to move whole axes for every S, so it stays."""
    steps = [("Reshape", [0, 3, -1, 8]), ("Transpose", [0, 2, 1, 3]), ("Reshape", [0, -1, 8])]
    model = _chain(tmp_path / "unproven.onnx", steps, ["B", "S", 8], ["B", "S", 8])
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(CHAIN) == (0, 0)
    assert run.op_counts()["Transpose"] == 1
    compare_on_feeds(model, run.output, _feeds([2, 6, 8]))


def test_chain_with_a_target_computed_at_run_time_is_a_near_miss(tmp_path: Path) -> None:
    """A Reshape whose target is computed from a graph input (not the data's own shape) and
    whose result shape is not inferred: the chain cannot be read, and the report says so."""
    nodes = [
        helper.make_node("Reshape", ["x", "target"], ["t0"]),
        helper.make_node("Transpose", ["t0"], ["y"], perm=[0, 2, 1]),
        helper.make_node("Relu", ["y"], ["z"]),
    ]
    inputs = [value("x", ["B", "S", 32]), value("target", ["n"], 7)]
    model = save_model(tmp_path / "runtime.onnx", nodes, inputs, [value("z", ["B", 32, "S"])])
    run = optimize_checked(model, tmp_path, compare=False)
    assert reasons(run, CHAIN) == {
        "a Reshape in the chain has a target neither constant nor traced": 1
    }
    assert run.counts(CHAIN) == (1, 0)
