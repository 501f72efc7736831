"""Models exported by Optimum (tests/fixtures/make_optimum_fixtures.py), the way most users get an
LLM as ONNX: KV-cache decoders whose mask is declared over ``past_sequence_length +
sequence_length``, and a merged encoder-decoder decoder (one If, two branches computing values of
the same names).

Before this, GPT-2 and the merged BART were internal errors (the fused attention would have read
a mask built from the key length of the present it computes: a cycle), and OPT's fused attention
lost its causal mask (the key padding recognizer probed the mask at sizes that cannot go
together: a mask shorter than the past it covers). GPT-J's rotary did not fuse: its angles are
gathered per batch row from a tiled table with GatherElements and interleaved with Tile and
Reshape, where onnx's inference makes up every size; the size walk now reads Split parts,
Tile repeats and GatherElements' indices. Cohere's did not either: its angles are repeated with
repeat_interleave, which the TorchScript exporter lowers to NonZero + GatherND, where no
structural proof of the pairs goes through and onnx cannot size the table; the pass now reads
both from the table evaluated on random positions at the probe sizes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fusectl.diagnostics.inputs import generate_feeds
from fusectl.rewrite.evaluate import PROBE_SIZES, probes
from tests.conftest import FIXTURES, fused_op_classes, optimize, run_model

OPTIMUM = FIXTURES / "optimum"

# Per fixture: fused ops per class, every op counted (If branches too), and the nodes left (the
# rotary's attention scaling and BART's embedding scale of 1.0 go: NeutralOperandElimination;
# the -1 tests of repeat_kv's and the causal mask's expand sizes: ShapeRunCanonicalization;
# repeat_kv's expand sizes, constants (ExpandTargetCanonicalization), and the head merges after
# it, [B, N*r, -1, H] once the -1 is counted (ReshapeTargetCanonicalization): 32 shape ops
# fewer for LLaMA and Cohere;
# a decoder step's one query row takes its mask rows as they are, 6 nodes fewer for BART and
# Marian's If branch; their decoders' context merges count their -1 from sizes traced through
# the attention, constant targets then: 11 shape ops fewer each; the sizes read outside the
# fused attentions come from the graph inputs, one read for every layer, merged: 6 more for
# BART and Marian, 8 for GPT-2, 16 for Whisper).
EXPECTED = {
    "gpt2_past": ({"attention": 2, "norm": 5, "skip_norm": 5, "gelu": 2, "rotary": 0}, 79),
    "opt_past": ({"attention": 2, "norm": 5, "skip_norm": 1, "gelu": 0, "rotary": 0}, 98),
    "llama_past": ({"attention": 2, "norm": 5, "skip_norm": 5, "gelu": 2, "rotary": 4}, 137),
    "gptj_past": ({"attention": 2, "norm": 3, "skip_norm": 2, "gelu": 2, "rotary": 4}, 162),
    "cohere_past": ({"attention": 2, "norm": 3, "skip_norm": 3, "gelu": 2, "rotary": 4}, 166),
    "bart_merged": ({"attention": 8, "norm": 14, "skip_norm": 12, "gelu": 4, "rotary": 0}, 302),
    "marian_merged": ({"attention": 8, "norm": 12, "skip_norm": 12, "gelu": 4, "rotary": 0}, 296),
    "whisper_merged": ({"attention": 8, "norm": 14, "skip_norm": 12, "gelu": 4, "rotary": 0}, 199),
}


def _ops(path: Path) -> Counter[str]:
    """Op types of the model and of every graph in it."""
    found: Counter[str] = Counter()
    pending = [onnx.load(str(path)).graph]
    while pending:
        graph = pending.pop()
        for node in graph.node:
            found[node.op_type] += 1
            pending += [a.g for a in node.attribute if a.HasField("g")]
    return found


def padded_feeds(path: Path, seed: int = 0, **fixed: bool) -> dict[str, np.ndarray]:
    """fusectl's feeds (batch 2, a past of 4, 8 new tokens, the mask over both), the second
    row left-padded by three positions so that the padding and causal parts both count."""
    feeds, _ = generate_feeds(ir.load(str(path)), {}, seed)
    for name, array in feeds.items():
        if "mask" in name and array.ndim == 2:
            array[-1, :3] = 0
    for name, value in fixed.items():
        feeds[name] = np.array([value])
    return feeds


def assert_same(original: Path, optimized: Path, feeds: dict[str, np.ndarray]) -> None:
    for want, got in zip(run_model(original, feeds), run_model(optimized, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", EXPECTED)
def test_fuses_every_layer_and_computes_the_same(name: str, tmp_path: Path) -> None:
    model = OPTIMUM / f"{name}.onnx"
    run = optimize(model, tmp_path)
    classes, nodes = EXPECTED[name]
    ops = _ops(run.output)
    assert fused_op_classes(ops) == classes
    assert sum(ops.values()) == nodes
    onnx.checker.check_model(str(run.output), full_check=True)
    branches = [{"use_cache_branch": True}, {"use_cache_branch": False}]
    for fixed in branches if name.endswith("_merged") else [{}]:
        assert_same(model, run.output, padded_feeds(model, **fixed))


def test_gpt2_mask_reads_the_key_length_from_the_past_and_the_new_keys(tmp_path: Path) -> None:
    """GPT-2 slices its causal mask to ``present.shape[2]``; the fused op computes the present,
    so the length is read as past + new keys instead, and the op takes the past."""
    run = optimize(OPTIMUM / "gpt2_past.onnx", tmp_path)
    graph = onnx.load(str(run.output)).graph
    attention = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert [list(n.input[6:8]) for n in attention] == [
        [f"past_key_values.{i}.key", f"past_key_values.{i}.value"] for i in range(2)
    ]
    readers = {n.input[0] for n in graph.node if n.op_type == "Shape"}
    assert not readers & {f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")}


def test_a_mask_read_from_the_present_through_another_op_is_declined(tmp_path: Path) -> None:
    """Near miss: the key length read from Abs(present) rather than the present itself cannot
    be read again from the past and the new keys; fusing would close a cycle, so the pass
    declines with that reason (this was an internal error)."""
    model = onnx.load(str(OPTIMUM / "gpt2_past.onnx"))
    graph = model.graph
    shape = next(n for n in graph.node if n.op_type == "Shape" and n.input[0] == "present.0.key")
    graph.node.insert(
        list(graph.node).index(shape),
        onnx.helper.make_node("Abs", ["present.0.key"], ["present_0_key_abs"], name="KeyAbs"),
    )
    shape.input[0] = "present_0_key_abs"
    edited = tmp_path / "gpt2_past_abs.onnx"
    onnx.save(model, str(edited))
    run = optimize(edited, tmp_path)
    reasons = {m["reason"] for m in run.passed("MultiHeadAttentionFusionPass")["near_misses"]}
    assert (
        "the new MultiHeadAttention would read a value computed from its own output (a size or "
        "mask read from a value it computes)"
    ) in reasons
    assert fused_op_classes(_ops(run.output))["attention"] == 1  # the other layer fuses
    assert_same(edited, run.output, padded_feeds(edited))


def test_opt_causal_mask_is_not_taken_for_a_padding_mask(tmp_path: Path) -> None:
    """OPT's mask is causal over past + new positions with the padding assigned into it. Probed
    at a mask length shorter than the past, the causal part vanished and the bias looked like
    padding alone; probed at a length that is past + new, it varies with the query, and stays
    the fused op's attention_bias."""
    run = optimize(OPTIMUM / "opt_past.onnx", tmp_path)
    misses = run.passed("KeyPaddingMaskFusionPass")["near_misses"]
    assert [(m["reason"], m["count"]) for m in misses] == [
        ("the attention bias varies with the query (a causal or windowed mask)", 2)
    ]
    graph = onnx.load(str(run.output)).graph
    attention = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert all(n.input[4] == "" and n.input[5] for n in attention)


def test_a_mask_length_named_apart_is_probed_as_the_key_length(tmp_path: Path) -> None:
    """The same OPT with its mask declared over a plain "total_length" (as transformers 5's
    exports name it): the name says nothing of past + new, so the probe sets it to the fused
    op's key length, and the causal mask is seen again."""
    model = onnx.load(str(OPTIMUM / "opt_past.onnx"))
    mask = next(i for i in model.graph.input if i.name == "attention_mask")
    mask.type.tensor_type.shape.dim[1].dim_param = "total_length"
    edited = tmp_path / "opt_total.onnx"
    onnx.save(model, str(edited))
    run = optimize(edited, tmp_path)
    misses = run.passed("KeyPaddingMaskFusionPass")["near_misses"]
    assert [m["reason"] for m in misses] == [
        "the attention bias varies with the query (a causal or windowed mask)"
    ]
    assert_same(edited, run.output, padded_feeds(edited))


def test_probe_sizes_compute_arithmetic_dimension_names() -> None:
    names = ["batch_size", "past_sequence_length + sequence_length", "sequence_length"]
    found = probes(names)
    assert not isinstance(found, str)
    for row, probe in zip(PROBE_SIZES, found, strict=True):
        batch, length, past = row[:3]  # the names inside the sum are probed in turn
        assert probe == {
            "batch_size": batch,
            "past_sequence_length": length,
            "sequence_length": past,
            "past_sequence_length + sequence_length": length + past,
        }
    assert probes(["a - b"]) == "the dimension 'a - b' comes to no positive size at the probe sizes"
    assert probes([f"d{i}" for i in range(7)]) == "7 named dimensions, more than the 6 probe sizes"


def test_generated_feeds_follow_the_declared_sum(tmp_path: Path) -> None:
    feeds, _ = generate_feeds(ir.load(str(OPTIMUM / "opt_past.onnx")), {"input_ids": [1, 5]})
    assert feeds["input_ids"].shape == (1, 5)
    assert feeds["past_key_values.0.key"].shape == (1, 2, 4, 16)
    assert feeds["attention_mask"].shape == (1, 9)  # past 4 + 5 new


def test_cohere_rotary_reads_its_repeat_interleave_from_the_evaluated_table(
    tmp_path: Path,
) -> None:
    """Every RotaryEmbedding is interleaved and reads the model's own position ids, and the
    output follows positions that are neither 0.. nor the same per row."""
    model = OPTIMUM / "cohere_past.onnx"
    run = optimize(model, tmp_path)
    graph = onnx.load(str(run.output)).graph
    rotary = [n for n in graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == 4
    assert all(
        onnx.helper.get_attribute_value(a) == 1
        for n in rotary
        for a in n.attribute
        if a.name == "interleaved"
    )
    assert {n.op_type for n in graph.node} >= {"NonZero", "GatherND"}  # the table stays
    feeds = padded_feeds(model)
    feeds["position_ids"] = np.random.default_rng(3).integers(0, 40, feeds["position_ids"].shape)
    assert_same(model, run.output, feeds)


def test_a_table_that_is_not_pairs_on_the_probes_is_declined(tmp_path: Path) -> None:
    """Near miss: Cohere's cos scaled by [1, 1.5, 1, 1.5, ...] along the head axis is no longer
    each angle twice in a row. Nothing proves it structurally and the evaluated table shows it
    is not pairs, so all four sites decline with the reason (sin alone is not enough)."""
    model = onnx.load(str(OPTIMUM / "cohere_past.onnx"))
    graph = model.graph
    cast = next(n for n in graph.node if n.name == "/model/rotary_emb/Cast_4")
    head = 8  # hidden 32 over 4 heads
    scale = onnx.numpy_helper.from_array(
        np.tile(np.array([1.0, 1.5], np.float32), head // 2), "cos_scale"
    )
    graph.initializer.append(scale)
    scaled = onnx.helper.make_node("Mul", [cast.output[0], "cos_scale"], ["cos_scaled"])
    for node in graph.node:
        node.input[:] = ["cos_scaled" if i == cast.output[0] else i for i in node.input]
    graph.node.insert(list(graph.node).index(cast) + 1, scaled)
    edited = tmp_path / "cohere_unpaired.onnx"
    onnx.save(model, str(edited))
    run = optimize(edited, tmp_path)
    misses = run.passed("RotaryEmbeddingFusionPass")["near_misses"]
    assert [(m["reason"], m["count"]) for m in misses] == [
        ("cos / sin are not each angle repeated twice in a row (repeat_interleave)", 4)
    ]
    assert fused_op_classes(_ops(run.output))["rotary"] == 0
    assert_same(edited, run.output, padded_feeds(edited))
