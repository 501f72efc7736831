"""SplitConcatFusionPass, ZConcatv2dFusionPass and FusionVirtualOpSetSwitch: TorchScript
exports, forms and near misses built with onnx.helper."""

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

SPLIT_CONCAT = "SplitConcatFusionPass"
CONCAT = "ZConcatv2dFusionPass"
VIRTUAL = "FusionVirtualOpSetSwitch"
NO_TASK = "_no_task"


def _graph(path: Path) -> tuple[list[tuple[str, list[str], list[str]]], list[str]]:
    """(op type, inputs, outputs) per node, and the graph output names."""
    graph = onnx.load(str(path)).graph
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in graph.node]
    return nodes, [o.name for o in graph.output]


def _metadata(path: Path) -> dict[str, dict[str, str]]:
    """Node name -> metadata_props, for the nodes that have any."""
    return {
        node.name: {prop.key: prop.value for prop in node.metadata_props}
        for node in onnx.load(str(path)).graph.node
        if node.metadata_props
    }


# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py): torch.split / torch.cat written in
# PyTorch (TorchScript, opset 17, which writes no intermediate shapes).
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported() -> dict[str, Path]:
    """SplitCat, SplitCatLastAxis and BatchSplit in tests/fixtures/make_fixtures.py, x [2,4,4]."""
    return {
        name: fixture_path(f"{name}_torchscript")
        for name in ("split_cat", "split_cat_last_axis", "batch_split")
    }


def test_exported_split_cat(exported: dict[str, Path], tmp_path: Path) -> None:
    run = optimize_checked(exported["split_cat"], tmp_path)
    assert run.counts(SPLIT_CONCAT) == (1, 1)
    assert reasons(run, SPLIT_CONCAT) == {}
    assert run.passed(SPLIT_CONCAT)["sites"] == [
        {
            "pattern": "SplitConcat",
            "original_nodes": ["/Split", "/Concat"],
            "original_types": ["Split", "Concat"],
            # The Identity that replaced the pair, bypassed at once.
            "new_nodes": [f"{SPLIT_CONCAT}//Concat"],
            "graph": "0_0",
        }
    ]
    assert run.counts(CONCAT) == (0, 0)
    ops = run.op_counts()
    assert (ops["Split"], ops["Concat"], ops["Identity"]) == (0, 1, 0)
    assert run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"] == {
        SPLIT_CONCAT: {"effect_times": "1", "match_times": "1"}
    }


def test_exported_split_cat_last_axis(exported: dict[str, Path], tmp_path: Path) -> None:
    run = optimize_checked(exported["split_cat_last_axis"], tmp_path)
    assert run.counts(SPLIT_CONCAT) == (1, 1)


def test_exported_batch_split(exported: dict[str, Path], tmp_path: Path) -> None:
    run = optimize_checked(exported["batch_split"], tmp_path)
    assert run.counts(VIRTUAL) == (1, 1)


# ---------------------------------------------------------------------------------------------
# SplitConcatFusionPass: x [2,6] -> Relu -> Split -> Concat -> Neg -> y
# ---------------------------------------------------------------------------------------------


def _split_concat(
    path: Path,
    *,
    split_axis: int = 1,
    concat_axis: int = 1,
    opset: int = 17,
    sizes: list[int] | None = (2, 4),
    order: tuple[int, ...] | None = None,
    relu: bool = True,
    consumer: bool = True,
    x_shape: tuple = (2, 6),
    y_shape: tuple | None = None,
    extra_nodes: tuple = (),
    extra_outputs: tuple = (),
    value_info: tuple = (),
) -> Path:
    """Split sizes are an attribute before opset 13 and an input from 13 on; None splits in
    two equal parts (num_outputs from opset 18)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] if relu else []
    data = "r" if relu else "x"
    initializers, attrs, inputs = [], {"axis": split_axis}, [data]
    count = 2 if sizes is None else len(sizes)
    if sizes is None and opset >= 18:
        attrs["num_outputs"] = count
    elif sizes is not None and opset >= 13:
        inputs.append("sizes")
        initializers.append(const("sizes", list(sizes), np.int64))
    elif sizes is not None:
        attrs["split"] = list(sizes)
    parts = [f"part{i}" for i in range(count)]
    order = order or tuple(range(count))
    nodes += [
        helper.make_node("Split", inputs, parts, name="split", **attrs),
        helper.make_node(
            "Concat",
            [parts[i] for i in order],
            ["cat" if consumer else "y"],
            name="concat",
            axis=concat_axis,
        ),
    ]
    if consumer:
        nodes.append(helper.make_node("Neg", ["cat"], ["y"], name="neg"))
    return save_model(
        path,
        [*nodes, *extra_nodes],
        [value("x", list(x_shape))],
        [value("y", list(y_shape or x_shape)), *extra_outputs],
        initializers,
        opset=opset,
        value_info=value_info,
    )


SPLIT_CONCAT_FIRES = {
    "opset11_split_attribute": {"opset": 11},
    "opset13_split_input": {"opset": 13},
    "opset18_num_outputs": {"opset": 18, "sizes": None, "split_axis": 0, "concat_axis": 0},
    "three_parts": {"sizes": (1, 2, 3)},
    # The Split's input has a recorded rank: -1 is axis 1, as the Concat's.
    "negative_split_axis": {"split_axis": -1, "value_info": (value("r", [2, 6]),)},
    "negative_axes_recorded_shapes": {
        "split_axis": -1,
        "concat_axis": -1,
        "value_info": (value("r", [2, 6]), value("part0", [2, 2]), value("part1", [2, 4])),
    },
}


@pytest.mark.parametrize("case", sorted(SPLIT_CONCAT_FIRES))
def test_split_concat_fires(case: str, tmp_path: Path) -> None:
    model = _split_concat(tmp_path / f"{case}.onnx", **SPLIT_CONCAT_FIRES[case])
    run = optimize_checked(model, tmp_path)
    assert run.counts(SPLIT_CONCAT) == (1, 1)
    assert reasons(run, SPLIT_CONCAT) == {}
    # Nothing is left of the pair, not even an Identity.
    assert _graph(run.output) == ([("Relu", ["x"], ["r"]), ("Neg", ["r"], ["y"])], ["y"])
    (site,) = run.passed(SPLIT_CONCAT)["sites"]
    assert site["original_nodes"] == ["split", "concat"]


def test_split_concat_at_graph_output_with_recorded_type(tmp_path: Path) -> None:
    """The Relu output takes the graph output's name."""
    model = _split_concat(
        tmp_path / "at_output.onnx", consumer=False, value_info=(value("r", [2, 6]),)
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(SPLIT_CONCAT) == (1, 1)
    assert _graph(run.output) == ([("Relu", ["x"], ["y"])], ["y"])


def test_split_concat_at_graph_output_keeps_output_type(tmp_path: Path) -> None:
    model = _split_concat(tmp_path / "at_output_no_type.onnx", consumer=False)
    run = optimize_checked(model, tmp_path)
    assert _graph(run.output) == ([("Relu", ["x"], ["y"])], ["y"])


def test_split_concat_between_graph_input_and_output(tmp_path: Path) -> None:
    """An Identity stays: a graph input cannot also be the graph output."""
    model = _split_concat(tmp_path / "in_out.onnx", relu=False, consumer=False)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SPLIT_CONCAT) == (1, 1)
    assert _graph(run.output) == ([("Identity", ["x"], ["y"])], ["y"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"order": (1, 0)},
        {"sizes": (2, 2, 2), "order": (0, 1)},
        {"order": (0, 1, 1), "y_shape": (2, 10)},
    ],
    ids=["reordered", "part_left_out", "part_repeated"],
)
def test_split_concat_not_a_candidate(kwargs: dict, tmp_path: Path) -> None:
    """A Concat that does not take every Split output once, in order, is no match."""
    extra = {}
    if kwargs.get("sizes") == (2, 2, 2):
        extra = {
            "extra_nodes": (helper.make_node("Neg", ["part2"], ["n"], name="neg2"),),
            "extra_outputs": (value("n", [2, 2]),),
            "y_shape": (2, 4),
        }
    model = _split_concat(tmp_path / "no_candidate.onnx", **kwargs, **extra)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SPLIT_CONCAT) == (0, 0)
    assert run.op_counts()["Split"] == 1


SPLIT_CONCAT_DECLINES = {
    "different_axes": (
        {"split_axis": 0, "concat_axis": 1, "sizes": (1, 1), "y_shape": (1, 12)},
        "Split and Concat use different axes",
    ),
    "part_shared": (
        {
            "extra_nodes": (helper.make_node("Abs", ["part0"], ["a"], name="abs"),),
            "extra_outputs": (value("a", [2, 2]),),
        },
        "an intermediate value (Split output) is also used by Abs outside the match",
    ),
    "part_is_graph_output": (
        {"extra_outputs": (value("part1", [2, 4]),)},
        "an intermediate value (Split output) is a graph output",
    ),
}


@pytest.mark.parametrize("case", sorted(SPLIT_CONCAT_DECLINES))
def test_split_concat_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = SPLIT_CONCAT_DECLINES[case]
    run = optimize_checked(_split_concat(tmp_path / f"{case}.onnx", **kwargs), tmp_path)
    assert_declined(run, SPLIT_CONCAT, reason, "concat")
    assert run.op_counts()["Split"] == run.op_counts()["Concat"] == 1


def test_split_concat_negative_axes_unrecorded(tmp_path: Path) -> None:
    model = _split_concat(tmp_path / "negative.onnx", split_axis=-1, concat_axis=-1)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SPLIT_CONCAT) == (1, 1)


# ---------------------------------------------------------------------------------------------
# ZConcatv2dFusionPass: nested Concats on one axis -> one Concat
# ---------------------------------------------------------------------------------------------


def _concat(inputs: list[str], output: str, name: str, axis: int = 1) -> onnx.NodeProto:
    return helper.make_node("Concat", inputs, [output], name=name, axis=axis)


def _nested(
    path: Path,
    nodes: list[onnx.NodeProto],
    y_shape: tuple,
    *,
    extra_outputs: tuple = (),
    value_info: tuple = (),
) -> Path:
    """x [2,3] -> Relu -> r; the Concat nodes use x and r and end in y."""
    return save_model(
        path,
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), *nodes],
        [value("x", [2, 3])],
        [value("y", list(y_shape)), *extra_outputs],
        value_info=value_info,
    )


def test_nested_concat_flattened(tmp_path: Path) -> None:
    model = _nested(
        tmp_path / "nested.onnx",
        [_concat(["r", "x"], "inner", "inner"), _concat(["x", "inner", "r"], "y", "outer")],
        (2, 12),
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(CONCAT) == (1, 1)
    assert reasons(run, CONCAT) == {}
    assert _graph(run.output) == (
        [("Relu", ["x"], ["r"]), ("Concat", ["x", "r", "x", "r"], ["y"])],
        ["y"],
    )
    assert lineage(run) == {f"{CONCAT}/outer": ([CONCAT], ["inner", "outer"])}
    assert run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"] == {
        CONCAT: {"effect_times": "1", "match_times": "1"}
    }


def test_nested_concat_three_levels(tmp_path: Path) -> None:
    """The middle Concat absorbs the inner one, then the outer absorbs the result."""
    model = _nested(
        tmp_path / "three_levels.onnx",
        [
            _concat(["x", "r"], "c1", "c1", axis=0),
            _concat(["c1", "x"], "c2", "c2", axis=0),
            _concat(["r", "c2"], "y", "c3", axis=0),
        ],
        (8, 3),
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(CONCAT) == (2, 2)
    assert _graph(run.output) == (
        [("Relu", ["x"], ["r"]), ("Concat", ["r", "x", "r", "x"], ["y"])],
        ["y"],
    )
    assert lineage(run) == {f"{CONCAT}/c3": ([CONCAT], ["c1", "c2", "c3"])}


def test_nested_concat_one_of_two_inner_spliced(tmp_path: Path) -> None:
    """An inner Concat on the outer axis is spliced in, one on another axis stays: one effect,
    no near miss."""
    model = _nested(
        tmp_path / "two_inner.onnx",
        [
            _concat(["x", "r"], "same", "same"),
            helper.make_node("ReduceMax", ["x"], ["top"], name="max", axes=[0]),
            helper.make_node("ReduceMin", ["x"], ["bottom"], name="min", axes=[0]),
            _concat(["top", "bottom"], "other", "other", axis=0),
            _concat(["same", "other"], "y", "outer"),
        ],
        (2, 9),
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(CONCAT) == (1, 1)
    assert reasons(run, CONCAT) == {}
    nodes, _ = _graph(run.output)
    assert nodes[-1] == ("Concat", ["x", "r", "other"], ["y"])
    assert run.op_counts() == Counter({"Relu": 1, "ReduceMax": 1, "ReduceMin": 1, "Concat": 2})
    assert lineage(run) == {f"{CONCAT}/outer": ([CONCAT], ["same", "outer"])}


CONCAT_DECLINES = {
    "inner_other_axis": (
        [
            _concat(["x", "r"], "inner", "inner", axis=0),
            _concat(["inner", "inner2"], "y", "outer"),
        ],
        (4, 6),
        {},
        "inner Concat uses another axis",
    ),
    "inner_shared": (
        [
            _concat(["x", "r"], "inner", "inner"),
            _concat(["inner", "x"], "y", "outer"),
            helper.make_node("Abs", ["inner"], ["a"], name="abs"),
        ],
        (2, 9),
        {"extra_outputs": (value("a", [2, 6]),)},
        "inner Concat output has other consumers",
    ),
    "inner_twice": (
        [_concat(["x", "r"], "inner", "inner"), _concat(["inner", "inner"], "y", "outer")],
        (2, 12),
        {},
        "inner Concat output has other consumers",
    ),
    "inner_is_graph_output": (
        [_concat(["x", "r"], "inner", "inner"), _concat(["inner", "x"], "y", "outer")],
        (2, 9),
        {"extra_outputs": (value("inner", [2, 6]),)},
        "inner Concat output is a graph output",
    ),
}


@pytest.mark.parametrize("case", sorted(CONCAT_DECLINES))
def test_nested_concat_declines(case: str, tmp_path: Path) -> None:
    nodes, y_shape, kwargs, reason = CONCAT_DECLINES[case]
    if case == "inner_other_axis":  # a second inner Concat, not a copy (CSE would merge it)
        nodes = [_concat(["r", "x"], "inner2", "inner2", axis=0), *nodes]
    run = optimize_checked(_nested(tmp_path / f"{case}.onnx", nodes, y_shape, **kwargs), tmp_path)
    assert_declined(run, CONCAT, reason, "outer")
    assert run.op_counts()["Concat"] == len([n for n in nodes if n.op_type == "Concat"])


def test_nested_concat_negative_axes_unrecorded(tmp_path: Path) -> None:
    model = _nested(
        tmp_path / "negative.onnx",
        [
            _concat(["r", "r"], "inner", "inner", axis=-1),
            _concat(["inner", "r"], "y", "outer", axis=-1),
        ],
        (2, 9),
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(CONCAT) == (1, 1)


# ---------------------------------------------------------------------------------------------
# FusionVirtualOpSetSwitch: x -> Split -> Exp per part -> y0, y1
# ---------------------------------------------------------------------------------------------


def _split(
    path: Path,
    *,
    x_shape: tuple = (4, 3),
    axis: int = 0,
    source: str = "x",
    pre_nodes: tuple = (),
    initializers: tuple = (),
    consumers: tuple[str, str] = ("Exp", "Exp"),
    part_outputs: bool = False,
    metadata: dict[str, dict[str, str]] | None = None,
    extra_nodes: tuple = (),
    extra_outputs: tuple | None = None,
    value_info: tuple = (),
    shape: tuple | None = None,
) -> Path:
    """Split in two equal parts along `axis` (num_outputs, opset 18)."""
    shape = shape or x_shape
    part = [d // 2 if i == axis % len(shape) else d for i, d in enumerate(shape)]
    nodes = [
        *pre_nodes,
        helper.make_node("Split", [source], ["p0", "p1"], name="split", axis=axis, num_outputs=2),
        *(
            helper.make_node(op, [f"p{i}"], [f"y{i}"], name=f"consumer{i}")
            for i, op in enumerate(consumers)
        ),
        *extra_nodes,
    ]
    for node in nodes:
        for key, text in (metadata or {}).get(node.name, {}).items():
            node.metadata_props.add(key=key, value=text)
    outputs = [value(f"y{i}", part) for i in range(len(consumers))]
    if part_outputs:
        outputs.append(value("p1", part))
    return save_model(
        path,
        nodes,
        [value("x", list(x_shape))],
        outputs + list(extra_outputs or ()),
        initializers,
        opset=18,
        value_info=value_info,
    )


VIRTUAL_FIRES = {
    "batch_axis": {},
    "negative_batch_axis": {"axis": -2},
    "channels_with_batch_1": {"x_shape": (1, 4, 3), "axis": 1},
    "recorded_intermediate": {
        "pre_nodes": (helper.make_node("Relu", ["x"], ["r"], name="relu"),),
        "source": "r",
        "value_info": (value("r", [4, 3]),),
    },
}


@pytest.mark.parametrize("case", sorted(VIRTUAL_FIRES))
def test_virtual_split_marked(case: str, tmp_path: Path) -> None:
    model = _split(tmp_path / f"{case}.onnx", **VIRTUAL_FIRES[case])
    run = optimize_checked(model, tmp_path)
    assert run.counts(VIRTUAL) == (1, 1)
    assert reasons(run, VIRTUAL) == {}
    assert _metadata(run.output) == {"split": {NO_TASK: "1"}}
    assert run.op_counts()["Split"] == 1
    # Metadata only: never in fusion_result.json.
    assert VIRTUAL not in run.fusion_result_path.read_text()
    (site,) = run.passed(VIRTUAL)["sites"]
    assert site["original_nodes"] == ["split"]


def test_virtual_split_second_run_changes_nothing(tmp_path: Path) -> None:
    first = optimize_checked(_split(tmp_path / "twice.onnx"), tmp_path)
    again = optimize_checked(first.output, tmp_path)
    assert again.counts(VIRTUAL) == (0, 0)
    assert reasons(again, VIRTUAL) == {}
    assert _metadata(again.output) == _metadata(first.output) == {"split": {NO_TASK: "1"}}
    assert _graph(again.output) == _graph(first.output)


def test_virtual_split_on_target_onnx(tmp_path: Path) -> None:
    """It emits no operator, so --target onnx keeps it."""
    run = optimize_checked(_split(tmp_path / "target_onnx.onnx"), tmp_path, "--target", "onnx")
    assert run.passed(VIRTUAL)["state"] == "on"
    assert run.counts(VIRTUAL) == (1, 1)


VIRTUAL_DECLINES = {
    "dynamic_shape": ({"x_shape": ("N", 3), "shape": (4, 3)}, "dynamic shape"),
    "channels_with_batch_2": (
        {"x_shape": (2, 4, 3), "axis": 1},
        "split axis is neither the batch axis nor channels with batch 1",
    ),
    "last_axis": (
        {"x_shape": (4, 6), "axis": 1},
        "split axis is neither the batch axis nor channels with batch 1",
    ),
    "initializer": (
        {"source": "c", "initializers": (const("c", np.ones((4, 3))),)},
        "the input is a constant",
    ),
    "constant_node": (
        {
            "source": "c",
            "pre_nodes": (
                helper.make_node(
                    "Constant",
                    [],
                    ["c"],
                    name="constant",
                    value=onnx.numpy_helper.from_array(np.ones((4, 3), np.float32)),
                ),
            ),
            "value_info": (value("c", [4, 3]),),
        },
        "the input is a constant",
    ),
    "graph_input_reshape": (
        {
            "x_shape": (12,),
            "shape": (4, 3),
            "source": "reshaped",
            "pre_nodes": (
                helper.make_node("Reshape", ["x", "target"], ["reshaped"], name="reshape"),
            ),
            "initializers": (const("target", [4, 3], np.int64),),
            "value_info": (value("reshaped", [4, 3]),),
        },
        "graph input -> Reshape -> Split",
    ),
    "part_is_graph_output": ({"part_outputs": True}, "an output is a graph output"),
    # A Split marked by an earlier run feeds this one.
    "producer_marked": (
        {
            "source": "q0",
            "pre_nodes": (
                helper.make_node("Split", ["x"], ["q0", "q1"], name="first", axis=0, num_outputs=2),
            ),
            "x_shape": (8, 3),
            "shape": (4, 3),
            "extra_nodes": (helper.make_node("Exp", ["q1"], ["z"], name="exp_q1"),),
            "extra_outputs": (value("z", [4, 3]),),
            "value_info": (value("q0", [4, 3]),),
            "metadata": {"first": {NO_TASK: "1"}},
        },
        "the input's producer is already _no_task",
    ),
    "consumer_marked": (
        {"metadata": {"consumer1": {NO_TASK: "1"}}},
        "an output feeds a _no_task node",
    ),
}


# A Split of a constant is folded by ConstantFoldingPass before FusionVirtualOpSetSwitch
# runs; the switch only sees one when folding is off.
CONSTANT_SOURCES = ("constant_node", "initializer")


@pytest.mark.parametrize("case", sorted(VIRTUAL_DECLINES))
def test_virtual_split_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = VIRTUAL_DECLINES[case]
    model = _split(tmp_path / f"{case}.onnx", **kwargs)
    args = ("--disable_pass", "ConstantFoldingPass") if case in CONSTANT_SOURCES else ()
    # Random inputs give the symbolic batch the size 2: split in two, the parts differ from
    # the declared output shapes, which onnxruntime does not mind.
    run = optimize_checked(model, tmp_path, *args)
    assert_declined(run, VIRTUAL, reason, "split")
    assert NO_TASK not in _metadata(run.output).get("split", {})


@pytest.mark.parametrize("case", CONSTANT_SOURCES)
def test_virtual_split_of_constant_folded(case: str, tmp_path: Path) -> None:
    kwargs, _ = VIRTUAL_DECLINES[case]
    run = optimize_checked(_split(tmp_path / f"{case}_folded.onnx", **kwargs), tmp_path)
    assert run.passed("ConstantFoldingPass")["patterns"] == {"Split": {"matched": 1, "effected": 1}}
    assert run.counts(VIRTUAL) == (0, 0)
    assert reasons(run, VIRTUAL) == {}
    assert run.op_counts() == Counter({"Exp": 2})
    assert run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"] == {
        "ConstantFoldingPass": {"effect_times": "1", "match_times": "1"}
    }


def test_virtual_split_feeding_split(tmp_path: Path) -> None:
    """The outer Split feeds a Split; the inner one splits the last axis of a batch-2 part."""
    model = _split(
        tmp_path / "split_split.onnx",
        x_shape=(4, 4),
        consumers=("Exp",),
        extra_nodes=(
            helper.make_node("Split", ["p1"], ["s0", "s1"], name="inner", axis=1, num_outputs=2),
            helper.make_node("Exp", ["s0"], ["z0"], name="exp_s0"),
            helper.make_node("Exp", ["s1"], ["z1"], name="exp_s1"),
        ),
        extra_outputs=(value("z0", [2, 2]), value("z1", [2, 2])),
        value_info=(value("p1", [2, 4]),),
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(VIRTUAL) == (2, 0)
    assert reasons(run, VIRTUAL) == {
        "an output feeds another Split": 1,
        "split axis is neither the batch axis nor channels with batch 1": 1,
    }
    assert _metadata(run.output) == {}


def test_virtual_split_unrecorded_intermediate(tmp_path: Path) -> None:
    model = _split(
        tmp_path / "unrecorded.onnx",
        pre_nodes=(helper.make_node("Relu", ["x"], ["r"], name="relu"),),
        source="r",
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(VIRTUAL) == (1, 1)
