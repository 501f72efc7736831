"""ExpandTargetCanonicalizationPass: an Expand target read at run time from sizes the input
already has becomes a constant (1 where the input keeps its size). The Flax LLaMA through
jax2onnx, whose value repeat is sized by the repeated key (then GroupQueryAttention), torchtune
under TorchScript (its ``expand(b, kv, r, -1, h)`` through the -1 test), the spellings,
the near misses with their reasons, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.pass_helpers import (
    assert_declined,
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

EXPAND = "ExpandTargetCanonicalizationPass"
RESHAPE = "ReshapeTargetCanonicalizationPass"
REPEAT = "HeadRepeatTransposeCanonicalizationPass"
GQA = "GroupQueryAttentionFusionPass"
FLAX = fixture_path("flax_llama_jax2onnx")


def test_flax_llama_value_repeat_sized_by_the_key_is_fused(tmp_path: Path) -> None:
    """Key and value repeats of both layers get constant targets (the value's read the batch
    from the repeated key); the repeats then move behind their transposes and
    GroupQueryAttention takes both layers, no Shape read left but the one GQA's own."""
    run = optimize_checked(FLAX, tmp_path)
    assert pattern_counts(run, EXPAND) == {"ExpandTarget": (4, 4)}
    assert run.counts(REPEAT) == (4, 4)
    assert run.counts(GQA) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    ops = run.op_counts()
    assert ops["GroupQueryAttention"] == 2
    assert len(onnx.load(str(run.output)).graph.node) == 35


def test_without_the_pass_the_flax_attention_stays(tmp_path: Path) -> None:
    run = optimize_checked(FLAX, tmp_path, "--disable_pass", EXPAND)
    assert run.op_counts()["GroupQueryAttention"] == 0
    unfused = run.report["coverage"]["attention"]["unfused"]
    assert len(unfused) == 2
    assert all(
        "AttentionFusionPass: only one of key and value has repeated heads" in site["reason"]
        for site in unfused
    )


def test_torchtune_torchscript_expand_sizes_through_the_minus_one_test(tmp_path: Path) -> None:
    """torchtune's ``expand(b, kv, r, -1, h)``: TorchScript's Where(Equal(sizes, -1), 1,
    sizes) read element by element; the flatten after the repeat then counts its -1 from the
    element count (the length is read at another position), so both constant targets let
    GroupQueryAttention take the layers (0/2 before). The flattens declined in the first round
    are not reported once a later round rewrote them."""
    run = optimize_checked(fixture_path("torchtune_ts17"), tmp_path)
    assert pattern_counts(run, EXPAND) == {"ExpandTarget": (4, 4)}
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    assert run.op_counts()["GroupQueryAttention"] == 2
    # The rotary tables' views read the head size from the pair views, whose -1 shape
    # inference resolves to the 8 it counts to (the shape oracle's _minus_ones): constant
    # folding makes four of those targets constants before this pass, and it rewrites the rest.
    # The context merges, [B, L, -1] of a context whose sizes inference leaves unnamed, count
    # their -1 from the sizes traced through the attention: every target is constant.
    assert reasons(run, RESHAPE) == {}
    assert run.counts(RESHAPE) == (20, 20)
    # 105 before the sizes read outside the fused attention were read from the graph input
    # (the same for both layers, merged) and before the queries' traced sizes shared one
    # seqlens_k / total_sequence_length chain.
    assert run.report["model"]["after"]["nodes"] == 96


@pytest.mark.parametrize(
    ("exporter", "nodes", "reshapes"), [("ts17", 70, (10, 10)), ("dynamo", 58, (14, 0))]
)
def test_litgpt_key_value_expanded_to_their_query_group(
    tmp_path: Path, exporter: str, nodes: int, reshapes: tuple[int, int]
) -> None:
    """litgpt expands each group's key and value to its queries (``expand(B, KV, r, L, H)``,
    the batch and length read at run time) before the rotary: constant targets under both
    exporters, and under TorchScript the head merge after them, [0, N, -1, H] once its -1 is
    counted, so the attention of both layers fuses (0/2 before; dynamo's were fused already,
    its views' targets read two sizes and stay); TorchScript's context merges count their -1
    from the sizes traced through the attention. With the QKV cut per group and the key's
    rotary moved before the repeat (test_pass_projection_pieces.py), it is GroupQueryAttention."""
    run = optimize_checked(fixture_path(f"litgpt_{exporter}"), tmp_path)
    assert pattern_counts(run, EXPAND) == {"ExpandTarget": (4, 4)}
    assert run.counts(RESHAPE) == reshapes
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    assert run.op_counts()["GroupQueryAttention"] == 2
    assert run.report["model"]["after"]["nodes"] == nodes


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    run = optimize_checked(FLAX, tmp_path)
    assert_second_run_changes_nothing(run, tmp_path, EXPAND)


LENGTH, SIZE = 5, 4


def _model(
    path: Path,
    *,
    source: list[int | str] | None = None,
    parts: list[tuple[str, int] | int] | None = None,
    minus_one_test: bool = False,
) -> Path:
    """x [batch, LENGTH, 1, SIZE] expanded to a target built of ``parts``: a size read from
    ``x`` or ``y`` (``("x", axis)``) or a constant; ``minus_one_test`` puts TorchScript's
    Where(Equal(sizes, -1), 1, sizes) between the Concat and the Expand."""
    parts = parts if parts is not None else [("y", 0), LENGTH, 3, SIZE]
    nodes, pieces, initializers = [], [], [const("zero", [0], np.int64)]
    for index, part in enumerate(parts):
        name = f"part{index}"
        if isinstance(part, int):
            initializers.append(const(name, [part], np.int64))
        else:
            tensor, axis = part
            initializers.append(const(f"axis{index}", [axis], np.int64))
            nodes += [
                helper.make_node("Shape", [tensor], [f"shape{index}"]),
                helper.make_node("Gather", [f"shape{index}", f"axis{index}"], [name], axis=0),
            ]
        pieces.append(name)
    nodes.append(helper.make_node("Concat", pieces, ["sizes"], axis=0))
    target = "sizes"
    if minus_one_test:
        initializers += [
            const("minus_one", [-1] * len(parts), np.int64),
            const("ones", [1] * len(parts), np.int64),
        ]
        nodes += [
            helper.make_node("Equal", ["sizes", "minus_one"], ["unset"]),
            helper.make_node("Where", ["unset", "ones", "sizes"], ["target"]),
        ]
        target = "target"
    nodes += [
        helper.make_node("Expand", ["x", target], ["spread"]),
        helper.make_node("Add", ["spread", "spread"], ["out"]),
        helper.make_node("Mul", ["y", "y"], ["y_out"]),
    ]
    inputs = [
        value("x", source or ["batch", LENGTH, 1, SIZE]),
        value("y", ["batch", "width"]),
    ]
    outputs = [value("out", [None] * max(4, len(parts))), value("y_out", [None] * 2)]
    return save_model(path, nodes, inputs, outputs, initializers)


def _feeds(batch: int = 2, source: tuple[int, ...] = (LENGTH, 1, SIZE)) -> dict:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(batch, *source)).astype(np.float32),
        "y": rng.normal(size=(batch, 7)).astype(np.float32),
    }


def _target(run_output: Path) -> list[int]:
    model = onnx.load(str(run_output))
    (expand,) = [node for node in model.graph.node if node.op_type == "Expand"]
    (shape,) = [t for t in model.graph.initializer if t.name == expand.input[1]]
    return onnx.numpy_helper.to_array(shape).tolist()


@pytest.mark.parametrize("minus_one_test", [False, True])
def test_a_size_named_alike_becomes_one(tmp_path: Path, minus_one_test: bool) -> None:
    """The batch read from another tensor whose first axis has the input's name: 1, the other
    sizes as they are; through TorchScript's -1 test too, a -1 there becoming 1."""
    parts = [("y", 0), -1 if minus_one_test else LENGTH, 3, SIZE]
    model = _model(tmp_path / "named.onnx", parts=parts, minus_one_test=minus_one_test)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, EXPAND) == {"ExpandTarget": (1, 1)}
    assert _target(run.output) == [1, 1 if minus_one_test else LENGTH, 3, SIZE]
    assert run.op_counts()["Shape"] == 0
    compare_on_feeds(model, run.output, _feeds())


def test_a_target_of_the_input_own_sizes_removes_the_expand(tmp_path: Path) -> None:
    """The batch named alike and the input's static sizes: the Expand changes nothing. (Sizes
    all read from the input itself are Shape(x), which ShapeRunCanonicalizationPass takes.)"""
    parts = [("y", 0), LENGTH, 1, SIZE]
    model = _model(tmp_path / "own.onnx", parts=parts)
    run = optimize_checked(model, tmp_path)
    assert run.counts(EXPAND) == (1, 1)
    assert run.op_counts()["Expand"] == 0
    compare_on_feeds(model, run.output, _feeds())


def test_a_size_not_proven_the_input_stays(tmp_path: Path) -> None:
    """y's first axis is named otherwise: its size may differ from the batch (Expand would
    then fail or spread a 1), so the target stays computed."""
    source: list[int | str] = ["other", LENGTH, 1, SIZE]
    model = _model(tmp_path / "unproven.onnx", source=source)
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(
        run,
        EXPAND,
        "a size of the target is read from another tensor, not proven the input's",
        "spread",
    )
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize(
    "parts",
    [
        [("y", 0), LENGTH, ("y", 1), SIZE],  # spread along the input's unit axis
        [("y", 1), ("y", 0), LENGTH, 1, SIZE],  # a new leading axis
    ],
)
def test_a_spread_along_a_read_size_is_not_a_candidate(tmp_path: Path, parts: list) -> None:
    """An Expand that truly spreads along a size read at run time (a mask to the scores'
    shape) has no constant target: not counted, not declined."""
    model = _model(tmp_path / "spread.onnx", parts=parts)
    run = optimize_checked(model, tmp_path)
    assert run.counts(EXPAND) == (0, 0)
    assert run.op_counts()["Expand"] == 1
    compare_on_feeds(model, run.output, _feeds())


def test_the_output_keeps_the_sizes_the_constant_target_proves(tmp_path: Path) -> None:
    """The Expand's output was recorded with a size named anew (``unk__7``, as onnx inference
    names a size read at run time), and a recorded name outlives re-inference: the rewrite
    records the input's batch there, so the Reshape after it, whose target reads the batch
    from y, copies it (0) and its target is a constant too."""
    nodes = [
        helper.make_node("Shape", ["y"], ["y_shape"]),
        helper.make_node("Gather", ["y_shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "length", "three", "size"], ["sizes"], axis=0),
        helper.make_node("Expand", ["x", "sizes"], ["spread"]),
        helper.make_node("Concat", ["batch", "minus_one"], ["rows"], axis=0),
        helper.make_node("Reshape", ["spread", "rows"], ["out"]),
        helper.make_node("Mul", ["y", "y"], ["y_out"]),
    ]
    initializers = [
        const("zero", [0], np.int64),
        const("length", [LENGTH], np.int64),
        const("three", [3], np.int64),
        const("size", [SIZE], np.int64),
        const("minus_one", [-1], np.int64),
    ]
    model = save_model(
        tmp_path / "recorded.onnx",
        nodes,
        [value("x", ["batch", LENGTH, 1, SIZE]), value("y", ["batch", "width"])],
        [value("out", ["batch", 3 * LENGTH * SIZE]), value("y_out", ["batch", "width"])],
        initializers,
        value_info=[value("spread", ["unk__7", LENGTH, 3, SIZE])],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(EXPAND) == (1, 1)
    assert run.counts(RESHAPE) == (1, 1)
    assert run.op_counts()["Shape"] == 0
    compare_on_feeds(model, run.output, _feeds())
