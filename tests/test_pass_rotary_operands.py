"""RotaryOperandExpandCanonicalizationPass: the standard RotaryEmbedding's caches (or position
ids) of batch 1 spread to x's batch. The dynamo exporter's LLaMA at opset 23, which onnxruntime
runs at batch 1 only; hand-built forms (position ids, 3-D x, static sizes); the operands it
leaves; numerics against onnx's reference evaluator, the op as onnx defines it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import Run, reference_outputs, run_model
from tests.pass_helpers import (
    assert_declined,
    assert_second_run_changes_nothing,
    check_output,
    fixture_path,
    optimize,
    save_model,
    value,
)

PASS = "RotaryOperandExpandCanonicalizationPass"
HEADS, HEAD = 4, 16


def _llama_feeds(model: Path, batch: int, sequence: int, past: int, seed: int) -> dict:
    """Token ids, a mask (the last row padded by two), and random past keys and values."""
    rng = np.random.default_rng(seed)
    names = [i.name for i in onnx.load(str(model)).graph.input]
    feeds = {"input_ids": rng.integers(0, 100, (batch, sequence)).astype(np.int64)}
    feeds["attention_mask"] = np.ones((batch, past + sequence), np.int64)
    feeds["attention_mask"][-1, :2] = 0
    for name in names[2:]:  # past_key_<i>, past_value_<i>: [batch, 2 kv heads, past, 16]
        feeds[name] = rng.standard_normal((batch, 2, past, HEAD)).astype(np.float32)
    return feeds


def _agrees_with_the_definition(original: Path, run: Run, feeds: dict) -> None:
    """The optimized model on onnxruntime computes what onnx's reference evaluator computes
    for the original."""
    want, got = reference_outputs(original, feeds), run_model(run.output, feeds)
    assert len(want) == len(got)
    for expected, actual in zip(want, got, strict=True):
        np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=1e-3)


def _spreads(run: Run) -> list[onnx.NodeProto]:
    """The Expands the RotaryEmbedding nodes read."""
    graph = onnx.load(str(run.output)).graph
    made = {out: node for node in graph.node for out in node.output}
    read = {name for node in graph.node if node.op_type == "RotaryEmbedding" for name in node.input}
    return [made[name] for name in sorted(read) if name in made and made[name].op_type == "Expand"]


@pytest.mark.parametrize(
    ("name", "nodes", "past"),
    [("llama_tiny_dynamo23", 93, 0), ("llama_tiny_past_dynamo23", 107, 4)],
)
def test_the_dynamo_exporters_opset_23_llama_runs_at_every_batch(
    tmp_path: Path, name: str, nodes: int, past: int
) -> None:
    """Its four RotaryEmbedding nodes (q and k of two layers) read cos/sin caches of batch 1,
    a Cos and a Sin per node: each layer reads one spread of each, the batch read from
    input_ids, and the repeated Cos and Sin go."""
    model = fixture_path(name)
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(PASS) == (4, 4)
    assert run.report["model"]["after"]["nodes"] == nodes
    ops = run.op_counts()
    assert (ops["RotaryEmbedding"], ops["Cos"], ops["Sin"]) == (4, 1, 1)
    spreads = _spreads(run)
    assert len(spreads) == 2
    assert spreads[0].input[1] == spreads[1].input[1]  # one target for both
    for batch, sequence, seed in ((1, 8, 0), (2, 3, 1), (3, 5, 2)):
        feeds = _llama_feeds(model, batch, sequence, past, seed)
        _agrees_with_the_definition(model, run, feeds)
        if batch == 1:  # where onnxruntime runs the export itself, it agrees too
            original, optimized = run_model(model, feeds), run_model(run.output, feeds)
            for want, got in zip(original, optimized, strict=True):
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    run = optimize(fixture_path("llama_tiny_dynamo23"), tmp_path)
    assert_second_run_changes_nothing(run, tmp_path, PASS)


def _rotary(
    path: Path, x: list, operands: list[tuple[str, list]], domain: str = "", **attributes
) -> Path:
    """RotaryEmbedding(x, operands...) on graph inputs, its output doubled."""
    int64 = ("positions", "offset")
    inputs = [value("x", x)] + [
        value(name, shape, onnx.TensorProto.INT64 if name in int64 else onnx.TensorProto.FLOAT)
        for name, shape in operands
    ]
    rotary = helper.make_node(
        "RotaryEmbedding", ["x", *(name for name, _ in operands)], ["rotated"], name="rotary",
        domain=domain, **attributes,
    )  # fmt: skip
    nodes = [rotary, helper.make_node("Add", ["rotated", "rotated"], ["out"])]
    contrib = domain == "com.microsoft"
    outputs = [value("out", [None] * len(x))]
    return save_model(path, nodes, inputs, outputs, opset=23, contrib=contrib)


def _feeds(shapes: dict[str, list[int]], positions: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    if "positions" in feeds:
        feeds["positions"] = rng.integers(0, positions, shapes["positions"]).astype(np.int64)
    return feeds


def test_position_ids_of_batch_1_are_spread(tmp_path: Path) -> None:
    """With position ids the caches are 2-D tables and the ids carry the batch."""
    x = ["batch", HEADS, "sequence", HEAD]
    operands = [("cos", [32, HEAD // 2]), ("sin", [32, HEAD // 2]), ("positions", [1, "sequence"])]
    model = _rotary(tmp_path / "positions.onnx", x, operands)
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(PASS) == (1, 1)
    (spread,) = _spreads(run)
    assert spread.input[0] == "positions"
    shapes = {"x": [3, HEADS, 5, HEAD], "cos": [32, 8], "sin": [32, 8], "positions": [1, 5]}
    _agrees_with_the_definition(model, run, _feeds(shapes, positions=32))


def test_caches_of_a_3d_x_are_spread(tmp_path: Path) -> None:
    """x as [batch, sequence, heads * head] (num_heads given): the sequence is axis 1."""
    x = ["batch", "sequence", HEADS * HEAD]
    operands = [("cos", [1, "sequence", HEAD // 2]), ("sin", [1, "sequence", HEAD // 2])]
    model = _rotary(tmp_path / "flat.onnx", x, operands, num_heads=HEADS)
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(PASS) == (1, 1)
    assert len(_spreads(run)) == 2
    cache = [1, 5, HEAD // 2]
    shapes = {"x": [2, 5, HEADS * HEAD], "cos": cache, "sin": cache}
    _agrees_with_the_definition(model, run, _feeds(shapes))


def test_static_sizes_spread_to_a_constant_target(tmp_path: Path) -> None:
    """A batch and a sequence both 1 in the caches, static in x: the target is the sizes
    (folded to one constant)."""
    x = [2, HEADS, 6, HEAD]
    cache = [1, 1, HEAD // 2]
    model = _rotary(tmp_path / "static.onnx", x, [("cos", cache), ("sin", cache)])
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(PASS) == (1, 1)
    constants = {
        i.name: onnx.numpy_helper.to_array(i).tolist()
        for i in onnx.load(str(run.output)).graph.initializer
    }
    assert [constants.get(spread.input[1]) for spread in _spreads(run)] == [[2, 6, 1]] * 2
    _agrees_with_the_definition(model, run, _feeds({"x": x, "cos": cache, "sin": cache}))


@pytest.mark.parametrize(
    "operands",
    [
        [("cos", ["batch", "sequence", 8]), ("sin", ["batch", "sequence", 8])],
        [("cos", [32, 8]), ("sin", [32, 8]), ("positions", ["batch", "sequence"])],
    ],
    ids=["caches", "position_ids"],
)
def test_operands_of_x_sizes_stay(tmp_path: Path, operands: list) -> None:
    """Operands that have x's batch and sequence by name are the kernel's form already."""
    model = _rotary(tmp_path / "full.onnx", ["batch", HEADS, "sequence", HEAD], operands)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert run.op_counts()["Expand"] == 0


def test_x_of_unknown_rank_is_declined(tmp_path: Path) -> None:
    """Without x's rank (a Reshape to a target read at run time) there is no telling its batch
    and sequence axes apart."""
    cache = [1, "sequence", 8]
    nodes = [
        helper.make_node("Reshape", ["data", "target"], ["x"]),
        helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["rotated"], name="rotary"),
    ]
    inputs = [value("data", ["count"]), value("target", ["rank"], onnx.TensorProto.INT64)]
    inputs += [value("cos", cache), value("sin", cache)]
    model = save_model(
        tmp_path / "rankless.onnx", nodes, inputs, [value("rotated", [None] * 4)], opset=23
    )
    run = optimize(model, tmp_path)
    check_output(run)
    reason = "x's rank is unknown or not 3 or 4: its batch and sequence axes are not known"
    assert_declined(run, PASS, reason, "rotary")
    assert run.op_counts()["Expand"] == 0
    feeds = _feeds({"data": [HEADS * 5 * HEAD], "cos": [1, 5, 8], "sin": [1, 5, 8]})
    feeds["target"] = np.array([1, HEADS, 5, HEAD], np.int64)
    np.testing.assert_allclose(run_model(run.output, feeds)[0], run_model(model, feeds)[0])


def test_onnxruntimes_own_rotary_is_not_the_standard_op(tmp_path: Path) -> None:
    """com.microsoft's RotaryEmbedding reads (x, position_ids, cos, sin), 2-D caches: left
    as it is, though its position ids (an offset here) have no batch."""
    operands = [("offset", [1]), ("cos", [32, HEAD // 2]), ("sin", [32, HEAD // 2])]
    model = _rotary(tmp_path / "contrib.onnx", ["batch", "sequence", HEADS * HEAD], operands,
                    domain="com.microsoft", num_heads=HEADS)  # fmt: skip
    run = optimize(model, tmp_path)
    check_output(run)
    assert run.counts(PASS) == (0, 0)
    assert run.op_counts()["Expand"] == 0
    feeds = _feeds({"x": [2, 5, HEADS * HEAD], "cos": [32, 8], "sin": [32, 8]})
    feeds["offset"] = np.array([3], np.int64)
    np.testing.assert_allclose(run_model(run.output, feeds)[0], run_model(model, feeds)[0])
