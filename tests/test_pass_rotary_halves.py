"""RotaryHalvesCanonicalizationPass: a rotary embedding computed half by half (GPT-OSS's
Concat(x1*c - x2*s, x2*c + x1*s)) becomes the rotate_half form, which RotaryEmbeddingFusionPass
then fuses. GPT-OSS under both exporters, the halves as a Split or as Slices, the forms it
must leave, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import run_model
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

HALVES = "RotaryHalvesCanonicalizationPass"
ROTARY = "RotaryEmbeddingFusionPass"


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_gpt_oss_rotary_fused_in_every_layer(tmp_path: Path, exporter: str) -> None:
    """q and k of both layers: four rotations, each rewritten and then fused."""
    run = optimize_checked(ARCH_FIXTURES / f"gpt_oss_{exporter}.onnx", tmp_path)
    assert pattern_counts(run, HALVES) == {"RotaryHalves": (4, 4)}
    assert run.counts(ROTARY) == (4, 4)
    assert run.report["coverage"]["rotary"] == {"fused": 4, "total": 4, "unfused": []}
    counts = run.op_counts()
    assert (counts["RotaryEmbedding"], counts["Split"]) == (4, 0)


HEADS, HEAD, HALF = 2, 8, 4


# How x1 and x2 are taken from x's last axis: (op, its inputs for x1, for x2), the constants
# named below. "strided" is DeepSeek's x[..., 0::2] / x[..., 1::2]; "gathered" any order that
# takes each element once; "overlapping" takes some twice.
PARTS = {
    "split": ("Split", [], []),
    "slices": ("Slice", ["zero", "half", "last"], ["half", "end", "last"]),
    "strided": ("Slice", ["zero", "end", "last", "two"], ["one", "end", "last", "two"]),
    "gathered": ("Gather", ["low_order"], ["high_order"]),
    "overlapping": ("Slice", ["zero", "half", "last"], ["one", "five", "last"]),
}


def _model(
    path: Path,
    *,
    parts: str = "split",
    angles: int = HALF,
    swap: bool = False,
    widened: bool = False,
    second_source: str = "x",
) -> Path:
    """x [B, N, S, H] rotated half by half with angles of width ``angles`` from positions, its
    two parts taken as PARTS[parts] says; ``swap`` puts sin where cos belongs in the second
    half (no rotation). ``widened``: x is float16 and each part is cast to float32 on its own
    (dots.llm3's partial rotary in half precision); ``second_source`` names the tensor the
    second part is taken from."""
    rng = np.random.default_rng(0)
    taken = ("x1h", "x2h") if widened else ("x1", "x2")
    nodes = [
        helper.make_node("Unsqueeze", ["positions", "last"], ["p"]),
        helper.make_node("Mul", ["p", "frequencies"], ["f"]),
        helper.make_node("Cos", ["f"], ["c3"]),
        helper.make_node("Sin", ["f"], ["s3"]),
        helper.make_node("Unsqueeze", ["c3", "heads_axis"], ["c"]),
        helper.make_node("Unsqueeze", ["s3", "heads_axis"], ["s"]),
    ]
    op, low, high = PARTS[parts]
    if op == "Split":
        nodes.append(helper.make_node("Split", ["x"], list(taken), axis=-1, num_outputs=2))
    else:
        axis = {"axis": -1} if op == "Gather" else {}
        nodes += [
            helper.make_node(op, ["x", *low], [taken[0]], **axis),
            helper.make_node(op, [second_source, *high], [taken[1]], **axis),
        ]
    if widened:
        nodes += [
            helper.make_node("Cast", [part], [part[:2]], to=onnx.TensorProto.FLOAT)
            for part in taken
        ]
    second = ("s", "c") if swap else ("c", "s")
    nodes += [
        helper.make_node("Mul", ["x1", "c"], ["a"]),
        helper.make_node("Mul", ["x2", "s"], ["b"]),
        helper.make_node("Sub", ["a", "b"], ["first"]),
        helper.make_node("Mul", [second[0], "x2"], ["d"]),
        helper.make_node("Mul", ["x1", second[1]], ["e"]),
        helper.make_node("Add", ["e", "d"], ["second"]),
        helper.make_node("Concat", ["first", "second"], ["y"], axis=-1),
    ]
    initializers = [
        const("frequencies", rng.uniform(0.1, 1.0, size=angles)),
        const("last", [-1], np.int64),
        const("heads_axis", [1], np.int64),
        const("zero", [0], np.int64),
        const("half", [HALF], np.int64),
        const("end", [2**62], np.int64),
        const("one", [1], np.int64),
        const("two", [2], np.int64),
        const("five", [5], np.int64),
        const("low_order", [5, 0, 3, 6], np.int64),
        const("high_order", [1, -1, 2, 4], np.int64),
    ]
    kind = onnx.TensorProto.FLOAT16 if widened else onnx.TensorProto.FLOAT
    inputs = [value("x", ["batch", HEADS, "seq", HEAD], kind), value("positions", [1, "seq"])]
    if second_source != "x":
        inputs.append(value(second_source, ["batch", HEADS, "seq", HEAD], kind))
    outputs = [value("y", ["batch", HEADS, "seq", HEAD])]
    return save_model(path, nodes, inputs, outputs, initializers, opset=18)


def _feeds(batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(batch, HEADS, seq, HEAD)).astype(np.float32),
        "positions": np.arange(seq, dtype=np.float32)[None],
    }


@pytest.mark.parametrize("parts", ["split", "slices", "strided", "gathered"])
def test_parts_become_rotate_half_and_fuse(tmp_path: Path, parts: str) -> None:
    """Halves, even and odd elements, any order: one rotation, fused."""
    model = _model(tmp_path / f"{parts}.onnx", parts=parts)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, HALVES) == {"RotaryHalves": (1, 1)}
    assert run.counts(ROTARY) == (1, 1)
    counts = run.op_counts()
    assert counts["RotaryEmbedding"] == 1
    assert counts.get("Gather", 0) == (parts in ("strided", "gathered"))
    compare_on_feeds(model, run.output, _feeds())
    compare_on_feeds(model, run.output, _feeds(batch=1, seq=3))


@pytest.mark.parametrize("parts", ["split", "strided"])
def test_exact_without_the_rotary_fusion(tmp_path: Path, parts: str) -> None:
    """The rewrite alone (rotary fusion off) computes the same values bit for bit: the Gather
    only moves elements."""
    model = _model(tmp_path / "halves.onnx", parts=parts)
    run = optimize_checked(model, tmp_path, "--disable_pass", ROTARY, compare=False)
    assert pattern_counts(run, HALVES) == {"RotaryHalves": (1, 1)}
    feeds = _feeds()
    (want,), (got,) = run_model(model, feeds), run_model(run.output, feeds)
    np.testing.assert_array_equal(got, want)


def test_parts_that_overlap_are_a_near_miss(tmp_path: Path) -> None:
    """x[..., 0:4] and x[..., 1:5] share elements: no order of x gives them as halves."""
    run = optimize_checked(_model(tmp_path / "overlap.onnx", parts="overlapping"), tmp_path)
    reason = (
        "the rotated parts are not one tensor's last axis taken in two equal parts, "
        "each element once"
    )
    assert reasons(run, HALVES) == {reason: 1}
    assert run.counts(ROTARY) == (0, 0)


def test_angles_that_broadcast_are_declined(tmp_path: Path) -> None:
    """One angle per position ([.., S, 1], broadcast over the half): Concat(c, c) would be
    two wide, not the head, so the rotation is left as it is, and the report says why."""
    model = _model(tmp_path / "narrow.onnx", angles=1)
    run = optimize_checked(model, tmp_path)
    assert reasons(run, HALVES) == {"cos / sin do not span the half head on the last axis": 1}
    assert run.counts(ROTARY) == (0, 0)


def test_half_read_elsewhere_is_declined(tmp_path: Path) -> None:
    model = _model(tmp_path / "shared.onnx")
    graph = onnx.load(str(model))
    graph.graph.output.append(value("first", ["batch", HEADS, "seq", HALF]))
    onnx.save(graph, str(model))
    run = optimize_checked(model, tmp_path)
    assert reasons(run, HALVES) == {"an intermediate value (Sub output) is a graph output": 1}


def test_other_combinations_stay(tmp_path: Path) -> None:
    """sin where cos belongs in the second half is no rotation: no candidate, no near miss."""
    model = _model(tmp_path / "swapped.onnx", swap=True)
    run = optimize_checked(model, tmp_path)
    assert run.counts(HALVES) == (0, 0)
    assert reasons(run, HALVES) == {}
    assert (run.op_counts()["Sub"], run.op_counts()["RotaryEmbedding"]) == (1, 0)


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_deepseek_even_and_odd_elements_fused_in_every_layer(tmp_path: Path, exporter: str) -> None:
    """DeepSeek-V3 rotates q[..., 0::2] and q[..., 1::2] and concatenates the results half by
    half: the rotate_half form of x[..., order], one Gather in front. TorchScript flattens the
    query's Concat(q_pass, Concat(halves)) into one Concat of three; its rotation is found
    among the parts and the pass part stays in front."""
    run = optimize_checked(ARCH_FIXTURES / f"deepseek_v3_{exporter}.onnx", tmp_path)
    assert pattern_counts(run, HALVES) == {"RotaryHalves": (4, 4)}
    assert run.counts(ROTARY) == (4, 4)
    assert run.report["coverage"]["rotary"] == {"fused": 4, "total": 4, "unfused": []}
    assert run.op_counts()["RotaryEmbedding"] == 4


def test_halves_cast_one_by_one_are_the_whole_cast(tmp_path: Path) -> None:
    """Each half of a float16 x widened by its own Cast: x cast once converts the same
    elements, exactly, and the rotation reads it whole and fuses (dots.llm3's float16 dynamo
    export: rotary 2/4 -> 4/4). Compared bit for bit with the rotary fusion off."""
    model = _model(tmp_path / "cast_halves.onnx", parts="slices", widened=True)
    feeds = _feeds()
    feeds["x"] = feeds["x"].astype(np.float16)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, HALVES) == {"RotaryHalves": (1, 1)}
    assert run.counts(ROTARY) == (1, 1)
    assert run.op_counts()["Cast"] == 1
    compare_on_feeds(model, run.output, feeds)
    (tmp_path / "off").mkdir()
    off = optimize_checked(model, tmp_path / "off", "--disable_pass", ROTARY, compare=False)
    (want,), (got,) = run_model(model, feeds), run_model(off.output, feeds)
    np.testing.assert_array_equal(got, want)


def test_halves_cast_from_two_tensors_are_a_near_miss(tmp_path: Path) -> None:
    """Near miss: the second half cast from another tensor is no half of x."""
    model = _model(
        tmp_path / "two_tensors.onnx", parts="slices", widened=True, second_source="other"
    )
    run = optimize_checked(model, tmp_path, compare=False)
    reason = (
        "the rotated parts are not one tensor's last axis taken in two equal parts, "
        "each element once"
    )
    assert reasons(run, HALVES) == {reason: 1}
    assert run.counts(ROTARY) == (0, 0)
