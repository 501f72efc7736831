"""ReshapeReshapeFusionPass: exporter fixtures, near misses built with onnx.helper."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import named_dim_feeds, optimize, run_model
from tests.pass_helpers import (
    assert_declined,
    const,
    fixture_path,
    optimize_checked,
    reasons,
    save_model,
    value,
)

RR = "ReshapeReshapeFusionPass"
NOT_CONSTANT = "outer target shape is not a constant"
COPIES_ZERO = "outer target shape copies a dimension (0) of the inner result"

# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py). views = four view/reshape pairs
# (one with -1 on both sides, one ending in view(x.size(0), -1)) and one chain of three.
# ---------------------------------------------------------------------------------------------

VIEWS_EXPECTED = {
    # Constant target shapes: 4 pairs + 2 for the chain of three (the second fusion sees the
    # first one's result). The Constants are initializers (ConstantFoldingPass lifts them);
    # the inner Reshapes and their targets are then dead.
    "views_torchscript": (
        5,
        5,
        {},
        {"Reshape": 4, "Mul": 1, "Add": 1, "Sub": 1},
    ),
    # Dynamic batch: view(x.size(0), -1) gets a Shape/Gather/Unsqueeze/Concat target.
    "views_torchscript_dynbatch": (
        5,
        4,
        {NOT_CONSTANT: 1},
        {
            "Reshape": 5,
            "Shape": 1,
            "Gather": 1,
            "Unsqueeze": 1,
            "Concat": 1,
            "Mul": 1,
            "Add": 1,
            "Sub": 1,
        },
    ),
    # The dynamo exporter's optimizer already collapsed every chain.
    "views_dynamo": (0, 0, {}, {"Reshape": 3, "Mul": 1, "Add": 1, "Sub": 1}),
    # optimize=False: every target shape is a Concat of Constants, which ConstantFoldingPass
    # folds into a constant first; the Constants are then dead.
    "views_dynamo_noopt": (5, 5, {}, {"Reshape": 4, "Mul": 1, "Add": 1, "Sub": 1}),
}


@pytest.mark.parametrize("name", sorted(VIEWS_EXPECTED))
def test_exported_views(name: str, tmp_path: Path) -> None:
    matched, effected, near_misses, ops = VIEWS_EXPECTED[name]
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(RR) == (matched, effected)
    assert reasons(run, RR) == near_misses
    assert run.op_counts() == Counter(ops)


def test_exported_views_fusion_result_and_alias(tmp_path: Path) -> None:
    run = optimize(fixture_path("views_torchscript"), tmp_path)
    assert run.fusion_result == {
        "session_and_graph_id_0_0": {
            "graph_fusion": {
                RR: {"effect_times": "5", "match_times": "5"},
            }
        }
    }
    off = optimize(fixture_path("views_torchscript"), tmp_path, "--disable_pass", "shape_reshape")
    assert off.counts(RR) == (0, 0)
    assert off.op_counts()["Reshape"] == 9


def test_reshapes_the_fusions_make_adjacent_are_merged_after_them(tmp_path: Path) -> None:
    """GPT-BigCode (TorchScript): the attention fusion leaves the exporter's key Reshape next
    to another; ReshapeReshapeFusionPass runs again after the fusions (its switch as it is)
    and merges them, where only a second run of fusectl used to (78 -> 76 nodes; without it
    and LayoutChainFusionPass, which runs again too and would take them as a layout chain,
    the two Reshapes stay, their targets constants once ReshapeTargetCanonicalizationPass
    counts a -1 from the element count)."""
    model = fixture_path("arch/gpt_bigcode_ts17")
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    run = optimize_checked(model, tmp_path / "on", compare=False)
    assert run.counts(RR) == (3, 2)
    assert reasons(run, RR) == {"outer target shape is not a constant": 1}
    assert run.report["model"]["after"]["nodes"] == 76
    off = optimize(model, tmp_path / "off", "--disable_pass", f"{RR},LayoutChainFusionPass")
    assert off.passed(RR)["state"] == "off"
    assert off.report["model"]["after"]["nodes"] == 78
    feeds = named_dim_feeds(model, {"batch": 3, "sequence": 5})
    for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# Reshape -> Reshape built with onnx.helper: x [2,3,4] -> r1 (s1) -> y (s2).
# ---------------------------------------------------------------------------------------------


def _reshape_model(
    path: Path,
    s2: list[int] | None,
    *,
    s1: list[int] | None = (6, 4),
    x_shape: tuple[int, ...] = (2, 3, 4),
    y_shape: tuple[int, ...] = (4, 6),
    outer_attrs: dict | None = None,
    pre_nodes: tuple = (),
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    extra_initializers: tuple = (),
    opset: int = 17,
) -> Path:
    initializers = list(extra_initializers)
    if s1 is not None:
        initializers.append(const("s1", s1, np.int64))
    if s2 is not None:
        initializers.append(const("s2", s2, np.int64))
    return save_model(
        path,
        [
            *pre_nodes,
            helper.make_node("Reshape", ["x", "s1"], ["r1"], name="inner"),
            helper.make_node("Reshape", ["r1", "s2"], ["y"], name="outer", **(outer_attrs or {})),
            *extra_nodes,
        ],
        [value("x", list(x_shape)), *extra_inputs],
        [value("y", list(y_shape)), *extra_outputs],
        initializers,
        opset=opset,
    )


def _computed(target: str, dims: list[int]) -> dict:
    """`target` computed from a graph input as z * 0 + dims: known only at run time. (Shape of
    a static input, or any computation of constants alone, is folded into a constant first.)"""
    return {
        target: None,
        "pre_nodes": (
            helper.make_node("Mul", ["z", "zero"], ["offset"], name="mul"),
            helper.make_node("Add", ["offset", "base"], [target], name="add"),
        ),
        "extra_inputs": (value("z", [len(dims)], onnx.TensorProto.INT64),),
        "extra_initializers": (const("zero", 0, np.int64), const("base", dims, np.int64)),
    }


RR_FIRES = {
    "constant": {"s2": [4, 6]},
    "minus_one": {"s2": [-1, 6]},
    # The inner target shape may be anything: it does not survive.
    "inner_shape_computed": {"s2": [4, 6], **_computed("s1", [6, 4])},
    # allowzero=1 (opset 14): a 0 is a real zero-sized dimension, not a copy.
    "zero_with_allowzero": {
        "s1": [0, 4],
        "s2": [4, 0],
        "x_shape": (0, 2, 2),
        "y_shape": (4, 0),
        "outer_attrs": {"allowzero": 1},
        "opset": 14,
    },
}


@pytest.mark.parametrize("case", sorted(RR_FIRES))
def test_reshape_reshape_fires(case: str, tmp_path: Path) -> None:
    model = _reshape_model(tmp_path / f"rr_{case}.onnx", **RR_FIRES[case])
    run = optimize_checked(model, tmp_path)
    assert run.counts(RR) == (1, 1)
    assert reasons(run, RR) == {}
    ops = run.op_counts()
    assert ops["Reshape"] == 1
    (reshape,) = (n for n in onnx.load(str(run.output)).graph.node if n.op_type == "Reshape")
    assert list(reshape.input) == ["x", "s2"]
    allowzero = RR_FIRES[case].get("outer_attrs", {}).get("allowzero")
    assert [a.i for a in reshape.attribute if a.name == "allowzero"] == (
        [allowzero] if allowzero is not None else []
    )


@pytest.mark.parametrize(
    ("kwargs", "target"),
    [
        # 0 copies the inner result's 6, which x's sizes prove: [6, 4]
        ({"s2": [0, -1], "y_shape": (6, 4)}, [6, 4]),
        ({"s2": [0, -1], "y_shape": (6, 4), "outer_attrs": {"allowzero": 0}, "opset": 14}, [6, 4]),
        # named sizes: [B, S, 4] -> [B*S, 4] -> [B*S, 2, 2]: B*S is no axis of x, so -1
        ({"s1": [-1, 4], "s2": [0, 2, 2], "x_shape": ("B", "S", 4), "y_shape": ("N", 2, 2)},
         [-1, 2, 2]),
        # [B, S, 4] -> [B, S*4] -> [B, S, 2, 2]: 0 is x's own first axis
        ({"s1": [0, -1], "s2": [0, -1, 2, 2], "x_shape": ("B", "S", 4),
          "y_shape": ("B", "S", 2, 2)}, [0, 0, 2, 2]),
    ],
)  # fmt: skip
def test_reshape_reshape_copying_a_proven_dimension(
    tmp_path: Path, kwargs: dict, target: list[int]
) -> None:
    """An outer target copying a size (0) of the inner result still holds on x where the
    pair's layout proves which size that is: one Reshape to the proven target."""
    model = _reshape_model(tmp_path / "rr_zero.onnx", **kwargs)
    run = optimize_checked(model, tmp_path)
    assert run.counts(RR) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (reshape,) = (n for n in graph.node if n.op_type == "Reshape")
    (shape,) = (t for t in graph.initializer if t.name == reshape.input[1])
    assert reshape.input[0] == "x"
    assert onnx.numpy_helper.to_array(shape).tolist() == target


RR_DECLINES = {
    # the inner target is known only at run time: which size the 0 copies is not proven
    "zero_of_a_computed_inner": ({"s2": [0, -1], **_computed("s1", [6, 4])}, COPIES_ZERO),
    "shape_computed": (
        _computed("s2", [4, 6]),
        NOT_CONSTANT,
    ),
    "shape_overridable": (
        {"s2": [4, 6], "extra_inputs": (value("s2", [2], onnx.TensorProto.INT64),)},
        NOT_CONSTANT,
    ),
    "inner_is_graph_output": (
        {"s2": [4, 6], "extra_outputs": (value("r1", [6, 4]),)},
        "an intermediate value (Reshape output) is a graph output",
    ),
    "inner_shared": (
        {
            "s2": [4, 6],
            "extra_nodes": (helper.make_node("Relu", ["r1"], ["r"], name="relu"),),
            "extra_outputs": (value("r", [6, 4]),),
        },
        "an intermediate value (Reshape output) is also used by Relu outside the match",
    ),
}


@pytest.mark.parametrize("case", sorted(RR_DECLINES))
def test_reshape_reshape_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = RR_DECLINES[case]
    model = _reshape_model(tmp_path / f"rr_{case}.onnx", **kwargs)
    # An overridable shape input would get random feeds; the original is run as it stands.
    run = optimize_checked(model, tmp_path, compare=case != "shape_overridable")
    assert_declined(run, RR, reason, "outer")
    assert run.op_counts()["Reshape"] == 2
    assert run.fusion_result == {
        "session_and_graph_id_0_0": {
            "graph_fusion": {RR: {"effect_times": "0", "match_times": "1"}}
        }
    }
