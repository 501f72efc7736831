"""TransposePushCanonicalizationPass: Transposes moved down past element-wise ops, pads and
reductions until they meet another Transpose.

Real exporter output (a Keras MobileNetV3-style model through tf2onnx, whose own transpose
optimizer gave up: tests/fixtures/make_keras_fixtures.py), tf2onnx's spelling of a Conv block
built with onnx.helper, the moves it must not make with the reason the report gives, and
numerics on onnxruntime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from tests.conftest import FIXTURES, assert_same_outputs
from tests.pass_helpers import (
    compare_on_feeds,
    const,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

PUSH = "TransposePushCanonicalizationPass"
FIRST, LAST = [0, 3, 1, 2], [0, 2, 3, 1]  # channels-last -> channels-first, and back


def test_keras_model_through_tf2onnx_keeps_only_what_cannot_cancel(tmp_path: Path) -> None:
    """10 Transposes: the input's, one pair per Conv. Those around the depthwise block (its
    pad, batch norm and ReLU, the squeeze-excite gate's pooling, ReLU and hard-sigmoid, read
    together by a Mul) cancel; left: the input's and three at the residual Add, whose sum a
    pooling reads without keeping its axes."""
    model = FIXTURES / "keras_mobile_blocks_tf2onnx.onnx"
    original = onnx.load(model).graph.node
    assert sum(node.op_type == "Transpose" for node in original) == 10
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PUSH) == {"TransposePush": (11, 9), "TransposeCancel": (3, 3)}
    ops = run.op_counts()
    assert ops["Transpose"] == 4
    # Next to their Convs, the batch norms' scale and shift and the pad fold into them.
    assert run.counts("ConvScaleFusionPass")[1] == 1
    assert run.counts("ConvBiasAddFusionPass")[1] == 2
    assert reasons(run, PUSH) == {
        "the reduction drops axes": 1,  # the global pooling after the residual Add
        "an operand is neither a constant nor a Transpose of the same perm": 1,
    }


def _conv_block(path: Path, tail: list[onnx.NodeProto], output: str, shape: list) -> Path:
    """tf2onnx's Conv in a channels-last graph: x [N, 8, 8, 4] -> Transpose -> Conv ->
    Transpose back -> batch norm as Mul and Add by [4] -> ``tail`` -> ``output``."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Transpose", ["x"], ["x_first"], perm=FIRST),
        helper.make_node("Conv", ["x_first", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c"], ["c_last"], perm=LAST),
        helper.make_node("Mul", ["c_last", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "shift"], ["h"]),
        *tail,
    ]
    inits = [
        const("w", rng.normal(0, 0.3, (4, 4, 3, 3))),
        const("w2", rng.normal(0, 0.3, (4, 4, 3, 3))),
        const("scale", rng.uniform(0.5, 1.5, 4)),
        const("shift", rng.normal(0, 0.5, 4)),
        const("three", np.array(3.0)),
        const("pads", np.array([0, 1, 1, 0, 0, 1, 1, 0]), np.int64),
        const("matrix", rng.normal(0, 0.3, (4, 4))),
    ]
    return save_model(
        path, nodes, [value("x", ["N", 8, 8, 4])], [value(output, shape)], initializers=inits
    )


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).normal(size=(2, 8, 8, 4)).astype(np.float32)}


def test_a_conv_block_between_transposes_loses_them(tmp_path: Path) -> None:
    """Batch norm, ReLU, a channels-last Pad, a shared value read by a residual Add: every
    Transpose but the input's goes, and the Pad, scale and shift go into the Convs."""
    tail = [
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Pad", ["r", "pads"], ["padded"]),
        helper.make_node("Transpose", ["padded"], ["p_first"], perm=FIRST),
        helper.make_node("Conv", ["p_first", "w2"], ["c2"]),
        helper.make_node("Transpose", ["c2"], ["c2_last"], perm=LAST),
        helper.make_node("Add", ["c2_last", "r"], ["sum"]),
        helper.make_node("Transpose", ["sum"], ["y"], perm=FIRST),
    ]
    model = _conv_block(tmp_path / "block.onnx", tail, "y", ["N", 4, 8, 8])
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PUSH) == {"TransposePush": (5, 5), "TransposeCancel": (1, 1)}
    ops = run.op_counts()
    assert ops["Transpose"] == 1 and ops["Pad"] == 0 and ops["Mul"] == 0
    compare_on_feeds(model, run.output, _feeds())
    again = tmp_path / "again"
    again.mkdir()
    assert optimize_checked(run.output, again).counts(PUSH) == (0, 0)


def test_transposes_that_would_only_move_stay(tmp_path: Path) -> None:
    """A Transpose that meets no other on the way (here a MatMul reads the values) is left
    where the exporter put it: moving it alone gains nothing."""
    tail = [
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "matrix"], ["y"]),
    ]
    model = _conv_block(tmp_path / "block.onnx", tail, "y", ["N", 8, 8, 4])
    run = optimize_checked(model, tmp_path)
    assert run.counts(PUSH) == (0, 0)
    assert run.op_counts()["Transpose"] == 2


def test_moves_it_must_not_make_are_near_misses(tmp_path: Path) -> None:
    # A layer norm over the channels of the channels-last value: over axis 1 once moved,
    # where the normalization fusions do not read it.
    tail = [
        helper.make_node("ReduceMean", ["h"], ["mean"], axes=[3]),
        helper.make_node("Sub", ["h", "mean"], ["centred"]),
        helper.make_node("Transpose", ["centred"], ["y"], perm=FIRST),
    ]
    model = _conv_block(tmp_path / "norm.onnx", tail, "y", ["N", 4, 8, 8])
    run = optimize_checked(model, tmp_path)
    assert run.counts(PUSH) == (1, 0)
    assert reasons(run, PUSH) == {"the reduction would no longer be over trailing axes": 1}
    # An operand computed channels-last without a Transpose (the input itself).
    tail = [
        helper.make_node("Add", ["h", "x"], ["sum"]),
        helper.make_node("Transpose", ["sum"], ["y"], perm=FIRST),
    ]
    model = _conv_block(tmp_path / "input.onnx", tail, "y", ["N", 4, 8, 8])
    run = optimize_checked(model, tmp_path)
    assert run.counts(PUSH) == (1, 0)
    assert reasons(run, PUSH) == {
        "an operand is neither a constant nor a Transpose of the same perm": 1
    }
    # A value on the way is a graph output: its channels-last form must stay.
    tail = [
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=FIRST),
    ]
    path = _conv_block(tmp_path / "output.onnx", tail, "y", ["N", 4, 8, 8])
    model = onnx.load(path)
    model.graph.output.append(value("h", ["N", 8, 8, 4]))
    onnx.save(model, path)
    run = optimize_checked(path, tmp_path)
    assert run.counts(PUSH) == (1, 0)
    assert reasons(run, PUSH) == {"a value it would move past is a graph output": 1}
    assert_same_outputs(path, run.output)


def test_transposes_that_do_not_undo_each_other_stay(tmp_path: Path) -> None:
    """Merged, two Transposes would be one another fusion may not read (a key transposed for
    MatMul's transB): a Transpose moves only to meet its inverse."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("Sigmoid", ["t"], ["s"]),
        helper.make_node("Transpose", ["s"], ["y"], perm=[0, 2, 3, 1]),
    ]
    model = save_model(
        tmp_path / "two.onnx", nodes, [value("x", [2, 3, 4, 5])], [value("y", [2, 5, 3, 4])]
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(PUSH) == (0, 0)
    assert run.op_counts()["Transpose"] == 2


def test_an_operand_transposed_for_other_readers_too_is_read_through(tmp_path: Path) -> None:
    """ConvNeXt's residual stream: T(a) is read by the next block's Conv and by the residual
    Add with T(b); the Add moves, the stream's Transpose stays for the Conv."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Transpose", ["a"], ["stream"], perm=FIRST),
        helper.make_node("Transpose", ["b"], ["block"], perm=FIRST),
        helper.make_node("Conv", ["stream", "w"], ["next"]),
        helper.make_node("Add", ["stream", "block"], ["sum"]),
        helper.make_node("Transpose", ["sum"], ["last"], perm=LAST),
        helper.make_node("Relu", ["last"], ["y"]),
    ]
    model = save_model(
        tmp_path / "stream.onnx",
        nodes,
        [value("a", ["N", 4, 4, 8]), value("b", ["N", 4, 4, 8])],
        [value("y", ["N", 4, 4, 8]), value("next", ["N", 8, 4, 4])],
        [const("w", rng.normal(0, 0.3, (8, 8, 1, 1)))],
    )
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PUSH) == {"TransposePush": (1, 1), "TransposeCancel": (1, 1)}
    assert run.op_counts()["Transpose"] == 1
    feeds = {name: rng.normal(size=(2, 4, 4, 8)).astype(np.float32) for name in "ab"}
    compare_on_feeds(model, run.output, feeds)
