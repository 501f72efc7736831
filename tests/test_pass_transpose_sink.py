"""Transpose(T(a) + T(b), inverse) is a + b (TransposePushCanonicalizationPass: ConvNeXt's
residual between its channels-last blocks, a block built with onnx.helper the way its exports
spell it), and Transpose(Concat(T(a), T(b)), inverse) is a Concat of a and b on the axis T moved
(TransposeSinkFusionPass); the Transposes both must leave, and numerics on onnxruntime.
Dynamo's slice assignment, which leaves such a Concat, is in test_pass_slice_assign."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.pass_helpers import (
    compare_on_feeds,
    optimize_checked,
    pattern_counts,
    save_model,
    value,
)

SINK = "TransposeSinkFusionPass"
PUSH = "TransposePushCanonicalizationPass"
CHANNELS_FIRST, CHANNELS_LAST = [0, 3, 1, 2], [0, 2, 3, 1]


def _block(
    path: Path, perm_b: list[int], back: list[int], shared: bool = False, op: str = "Add"
) -> Path:
    """a, b channels-last [N, H, W, C]: z = Transpose(T(a) op T(b'), back) with T the
    channels-first perm, b' = b transposed by ``perm_b``, op Add or a Concat of the channels;
    ``shared`` also outputs T(a) op ..."""
    joined = {"axis": 1} if op == "Concat" else {}
    channels = 16 if op == "Concat" else 8
    nodes = [
        helper.make_node("Transpose", ["a"], ["a_first"], perm=CHANNELS_FIRST),
        helper.make_node("Transpose", ["b"], ["b_first"], perm=perm_b),
        helper.make_node(op, ["a_first", "b_first"], ["total"], **joined),
        helper.make_node("Transpose", ["total"], ["last"], perm=back),
        helper.make_node("Relu", ["last"], ["z"]),
    ]
    first = ["N", channels, 4, 4]  # both perms of the tests put the channels second
    outputs = [value("z", ["N", 4, 4, channels] if back == CHANNELS_LAST else first)]
    outputs += [value("total", first)] if shared else []
    inputs = [value("a", ["N", 4, 4, 8]), value("b", ["N", 4, 4, 8])]
    return save_model(path, nodes, inputs, outputs)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.normal(size=(2, 4, 4, 8)).astype(np.float32) for name in "ab"}


@pytest.mark.parametrize("op", ["Add", "Concat"])
def test_channels_first_residual_between_channels_last_blocks(tmp_path: Path, op: str) -> None:
    model = _block(tmp_path / "block.onnx", CHANNELS_FIRST, CHANNELS_LAST, op=op)
    run = optimize_checked(model, tmp_path, compare=False)
    if op == "Add":  # moved below the Add, the Transposes meet the one that undoes them
        assert pattern_counts(run, PUSH) == {"TransposePush": (1, 1), "TransposeCancel": (1, 1)}
    assert run.counts(SINK) == ((0, 0) if op == "Add" else (1, 1))
    assert run.op_counts()["Transpose"] == 0
    if op == "Concat":  # the channels, axis 1 channels-first, are axis 3 channels-last
        (concat,) = [n for n in onnx.load(str(run.output)).graph.node if n.op_type == "Concat"]
        assert helper.get_attribute_value(concat.attribute[0]) == 3
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize("op", ["Add", "Concat"])
@pytest.mark.parametrize(
    ("perm_b", "back", "shared"),
    [
        ([0, 3, 2, 1], CHANNELS_LAST, False),  # the operands transposed differently
        (CHANNELS_FIRST, [0, 1, 3, 2], False),  # not transposed back
        (CHANNELS_FIRST, CHANNELS_LAST, True),  # the sum read channels-first too
    ],
)
def test_other_transposes_stay(
    tmp_path: Path, perm_b: list, back: list, shared: bool, op: str
) -> None:
    model = _block(tmp_path / "other.onnx", perm_b, back, shared, op)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(SINK) == (0, 0)
    assert run.op_counts()[op] == 1
    assert run.op_counts()["Transpose"] == 3
    compare_on_feeds(model, run.output, _feeds())
