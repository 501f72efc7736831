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
from fusectl.rewrite.axes import axis_size, same_traced_size, symbolic_size
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.registry import Category, PassSpec
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


def test_a_value_first_inferred_later_shares_the_earlier_names() -> None:
    """An Unsqueeze whose axes come through an Identity has no shape until the Identity is
    folded; inferred then, its dimensions take the names the earlier run gave its input's, so
    sizes compare equal across the two runs (a GPT-BigCode layer's heads went unproven)."""
    proto = _model(
        [
            helper.make_node("NonZero", ["x"], ["found"]),
            helper.make_node("Transpose", ["found"], ["moved"]),
            helper.make_node("Identity", ["axis"], ["axes"]),
            helper.make_node("Unsqueeze", ["moved", "axes"], ["widened"]),
        ],
        [value("x", [3, 4])],
        [helper.make_tensor_value_info("widened", onnx.TensorProto.INT64, None)],
        [const("axis", [0], np.int64)],
    )
    model = ir.serde.deserialize_model(proto)
    oracle = ShapeOracle(model, None)
    moved, widened = model.graph.node(1).outputs[0], model.graph.node(3).outputs[0]
    first = oracle.shape(moved)
    assert first is not None and str(first[0]).startswith("unk__")
    assert oracle.shape(widened) is None
    # A rewrite folds the Identity: the Unsqueeze reads the constant axes.
    unsqueeze = model.graph.node(3)
    unsqueeze.replace_input_with(1, model.graph.initializers["axis"])
    model.graph.remove(model.graph.node(2), safe=True)
    oracle.invalidate()
    assert oracle.shape(widened) == ir.Shape([1, first[0], 2])


@pytest.mark.parametrize(
    ("name", "ties"),
    [
        ("batch", True),
        ("s0", True),
        ("past_sequence_length + 1", True),
        ("unk__3", False),  # onnx's inference
        ("unk__2.3", False),  # fusectl's second inference run
        ("Reshape_43_o0__d1", False),  # onnxruntime's symbolic inference
        ("floor(Pad_396_o0__d1/4)", False),  # its arithmetic over one it made up
    ],
)
def test_names_inference_made_up_tie_nothing(name: str, ties: bool) -> None:
    assert shapes.named(ir.SymbolicDim(name)) is ties


def _reshaped_by_its_own_batch(batch: str) -> onnx.ModelProto:
    """x [batch, 6] reshaped to [its batch, 2, 3] through a target computed from its shape:
    onnx's inference follows it with data propagation only."""
    return _model(
        [
            helper.make_node("Shape", ["x"], ["shape"], start=0, end=1),
            helper.make_node("Concat", ["shape", "rest"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Relu", ["y"], ["z"]),
        ],
        [value("x", [batch, 6])],
        [value("z", None), value("r", None)],
        [const("rest", [2, 3], np.int64)],
    )


def test_a_name_another_tools_inference_made_up_is_derived_again() -> None:
    """Users run onnx's infer_shapes before handing a model over: without data propagation it
    names the reshaped sizes it cannot follow (unk__N) and writes them into value_info.
    fusectl's inference derives them; the graph input's own name stays."""
    proto = onnx.shape_inference.infer_shapes(_reshaped_by_its_own_batch("batch"))
    declared = {info.name: info for info in proto.graph.value_info}
    assert [d.dim_param for d in declared["y"].type.tensor_type.shape.dim] == [
        "unk__0",
        "unk__1",
        "unk__2",
    ]
    model = ir.serde.deserialize_model(proto)
    oracle = ShapeOracle(model, proto)
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert oracle.shape(values["y"]) == ir.Shape(["batch", 2, 3])
    assert oracle.shape(values["r"]) == ir.Shape(["batch", 6])


def test_a_made_up_name_the_inputs_declare_is_kept() -> None:
    """tf2onnx names an input's unknown size unk__N: it is the model's interface, not another
    tool's guess, and the values that inherit it keep it."""
    proto = onnx.shape_inference.infer_shapes(_reshaped_by_its_own_batch("unk__7"))
    model = ir.serde.deserialize_model(proto)
    oracle = ShapeOracle(model, proto)
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert oracle.shape(values["r"]) == ir.Shape(["unk__7", 6])
    assert oracle.shape(values["y"]) == ir.Shape(["unk__7", 2, 3])


def test_a_guess_not_derived_again_is_written_as_fusectls_own() -> None:
    """A size no inference follows (a NonZero's count) keeps its made-up name, written in
    fusectl's form (unk__0.N): a second run does not take it for another tool's guess."""
    proto = onnx.shape_inference.infer_shapes(
        _model(
            [
                helper.make_node("NonZero", ["a"], ["found"]),
                helper.make_node("Transpose", ["found"], ["moved"]),
                helper.make_node("Neg", ["moved"], ["out"]),
            ],
            [value("a", [3, 4])],
            [helper.make_tensor_value_info("out", onnx.TensorProto.INT64, None)],
            [],
        )
    )
    model = ir.serde.deserialize_model(proto)
    oracle = ShapeOracle(model, proto)
    moved = model.graph.node(1).outputs[0]
    assert oracle.shape(moved) == ir.Shape(["unk__0", 2])
    oracle.own_guesses()
    assert moved.shape == ir.Shape(["unk__0.0", 2])
    again = ShapeOracle(model, None)
    assert again.shape(moved) == ir.Shape(["unk__0.0", 2])


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


def _size_of(shape: str, index: int, out: str) -> list[onnx.NodeProto]:
    """TorchScript's x.shape[index] as a 1-element tensor: Unsqueeze(Gather(shape, index))."""
    return [
        helper.make_node("Gather", [shape, f"i{index}"], [f"{out}_g"], axis=0),
        helper.make_node("Unsqueeze", [f"{out}_g", "zero"], [out]),
    ]


def test_axis_size_reads_whole_shape_targets_as_far_up_as_the_walk() -> None:
    """LFM2's key: heads split with a -1, a per-head norm written as
    Reshape(norm(Reshape(k, [0, -1, 8])), Shape(k)), a transpose and element-wise ops, then
    the heads repeated by a Reshape whose target multiplies a size read at run time. The
    head counts are static: the whole Shape(k) is read element by element, and the repeat's
    target follows its copied size as far up as the walk to the Reshape reached."""
    nodes = [
        helper.make_node("Shape", ["h"], ["h_shape"]),
        *_size_of("h_shape", 0, "b"),
        *_size_of("h_shape", 1, "s"),
        helper.make_node("Concat", ["b", "s", "minus_one", "eight"], ["split"], axis=0),
        helper.make_node("Reshape", ["h", "split"], ["k"]),
        helper.make_node("Reshape", ["k", "as_3d"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["normed"]),
        helper.make_node("Shape", ["k"], ["k_shape"]),
        helper.make_node("Reshape", ["normed", "k_shape"], ["back"]),
        helper.make_node("Transpose", ["back"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Neg", ["t"], ["t1"]),
        helper.make_node("Abs", ["t1"], ["t2"]),
        helper.make_node("Relu", ["t2"], ["t3"]),
        helper.make_node("Unsqueeze", ["t3", "two_axis"], ["wide"]),
        helper.make_node("Expand", ["wide", "twice"], ["repeated"]),
        helper.make_node("Shape", ["t3"], ["t_shape"]),
        *_size_of("t_shape", 0, "rb"),
        helper.make_node("Gather", ["t_shape", "i1"], ["heads"], axis=0),
        helper.make_node("Mul", ["heads", "two"], ["all_heads"]),
        helper.make_node("Unsqueeze", ["all_heads", "zero"], ["rn"]),
        *_size_of("t_shape", 2, "rs"),
        helper.make_node("Concat", ["rb", "rn", "rs", "eight"], ["merge"], axis=0),
        helper.make_node("Reshape", ["repeated", "merge"], ["key"]),
    ]
    inits = [
        const("i0", 0, np.int64),
        const("i1", 1, np.int64),
        const("i2", 2, np.int64),
        const("zero", [0], np.int64),
        const("two_axis", [2], np.int64),
        const("two", 2, np.int64),
        const("minus_one", [-1], np.int64),
        const("eight", [8], np.int64),
        const("as_3d", [0, -1, 8], np.int64),
        const("twice", [1, 1, 2, 1, 1], np.int64),
    ]
    proto = _model(nodes, [value("h", ["B", "S", 16])], [value("key", None)], inits)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    spec = PassSpec(name="Probe", category=Category.GRAPH, description="reads sizes")
    ctx = PassContext(spec=spec, target="ort", opset=17)
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert ctx.shape(values["back"]) is not None and ctx.shape(values["back"])[2] != 2
    assert [axis_size(ctx, values["back"], axis) for axis in range(4)] == [None, None, 2, 8]
    assert axis_size(ctx, values["t3"], 1) == 2
    assert axis_size(ctx, values["key"], 1) == 4


@pytest.mark.parametrize(
    ("shape", "sizes", "head_size"),
    [
        # ViTDet's fold of the heads into the batch: [B*2, 16, -1] of [B, 2, 16, 4]. The
        # target multiplies a size read at run time, so inference knows no size of the
        # result; traced as products, B*2*16*4 over B*2 * 16 leaves 4.
        (["B", 2, 16, 4], ["b2", "sixteen", "minus_one"], 4),
        # Near miss: [B*2, -1] of [B, S, 8] leaves 4*S, a size only known at run time.
        (["B", "S", 8], ["b2", "minus_one"], None),
    ],
)
def test_axis_size_counts_a_minus_one_from_sizes_multiplied_at_run_time(
    shape: list, sizes: list[str], head_size: int | None
) -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "i0"], ["b"], axis=0),
        helper.make_node("Mul", ["b", "two"], ["b_times_two"]),
        helper.make_node("Unsqueeze", ["b_times_two", "zero"], ["b2"]),
        helper.make_node("Concat", sizes, ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["folded"]),
    ]
    inits = [
        const("i0", 0, np.int64),
        const("zero", [0], np.int64),
        const("two", 2, np.int64),
        const("sixteen", [16], np.int64),
        const("minus_one", [-1], np.int64),
    ]
    proto = _model(nodes, [value("x", shape)], [value("folded", None)], inits)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    spec = PassSpec(name="Probe", category=Category.GRAPH, description="reads sizes")
    ctx = PassContext(spec=spec, target="ort", opset=17)
    folded = next(v for node in model.graph for v in node.outputs if v.name == "folded")
    assert not isinstance(ctx.shape(folded)[-1], int)  # inference does not know it
    assert axis_size(ctx, folded, len(sizes) - 1) == head_size


@pytest.mark.parametrize(
    ("kept", "sizes"), [("one", [(1, ("B",)), 17, 8]), ("x_shape", [(1, ("B",)), None, 8])]
)
def test_symbolic_sizes_through_expand_minus_ones_and_a_join(kept: str, sizes: list) -> None:
    """DPT's class token: TorchScript writes ``cls.expand(B, -1, -1)`` as
    Expand(cls, Where(Equal(s, -1), 1, s)) with s = [B, -1, -1]: a -1 is the 1 the Where
    selects, so the token is [B, 1, 8]; joined to the [B, 16, 8] patches, the joined axis is
    17. Near miss: where the Where selects a size read at run time instead of a constant, the
    -1s say nothing (the batch is still the patches')."""
    nodes = [
        helper.make_node("Shape", ["patches"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "i0"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus_ones"], ["s"], axis=0),
        helper.make_node("Equal", ["s", "minus_one"], ["is_minus_one"]),
        helper.make_node("Where", ["is_minus_one", kept, "s"], ["target"]),
        helper.make_node("Expand", ["cls", "target"], ["token"]),
        helper.make_node("Concat", ["token", "patches"], ["joined"], axis=1),
    ]
    inits = [
        const("i0", 0, np.int64),
        const("zero", [0], np.int64),
        const("one", [1], np.int64),
        const("minus_one", [-1], np.int64),
        const("minus_ones", [-1, -1], np.int64),
        const("cls", np.ones((1, 1, 8)), np.float32),
    ]
    proto = _model(nodes, [value("patches", ["B", 16, 8])], [value("joined", None)], inits)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    spec = PassSpec(name="Probe", category=Category.GRAPH, description="reads sizes")
    ctx = PassContext(spec=spec, target="ort", opset=17)
    joined = next(v for node in model.graph for v in node.outputs if v.name == "joined")
    assert not isinstance(ctx.shape(joined)[1], int)  # inference does not know it
    traced = [symbolic_size(ctx, joined, axis) for axis in range(3)]
    assert [size[0] if size is not None and not size[1] else size for size in traced] == sizes


def test_same_traced_size_ties_only_equal_products() -> None:
    """A size read from another tensor is the data's where both trace to one product of
    named dimensions: the batch of x folded with its 2 heads and unfolded again is x's batch
    (inference names the result's sizes apart); the fold itself, 2·B, is not."""
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "i0"], ["b"], axis=0),
        helper.make_node("Mul", ["b", "two"], ["b_times_two"]),
        helper.make_node("Unsqueeze", ["b_times_two", "zero"], ["b2"]),
        helper.make_node("Concat", ["b2", "minus_one"], ["fold"], axis=0),
        helper.make_node("Reshape", ["x", "fold"], ["folded"]),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus_one"], ["unfold"], axis=0),
        helper.make_node("Reshape", ["folded", "unfold"], ["unfolded"]),
    ]
    inits = [
        const("i0", 0, np.int64),
        const("zero", [0], np.int64),
        const("two", 2, np.int64),
        const("minus_one", [-1], np.int64),
    ]
    proto = _model(nodes, [value("x", ["B", 2, 8])], [value("unfolded", None)], inits)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    spec = PassSpec(name="Probe", category=Category.GRAPH, description="reads sizes")
    ctx = PassContext(spec=spec, target="ort", opset=17)
    values = {v.name: v for node in model.graph for v in node.outputs}
    x = model.graph.inputs[0]
    assert ctx.shape(values["unfolded"])[0] != ctx.shape(x)[0]  # named apart by inference
    assert same_traced_size(ctx, (values["unfolded"], 0), x, 0)
    assert not same_traced_size(ctx, (values["folded"], 0), x, 0)


def _head_split(opset: int, extra: list[onnx.NodeProto] = ()) -> onnx.ModelProto:
    """x [b, s, 8] reshaped to [b, -1, 2, 4] by a target computed from x's shape (every
    exporter's head split), then ``extra``."""
    nodes = [
        helper.make_node("Shape", ["x"], ["dims"]),
        helper.make_node("Gather", ["dims", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch"], ["batch1"], axes=[0]),
        helper.make_node("Concat", ["batch1", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["heads"]),
        *extra,
    ]
    inits = [const("zero", np.array(0, np.int64), np.int64), const("rest", [-1, 2, 4], np.int64)]
    last = nodes[-1].output[0]
    proto = _model(nodes, [value("x", ["b", "s", 8])], [value(last, None)], inits)
    proto.opset_import[0].version = opset
    return proto


def test_a_model_before_opset_14_is_inferred_as_at_opset_14() -> None:
    """Reshape's inference before opset 14 gives a computed target's output no rank; on the
    model converted to opset 14 (names and meaning kept) it has rank 4, batch kept."""
    proto = _head_split(11)
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    assert not {v.name: v for v in inferred.graph.output}["heads"].type.tensor_type.HasField(
        "shape"
    )
    model = ir.serde.deserialize_model(proto)
    heads = next(node for node in model.graph if node.op_type == "Reshape").outputs[0]
    shape = ShapeOracle(model, None).shape(heads)
    assert shape is not None and len(shape) == 4
    assert str(shape[0]) == "b" and list(shape)[2:] == [2, 4]


def test_a_model_the_converter_refuses_keeps_its_opset() -> None:
    """An op no schema describes stops onnx's version converter: inference runs on the model
    as it is (the old inference, no rank), and nothing is raised."""
    proto = _head_split(11, [helper.make_node("Frobnicate", ["heads"], ["out"])])
    assert shapes._inferable(proto) is proto
    convertible = _head_split(11)
    assert shapes._inferable(convertible) is not convertible  # converted: a new model
    model = ir.serde.deserialize_model(proto)
    heads = next(node for node in model.graph if node.op_type == "Reshape").outputs[0]
    assert ShapeOracle(model, None).shape(heads) is None


def _viewed(tail: list[int]) -> ir.Model:
    """x [batch, length, 64] viewed as [batch, length, *tail], its leading sizes read from x at
    run time (dynamo's ``view(*x.shape[:2], ...)``)."""
    proto = _model(
        [
            helper.make_node("Shape", ["x"], ["sizes"], end=2),
            helper.make_node("Concat", ["sizes", "tail"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        [value("x", ["batch", "length", 64])],
        [value("y", None)],
        [const("tail", tail, np.int64)],
    )
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        # The -1 is what is left of 64 once 4 and 2 divide it: the names cancel.
        ([4, -1, 2], ["batch", "length", 4, 8, 2]),
        # What is left is no static size (a -1 that merges the length), or none divides.
        ([-1], None),
        ([5, -1], None),
    ],
)
def test_a_reshapes_minus_one_is_what_the_data_leaves(
    tail: list[int], expected: list[int | str] | None
) -> None:
    """onnx leaves a Reshape's -1 unresolved once a size is symbolic (an export stripped of its
    value_info: llama.c's pairs viewed [batch, length, 4, -1, 2]); the sizes that cancel
    resolve it."""
    model = _viewed(tail)
    oracle = ShapeOracle(model, None)
    shape = oracle.shape(model.graph.node(2).outputs[0])
    assert shape is not None
    if expected is not None:
        assert shape == ir.Shape(expected)
    else:
        assert not shapes.named(shape[-1])
