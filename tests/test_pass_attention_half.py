"""Half-precision attention whose Softmax computes in float32 between float16 operands.

Decoder exports in float16 promote around the Softmax in several places (fixtures: the
architecture matrix's models, ``make_arch_matrix.py --half --only NAME``):

- GPT-J and GPT-Neo cast the query and key heads to float32 for the scores (the key before
  its transpose), and the probabilities back to float16 for the value product;
- MPT casts the float16 product up and the probabilities back;
- XLM and Funnel mask or bias the scores in float16, then promote them;
- Granite's sliding-window attention computes its sink's sigmoid in float32;
- XGLM floors the float16 scores at float16's lowest value, -65504.

The fused op computes in float32 from the promoted operands (a Cast of each float16 input,
the biases too), and where the probabilities were cast back, its output is cast back too.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import named_dim_feeds, optimize, run_model
from tests.pass_helpers import check_output, edited_fixture, fixture_path, node_named, reasons

HOIST = "WideningCastHoistPass"
MHA = "MultiHeadAttentionFusionPass"
GQA = "GroupQueryAttentionFusionPass"
PACKED = "QkvAttentionFusionPass"
DIMS = json.loads((fixture_path("gptj_ts17_fp16").parent / "arch" / "manifest.json").read_text())[
    "dims"
]

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
# fixture: (the pass that fuses, its fused op, Transposes moved above the key's Cast, the type
# the fused op computes in, the probabilities cast back to float16)
CASES = {
    "gptj_ts17_fp16": (MHA, "MultiHeadAttention", 2, FLOAT, True),
    "gpt_neo_dynamo_fp16": (MHA, "MultiHeadAttention", 2, FLOAT, True),
    "mpt_dynamo_fp16": (MHA, "MultiHeadAttention", 0, FLOAT, True),
    "xlm_dynamo_fp16": (MHA, "MultiHeadAttention", 0, FLOAT, True),
    "funnel_ts17_fp16": (MHA, "MultiHeadAttention", 0, FLOAT, True),
    # the Softmax in float16: only the sink's sigmoid (Granite), or the floor (XGLM) differs
    "granite_swa_dynamo_fp16": (GQA, "GroupQueryAttention", 0, HALF, False),
    "xglm_dynamo_fp16": (PACKED, "Attention", 0, HALF, False),
}


def _same_outputs(original: Path, optimized: Path) -> None:
    """Equal on onnxruntime within float16's resolution, a padded row included, no NaN."""
    feeds = named_dim_feeds(original, DIMS)
    want, got = run_model(original, feeds), run_model(optimized, feeds)
    assert len(want) == len(got)
    for expected, actual in zip(want, got, strict=True):
        assert not np.isnan(actual).any() and not np.isnan(expected).any()
        np.testing.assert_allclose(actual, expected, atol=1e-2, rtol=1e-2)


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_softmax_between_float16_operands_fuses(name: str, tmp_path: Path) -> None:
    fusion, op_type, sunk, computes_in, narrowed = CASES[name]
    run = optimize(fixture_path(name), tmp_path)
    check_output(run)
    _same_outputs(fixture_path(name), run.output)
    assert run.counts(fusion) == (2, 2)
    assert run.counts(HOIST) == (sunk, sunk)
    ops = run.op_counts()
    assert ops["Softmax"] == 0 and ops[op_type] == 2
    model = onnx.load(str(run.output))
    types = _elem_types(model)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name_in in node.input:
            readers.setdefault(name_in, []).append(node)
    for node in (n for n in model.graph.node if n.op_type == op_type):
        operands = [x for x in node.input[:3] if x]
        assert {types[x] for x in operands if x in types} == {computes_in}
        if narrowed:  # its output cast back to the value product's float16
            (reader,) = readers[node.output[0]]
            assert reader.op_type == "Cast"
            assert helper.get_attribute_value(reader.attribute[0]) == HALF


@pytest.mark.parametrize("name", ["gptj_ts17_fp16", "gpt_neo_dynamo_fp16"])
def test_the_key_transposed_below_its_cast_is_read_in_float16(name: str, tmp_path: Path) -> None:
    """With the Transpose above the key's Cast, the fused op reads the float16 key heads merged
    like the query's; without it, the float32 heads the Cast made, merged back by extra nodes."""
    run = optimize(fixture_path(name), tmp_path)
    (tmp_path / "off").mkdir()
    off = optimize(fixture_path(name), tmp_path / "off", "--disable_pass", HOIST)
    assert run.counts(MHA) == off.counts(MHA) == (2, 2)
    nodes = sum(run.op_counts().values())
    assert nodes < sum(off.op_counts().values())
    _same_outputs(fixture_path(name), off.output)


def _exposed(fixture: str, node: str, elem: int, tmp_path: Path) -> Path:
    """The fixture with the 4-D output of ``node`` (of type ``elem``) a graph output too."""

    def edit(model: onnx.ModelProto) -> None:
        made = node_named(model, node).output[0]
        model.graph.output.append(helper.make_tensor_value_info(made, elem, [None] * 4))

    return edited_fixture(fixture, tmp_path, edit, f"{fixture}_exposed")


def test_key_cast_also_an_output_stays_above_its_transpose(tmp_path: Path) -> None:
    """The key's Cast is also a graph output in layer 0: the Transpose cannot move above it
    (the Cast would stay for the output, and the Transpose would read float16 for nothing);
    layer 1's moves. Both attentions fuse, layer 0 reading the float32 key the Cast made."""

    path = _exposed("gptj_ts17_fp16", "/inner/h.0/attn/Cast_1", FLOAT, tmp_path)
    run = optimize(path, tmp_path)
    check_output(run)
    assert run.counts(HOIST) == (1, 1)
    assert run.counts(MHA) == (2, 2)
    _same_outputs(path, run.output)


def test_probabilities_cast_back_and_read_outside_decline(tmp_path: Path) -> None:
    """MPT's float16 probabilities (the Cast back) also a graph output in layer 0: the fused op
    would not compute them, so that layer declines with the reason; layer 1 fuses."""

    path = _exposed("mpt_dynamo_fp16", "node__to_copy_3", HALF, tmp_path)
    run = optimize(path, tmp_path)
    check_output(run)
    assert run.counts(MHA) == (2, 1)
    assert reasons(run, MHA) == {"an intermediate value (Cast output) is a graph output": 1}
    _same_outputs(path, run.output)


def test_float16_floor_above_its_lowest_value_is_not_dropped(tmp_path: Path) -> None:
    """Max(scores, -1e4) in float16 clips finite scores: not a floor the fused op may drop,
    so the walk from the Softmax stops at it and every attention pass declines."""

    def edit(model: onnx.ModelProto) -> None:
        floor = np.array(-1e4, np.float16)
        for node in (n for n in model.graph.node if n.name.startswith("node_maximum")):
            name = f"{node.name}/floor"
            model.graph.initializer.append(numpy_helper.from_array(floor, name))
            node.input[1] = name

    path = edited_fixture("xglm_dynamo_fp16", tmp_path, edit, "xglm_high_floor")
    run = optimize(path, tmp_path)
    check_output(run)
    for fusion in (MHA, PACKED):
        assert run.counts(fusion) == (2, 0)
        assert reasons(run, fusion) == {
            "the scores are folded to [batch*heads, ...] before the Softmax but not unfolded": 2
        }
    assert Counter(n.op_type for n in onnx.load(str(run.output)).graph.node)["Softmax"] == 2
    _same_outputs(path, run.output)
