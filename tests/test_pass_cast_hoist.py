"""WideningCastHoistPass: a widening Cast moved above the Concat, Neg and Slice it follows
(OLMo-2's float16 exports) and the views of them (ERNIE 4.5's stacked pairs), a round trip
through float32 around a Slice dropped (the OpenAI privacy filter's float16 exports; all
``make_arch_matrix.py --half --only NAME``), and the Casts it must leave where they are."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import assert_same_outputs, optimize
from tests.pass_helpers import check_output, fixture_path, pattern_counts, save_model, value

HOIST = "WideningCastHoistPass"
ROTARY = "RotaryEmbeddingFusionPass"
MHA = "MultiHeadAttentionFusionPass"
GQA = "GroupQueryAttentionFusionPass"


@pytest.mark.parametrize("name", ["olmo2_ts17_fp16", "olmo2_dynamo_fp16"])
def test_olmo2_half_precision_rotary_reads_one_tensor(name: str, tmp_path: Path) -> None:
    """OLMo-2 rotates float16 q and k with float32 tables: Cast(x) * cos + Cast(rotate_half(x))
    * sin. Per rotation the Cast moves over the Concat, the Neg and both Slices (2 layers, q
    and k), then both terms read one Cast(x) and the rotary fuses; without the pass it does
    not."""
    run = optimize(fixture_path(name), tmp_path)
    check_output(run)
    assert_same_outputs(fixture_path(name), run.output, atol=1e-2, rtol=1e-2)
    assert run.counts(HOIST) == (16, 16)
    assert pattern_counts(run, HOIST) == {
        "CastAboveConcat": (4, 4),
        "CastAboveNeg": (4, 4),
        "CastAboveSlice": (8, 8),
    }
    assert run.counts(ROTARY) == (4, 4) and run.counts(MHA) == (2, 2)
    graph = onnx.load(str(run.output)).graph
    rotations = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    produced = {out: n for n in graph.node for out in n.output}
    for rotation in rotations:  # each computes in float32 on the cast heads
        cast = produced[rotation.input[0]]
        assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.FLOAT
    (tmp_path / "off").mkdir()
    off = optimize(fixture_path(name), tmp_path / "off", "--disable_pass", HOIST)
    assert off.counts(ROTARY) == (0, 0) and off.op_counts()["RotaryEmbedding"] == 0


def test_ernie_half_precision_rotate_every_two_reads_one_tensor(tmp_path: Path) -> None:
    """ERNIE 4.5 (dynamo, float16) rotates pair by pair: Cast(x) * cos + Cast(Reshape(stack(
    -x[..., 1::2], x[..., 0::2]))) * sin, the stack an Unsqueeze of each part and a Concat.
    The Cast moves over the view back (Reshape), the Concat, both Unsqueezes, the Neg and both
    Slices, so both terms read one Cast(x) and the rotary fuses (0/4 before: "no pass
    recognized this spelling"). The attention's own head split stays below its Casts: both
    layers still fuse."""
    name = "ernie4_5_moe_dynamo_fp16"
    run = optimize(fixture_path(name), tmp_path)
    check_output(run)
    assert_same_outputs(fixture_path(name), run.output, atol=1e-2, rtol=1e-2)
    assert pattern_counts(run, HOIST) == {
        "CastAboveReshape": (4, 4),
        "CastAboveConcat": (4, 4),
        "CastAboveUnsqueeze": (8, 8),
        "CastAboveNeg": (4, 4),
        "CastAboveSlice": (8, 8),
    }
    assert run.counts(ROTARY) == (4, 4) and run.counts(GQA) == (2, 2)
    (tmp_path / "off").mkdir()
    off = optimize(fixture_path(name), tmp_path / "off", "--disable_pass", HOIST)
    assert off.counts(ROTARY) == (0, 0)


@pytest.mark.parametrize(
    "name", ["openai_privacy_filter_ts17_fp16", "openai_privacy_filter_dynamo_fp16"]
)
def test_a_sink_sliced_off_in_float32_is_sliced_in_float16(name: str, tmp_path: Path) -> None:
    """The privacy filter casts its float16 probabilities to float32, slices the sink column
    off and casts back: the Slice alone (exact), which the attention passes read as the sink
    dropped after the Softmax."""
    run = optimize(fixture_path(name), tmp_path)
    check_output(run)
    assert_same_outputs(fixture_path(name), run.output, atol=1e-2, rtol=1e-2)
    assert pattern_counts(run, HOIST) == {"CastRoundTripAroundSlice": (2, 2)}
    assert run.counts(GQA) == (2, 2)
    (tmp_path / "off").mkdir()
    off = optimize(fixture_path(name), tmp_path / "off", "--disable_pass", HOIST)
    assert off.op_counts()["GroupQueryAttention"] == 0


def _casted(
    path: Path, nodes: list[onnx.NodeProto], elem: int = TensorProto.FLOAT16, width: int = 8
) -> Path:
    """x [2, 8] of ``elem`` through ``nodes`` to y [2, width] (float16 from float32 input,
    float32 from float16)."""
    out = TensorProto.FLOAT16 if elem == TensorProto.FLOAT else TensorProto.FLOAT
    return save_model(path, nodes, [value("x", [2, 8], elem)], [value("y", [2, width], out)], [])


def _slice(source: str, start: int, end: int, out: str) -> list[onnx.NodeProto]:
    consts = [
        helper.make_node(
            "Constant", [], [f"{out}_{k}"], value=helper.make_tensor(k, TensorProto.INT64, [1], [v])
        )
        for k, v in (("start", start), ("end", end), ("axis", -1))
    ]
    names = [source, f"{out}_start", f"{out}_end", f"{out}_axis"]
    return [*consts, helper.make_node("Slice", names, [out])]


NEAR_MISSES: dict[str, tuple[list[onnx.NodeProto], int, int]] = {
    # float32 to float16 loses values: Cast(Neg(x)) is not Neg(Cast(x)) to the bit
    "narrowing": (
        [
            helper.make_node("Neg", ["x"], ["n"]),
            helper.make_node("Cast", ["n"], ["y"], to=TensorProto.FLOAT16),
        ],
        TensorProto.FLOAT,
        8,
    ),
    # the Neg is read by another node too: moving the Cast would compute the Neg twice
    "read_elsewhere": (
        [
            helper.make_node("Neg", ["x"], ["n"]),
            helper.make_node("Cast", ["n"], ["c"], to=TensorProto.FLOAT),
            helper.make_node("Abs", ["n"], ["a"]),
            helper.make_node("Cast", ["a"], ["a32"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["c", "a32"], ["y"]),
        ],
        TensorProto.FLOAT16,
        8,
    ),
    # a Slice whose whole input nothing else casts: casting all of x for half of it
    "slice_of_an_uncast_tensor": (
        [
            *_slice("x", 0, 4, "s"),
            helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT),
        ],
        TensorProto.FLOAT16,
        4,
    ),
}


def test_a_slice_of_a_tensor_cast_anyway_moves(tmp_path: Path) -> None:
    """Cast(x) is there already: Cast(Slice(x)) becomes Slice of that Cast, bit for bit."""
    nodes = [
        helper.make_node("Cast", ["x"], ["whole"], to=TensorProto.FLOAT),
        *_slice("x", 0, 4, "s"),
        helper.make_node("Cast", ["s"], ["part"], to=TensorProto.FLOAT),
        helper.make_node("Concat", ["part", "part"], ["both"], axis=-1),
        helper.make_node("Add", ["whole", "both"], ["y"]),
    ]
    model = _casted(tmp_path / "sliced.onnx", nodes)
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(HOIST) == (1, 1)
    assert run.op_counts()["Cast"] == 1
    assert_same_outputs(model, run.output, atol=0)


def test_a_round_trip_whose_wide_slice_is_an_output_stays(tmp_path: Path) -> None:
    """The float32 slice is a graph output too: the round trip around it is not dropped."""
    nodes = [
        helper.make_node("Cast", ["x"], ["w"], to=TensorProto.FLOAT),
        *_slice("w", 0, 4, "s"),
        helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT16),
    ]
    outputs = [value("y", [2, 4], TensorProto.FLOAT16), value("s", [2, 4], TensorProto.FLOAT)]
    model = save_model(
        tmp_path / "exposed.onnx", nodes, [value("x", [2, 8], TensorProto.FLOAT16)], outputs, []
    )
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(HOIST) == (0, 0)
    assert run.op_counts() == Counter({"Cast": 2, "Slice": 1})
    assert_same_outputs(model, run.output, atol=0)


def _transposed(path: Path, nodes: list[onnx.NodeProto], elem: int, outputs: list[str]) -> Path:
    """x [2, 8] of ``elem`` through ``nodes``, which Cast it to the other float type as "c" and
    Transpose that as "t"; ``outputs`` of those are the graph's."""
    other = TensorProto.FLOAT16 if elem == TensorProto.FLOAT else TensorProto.FLOAT
    shapes = {"c": [2, 8], "t": [8, 2], "y": [8, 2]}
    return save_model(
        path, nodes, [value("x", [2, 8], elem)], [value(n, shapes[n], other) for n in outputs], []
    )


def test_a_transpose_moves_above_the_widening_cast_it_alone_reads(tmp_path: Path) -> None:
    """Transpose(Cast(x) to float32) -> Cast(Transpose(x)): bit for bit, half the bytes moved."""
    nodes = [
        helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["c"], ["t"], perm=[1, 0]),
    ]
    model = _transposed(tmp_path / "sink.onnx", nodes, TensorProto.FLOAT16, ["t"])
    run = optimize(model, tmp_path)
    check_output(run)
    assert pattern_counts(run, HOIST) == {"CastBelowTranspose": (1, 1)}
    graph = onnx.load(str(run.output)).graph
    assert [n.op_type for n in graph.node] == ["Transpose", "Cast"]
    assert_same_outputs(model, run.output, atol=0)


SINK_NEAR_MISSES: dict[str, tuple[list[onnx.NodeProto], int, list[str]]] = {
    # float32 to float16 loses values: the Transpose keeps reading what the Cast rounded
    "narrowing_under_a_transpose": (
        [
            helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT16),
            helper.make_node("Transpose", ["c"], ["t"], perm=[1, 0]),
        ],
        TensorProto.FLOAT,
        ["t"],
    ),
    # the cast tensor is a graph output: the Cast stays for it either way
    "cast_is_an_output": (
        [
            helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),
            helper.make_node("Transpose", ["c"], ["t"], perm=[1, 0]),
        ],
        TensorProto.FLOAT16,
        ["t", "c"],
    ),
    # another node reads the cast tensor too: the Cast would stay, and a second one be added
    "cast_read_elsewhere": (
        [
            helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),
            helper.make_node("Transpose", ["c"], ["t"], perm=[1, 0]),
            helper.make_node("Abs", ["c"], ["a"]),
            helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
            helper.make_node("Add", ["t", "b"], ["y"]),
        ],
        TensorProto.FLOAT16,
        ["y"],
    ),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES) + sorted(SINK_NEAR_MISSES))
def test_casts_that_must_stay(case: str, tmp_path: Path) -> None:
    path = tmp_path / f"{case}.onnx"
    if case in NEAR_MISSES:
        nodes, elem, width = NEAR_MISSES[case]
        model = _casted(path, nodes, elem, width)
    else:
        nodes, elem, outputs = SINK_NEAR_MISSES[case]
        model = _transposed(path, nodes, elem, outputs)
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(HOIST) == (0, 0)
    before = Counter(n.op_type for n in onnx.load(str(model)).graph.node if n.op_type != "Constant")
    after = run.op_counts()
    assert {op: after[op] for op in before} == dict(before)
    assert_same_outputs(model, run.output, atol=0)
