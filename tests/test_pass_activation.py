"""SoftmaxFusionPass: a TorchScript export, forms and near misses built with onnx.helper."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.pass_helpers import (
    assert_declined,
    const,
    fixture_path,
    lineage,
    optimize_checked,
    reasons,
    save_model,
    value,
)

SOFTMAX = "SoftmaxFusionPass"
INT64 = onnx.TensorProto.INT64


def _softmax_axes(path: Path) -> list[int]:
    return [
        next(helper.get_attribute_value(a) for a in node.attribute if a.name == "axis")
        for node in onnx.load(str(path)).graph.node
        if node.op_type == "Softmax"
    ]


def _sorted_lineage(run) -> dict[str, tuple[list[str], list[str]]]:
    """Lineage with the original names sorted: the pattern is not a chain, and the order of
    its nodes in fusectl.original_op_names is the matcher's, not the graph's."""
    return {name: (passes, sorted(names)) for name, (passes, names) in lineage(run).items()}


# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py): softmax written out by hand, stable
# and plain.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_softmax() -> Path:
    """HandSoftmax in tests/fixtures/make_fixtures.py, TorchScript, opset 17."""
    return fixture_path("hand_softmax_torchscript")


def test_exported_softmax(exported_softmax: Path, tmp_path: Path) -> None:
    run = optimize_checked(exported_softmax, tmp_path)
    assert run.counts(SOFTMAX) == (2, 2)
    assert run.passed(SOFTMAX)["patterns"] == {
        "StableSoftmax": {"matched": 1, "effected": 1},
        "Softmax": {"matched": 1, "effected": 1},
    }
    assert reasons(run, SOFTMAX) == {}
    assert run.op_counts() == Counter({"Softmax": 2})
    # TorchScript keeps the negative axis of the ReduceMax attribute, made absolute here.
    assert _softmax_axes(run.output) == [2, 1]
    assert _sorted_lineage(run) == {
        f"{SOFTMAX}//Div": ([SOFTMAX], ["/Div", "/Exp", "/ReduceMax", "/ReduceSum", "/Sub"]),
        f"{SOFTMAX}//Div_1": ([SOFTMAX], ["/Div_1", "/Exp_1", "/ReduceSum_1"]),
    }
    assert run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"] == {
        SOFTMAX: {"effect_times": "2", "match_times": "2"}
    }


# ---------------------------------------------------------------------------------------------
# Built with onnx.helper: x [2,3,4] -> [ReduceMax -> Sub ->] Exp -> ReduceSum -> Div -> y
# ---------------------------------------------------------------------------------------------


def _reduce(
    op_type: str, data: str, output: str, axes, opset: int, name: str, **attrs
) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """A Reduce* node with axes as attribute or input, as the opset wants it (ReduceSum takes
    an input from 13 on, ReduceMax from 18 on). `axes=None` reduces every axis."""
    as_input = opset >= (13 if op_type == "ReduceSum" else 18)
    if axes is None:
        return helper.make_node(op_type, [data], [output], name=name, **attrs), []
    if isinstance(axes, str):  # the name of a graph input
        return helper.make_node(op_type, [data, axes], [output], name=name, **attrs), []
    if as_input:
        axes_name = f"{name}_axes"
        node = helper.make_node(op_type, [data, axes_name], [output], name=name, **attrs)
        return node, [const(axes_name, axes, np.int64)]
    return helper.make_node(op_type, [data], [output], name=name, axes=axes, **attrs), []


def _softmax_model(
    path: Path,
    *,
    sum_axes=(-1,),
    max_axes=None,
    opset: int = 17,
    sum_attrs: dict | None = None,
    max_attrs: dict | None = None,
    x_shape: tuple = (2, 3, 4),
    y_shape: tuple | None = None,
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    check: bool = True,
) -> Path:
    """The stable form when max_axes is given, else the plain form."""
    nodes, initializers, data = [], [], "x"
    if max_axes is not None:
        node, inits = _reduce(
            "ReduceMax", "x", "peak", list(max_axes), opset, "max", **(max_attrs or {})
        )
        nodes += [node, helper.make_node("Sub", ["x", "peak"], ["shifted"], name="sub")]
        initializers += inits
        data = "shifted"
    axes = sum_axes if sum_axes is None or isinstance(sum_axes, str) else list(sum_axes)
    node, inits = _reduce("ReduceSum", "e", "total", axes, opset, "sum", **(sum_attrs or {}))
    nodes += [
        helper.make_node("Exp", [data], ["e"], name="exp"),
        node,
        helper.make_node("Div", ["e", "total"], ["y"], name="div"),
        *extra_nodes,
    ]
    initializers += inits
    return save_model(
        path,
        nodes,
        [value("x", list(x_shape)), *extra_inputs],
        [value("y", list(y_shape or x_shape)), *extra_outputs],
        initializers,
        opset=opset,
        check=check,
    )


SOFTMAX_FIRES = {
    # name: (kwargs, Softmax axis, pattern)
    "plain_last_axis": ({"sum_axes": (-1,)}, 2, "Softmax"),
    "plain_middle_axis": ({"sum_axes": (1,)}, 1, "Softmax"),
    "plain_opset11_last_axis": ({"sum_axes": (2,), "opset": 11}, 2, "Softmax"),
    "plain_opset11_negative_last_axis": ({"sum_axes": (-1,), "opset": 11}, 2, "Softmax"),
    "stable_last_axis": ({"sum_axes": (-1,), "max_axes": (2,)}, 2, "StableSoftmax"),
    "stable_first_axis_opset13": (
        {"sum_axes": (0,), "max_axes": (-3,), "opset": 13},
        0,
        "StableSoftmax",
    ),
    "stable_opset18_axes_inputs": (
        {"sum_axes": (1,), "max_axes": (1,), "opset": 18},
        1,
        "StableSoftmax",
    ),
    "stable_opset11": ({"sum_axes": (2,), "max_axes": (-1,), "opset": 11}, 2, "StableSoftmax"),
}


@pytest.mark.parametrize("case", sorted(SOFTMAX_FIRES))
def test_softmax_fires(case: str, tmp_path: Path) -> None:
    kwargs, axis, pattern = SOFTMAX_FIRES[case]
    run = optimize_checked(_softmax_model(tmp_path / f"softmax_{case}.onnx", **kwargs), tmp_path)
    assert run.counts(SOFTMAX) == (1, 1)
    assert run.passed(SOFTMAX)["patterns"][pattern] == {"matched": 1, "effected": 1}
    assert reasons(run, SOFTMAX) == {}
    assert run.op_counts() == Counter({"Softmax": 1})
    assert _softmax_axes(run.output) == [axis]
    originals = ["exp", "sum", "div"]
    if "max_axes" in kwargs:
        originals = ["max", "sub", *originals]
    assert _sorted_lineage(run) == {f"{SOFTMAX}/div": ([SOFTMAX], sorted(originals))}


SOFTMAX_DECLINES = {
    # x [4,4]: a ReduceSum without keepdims gives [4], which broadcasts along the rows.
    "keepdims_0": (
        {"sum_axes": (1,), "sum_attrs": {"keepdims": 0}, "x_shape": (4, 4)},
        "ReduceSum does not keep dims",
    ),
    "several_axes": ({"sum_axes": (1, 2)}, "ReduceSum does not reduce exactly one constant axis"),
    "every_axis": ({"sum_axes": None}, "ReduceSum does not reduce exactly one constant axis"),
    "axes_fed": (
        {"sum_axes": "axes", "extra_inputs": (value("axes", [1], INT64),)},
        "ReduceSum does not reduce exactly one constant axis",
    ),
    "opset11_not_last_axis": (
        {"sum_axes": (1,), "opset": 11},
        "below opset 13 Softmax equals this only on the last axis",
    ),
    "stable_opset12_not_last_axis": (
        {"sum_axes": (0,), "max_axes": (0,), "opset": 12},
        "below opset 13 Softmax equals this only on the last axis",
    ),
    "exp_shared": (
        {
            "extra_nodes": (helper.make_node("Neg", ["e"], ["n"], name="neg"),),
            "extra_outputs": (value("n", [2, 3, 4]),),
        },
        "an intermediate value (Exp output) is also used by Neg outside the match",
    ),
    "sum_is_graph_output": (
        {"extra_outputs": (value("total", [2, 3, 1]),)},
        "an intermediate value (ReduceSum output) is a graph output",
    ),
}


@pytest.mark.parametrize("case", sorted(SOFTMAX_DECLINES))
def test_softmax_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = SOFTMAX_DECLINES[case]
    model = _softmax_model(tmp_path / f"softmax_{case}.onnx", **kwargs)
    # Random axes would be out of range or repeated.
    run = optimize_checked(model, tmp_path, compare=case != "axes_fed")
    if "max_axes" in kwargs:
        # The stable form declines; the plain form inside it declines the same Div again, which
        # is one candidate of the pass and keeps the first reason.
        assert run.counts(SOFTMAX) == (1, 0)
        assert reasons(run, SOFTMAX) == {reason: 1}
    else:
        assert_declined(run, SOFTMAX, reason, "div")
    assert run.op_counts()["Softmax"] == 0
    assert run.op_counts()["Div"] == 1


STABLE_NEAR_MISSES = {
    "different_axes": (
        {"sum_axes": (2,), "max_axes": (1,)},
        "ReduceMax and ReduceSum use different axes",
    ),
    # x [4,4]: the ReduceMax output [4] broadcasts along the rows; ReduceSum keeps its dims.
    "max_keepdims_0": (
        {"sum_axes": (1,), "max_axes": (1,), "max_attrs": {"keepdims": 0}, "x_shape": (4, 4)},
        "ReduceMax does not keep dims",
    ),
}


@pytest.mark.parametrize("case", sorted(STABLE_NEAR_MISSES))
def test_stable_softmax_declines_keep_numerics(case: str, tmp_path: Path) -> None:
    """StableSoftmax declines; Exp/ReduceSum/Div inside it is still a softmax of the Sub
    output, which the plain rule turns into Softmax. The Div was rewritten after all, so the
    StableSoftmax decline is withdrawn: one candidate, one effect. The numbers hold."""
    kwargs, _ = STABLE_NEAR_MISSES[case]
    run = optimize_checked(_softmax_model(tmp_path / f"stable_{case}.onnx", **kwargs), tmp_path)
    assert run.counts(SOFTMAX) == (1, 1)
    assert run.passed(SOFTMAX)["patterns"] == {
        "StableSoftmax": {"matched": 0, "effected": 0},
        "Softmax": {"matched": 1, "effected": 1},
    }
    assert reasons(run, SOFTMAX) == {}
    assert run.op_counts() == Counter({"ReduceMax": 1, "Sub": 1, "Softmax": 1})


# At opset 12 the plain rule declines as well (Softmax over a middle axis), so nothing rewrites
# the Div and the StableSoftmax decline stays in the report with its own reason.
STABLE_NEAR_MISSES_OPSET12 = {
    "different_axes": {"sum_axes": (1,), "max_axes": (2,), "opset": 12},
    "max_keepdims_0": {
        "sum_axes": (0,),
        "max_axes": (1,),
        "max_attrs": {"keepdims": 0},
        "x_shape": (4, 4),
        "opset": 12,
    },
}


@pytest.mark.parametrize("case", sorted(STABLE_NEAR_MISSES_OPSET12))
def test_stable_softmax_decline_reason_kept_when_plain_declines(case: str, tmp_path: Path) -> None:
    _, reason = STABLE_NEAR_MISSES[case]
    kwargs = STABLE_NEAR_MISSES_OPSET12[case]
    run = optimize_checked(_softmax_model(tmp_path / f"stable12_{case}.onnx", **kwargs), tmp_path)
    # Both patterns decline the same Div: one candidate, reported with the first reason.
    assert run.counts(SOFTMAX) == (1, 0)
    assert run.passed(SOFTMAX)["patterns"] == {
        "StableSoftmax": {"matched": 1, "effected": 0},
        "Softmax": {"matched": 0, "effected": 0},
    }
    assert reasons(run, SOFTMAX) == {reason: 1}
    assert run.op_counts()["Softmax"] == 0


@pytest.mark.parametrize("case", sorted(STABLE_NEAR_MISSES))
def test_stable_softmax_decline_counts_one_candidate(case: str, tmp_path: Path) -> None:
    kwargs, _ = STABLE_NEAR_MISSES[case]
    run = optimize_checked(_softmax_model(tmp_path / f"stable_{case}.onnx", **kwargs), tmp_path)
    matched, effected = run.counts(SOFTMAX)
    assert matched == 1
    assert sum(reasons(run, SOFTMAX).values()) == matched - effected
