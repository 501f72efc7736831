"""Weights no graph output depends on: fusectl removes the nodes computing with them (dead
code), and says so, since a miswired export looks exactly like that (onnxruntime-genai's
builder, given a Phi-3 with transformers 5, wired its LM head to layer 0's norm and left layer
1's MLP and the final norm computing nothing). The run's warnings, whatever the log level,
are in the report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import assert_same_outputs, optimize, random_feeds, run_model
from tests.pass_helpers import fixture_path

F = TensorProto.FLOAT
POOLER = "inner.pooler.dense.weight"


def _without_pooler(tmp_path: Path) -> Path:
    """The tiny BERT with its pooler output dropped, as an export asked for one output only
    would not be, but a graph edited by hand or a tool may."""
    model = onnx.load(str(fixture_path("bert_tiny_ts17")))
    kept = [output for output in model.graph.output if output.name != "pooler_output"]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    path = tmp_path / "no_pooler.onnx"
    onnx.save(model, str(path))
    return path


def test_weights_that_feed_no_output_are_named(tmp_path: Path) -> None:
    source = _without_pooler(tmp_path)
    run = optimize(source, tmp_path, "--log", "error")
    assert "feed no graph output" not in run.stderr  # the log level hides it
    warnings = [w for w in run.report["warnings"] if "feed no graph output" in w]
    assert warnings == [
        f"{source}: 1 weight(s) (0.0 MB, the first '{POOLER}', read by Gemm "
        "'/inner/pooler/dense/Gemm') feed no graph output; the nodes computing with them are "
        "removed. If the model should compute with them, an output may be missing from its "
        "export"
    ]
    names = {tensor.name for tensor in onnx.load(str(run.output)).graph.initializer}
    assert POOLER not in names
    assert_same_outputs(source, run.output, atol=1e-4)


def test_a_complete_export_gets_no_warning(tmp_path: Path) -> None:
    run = optimize(fixture_path("bert_tiny_ts17"), tmp_path)
    assert "feed no graph output" not in run.stderr
    assert not any("feed no graph output" in w for w in run.report["warnings"])


def test_a_value_read_only_inside_a_branch_is_live(tmp_path: Path) -> None:
    """A projection whose result only an If branch reads (a captured value) computes for an
    output: no warning, and the projection stays."""
    weight = numpy_helper.from_array(np.full((32, 32), 0.01, np.float32), "w")
    branch = helper.make_graph(
        [helper.make_node("Relu", ["h"], ["r"])],
        "then",
        [],
        [helper.make_tensor_value_info("r", F, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["n"])],
        "else",
        [],
        [helper.make_tensor_value_info("n", F, None)],
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="projection"),
            helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", F, [2, 32]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", F, [2, 32])],
        [weight],
    )
    path = tmp_path / "branch.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    run = optimize(path, tmp_path)
    assert "feed no graph output" not in run.stderr
    assert "projection" in {node.name for node in onnx.load(str(run.output)).graph.node}
    feeds = random_feeds(path) | {"c": np.array(True)}
    np.testing.assert_array_equal(run_model(run.output, feeds)[0], run_model(path, feeds)[0])


def test_the_report_keeps_the_inputs_checker_warning(tmp_path: Path) -> None:
    """What stderr says about the input is in the report's warnings too."""
    norm = helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y"], name="rms")
    scale = helper.make_tensor("s", F, [2], [1.0, 2.0])
    graph = helper.make_graph(
        [norm],
        "g",
        [helper.make_tensor_value_info("x", F, [1, 2])],
        [helper.make_tensor_value_info("y", F, [1, 2])],
        [scale],
    )
    path = tmp_path / "rms.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    run = optimize(path, tmp_path)
    said = "onnx.checker rejects it (onnxruntime loads it)"
    assert said in run.stderr
    assert any(said in warning for warning in run.report["warnings"])
