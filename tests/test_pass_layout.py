"""TransposeTransposeFusionPass, SqueezeUnsqueezeFusionPass, CastCastFusionPass and
IdentityEliminationPass: a TorchScript export, forms and near misses built with onnx.helper."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import optimize, run_model
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

TRANSPOSE = "TransposeTransposeFusionPass"
SQUEEZE = "SqueezeUnsqueezeFusionPass"
CAST = "CastCastFusionPass"
IDENTITY = "IdentityEliminationPass"
FOLD = "ConstantFoldingPass"

F, F16, D = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE
I32, I64, U8, B = TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8, TensorProto.BOOL


def _graph(path: Path) -> tuple[list[tuple[str, list[str], list[str]]], list[str]]:
    """(op type, inputs, outputs) per node, and the graph output names."""
    graph = onnx.load(str(path)).graph
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in graph.node]
    return nodes, [o.name for o in graph.output]


def _attribute(path: Path, op_type: str, name: str):
    (node,) = (n for n in onnx.load(str(path)).graph.node if n.op_type == op_type)
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py): unsqueeze/squeeze and dtype round
# trips written in PyTorch.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_layout() -> Path:
    """Layout in tests/fixtures/make_fixtures.py, TorchScript, opset 17, x [2,4,4]."""
    return fixture_path("layout_torchscript")


def test_exported_layout(exported_layout: Path, tmp_path: Path) -> None:
    run = optimize_checked(exported_layout, tmp_path)
    # unsqueeze(1).squeeze(1) goes away entirely.
    assert run.counts(SQUEEZE) == (1, 1)
    assert run.passed(SQUEEZE)["patterns"]["UnsqueezeSqueeze"] == {"matched": 1, "effected": 1}
    # float->half->float declines; in half->double->float the double loses nothing, so that
    # becomes one half->float Cast, which then meets the lossy float->half Cast before it.
    assert run.counts(CAST) == (4, 1)
    assert reasons(run, CAST) == {"casting FLOAT to FLOAT16 loses values": 3}
    assert run.counts(TRANSPOSE) == run.counts(IDENTITY) == (0, 0)
    ops = run.op_counts()
    assert (ops["Unsqueeze"], ops["Squeeze"], ops["Cast"]) == (0, 0, 4)
    assert lineage(run) == {f"{CAST}//Cast_4": ([CAST], ["/Cast_3", "/Cast_4"])}


# ---------------------------------------------------------------------------------------------
# TransposeTransposeFusionPass: x [2,3,4] -> Relu -> Transpose -> Transpose [-> Neg] -> y
# ---------------------------------------------------------------------------------------------


def _transposes(
    path: Path,
    perms: list[list[int] | None],
    *,
    y_shape: tuple = (2, 3, 4),
    relu: bool = True,
    consumer: bool = False,
    x_shape: tuple | None = (2, 3, 4),
    extra_nodes: tuple = (),
    extra_outputs: tuple = (),
    check: bool = True,
) -> Path:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] if relu else []
    data = "r" if relu else "x"
    for index, perm in enumerate(perms, 1):
        attrs = {} if perm is None else {"perm": perm}
        output = "y" if index == len(perms) and not consumer else f"t{index}"
        nodes.append(helper.make_node("Transpose", [data], [output], name=f"t{index}", **attrs))
        data = output
    if consumer:
        nodes.append(helper.make_node("Neg", [data], ["y"], name="neg"))
    return save_model(
        path,
        [*nodes, *extra_nodes],
        [value("x", None if x_shape is None else list(x_shape))],
        [value("y", None if y_shape is None else list(y_shape)), *extra_outputs],
        check=check,
    )


def test_transpose_pair_cancels_at_graph_output(tmp_path: Path) -> None:
    """Nothing is left, not even an Identity; the Relu output takes the graph output's name."""
    model = _transposes(tmp_path / "cancel.onnx", [[1, 0, 2], [1, 0, 2]])
    run = optimize_checked(model, tmp_path)
    assert run.counts(TRANSPOSE) == (1, 1)
    assert _graph(run.output) == ([("Relu", ["x"], ["y"])], ["y"])
    assert lineage(run) == {}


@pytest.mark.parametrize(
    "perms",
    [[[1, 0, 2], [1, 0, 2]], [None, None], [[2, 0, 1], [1, 2, 0]], [None, [2, 1, 0]]],
    ids=["swap_swap", "default_default", "rotate_back", "default_explicit"],
)
def test_transpose_pair_cancels_before_consumer(perms, tmp_path: Path) -> None:
    model = _transposes(tmp_path / "cancel_consumer.onnx", perms, consumer=True)
    run = optimize_checked(model, tmp_path)
    assert run.counts(TRANSPOSE) == (1, 1)
    assert reasons(run, TRANSPOSE) == {}
    assert _graph(run.output) == ([("Relu", ["x"], ["r"]), ("Neg", ["r"], ["y"])], ["y"])


@pytest.mark.parametrize(
    ("perms", "combined", "y_shape"),
    [
        ([[1, 0, 2], [0, 2, 1]], [1, 2, 0], (3, 4, 2)),
        ([None, [1, 0, 2]], [1, 2, 0], (3, 4, 2)),
        ([[2, 0, 1], None], [1, 0, 2], (3, 2, 4)),
    ],
    ids=["explicit", "default_inner", "default_outer"],
)
def test_transpose_pair_composes(perms, combined, y_shape, tmp_path: Path) -> None:
    model = _transposes(tmp_path / "compose.onnx", perms, y_shape=y_shape)
    run = optimize_checked(model, tmp_path)
    assert run.counts(TRANSPOSE) == (1, 1)
    assert run.op_counts() == Counter({"Relu": 1, "Transpose": 1})
    assert list(_attribute(run.output, "Transpose", "perm")) == combined
    assert lineage(run) == {f"{TRANSPOSE}/t2": ([TRANSPOSE], ["t1", "t2"])}


def test_transpose_chain_of_three(tmp_path: Path) -> None:
    """The first pair becomes one Transpose, which then pairs with the third."""
    model = _transposes(
        tmp_path / "three.onnx", [[1, 0, 2], [0, 2, 1], [2, 1, 0]], y_shape=(2, 4, 3)
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(TRANSPOSE) == (2, 2)
    assert run.op_counts() == Counter({"Relu": 1, "Transpose": 1})
    assert list(_attribute(run.output, "Transpose", "perm")) == [0, 2, 1]
    ((passes, names),) = lineage(run).values()
    assert (passes, names) == ([TRANSPOSE], ["t1", "t2", "t3"])


def test_transpose_pair_between_graph_input_and_output(tmp_path: Path) -> None:
    """The Identity that replaces the pair stays: a graph input cannot be a graph output."""
    model = _transposes(tmp_path / "in_out.onnx", [[1, 0, 2], [1, 0, 2]], relu=False)
    run = optimize_checked(model, tmp_path)
    assert run.counts(TRANSPOSE) == (1, 1)
    assert _graph(run.output) == ([("Identity", ["x"], ["y"])], ["y"])


TRANSPOSE_DECLINES = {
    # A graph input of unknown rank (valid ONNX; the full checker wants output shapes).
    "no_perm_rank_unknown": (
        {
            "perms": [None, [1, 0, 2]],
            "relu": False,
            "x_shape": None,
            "y_shape": None,
            "check": False,
        },
        "a Transpose has no perm and the input rank is unknown",
    ),
    "inner_shared": (
        {
            "perms": [[1, 0, 2], [1, 0, 2]],
            "extra_nodes": (helper.make_node("Neg", ["t1"], ["n"], name="neg"),),
            "extra_outputs": (value("n", [3, 2, 4]),),
        },
        "an intermediate value (Transpose output) is also used by Neg outside the match",
    ),
    "inner_is_graph_output": (
        {"perms": [[1, 0, 2], [1, 0, 2]], "extra_outputs": (value("t1", [3, 2, 4]),)},
        "an intermediate value (Transpose output) is a graph output",
    ),
}


@pytest.mark.parametrize("case", sorted(TRANSPOSE_DECLINES))
def test_transpose_pair_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = TRANSPOSE_DECLINES[case]
    model = _transposes(tmp_path / f"transpose_{case}.onnx", **kwargs)
    valid = kwargs.get("check", True)
    run = optimize_checked(model, tmp_path) if valid else optimize(model, tmp_path)
    assert_declined(run, TRANSPOSE, reason, "t2")
    assert run.op_counts()["Transpose"] == 2


# ---------------------------------------------------------------------------------------------
# SqueezeUnsqueezeFusionPass: x -> Relu -> Squeeze/Unsqueeze -> Unsqueeze/Squeeze -> Neg -> y
# ---------------------------------------------------------------------------------------------


def _squeeze_pair(
    path: Path,
    first: str,
    first_axes,
    second_axes,
    *,
    opset: int = 17,
    x_shape: tuple | None = (2, 1, 4),
    y_shape: tuple | None = None,
    relu: bool = True,
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    check: bool = True,
) -> Path:
    """Axes are attributes before opset 13 and inputs from 13 on; None leaves them out, a
    string names a graph input that feeds them."""
    second = "Unsqueeze" if first == "Squeeze" else "Squeeze"
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] if relu else []
    initializers = []
    data = "r" if relu else "x"
    for op_type, axes, output, name in (
        (first, first_axes, "mid", "first"),
        (second, second_axes, "out", "second"),
    ):
        inputs, attrs = [data], {}
        if isinstance(axes, str):
            inputs.append(axes)
        elif axes is not None and opset >= 13:
            inputs.append(f"{name}_axes")
            initializers.append(const(f"{name}_axes", axes, np.int64))
        elif axes is not None:
            attrs["axes"] = axes
        nodes.append(helper.make_node(op_type, inputs, [output], name=name, **attrs))
        data = output
    nodes.append(helper.make_node("Neg", ["out"], ["y"], name="neg"))
    shape = y_shape if y_shape is not None else x_shape
    return save_model(
        path,
        [*nodes, *extra_nodes],
        [value("x", None if x_shape is None else list(x_shape)), *extra_inputs],
        [value("y", None if shape is None else list(shape)), *extra_outputs],
        initializers,
        opset=opset,
        check=check,
    )


SQUEEZE_FIRES = {
    "squeeze_unsqueeze_opset11": ("Squeeze", [1], [1], {"opset": 11}),
    "squeeze_unsqueeze_opset17": ("Squeeze", [1], [1], {}),
    "squeeze_unsqueeze_negative": ("Squeeze", [-2], [1], {}),
    "unsqueeze_squeeze_opset11": ("Unsqueeze", [0, 3], [3, 0], {"opset": 11}),
    "unsqueeze_squeeze_opset17": ("Unsqueeze", [2], [2], {}),
    # Both index the 4-D tensor between them: -1 is 3.
    "unsqueeze_squeeze_negative": ("Unsqueeze", [-1], [3], {}),
}


@pytest.mark.parametrize("case", sorted(SQUEEZE_FIRES))
def test_squeeze_pair_fires(case: str, tmp_path: Path) -> None:
    first, first_axes, second_axes, kwargs = SQUEEZE_FIRES[case]
    model = _squeeze_pair(tmp_path / f"{case}.onnx", first, first_axes, second_axes, **kwargs)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SQUEEZE) == (1, 1)
    pattern = "SqueezeUnsqueeze" if first == "Squeeze" else "UnsqueezeSqueeze"
    assert run.passed(SQUEEZE)["patterns"][pattern] == {"matched": 1, "effected": 1}
    assert reasons(run, SQUEEZE) == {}
    assert _graph(run.output) == ([("Relu", ["x"], ["r"]), ("Neg", ["r"], ["y"])], ["y"])


SQUEEZE_DECLINES = {
    "different_axes": (
        ("Squeeze", [1], [2]),
        {"y_shape": (2, 4, 1)},
        "Squeeze and Unsqueeze use different axes",
    ),
    "squeeze_without_axes": (
        ("Squeeze", None, [1]),
        {},
        "axes are not constant (or Squeeze has none)",
    ),
    "axes_fed": (
        ("Unsqueeze", "axes", [1]),
        {"extra_inputs": (value("axes", [1], TensorProto.INT64),), "x_shape": (2, 4)},
        "axes are not constant (or Squeeze has none)",
    ),
    # A graph input of unknown rank (valid ONNX; the full checker wants output shapes).
    "negative_axes_rank_unknown": (
        ("Squeeze", [-2], [-2]),
        {"x_shape": None, "relu": False, "check": False},
        "negative axes and the rank is unknown",
    ),
    "inner_shared": (
        ("Squeeze", [1], [1]),
        {
            "extra_nodes": (helper.make_node("Abs", ["mid"], ["a"], name="abs"),),
            "extra_outputs": (value("a", [2, 4]),),
        },
        "an intermediate value (Squeeze output) is also used by Abs outside the match",
    ),
}


@pytest.mark.parametrize("case", sorted(SQUEEZE_DECLINES))
def test_squeeze_pair_declines(case: str, tmp_path: Path) -> None:
    (first, first_axes, second_axes), kwargs, reason = SQUEEZE_DECLINES[case]
    model = _squeeze_pair(tmp_path / f"{case}.onnx", first, first_axes, second_axes, **kwargs)
    if kwargs.get("check", True):
        # Random axes would be out of range.
        run = optimize_checked(model, tmp_path, compare=case != "axes_fed")
    else:
        run = optimize(model, tmp_path)
    assert_declined(run, SQUEEZE, reason, "second")
    assert run.op_counts()["Squeeze"] == run.op_counts()["Unsqueeze"] == 1


# ---------------------------------------------------------------------------------------------
# CastCastFusionPass: x -> Cast(T1) -> Cast(T2) [-> consumer] -> y
# ---------------------------------------------------------------------------------------------


def _casts(
    path: Path,
    source: int,
    middle: int,
    final: int,
    *,
    consumer: str | None = None,
    relu: bool = False,
    record_relu: bool = True,
    extra_nodes: tuple = (),
    extra_outputs: tuple = (),
    opset: int = 17,
    outer_attrs: dict | None = None,
) -> Path:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] if relu else []
    data = "r" if relu else "x"
    nodes += [
        helper.make_node("Cast", [data], ["c1"], name="c1", to=middle),
        helper.make_node(
            "Cast", ["c1"], ["c2" if consumer else "y"], name="c2", to=final, **(outer_attrs or {})
        ),
    ]
    if consumer:
        nodes.append(helper.make_node(consumer, ["c2"], ["y"], name="consumer"))
    return save_model(
        path,
        [*nodes, *extra_nodes],
        [value("x", [2, 3], source)],
        [value("y", [2, 3], final), *extra_outputs],
        opset=opset,
        value_info=[value("r", [2, 3], source)] if relu and record_relu else (),
    )


_EDGE_VALUES = {
    F16: np.array([0.0, -1.5, 65504.0, 6.1e-5, -0.0, 3.0], np.float16),
    F: np.array([0.0, -1.5, 3.4e38, 1e-40, 16777217.0, 0.1], np.float32),
    U8: np.array([0, 1, 127, 128, 254, 255], np.uint8),
    I32: np.array([0, -1, 2**31 - 1, -(2**31), 16777217, 7], np.int32),
    B: np.array([True, False, True, True, False, False]),
}
CAST_FIRES = {
    # name: (source, middle, final, kwargs, ops after)
    "float16_float_double": (F16, F, D, {}, {"Cast": 1}),
    "uint8_int32_float": (U8, I32, F, {}, {"Cast": 1}),
    "float_double_float": (F, D, F, {"relu": True}, {"Relu": 1}),
    "int32_int64_int32": (I32, I64, I32, {"consumer": "Neg"}, {"Neg": 1}),
    "bool_float_bool": (B, F, B, {"consumer": "Not"}, {"Not": 1}),
}


@pytest.mark.parametrize("case", sorted(CAST_FIRES))
def test_cast_pair_fires(case: str, tmp_path: Path) -> None:
    source, middle, final, kwargs, ops = CAST_FIRES[case]
    model = _casts(tmp_path / f"{case}.onnx", source, middle, final, **kwargs)
    run = optimize_checked(model, tmp_path, compare=False)
    # Random feeds have no bool or uint8 inputs: every value of the input type, by hand.
    feeds = {"x": np.resize(_EDGE_VALUES[source], (2, 3))}
    for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
    assert run.counts(CAST) == (1, 1)
    assert reasons(run, CAST) == {}
    assert run.op_counts() == Counter(ops)
    if "Cast" in ops:
        assert _attribute(run.output, "Cast", "to") == final
        assert lineage(run) == {f"{CAST}/c2": ([CAST], ["c1", "c2"])}
    else:  # the pair cancels: nothing is left, and the graph output keeps its name
        nodes, outputs = _graph(run.output)
        assert [op for op, _, _ in nodes] == list(ops)
        assert outputs == ["y"]


def test_noop_cast_goes_before_cast_pairs_are_looked_at(tmp_path: Path) -> None:
    """float -> float is no cast at all: IdentityEliminationPass removes it, one Cast stays."""
    model = _casts(tmp_path / "noop.onnx", F, F, F16)
    run = optimize_checked(model, tmp_path, compare=False)
    feeds = {"x": np.resize(_EDGE_VALUES[F], (2, 3))}
    for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
    assert run.passed("IdentityEliminationPass")["patterns"]["Cast"] == {
        "matched": 1,
        "effected": 1,
    }
    assert run.counts(CAST) == (0, 0)
    assert run.op_counts() == Counter({"Cast": 1})
    assert _attribute(run.output, "Cast", "to") == F16


CAST_DECLINES = {
    "float_float16_float": ((F, F16, F), {}, "casting FLOAT to FLOAT16 loses values"),
    "double_float_double": ((D, F, D), {}, "casting DOUBLE to FLOAT loses values"),
    "int32_float_int32": (
        (I32, F, I32),
        {"consumer": "Neg"},
        "casting INT32 to FLOAT loses values",
    ),
    "int64_int32_int64": (
        (I64, I32, I64),
        {"consumer": "Neg"},
        "casting INT64 to INT32 loses values",
    ),
    "float16_int8_float": ((F16, TensorProto.INT8, F), {}, "casting FLOAT16 to INT8 loses values"),
    "inner_shared": (
        (F16, F, D),
        {
            "extra_nodes": (helper.make_node("Neg", ["c1"], ["n"], name="neg"),),
            "extra_outputs": (value("n", [2, 3]),),
        },
        "an intermediate value (Cast output) is also used by Neg outside the match",
    ),
}


@pytest.mark.parametrize("case", sorted(CAST_DECLINES))
def test_cast_pair_declines(case: str, tmp_path: Path) -> None:
    types, kwargs, reason = CAST_DECLINES[case]
    run = optimize_checked(_casts(tmp_path / f"{case}.onnx", *types, **kwargs), tmp_path)
    assert_declined(run, CAST, reason, "c2")
    assert run.op_counts()["Cast"] == 2


def test_cast_pair_input_type_not_recorded(tmp_path: Path) -> None:
    model = _casts(tmp_path / "unrecorded.onnx", F, D, F, relu=True, record_relu=False)
    run = optimize_checked(model, tmp_path)
    assert run.counts(CAST) == (1, 1)


def test_cast_pair_keeps_saturate(tmp_path: Path) -> None:
    f8 = TensorProto.FLOAT8E4M3FN
    model = save_model(
        tmp_path / "saturate.onnx",
        [
            helper.make_node("Cast", ["x"], ["c1"], name="c1", to=F),
            helper.make_node("Cast", ["c1"], ["c2"], name="c2", to=f8, saturate=0),
            helper.make_node("Cast", ["c2"], ["y"], name="c3", to=F),
        ],
        [value("x", [4], F16)],
        [value("y", [4])],
        opset=19,
    )
    run = optimize(model, tmp_path)
    feeds = {"x": np.array([1.0, 1000.0, -1000.0, 3.0], np.float16)}
    (want,) = run_model(model, feeds)
    assert np.isnan(want[1])  # the original overflows to NaN
    (got,) = run_model(run.output, feeds)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# IdentityEliminationPass: Identity and inference Dropout
# ---------------------------------------------------------------------------------------------


def _dropout(
    path: Path,
    *,
    inputs: tuple[str, ...] = ("r",),
    outputs: tuple[str, ...] = ("d",),
    opset: int = 17,
    initializers: tuple = (),
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    **attrs,
) -> Path:
    """x [2,3] -> Relu -> Dropout -> Neg -> y."""
    return save_model(
        path,
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Dropout", list(inputs), list(outputs), name="drop", **attrs),
            helper.make_node("Neg", ["d"], ["y"], name="neg"),
            *extra_nodes,
        ],
        [value("x", [2, 3]), *extra_inputs],
        [value("y", [2, 3]), *extra_outputs],
        initializers,
        opset=opset,
    )


def test_identity_chain_removed(tmp_path: Path) -> None:
    """Every Identity goes; the one at the graph output hands its name to the Add. The
    Identity of a constant is folded first (ConstantFoldingPass): its output becomes the
    initializer the Add reads."""
    model = save_model(
        tmp_path / "identities.onnx",
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Identity", ["r"], ["i"], name="id1"),
            helper.make_node("Identity", ["c"], ["ci"], name="id_const"),
            helper.make_node("Add", ["i", "ci"], ["n"], name="add"),
            helper.make_node("Identity", ["n"], ["y"], name="id2"),
        ],
        [value("x", [2, 3])],
        [value("y", [2, 3])],
        [const("c", np.ones((2, 3)))],
        value_info=[value("n", [2, 3])],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(IDENTITY) == (2, 2)
    assert run.passed(IDENTITY)["patterns"] == {"Identity": {"matched": 2, "effected": 2}}
    assert reasons(run, IDENTITY) == {}
    assert run.passed(FOLD)["patterns"] == {"Identity": {"matched": 1, "effected": 1}}
    assert [site["original_nodes"] for site in run.passed(FOLD)["sites"]] == [["id_const"]]
    assert _graph(run.output) == (
        [("Relu", ["x"], ["r"]), ("Add", ["r", "ci"], ["y"])],
        ["y"],
    )
    assert [i.name for i in onnx.load(str(run.output)).graph.initializer] == ["ci"]
    assert [site["original_nodes"] for site in run.passed(IDENTITY)["sites"]] == [
        ["id1"],
        ["id2"],
    ]
    assert run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"] == {
        FOLD: {"effect_times": "1", "match_times": "1"},
        IDENTITY: {"effect_times": "2", "match_times": "2"},
    }


DROPOUT_FIRES = {
    "opset17_mask_unused": {"outputs": ("d", "mask")},
    "opset17_training_false": {
        "inputs": ("r", "ratio", "training"),
        "initializers": (const("ratio", 0.5), const("training", False, np.bool_)),
    },
    "opset12_ratio_only": {
        "inputs": ("r", "ratio"),
        "initializers": (const("ratio", 0.3),),
        "opset": 12,
    },
    "opset10_ratio_attribute": {"opset": 10, "ratio": 0.3},
    "opset6_is_test": {"opset": 6, "is_test": 1},
}


@pytest.mark.parametrize("case", sorted(DROPOUT_FIRES))
def test_inference_dropout_removed(case: str, tmp_path: Path) -> None:
    kwargs = DROPOUT_FIRES[case]
    model = _dropout(tmp_path / f"dropout_{case}.onnx", **kwargs)
    # onnxruntime has no Dropout kernel for opset 6.
    run = optimize_checked(model, tmp_path, compare=kwargs.get("opset") != 6)
    assert run.counts(IDENTITY) == (1, 1)
    assert run.passed(IDENTITY)["patterns"] == {"Dropout": {"matched": 1, "effected": 1}}
    assert _graph(run.output) == ([("Relu", ["x"], ["r"]), ("Neg", ["r"], ["y"])], ["y"])


def test_identity_at_graph_output_keeps_output_type(tmp_path: Path) -> None:
    model = save_model(
        tmp_path / "identity_output_type.onnx",
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Identity", ["r"], ["y"], name="id"),
        ],
        [value("x", [2, 3])],
        [value("y", [2, 3])],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(IDENTITY) == (1, 1)
    assert _graph(run.output) == ([("Relu", ["x"], ["y"])], ["y"])


STRAIGHT = "it links a graph input or initializer straight to a graph output"


@pytest.mark.parametrize("source", ["x", "c"], ids=["graph_input", "initializer"])
def test_identity_from_graph_input_to_output_kept(source: str, tmp_path: Path) -> None:
    model = save_model(
        tmp_path / f"identity_{source}.onnx",
        [helper.make_node("Identity", [source], ["y"], name="id")],
        [value("x", [2, 3])],
        [value("y", [2, 3])],
        [const("c", np.ones((2, 3)))],
    )
    run = optimize_checked(model, tmp_path)
    assert_declined(run, IDENTITY, STRAIGHT, "id")
    assert _graph(run.output) == ([("Identity", [source], ["y"])], ["y"])


DROPOUT_DECLINES = {
    "mask_used": (
        {
            "outputs": ("d", "mask"),
            "extra_nodes": (helper.make_node("Not", ["mask"], ["keep"], name="not"),),
            "extra_outputs": (value("keep", [2, 3], B),),
        },
        "the Dropout mask is used",
    ),
    "mask_is_graph_output": (
        {"outputs": ("d", "mask"), "extra_outputs": (value("mask", [2, 3], B),)},
        "the Dropout mask is used",
    ),
    # ratio 0: training mode keeps every value, so the outputs still compare.
    "training_true": (
        {
            "inputs": ("r", "ratio", "training"),
            "initializers": (const("ratio", 0.0), const("training", True, np.bool_)),
        },
        "Dropout training_mode is not a constant false",
    ),
    "training_fed": (
        {
            "inputs": ("r", "ratio", "training"),
            "initializers": (const("ratio", 0.0),),
            "extra_inputs": (value("training", [], B),),
        },
        "Dropout training_mode is not a constant false",
    ),
    "opset6_is_test_0": ({"opset": 6, "is_test": 0}, "Dropout is in training mode (is_test=0)"),
}


@pytest.mark.parametrize("case", sorted(DROPOUT_DECLINES))
def test_dropout_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = DROPOUT_DECLINES[case]
    model = _dropout(tmp_path / f"dropout_{case}.onnx", **kwargs)
    # Random feeds have no bool inputs; onnxruntime has no Dropout kernel for opset 6.
    run = optimize_checked(
        model, tmp_path, compare=case in ("mask_used", "mask_is_graph_output", "training_true")
    )
    assert_declined(run, IDENTITY, reason, "drop")
    assert run.op_counts()["Dropout"] == 1


def test_dropout_training_mode_overridable_kept(tmp_path: Path) -> None:
    model = _dropout(
        tmp_path / "dropout_overridable.onnx",
        inputs=("r", "ratio", "training"),
        initializers=(const("ratio", 0.5), const("training", False, np.bool_)),
        extra_inputs=(value("training", [], B),),
    )
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(run, IDENTITY, "Dropout training_mode is not a constant false", "drop")


def test_identity_between_two_graph_outputs_reason(tmp_path: Path) -> None:
    model = save_model(
        tmp_path / "identity_outputs.onnx",
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Identity", ["r"], ["y"], name="id"),
        ],
        [value("x", [2, 3])],
        [value("y", [2, 3]), value("r", [2, 3])],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(IDENTITY) == (1, 0)
    assert reasons(run, IDENTITY) != {STRAIGHT: 1}
