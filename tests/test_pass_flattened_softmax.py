"""FlattenedSoftmaxCanonicalizationPass: a softmax that onnx's version converter wrote around a
Flatten (a model upgraded from below opset 13) is the softmax of the last axis again. Real
TorchScript exports at opset 11 upgraded to 23, hand-built Softmax / LogSoftmax / Hardmax in
the converter's spelling, the near misses it leaves, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, version_converter

from tests.pass_helpers import (
    assert_declined,
    assert_second_run_changes_nothing,
    compare_on_feeds,
    fixture_path,
    optimize_checked,
    save_model,
    value,
)

PASS = "FlattenedSoftmaxCanonicalizationPass"


def _upgraded(source: Path, tmp_path: Path, opset: int = 23) -> Path:
    """``source`` through onnx's version converter, as users upgrade a model."""
    path = tmp_path / f"{source.stem}_{opset}.onnx"
    onnx.save(version_converter.convert_version(onnx.load(str(source)), opset), str(path))
    return path


@pytest.mark.parametrize(
    ("name", "fused", "nodes"),
    [
        ("llama_tiny_eager_ts11", "GroupQueryAttentionFusionPass", 82),
        ("gptj_ts11", "MultiHeadAttentionFusionPass", 104),
        ("bloom_ts11", "QkvAttentionFusionPass", 68),
    ],
)
def test_upgraded_opset_11_exports_fuse_their_attention(
    tmp_path: Path, name: str, fused: str, nodes: int
) -> None:
    """TorchScript at opset 11 writes Softmax(scores, axis=3); upgraded to opset 23 it is
    Reshape(Softmax(Flatten(scores, 3), -1), Shape(scores)) in each of the two layers, and
    no attention fused (0/2) until the softmax was read as the last axis's again."""
    model = _upgraded(fixture_path(name), tmp_path)
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (2, 2)
    assert run.counts(fused) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    flattens = sum(node.op_type == "Flatten" for node in onnx.load(str(model)).graph.node)
    ops = run.op_counts()
    assert (ops["Flatten"], ops["Softmax"]) == (flattens - 2, 0)  # the scores' two go
    assert run.report["model"]["after"]["nodes"] == nodes


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    run = optimize_checked(_upgraded(fixture_path("gptj_ts11"), tmp_path), tmp_path)
    assert_second_run_changes_nothing(run, tmp_path, PASS)


def _converted(path: Path, op: str, axis: int, shape: list) -> Path:
    """op over x coerced to 2-D at ``axis`` as onnx's version converter writes an opset-12
    op(x, axis) at opset 13 and later where x's rank is not known to it (TorchScript's scores):
    Reshape(op(Flatten(x, axis), -1), Shape(x)); its result doubled."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Flatten", ["x"], ["rows"], axis=axis),
        helper.make_node(op, ["rows"], ["weights"], axis=-1, name="softmax"),
        helper.make_node("Reshape", ["weights", "shape"], ["y"]),
        helper.make_node("Add", ["y", "y"], ["out"]),
    ]
    return save_model(path, nodes, [value("x", shape)], [value("out", shape)], opset=23)


def _feeds(shape: list) -> dict[str, np.ndarray]:
    sizes = [3 if isinstance(size, str) else size for size in shape]
    return {"x": np.random.default_rng(0).normal(size=sizes).astype(np.float32)}


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_each_coercing_op_around_a_flatten_is_its_last_axis_op(op: str, tmp_path: Path) -> None:
    shape = ["batch", 4, 5, 6]
    model = _converted(tmp_path / f"{op}.onnx", op, 3, shape)
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    assert [n.op_type for n in graph.node] == [op, "Add"]
    assert graph.node[0].input[0] == "x"
    assert helper.get_attribute_value(graph.node[0].attribute[0]) == -1
    compare_on_feeds(model, run.output, _feeds(shape))


def test_a_softmax_over_several_axes_stays(tmp_path: Path) -> None:
    """Softmax-12 at axis 2 of a 4-D tensor normalises over the last two axes together: the
    converter's Flatten keeps both in a row, which no one-axis op computes."""
    shape = ["batch", 4, 5, 6]
    model = _converted(tmp_path / "two_axes.onnx", "Softmax", 2, shape)
    run = optimize_checked(model, tmp_path)
    reason = "the Flatten keeps more than the last axis in a row: a softmax over several axes"
    assert_declined(run, PASS, reason, "softmax")
    assert run.op_counts()["Flatten"] == 1
    compare_on_feeds(model, run.output, _feeds(shape))


def test_a_softmax_viewed_to_another_shape_stays(tmp_path: Path) -> None:
    """Flattened, normalised, then viewed to a shape of its own: no softmax of x's last axis
    gives that tensor."""
    nodes = [
        helper.make_node("Flatten", ["x"], ["rows"], axis=3),
        helper.make_node("Softmax", ["rows"], ["weights"], axis=-1, name="softmax"),
        helper.make_node("Reshape", ["weights", "target"], ["out"]),
    ]
    inputs = [value("x", [2, 4, 5, 6]), value("target", [2], onnx.TensorProto.INT64)]
    model = save_model(tmp_path / "viewed.onnx", nodes, inputs, [value("out", [None, None])])
    run = optimize_checked(model, tmp_path, compare=False)
    reason = "the softmax's result is not viewed back to the flattened tensor's shape"
    assert_declined(run, PASS, reason, "softmax")
    feeds = _feeds([2, 4, 5, 6]) | {"target": np.array([8, 30], np.int64)}
    compare_on_feeds(model, run.output, feeds)
