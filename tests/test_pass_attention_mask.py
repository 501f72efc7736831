"""KeyPaddingMaskFusionPass: an attention bias recognized, by evaluating it, as a padding mask
turned into 0 / a negative value becomes the fused attention's own 2-D mask input. ERNIE
(transformers 5's mask functions, both exporters), the classic ``(1 - mask) * -10000``
spelling into a MultiHeadAttention, the biases it must leave (a causal mask, a position
bias, a bias of two inputs), and numerics on onnxruntime with padded and empty rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

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

MASK = "KeyPaddingMaskFusionPass"
HEADS, HEAD, HIDDEN = 4, 8, 32


def _text_feeds(batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids and a mask that pads every row differently, the last row entirely."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((batch, length)) > 0.4).astype(np.int64)
    mask[:, 0] = 1
    mask[-1] = 0
    return {"input_ids": rng.integers(0, 60, (batch, length)), "attention_mask": mask}


def _attention_inputs(path: Path) -> list[list[str]]:
    graph = onnx.load(str(path)).graph
    return [
        list(node.input)
        for node in graph.node
        if node.op_type in ("Attention", "MultiHeadAttention")
    ]


@pytest.mark.parametrize(
    ("model", "nodes", "guards"), [("ernie_ts17", 23, 2), ("ernie_dynamo", 19, 0)]
)
def test_ernie_mask_becomes_the_mask_index(
    tmp_path: Path, model: str, nodes: int, guards: int
) -> None:
    """Both layers read attention_mask (cast to int32 once) instead of the bias the mask
    functions build; that construction (Range grids, And, Expand, Where) is gone. TorchScript's
    fill is -inf, so an entirely padded row is NaN, which the export's guard after each
    attention (Where(IsNaN(p), 0, p)) turns into zeros as before."""
    source = ARCH_FIXTURES / f"{model}.onnx"
    run = optimize_checked(source, tmp_path)
    assert pattern_counts(run, MASK) == {"KeyPaddingMask": (2, 2)}
    assert reasons(run, MASK) == {}
    attentions = _attention_inputs(run.output)
    assert len(attentions) == 2
    for inputs in attentions:
        assert len(inputs) == 4 and inputs[3] == "attention_mask_int32"
    ops = run.op_counts()
    assert ops["Range"] == ops["And"] == ops["Expand"] == 0
    assert ops["Where"] == ops["IsNaN"] == guards
    assert sum(ops.values()) == nodes
    for batch, length in ((2, 8), (3, 5), (1, 1)):
        compare_on_feeds(source, run.output, _text_feeds(batch, length))


@pytest.mark.parametrize("model", ["bart_ts17", "bart_dynamo"])
def test_encoder_padding_in_self_and_cross_attention(tmp_path: Path, model: str) -> None:
    """BART: the encoder's self-attention and the decoder's cross-attention read the encoder's
    padding mask (the cross bias [B, 1, T, S] built from the decoder's length too); the
    decoder's causal self-attention is not a padding mask and is left to the lowering."""
    source = ARCH_FIXTURES / f"{model}.onnx"
    run = optimize_checked(source, tmp_path)
    assert pattern_counts(run, MASK) == {"KeyPaddingMask": (4, 4)}
    masked = [
        inputs for inputs in _attention_inputs(run.output) if "attention_mask_int32" in inputs
    ]
    assert len(masked) == 4
    for batch, length in ((2, 8), (3, 5)):
        feeds = _text_feeds(batch, length)
        feeds["decoder_input_ids"] = np.random.default_rng(1).integers(0, 60, (batch, 3))
        compare_on_feeds(source, run.output, feeds)


def _masked_attention(path: Path, bias: str, mask_type: int = TensorProto.BOOL) -> Path:
    """A MultiHeadAttention over x with an attention_bias [B, 1 or N, S, S] built from the
    2-D ``mask`` the classic way, ``(1 - mask) * -10000`` unsqueezed, with ``bias`` adding:
    "" nothing, "causal" a causal mask, "position" a constant per-head bias, "input" a
    second graph input [B, 1, 1, S]."""
    rng = np.random.default_rng(0)
    inputs = [value("x", ["B", "S", HIDDEN]), value("mask", ["B", "S"], mask_type)]
    initializers = [
        const(f"w{name}", rng.normal(size=(HIDDEN, HIDDEN)) * 0.3) for name in "qkv"
    ] + [const("one", 1.0), const("big", -10000.0), const("axes", [1, 2], np.int64)]
    nodes = [helper.make_node("MatMul", ["x", f"w{name}"], [name]) for name in "qkv"]
    nodes += [
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "maskf"], ["dropped"]),
        helper.make_node("Mul", ["dropped", "big"], ["flat"]),
        helper.make_node("Unsqueeze", ["flat", "axes"], ["keys"]),  # [B, 1, 1, S]
        # [B, 1, S, S]: MultiHeadAttention broadcasts the bias over heads only
        helper.make_node("Shape", ["mask"], ["batch"], end=1),
        helper.make_node("Shape", ["mask"], ["length"], start=1),
        helper.make_node("Concat", ["batch", "unit", "length", "length"], ["grid"], axis=0),
        helper.make_node("Expand", ["keys", "grid"], ["padding"]),
    ]
    initializers.append(const("unit", [1], np.int64))
    final = "padding"
    if bias == "causal":  # -10000 above the diagonal, from the mask's length
        initializers += [const("zero", 0, np.int64), const("step", 1, np.int64)]
        initializers.append(const("row_axis", [1], np.int64))
        nodes += [
            helper.make_node("Squeeze", ["length"], ["length_scalar"]),
            helper.make_node("Range", ["zero", "length_scalar", "step"], ["positions"]),
            helper.make_node("Unsqueeze", ["positions", "row_axis"], ["rows"]),
            helper.make_node("Greater", ["positions", "rows"], ["future"]),  # [S, S]
            helper.make_node("Cast", ["future"], ["futuref"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["futuref", "big"], ["causal"]),
            helper.make_node("Add", ["padding", "causal"], ["both"]),
        ]
        final = "both"
    elif bias == "position":
        initializers.append(const("table", rng.normal(size=(1, HEADS, 1, 1))))
        nodes.append(helper.make_node("Add", ["padding", "table"], ["both"]))
        final = "both"
    elif bias == "input":
        inputs.append(value("extra", ["B", 1, 1, "S"]))
        nodes.append(helper.make_node("Add", ["padding", "extra"], ["both"]))
        final = "both"
    nodes.append(
        helper.make_node(
            "MultiHeadAttention",
            ["q", "k", "v", "", "", final],
            ["y"],
            domain="com.microsoft",
            num_heads=HEADS,
        )
    )
    outputs = [value("y", ["B", "S", HIDDEN])]
    return save_model(path, nodes, inputs, outputs, initializers, contrib=True)


def _feeds(
    batch: int, length: int, extra: bool = False, mask_type: type = bool
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * length)
    mask = (rng.random((batch, length)) > 0.4).astype(mask_type)
    mask[:, 0] = 1
    feeds = {"x": rng.normal(size=(batch, length, HIDDEN)).astype(np.float32), "mask": mask}
    if extra:
        feeds["extra"] = rng.normal(size=(batch, 1, 1, length)).astype(np.float32)
    return feeds


def test_classic_mask_into_multi_head_attention(tmp_path: Path) -> None:
    """``(1 - mask) * -10000`` of a bool mask becomes key_padding_mask with
    mask_filter_value -10000."""
    model = _masked_attention(tmp_path / "classic.onnx", "")
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, MASK) == {"KeyPaddingMask": (1, 1)}
    graph = onnx.load(str(run.output)).graph
    (attention,) = [node for node in graph.node if node.op_type == "MultiHeadAttention"]
    assert list(attention.input)[4:] == ["mask_int32"]
    filter_value = next(a.f for a in attention.attribute if a.name == "mask_filter_value")
    assert filter_value == -10000.0
    assert run.op_counts()["Sub"] == run.op_counts()["Unsqueeze"] == 0
    for batch, length in ((2, 7), (3, 1)):
        compare_on_feeds(model, run.output, _feeds(batch, length))


def test_an_integer_mask_scaled_by_its_value_stays(tmp_path: Path) -> None:
    """``(1 - mask) * -10000`` of an int64 mask adds +10000 where the mask is 2: the op's
    mask would keep that key with 0 added, so the bias stays."""
    model = _masked_attention(tmp_path / "scaled.onnx", "", TensorProto.INT64)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, MASK) == {"KeyPaddingMask": (1, 0)}
    assert reasons(run, MASK) == {
        "the attention bias reads the mask's values, not only whether they are 0 "
        "((1 - mask) * c): the op's mask would differ for values above 1": 1
    }
    compare_on_feeds(model, run.output, _feeds(2, 6, mask_type=np.int64))


@pytest.mark.parametrize(
    ("bias", "reason"),
    [
        ("causal", "the attention bias varies with the query (a causal or windowed mask)"),
        ("position", "the attention bias adds more than the mask (a position bias)"),
        ("input", "the attention bias reads more than one graph input"),
    ],
)
def test_biases_that_are_more_than_a_padding_mask_stay(
    tmp_path: Path, bias: str, reason: str
) -> None:
    model = _masked_attention(tmp_path / f"{bias}.onnx", bias)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, MASK) == {"KeyPaddingMask": (1, 0)}
    assert reasons(run, MASK) == {reason: 1}
    (attention,) = _attention_inputs(run.output)
    assert attention[4] == "" and attention[5] != ""
    compare_on_feeds(model, run.output, _feeds(2, 6, extra=bias == "input"))
