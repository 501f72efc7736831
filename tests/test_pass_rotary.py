"""RotaryEmbeddingFusionPass: LLaMA's rotate_half rotary embedding -> com.microsoft
RotaryEmbedding, applied to the projection before the head split."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import Run, optimize, random_feeds, run_model
from tests.pass_helpers import (
    assert_declined,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    reasons,
    save_model,
    value,
)

ROTARY = "RotaryEmbeddingFusionPass"
MS = "com.microsoft"

# ---------------------------------------------------------------------------------------------
# Real exports: tiny LLaMA (two layers; q and k rotated in each), TorchScript and dynamo.
# ---------------------------------------------------------------------------------------------


def test_paddle_llama_rotates_q_and_k(tmp_path: Path) -> None:
    """A LLaMA block through paddle2onnx (tests/fixtures/make_paddle_fixtures.py): its
    rotate_half negates with ``x * -1 + 0`` (Neg once NeutralOperandEliminationPass has read
    it) and its head splits read the batch and sequence through views of one size
    (Unsqueeze(Reshape(Squeeze(Slice(Shape))))). With the head size known from those, q and k
    are rotated by RotaryEmbedding; before, the rotary was not even counted."""
    model = fixture_path("paddle_llama_paddle2onnx")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (2, 2)
    assert reasons(run, ROTARY) == {}
    assert run.report["coverage"]["rotary"] == {"fused": 2, "total": 2, "unfused": []}
    ops = run.op_counts()
    assert (ops["RotaryEmbedding"], ops["MultiHeadAttention"], ops["Softmax"]) == (2, 1, 0)
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1), (2, 5), (3, 12)):
        feeds = {"input_ids": rng.integers(0, 64, (batch, length)).astype(np.int64)}
        compare_on_feeds(model, run.output, feeds)


LLAMA = ["llama_tiny_ts14", "llama_tiny_ts17", "llama_tiny_dynamo"]
# With a KV cache the angles are computed for positions past..past+S-1; the query rows are
# still 0..S-1 of the cache, so position offset 0 stays right.
LLAMA_PAST = ["llama_tiny_past_dynamo", "llama_tiny_past_ts17"]
PAST_DIMS = {"batch": 2, "sequence": 3, "past_sequence": 4, "total_sequence": 7}


def _graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path)).graph


def _check_llama_rotaries(original: Path, run: Run, *, cache: bool = False) -> None:
    """Four rotaries (q and k, two layers) on the MatMul projections, sharing one cos / sin
    cache pair and one position offset [0]; no rotate_half is left. The head split after them
    went into the fused attention, which reads each rotated projection itself: without a KV
    cache GroupQueryAttention reads q and k, with one MultiHeadAttention reads q and the rotated
    k is split into heads for Concat(past, k), the present key."""
    assert Counter(n.op_type for n in _graph(original).node)["Neg"] == 4  # the rotate_halfs
    assert run.counts(ROTARY) == (4, 4)
    assert reasons(run, ROTARY) == {}
    graph = _graph(run.output)
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["RotaryEmbedding"], ops["Neg"]) == (4, 0)
    assert (ops["Cos"], ops["Sin"]) == (1, 1)  # the angles, computed once for the caches
    producers = {out: n for n in graph.node for out in n.output}
    readers = _readers(graph)
    attention = "MultiHeadAttention" if cache else "GroupQueryAttention"
    fused = [n for n in graph.node if n.op_type == attention]
    assert len(fused) == 2
    rotaries = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    for node in rotaries:
        assert node.domain == MS
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"interleaved": 0}
        assert producers[node.input[0]].op_type == "MatMul"  # hoisted above the head split
    rotated = {n.output[0] for n in rotaries}
    queries = [n.input[0] for n in fused]
    assert set(queries) <= rotated
    keys = rotated - set(queries)
    assert len(keys) == 2
    if not cache:
        assert {n.input[1] for n in fused} == keys
    # GroupQueryAttention's seqlens_k / total_sequence_length: Shape of the first query, once.
    shapes = [r for name in rotated for r in readers[name] if r.op_type == "Shape"]
    assert len(shapes) == (0 if cache else 1)
    for name in rotated:
        (reader,) = [r for r in readers[name] if r.op_type != "Shape"]
        if not cache or name in queries:
            assert reader in fused
            continue
        assert reader.op_type == "Reshape"
        (transpose,) = readers[reader.output[0]]
        assert transpose.op_type == "Transpose"
        assert list(transpose.attribute[0].ints) == [0, 2, 1, 3]
        (concat,) = readers[transpose.output[0]]
        assert concat.op_type == "Concat" and concat.output[0].startswith("present_key_")
    assert len({tuple(n.input[1:]) for n in rotaries}) == 1
    offset = next(i for i in graph.initializer if i.name == rotaries[0].input[1])
    assert numpy_helper.to_array(offset).tolist() == [0]


@pytest.mark.parametrize("name", LLAMA)
def test_llama_q_and_k_rotated_in_every_layer(name: str, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path)
    _check_llama_rotaries(fixture_path(name), run)


@pytest.mark.parametrize("name", LLAMA_PAST)
def test_llama_with_kv_cache_rotates_the_new_positions(name: str, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    _check_llama_rotaries(fixture_path(name), run, cache=True)
    feeds = random_feeds(fixture_path(name), dims=PAST_DIMS)
    expected = run_model(fixture_path(name), feeds)
    actual = run_model(run.output, feeds)
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", LLAMA)
def test_llama_rotary_alone_is_split_into_heads_after(name: str, tmp_path: Path) -> None:
    """With the attention fusions off, each rotary is followed by the head split it was hoisted
    above: Reshape, then Transpose [0, 2, 1, 3]."""
    attention = "GroupQueryAttentionFusionPass,MultiHeadAttentionFusionPass"
    run = optimize_checked(fixture_path(name), tmp_path, "--disable_pass", attention)
    assert run.counts(ROTARY) == (4, 4)
    graph = _graph(run.output)
    readers = _readers(graph)
    rotaries = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotaries) == 4
    for node in rotaries:
        (reshape,) = readers[node.output[0]]
        assert reshape.op_type == "Reshape"
        (transpose,) = readers[reshape.output[0]]
        assert transpose.op_type == "Transpose"
        assert list(transpose.attribute[0].ints) == [0, 2, 1, 3]
    assert Counter(n.op_type for n in graph.node)["Softmax"] == 2


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_position_ids_input_rotates_each_row(exporter: str, tmp_path: Path) -> None:
    """LLaMA exported with position_ids [B, S] as an input (what generation feeds): every q and
    k rotated by one RotaryEmbedding reading position ids b * S + s into the per-row caches,
    and the rows agree with the original for positions that differ per row."""
    name = f"arch/llama_positions_{exporter}"
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(ROTARY) == (4, 4)
    graph = _graph(run.output)
    rotaries = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotaries) == 4 and run.op_counts()["Neg"] == 0
    assert len({n.input[1] for n in rotaries}) == 1  # one position grid, shared
    batch, seq = 3, 5
    feeds = random_feeds(fixture_path(name), seed=2, dims={"batch": batch, "sequence": seq})
    feeds["attention_mask"] = np.ones((batch, seq), np.int64)
    feeds["position_ids"] = _row_positions(batch, seq)
    compare_on_feeds(fixture_path(name), run.output, feeds)


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_decode_step_with_position_ids_and_cache(exporter: str, tmp_path: Path) -> None:
    """LLaMA as Optimum-style pipelines export it: a KV cache and position_ids [B, S] inputs.
    With a decode step fixed (batch 3, one new token, a past of 4), GroupQueryAttention takes
    the cache and RotaryEmbedding reads the per-row tables; rows agree with the original for
    positions that differ per row."""
    name = f"arch/llama_past_positions_{exporter}"
    batch, new, past = 3, 1, 4
    caches = ";".join(f"past_{kind}_{i}:3,2,4,16" for i in (0, 1) for kind in ("key", "value"))
    shapes = f"input_ids:3,1;attention_mask:3,5;position_ids:3,1;{caches}"
    run = optimize_checked(fixture_path(name), tmp_path, "--input_shape", shapes, compare=False)
    assert run.counts(ROTARY) == (4, 4)
    ops = run.op_counts()
    assert (ops["GroupQueryAttention"], ops["RotaryEmbedding"], ops["Neg"]) == (2, 4, 0)
    dims = {"batch": batch, "sequence": new, "past_sequence": past, "total_sequence": past + new}
    feeds = random_feeds(fixture_path(name), seed=2, dims=dims)
    feeds["attention_mask"] = np.ones((batch, past + new), np.int64)
    feeds["position_ids"] = past + _row_positions(batch, new)
    compare_on_feeds(fixture_path(name), run.output, feeds)


def test_torchscript_split_point_is_the_folded_head_size(tmp_path: Path) -> None:
    """TorchScript slices q at Gather(Shape(q), 3) / 2, not a constant: only the folding of
    that static dimension lets the rotary be found; dynamo's slices are constants already."""
    ts = optimize_checked(
        fixture_path("llama_tiny_ts14"), tmp_path, "--disable_pass", "ConstantFoldingPass"
    )
    assert ts.counts(ROTARY) == (0, 0)
    assert (ts.op_counts()["Neg"], ts.op_counts()["RotaryEmbedding"]) == (4, 0)
    dynamo = optimize_checked(
        fixture_path("llama_tiny_dynamo"), tmp_path, "--disable_pass", "ConstantFoldingPass"
    )
    assert dynamo.counts(ROTARY) == (4, 4)


@pytest.mark.parametrize("name", ["llama_tiny_ts14", "llama_tiny_dynamo"])
def test_static_shapes_give_constant_caches(name: str, tmp_path: Path) -> None:
    """With --input_shape the cos / sin tables fold to constants before this pass: their
    halves are compared by value, and the caches are constants (nothing left to compute)."""
    run = optimize_checked(
        fixture_path(name),
        tmp_path,
        "--input_shape",
        "input_ids:1,8;attention_mask:1,8",
        compare=False,
    )
    assert run.counts(ROTARY) == (4, 4)
    assert reasons(run, ROTARY) == {}
    graph = _graph(run.output)
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["RotaryEmbedding"], ops["Neg"], ops["Cos"], ops["Sin"]) == (4, 0, 0, 0)
    initializers = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    rotaries = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert len({tuple(n.input[1:]) for n in rotaries}) == 1
    cos, sin = (initializers[name] for name in rotaries[0].input[2:])
    assert cos.shape == sin.shape and cos.shape[0] == 8  # one row per position
    np.testing.assert_allclose(cos[0], 1.0)  # position 0: angle 0
    np.testing.assert_allclose(sin[0], 0.0, atol=1e-7)
    feeds = random_feeds(run.output)  # batch 1, sequence 8
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", LLAMA)
def test_target_onnx_keeps_rotate_half(name: str, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path, "--target", "onnx")
    entry = run.passed(ROTARY)
    assert (entry["state"], entry["reason"]) == ("off", "target")
    model = onnx.load(str(run.output))
    assert [n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")] == []
    assert MS not in {o.domain for o in model.opset_import}
    assert Counter(n.op_type for n in model.graph.node)["Neg"] == 4


# ---------------------------------------------------------------------------------------------
# onnx.helper models: y = x * cos + Concat(-x[..., H/2:], x[..., :H/2]) * sin, with
# cos / sin = Unsqueeze(Cos / Sin(Concat(f, f)), 1) from angles f = positions * inv_freq.
# ---------------------------------------------------------------------------------------------

HEADS, HEAD = 2, 8
HALF = HEAD // 2
INT64_MAX = np.iinfo(np.int64).max


def _n(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output, **attrs)


def _angles(
    *,
    second: str = "f",
    scale: str | None = None,
    dtype: int = TensorProto.FLOAT,
    heads_axis: str = "axis1",
) -> list[onnx.NodeProto]:
    """cos / sin [1 or B, 1, S, H] from positions pos [1 or B, S]; emb = Concat(f, second),
    cos and sin multiplied by the constant ``scale`` when given (LLaMA's attention_scaling);
    the heads axis of size 1 inserted at ``heads_axis`` ([1, S, 1, H] for "axis2")."""
    nodes = [
        _n("Cast", ["pos"], "pos_f", to=dtype),
        _n("Unsqueeze", ["pos_f", "axis2"], "pos_3"),  # [., S, 1]
        _n("Mul", ["pos_3", "inv_freq"], "f"),  # [., S, H/2]
    ]
    if second != "f":
        nodes.append(_n("Mul", ["f", "two"], second))
    nodes += [
        _n("Concat", ["f", second], "emb", axis=-1),
        _n("Cos", ["emb"], "cos_3"),
        _n("Sin", ["emb"], "sin_3"),
    ]
    if scale is not None:
        nodes += [
            _n("Mul", ["cos_3", scale], "cos_scaled"),
            _n("Mul", ["sin_3", scale], "sin_scaled"),
        ]
    suffix = "_3" if scale is None else "_scaled"
    return [
        *nodes,
        _n("Unsqueeze", [f"cos{suffix}", heads_axis], "cos"),
        _n("Unsqueeze", [f"sin{suffix}", heads_axis], "sin"),
    ]


def _negated_parts(first: str, second: str, negate: str) -> list[onnx.NodeProto]:
    """Neg nodes for the rotated parts ``negate`` names ("first": -x2, x1 as rotate_half;
    "second": x2, -x1, its negation as NanoChat writes it; "both"), writing <part>_n."""
    names = {"first": [first], "second": [second], "both": [first, second]}[negate]
    return [_n("Neg", [name], f"{name}_n") for name in names]


def _part(name: str, negate: str, which: str) -> str:
    return f"{name}_n" if negate in (which, "both") else name


def _rotate(
    x: str,
    *,
    split: str = "half",
    axis: str = "axis3",
    concat_axis: int = -1,
    swap: bool = False,
    negate: str = "first",
    halves: str = "slices",
) -> list[onnx.NodeProto]:
    """x_out = x * cos + Concat(Neg(x[split:]), x[:split]) * sin, slicing along ``axis``;
    ``swap`` writes every commutative operand the other way round; ``negate`` says which part
    of the Concat is negated; ``halves="split"`` takes the halves with one Split (jax2onnx)."""
    products = [[x, "cos"], [f"{x}_rot", "sin"]]
    sums = [f"{x}_cos", f"{x}_sin"]
    if swap:
        products = [pair[::-1] for pair in products]
        sums = sums[::-1]
    high, low = _part(f"{x}_hi", negate, "first"), _part(f"{x}_lo", negate, "second")
    taken = [
        _n("Slice", [x, "zero", split, axis], f"{x}_lo"),
        _n("Slice", [x, split, "max", axis], f"{x}_hi"),
    ]
    if halves == "split":
        taken = [helper.make_node("Split", [x, "halves"], [f"{x}_lo", f"{x}_hi"], axis=-1)]
    return [
        *taken,
        *_negated_parts(f"{x}_hi", f"{x}_lo", negate),
        _n("Concat", [high, low], f"{x}_rot", axis=concat_axis),
        _n("Mul", products[0], f"{x}_cos"),
        _n("Mul", products[1], f"{x}_sin"),
        _n("Add", sums, f"{x}_out"),
    ]


def _split_heads(source: str, x: str, target: str) -> list[onnx.NodeProto]:
    """x = Transpose(Reshape(source, target), [0, 2, 1, 3])."""
    return [
        _n("Reshape", [source, target], f"{x}_heads"),
        _n("Transpose", [f"{x}_heads"], x, perm=[0, 2, 1, 3]),
    ]


def _constants(
    nodes: list[onnx.NodeProto], dtype: int = TensorProto.FLOAT, heads: int = HEADS
) -> list[onnx.TensorProto]:
    """The shared constants (bounds, axes, frequencies, scales) that ``nodes`` read."""
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    ints = {
        "axis1": [1],
        "axis2": [2],
        "axis3": [3],
        "axis_last": [-1],
        "zero": [0],
        "half": [HALF],
        "half_plus_one": [HALF + 1],
        "halves": [HALF, HALF],
        "max": [INT64_MAX],
        "q_target": [0, 0, heads, HEAD],
        "k_target": [0, 0, 1, HEAD],
    }
    tensors = [
        *(const(name, numbers, np.int64) for name, numbers in ints.items()),
        const("inv_freq", 1.0 / 10000 ** (np.arange(HALF) / HALF), np_type),
        const("two", np.array(2.0), np_type),
        const("per_element", np.linspace(0.5, 1.5, HEAD), np_type),
    ]
    read = {name for node in nodes for name in node.input}
    return [tensor for tensor in tensors if tensor.name in read]


def _model(
    path: Path,
    rotations: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    *,
    positions: list[int | str] | None = None,
    second: str = "f",
    scale: str | None = None,
    dtype: int = TensorProto.FLOAT,
    heads: int = HEADS,
) -> Path:
    pos = value("pos", positions or [1, "seq"], TensorProto.INT64)
    nodes = [*_angles(second=second, scale=scale, dtype=dtype), *rotations]
    return save_model(path, nodes, [*inputs, pos], outputs, _constants(nodes, dtype, heads))


def _q_model(
    path: Path,
    *,
    extra: list[onnx.NodeProto] | None = None,
    extra_outputs: list[onnx.ValueInfoProto] | None = None,
    heads: int = HEADS,
    rotate: dict | None = None,
    dtype: int = TensorProto.FLOAT,
    **options: object,
) -> Path:
    """One rotary on q = the head split of the [B, S, N*H] projection Q."""
    return _model(
        path,
        [*_split_heads("Q", "q", "q_target"), *_rotate("q", **(rotate or {})), *(extra or [])],
        [value("Q", ["batch", "seq", heads * HEAD], dtype)],
        [value("q_out", ["batch", heads, "seq", HEAD], dtype), *(extra_outputs or [])],
        heads=heads,
        dtype=dtype,
        **options,
    )


def _compare(original: Path, run: Run, *, atol: float = 1e-4, **dims: int) -> None:
    """Outputs agree on onnxruntime at other sizes than optimize_checked's (2 everywhere)."""
    feeds = random_feeds(original, seed=1, dims=dims)
    expected, actual = run_model(original, feeds), run_model(run.output, feeds)
    for want, got in zip(expected, actual, strict=True):
        np.testing.assert_allclose(got, want, atol=atol, rtol=1e-3)


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    found: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found


def test_q_and_k_rotated_before_the_head_split(tmp_path: Path) -> None:
    """Grouped heads (q 2, k 1) sharing cos / sin: one cache pair, both rotaries on the 3-D
    projections, each split into heads after it."""
    model = _model(
        tmp_path / "split.onnx",
        [
            *_split_heads("Q", "q", "q_target"),
            *_split_heads("K", "k", "k_target"),
            *_rotate("q"),
            *_rotate("k"),
        ],
        [value("Q", ["batch", "seq", HEADS * HEAD]), value("K", ["batch", "seq", HEAD])],
        [value("q_out", ["batch", HEADS, "seq", HEAD]), value("k_out", ["batch", 1, "seq", HEAD])],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (2, 2)
    assert run.passed(ROTARY)["patterns"] == {"RotaryEmbedding": {"matched": 2, "effected": 2}}
    assert run.op_counts() == Counter(
        # the angles (Cast, Unsqueeze, Mul, Concat, Cos, Sin, 2 x Unsqueeze), the caches
        # (Slice + Reshape each), per projection RotaryEmbedding + Reshape + Transpose, but the
        # one key head's split is a Reshape alone (LayoutChainFusionPass)
        {"Cast": 1, "Unsqueeze": 3, "Mul": 1, "Concat": 1, "Cos": 1, "Sin": 1}
        | {"Slice": 2, "Reshape": 4, "RotaryEmbedding": 2, "Transpose": 1}
    )
    graph = _graph(run.output)
    rotaries = {n.input[0]: n for n in graph.node if n.op_type == "RotaryEmbedding"}
    assert sorted(rotaries) == ["K", "Q"]
    assert len({tuple(n.input[1:]) for n in rotaries.values()}) == 1
    readers = _readers(graph)
    for node, after in ((rotaries["Q"], ["Transpose"]), (rotaries["K"], [])):
        (reshape,) = readers[node.output[0]]
        assert reshape.op_type == "Reshape"
        assert [n.op_type for n in readers.get(reshape.output[0], [])] == after
    _compare(model, run, batch=3, seq=5)


def test_rotary_on_heads_without_a_split(tmp_path: Path) -> None:
    """x [B, N, S, H] fed as is: the rotary reads it directly, nothing is reshaped after."""
    model = _model(
        tmp_path / "heads.onnx",
        _rotate("x"),
        [value("x", ["batch", HEADS, "seq", HEAD])],
        [value("x_out", ["batch", HEADS, "seq", HEAD])],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    (node,) = [n for n in _graph(run.output).node if n.op_type == "RotaryEmbedding"]
    assert (node.domain, node.input[0], node.output[0]) == (MS, "x", "x_out")
    assert run.op_counts()["Transpose"] == 0
    assert run.op_counts()["Reshape"] == 2  # the two caches only
    _compare(model, run, batch=3, seq=5)


def test_commuted_operands_and_positive_axes(tmp_path: Path) -> None:
    """cos * x, sin * rotated, Add(sin term, cos term); slices on axis -1, Concat on axis 3."""
    model = _q_model(
        tmp_path / "commuted.onnx", rotate={"swap": True, "axis": "axis_last", "concat_axis": 3}
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    assert run.op_counts()["Neg"] == 0
    _compare(model, run, batch=1, seq=6)


def test_halves_taken_by_a_split(tmp_path: Path) -> None:
    """rotate_half with its halves from one Split (jax2onnx's ``jnp.split``): the halves are
    read by the elements they hold, not by the op that takes them."""
    model = _q_model(tmp_path / "split.onnx", rotate={"halves": "split"})
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    assert (run.op_counts()["Neg"], run.op_counts()["Split"]) == (0, 0)
    _compare(model, run, batch=2, seq=7)


def test_cos_and_sin_scaled_by_a_scalar(tmp_path: Path) -> None:
    """cos * 2 and sin * 2 (a scalar keeps both halves equal): the caches carry the scale."""
    model = _q_model(tmp_path / "scaled.onnx", scale="two")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    assert run.op_counts()["Neg"] == 0
    _compare(model, run, batch=3, seq=5)


def test_float16_rotary(tmp_path: Path) -> None:
    model = _q_model(tmp_path / "half.onnx", dtype=TensorProto.FLOAT16)
    run = optimize_checked(model, tmp_path, atol=1e-2)
    assert run.counts(ROTARY) == (1, 1)
    assert run.op_counts()["RotaryEmbedding"] == 1


def test_reshape_that_is_no_head_split_is_not_hoisted(tmp_path: Path) -> None:
    """Q [B, 2, 32] reshaped to [B, 4, 2, 8] (4 positions, 2 heads): Q's rows are not the
    positions, so the rotary applies to the 4-D x after that Reshape, not to Q."""
    nodes = [*_angles(), *_split_heads("Q", "q", "target"), *_rotate("q")]
    model = save_model(
        tmp_path / "no_split.onnx",
        nodes,
        [value("Q", ["batch", 2, 32]), value("pos", [1, 4], TensorProto.INT64)],
        [value("q_out", ["batch", 2, 4, HEAD])],
        [*_constants(nodes), const("target", [0, 4, 2, HEAD], np.int64)],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert (node.input[0], node.output[0]) == ("q", "q_out")
    assert [n.name for n in graph.node if n.op_type == "Transpose"] == ["q"]
    reshapes = [n.name for n in graph.node if n.op_type == "Reshape"]
    assert len(reshapes) == 3 and "q_heads" in reshapes  # and the two caches


def test_nameless_rotaries_of_two_head_sizes_keep_their_own_caches(tmp_path: Path) -> None:
    """Nodes without names (the cache bounds are named after the rotary's root): rotaries of
    head size 8 and 4, each with its own angles, keep their own cache bounds."""
    shared = {"pos", "zero", "max", "axis1", "axis2", "axis3"}

    def copy(prefix: str) -> list[onnx.NodeProto]:
        nodes = [*_angles(), *_rotate("x")]
        for node in nodes:
            node.name = ""
            node.input[:] = [n if n in shared else prefix + n for n in node.input]
            node.output[:] = [prefix + n for n in node.output]
        return nodes

    nodes = copy("a_") + copy("b_")
    ints = {"zero": [0], "max": [INT64_MAX], "axis1": [1], "axis2": [2], "axis3": [3]}
    model = save_model(
        tmp_path / "nameless.onnx",
        nodes,
        [
            value("a_x", ["batch", HEADS, "seq", 8]),
            value("b_x", ["batch", HEADS, "seq", 4]),
            value("pos", [1, "seq"], TensorProto.INT64),
        ],
        [
            value("a_x_out", ["batch", HEADS, "seq", 8]),
            value("b_x_out", ["batch", HEADS, "seq", 4]),
        ],
        [
            *(const(name, numbers, np.int64) for name, numbers in ints.items()),
            const("a_inv_freq", [1.0, 0.1, 0.01, 0.001]),
            const("a_half", [4], np.int64),
            const("b_inv_freq", [1.0, 0.01]),
            const("b_half", [2], np.int64),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (2, 2)
    graph = _graph(run.output)
    assert len(graph.initializer) == len({i.name for i in graph.initializer})
    rotaries = {n.input[0]: n for n in graph.node if n.op_type == "RotaryEmbedding"}
    assert sorted(rotaries) == ["a_x", "b_x"]
    assert not set(rotaries["a_x"].input[2:]) & set(rotaries["b_x"].input[2:])
    _compare(model, run, batch=3, seq=5)


@pytest.mark.parametrize("duplicated", [True, False], ids=["equal_halves", "unequal_halves"])
def test_constant_tables(duplicated: bool, tmp_path: Path) -> None:
    """cos / sin given as constants [1, 1, 3, H]: their halves are compared by value."""
    angles = np.outer(np.arange(3), 1.0 / 10000 ** (np.arange(HALF) / HALF))
    second = angles if duplicated else angles * 2
    table = np.concatenate([angles, second], axis=-1).reshape(1, 1, 3, HEAD)
    model = save_model(
        tmp_path / "tables.onnx",
        _rotate("x"),
        [value("x", ["batch", HEADS, 3, HEAD])],
        [value("x_out", ["batch", HEADS, 3, HEAD])],
        [
            const("cos", np.cos(table)),
            const("sin", np.sin(table)),
            *(const(n, v, np.int64) for n, v in [("zero", [0]), ("half", [HALF])]),
            *(const(n, v, np.int64) for n, v in [("max", [INT64_MAX]), ("axis3", [3])]),
        ],
    )
    run = optimize_checked(model, tmp_path)
    if duplicated:
        assert run.counts(ROTARY) == (1, 1)
        assert run.op_counts() == Counter({"RotaryEmbedding": 1})
        _compare(model, run, batch=3)
    else:
        assert_declined(
            run,
            ROTARY,
            "cos / sin are not the same angles repeated in both halves (Concat(f, f))",
            "x_out",
        )


# Near misses: not the pattern (nothing matched) or declined with the reason.

MISSES = {
    # name: (options, decline reason or None when it is not the pattern at all)
    "halves_differ": (
        {"second": "g"},
        "cos / sin are not the same angles repeated in both halves (Concat(f, f))",
    ),
    "scaled_per_element": (
        {"scale": "per_element"},
        "cos / sin are not the same angles repeated in both halves (Concat(f, f))",
    ),
    "one_row_for_every_position": (
        {"positions": [1, 1]},
        "cos / sin do not have one row per query position",
    ),
    "double": (
        {"dtype": TensorProto.DOUBLE},
        "onnxruntime has no com.microsoft.RotaryEmbedding kernel for DOUBLE",
    ),
    "split_past_the_middle": ({"rotate": {"split": "half_plus_one"}}, None),
    # rotate_half over the heads axis (8 heads, halves of 4) instead of the head size
    "heads_axis": ({"heads": 8, "rotate": {"axis": "axis1", "concat_axis": 1}}, None),
}


@pytest.mark.parametrize("miss", sorted(MISSES))
def test_near_misses(miss: str, tmp_path: Path) -> None:
    options, reason = MISSES[miss]
    model = _q_model(tmp_path / f"{miss}.onnx", **options)
    run = optimize_checked(model, tmp_path)
    if reason is None:
        assert run.counts(ROTARY) == (0, 0)
    else:
        assert_declined(run, ROTARY, reason, "q_out")
    ops = run.op_counts()
    assert (ops["RotaryEmbedding"], ops["Neg"]) == (0, 1)
    _compare(model, run, batch=3, seq=5)


# Tables per batch row: position ids [B, S] (left padding, packed sequences) or multimodal
# rotary give cos / sin [B, 1, S, H]. Flattened to [B*S, H/2], row b*S + s is batch row b's
# position s: RotaryEmbedding reads it through position_ids [B, S].


def _row_positions(batch: int, seq: int) -> np.ndarray:
    """Positions that differ per batch row, also relative to each other (attention sees only
    differences): row b is b, b + (b + 1), b + 2 (b + 1), ..."""
    rows = np.arange(batch)[:, None]
    return (rows + np.arange(seq)[None, :] * (rows + 1)).astype(np.int64)


def _compare_rows(original: Path, run: Run, batch: int, seq: int, **dims: int) -> None:
    """Outputs agree on onnxruntime with positions that differ per batch row."""
    feeds = random_feeds(original, seed=1, dims={"batch": batch, "seq": seq, **dims})
    feeds["pos"] = _row_positions(batch, seq)
    compare_on_feeds(original, run.output, feeds)


@pytest.mark.parametrize("sizes", ["symbolic", "static"])
def test_positions_per_batch_row(sizes: str, tmp_path: Path) -> None:
    """pos [B, S]: the caches are the tables flattened to [B*S, H/2], and position_ids
    b * S + s: a constant when B and S are static, else Range(0, B*S) shaped [B, S] from the
    table's shape at run time."""
    batch, seq = (3, 5) if sizes == "static" else ("batch", "seq")
    model = _model(
        tmp_path / f"{sizes}.onnx",
        [*_split_heads("Q", "q", "q_target"), *_rotate("q")],
        [value("Q", [batch, seq, HEADS * HEAD])],
        [value("q_out", [batch, HEADS, seq, HEAD])],
        positions=[batch, seq],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    ops = run.op_counts()
    if sizes == "static":
        ids = {i.name: numpy_helper.to_array(i) for i in graph.initializer}[node.input[1]]
        np.testing.assert_array_equal(ids, np.arange(15).reshape(3, 5))
        assert ops["Range"] == 0
    else:
        (grid,) = [n for n in graph.node if node.input[1] in n.output]
        assert grid.op_type == "Reshape"
        assert (ops["Shape"], ops["ReduceProd"], ops["Range"]) == (1, 1, 1)
    assert (ops["RotaryEmbedding"], ops["Neg"]) == (1, 0)
    _compare_rows(model, run, 3, 5)


@pytest.mark.parametrize("ids", ["int64", "int32"])
def test_cached_tables_looked_up_by_position_ids(ids: str, tmp_path: Path) -> None:
    """cos / sin = cos_cached[pos] (transformers 4's LLaMA, GPT-NeoX): constant tables [P, H]
    looked up per batch row by int64 position ids. RotaryEmbedding reads the tables' first
    halves through those ids, nothing flattened or computed; int32 ids (the kernel takes
    int64) go the general way, the lookups flattened and read through b * S + s."""
    positions = 16
    angles = np.arange(positions)[:, None] / 10000 ** (np.arange(HALF) / HALF)
    table = np.concatenate([angles, angles], -1)
    nodes = [
        *_split_heads("Q", "q", "q_target"),
        *(_n("Gather", [f"{t}_cached", "pos"], f"{t}_rows", axis=0) for t in ("cos", "sin")),
        *(_n("Unsqueeze", [f"{t}_rows", "axis1"], t) for t in ("cos", "sin")),
        *_rotate("q"),
    ]
    id_type = TensorProto.INT64 if ids == "int64" else TensorProto.INT32
    model = save_model(
        tmp_path / f"cached_{ids}.onnx",
        nodes,
        [value("Q", ["batch", "seq", HEADS * HEAD]), value("pos", ["batch", "seq"], id_type)],
        [value("q_out", ["batch", HEADS, "seq", HEAD])],
        [
            *_constants(nodes),
            const("cos_cached", np.cos(table), np.float32),
            const("sin_cached", np.sin(table), np.float32),
        ],
    )
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(ROTARY) == (1, 1)
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    initializers = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    if ids == "int64":
        assert node.input[1] == "pos"
        np.testing.assert_allclose(initializers[node.input[2]], np.cos(angles), rtol=1e-6)
        assert [n.op_type for n in graph.node] == ["RotaryEmbedding", "Reshape", "Transpose"]
    else:
        assert run.op_counts()["Range"] == 1
    feeds = random_feeds(model, seed=1, dims={"batch": 3, "seq": 5})
    feeds["pos"] = _row_positions(3, 5).astype(np.int64 if ids == "int64" else np.int32)
    compare_on_feeds(model, run.output, feeds)


def test_interleaved_table_per_batch_row(tmp_path: Path) -> None:
    """A RoFormer table [B, 1, S, H] per batch row: RotaryEmbedding(interleaved=1) on Q."""
    tables = _roformer_tables()
    model = _layout_model(
        tmp_path / "rows.onnx", tables, _rotate_pairs("q"), table=["batch", 1, "seq", HEAD]
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    assert (run.op_counts()["RotaryEmbedding"], run.op_counts()["Neg"]) == (1, 0)
    _compare(model, run, batch=3, seq=5)


# Negated rotations: NanoChat's rotate_half is Concat(x2, -x1), the negation of LLaMA's
# Concat(-x2, x1): a rotation by -angle, RotaryEmbedding with the sin cache negated.


def _signed_model(tmp_path: Path, rotation: str, negate: str) -> Path:
    """A rotate_half ("halves") or rotate_every_two ("pairs") of q, ``negate`` naming the part
    of its Concat that is negated."""
    if rotation == "halves":
        return _q_model(tmp_path / "halves.onnx", rotate={"negate": negate})
    pairs = _rotate_pairs("q", negate=negate)
    return _layout_model(tmp_path / "pairs.onnx", _roformer_tables(), pairs)


@pytest.mark.parametrize("rotation", ["halves", "pairs"])
def test_negated_rotation_negates_the_sin_cache(rotation: str, tmp_path: Path) -> None:
    model = _signed_model(tmp_path, rotation, "second")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    (negate,) = [n for n in graph.node if n.op_type == "Neg"]
    assert negate.output[0] == node.input[3]  # the sin cache, negated
    _compare(model, run, batch=3, seq=5)


@pytest.mark.parametrize("rotation", ["halves", "pairs"])
def test_both_parts_negated_is_no_rotation(rotation: str, tmp_path: Path) -> None:
    """Concat(-x2, -x1) is no rotation of x: not matched."""
    model = _signed_model(tmp_path, rotation, "both")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (0, 0)
    assert (run.op_counts()["RotaryEmbedding"], run.op_counts()["Neg"]) == (0, 2)
    _compare(model, run, batch=3, seq=5)


def test_positions_of_another_batch_decline(tmp_path: Path) -> None:
    """pos [P, S] with P not provably Q's batch (1 at run time would broadcast): declined."""
    model = _q_model(tmp_path / "other_batch.onnx", positions=["pos_batch", "seq"])
    run = optimize_checked(model, tmp_path)
    reason = "cos / sin have a batch axis that is not provably the input's batch"
    assert_declined(run, ROTARY, reason, "q_out")
    assert run.op_counts()["RotaryEmbedding"] == 0
    _compare(model, run, batch=3, seq=5, pos_batch=1)


@pytest.mark.parametrize(
    ("leak", "reason"),
    [
        ("output", "an intermediate value (Mul output) is a graph output"),
        ("reader", "an intermediate value (Mul output) is also used by Relu outside the match"),
    ],
)
def test_intermediate_read_outside_declines(leak: str, reason: str, tmp_path: Path) -> None:
    """x * cos is also a graph output, or read by another node."""
    if leak == "output":
        extra, outputs = [], [value("q_cos", ["batch", HEADS, "seq", HEAD])]
    else:
        extra = [_n("Relu", ["q_cos"], "leak")]
        outputs = [value("leak", ["batch", HEADS, "seq", HEAD])]
    model = _q_model(tmp_path / f"{leak}.onnx", extra=extra, extra_outputs=outputs)
    run = optimize_checked(model, tmp_path)
    assert_declined(run, ROTARY, reason, "q_out")
    assert run.op_counts()["RotaryEmbedding"] == 0


def test_symbolic_head_size_is_not_matched(tmp_path: Path) -> None:
    """x [B, N, S, head]: the split point H/2 cannot be checked against the head size."""
    model = _model(
        tmp_path / "symbolic_head.onnx",
        _rotate("x"),
        [value("x", ["batch", HEADS, "seq", "head"])],
        [value("x_out", ["batch", HEADS, "seq", "head"])],
    )
    run = optimize(model, tmp_path)
    assert run.counts(ROTARY) == (0, 0)
    assert run.op_counts()["Neg"] == 1
    _compare(model, run, batch=2, seq=3, head=HEAD)


# ---------------------------------------------------------------------------------------------
# GPT-J's interleaved rotary: rotate_every_two on [B, S, N, R] heads (R: the rotated part of
# each head), cos / sin repeat_interleave'd: RotaryEmbedding(interleaved=1) on x merged to
# [B, S, N*R], between two constant-target Reshapes.
# ---------------------------------------------------------------------------------------------

# gptj_ts11: exported at opset 11 (make_arch_matrix.py --torchscript-opset 11), where the
# Unsqueezes of rotate_every_two take their axes as an attribute
GPTJ = ["arch/gptj_ts17", "arch/gptj_dynamo", "gptj_ts11"]


def _four_rotaries(name: str, tmp_path: Path) -> tuple[Run, onnx.GraphProto, list[onnx.NodeProto]]:
    """The export's four rotations (q and k of two layers) each fused, no near-miss and no
    rotation left: the run, the output graph and its RotaryEmbedding nodes."""
    assert Counter(n.op_type for n in _graph(fixture_path(name)).node)["Neg"] == 4
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(ROTARY) == (4, 4)
    assert reasons(run, ROTARY) == {}
    graph = _graph(run.output)
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["RotaryEmbedding"], ops["Neg"]) == (4, 0)
    return run, graph, [n for n in graph.node if n.op_type == "RotaryEmbedding"]


@pytest.mark.parametrize("name", GPTJ)
def test_gptj_interleaved_partial_rotary_in_every_layer(name: str, tmp_path: Path) -> None:
    """q and k of both layers: the rotated quarter of each head (R = 4 of 8) goes through
    RotaryEmbedding(interleaved=1, num_heads=4); no rotate_every_two is left (TorchScript's
    Shape arithmetic for its Reshape back dies with it)."""
    run, _, rotaries = _four_rotaries(name, tmp_path)
    for node in rotaries:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"interleaved": 1, "num_heads": 4}
    # GPT-J computes its angles in every layer; merged as common subexpressions, one cos / sin
    # cache pair serves all four
    assert len({(n.input[2], n.input[3]) for n in rotaries}) == 1
    _compare(fixture_path(name), run, batch=3, sequence=5)


def _interleaved_model(
    path: Path,
    *,
    repeated_sin: bool = True,
    table_target: tuple[int, ...] = (0, 0, 0, -1),
) -> Path:
    """x [B, S, 2, 8] rotated every two with cos_t / sin_t [1, S, 1, 4] repeat_interleave'd
    (Unsqueeze, Tile by 2, Reshape to ``table_target``); without ``repeated_sin``, sin [1, S,
    1, 8] is fed as is."""
    nodes = []
    tables = ["cos", "sin"] if repeated_sin else ["cos"]
    for table in tables:
        nodes += [
            _n("Unsqueeze", [f"{table}_t", "axis_last"], f"{table}_5"),
            _n("Tile", [f"{table}_5", "twice"], f"{table}_pairs"),
            _n("Reshape", [f"{table}_pairs", "merge_table"], table),
        ]
    nodes += _rotate_pairs("x", target="constant")
    shape = ["batch", "seq", HEADS, HEAD]
    sin = ("sin_t", [1, "seq", 1, HALF]) if repeated_sin else ("sin", [1, "seq", 1, HEAD])
    inputs = [value("x", shape), value("cos_t", [1, "seq", 1, HALF]), value(*sin)]
    ints = {
        "zero": [0],
        "one": [1],
        "max": [INT64_MAX],
        "axis_last": [-1],
        "two_step": [2],
        "twice": [1, 1, 1, 1, 2],
        "merge_pairs": [0, 0, 0, -1],
        "merge_table": list(table_target),
    }
    constants = [const(name, numbers, np.int64) for name, numbers in ints.items()]
    return save_model(path, nodes, inputs, [value("x_out", shape)], constants)


def test_interleaved_rotary_synthetic(tmp_path: Path) -> None:
    model = _interleaved_model(tmp_path / "interleaved.onnx")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    # x merged and split back; each cache every second angle of the table the model repeated
    # (Unsqueeze, Tile, Reshape; the Tile of a unit axis an Expand, TileExpandCanonicalization),
    # flattened: computed once, whatever the number of layers
    repeats = {"Unsqueeze": 2, "Expand": 2, "Reshape": 2}
    assert run.op_counts() == Counter({"RotaryEmbedding": 1, "Slice": 2, "Reshape": 4}) + Counter(
        repeats
    )
    _compare(model, run, batch=2, seq=5)


def test_interleaved_rotary_positions_inferred_by_the_merge(tmp_path: Path) -> None:
    """The tables' pairs merged by a target that infers the position axis (-1), as dynamo
    writes it: the element count ([1, S, 1, 4, 2] into [1, -1, 1, 8]) makes it S."""
    model = _interleaved_model(tmp_path / "inferred.onnx", table_target=(1, -1, 1, 8))
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    _compare(model, run, batch=2, seq=5)


def test_interleaved_rotary_needs_repeated_angles(tmp_path: Path) -> None:
    model = _interleaved_model(tmp_path / "unrepeated.onnx", repeated_sin=False)
    run = optimize_checked(model, tmp_path)
    reason = "cos / sin are not each angle repeated twice in a row (repeat_interleave)"
    assert_declined(run, ROTARY, reason, "x_out")
    assert run.op_counts()["Neg"] == 1
    assert run.report["coverage"]["rotary"] == {
        "fused": 0,
        "total": 1,
        "unfused": [{"node": "x_pairs", "reason": f"{ROTARY}: {reason}"}],
    }


# ---------------------------------------------------------------------------------------------
# Either rotation on either layout. RoFormer and Cohere rotate every two elements of heads
# transposed to [B, N, S, H]: RotaryEmbedding(interleaved=1) on the projection, before the head
# split, whatever spells each angle twice in a row in cos / sin (torch.stack([t, t], -1)
# flattened, repeat_interleave).
# ---------------------------------------------------------------------------------------------

INTERLEAVED_TRANSPOSED = ["arch/roformer_ts17", "arch/roformer_dynamo", "rotary/cohere_dynamo"]


@pytest.mark.parametrize("name", INTERLEAVED_TRANSPOSED)
def test_interleaved_rotary_on_transposed_heads_in_every_layer(name: str, tmp_path: Path) -> None:
    """q and k of both layers; the rotaries read the projections (RoFormer's bias Add, Cohere's
    MatMul) and feed the fused attention directly, sharing one cache pair."""
    run, graph, rotaries = _four_rotaries(name, tmp_path)
    producers = {out: n for n in graph.node for out in n.output}
    readers = _readers(graph)
    attention = "GroupQueryAttention" if "cohere" in name else "MultiHeadAttention"
    for node in rotaries:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"interleaved": 1}
        assert producers[node.input[0]].op_type in ("MatMul", "Add")  # hoisted above the split
        assert attention in {r.op_type for r in readers[node.output[0]]}
    assert len({tuple(n.input[1:]) for n in rotaries}) == 1
    _compare(fixture_path(name), run, batch=3, sequence=5)


def _pairs_of(table: str, *, stack: str = "same") -> list[onnx.NodeProto]:
    """``table`` [.., R/2] with each element twice in a row, as ``table``_pairs [.., R/2, 2]:
    torch.stack([t, t], -1) as dynamo writes it (one Unsqueeze, "same") or TorchScript (one per
    operand, "two"); repeat_interleave by Expand ("expand"); stack([t, t * 2]) ("differ")."""
    second = {"same": f"{table}_5", "two": f"{table}_5b", "expand": "", "differ": f"{table}_5d"}
    nodes = [_n("Unsqueeze", [table, "axis_last"], f"{table}_5")]
    if stack == "expand":
        return [*nodes, _n("Expand", [f"{table}_5", "twice"], f"{table}_pairs")]
    if stack == "two":
        nodes.append(_n("Unsqueeze", [table, "axis_last"], f"{table}_5b"))
    if stack == "differ":
        nodes.append(_n("Mul", [f"{table}_5", "two"], f"{table}_5d"))
    return [*nodes, _n("Concat", [f"{table}_5", second[stack]], f"{table}_pairs", axis=-1)]


def _roformer_tables(*, stack: str = "same", merge: str = "shape") -> list[onnx.NodeProto]:
    """RoFormer: sin, cos = table [1, 1, S, H].chunk(2, -1), each repeated twice in a row by a
    stack merged back to the table's shape (reshape_as: Shape(table), or [1, 1, -1, H])."""
    target = {"shape": "table_shape", "constant": "table_target"}[merge]
    nodes = [
        _n("Shape", ["table"], "table_shape"),
        _n("Slice", ["table", "zero", "half", "axis_last"], "sin_t"),
        _n("Slice", ["table", "half", "max", "axis_last"], "cos_t"),
    ]
    for name in ("cos", "sin"):
        nodes += _pairs_of(f"{name}_t", stack=stack)
        nodes.append(_n("Reshape", [f"{name}_t_pairs", target], name))
    return nodes


def _cohere_tables(heads_axis: str = "axis1") -> list[onnx.NodeProto]:
    """Cohere: emb = repeat_interleave(f, 2, -1) for the angles f = positions * inv_freq
    [1, S, H/2]; cos / sin = Unsqueeze(Cos / Sin(emb), 1) [1, 1, S, H] (or at ``heads_axis``)."""
    return [
        _n("Cast", ["pos"], "pos_f", to=TensorProto.FLOAT),
        _n("Unsqueeze", ["pos_f", "axis2"], "pos_3"),
        _n("Mul", ["pos_3", "inv_freq"], "f"),
        *_pairs_of("f", stack="expand"),
        _n("Reshape", ["f_pairs", "emb_target"], "emb"),
        _n("Cos", ["emb"], "cos_3"),
        _n("Sin", ["emb"], "sin_3"),
        _n("Unsqueeze", ["cos_3", heads_axis], "cos"),
        _n("Unsqueeze", ["sin_3", heads_axis], "sin"),
    ]


def _rotate_pairs(x: str, *, target: str = "shape", negate: str = "first") -> list[onnx.NodeProto]:
    """x_out = x * cos + rotate_every_two(x) * sin, the pairs Reshaped back to x's shape
    (Shape(x), or [0, 0, 0, -1]); ``negate`` says which part is negated (the odd one: "first")."""
    shape = [_n("Shape", [x], f"{x}_shape")] if target == "shape" else []
    merge = f"{x}_shape" if target == "shape" else "merge_pairs"
    odd, even = _part(f"{x}_odd", negate, "first"), _part(f"{x}_even", negate, "second")
    return [
        *shape,
        _n("Slice", [x, "zero", "max", "axis_last", "two_step"], f"{x}_even"),
        _n("Slice", [x, "one", "max", "axis_last", "two_step"], f"{x}_odd"),
        *_negated_parts(f"{x}_odd", f"{x}_even", negate),
        _n("Unsqueeze", [odd, "axis_last"], f"{x}_odd_5"),
        _n("Unsqueeze", [even, "axis_last"], f"{x}_even_5"),
        _n("Concat", [f"{x}_odd_5", f"{x}_even_5"], f"{x}_pairs", axis=-1),
        _n("Reshape", [f"{x}_pairs", merge], f"{x}_rot"),
        _n("Mul", [x, "cos"], f"{x}_cos"),
        _n("Mul", [f"{x}_rot", "sin"], f"{x}_sin"),
        _n("Add", [f"{x}_cos", f"{x}_sin"], f"{x}_out"),
    ]


def _layout_model(
    path: Path,
    tables: list[onnx.NodeProto],
    rotation: list[onnx.NodeProto],
    *,
    layout: str = "split",
    table: list[int | str] | None = None,
    heads: int | str = HEADS,
) -> Path:
    """The rotary of x ("q" for the "split" layout, else "x") with cos / sin from ``tables``,
    which read the positions pos [1, S] or the position table [1, 1, S, H] (or ``table``);
    x is the head split of Q [B, S, N*H] ("split"), heads [B, N, S, H] fed as they are
    ("heads") or heads not transposed, [B, S, N, H] ("untransposed")."""
    x = "q" if layout == "split" else "x"
    nodes = [*tables, *rotation]
    if layout == "split":
        nodes = [*_split_heads("Q", x, "q_target"), *nodes]
        inputs = [value("Q", ["batch", "seq", HEADS * HEAD])]
    shape = {
        "split": ["batch", HEADS, "seq", HEAD],
        "heads": ["batch", HEADS, "seq", HEAD],
        "untransposed": ["batch", "seq", heads, HEAD],
    }[layout]
    if layout != "split":
        inputs = [value(x, shape)]
    read = {name for node in nodes for name in node.input}
    if "table" in read:
        inputs.append(value("table", table or [1, 1, "seq", HEAD]))
    if "pos" in read:
        inputs.append(value("pos", [1, "seq"], TensorProto.INT64))
    ints = {
        "one": [1],
        "two_step": [2],
        "twice": [1, 1, 1, 2],
        "merge_pairs": [0, 0, 0, -1],
        "table_target": [1, 1, -1, HEAD],
        "emb_target": [1, -1, HEAD],
    }
    constants = [
        *_constants(nodes),
        *(const(name, v, np.int64) for name, v in ints.items() if name in read),
    ]
    return save_model(path, nodes, inputs, [value(f"{x}_out", shape)], constants)


@pytest.mark.parametrize(
    "spelling",
    ["stack_same", "stack_two", "stack_constant_target", "cohere", "reshape_target_constant"],
)
def test_interleaved_rotary_before_the_head_split(spelling: str, tmp_path: Path) -> None:
    """Every spelling of each angle twice in a row, and of the rotated pairs' merge: one
    RotaryEmbedding(interleaved=1) on the projection Q, split into heads after it."""
    tables = {
        "stack_same": _roformer_tables(),
        "stack_two": _roformer_tables(stack="two"),
        "stack_constant_target": _roformer_tables(merge="constant"),
        "cohere": _cohere_tables(),
        "reshape_target_constant": _roformer_tables(),
    }[spelling]
    target = "constant" if spelling == "reshape_target_constant" else "shape"
    model = _layout_model(tmp_path / f"{spelling}.onnx", tables, _rotate_pairs("q", target=target))
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (node.domain, node.input[0], attrs) == (MS, "Q", {"interleaved": 1})
    assert [n.op_type for n in _readers(graph)[node.output[0]]] == ["Reshape"]
    assert run.op_counts()["Neg"] == 0
    _compare(model, run, batch=3, seq=5)


def test_interleaved_rotary_on_heads_without_a_split(tmp_path: Path) -> None:
    """x [B, N, S, H] fed as is: RotaryEmbedding(interleaved=1) reads the 4-D heads."""
    rotation = _rotate_pairs("x")
    model = _layout_model(tmp_path / "heads.onnx", _roformer_tables(), rotation, layout="heads")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    (node,) = [n for n in _graph(run.output).node if n.op_type == "RotaryEmbedding"]
    assert (node.input[0], node.output[0]) == ("x", "x_out")
    _compare(model, run, batch=3, seq=5)


def test_rotate_half_on_heads_not_transposed(tmp_path: Path) -> None:
    """rotate_half of x [B, S, N, H] with cos / sin [1, S, 1, H] (Concat(f, f) unsqueezed at
    the heads axis): RotaryEmbedding(interleaved=0, num_heads=N) on x merged to [B, S, N*H]."""
    nodes = [*_angles(heads_axis="axis2"), *_rotate("x")]
    model = _layout_model(tmp_path / "untransposed.onnx", [], nodes, layout="untransposed")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    (node,) = [n for n in _graph(run.output).node if n.op_type == "RotaryEmbedding"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"interleaved": 0, "num_heads": HEADS}
    _compare(model, run, batch=3, seq=5)


@pytest.mark.parametrize("equal", [True, False], ids=["equal_pairs", "unequal_pairs"])
def test_constant_interleaved_tables(equal: bool, tmp_path: Path) -> None:
    """cos / sin given as constants [1, 1, 3, H]: their pairs are compared by value, and the
    caches are every second element, constants too."""
    angles = np.outer(np.arange(3), 1.0 / 10000 ** (np.arange(HALF) / HALF))
    table = np.repeat(angles, 2, axis=-1) if equal else np.concatenate([angles, angles], -1)
    nodes = _rotate_pairs("x", target="constant")
    model = save_model(
        tmp_path / "tables.onnx",
        nodes,
        [value("x", ["batch", HEADS, 3, HEAD])],
        [value("x_out", ["batch", HEADS, 3, HEAD])],
        [
            const("cos", np.cos(table).reshape(1, 1, 3, HEAD)),
            const("sin", np.sin(table).reshape(1, 1, 3, HEAD)),
            *_constants(nodes),
            *(const(n, v, np.int64) for n, v in [("one", [1]), ("two_step", [2])]),
            const("merge_pairs", [0, 0, 0, -1], np.int64),
        ],
    )
    run = optimize_checked(model, tmp_path)
    if not equal:
        reason = "cos / sin are not each angle repeated twice in a row (repeat_interleave)"
        assert_declined(run, ROTARY, reason, "x_out")
        return
    assert run.counts(ROTARY) == (1, 1)
    graph = _graph(run.output)
    (node,) = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    initializers = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    np.testing.assert_allclose(initializers[node.input[2]], np.cos(angles), rtol=1e-6)
    _compare(model, run, batch=3)


LAYOUT_MISSES: dict[str, tuple[Callable[[], list[onnx.NodeProto]], dict, str]] = {
    # name: (cos / sin, model options, decline reason)
    "pairs_differ": (
        lambda: _roformer_tables(stack="differ"),
        {},
        "cos / sin are not each angle repeated twice in a row (repeat_interleave)",
    ),
    # a rotate_half table (Concat(f, f)) with the interleaved rotation: halves are no pairs
    "halves_for_pairs": (
        _angles,
        {},
        "cos / sin are not each angle repeated twice in a row (repeat_interleave)",
    ),
    "table_varies_along_heads": (
        _roformer_tables,
        {"table": [1, HEADS, "seq", HEAD]},
        "cos / sin differ per head",
    ),
    "one_row_for_every_position": (
        _roformer_tables,
        {"table": [1, 1, 1, HEAD]},
        "cos / sin do not have one row per query position",
    ),
    "heads_not_transposed_unknown_count": (
        lambda: _cohere_tables(heads_axis="axis2"),
        {"layout": "untransposed", "heads": "heads"},
        "the number of heads of the rotary's [B, S, N, H] input is unknown",
    ),
}


@pytest.mark.parametrize("miss", sorted(LAYOUT_MISSES))
def test_interleaved_near_misses(miss: str, tmp_path: Path) -> None:
    tables, options, reason = LAYOUT_MISSES[miss]
    x = "q" if options.get("layout", "split") == "split" else "x"
    rotation = _rotate_pairs(x, target="constant")
    model = _layout_model(tmp_path / f"{miss}.onnx", tables(), rotation, **options)
    run = optimize_checked(model, tmp_path)
    assert_declined(run, ROTARY, reason, f"{x}_out")
    assert (run.op_counts()["RotaryEmbedding"], run.op_counts()["Neg"]) == (0, 1)
    _compare(model, run, batch=3, seq=5, heads=HEADS)


# Rotated pair by pair (_pair_rotation), as code rotating complex numbers writes it in real
# arithmetic (transformers' OpenAI privacy filter): first, second = x[..., 0::2], x[..., 1::2];
# Reshape(Concat(Unsqueeze(first*cos - second*sin), Unsqueeze(second*cos + first*sin)), x),
# cos / sin [1, 1, S, H/2] each angle once.


def _pair_model(path: Path, *, frequencies: int = HALF, swap: bool = False) -> Path:
    """q = the head split of Q [B, S, N*H], rotated pair by pair by the angles of
    ``frequencies`` frequencies (H/2: one per pair); ``swap``: each product and the sum the
    other way round."""
    products = {
        "ec": ["q_even", "cos"], "os": ["q_odd", "sin"],
        "oc": ["q_odd", "cos"], "es": ["q_even", "sin"],
    }  # fmt: skip
    if swap:
        products = {name: operands[::-1] for name, operands in products.items()}
    nodes = [
        _n("Cast", ["pos"], "pos_f", to=TensorProto.FLOAT),
        _n("Unsqueeze", ["pos_f", "axis2"], "pos_3"),
        _n("Mul", ["pos_3", "freqs"], "f"),
        _n("Cos", ["f"], "cos_3"),
        _n("Sin", ["f"], "sin_3"),
        _n("Unsqueeze", ["cos_3", "axis1"], "cos"),
        _n("Unsqueeze", ["sin_3", "axis1"], "sin"),
        *_split_heads("Q", "q", "q_target"),
        _n("Slice", ["q", "zero", "max", "axis_last", "two_step"], "q_even"),
        _n("Slice", ["q", "one", "max", "axis_last", "two_step"], "q_odd"),
        *(_n("Mul", operands, f"q_{name}") for name, operands in products.items()),
        _n("Sub", ["q_ec", "q_os"], "q_first"),
        _n("Add", ["q_es", "q_oc"] if swap else ["q_oc", "q_es"], "q_second"),
        _n("Unsqueeze", ["q_first", "axis_last"], "q_first_1"),
        _n("Unsqueeze", ["q_second", "axis_last"], "q_second_1"),
        _n("Concat", ["q_first_1", "q_second_1"], "q_pairs", axis=-1),
        _n("Shape", ["q"], "q_shape"),
        _n("Reshape", ["q_pairs", "q_shape"], "q_out"),
    ]
    constants = [
        *_constants(nodes),
        const("one", [1], np.int64),
        const("two_step", [2], np.int64),
        const("freqs", 1.0 / 10000 ** (np.arange(frequencies) / max(frequencies, 1))),
    ]
    inputs = [
        value("Q", ["batch", "seq", HEADS * HEAD]),
        value("pos", [1, "seq"], TensorProto.INT64),
    ]
    outputs = [value("q_out", ["batch", HEADS, "seq", HEAD])]
    return save_model(path, nodes, inputs, outputs, constants)


@pytest.mark.parametrize("swap", [False, True])
def test_rotation_pair_by_pair_is_interleaved(swap: bool, tmp_path: Path) -> None:
    """RotaryEmbedding(interleaved=1) on the projection, cos / sin's rows its caches as they
    are; no Slice, Concat or Reshape of the rotation left."""
    model = _pair_model(tmp_path / "pairs.onnx", swap=swap)
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY) == (1, 1)
    (rotary,) = [n for n in _graph(run.output).node if n.op_type == "RotaryEmbedding"]
    assert {a.name: helper.get_attribute_value(a) for a in rotary.attribute} == {"interleaved": 1}
    ops = run.op_counts()
    assert (ops["Slice"], ops["Concat"], ops["Sub"]) == (0, 0, 0)
    _compare(model, run, batch=3, seq=5)


def test_rotation_pair_by_pair_by_one_angle_is_declined(tmp_path: Path) -> None:
    """One angle for every pair (cos / sin [1, 1, S, 1], broadcast): a rotation, but not one
    whose cache RotaryEmbedding reads."""
    model = _pair_model(tmp_path / "one.onnx", frequencies=1)
    run = optimize_checked(model, tmp_path)
    reason = "cos / sin do not have half the head size as their last axis"
    assert_declined(run, ROTARY, reason, "q_out")
    _compare(model, run, batch=3, seq=5)


# ---------------------------------------------------------------------------------------------
# Heads with no batch axis: a VLM vision tower's patches of all images as one sequence.
# ---------------------------------------------------------------------------------------------

QWEN3_VL_VISION = fixture_path("qwen3_vl_vision_ts17")


def test_vision_tower_rotates_packed_heads(tmp_path: Path) -> None:
    """Qwen3-VL's vision tower (TorchScript; tests/fixtures/make_transformer_fixtures.py)
    rotates q and k as [patches, heads, head size], no batch axis, by the standard rotate_half
    (0/4 before: the pass took 4-D heads only). Each becomes RotaryEmbedding on [1, S, N*H],
    and both attentions fuse."""
    run = optimize_checked(QWEN3_VL_VISION, tmp_path)
    assert run.counts(ROTARY) == (4, 4)
    coverage = run.report["coverage"]
    assert coverage["rotary"] == {"fused": 4, "total": 4, "unfused": []}
    assert coverage["attention"] == {"fused": 2, "total": 2, "unfused": []}
    assert (run.op_counts()["RotaryEmbedding"], run.op_counts()["Neg"]) == (4, 0)
    for seed in (1, 2):
        compare_on_feeds(QWEN3_VL_VISION, run.output, random_feeds(QWEN3_VL_VISION, seed=seed))


def _packed(path: Path, *, per_head: bool = False, along_heads: bool = False) -> Path:
    """x_out = x * cos + rotate_half(x) * sin for x [S, N, H] with no batch axis, cos / sin
    [S, 1, H] from positions [S]; with ``per_head`` scaled per head ([S, N, H]); with
    ``along_heads`` [1, N, H] from N positions (a row of angles for each head)."""
    suffix = "_shared" if per_head else ""
    rows_axis = "zero" if along_heads else "axis1"
    nodes = [
        _n("Cast", ["pos"], "pos_f", to=TensorProto.FLOAT),
        _n("Unsqueeze", ["pos_f", "axis1"], "pos_2"),  # [S, 1]
        _n("Mul", ["pos_2", "inv_freq"], "f"),  # [S, H/2]
        _n("Concat", ["f", "f"], "emb", axis=-1),
        _n("Cos", ["emb"], "cos_2"),
        _n("Sin", ["emb"], "sin_2"),
        _n("Unsqueeze", ["cos_2", rows_axis], f"cos{suffix}"),  # [S, 1, H] (or [1, N, H])
        _n("Unsqueeze", ["sin_2", rows_axis], f"sin{suffix}"),
    ]
    constants = []
    if per_head:
        nodes += [
            _n("Mul", ["cos_shared", "heads"], "cos"),
            _n("Mul", ["sin_shared", "heads"], "sin"),
        ]
        constants.append(const("heads", np.linspace(0.5, 1.5, HEADS).reshape(1, HEADS, 1)))
    nodes += _rotate("x", axis="axis_last")
    positions = [HEADS] if along_heads else ["seq"]
    inputs = [value("x", ["seq", HEADS, HEAD]), value("pos", positions, TensorProto.INT64)]
    outputs = [value("x_out", ["seq", HEADS, HEAD])]
    return save_model(path, nodes, inputs, outputs, [*_constants(nodes), *constants])


def _packed_feeds(length: int, positions: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((length, HEADS, HEAD)).astype(np.float32)
    return {"x": x, "pos": np.arange(positions or length, dtype=np.int64)}


def test_packed_heads_rotate_on_the_merged_projection(tmp_path: Path) -> None:
    model = _packed(tmp_path / "packed.onnx")
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(ROTARY) == (1, 1)
    (rotary,) = [n for n in _graph(run.output).node if n.op_type == "RotaryEmbedding"]
    attributes = {a.name: helper.get_attribute_value(a) for a in rotary.attribute}
    assert attributes == {"interleaved": 0, "num_heads": HEADS}
    for length in (1, 5, 12):
        compare_on_feeds(model, run.output, _packed_feeds(length))


def test_packed_heads_with_angles_per_head_are_declined(tmp_path: Path) -> None:
    """cos / sin [S, N, H]: each head rotated by its own angles, which no cache shared by the
    heads holds."""
    model = _packed(tmp_path / "per_head.onnx", per_head=True)
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(run, ROTARY, "cos / sin differ per head", "x_out")
    compare_on_feeds(model, run.output, _packed_feeds(5))


def test_packed_heads_with_angles_along_their_second_axis_rotate_it(tmp_path: Path) -> None:
    """cos / sin [1, N, H] against x [S, N, H]: a row of angles for each index of x's second
    axis. That is RotaryEmbedding's [batch, sequence, H] with one head, on x as it is (no
    merge), its rows the cache's."""
    model = _packed(tmp_path / "along_heads.onnx", along_heads=True)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(ROTARY) == (1, 1)
    (rotary,) = [n for n in _graph(run.output).node if n.op_type == "RotaryEmbedding"]
    assert rotary.input[0] == "x"
    assert {a.name: helper.get_attribute_value(a) for a in rotary.attribute} == {"interleaved": 0}
    for length in (1, 5):
        compare_on_feeds(model, run.output, _packed_feeds(length, positions=HEADS))
