"""ProjectionPieceCanonicalizationPass: pieces of a projection cut along an axis its columns are
viewed in become projections of their own. litgpt's grouped QKV under both exporters and
Falcon's new decoder architecture (then GroupQueryAttention, with the rotary moved before the
key's repeat), the readers a piece may be taken by, the near misses with their reasons, the
cuts that are no candidates, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import FIXTURES
from tests.pass_helpers import (
    assert_declined,
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    save_model,
    value,
)

PIECE = "ProjectionPieceCanonicalizationPass"
ROTARY_REPEAT = "RotaryHeadRepeatCanonicalizationPass"
GQA = "GroupQueryAttentionFusionPass"
MHA = "MultiHeadAttentionFusionPass"


@pytest.mark.parametrize(("exporter", "nodes"), [("ts17", 70), ("dynamo", 58)])
def test_litgpt_grouped_qkv_becomes_grouped_query_attention(
    tmp_path: Path, exporter: str, nodes: int
) -> None:
    """litgpt views its QKV projection as [B, L, KV, r+2, H], moves the heads first and splits
    the r+2 axis: three projections, the key's and value's one head a unit axis (repeat_kv's
    form); the rotary of the repeated key moves before the repeat, and GroupQueryAttention
    takes both layers (MultiHeadAttention over the repeated heads before)."""
    run = optimize_checked(fixture_path(f"litgpt_{exporter}"), tmp_path)
    assert pattern_counts(run, PIECE) == {"ProjectionPiece": (2, 2)}
    assert run.counts(ROTARY_REPEAT) == (2, 2)
    assert run.counts(GQA) == (2, 2)
    ops = run.op_counts()
    assert (ops["GroupQueryAttention"], ops["MultiHeadAttention"], ops["Split"]) == (2, 0, 0)
    assert ops["MatMul"] == 3 * 2 + 4 * 2 + 1  # q, k, v; output and MLP; the LM head
    assert run.report["model"]["after"]["nodes"] == nodes


def test_without_the_pass_litgpt_stays_multi_head(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("litgpt_ts17"), tmp_path, "--disable_pass", PIECE)
    ops = run.op_counts()
    assert (ops["GroupQueryAttention"], ops["MultiHeadAttention"]) == (0, 2)


@pytest.mark.parametrize(("exporter", "nodes"), [("ts17", 92), ("dynamo", 70)])
def test_falcon_new_decoder_architecture(tmp_path: Path, exporter: str, nodes: int) -> None:
    """Falcon-40B's layout: the grouped QKV view's query sliced (``[..., :-2, :]``) and key
    and value taken by index (``[..., [-2], :]``: a Gather under TorchScript, dynamo's GatherND
    between two Transposes), broadcast to the group, rotary after the head transpose."""
    run = optimize_checked(FIXTURES / "arch" / f"falcon_new_{exporter}.onnx", tmp_path)
    assert pattern_counts(run, PIECE) == {"ProjectionPiece": (2, 2)}
    assert run.counts(ROTARY_REPEAT) == (2, 2)
    assert run.counts(GQA) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    assert run.report["model"]["after"]["nodes"] == nodes


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("litgpt_dynamo"), tmp_path)
    assert_second_run_changes_nothing(run, tmp_path, PIECE)


WIDTH, GROUPS, QUERIES, SIZE = 8, 2, 2, 4
COLUMNS = GROUPS * (QUERIES + 2) * SIZE


def _model(
    path: Path,
    readers: list[onnx.NodeProto],
    pieces: list[str],
    *,
    perm: list[int] | None = None,
    bias: str = "",
    extra: list[onnx.NodeProto] = (),  # type: ignore[assignment]
    outputs: list[str] = (),  # type: ignore[assignment]
    dtype: type = np.float32,
) -> Path:
    """x [batch, 3, WIDTH] @ W (+ b, before or after) viewed as [batch, 3, GROUPS, QUERIES+2,
    SIZE] (moved by ``perm``), read by ``readers`` into ``pieces``, each doubled to an output."""
    rng = np.random.default_rng(0)
    initializers = [
        const("w", rng.normal(size=(WIDTH, COLUMNS)), dtype),
        const("b", rng.normal(size=COLUMNS), dtype),
        const("view", [0, 0, GROUPS, QUERIES + 2, SIZE], np.int64),
    ]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["projected"])]
    projection = "projected"
    if bias:
        pair = ["b", "projected"] if bias == "first" else ["projected", "b"]
        nodes.append(helper.make_node("Add", pair, ["biased"]))
        projection = "biased"
    nodes.append(helper.make_node("Reshape", [projection, "view"], ["viewed"], name="view"))
    if perm is not None:
        nodes.append(helper.make_node("Transpose", ["viewed"], ["moved"], perm=perm))
    nodes += [*readers, *extra]
    nodes += [helper.make_node("Add", [piece, piece], [f"{piece}_out"]) for piece in pieces]
    outs = [value(f"{piece}_out", None) for piece in pieces] + [value(n, None) for n in outputs]
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [value("x", ["batch", 3, WIDTH], elem)]
    return save_model(path, nodes, inputs, outs, initializers, check=False)


def _save(model: onnx.ModelProto, path: Path) -> Path:
    """Saved with each output of its producer's first input's rank, as inference finds it
    (every output here is an element-wise op or a Concat; the checker wants a shape)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {info.name: info.type for info in inferred.graph.value_info}
    producers = {output: node for node in model.graph.node for output in node.output}
    for output in model.graph.output:
        source = types[producers[output.name].input[0]].tensor_type
        output.CopyFrom(value(output.name, [None] * len(source.shape.dim), source.elem_type))
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _feeds(dtype: type = np.float32) -> dict:
    return {"x": np.random.default_rng(1).normal(size=(2, 3, WIDTH)).astype(dtype)}


def _split(data: str, axis: int) -> onnx.NodeProto:
    return helper.make_node("Split", [data, "sizes"], ["q", "k", "v"], axis=axis)


def _with_sizes(path: Path, *args, **kwargs) -> Path:
    model = onnx.load(str(_model(path, *args, **kwargs)))
    model.graph.initializer.append(const("sizes", [QUERIES, 1, 1], np.int64))
    return _save(model, path)


@pytest.mark.parametrize(
    ("bias", "dtype"),
    [("", np.float32), ("first", np.float32), ("last", np.float32), ("last", np.float16)],
)
def test_split_after_the_heads_move(tmp_path: Path, bias: str, dtype: type) -> None:
    """litgpt's spelling with or without a bias on either side of the Add, in float16 too
    (the weight's columns taken in its own type): three MatMuls (and Adds), the key's and
    value's unit axis an Unsqueeze after their Transpose."""
    split = _split("moved", 2)
    model = _with_sizes(
        tmp_path / "split.onnx",
        [split],
        ["q", "k", "v"],
        perm=[0, 2, 3, 1, 4],
        bias=bias,
        dtype=dtype,
    )
    run = optimize_checked(model, tmp_path, "--disable_pass", "LayoutChainCanonicalizationPass")
    assert run.counts(PIECE) == (1, 1)
    ops = run.op_counts()
    assert (ops["MatMul"], ops["Split"], ops["Unsqueeze"]) == (3, 0, 2)
    assert ops["Add"] == 3 + (3 if bias else 0)
    compare_on_feeds(model, run.output, _feeds(dtype))


def test_slice_and_gathers_of_the_view(tmp_path: Path) -> None:
    """Falcon's spelling, straight off the view: a Slice of the query positions, a Gather of
    [k] keeping the axis, and a Gather of a scalar index dropping it."""
    readers = [
        helper.make_node("Slice", ["viewed", "zero", "queries", "three"], ["q"]),
        helper.make_node("Gather", ["viewed", "key_index"], ["k"], axis=3),
        helper.make_node("Gather", ["viewed", "value_index"], ["v"], axis=3),
    ]
    model = onnx.load(str(_model(tmp_path / "slices.onnx", readers, ["q", "k", "v"])))
    model.graph.initializer.extend(
        [
            const("zero", [0], np.int64),
            const("queries", [-2], np.int64),
            const("three", [3], np.int64),
            const("key_index", [QUERIES], np.int64),
            const("value_index", np.array(QUERIES + 1), np.int64),
        ]
    )
    path = _save(model, tmp_path / "slices.onnx")
    run = optimize_checked(path, tmp_path)
    assert run.counts(PIECE) == (1, 1)
    ops = run.op_counts()
    assert (ops["MatMul"], ops["Gather"], ops["Slice"], ops["Unsqueeze"]) == (3, 0, 0, 1)
    compare_on_feeds(path, run.output, _feeds())


def test_every_second_position_of_the_cut_axis(tmp_path: Path) -> None:
    """Pieces need not be runs: Slices with step 2 of the group's axis take every second
    position, both projections of their own, their columns read off the view's grid."""
    readers = [
        helper.make_node("Slice", ["viewed", "start0", "end", "axis", "two"], ["even"]),
        helper.make_node("Slice", ["viewed", "start1", "end", "axis", "two"], ["odd"]),
    ]
    model = onnx.load(str(_model(tmp_path / "strided.onnx", readers, ["even", "odd"])))
    model.graph.initializer.extend(
        const(name, [number], np.int64)
        for name, number in (("start0", 0), ("start1", 1), ("end", 9), ("axis", 3), ("two", 2))
    )
    path = _save(model, tmp_path / "strided.onnx")
    run = optimize_checked(path, tmp_path)
    assert run.counts(PIECE) == (1, 1)
    assert (run.op_counts()["MatMul"], run.op_counts()["Slice"]) == (2, 0)
    compare_on_feeds(path, run.output, _feeds())


def test_a_projection_read_elsewhere_is_declined(tmp_path: Path) -> None:
    """Cutting it would compute the projection twice, whole and in pieces."""
    extra = [helper.make_node("Mul", ["projected", "projected"], ["also"])]
    model = _with_sizes(
        tmp_path / "shared.onnx",
        [_split("moved", 2)],
        ["q", "k", "v"],
        perm=[0, 2, 3, 1, 4],
        extra=extra,
        outputs=["also"],
    )
    run = optimize_checked(model, tmp_path)
    assert_declined(run, PIECE, "the projection is also read elsewhere than its view", "view")
    compare_on_feeds(model, run.output, _feeds())


def test_a_view_cut_along_two_axes_is_declined(tmp_path: Path) -> None:
    readers = [
        helper.make_node("Slice", ["viewed", "zero", "one", "two"], ["groups"]),
        helper.make_node("Slice", ["viewed", "zero", "one", "three"], ["positions"]),
    ]
    model = onnx.load(str(_model(tmp_path / "two.onnx", readers, ["groups", "positions"])))
    model.graph.initializer.extend(
        const(name, [number], np.int64)
        for name, number in (("zero", 0), ("one", 1), ("two", 2), ("three", 3))
    )
    path = _save(model, tmp_path / "two.onnx")
    run = optimize_checked(path, tmp_path)
    assert_declined(run, PIECE, "the view is cut along two of its axes", "view")
    compare_on_feeds(path, run.output, _feeds())


@pytest.mark.parametrize("case", ["read_whole", "rows", "head_parts", "fed_weight"])
def test_cuts_that_are_no_candidates(tmp_path: Path, case: str) -> None:
    """Not counted: a view read whole too (a rotary's product with the head), a cut along the
    rows (the batch axis: no piece of the weight), parts of the last axis (each head's own
    elements, a rotary's halves: cut, the rotary would see no head), a weight that is fed."""
    readers = [
        helper.make_node("Slice", ["viewed", "zero", "two", "axis"], ["front"]),
        helper.make_node("Slice", ["viewed", "two", "end", "axis"], ["back"]),
    ]
    pieces, extra, outputs = ["front", "back"], [], []
    axis = {"rows": 0, "head_parts": 4}.get(case, 3)
    if case == "read_whole":
        extra = [helper.make_node("Mul", ["viewed", "viewed"], ["whole"])]
        outputs = ["whole"]
    model = onnx.load(
        str(_model(tmp_path / "none.onnx", readers, pieces, extra=extra, outputs=outputs))
    )
    model.graph.initializer.extend(
        const(name, [number], np.int64)
        for name, number in (("zero", 0), ("two", 2), ("end", 8), ("axis", axis))
    )
    feeds = _feeds()
    if case == "fed_weight":
        (weight,) = [t for t in model.graph.initializer if t.name == "w"]
        model.graph.initializer.remove(weight)
        model.graph.input.append(value("w", [WIDTH, COLUMNS]))
        feeds["w"] = onnx.numpy_helper.to_array(weight)
    path = _save(model, tmp_path / "none.onnx")
    run = optimize_checked(path, tmp_path, compare=False)
    assert run.counts(PIECE) == (0, 0)
    assert run.op_counts()["MatMul"] == 1
    compare_on_feeds(path, run.output, feeds)
