"""The shape oracle passes ask (fusectl.rewrite.shapes.ShapeOracle): shapes inferred again
after rewrites without mixing up the names that each inference made up, and onnxruntime's
symbolic inference for proofs that need the ops' arithmetic."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from fusectl.rewrite import shapes
from fusectl.rewrite.shapes import ShapeOracle
from tests.pass_helpers import IR_VERSION, const, value


def _model(
    nodes: list[onnx.NodeProto], inputs: list, outputs: list, inits: list
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION
    )


def test_names_made_up_by_a_later_inference_stay_apart() -> None:
    """onnx counts its made-up names (unk__N) from 0 in every run: a size inferred after the
    graph changed may not take the name an earlier run gave another size."""
    proto = _model(
        [helper.make_node("NonZero", ["a"], ["found"])],
        [value("a", [3, 4])],
        [helper.make_tensor_value_info("found", onnx.TensorProto.INT64, None)],
        [],
    )
    model = ir.serde.deserialize_model(proto)
    oracle = ShapeOracle(model, None)
    (found,) = model.graph.node(0).outputs
    first = oracle.shape(found)
    assert first is not None and str(first[1]).startswith("unk__")
    # A rewrite adds a second NonZero, then asks for its shape.
    again = ir.node("NonZero", [model.graph.inputs[0]])
    model.graph.append(again)
    oracle.invalidate()
    second = oracle.shape(again.outputs[0])
    assert second is not None and str(second[1]).startswith("unk__2.")
    assert oracle.shape(found) == first


def test_symbolic_dims_follow_the_arithmetic_of_the_graph_as_loaded() -> None:
    """Range(0, S) has S elements, and a [16]-row table sliced to it Min(16, S): sizes onnx's
    inference names afresh. A value that is not in the loaded graph has none."""
    proto = _model(
        [
            helper.make_node("Shape", ["a"], ["shape"], start=0, end=1),
            helper.make_node("Squeeze", ["shape"], ["length"]),
            helper.make_node("Range", ["zero", "length", "one"], ["positions"]),
            helper.make_node("Slice", ["table", "zero_1d", "shape"], ["rows"]),
        ],
        [value("a", ["S"])],
        [
            helper.make_tensor_value_info("positions", onnx.TensorProto.INT64, None),
            value("rows", None),
        ],
        [
            const("zero", np.array(0), np.int64),
            const("one", np.array(1), np.int64),
            const("zero_1d", [0], np.int64),
            const("table", np.zeros(16)),
        ],
    )
    model = ir.serde.deserialize_model(proto)
    oracle = ShapeOracle(model, proto)
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert oracle.symbolic_dims([values["positions"], values["rows"]]) == [["S"], ["Min(16, S)"]]
    assert oracle.symbolic_dims([ir.Value(name="made_by_a_pass")]) == [None]


def test_symbolic_dims_within_a_node_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the budget the inference is not run (a slow proof on a huge graph is not made)."""
    monkeypatch.setattr(shapes, "SYMBOLIC_NODE_LIMIT", 1)
    proto = _model(
        [
            helper.make_node("Shape", ["a"], ["shape"]),
            helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        ],
        [value("a", ["S"])],
        [value("zeros", None)],
        [],
    )
    model = ir.serde.deserialize_model(proto)
    oracle = ShapeOracle(model, proto)
    (zeros,) = model.graph.node(1).outputs
    assert oracle.symbolic_dims([zeros]) == [None]
    monkeypatch.setattr(shapes, "SYMBOLIC_NODE_LIMIT", 2)
    assert ShapeOracle(model, proto).symbolic_dims([zeros]) == [["S"]]
