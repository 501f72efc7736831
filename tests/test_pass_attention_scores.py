"""Scores as eager code writes them, read by what they compute: a masked_fill (Where with a
mask value) or a subtracted mask is an additive bias, K^T however computed is the key's
transpose, a floor Max(., -FLT_MAX) only keeps -inf out, a per-head
scale moves onto the query heads, and a fold to [batch*heads, ...] before the Softmax is the
fold after it. Real exports (MPT, GPT-Neo, XGLM, Swin-v2, Funnel, SqueezeBERT under both
exporters) and small
onnx.helper models, with the near-misses each reading must decline."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import FIXTURES, fused_op_classes, named_dim_feeds
from tests.pass_helpers import (
    assert_declined,
    compare_on_feeds,
    const,
    optimize_checked,
    reasons,
    save_model,
    value,
)

MHA = "MultiHeadAttentionFusionPass"
QKV = "QkvAttentionFusionPass"
HEADS, HEAD, HIDDEN = 4, 8, 32
FLT_MIN = float(np.finfo(np.float32).min)


def _n(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output, **attrs)


def _eager(
    path: Path,
    *,
    fill: str = "",
    fill_value: float = FLT_MIN,
    floor: float | None = None,
    bias: str = "input",
    head_scale: list[int] | None = None,
    axis: int = -1,
    seq: int | str = "seq",
    position: bool = False,
    key_length: bool = False,
    scores_shape: bool = False,
    opset: int = 17,
) -> Path:
    """Self-attention over x [batch, seq, 32], 4 heads of 8, scores q @ k^T scaled by 1/sqrt(8)
    (or by a constant of shape ``head_scale``), then: ``fill`` "keep" Where(keep, s, m) or
    "drop" Where(drop, m, s) with the bool input [batch, 1, seq, seq] and m ``fill_value``;
    ``floor``: Add(s, bias) then Max(., floor), the bias an ``input`` or a ``where`` of
    constants (0 / -FLT_MAX) by the bool input; Softmax over ``axis``. ``position`` adds an
    input [batch, 1, seq, seq] to q @ k^T before the scale (XLNet); ``key_length`` outputs
    the scores' last size as a float (XLNet's klen = scores.shape[3]); ``scores_shape`` their
    whole shape."""
    rng = np.random.default_rng(0)
    inputs = [value("x", ["batch", seq, HIDDEN])]
    outputs = [value("y", ["batch", seq, HIDDEN])]
    initializers = [
        const("split", [0, 0, HEADS, HEAD], np.int64),
        const("merge", [0, 0, HIDDEN], np.int64),
        const("m", np.array(fill_value)),
        const("zero", np.array(0.0)),
        const("lowest", np.array(FLT_MIN)),
    ]
    nodes = []
    for name in ("Q", "K", "V"):
        initializers.append(const(f"w{name}", rng.normal(size=(HIDDEN, HIDDEN)) * 0.3))
        nodes += [
            _n("MatMul", ["x", f"w{name}"], name),
            _n("Reshape", [name, "split"], f"{name}_heads"),
        ]
    nodes += [
        _n("Transpose", ["Q_heads"], "q", perm=[0, 2, 1, 3]),
        _n("Transpose", ["K_heads"], "kT", perm=[0, 2, 3, 1]),
        _n("Transpose", ["V_heads"], "v", perm=[0, 2, 1, 3]),
        _n("MatMul", ["q", "kT"], "scores"),
    ]
    if head_scale is None:
        initializers.append(const("s", np.array(HEAD**-0.5)))
    else:
        factor = rng.uniform(0.2, 1.0, size=head_scale)
        initializers.append(const("s", factor))
    product = "scores"
    if position:
        inputs.append(value("position", ["batch", 1, seq, seq]))
        nodes.append(_n("Add", ["scores", "position"], "positioned"))
        product = "positioned"
    if key_length:
        initializers.append(const("last", np.array(3), np.int64))
        nodes += [
            _n("Shape", ["scores"], "scores_shape"),
            _n("Gather", ["scores_shape", "last"], "length", axis=0),
            _n("Cast", ["length"], "key_length", to=TensorProto.FLOAT),
        ]
        outputs.append(value("key_length", []))
    if scores_shape:
        nodes.append(_n("Shape", ["scores"], "scores_shape"))
        outputs.append(value("scores_shape", [4], TensorProto.INT64))
    nodes.append(_n("Mul", [product, "s"], "scaled"))
    last = "scaled"
    if fill or floor is not None:
        inputs.append(value("flag", ["batch", 1, seq, seq], TensorProto.BOOL))
    if fill:
        branches = [last, "m"] if fill == "keep" else ["m", last]
        nodes.append(_n("Where", ["flag", *branches], "filled"))
        last = "filled"
    if floor is not None:
        if bias == "input":
            inputs.append(value("bias", ["batch", 1, seq, seq]))
        else:
            nodes.append(_n("Where", ["flag", "zero", "lowest"], "bias"))
        initializers.append(const("floor", np.array(floor)))
        nodes += [_n("Add", [last, "bias"], "biased"), _n("Max", ["biased", "floor"], "floored")]
        last = "floored"
    nodes += [
        _n("Softmax", [last], "probs", axis=axis),
        _n("MatMul", ["probs", "v"], "context"),
        _n("Transpose", ["context"], "merged", perm=[0, 2, 1, 3]),
        _n("Reshape", ["merged", "merge"], "y"),
    ]
    return save_model(path, nodes, inputs, outputs, initializers, opset=opset)


def _feeds(model: Path, *, batch: int = 3, seq: int = 5) -> dict[str, np.ndarray]:
    """Random x and bias; the flag keeps a causal triangle, every position of the last row
    of the batch flagged the other way (a fully masked row, for a "keep" fill)."""
    rng = np.random.default_rng(7)
    causal = np.tril(np.ones((seq, seq), bool))
    flag = np.broadcast_to(causal, (batch, 1, seq, seq)).copy()
    flag[-1, :, 0, :] = False
    feeds = {
        "x": rng.normal(size=(batch, seq, HIDDEN)).astype(np.float32),
        "flag": flag,
        "bias": rng.normal(size=(batch, 1, seq, seq)).astype(np.float32),
        "position": rng.normal(size=(batch, 1, seq, seq)).astype(np.float32),
    }
    inputs = {i.name for i in onnx.load(str(model)).graph.input}
    return {name: array for name, array in feeds.items() if name in inputs}


def _fused(run_output: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(run_output)).graph.node)


def _attention(run_output: Path) -> tuple[onnx.NodeProto, float]:
    """The one MultiHeadAttention of the output, and its scale."""
    graph = onnx.load(str(run_output)).graph
    (attention,) = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    scale = {a.name: helper.get_attribute_value(a) for a in attention.attribute}["scale"]
    return attention, scale


@pytest.mark.parametrize("fill", ["keep", "drop"])
@pytest.mark.parametrize("fill_value", [FLT_MIN, -1e9, -np.inf])
def test_masked_fill_becomes_the_attention_bias(
    fill: str, fill_value: float, tmp_path: Path
) -> None:
    """Where(keep, s, m) is s + Where(keep, 0, m) (Where(drop, m, s): s + Where(drop, m, 0)):
    the fused op reads that Where as its attention_bias. A row filled everywhere gets the
    uniform weights of the written-out softmax (-inf is read as -1e30 there, as for masks)."""
    model = _eager(tmp_path / f"{fill}.onnx", fill=fill, fill_value=fill_value)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    assert run.counts(MHA) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (attention,) = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    (where,) = [n for n in graph.node if n.op_type == "Where"]
    assert attention.input[5] == where.output[0]
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    zero_first = fill == "keep"
    values = [float(constants[name]) for name in where.input[1:]]
    assert values == ([0.0, fill_value] if zero_first else [fill_value, 0.0])
    assert _fused(run.output)["Softmax"] == 0
    if np.isfinite(fill_value):
        for batch, seq in [(3, 5), (1, 2)]:
            compare_on_feeds(model, run.output, _feeds(model, batch=batch, seq=seq))


def test_fill_that_is_no_mask_value_keeps_the_attention(tmp_path: Path) -> None:
    """Where(keep, s, 0): the filled scores keep weight, no bias expresses it."""
    model = _eager(tmp_path / "zero_fill.onnx", fill="keep", fill_value=0.0)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    reason = (
        "the scores are not MatMul(query, key^T) with additive biases and a constant scale "
        "(they come from Where)"
    )
    assert_declined(run, MHA, reason, "probs")
    compare_on_feeds(model, run.output, _feeds(model))


def test_floor_is_read_through_when_the_mask_is_finite(tmp_path: Path) -> None:
    """Max(s + Where(flag, 0, -FLT_MAX), -FLT_MAX): the floor changes nothing a finite mask
    leaves, so the attention fuses with that mask as its bias."""
    model = _eager(tmp_path / "floored.onnx", floor=FLT_MIN, bias="where")
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    assert run.counts(MHA) == (1, 1)
    counts = _fused(run.output)
    assert (counts["Max"], counts["Softmax"], counts["MultiHeadAttention"]) == (0, 0, 1)
    compare_on_feeds(model, run.output, _feeds(model))


@pytest.mark.parametrize(
    ("floor", "bias", "reason"),
    [
        (FLT_MIN, "input", "the scores are floored by Max(., -FLT_MAX) and the additive mask "
         "may hold -inf"),
        (0.0, "where", "the scores are not MatMul(query, key^T) with additive biases and a "
         "constant scale (they come from Max)"),
    ],
)  # fmt: skip
def test_floor_near_misses(floor: float, bias: str, reason: str, tmp_path: Path) -> None:
    """A floor over a mask fed at run time (it may hold -inf, which the floor turned into
    -FLT_MAX); a floor at 0 (a ReLU of the scores)."""
    model = _eager(tmp_path / "floor.onnx", floor=floor, bias=bias)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    assert_declined(run, MHA, reason, "probs")
    compare_on_feeds(model, run.output, _feeds(model))


@pytest.mark.parametrize("shape", [[HEADS, 1, 1], [1, HEADS, 1, 1]])
def test_per_head_scale_moves_onto_the_query_heads(shape: list[int], tmp_path: Path) -> None:
    """Scores scaled per head (Swin-v2's logit scale): the query heads are, the fused op reads
    them merged back, with scale 1."""
    model = _eager(tmp_path / "per_head.onnx", head_scale=shape)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    assert run.counts(MHA) == (1, 1)
    _, scale = _attention(run.output)
    assert scale == pytest.approx(1.0)
    assert _fused(run.output)["Mul"] == 1  # on the query heads
    for batch, seq in [(3, 5), (2, 1)]:
        compare_on_feeds(model, run.output, _feeds(model, batch=batch, seq=seq))


def test_scale_varying_along_the_keys_keeps_the_attention(tmp_path: Path) -> None:
    """A factor [1, 1, 1, L] weighs key positions: no query scaling expresses it."""
    model = _eager(tmp_path / "per_key.onnx", head_scale=[1, 1, 1, 5], seq=5)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    reason = (
        "the scores are not MatMul(query, key^T) with additive biases and a constant scale "
        "(they come from Mul)"
    )
    assert_declined(run, MHA, reason, "probs")


def test_softmax_over_the_queries_keeps_the_attention(tmp_path: Path) -> None:
    """A Softmax over axis 2 normalizes over the query positions: not attention's."""
    model = _eager(tmp_path / "axis2.onnx", axis=2)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    reason = "the Softmax is not provably over the last axis (the key positions)"
    assert_declined(run, MHA, reason, "probs")
    assert _fused(run.output)["Softmax"] == 1


def test_position_term_before_the_scale_is_scaled_into_the_bias(tmp_path: Path) -> None:
    """(q @ k^T + position) * s, XLNet's order: the fused op scales q @ k^T itself and adds
    s * position as its attention bias."""
    model = _eager(tmp_path / "position.onnx", position=True)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    assert run.counts(MHA) == (1, 1)
    attention, scale = _attention(run.output)
    assert scale == pytest.approx(HEAD**-0.5)
    graph = onnx.load(str(run.output)).graph
    (bias,) = [n for n in graph.node if attention.input[5] in n.output]
    assert (bias.op_type, bias.input[0]) == ("Mul", "position")
    for batch, seq in [(3, 5), (2, 1)]:
        compare_on_feeds(model, run.output, _feeds(model, batch=batch, seq=seq))


def test_position_term_before_the_scale_is_no_mask_the_standard_op_clamps(
    tmp_path: Path,
) -> None:
    """The standard Attention op (opset 23) takes -FLT_MAX in a mask for -inf; fusectl clamps
    masks it can read, and a position term computed at run time is not one."""
    model = _eager(tmp_path / "position23.onnx", position=True, opset=23)
    run = optimize_checked(model, tmp_path, "--target", "onnx", compare=False)
    reason = (
        "a bias is added before the scale, its values unknown, so it may hold -FLT_MAX, "
        "which the standard Attention kernel takes for -inf"
    )
    assert_declined(run, "AttentionFusionPass", reason, "probs")


def test_key_length_read_from_the_scores_is_read_from_the_input(tmp_path: Path) -> None:
    """The scores' shape read outside the attention (XLNet's relative shift takes klen from
    it): the fused op removes the scores, so the size is read where it is copied from: the
    graph input's axis of that named size (the key is projected from it), which every layer
    reads alike, before the key projection the fused op reads; nothing of the scores'
    product stays."""
    model = _eager(tmp_path / "klen.onnx", key_length=True)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    assert run.counts(MHA) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (shape,) = [n for n in graph.node if n.op_type == "Shape"]
    assert shape.input[0] == "x"
    counts = _fused(run.output)
    assert (counts["MatMul"], counts["Softmax"]) == (3, 0)  # the projections alone
    for batch, seq in [(3, 5), (2, 1)]:
        compare_on_feeds(model, run.output, _feeds(model, batch=batch, seq=seq))


def test_scores_shape_read_whole_is_rebuilt_from_the_sizes_it_copies(tmp_path: Path) -> None:
    """The scores' whole shape, a graph output: rebuilt as a Concat of the sizes it copies
    (batch and lengths from the projections the fused op reads, the heads a constant), in
    front of nothing that reads it late (the full checker checks the order)."""
    model = _eager(tmp_path / "shape.onnx", scores_shape=True)
    run = optimize_checked(model, tmp_path, "--disable_pass", QKV, compare=False)
    assert run.counts(MHA) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (concat,) = [n for n in graph.node if "scores_shape" in n.output]
    assert concat.op_type == "Concat"
    assert _fused(run.output)["MatMul"] == 3  # the projections alone
    for batch, seq in [(3, 5), (2, 1)]:
        compare_on_feeds(model, run.output, _feeds(model, batch=batch, seq=seq))


def test_xlnet_relative_attention_fused_in_every_layer(tmp_path: Path) -> None:
    """XLNet (TorchScript): its position term and segment term are added to the content
    scores before the scale, the mask is subtracted after it through an einsum, the layout is
    sequence-first, and the relative shift reads the key length from the scores' shape. Both
    layers become MultiHeadAttention; a second run changes nothing."""
    model = FIXTURES / "arch" / "xlnet_ts17.onnx"
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(MHA) == (2, 2)
    assert reasons(run, MHA) == {}
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    dims = json.loads((FIXTURES / "arch" / "manifest.json").read_text())["dims"]
    compare_on_feeds(model, run.output, named_dim_feeds(model, dims))
    (tmp_path / "again").mkdir()
    again = optimize_checked(run.output, tmp_path / "again", compare=False)
    first, second = (onnx.load(str(path)).graph.node for path in (run.output, again.output))
    assert [(n.op_type, list(n.input)) for n in first] == [
        (n.op_type, list(n.input)) for n in second
    ]


# fixture: what makes its scores (the matrix's tests check every class's counts and numerics)
EAGER_EXPORTS = {
    "mpt": "ALiBi added, then masked_fill(mask, -FLT_MAX)",
    "gpt_neo": "unscaled, masked_fill by the causal and local-window masks, padding mask added",
    "xglm": "folded bmm scores unfolded for the mask, floored, folded back before the Softmax",
    "swinv2": "cosine scores scaled per head, position bias and the shifted windows' mask",
    "funnel": "einsum scores and context (canonical MatMuls), the mask subtracted",
    "squeezebert": "K^T reshaped straight from a channel-first convolution's output",
}


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
@pytest.mark.parametrize("name", sorted(EAGER_EXPORTS))
def test_eager_scores_fused_in_every_layer(name: str, exporter: str, tmp_path: Path) -> None:
    """Both attention layers of each become a fused attention (packed-QKV Attention where one
    input feeds the three projections, else MultiHeadAttention): no Softmax is left, nothing
    is reported unfused, and the outputs match the original's on onnxruntime."""
    model = FIXTURES / "arch" / f"{name}_{exporter}.onnx"
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(MHA)[1] + run.counts(QKV)[1] == 2
    assert reasons(run, MHA) == reasons(run, QKV) == {}
    counts = _fused(run.output)
    assert fused_op_classes(counts)["attention"] == 2
    assert counts["Softmax"] == 0
    dims = json.loads((FIXTURES / "arch" / "manifest.json").read_text())["dims"]
    compare_on_feeds(model, run.output, named_dim_feeds(model, dims))


GQA = "GroupQueryAttentionFusionPass"


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_attention_sinks_become_the_head_sink(exporter: str, tmp_path: Path) -> None:
    """GPT-OSS joins a learned logit per head to every row's scores, subtracts the row's
    maximum, takes the Softmax and drops the sink's column: GroupQueryAttention with that
    logit as head_sink (its input 11), the max subtraction read through (the Softmax does it
    anyway). Both layers, the alternating sliding window in the additive mask."""
    model = FIXTURES / "arch" / f"gpt_oss_{exporter}.onnx"
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(GQA) == (2, 2)
    graph = onnx.load(str(run.output)).graph
    sinks = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(fused) == 2
    for node in fused:
        assert len(node.input) == 12
        assert sinks[node.input[11]].shape == (4,)
    coverage = run.report["coverage"]["attention"]
    assert (coverage["fused"], coverage["total"]) == (2, 2)  # the MoE routers' Softmax stay
    dims = json.loads((FIXTURES / "arch" / "manifest.json").read_text())["dims"]
    for sizes in (dims, {**dims, "batch": 3, "sequence": 3}):
        compare_on_feeds(model, run.output, named_dim_feeds(model, sizes))


def test_attention_sinks_decline_where_the_op_has_none(tmp_path: Path) -> None:
    """With GroupQueryAttention off, MultiHeadAttention has no input for the sink: it says so."""
    model = FIXTURES / "arch" / "gpt_oss_dynamo.onnx"
    run = optimize_checked(model, tmp_path, "--disable_pass", GQA)
    assert reasons(run, MHA) == {
        "the Softmax has a sink per head (a logit joined to the scores and dropped after it), "
        "which MultiHeadAttention cannot take (GroupQueryAttention's head_sink)": 2
    }


def test_a_sink_column_kept_is_a_near_miss(tmp_path: Path) -> None:
    """The probabilities with the sink's column also a graph output: the column is not only
    dropped, so no fused op computes what is read, and the report says why."""
    proto = onnx.load(str(FIXTURES / "arch" / "gpt_oss_dynamo.onnx"))
    softmax = next(n for n in proto.graph.node if n.op_type == "Softmax")
    proto.graph.output.append(
        helper.make_tensor_value_info(softmax.output[0], TensorProto.FLOAT, None)
    )
    model = tmp_path / "kept.onnx"
    onnx.save(proto, str(model))
    run = optimize_checked(model, tmp_path)
    assert reasons(run, GQA) == {
        "a column is joined to the scores (a sink) but not dropped after the Softmax": 1
    }
    assert run.counts(GQA) == (2, 1)
