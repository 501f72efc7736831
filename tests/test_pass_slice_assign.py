"""SliceAssignmentCanonicalizationPass: a slice assignment t[..., a:b] = y (ScatterND with an
index grid computed from shapes) becomes the Concat it is. Tiny PyTorch modules under both
exporters (tests/fixtures/make_slice_assign_fixtures.py) and DeepSeek-V3's key, whose attention
fuses once it is a Concat; the grids it must leave, with their reasons; outputs on
onnxruntime, bit for bit, at sizes other than the export's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.conftest import FIXTURES, run_model
from tests.pass_helpers import (
    ARCH_FIXTURES,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

ASSIGN = "SliceAssignmentCanonicalizationPass"
NOT_A_RANGE = "the indices are not every position of one constant range of one axis"
COMPUTED = (
    "the tensor assigned into is computed and keeps a part beside the range: a Slice of it "
    "each side is no fewer nodes than the ScatterND"
)

# fixture: (assignments, op counts after); feeds at other sizes than the export's (2, 3, 5, 8)
FILLS = {
    "fill_parts_ts17": (2, {"Expand": 1, "Concat": 1, "Mul": 1}),
    "fill_parts_dynamo": (2, {"Expand": 1, "Concat": 1, "Mul": 1}),
}


def _feeds(name: str, batch: int, sequence: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    shapes = {
        "fill_parts": {"a": (batch, 3, sequence, 3), "b": (batch, 1, sequence, 5)},
        "fill_middle": {"x": (batch, 3, 5, 8), "rows": (batch, 3, 2, 8)},
        "fill_strided": {"x": (batch, 3, sequence, 8), "half": (batch, 3, sequence, 4)},
    }[name.rsplit("_", 1)[0]]
    return {key: rng.normal(size=shape).astype(np.float32) for key, shape in shapes.items()}


def _same_bits(original: Path, optimized: Path, name: str) -> None:
    for batch, sequence in ((1, 7), (4, 2)):
        feeds = _feeds(name, batch, sequence)
        for want, got in zip(run_model(original, feeds), run_model(optimized, feeds), strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", sorted(FILLS))
def test_assignments_become_concat(tmp_path: Path, name: str) -> None:
    """Every ScatterND goes; a tensor made to be filled and filled completely keeps nothing
    of what it started as (no Slice, no ConstantOfShape), and dynamo's moved axis goes with it
    (TransposeSink)."""
    count, ops = FILLS[name]
    model = FIXTURES / f"{name}.onnx"
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, ASSIGN) == {"SliceAssignment": (count, count)}
    assert dict(run.op_counts()) == ops
    _same_bits(model, run.output, name)


# fixture: the reason its ScatterND stays. fill_middle: t = x.clone(); t[:, :, 1:3] = rows,
# x's rows around the range stay, so Slices of x and a Concat would be more nodes than the one
# ScatterND, and no fusion reads them. fill_strided: t[..., ::2] = y writes no range.
NEAR_MISSES = {"fill_middle": COMPUTED, "fill_strided": NOT_A_RANGE}


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
@pytest.mark.parametrize("fixture", sorted(NEAR_MISSES))
def test_assignments_that_stay(tmp_path: Path, fixture: str, exporter: str) -> None:
    """A near-miss with its reason, the ScatterND kept, the outputs as they were."""
    name = f"{fixture}_{exporter}"
    model = FIXTURES / f"{name}.onnx"
    run = optimize_checked(model, tmp_path)
    assert reasons(run, ASSIGN) == {NEAR_MISSES[fixture]: 1}
    assert run.op_counts()["ScatterND"] == 1
    _same_bits(model, run.output, name)


def test_indices_read_from_an_input_stay(tmp_path: Path) -> None:
    """Indices that are data, not shapes, cannot be evaluated before run time."""
    nodes = [helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"])]
    inputs = [
        value("data", [4, 3]),
        value("indices", [2, 1], TensorProto.INT64),
        value("updates", [2, 3]),
    ]
    model = save_model(tmp_path / "data.onnx", nodes, inputs, [value("y", [4, 3])])
    run = optimize_checked(model, tmp_path)
    assert reasons(run, ASSIGN) == {
        "the indices cannot be evaluated: indices is not computed before it is read": 1
    }


def test_a_grid_from_a_negative_index_stays(tmp_path: Path) -> None:
    """Rows -1 and 0 of a [4, 3] tensor step by one, but -1 is the last row: the rows written
    are 3 and 0, no range (found by fuzzing DeepSeek-V3's key grid: its Range started at -1)."""
    nodes = [helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"])]
    indices = helper.make_tensor("indices", TensorProto.INT64, [2, 1], [-1, 0])
    inputs = [value("data", [4, 3]), value("updates", [2, 3])]
    model = save_model(tmp_path / "wrapped.onnx", nodes, inputs, [value("y", [4, 3])], [indices])
    run = optimize_checked(model, tmp_path)
    assert reasons(run, ASSIGN) == {NOT_A_RANGE: 1}
    rng = np.random.default_rng(0)
    feeds = {"data": rng.normal(size=(4, 3)), "updates": rng.normal(size=(2, 3))}
    feeds = {key: array.astype(np.float32) for key, array in feeds.items()}
    np.testing.assert_array_equal(run_model(run.output, feeds)[0], run_model(model, feeds)[0])


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_deepseek_key_becomes_concat_and_attention_fuses(tmp_path: Path, exporter: str) -> None:
    """DeepSeek-V3 fills its key as new_empty + two copy_ per layer. As a Concat of the two
    parts its attention is what MultiHeadAttention computes, under TorchScript too."""
    run = optimize_checked(ARCH_FIXTURES / f"deepseek_v3_{exporter}.onnx", tmp_path)
    assert pattern_counts(run, ASSIGN) == {"SliceAssignment": (4, 4)}
    counts = run.op_counts()
    assert (counts["MultiHeadAttention"], counts["ScatterND"]) == (2, 0)
    assert run.report["coverage"]["attention"]["fused"] == 2
