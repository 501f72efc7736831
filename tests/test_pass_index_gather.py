"""IndexGatherCanonicalizationPass: a GatherND of constant indices that picks whole slices of
the first axis is a Gather; between a Transpose and its inverse (dynamo's ``x[..., [k]]``) a
Gather on the axis indexed. Falcon's new decoder architecture under dynamo, the spellings, what
is left alone, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import FIXTURES
from tests.pass_helpers import compare_on_feeds, const, optimize_checked, save_model, value

INDEX = "IndexGatherCanonicalizationPass"


def test_falcon_new_dynamo_key_and_value_taken_by_index(tmp_path: Path) -> None:
    """``qkv[:, :, :, [-2]]`` and ``[-1]`` of both layers: four Gathers on the view's group
    axis, no GatherND or Transpose of the view left (the projection is then cut in pieces)."""
    run = optimize_checked(FIXTURES / "arch" / "falcon_new_dynamo.onnx", tmp_path)
    assert run.counts(INDEX) == (4, 4)
    ops = run.op_counts()
    assert ops["GatherND"] == 1  # the padding mask's, its indices computed at run time
    assert ops["GroupQueryAttention"] == 2


def _model(path: Path, *, perm: list[int] | None, back: list[int] | None, indices: list) -> Path:
    """x [batch, 3, 4, 5] (moved by ``perm``) GatherND'ed with constant ``indices`` (moved back
    by ``back``), then doubled."""
    nodes, data = [], "x"
    if perm is not None:
        nodes.append(helper.make_node("Transpose", ["x"], ["moved"], perm=perm))
        data = "moved"
    nodes.append(helper.make_node("GatherND", [data, "indices"], ["picked"]))
    result = "picked"
    if back is not None:
        nodes.append(helper.make_node("Transpose", ["picked"], ["back"], perm=back))
        result = "back"
    nodes.append(helper.make_node("Add", [result, result], ["out"]))
    rank = 4 + np.asarray(indices).ndim - 1 - np.asarray(indices).shape[-1]
    return save_model(
        path,
        nodes,
        [value("x", ["batch", 3, 4, 5])],
        [value("out", [None] * rank)],
        [const("indices", indices, np.int64)],
    )


def _feeds() -> dict:
    return {"x": np.random.default_rng(0).normal(size=(2, 3, 4, 5)).astype(np.float32)}


def test_indexing_one_axis_between_transposes(tmp_path: Path) -> None:
    """x[:, :, [-2, 0]]: a Gather of axis 2, both Transposes gone."""
    model = _model(
        tmp_path / "index.onnx", perm=[2, 0, 1, 3], back=[1, 2, 0, 3], indices=[[-2], [0]]
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(INDEX) == (1, 1)
    ops = run.op_counts()
    assert (ops["Gather"], ops["Transpose"], ops["GatherND"]) == (1, 0, 0)
    gather = next(n for n in onnx.load(str(run.output)).graph.node if n.op_type == "Gather")
    assert helper.get_attribute_value(gather.attribute[0]) == 2
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize(
    ("perm", "back", "transposes"),
    [(None, None, 0), ([2, 0, 1, 3], [0, 2, 1, 3], 2)],
)
def test_slices_of_the_first_axis_become_a_gather(
    tmp_path: Path, perm: list[int] | None, back: list[int] | None, transposes: int
) -> None:
    """Without a Transpose, or between two that do not undo each other: a Gather of the
    data's first axis, the Transposes kept."""
    model = _model(tmp_path / "first.onnx", perm=perm, back=back, indices=[[1], [0]])
    run = optimize_checked(model, tmp_path)
    assert run.counts(INDEX) == (1, 1)
    ops = run.op_counts()
    assert (ops["Gather"], ops["GatherND"], ops["Transpose"]) == (1, 0, transposes)
    compare_on_feeds(model, run.output, _feeds())


def test_indices_of_two_axes_are_left_alone(tmp_path: Path) -> None:
    """Indices that end in two coordinates pick single rows of a 2-D index, no slice of one
    axis: no candidate."""
    model = _model(tmp_path / "pairs.onnx", perm=None, back=None, indices=[[1, 0], [0, 2]])
    run = optimize_checked(model, tmp_path)
    assert run.counts(INDEX) == (0, 0)
    assert run.op_counts()["GatherND"] == 1
    compare_on_feeds(model, run.output, _feeds())
