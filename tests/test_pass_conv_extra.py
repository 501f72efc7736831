"""ConvScaleFusionPass, PadConv2dFusionPass, Conv2DTransposeBatchnormFusionPass and
ConvToFullyConnectionFusionPass: exporter fixtures, near misses built with onnx.helper."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import optimize
from tests.pass_helpers import (
    assert_declined,
    const,
    conv_batchnorm_params,
    fixture_path,
    lineage,
    optimize_checked,
    plain_input_not_constant,
    reasons,
    save_model,
    value,
)

SCALE = "ConvScaleFusionPass"
PAD = "PadConv2dFusionPass"
DECONV = "Conv2DTransposeBatchnormFusionPass"
FC = "ConvToFullyConnectionFusionPass"
ACT = "ConvActivationFusionPass"

# Off by default (onnxruntime runs such a Conv as one GEMM already): its tests turn it on.
ENABLE_FC = ("--enable_pass", FC)

FLOAT16 = onnx.TensorProto.FLOAT16
BFLOAT16 = onnx.TensorProto.BFLOAT16
INT64 = onnx.TensorProto.INT64


def _attribute(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def _nodes(path: Path, op_type: str) -> list[onnx.NodeProto]:
    return [node for node in onnx.load(str(path)).graph.node if node.op_type == op_type]


# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py).
# ---------------------------------------------------------------------------------------------

FIXTURE_EXPECTED = {
    # TorchScript computes every Pad's amounts (ConstantOfShape/Concat/Slice/Transpose/Cast);
    # ConstantFoldingPass makes them constants, so every Pad goes into its Conv. Shapes are
    # inferred on the graph as loaded, where the amounts were not constants: no Conv input has
    # a static shape, so no Conv is a fully-connected candidate.
    # Folding the pad amounts makes the Conv inputs' shapes inferable again: eight 1x1 Convs
    # of the last stage see a 1x1 input.
    "mobilenetv2_tiny_torchscript": {
        PAD: (52, 52, {}),
        FC: (8, 8, {}),
        "ops": {"Pad": 0, "Flatten": 9, "Gemm": 8},
    },
    # dynamo, optimize=False: the CastLike of the zero Conv bias that also read each Pad output
    # is folded, so every Pad goes into its Conv. Eight 1x1 Convs see a 1x1 input; the four
    # depthwise 3x3 Convs now see their unpadded 1x1 input and are no candidates.
    "mobilenetv2_tiny_dynamo_noopt": {
        PAD: (52, 52, {}),
        FC: (8, 8, {}),
        "ops": {"Pad": 0, "Flatten": 8, "Gemm": 8},
    },
    # dynamo defaults: the pads are in the Convs already. The four converted Convs were
    # followed by a Clip, which then follows a Reshape and stays out of FusedConv.
    "mobilenetv2_tiny_dynamo": {
        PAD: (0, 0, {}),
        FC: (8, 8, {}),
        "ops": {"Pad": 0, "Flatten": 8, "Gemm": 8, "Clip": 4, "FusedConv": 31},
    },
    # The last stage's third 1x1 Conv sees a 1x1 input.
    "resnet_tiny_torchscript": {PAD: (0, 0, {}), FC: (1, 1, {}), "ops": {"Flatten": 1}},
    "resnet_tiny_dynamo": {PAD: (0, 0, {}), FC: (1, 1, {}), "ops": {"Flatten": 1}},
    "resnet_tiny_dynamo_noopt": {PAD: (0, 0, {}), FC: (1, 1, {}), "ops": {"Flatten": 1}},
    # No Conv of the small CNN covers its input.
    "cnn_torchscript": {PAD: (0, 0, {}), FC: (0, 0, {}), "ops": {"Flatten": 1}},
}


@pytest.mark.parametrize("name", sorted(FIXTURE_EXPECTED))
def test_exported_fixtures(name: str, tmp_path: Path) -> None:
    expected = FIXTURE_EXPECTED[name]
    run = optimize_checked(fixture_path(name), tmp_path, *ENABLE_FC)
    for pass_name in (PAD, FC):
        matched, effected, near_misses = expected[pass_name]
        assert run.counts(pass_name) == (matched, effected), pass_name
        assert reasons(run, pass_name) == near_misses, pass_name
    ops = run.op_counts()
    assert {op: ops[op] for op in expected["ops"]} == expected["ops"]


def test_exported_fixture_fully_connected_lineage(tmp_path: Path) -> None:
    """The Conv was made by ConvBatchnormFusionPass: the lineage accumulates."""
    run = optimize(fixture_path("resnet_tiny_torchscript"), tmp_path, *ENABLE_FC)
    layer = "/inner/encoder/stages.3/layers.0/layer/layer.2"
    originals = [f"{layer}/convolution/Conv", f"{layer}/normalization/BatchNormalization"]
    base = f"{FC}/ConvBatchnormFusionPass/{originals[1]}"
    (site,) = run.passed(FC)["sites"]
    assert site == {
        "pattern": "ConvToFullyConnection",
        "original_nodes": originals,
        "original_types": ["Conv", "BatchNormalization"],
        "new_nodes": [base, f"{base}_1", f"{base}_2"],
        "graph": "0_0",
    }
    stamped = lineage(run)
    for name in site["new_nodes"]:
        assert stamped[name] == (["ConvBatchnormFusionPass", FC], originals)


@pytest.fixture(scope="module")
def exported_cnn() -> Path:
    """TorchScript export of F.pad -> Conv -> * per-channel scale -> grouped ConvTranspose ->
    BatchNorm (eval mode: the exporter folds Conv+BN, never ConvTranspose+BN);
    PadConvScaleDeconvBN in tests/fixtures/make_fixtures.py."""
    return fixture_path("pad_conv_scale_deconv_bn_torchscript")


def test_exported_conv_scale_and_deconv_batchnorm(exported_cnn: Path, tmp_path: Path) -> None:
    run = optimize_checked(exported_cnn, tmp_path)
    assert run.counts(SCALE) == (1, 1)
    assert run.counts(DECONV) == (1, 1)
    # The exporter computes the pad amounts; ConstantFoldingPass makes them a constant.
    assert run.counts(PAD) == (1, 1)
    assert reasons(run, SCALE) == reasons(run, DECONV) == reasons(run, PAD) == {}
    ops = run.op_counts()
    assert (ops["Conv"], ops["ConvTranspose"], ops["Pad"]) == (1, 1, 0)
    assert ops["Mul"] == ops["BatchNormalization"] == 0
    (conv,) = _nodes(run.output, "Conv")
    assert list(_attribute(conv, "pads")) == [2, 1, 0, 1]  # F.pad (1, 1, 2, 0)
    stamped = lineage(run)
    assert stamped[f"{SCALE}//Mul"] == ([PAD, SCALE], ["/Pad", "/conv/Conv", "/Mul"])
    assert stamped[f"{DECONV}//bn/BatchNormalization"] == (
        [DECONV],
        ["/deconv/ConvTranspose", "/bn/BatchNormalization"],
    )


# ---------------------------------------------------------------------------------------------
# ConvScaleFusionPass: x [1,3,6,6] -> Conv(w[, b]) -> Mul(scale) -> y
# ---------------------------------------------------------------------------------------------

C = 4
RNG = np.random.default_rng(7)
WEIGHT = RNG.normal(0.0, 0.3, (C, 3, 3, 3)).astype(np.float32)
BIAS = RNG.normal(0.0, 0.3, C).astype(np.float32)


def _per_channel(shape: tuple[int, ...]) -> np.ndarray:
    return (np.arange(1, C + 1, dtype=np.float32) / 4 - 0.6).reshape(shape)


def _scale_model(
    path: Path,
    scale: np.ndarray | None,
    *,
    conv_inputs: tuple[str, ...] = ("x", "w"),
    scale_first: bool = False,
    x_shape: tuple[int, ...] = (1, 3, 6, 6),
    y_shape: tuple[int, ...] | None = None,
    weight: np.ndarray = WEIGHT,
    conv_attrs: dict | None = None,
    pre_nodes: tuple = (),
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    initializers: tuple | None = None,
    check: bool = True,
) -> Path:
    attrs = {"pads": [1] * (2 * (len(x_shape) - 2))} if conv_attrs is None else conv_attrs
    inits = [const("w", weight), const("b", BIAS)] if initializers is None else list(initializers)
    if scale is not None:
        inits.append(const("s", scale, scale.dtype.type))
    return save_model(
        path,
        [
            *pre_nodes,
            helper.make_node("Conv", list(conv_inputs), ["conv"], name="conv", **attrs),
            helper.make_node(
                "Mul", ["s", "conv"] if scale_first else ["conv", "s"], ["y"], name="mul"
            ),
            *extra_nodes,
        ],
        [value("x", list(x_shape)), *extra_inputs],
        [value("y", list(y_shape or (x_shape[0], C, *x_shape[2:]))), *extra_outputs],
        inits,
        check=check,
    )


SCALE_FIRES = {
    "c11": {"scale": _per_channel((C, 1, 1))},
    "1c11": {"scale": _per_channel((1, C, 1, 1))},
    "scalar": {"scale": np.array(-1.5, np.float32)},
    "scale_first": {"scale": _per_channel((C, 1, 1)), "scale_first": True},
    "conv_bias": {"scale": _per_channel((C, 1, 1)), "conv_inputs": ("x", "w", "b")},
    "empty_bias_input": {"scale": _per_channel((C, 1, 1)), "conv_inputs": ("x", "w", "")},
    "depthwise": {
        "scale": _per_channel((1, C, 1, 1)),
        "x_shape": (1, C, 6, 6),
        "weight": RNG.normal(0.0, 0.3, (C, 1, 3, 3)).astype(np.float32),
        "conv_attrs": {"pads": [1, 1, 1, 1], "group": C},
        "conv_inputs": ("x", "w", "b"),
    },
    "conv1d": {
        "scale": _per_channel((C, 1)),
        "x_shape": (2, 3, 7),
        "weight": RNG.normal(0.0, 0.3, (C, 3, 3)).astype(np.float32),
    },
}


@pytest.mark.parametrize("case", sorted(SCALE_FIRES))
def test_conv_scale_fires(case: str, tmp_path: Path) -> None:
    kwargs = SCALE_FIRES[case]
    run = optimize_checked(_scale_model(tmp_path / f"scale_{case}.onnx", **kwargs), tmp_path)
    assert run.counts(SCALE) == (1, 1)
    assert reasons(run, SCALE) == {}
    assert run.op_counts() == Counter({"Conv": 1})
    (conv,) = _nodes(run.output, "Conv")
    has_bias = "b" in kwargs.get("conv_inputs", ())
    assert list(conv.input) == [
        "x",
        f"{SCALE}/mul/weight",
        *([f"{SCALE}/mul/bias"] if has_bias else []),
    ]
    assert lineage(run) == {f"{SCALE}/mul": ([SCALE], ["conv", "mul"])}


def test_conv_scale_from_constant_node(tmp_path: Path) -> None:
    scale = helper.make_node(
        "Constant",
        [],
        ["s"],
        name="scale",
        value=onnx.numpy_helper.from_array(_per_channel((C, 1, 1))),
    )
    model = _scale_model(tmp_path / "scale_constant.onnx", None, pre_nodes=(scale,))
    run = optimize_checked(model, tmp_path)
    assert run.counts(SCALE) == (1, 1)
    assert run.op_counts() == Counter({"Conv": 1})


NOT_PER_CHANNEL = (
    "scale of rank {rank} does not broadcast per output channel "
    "(it must be [C,1,..], [1,C,1,..] or a scalar)"
)
SCALE_DECLINES = {
    # [C] broadcasts along the last spatial axis (W == C here), not along channels.
    "scale_c": (
        {"scale": _per_channel((C,)), "x_shape": (1, 3, 6, C)},
        NOT_PER_CHANNEL.format(rank=1),
        True,
    ),
    "scale_spatial": (
        {"scale": np.full((1, C, 6, 6), 0.5, np.float32)},
        NOT_PER_CHANNEL.format(rank=4),
        True,
    ),
    "scale_rank5": (
        {"scale": _per_channel((1, 1, C, 1, 1)), "y_shape": (1, 1, C, 6, 6)},
        "scale has more axes than the conv output",
        True,
    ),
    "scale_fed": (
        {"scale": None, "extra_inputs": (value("s", [C, 1, 1]),)},
        plain_input_not_constant("scale"),
        True,
    ),
    "scale_overridable": (
        {"scale": _per_channel((C, 1, 1)), "extra_inputs": (value("s", [C, 1, 1]),)},
        "scale is a graph input (an overridable initializer), not a constant",
        True,
    ),
    "weight_fed": (
        {
            "scale": _per_channel((C, 1, 1)),
            "extra_inputs": (value("w", [C, 3, 3, 3]),),
            "initializers": (),
        },
        plain_input_not_constant("Conv weight"),
        True,
    ),
    "conv_bias_fed": (
        {
            "scale": _per_channel((C, 1, 1)),
            "conv_inputs": ("x", "w", "b"),
            "extra_inputs": (value("b", [C]),),
            "initializers": (const("w", WEIGHT),),
        },
        plain_input_not_constant("Conv bias"),
        True,
    ),
    "conv_output_shared": (
        {
            "scale": _per_channel((C, 1, 1)),
            "extra_nodes": (helper.make_node("Relu", ["conv"], ["r"], name="relu"),),
            "extra_outputs": (value("r", [1, C, 6, 6]),),
        },
        "an intermediate value (Conv output) is also used by Relu outside the match",
        True,
    ),
    "conv_output_is_graph_output": (
        {"scale": _per_channel((C, 1, 1)), "extra_outputs": (value("conv", [1, C, 6, 6]),)},
        "an intermediate value (Conv output) is a graph output",
        True,
    ),
    # Not valid ONNX (Mul needs one element type); fusectl must still leave it alone.
    "dtype_mismatch": (
        {"scale": _per_channel((C, 1, 1)).astype(np.float64), "check": False},
        "scale and Conv weight have different element types",
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(SCALE_DECLINES))
def test_conv_scale_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason, valid = SCALE_DECLINES[case]
    model = _scale_model(tmp_path / f"scale_{case}.onnx", **kwargs)
    run = optimize_checked(model, tmp_path) if valid else optimize(model, tmp_path)
    assert_declined(run, SCALE, reason, "mul")
    assert run.op_counts()["Mul"] == 1
    assert run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"] == {
        SCALE: {"effect_times": "0", "match_times": "1"}
    }


# ---------------------------------------------------------------------------------------------
# PadConv2dFusionPass: x [1,3,5,5] -> Pad -> Conv(w) -> y
# ---------------------------------------------------------------------------------------------


def _pad_model(
    path: Path,
    pads: list[int] | None,
    *,
    opset: int = 17,
    mode: str | None = None,
    fill: float | None = None,
    pad_inputs: list[str] | None = None,
    conv_inputs: tuple[str, ...] = ("p", "w"),
    conv_attrs: dict | None = None,
    weight: np.ndarray = WEIGHT,
    x_shape: tuple[int, ...] = (1, 3, 5, 5),
    y_shape: tuple[int, ...] = (1, C, 5, 5),
    pre_nodes: tuple = (),
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    extra_initializers: tuple = (),
) -> Path:
    """Opset < 11: pads (and value) are attributes; from 11 on, inputs."""
    attrs = {} if mode is None else {"mode": mode}
    initializers = [const("w", weight), const("b", BIAS), *extra_initializers]
    if opset < 11:
        attrs["pads"] = pads
        if fill is not None:
            attrs["value"] = fill
        inputs = ["x"]
    else:
        inputs = pad_inputs or (["x", "pads"] if fill is None else ["x", "pads", "fill"])
        if pads is not None:
            initializers.append(const("pads", pads, np.int64))
        if fill is not None:
            initializers.append(const("fill", fill))
    conv = helper.make_node("Conv", list(conv_inputs), ["y"], name="conv", **(conv_attrs or {}))
    return save_model(
        path,
        [
            *pre_nodes,
            helper.make_node("Pad", inputs, ["p"], name="pad", **attrs),
            conv,
            *extra_nodes,
        ],
        [value("x", list(x_shape)), *extra_inputs],
        [value("y", list(y_shape)), *extra_outputs],
        [i for i in initializers if i.name != "b" or "b" in conv_inputs],
        opset=opset,
        check=True,
    )


PAD_FIRES = {
    "opset10_attribute": (
        {"pads": [0, 0, 1, 2, 0, 0, 1, 2], "opset": 10, "y_shape": (1, C, 5, 7)},
        [1, 2, 1, 2],
    ),
    "opset10_zero_value": (
        {"pads": [0, 0, 1, 1, 0, 0, 1, 1], "opset": 10, "fill": 0.0},
        [1, 1, 1, 1],
    ),
    "opset11_input": ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "opset": 11}, [1, 1, 1, 1]),
    "zero_constant_value": (
        {"pads": [0, 0, 0, 1, 0, 0, 2, 1], "fill": 0.0, "y_shape": (1, C, 5, 5)},
        [0, 1, 2, 1],
    ),
    "empty_constant_value": (
        {"pads": [0, 0, 1, 1, 0, 0, 1, 1], "pad_inputs": ["x", "pads", ""]},
        [1, 1, 1, 1],
    ),
    "adds_to_conv_pads": (
        {"pads": [0, 0, 1, 0, 0, 0, 1, 0], "conv_attrs": {"pads": [0, 1, 0, 1]}},
        [1, 1, 1, 1],
    ),
    "conv_bias_strides": (
        {
            "pads": [0, 0, 1, 1, 0, 0, 1, 1],
            "conv_inputs": ("p", "w", "b"),
            "conv_attrs": {"strides": [2, 2]},
            "y_shape": (1, C, 3, 3),
        },
        [1, 1, 1, 1],
    ),
    "conv1d": (
        {
            "pads": [0, 0, 2, 0, 0, 1],
            "x_shape": (2, 3, 7),
            "y_shape": (2, C, 8),
            "weight": RNG.normal(0.0, 0.3, (C, 3, 3)).astype(np.float32),
        },
        [2, 1],
    ),
}


@pytest.mark.parametrize("case", sorted(PAD_FIRES))
def test_pad_conv_fires(case: str, tmp_path: Path) -> None:
    kwargs, conv_pads = PAD_FIRES[case]
    kwargs = {"y_shape": (1, C, 5, 5), **kwargs}
    run = optimize_checked(_pad_model(tmp_path / f"pad_{case}.onnx", **kwargs), tmp_path)
    assert run.counts(PAD) == (1, 1)
    assert reasons(run, PAD) == {}
    assert run.op_counts() == Counter({"Conv": 1})
    (conv,) = _nodes(run.output, "Conv")
    assert list(_attribute(conv, "pads")) == conv_pads
    assert conv.input[0] == "x"
    assert lineage(run) == {f"{PAD}/conv": ([PAD], ["pad", "conv"])}


def test_pad_conv_amounts_from_constant_node(tmp_path: Path) -> None:
    amounts = helper.make_node(
        "Constant", [], ["pads"], value=onnx.numpy_helper.from_array(np.array([0, 0, 1, 1] * 2))
    )
    model = _pad_model(tmp_path / "pad_constant_node.onnx", None, pre_nodes=(amounts,))
    run = optimize_checked(model, tmp_path)
    assert run.counts(PAD) == (1, 1)
    assert run.op_counts() == Counter({"Conv": 1})


PAD_DECLINES = {
    "value_nonzero": ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "fill": 0.5}, "Pad value is not zero"),
    "value_nonzero_opset10": (
        {"pads": [0, 0, 1, 1, 0, 0, 1, 1], "fill": -1.0, "opset": 10},
        "Pad value is not zero",
    ),
    "value_fed": (
        {
            "pads": [0, 0, 1, 1, 0, 0, 1, 1],
            "pad_inputs": ["x", "pads", "fill"],
            "extra_inputs": (value("fill", []),),
        },
        "Pad value is not a constant",
    ),
    "value_overridable": (
        {
            "pads": [0, 0, 1, 1, 0, 0, 1, 1],
            "fill": 0.0,
            "extra_inputs": (value("fill", []),),
        },
        "Pad value is not a constant",
    ),
    "reflect": ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "mode": "reflect"}, "Pad mode is not constant"),
    "edge": ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "mode": "edge"}, "Pad mode is not constant"),
    "edge_opset10": (
        {"pads": [0, 0, 1, 1, 0, 0, 1, 1], "mode": "edge", "opset": 10},
        "Pad mode is not constant",
    ),
    "channel_axis": (
        {
            "pads": [0, 1, 0, 0, 0, 2, 0, 0],
            "weight": RNG.normal(0.0, 0.3, (C, 6, 3, 3)).astype(np.float32),
            "y_shape": (1, C, 3, 3),
        },
        "Pad pads the batch or channel axis",
    ),
    "batch_axis": (
        {"pads": [1, 0, 1, 1, 0, 0, 1, 1], "y_shape": (2, C, 5, 5)},
        "Pad pads the batch or channel axis",
    ),
    "negative": (
        {"pads": [0, 0, -1, 0, 0, 0, 0, -1], "y_shape": (1, C, 2, 2)},
        "Pad crops (negative amounts)",
    ),
    "auto_pad": (
        {
            "pads": [0, 0, 1, 1, 0, 0, 1, 1],
            "conv_attrs": {"auto_pad": "SAME_UPPER"},
            "y_shape": (1, C, 7, 7),
        },
        "Conv uses auto_pad",
    ),
    "amounts_fed": (
        {"pads": None, "extra_inputs": (value("pads", [8], INT64),)},
        plain_input_not_constant("Pad amounts"),
    ),
    # Computed from a graph input (z * 0 + amounts): known only at run time. A computation of
    # constants alone would be folded into a constant first.
    "amounts_computed": (
        {
            "pads": None,
            "pre_nodes": (
                helper.make_node("Mul", ["z", "zero"], ["offset"], name="mul"),
                helper.make_node("Add", ["offset", "amounts"], ["pads"], name="add"),
            ),
            "extra_inputs": (value("z", [8], INT64),),
            "extra_initializers": (
                const("zero", 0, np.int64),
                const("amounts", [0, 0, 1, 1, 0, 0, 1, 1], np.int64),
            ),
        },
        "Pad amounts is not a constant",
    ),
    "axes_input": (
        {
            "pads": [1, 1, 1, 1],
            "pad_inputs": ["x", "pads", "", "axes"],
            "extra_initializers": (const("axes", [2, 3], np.int64),),
            "opset": 18,
        },
        "Pad has an axes input",
    ),
    "pad_output_shared": (
        {
            "pads": [0, 0, 1, 1, 0, 0, 1, 1],
            "extra_nodes": (helper.make_node("Relu", ["p"], ["r"], name="relu"),),
            "extra_outputs": (value("r", [1, 3, 7, 7]),),
        },
        "an intermediate value (Pad output) is also used by Relu outside the match",
    ),
    "pad_output_is_graph_output": (
        {"pads": [0, 0, 1, 1, 0, 0, 1, 1], "extra_outputs": (value("p", [1, 3, 7, 7]),)},
        "an intermediate value (Pad output) is a graph output",
    ),
}


@pytest.mark.parametrize("case", sorted(PAD_DECLINES))
def test_pad_conv_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = PAD_DECLINES[case]
    kwargs = {"y_shape": (1, C, 5, 5), **kwargs}
    model = _pad_model(tmp_path / f"pad_{case}.onnx", **kwargs)
    # Random pad amounts would give the Conv the wrong number of channels.
    run = optimize_checked(model, tmp_path, compare=case != "amounts_fed")
    assert_declined(run, PAD, reason, "conv")
    assert run.op_counts()["Pad"] == 1
    (conv,) = _nodes(run.output, "Conv")
    assert conv.input[0] == "p"


# ---------------------------------------------------------------------------------------------
# Conv2DTransposeBatchnormFusionPass: x [1,6,3,3] -> ConvTranspose(w[, b]) -> BN -> y
# ---------------------------------------------------------------------------------------------

OUT = 6


def _deconv_model(
    path: Path,
    *,
    group: int = 1,
    bias: bool = False,
    bn_inputs: tuple[str, ...] = ("bn_scale", "bn_bias", "bn_mean", "bn_var"),
    bn_attrs: dict | None = None,
    bn_outputs: tuple[str, ...] = ("y",),
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    skip: tuple[str, ...] = (),
    bn_channels: int = OUT,
    opset: int = 17,
    check: bool = True,
) -> Path:
    weight = np.random.default_rng(group).normal(0.0, 0.3, (6, OUT // group, 3, 3))
    initializers = [const("w", weight), *conv_batchnorm_params(bn_channels)]
    if bias:
        initializers.append(const("b", np.linspace(-0.5, 0.5, OUT)))
    deconv = helper.make_node(
        "ConvTranspose",
        ["x", "w", "b"] if bias else ["x", "w"],
        ["deconv_out"],
        name="deconv",
        group=group,
        strides=[2, 2],
        output_padding=[1, 0],
    )
    bn = helper.make_node(
        "BatchNormalization",
        ["deconv_out", *bn_inputs],
        list(bn_outputs),
        name="bn",
        **(bn_attrs or {}),
    )
    return save_model(
        path,
        [deconv, bn, *extra_nodes],
        [value("x", [1, 6, 3, 3]), *extra_inputs],
        [value("y", [1, OUT, 8, 7]), *extra_outputs],
        [i for i in initializers if i.name not in skip],
        opset=opset,
        check=check,
    )


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_deconv_batchnorm_fires(group: int, bias: bool, tmp_path: Path) -> None:
    model = _deconv_model(tmp_path / f"deconv_g{group}_{bias}.onnx", group=group, bias=bias)
    run = optimize_checked(model, tmp_path)
    assert run.counts(DECONV) == (1, 1)
    assert reasons(run, DECONV) == {}
    assert run.op_counts() == Counter({"ConvTranspose": 1})
    (deconv,) = _nodes(run.output, "ConvTranspose")
    assert list(deconv.input) == ["x", f"{DECONV}/bn/weight", f"{DECONV}/bn/bias"]
    assert _attribute(deconv, "group") == group
    assert list(_attribute(deconv, "output_padding")) == [1, 0]
    assert lineage(run) == {f"{DECONV}/bn": ([DECONV], ["deconv", "bn"])}


def _training_mode_bn() -> dict:
    # The one-output form with training_mode=1 fails the full checker.
    return {
        "bn_attrs": {"training_mode": 1},
        "bn_outputs": ("y", "running_mean", "running_var"),
        "opset": 15,
    }


DECONV_DECLINES = {
    "training_mode": (_training_mode_bn(), "BatchNormalization is in training mode", True),
    "mean_fed": (
        {"skip": ("bn_mean",), "extra_inputs": (value("bn_mean", [OUT]),)},
        plain_input_not_constant("BatchNormalization mean"),
        True,
    ),
    "variance_overridable": (
        {"extra_inputs": (value("bn_var", [OUT]),)},
        "BatchNormalization variance is a graph input (an overridable initializer), not a constant",
        True,
    ),
    "weight_fed": (
        {"skip": ("w",), "extra_inputs": (value("w", [6, OUT, 3, 3]),)},
        plain_input_not_constant("ConvTranspose weight"),
        True,
    ),
    "bias_fed": (
        {"bias": True, "skip": ("b",), "extra_inputs": (value("b", [OUT]),)},
        plain_input_not_constant("bias"),
        True,
    ),
    "deconv_output_shared": (
        {
            "extra_nodes": (helper.make_node("Relu", ["deconv_out"], ["r"], name="relu"),),
            "extra_outputs": (value("r", [1, OUT, 8, 7]),),
        },
        "an intermediate value (ConvTranspose output) is also used by Relu outside the match",
        True,
    ),
    "deconv_output_is_graph_output": (
        {"extra_outputs": (value("deconv_out", [1, OUT, 8, 7]),)},
        "an intermediate value (ConvTranspose output) is a graph output",
        True,
    ),
    # Not a valid model (BN parameters must have C entries); fusectl must still leave it alone.
    "channel_mismatch": (
        {"bn_channels": 2, "check": False},
        "BatchNormalization parameters do not match the output channels",
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(DECONV_DECLINES))
def test_deconv_batchnorm_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason, valid = DECONV_DECLINES[case]
    model = _deconv_model(tmp_path / f"deconv_{case}.onnx", **kwargs)
    run = optimize_checked(model, tmp_path) if valid else optimize(model, tmp_path)
    assert_declined(run, DECONV, reason, "bn")
    assert run.op_counts()["BatchNormalization"] == 1


# ---------------------------------------------------------------------------------------------
# ConvToFullyConnectionFusionPass: a Conv whose kernel covers its whole input
# ---------------------------------------------------------------------------------------------

K = 4
FC_WEIGHT = RNG.normal(0.0, 0.3, (5, 3, K, K)).astype(np.float32)


def _fc_model(
    path: Path,
    *,
    x_shape: tuple = (2, 3, K, K),
    y_shape: tuple = (2, 5, 1, 1),
    weight: np.ndarray | None = FC_WEIGHT,
    bias: bool = False,
    elem: int = onnx.TensorProto.FLOAT,
    pre_nodes: tuple = (),
    conv_input: str = "x",
    extra_inputs: tuple = (),
    opset: int = 17,
    **conv_attrs,
) -> Path:
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    initializers = [] if weight is None else [const("w", weight, dtype)]
    if bias:
        initializers.append(const("b", np.linspace(-1, 1, 5), dtype))
    inputs = [conv_input, "w", "b"] if bias else [conv_input, "w"]
    return save_model(
        path,
        [*pre_nodes, helper.make_node("Conv", inputs, ["y"], name="conv", **conv_attrs)],
        [value("x", list(x_shape), elem), *extra_inputs],
        [value("y", list(y_shape), elem)],
        initializers,
        opset=opset,
    )


FC_FIRES = {
    "bias_dynamic_batch": {"bias": True, "x_shape": ("N", 3, K, K), "y_shape": ("N", 5, 1, 1)},
    "no_bias_strides": {"strides": [2, 3]},
    "explicit_zero_pads": {"pads": [0, 0, 0, 0], "dilations": [1, 1]},
    "auto_pad_valid": {"auto_pad": "VALID"},
    "conv1d": {
        "x_shape": (2, 3, K),
        "y_shape": (2, 5, 1),
        "weight": RNG.normal(0.0, 0.3, (5, 3, K)).astype(np.float32),
    },
    # The Relu output has no recorded shape: fusectl infers it.
    "input_shape_inferred": {
        "pre_nodes": (helper.make_node("Relu", ["x"], ["r"], name="relu"),),
        "conv_input": "r",
    },
}


@pytest.mark.parametrize("case", sorted(FC_FIRES))
def test_conv_to_fully_connected_fires(case: str, tmp_path: Path) -> None:
    kwargs = FC_FIRES[case]
    run = optimize_checked(_fc_model(tmp_path / f"fc_{case}.onnx", **kwargs), tmp_path, *ENABLE_FC)
    assert run.counts(FC) == (1, 1)
    assert reasons(run, FC) == {}
    ops = run.op_counts()
    assert ops - Counter({"Relu": 1}) == Counter({"Flatten": 1, "Gemm": 1, "Reshape": 1})
    (gemm,) = _nodes(run.output, "Gemm")
    assert len(gemm.input) == (3 if kwargs.get("bias") else 2)
    assert _attribute(gemm, "transB") == 1
    base = f"{FC}/conv"
    assert lineage(run) == {name: ([FC], ["conv"]) for name in (base, f"{base}_1", f"{base}_2")}


@pytest.mark.parametrize(
    ("x_shape", "y_shape"),
    [((2, 3, K + 1, K + 1), (2, 5, 2, 2)), ((2, 3, "H", "W"), (2, 5, "h", "w"))],
    ids=["kernel_smaller_than_input", "dynamic_spatial"],
)
def test_conv_to_fully_connected_not_a_candidate(x_shape, y_shape, tmp_path: Path) -> None:
    """A Conv that does not cover its (static) input is no match at all."""
    model = _fc_model(tmp_path / "fc_no_candidate.onnx", x_shape=x_shape, y_shape=y_shape)
    # Random inputs give symbolic dimensions the size 2, smaller than the kernel.
    run = optimize_checked(model, tmp_path, *ENABLE_FC, compare=isinstance(x_shape[2], int))
    assert run.counts(FC) == (0, 0)
    assert reasons(run, FC) == {}
    assert run.op_counts() == Counter({"Conv": 1})


FC_DECLINES = {
    "grouped": (
        {
            "weight": RNG.normal(0.0, 0.3, (6, 1, K, K)).astype(np.float32),
            "y_shape": (2, 6, 1, 1),
            "group": 3,
        },
        "grouped Conv",
    ),
    # Dilation 2 needs padding to fit a 3x3 kernel into a 3x3 input; dilation is checked first.
    "dilated": (
        {
            "weight": RNG.normal(0.0, 0.3, (5, 3, 3, 3)).astype(np.float32),
            "x_shape": (2, 3, 3, 3),
            "dilations": [2, 2],
            "pads": [1, 1, 1, 1],
        },
        "dilated Conv",
    ),
    "padded": ({"pads": [1, 1, 1, 1], "y_shape": (2, 5, 3, 3)}, "padded Conv"),
    "auto_pad_same": ({"auto_pad": "SAME_UPPER", "y_shape": (2, 5, K, K)}, "padded Conv"),
    "weight_fed": (
        {"weight": None, "extra_inputs": (value("w", [5, 3, K, K]),)},
        plain_input_not_constant("Conv weight"),
    ),
}


@pytest.mark.parametrize("case", sorted(FC_DECLINES))
def test_conv_to_fully_connected_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = FC_DECLINES[case]
    run = optimize_checked(_fc_model(tmp_path / f"fc_{case}.onnx", **kwargs), tmp_path, *ENABLE_FC)
    assert_declined(run, FC, reason, "conv")
    assert run.op_counts() == Counter({"Conv": 1})


def test_conv_to_fully_connected_half_precision(tmp_path: Path) -> None:
    """onnxruntime's CPU provider runs a float16 Gemm in float32, casting around it: converted,
    and it computes what the Conv did. No provider runs a bfloat16 Gemm: declined for --target
    ort, converted for onnx (which onnxruntime cannot run: only the checker)."""
    half = _fc_model(tmp_path / "fc_fp16.onnx", elem=FLOAT16)
    run = optimize_checked(half, tmp_path, *ENABLE_FC, atol=1e-2)
    assert run.counts(FC) == (1, 1)
    assert run.op_counts() == Counter({"Flatten": 1, "Gemm": 1, "Reshape": 1})
    model = _fc_model(tmp_path / "fc_bf16.onnx", elem=BFLOAT16, opset=22)  # bfloat16 Conv: 22
    run = optimize_checked(model, tmp_path, *ENABLE_FC, compare=False)
    assert_declined(run, FC, "onnxruntime has no Gemm kernel for BFLOAT16", "conv")
    assert run.op_counts() == Counter({"Conv": 1})
    onnx_run = optimize_checked(model, tmp_path, "--target", "onnx", *ENABLE_FC, compare=False)
    assert onnx_run.counts(FC) == (1, 1)
    assert onnx_run.op_counts() == Counter({"Flatten": 1, "Gemm": 1, "Reshape": 1})


def test_conv_to_fully_connected_with_relu_leaves_no_fused_conv(tmp_path: Path) -> None:
    """Graph fusion runs first: the Relu then follows a Reshape, so FusedConv is not made."""
    model = save_model(
        tmp_path / "fc_relu.onnx",
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        [value("x", [2, 3, K, K])],
        [value("y", [2, 5, 1, 1])],
        [const("w", FC_WEIGHT)],
    )
    run = optimize_checked(model, tmp_path, *ENABLE_FC)
    assert run.counts(FC) == (1, 1)
    assert run.counts(ACT) == (0, 0)
    assert run.op_counts() == Counter({"Flatten": 1, "Gemm": 1, "Reshape": 1, "Relu": 1})
    off = optimize_checked(model, tmp_path, "--disable_pass", "conv_to_fully_connection")
    assert off.counts(ACT) == (1, 1)
    assert off.op_counts() == Counter({"FusedConv": 1})
    # Off by default: the Conv and its Relu become one FusedConv.
    default = optimize_checked(model, tmp_path)
    assert default.passed(FC)["state"] == "off"
    assert default.counts(FC) == (0, 0)
    assert default.counts(ACT) == (1, 1)
    assert default.op_counts() == Counter({"FusedConv": 1})
