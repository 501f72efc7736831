"""The shape a Loop body declares for its carried state is taken only where the body keeps it.

TorchScript declares a loop-carried input with the initial value's shape. torchvision's Mask
R-CNN pastes its masks into the image with a Loop that grows ``res = cat([res, mask])`` from an
empty ``[0, H, W]`` start, and declares the body's state ``[0, H, W]``: true of the first
iteration only. Taken on trust, the state looked empty, NoOpSliceConcatEliminationPass dropped it
from the Concat, and the Loop returned the last mask alone (100 masks became 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusectl.rewrite.shapes import ShapeOracle
from tests.conftest import optimize, run_model


def _loop_model(path: Path, *, grows: bool) -> Path:
    """A Loop carrying a [rows, 4] state: grown by one row per iteration from an empty start
    (``grows``), or kept [2, 4] with a row added to every row; the body declares the state with
    the initial value's shape, as TorchScript does."""
    rows = 0 if grows else 2
    step = (
        helper.make_node("Concat", ["state_in", "row"], ["state_out"], axis=0)
        if grows
        else helper.make_node("Add", ["state_in", "row"], ["state_out"])
    )
    body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
            helper.make_node("Expand", ["fi", "row_shape"], ["row"]),
            step,
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_in", TensorProto.FLOAT, [rows, 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [None, 4]),
        ],
        [numpy_helper.from_array(np.array([1, 4], np.int64), "row_shape")],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "start"], ["final"], body=body)],
        "loop",
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("final", TensorProto.FLOAT, [None, 4])],
        [numpy_helper.from_array(np.zeros((rows, 4), np.float32), "start")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _state_shape(model: ir.Model) -> ir.Shape | None:
    loop = next(iter(model.graph))
    body = loop.attributes["body"].as_graph()
    return ShapeOracle(model, None).shape(body.inputs[2])


@pytest.mark.parametrize("grows", [True, False])
def test_declared_state_sizes_are_kept_only_where_the_body_keeps_them(
    grows: bool, tmp_path: Path
) -> None:
    path = _loop_model(tmp_path / "loop.onnx", grows=grows)
    shape = _state_shape(ir.load(str(path)))
    assert shape is not None
    if grows:  # the rows change every iteration: not a size at all
        assert not isinstance(shape[0], int) and shape[1] == 4
    else:  # a fixed point: the body's next state has the same [2, 4]
        assert list(shape) == [2, 4]


@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_a_loop_growing_its_state_from_empty_computes_the_same(
    iterations: int, tmp_path: Path
) -> None:
    path = _loop_model(tmp_path / "loop.onnx", grows=True)
    run = optimize(path, tmp_path)
    feeds = {"n": np.array(iterations, np.int64)}
    [want], [got] = run_model(path, feeds), run_model(run.output, feeds)
    assert want.shape == (iterations, 4)
    np.testing.assert_array_equal(got, want)
    misses = run.passed("NoOpSliceConcatEliminationPass")
    assert misses["effected"] == 0  # the state is no empty operand
