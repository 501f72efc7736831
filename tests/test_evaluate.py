"""fusectl.rewrite.evaluate: a value computed at probe sizes from the inputs it is fed, its
Shape reads taken from the inferred shapes (traced to named sizes), and what it refuses."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.evaluate import (
    PROBE_SIZES,
    Unevaluable,
    evaluate,
    sampled,
    sampled_dims,
    traced_sizes,
)
from fusectl.rewrite.registry import Category, PassSpec
from tests.pass_helpers import const, value


def _model(extra: list[onnx.NodeProto] | None = None) -> tuple[ir.Model, PassContext]:
    """bias = Where(Unsqueeze(mask, [1, 2]) != 0, 0, -1e4) expanded to [B, 1, S, S], S read
    from h's shape: h = Relu(x) has no name for its axes until traced to x's."""
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        helper.make_node("Shape", ["h"], ["h_shape"]),
        helper.make_node("Gather", ["h_shape", "one"], ["length"], axis=0),
        helper.make_node("Shape", ["mask"], ["batch"], end=1),
        helper.make_node("Concat", ["batch", "unit", "length", "length"], ["grid"], axis=0),
        helper.make_node("Unsqueeze", ["mask", "axes"], ["keys"]),
        helper.make_node("Cast", ["keys"], ["kept"], to=TensorProto.BOOL),
        helper.make_node("Where", ["kept", "zero", "fill"], ["rows"]),
        helper.make_node("Expand", ["rows", "grid"], ["bias"]),
        *(extra or []),
    ]
    initializers = [
        const("one", [1], np.int64),
        const("unit", [1], np.int64),
        const("axes", [1, 2], np.int64),
        const("zero", 0.0),
        const("fill", -1e4),
    ]
    inputs = [value("x", ["B", "S", 4]), value("mask", ["B", "S"], TensorProto.INT64)]
    graph = helper.make_graph(nodes, "bias", inputs, [value("bias", None)], initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(graph, opset_imports=opsets)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    spec = PassSpec(name="Probe", category=Category.GRAPH, description="evaluates")
    return model, PassContext(spec=spec, target="ort", opset=17)


def _values(model: ir.Model) -> dict[str, ir.Value]:
    found = {v.name: v for v in model.graph.inputs}
    found.update({v.name: v for node in model.graph for v in node.outputs})
    return found


def test_the_bias_is_computed_at_the_probe_sizes() -> None:
    model, ctx = _model()
    values = _values(model)
    mask = np.array([[1, 0, 1], [0, 1, 1]], np.int64)
    bias = evaluate(ctx, values["bias"], {values["mask"]: mask}, {"B": 2, "S": 3})
    want = np.broadcast_to(np.where(mask[:, None, None, :] != 0, 0.0, -1e4), (2, 1, 3, 3))
    np.testing.assert_array_equal(bias, want)
    assert traced_sizes(ctx, values["h"]) == [(1, ("B",)), (1, ("S",)), (4, ())]


def test_a_size_no_probe_sets_is_refused() -> None:
    model, ctx = _model()
    values = _values(model)
    mask = np.ones((2, 3), np.int64)
    with pytest.raises(Unevaluable, match="has a dimension no probe size sets"):
        evaluate(ctx, values["bias"], {values["mask"]: mask}, {"B": 2})


def test_an_op_outside_the_standard_domain_is_refused() -> None:
    extra = [helper.make_node("FastGelu", ["bias"], ["out"], domain="com.microsoft")]
    model, ctx = _model(extra)
    values = _values(model)
    with pytest.raises(Unevaluable, match="depends on FastGelu"):
        evaluate(ctx, values["out"], {values["mask"]: np.ones((2, 3), np.int64)}, {"B": 2, "S": 3})


def test_sampled_feeds_random_inputs_at_each_probe_size() -> None:
    """The graph inputs the bias reads (the mask; x only through a Shape) are fed random
    values, and each axis's size is read back as a size or the name whose probe size it is."""
    model, ctx = _model()
    values = _values(model)
    samples = sampled(ctx, values["bias"])
    assert not isinstance(samples, str)
    assert [probe for probe, _ in samples] == [{"B": row[0], "S": row[1]} for row in PROBE_SIZES]
    for probe, bias in samples:
        assert bias.shape == (probe["B"], 1, probe["S"], probe["S"])
        assert set(np.unique(bias)) <= {0.0, -1e4}
    assert sampled_dims(samples) == [
        ir.SymbolicDim("B"),
        1,
        ir.SymbolicDim("S"),
        ir.SymbolicDim("S"),
    ]
    doubled = [(probe, np.zeros((2 * probe["B"], 3))) for probe, _ in samples]
    assert sampled_dims(doubled) == [None, 3]  # 2B is no name's probe size


def test_sampled_says_why_it_cannot_evaluate() -> None:
    extra = [helper.make_node("FastGelu", ["bias"], ["out"], domain="com.microsoft")]
    model, ctx = _model(extra)
    assert sampled(ctx, _values(model)["out"]) == "it depends on FastGelu (com.microsoft)"
