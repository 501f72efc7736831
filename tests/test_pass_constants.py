"""ConstantFoldingPass: constants computed in the graph become initializers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from tests.conftest import optimize, random_feeds
from tests.pass_helpers import (
    assert_declined,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

FOLD = "ConstantFoldingPass"


def test_torchscript_mobilenet_pad_amounts_fold(tmp_path: Path) -> None:
    """TorchScript computes every Pad's amounts in the graph; folded, all 52 Pads merge."""
    run = optimize_checked(fixture_path("mobilenetv2_tiny_torchscript"), tmp_path)
    assert run.counts(FOLD) == (364, 364)
    assert run.counts("PadConv2dFusionPass") == (52, 52)
    assert run.counts("ConvBatchnormFusionPass") == (52, 52)
    assert run.counts("ConvActivationFusionPass") == (35, 35)
    assert run.report["model"]["before"]["nodes"] == 1105
    assert run.report["model"]["after"]["nodes"] == 64
    assert run.op_counts()["Pad"] == 0


def test_dynamo_unoptimized_zero_biases_fold(tmp_path: Path) -> None:
    """dynamo (optimize=False) gives bias-less Convs Expand(CastLike(0, x), Shape(W)[:1])."""
    run = optimize_checked(fixture_path("resnet_tiny_dynamo_noopt"), tmp_path)
    assert run.counts(FOLD) == (65, 65)
    assert run.counts("ConvBatchnormFusionPass") == (16, 16)
    ops = run.op_counts()
    assert (ops["BatchNormalization"], ops["Expand"], ops["CastLike"], ops["Shape"]) == (0,) * 4


def _shape_chain(path: Path, x_shape: list, *, overridable: bool = False) -> Path:
    """y = Reshape(x, Concat(Shape(x)[0:1], [-1])): the target shape is static iff x is."""
    inputs = [value("x", x_shape)]
    minus_one = const("minus_one", np.array([-1], np.int64), np.int64)
    if overridable:
        inputs.append(value("minus_one", [1], TensorProto.INT64))
    return save_model(
        path,
        [
            helper.make_node("Shape", ["x"], ["shape"], name="shape", end=1),
            helper.make_node("Concat", ["shape", "minus_one"], ["target"], name="concat", axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
        ],
        inputs,
        [value("y", [x_shape[0], 12])],
        [minus_one],
    )


def test_shape_of_a_static_value_folds_and_its_consumers_follow(tmp_path: Path) -> None:
    run = optimize_checked(_shape_chain(tmp_path / "static.onnx", [2, 3, 4]), tmp_path)
    assert run.counts(FOLD) == (2, 2)
    assert run.passed(FOLD)["patterns"] == {
        "Shape": {"matched": 1, "effected": 1},
        "Concat": {"matched": 1, "effected": 1},
    }
    assert run.op_counts() == Counter({"Reshape": 1})
    target = next(i for i in onnx.load(str(run.output)).graph.initializer if i.name == "target")
    assert onnx.numpy_helper.to_array(target).tolist() == [2, -1]


def test_dynamic_shape_and_overridable_inputs_stay(tmp_path: Path) -> None:
    dynamic = optimize_checked(_shape_chain(tmp_path / "dyn.onnx", ["n", 3, 4]), tmp_path)
    assert dynamic.counts(FOLD) == (0, 0)
    # Not a constant, but the same size as the data's at that position: the canonical
    # Reshape target copies it with a 0 (ReshapeTargetCanonicalizationPass).
    assert dynamic.counts("ReshapeTargetCanonicalizationPass") == (1, 1)
    assert dynamic.op_counts() == Counter({"Reshape": 1})
    (target,) = onnx.load(str(dynamic.output)).graph.initializer
    assert onnx.numpy_helper.to_array(target).tolist() == [0, -1]
    model = _shape_chain(tmp_path / "override.onnx", [2, 3, 4], overridable=True)
    run = optimize_checked(model, tmp_path)
    # Shape(x) folds; the Concat reads an initializer the caller may override, so it stays.
    assert run.counts(FOLD) == (1, 1)
    assert run.op_counts() == Counter({"Concat": 1, "Reshape": 1})


def test_castlike_reads_only_the_element_type(tmp_path: Path) -> None:
    model = save_model(
        tmp_path / "castlike.onnx",
        [
            helper.make_node("CastLike", ["zero", "x"], ["z"], name="castlike"),
            helper.make_node("Add", ["x", "z"], ["y"], name="add"),
        ],
        [value("x", [2, 3], TensorProto.DOUBLE)],
        [value("y", [2, 3], TensorProto.DOUBLE)],
        [const("zero", np.array(0.5, np.float32), np.float32)],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(FOLD) == (1, 1)
    z = next(i for i in onnx.load(str(run.output)).graph.initializer if i.name == "z")
    assert z.data_type == TensorProto.DOUBLE


def test_random_ops_and_graph_outputs_are_left_alone(tmp_path: Path) -> None:
    model = save_model(
        tmp_path / "random.onnx",
        [
            helper.make_node("RandomNormal", [], ["noise"], name="noise", shape=[2, 3], seed=1.0),
            helper.make_node("Add", ["x", "noise"], ["y"], name="add"),
            helper.make_node("Neg", ["c"], ["negated"], name="neg"),
        ],
        [value("x", [2, 3])],
        [value("y", [2, 3]), value("negated", [3])],
        [const("c", np.arange(3, dtype=np.float32))],
    )
    run = optimize(model, tmp_path)
    assert run.counts(FOLD) == (0, 0)
    assert run.op_counts() == Counter({"RandomNormal": 1, "Add": 1, "Neg": 1})


def _tile_model(path: Path, *, shared: bool) -> Path:
    """Tile of a 64 KiB constant to 2 MiB; `shared` also feeds the constant to an output."""
    nodes = [
        helper.make_node("Tile", ["block", "repeats"], ["tiled"], name="tile"),
        helper.make_node("Add", ["x", "tiled"], ["y"], name="add"),
    ]
    outputs = [value("y", [32, 128, 128])]
    if shared:
        nodes.append(helper.make_node("Add", ["x", "block"], ["y2"], name="add_block"))
        outputs.append(value("y2", [32, 128, 128]))
    return save_model(
        path,
        nodes,
        [value("x", [32, 128, 128])],
        outputs,
        [
            const("block", np.ones((1, 128, 128), np.float32)),
            const("repeats", np.array([32, 1, 1], np.int64), np.int64),
        ],
    )


def test_large_results_fold_only_when_they_free_their_inputs(tmp_path: Path) -> None:
    run = optimize_checked(_tile_model(tmp_path / "tile_shared.onnx", shared=True), tmp_path)
    assert_declined(run, FOLD, "the folded value would be large and duplicate its inputs", "tile")
    assert run.op_counts()["Tile"] == 1
    alone = optimize_checked(_tile_model(tmp_path / "tile_alone.onnx", shared=False), tmp_path)
    assert alone.counts(FOLD) == (1, 1)
    assert reasons(alone, FOLD) == {}
    assert alone.op_counts() == Counter({"Add": 1})


def test_a_large_constant_squared_folds(tmp_path: Path) -> None:
    """NF-ResNet's weight standardization (timm's ScaledStdConv2d) squares the centered weight
    as Mul(d, d): d is read twice, by that one node only, so folding frees it. It was left to
    run at every inference when the square was over the growth limit (here 2 MB)."""
    weight = np.random.default_rng(0).normal(size=(512, 1024)).astype(np.float32)
    model = save_model(
        tmp_path / "standardized.onnx",
        [
            helper.make_node("ReduceMean", ["w"], ["mean"], axes=[1], keepdims=1),
            helper.make_node("Sub", ["w", "mean"], ["centered"]),
            helper.make_node("Mul", ["centered", "centered"], ["squared"], name="square"),
            helper.make_node("ReduceMean", ["squared"], ["variance"], axes=[1], keepdims=1),
            helper.make_node("Add", ["x", "variance"], ["y"]),
        ],
        [value("x", [512, 1])],
        [value("y", [512, 1])],
        [const("w", weight)],
    )
    run = optimize_checked(model, tmp_path)
    assert reasons(run, FOLD) == {}
    assert run.op_counts() == Counter({"Add": 1})


def test_a_large_grid_scaled_by_a_shared_scalar_folds(tmp_path: Path) -> None:
    """onnx-asr's resampler (written in OnnxScript) builds its windowed-sinc kernels from a
    [640, 455] grid scaled by the sample rate, and scales the kernels by the same scalar
    again: a scalar read elsewhere duplicates nothing. The scaled grid feeds both the sinc and
    the window: readers that fold too, so it is freed with the last. The chain stopped at the
    first scaling and ran at every inference (1.2 MB a step); the grid itself still folds where
    it frees its inputs (the tile above is the near miss: a 64 KiB block shared with a reader
    that does not fold)."""
    model = save_model(
        tmp_path / "kernels.onnx",
        [
            helper.make_node("Add", ["column", "row"], ["grid"]),
            helper.make_node("Mul", ["grid", "rate"], ["scaled"], name="scale_grid"),
            helper.make_node("Sin", ["scaled"], ["sinc"]),
            helper.make_node("Cos", ["scaled"], ["window"]),
            helper.make_node("Mul", ["sinc", "window"], ["windowed"]),
            helper.make_node("Mul", ["windowed", "rate"], ["kernels"], name="scale_kernels"),
            helper.make_node("Add", ["x", "kernels"], ["y"]),
        ],
        [value("x", [640, 455])],
        [value("y", [640, 455])],
        [
            const("column", np.arange(640, dtype=np.float32).reshape(640, 1) / 640),
            const("row", np.arange(455, dtype=np.float32) / 455),
            const("rate", np.array(0.5, np.float32)),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert reasons(run, FOLD) == {}
    assert run.counts(FOLD) == (6, 6)
    assert run.op_counts() == Counter({"Add": 1})


def test_a_shared_scalar_expanded_to_a_large_shape_stays(tmp_path: Path) -> None:
    """The near miss of the above: the fold would keep the scalar for its other reader and
    add 4 MiB the model did not hold."""
    model = save_model(
        tmp_path / "filled.onnx",
        [
            helper.make_node("Expand", ["fill", "shape"], ["filled"], name="expand"),
            helper.make_node("Add", ["x", "filled"], ["y"]),
            helper.make_node("Mul", ["x", "fill"], ["z"]),
        ],
        [value("x", [1024, 1024])],
        [value("y", [1024, 1024]), value("z", [1024, 1024])],
        [
            const("fill", np.array(-2.0, np.float32)),
            const("shape", np.array([1024, 1024], np.int64), np.int64),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert_declined(run, FOLD, "the folded value would be large and duplicate its inputs", "expand")
    assert run.op_counts()["Expand"] == 1


# ---------------------------------------------------------------------------------------------
# Gather / Slice of a Shape: the dimensions they select may be static though the shape is not
# (the head size read back from a [B, S, N, H] tensor).
# ---------------------------------------------------------------------------------------------

X_SHAPE = ["batch", "seq", 4, 8]
INT64_MAX = np.iinfo(np.int64).max


def _scaled_by_a_dimension(
    path: Path, index: list[int] | int, perm: list[int] | None = None, **shape_attrs: int
) -> Path:
    """y = x / Sqrt(Cast(Gather(Shape(x), index))): attention's 1 / sqrt(head size). With
    ``perm``, the Shape is Gathered by it first, as onnxruntime's transpose optimizer writes
    the head size read off Shape(Transpose(x, perm))."""
    permuted = [helper.make_node("Gather", ["shape", "perm"], ["permuted"], name="permute")]
    return save_model(
        path,
        [
            helper.make_node("Shape", ["x"], ["shape"], name="shape", **shape_attrs),
            *(permuted if perm is not None else []),
            helper.make_node(
                "Gather", ["shape" if perm is None else "permuted", "index"], ["dim"], name="gather"
            ),
            helper.make_node("Cast", ["dim"], ["dim_f"], name="cast", to=TensorProto.FLOAT),
            helper.make_node("Sqrt", ["dim_f"], ["root"], name="sqrt"),
            helper.make_node("Div", ["x", "root"], ["y"], name="div"),
        ],
        [value("x", X_SHAPE)],
        [value("y", X_SHAPE)],
        [
            const("index", index, np.int64),
            *([const("perm", perm, np.int64)] if perm is not None else []),
        ],
    )


@pytest.mark.parametrize(
    ("index", "shape_attrs"),
    [(3, {}), (-1, {}), ([3], {}), (1, {"start": 2}), (0, {"start": -1})],
    ids=["index_3", "index_minus_1", "index_list", "shape_start_2", "shape_start_minus_1"],
)
def test_static_dimension_of_a_symbolic_shape_folds(
    index: list[int] | int, shape_attrs: dict[str, int], tmp_path: Path
) -> None:
    """Gather(Shape(x), 3) of x [batch, seq, 4, 8] is 8 whatever batch and seq are."""
    model = _scaled_by_a_dimension(tmp_path / "head_size.onnx", index, **shape_attrs)
    run = optimize_checked(model, tmp_path)
    assert run.counts(FOLD) == (3, 3)
    assert run.passed(FOLD)["patterns"] == {
        "Gather": {"matched": 1, "effected": 1},
        "Cast": {"matched": 1, "effected": 1},
        "Sqrt": {"matched": 1, "effected": 1},
    }
    assert run.op_counts() == Counter({"Div": 1})  # Shape has no reader left: removed
    graph = onnx.load(str(run.output)).graph
    root = next(i for i in graph.initializer if i.name == "root")
    np.testing.assert_allclose(
        onnx.numpy_helper.to_array(root), np.sqrt([8.0]).reshape(np.shape(index))
    )


@pytest.mark.parametrize(("index", "size"), [(3, 8), (1, 4), (2, None)])
def test_a_size_gathered_from_a_permuted_shape(
    index: int, size: int | None, tmp_path: Path
) -> None:
    """Gather(Gather(Shape(x), [0, 2, 1, 3]), i) of x [batch, seq, 4, 8] is x's size perm[i]:
    8 and 4 fold; at i = 2 it is the symbolic seq, which stays."""
    model = _scaled_by_a_dimension(tmp_path / "permuted.onnx", index, perm=[0, 2, 1, 3])
    run = optimize_checked(model, tmp_path)
    if size is None:
        assert run.counts(FOLD) == (0, 0)
        assert run.op_counts()["Shape"] == 1 and run.op_counts()["Gather"] == 2
        return
    assert pattern_counts(run, FOLD)["Gather"] == (1, 1)  # the outer one; then Cast, Sqrt
    assert run.op_counts() == Counter({"Div": 1})
    graph = onnx.load(str(run.output)).graph
    root = next(i for i in graph.initializer if i.name == "root")
    np.testing.assert_allclose(onnx.numpy_helper.to_array(root), np.sqrt(float(size)))


def _reshaped_by_a_slice(path: Path, bounds: list[list[int]], y_shape: list) -> Path:
    """y = Reshape(x, Concat([-1], Slice(Shape(x), *bounds)))."""
    names = ["starts", "ends", "axes", "steps"][: len(bounds)]
    return save_model(
        path,
        [
            helper.make_node("Shape", ["x"], ["shape"], name="shape"),
            helper.make_node("Slice", ["shape", *names], ["dims"], name="slice"),
            helper.make_node("Concat", ["minus_one", "dims"], ["target"], name="concat", axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
        ],
        [value("x", X_SHAPE)],
        [value("y", y_shape)],
        [
            const("minus_one", [-1], np.int64),
            *(const(n, b, np.int64) for n, b in zip(names, bounds, strict=True)),
        ],
    )


@pytest.mark.parametrize(
    ("bounds", "dims"),
    [
        ([[2], [4]], [4, 8]),
        ([[-2], [INT64_MAX], [0]], [4, 8]),
        ([[2], [INT64_MAX], [-1], [1]], [4, 8]),
        ([[3], [1], [0], [-1]], [8, 4]),
        ([[3], [4]], [8]),
    ],
    ids=["start_end", "from_minus_2", "axis_minus_1", "reversed", "last_only"],
)
def test_slice_of_static_dimensions_folds(bounds: list, dims: list[int], tmp_path: Path) -> None:
    model = _reshaped_by_a_slice(tmp_path / "slice.onnx", bounds, ["n", *dims])
    run = optimize_checked(model, tmp_path)
    assert run.counts(FOLD) == (2, 2)
    assert run.passed(FOLD)["patterns"] == {
        "Slice": {"matched": 1, "effected": 1},
        "Concat": {"matched": 1, "effected": 1},
    }
    assert run.op_counts() == Counter({"Reshape": 1})
    graph = onnx.load(str(run.output)).graph
    target = next(i for i in graph.initializer if i.name == "target")
    assert onnx.numpy_helper.to_array(target).tolist() == [-1, *dims]


def test_symbolic_dimensions_do_not_fold(tmp_path: Path) -> None:
    """Gather of the symbolic seq, and a Slice that covers it, are only known at run time: not
    folded. The Slice's run of x's sizes [seq, 4] becomes a constant Reshape target, seq
    copied with a 0 (ReshapeTargetCanonicalizationPass): nothing is known before run time."""
    gathered = optimize_checked(_scaled_by_a_dimension(tmp_path / "seq.onnx", 1), tmp_path)
    assert gathered.counts(FOLD) == (0, 0)
    assert gathered.op_counts() == Counter(
        {"Shape": 1, "Gather": 1, "Cast": 1, "Sqrt": 1, "Div": 1}
    )
    model = _reshaped_by_a_slice(tmp_path / "seq_slice.onnx", [[1], [3]], ["n", "seq", 4])
    sliced = optimize_checked(
        model, tmp_path, "--disable_pass", "ReshapeTargetCanonicalizationPass"
    )
    assert sliced.counts(FOLD) == (0, 0)
    assert sliced.op_counts() == Counter({"Shape": 1, "Slice": 1, "Concat": 1, "Reshape": 1})
    # Not a constant, but the same sizes at the same positions: a canonical target copies them
    canonical = optimize_checked(model, tmp_path)
    assert canonical.counts(FOLD) == (0, 0)
    assert canonical.op_counts() == Counter({"Reshape": 1})
    graph = onnx.load(str(canonical.output)).graph
    (reshape,) = graph.node
    target = next(i for i in graph.initializer if i.name == reshape.input[1])
    assert onnx.numpy_helper.to_array(target).tolist() == [-1, 0, 4]


def test_gather_of_something_else_than_a_shape_stays(tmp_path: Path) -> None:
    """A fed shape vector, and a Shape read at a fed index, are not known before run time."""
    fed = save_model(
        tmp_path / "fed.onnx",
        [
            helper.make_node("Gather", ["sizes", "index"], ["dim"], name="gather"),
            helper.make_node("Cast", ["dim"], ["dim_f"], name="cast", to=TensorProto.FLOAT),
            helper.make_node("Div", ["x", "dim_f"], ["y"], name="div"),
        ],
        [value("x", X_SHAPE), value("sizes", [4], TensorProto.INT64)],
        [value("y", X_SHAPE)],
        [const("index", 3, np.int64)],
    )
    run = optimize_checked(fed, tmp_path)
    assert run.counts(FOLD) == (0, 0)
    assert run.op_counts() == Counter({"Gather": 1, "Cast": 1, "Div": 1})
    at_fed_index = save_model(
        tmp_path / "fed_index.onnx",
        [
            helper.make_node("Shape", ["x"], ["shape"], name="shape"),
            helper.make_node("Gather", ["shape", "index"], ["dim"], name="gather"),
            helper.make_node("Cast", ["dim"], ["dim_f"], name="cast", to=TensorProto.FLOAT),
            helper.make_node("Div", ["x", "dim_f"], ["y"], name="div"),
        ],
        [value("x", [2, 3, 4, 8]), value("index", [], TensorProto.INT64)],
        [value("y", [2, 3, 4, 8])],
    )
    run = optimize(at_fed_index, tmp_path)
    # The static Shape itself folds; the Gather reads a fed index.
    assert run.counts(FOLD) == (1, 1)
    assert run.passed(FOLD)["patterns"] == {"Shape": {"matched": 1, "effected": 1}}
    assert run.op_counts() == Counter({"Gather": 1, "Cast": 1, "Div": 1})


def test_constants_cast_to_strings_stay(tmp_path: Path) -> None:
    """A constant cast to strings (DINOv2's position interpolation with a Cast's type
    changed to STRING) is not folded into an initializer: onnx-ir keeps strings as its
    StringTensor, which a folded numpy str array is not (the run ended in an internal
    error). Cast back to float, the value folds, and the strings go with it."""
    path = save_model(
        tmp_path / "strings.onnx",
        [
            helper.make_node("Cast", ["c"], ["text"], to=TensorProto.STRING),
            helper.make_node("Cast", ["text"], ["back"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["x", "back"], ["y"]),
        ],
        [value("x", [2])],
        [value("y", [2])],
        [const("c", np.array([1.5, -2.25], np.float32))],
    )
    run = optimize_checked(path, tmp_path)
    assert run.counts(FOLD) == (1, 1)
    assert pattern_counts(run, FOLD) == {"Cast": (1, 1)}
    assert run.op_counts() == Counter({"Add": 1})


def _quantized_weights(path: Path) -> dict[str, int]:
    """Initializer name -> element type, for the integer tensors a DequantizeLinear reads."""
    model = onnx.load(str(path))
    initializers = {tensor.name: tensor.data_type for tensor in model.graph.initializer}
    return {
        node.input[0]: initializers[node.input[0]]
        for node in model.graph.node
        if node.op_type == "DequantizeLinear" and node.input[0] in initializers
    }


def _ort_enable_all(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize(
    ("fixture", "dequantized", "weights"),
    [
        # quantize_static: int8 weights, biases in int32, Q of constants folded to int8
        ("qdq_bert_tiny_ts17", 47, 39),
        # MatMulNBitsQuantizer's QDQ format: 4-bit weights in blocks, each read by its MatMul
        ("qdq4_llama_tiny_dynamo", 14, 14),
    ],
)
def test_quantized_weights_stay_quantized(
    fixture: str, dequantized: int, weights: int, tmp_path: Path
) -> None:
    """A DequantizeLinear of a constant is a quantized model's weight: folded, it was stored
    in float (up to eight times larger) and onnxruntime computed in float what its quantized
    kernels compute in integers (onnxruntime-genai's QDQ LLaMA generated other tokens)."""
    source = fixture_path(fixture)
    run = optimize_checked(source, tmp_path)
    assert pattern_counts(run, FOLD)["DequantizeLinear"] == (dequantized, 0)
    assert reasons(run, FOLD)["a DequantizeLinear keeps the weights it reads quantized"] == (
        dequantized
    )
    before, after = _quantized_weights(source), _quantized_weights(run.output)
    assert len(before) == weights
    assert set(before.items()) <= set(after.items())
    assert run.output.stat().st_size < 1.2 * source.stat().st_size
    # Under onnxruntime's own optimizer, which runs the quantized kernels, the two agree too.
    feeds = random_feeds(source)
    for want, got in zip(
        _ort_enable_all(source, feeds), _ort_enable_all(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_qdq_llama_fuses_around_its_quantized_weights(tmp_path: Path) -> None:
    """The 4-bit QDQ LLaMA keeps its 14 DequantizeLinear -> MatMul projections and fuses what
    lies between them as its float export does."""
    counts = optimize_checked(fixture_path("qdq4_llama_tiny_dynamo"), tmp_path).op_counts()
    assert counts["DequantizeLinear"] == 14 and counts["MatMul"] == 14
    assert counts["GroupQueryAttention"] == 2 and counts["RotaryEmbedding"] == 4
    assert counts["SkipSimplifiedLayerNormalization"] == 5
