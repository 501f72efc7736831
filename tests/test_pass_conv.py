"""ConvBatchnormFusionPass and ConvBiasAddFusionPass: exporter fixtures, near misses, the zoo."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests import zoo
from tests.conftest import assert_same_outputs, optimize
from tests.pass_helpers import (
    assert_declined,
    check_output,
    const,
    conv_batchnorm_params,
    fixture_path,
    optimize_checked,
    plain_input_not_constant,
    reasons,
    save_model,
    value,
)

BN = "ConvBatchnormFusionPass"
BIAS_ADD = "ConvBiasAddFusionPass"
ACT = "ConvActivationFusionPass"

# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py). Per fixture: (matched, effected,
# near-miss reasons) for each pass, and the op counts of the optimized model.
# cnn = Conv(no bias)+BN+ReLU, Conv(bias)+BN, depthwise Conv+BN, Conv + [4,1,1] bias, Linear.
# ---------------------------------------------------------------------------------------------

NOT_CONSTANT_BIAS = "Conv bias is not a constant"
CNN_EXPECTED = {
    # TorchScript, training=PRESERVE: the three BNs survive export and all fold.
    "cnn_torchscript": {
        BN: (3, 3, {}),
        BIAS_ADD: (1, 1, {}),
        ACT: (1, 1, {}),
        "ops": {"Conv": 3, "FusedConv": 1, "Flatten": 1, "Gemm": 1},
    },
    # TorchScript defaults (EVAL): the exporter already folded every BN.
    "cnn_torchscript_eval": {
        BN: (0, 0, {}),
        BIAS_ADD: (1, 1, {}),
        ACT: (1, 1, {}),
        "ops": {"Conv": 3, "FusedConv": 1, "Flatten": 1, "Gemm": 1},
    },
    # dynamo defaults (optimize=True): onnxscript's optimizer already folded every BN.
    "cnn_dynamo": {
        BN: (0, 0, {}),
        BIAS_ADD: (1, 1, {}),
        ACT: (1, 1, {}),
        "ops": {"Conv": 3, "FusedConv": 1, "Reshape": 1, "Gemm": 1},
    },
    # dynamo, optimize=False: bias-less Convs get a zero bias computed by Expand(CastLike(0)),
    # which ConstantFoldingPass turns into a constant: every BN folds, as in the other exports.
    "cnn_dynamo_noopt": {
        BN: (3, 3, {}),
        BIAS_ADD: (1, 1, {}),
        ACT: (1, 1, {}),
        "ops": {"Conv": 3, "FusedConv": 1, "Reshape": 1, "Gemm": 1},
    },
}


@pytest.mark.parametrize("name", sorted(CNN_EXPECTED))
def test_exported_cnn(name: str, tmp_path: Path) -> None:
    expected = CNN_EXPECTED[name]
    run = optimize_checked(fixture_path(name), tmp_path)
    for pass_name in (BN, BIAS_ADD, ACT):
        matched, effected, near_misses = expected[pass_name]
        assert run.counts(pass_name) == (matched, effected), pass_name
        assert reasons(run, pass_name) == near_misses, pass_name
    assert run.op_counts() == Counter(expected["ops"])


def test_exported_cnn_noopt_folds_computed_biases(tmp_path: Path) -> None:
    """The zero biases (Shape/CastLike/Expand) and the Linear's flatten shape (Concat) are
    folded first; the Constants they read are then dead."""
    run = optimize(fixture_path("cnn_dynamo_noopt"), tmp_path)
    assert run.passed("ConstantFoldingPass")["patterns"] == {
        "Shape": {"matched": 3, "effected": 3},
        "Expand": {"matched": 6, "effected": 6},
        "CastLike": {"matched": 3, "effected": 3},
        "Concat": {"matched": 1, "effected": 1},
    }
    assert run.fusion_result == {
        "session_and_graph_id_0_0": {
            "graph_fusion": {
                "ConstantFoldingPass": {"effect_times": "13", "match_times": "13"},
                BN: {"effect_times": "3", "match_times": "3"},
                BIAS_ADD: {"effect_times": "1", "match_times": "1"},
            },
            "ub_fusion": {
                ACT: {"effect_times": "1", "match_times": "1", "repository_hit_times": "0"}
            },
        }
    }


def test_exported_cnn_fusion_result(tmp_path: Path) -> None:
    run = optimize(fixture_path("cnn_torchscript"), tmp_path)
    assert run.fusion_result == {
        "session_and_graph_id_0_0": {
            "graph_fusion": {
                BN: {"effect_times": "3", "match_times": "3"},
                BIAS_ADD: {"effect_times": "1", "match_times": "1"},
            },
            "ub_fusion": {
                ACT: {"effect_times": "1", "match_times": "1", "repository_hit_times": "0"}
            },
        }
    }


def test_exported_cnn_fused_sites(tmp_path: Path) -> None:
    """The depthwise Conv keeps its group attribute; each fused Conv names its originals."""
    run = optimize(fixture_path("cnn_torchscript"), tmp_path)
    sites = run.passed(BN)["sites"]
    assert [site["original_types"] for site in sites] == [["Conv", "BatchNormalization"]] * 3
    groups = sorted(
        next((a.i for a in node.attribute if a.name == "group"), 1)
        for node in onnx.load(str(run.output)).graph.node
        if node.op_type in ("Conv", "FusedConv")
    )
    assert groups == [1, 1, 1, 8]


# ---------------------------------------------------------------------------------------------
# Conv + BatchNormalization built with onnx.helper
# ---------------------------------------------------------------------------------------------

C = 4
X = value("x", [1, 3, 6, 6])


def _weight(name: str = "w", shape: tuple[int, ...] = (C, 3, 3, 3), seed: int = 1):
    return const(name, np.random.default_rng(seed).normal(0.0, 0.3, shape))


def _conv(inputs: list[str], output: str = "conv", name: str = "conv", **attrs):
    return helper.make_node("Conv", inputs, [output], name=name, pads=[1, 1, 1, 1], **attrs)


def _bn(data: str = "conv", output: str = "y", prefix: str = "bn", name: str = "bn", **attrs):
    params = [f"{prefix}_{p}" for p in ("scale", "bias", "mean", "var")]
    return helper.make_node("BatchNormalization", [data, *params], [output], name=name, **attrs)


def _conv_bn_model(path: Path, **overrides) -> Path:
    """x -> Conv(w[, b]) -> BN -> y, with parts replaced by keyword."""
    spec = {
        "nodes": [_conv(["x", "w"]), _bn()],
        "inputs": [X],
        "outputs": [value("y", [1, C, 6, 6])],
        "initializers": [_weight(), *conv_batchnorm_params(C)],
    }
    spec.update(overrides)
    opset = spec.pop("opset", 17)
    check = spec.pop("check", True)
    return save_model(path, opset=opset, check=check, **spec)


def _fires_conv_bias(path: Path) -> Path:
    return _conv_bn_model(
        path,
        nodes=[_conv(["x", "w", "b"]), _bn()],
        initializers=[_weight(), const("b", [0.1, -0.2, 0.3, 0.0]), *conv_batchnorm_params(C)],
    )


def _fires_conv1d(path: Path) -> Path:
    return _conv_bn_model(
        path,
        nodes=[helper.make_node("Conv", ["x", "w"], ["conv"], name="conv"), _bn()],
        inputs=[value("x", [2, 3, 7])],
        outputs=[value("y", [2, C, 5])],
        initializers=[_weight(shape=(C, 3, 3)), *conv_batchnorm_params(C)],
    )


def _fires_empty_bias_input(path: Path) -> Path:
    """Conv(x, w, "") : the optional bias named but left out."""
    return _conv_bn_model(path, nodes=[_conv(["x", "w", ""]), _bn()])


def _fires_shared_weight(path: Path) -> Path:
    """Two Convs share one weight initializer, each with its own BN (and its own input: two
    Convs of the same input would be one computation, merged before any fusion)."""
    return _conv_bn_model(
        path,
        nodes=[
            _conv(["x", "w"]),
            _bn(),
            _conv(["x2", "w"], output="conv2", name="conv2"),
            _bn("conv2", "y2", prefix="bn2", name="bn2"),
        ],
        inputs=[X, value("x2", [1, 3, 6, 6])],
        outputs=[value("y", [1, C, 6, 6]), value("y2", [1, C, 6, 6])],
        initializers=[
            _weight(),
            *conv_batchnorm_params(C),
            *conv_batchnorm_params(C, prefix="bn2", seed=2),
        ],
    )


def _params_behind_identity(path: Path) -> Path:
    """As the TorchScript exporter writes BN parameters equal to others (e.g. fresh BNs)."""
    bn = helper.make_node(
        "BatchNormalization", ["conv", "scale", "bn_bias", "bn_mean", "bn_var"], ["y"], name="bn"
    )
    return _conv_bn_model(
        path,
        nodes=[
            helper.make_node("Identity", ["bn_scale"], ["scale"], name="identity"),
            _conv(["x", "w"]),
            bn,
        ],
    )


@pytest.mark.parametrize(
    ("build", "effected"),
    [
        (_fires_conv_bias, 1),
        (_fires_conv1d, 1),
        pytest.param(_fires_empty_bias_input, 1),
        (_fires_shared_weight, 2),
        (_params_behind_identity, 1),
    ],
    ids=["conv_bias", "conv1d", "empty_bias_input", "shared_weight", "params_behind_identity"],
)
def test_conv_batchnorm_fires(build, effected: int, tmp_path: Path) -> None:
    model = build(tmp_path / f"{build.__name__.lstrip('_')}.onnx")
    run = optimize_checked(model, tmp_path)
    assert run.counts(BN) == (effected, effected)
    assert reasons(run, BN) == {}
    assert run.op_counts() == Counter({"Conv": effected})


def test_conv_batchnorm_float16(tmp_path: Path) -> None:
    """Folded in float64, stored back in float16."""
    f16 = onnx.TensorProto.FLOAT16
    model = _conv_bn_model(
        tmp_path / "fp16.onnx",
        inputs=[value("x", [1, 3, 6, 6], f16)],
        outputs=[value("y", [1, C, 6, 6], f16)],
        initializers=[
            const(t.name, onnx.numpy_helper.to_array(t), np.float16)
            for t in [_weight(), *conv_batchnorm_params(C)]
        ],
    )
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(BN) == (1, 1)
    assert run.op_counts() == Counter({"Conv": 1})
    assert_same_outputs(model, run.output, atol=1e-2, rtol=1e-2)


def test_conv_add_batchnorm_chain(tmp_path: Path) -> None:
    """Conv -> Add(bias) -> BN: one ConvBatchnorm rule folds the Add and the BN together."""
    model = _conv_bn_model(
        tmp_path / "conv_add_bn.onnx",
        nodes=[
            _conv(["x", "w"]),
            helper.make_node("Add", ["conv", "add_bias"], ["a"], name="add"),
            _bn("a"),
        ],
        initializers=[
            _weight(),
            const("add_bias", np.arange(C, dtype=np.float32).reshape(C, 1, 1) / 10),
            *conv_batchnorm_params(C),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(BIAS_ADD) == (0, 0)
    assert run.counts(BN) == (1, 1)
    assert run.passed(BN)["patterns"]["ConvAddBatchnorm"] == {"matched": 1, "effected": 1}
    assert run.op_counts() == Counter({"Conv": 1})


def test_conv_batchnorm_add_chain(tmp_path: Path) -> None:
    """Conv -> BN -> Add(per-channel): one rule folds all three into the Conv."""
    model = _conv_bn_model(
        tmp_path / "conv_bn_add.onnx",
        nodes=[
            _conv(["x", "w"]),
            _bn(output="bn_out"),
            helper.make_node("Add", ["add_bias", "bn_out"], ["y"], name="add"),
        ],
        initializers=[
            _weight(),
            const("add_bias", np.arange(C, dtype=np.float32).reshape(1, C, 1, 1) / 10),
            *conv_batchnorm_params(C),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(BN) == (1, 1)
    assert run.passed(BN)["patterns"] == {
        "ConvBatchnormAdd": {"matched": 1, "effected": 1},
        "ConvAddBatchnorm": {"matched": 0, "effected": 0},
        "ConvBatchnorm": {"matched": 0, "effected": 0},
    }
    assert run.counts(BIAS_ADD) == (0, 0)
    assert run.op_counts() == Counter({"Conv": 1})


def _conv_output_is_graph_output(path: Path) -> Path:
    return _conv_bn_model(path, outputs=[value("y", [1, C, 6, 6]), value("conv", [1, C, 6, 6])])


def _conv_output_shared(path: Path) -> Path:
    return _conv_bn_model(
        path,
        nodes=[_conv(["x", "w"]), _bn(), helper.make_node("Relu", ["conv"], ["r"], name="relu")],
        outputs=[value("y", [1, C, 6, 6]), value("r", [1, C, 6, 6])],
    )


def _training_mode(path: Path) -> Path:
    # The one-output form with training_mode=1 fails the full checker ("number of op outputs
    # should be 3"), so this is the three-output form with unused running statistics.
    bn = helper.make_node(
        "BatchNormalization",
        ["conv", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
        ["y", "running_mean", "running_var"],
        name="bn",
        training_mode=1,
    )
    return _conv_bn_model(path, nodes=[_conv(["x", "w"]), bn], opset=15)


def _mean_is_graph_input(path: Path) -> Path:
    scale, bias, _, var = conv_batchnorm_params(C)
    return _conv_bn_model(
        path, inputs=[X, value("bn_mean", [C])], initializers=[_weight(), scale, bias, var]
    )


def _variance_is_overridable_initializer(path: Path) -> Path:
    return _conv_bn_model(path, inputs=[X, value("bn_var", [C])])


def _weight_is_graph_input(path: Path) -> Path:
    return _conv_bn_model(
        path,
        inputs=[X, value("w", [C, 3, 3, 3])],
        initializers=conv_batchnorm_params(C),
    )


def _conv_bias_is_graph_input(path: Path) -> Path:
    return _conv_bn_model(path, nodes=[_conv(["x", "w", "b"]), _bn()], inputs=[X, value("b", [C])])


def _conv_bias_computed(path: Path) -> Path:
    """The bias is computed at run time from a graph input (exporters' computed zero biases
    are folded into constants first, so they no longer show this)."""
    return _conv_bn_model(
        path,
        nodes=[
            helper.make_node("Relu", ["b_in"], ["b"], name="relu"),
            _conv(["x", "w", "b"]),
            _bn(),
        ],
        inputs=[X, value("b_in", [C])],
    )


def _channel_mismatch(path: Path) -> Path:
    # Not a valid model (BN parameters must have C entries); fusectl must still leave it alone.
    return _conv_bn_model(path, initializers=[_weight(), *conv_batchnorm_params(1)], check=False)


def _spatial_zero(path: Path) -> Path:
    # opset 8 BN with spatial=0 wants [C, H, W] statistics; onnxruntime rejects these.
    return _conv_bn_model(path, nodes=[_conv(["x", "w"]), _bn(spatial=0)], opset=8, check=False)


CONV_BN_DECLINES = [
    (_conv_output_is_graph_output, "an intermediate value (Conv output) is a graph output", True),
    (
        _conv_output_shared,
        "an intermediate value (Conv output) is also used by Relu outside the match",
        True,
    ),
    (_training_mode, "BatchNormalization is in training mode", True),
    (_mean_is_graph_input, plain_input_not_constant("BatchNormalization mean"), True),
    (
        _variance_is_overridable_initializer,
        "BatchNormalization variance is a graph input (an overridable initializer), not a constant",
        True,
    ),
    (_weight_is_graph_input, plain_input_not_constant("Conv weight"), True),
    (_conv_bias_is_graph_input, plain_input_not_constant("Conv bias"), True),
    (_conv_bias_computed, NOT_CONSTANT_BIAS, True),
    (
        _channel_mismatch,
        "BatchNormalization parameters do not match the output channels",
        False,
    ),
    (_spatial_zero, "BatchNormalization has spatial=0", False),
]


@pytest.mark.parametrize(
    ("build", "reason", "valid"),
    CONV_BN_DECLINES,
    ids=[build.__name__.lstrip("_") for build, _, _ in CONV_BN_DECLINES],
)
def test_conv_batchnorm_declines(build, reason, valid: bool, tmp_path: Path) -> None:
    model = build(tmp_path / f"{build.__name__.lstrip('_')}.onnx")
    run = optimize_checked(model, tmp_path) if valid else optimize(model, tmp_path)
    assert_declined(run, BN, reason, "bn")
    assert run.op_counts()["BatchNormalization"] == 1
    assert run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"] == {
        BN: {"effect_times": "0", "match_times": "1"}
    }


# ---------------------------------------------------------------------------------------------
# Conv + per-channel bias Add built with onnx.helper
# ---------------------------------------------------------------------------------------------


NOT_PER_CHANNEL = (
    "added bias of rank {rank} does not broadcast per output channel "
    "(it must be [C,1,..], [1,C,1,..] or a scalar)"
)


def _conv_add_model(
    path: Path,
    bias: np.ndarray | None,
    *,
    conv_inputs: tuple[str, ...] = ("x", "w"),
    bias_first: bool = False,
    x_shape: tuple[int, ...] = (1, 3, 6, 6),
    y_shape: tuple[int, ...] | None = None,
    extra_nodes: tuple = (),
    extra_outputs: tuple = (),
    extra_inputs: tuple = (),
    initializers: tuple = (),
    check: bool = True,
) -> Path:
    add_inputs = ["bias", "conv"] if bias_first else ["conv", "bias"]
    inits = [_weight(), *initializers]
    if bias is not None:
        inits.append(const("bias", bias, bias.dtype.type))
    return save_model(
        path,
        [
            _conv(list(conv_inputs)),
            helper.make_node("Add", add_inputs, ["y"], name="add"),
            *extra_nodes,
        ],
        [value("x", list(x_shape)), *extra_inputs],
        [value("y", list(y_shape or (x_shape[0], C, *x_shape[2:]))), *extra_outputs],
        inits,
        check=check,
    )


def _per_channel(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(1, C + 1, dtype=np.float32).reshape(shape) / 10


BIAS_ADD_FIRES = {
    "c11": {"bias": _per_channel((C, 1, 1))},
    "1c11": {"bias": _per_channel((1, C, 1, 1))},
    "bias_first": {"bias": _per_channel((1, C, 1, 1)), "bias_first": True},
    "scalar": {"bias": np.array(0.5, np.float32)},
    "one": {"bias": np.array([0.5], np.float32)},
    "conv_has_bias": {
        "bias": _per_channel((C, 1, 1)),
        "conv_inputs": ("x", "w", "b"),
        "initializers": (const("b", [0.1, -0.2, 0.3, 0.0]),),
    },
}


@pytest.mark.parametrize(
    "case",
    [
        *sorted(BIAS_ADD_FIRES),
        pytest.param("empty_conv_bias_input"),
    ],
)
def test_conv_bias_add_fires(case: str, tmp_path: Path) -> None:
    kwargs = BIAS_ADD_FIRES.get(case) or {
        "bias": _per_channel((C, 1, 1)),
        "conv_inputs": ("x", "w", ""),
    }
    model = _conv_add_model(tmp_path / f"bias_{case}.onnx", **kwargs)
    run = optimize_checked(model, tmp_path)
    assert run.counts(BIAS_ADD) == (1, 1)
    assert reasons(run, BIAS_ADD) == {}
    assert run.op_counts() == Counter({"Conv": 1})
    conv = onnx.load(str(run.output)).graph.node[0]
    assert len(conv.input) == 3


def test_conv_bias_add_alias_switch(tmp_path: Path) -> None:
    """The Ascend name AABiasaddConvFusion switches the pass off."""
    model = _conv_add_model(tmp_path / "alias.onnx", _per_channel((C, 1, 1)))
    run = optimize(model, tmp_path, "--disable_pass", "AABiasaddConvFusion")
    assert run.counts(BIAS_ADD) == (0, 0)
    assert run.op_counts() == Counter({"Conv": 1, "Add": 1})


BIAS_ADD_DECLINES = {
    # [C] broadcasts along the last spatial axis (W == C here), not along channels.
    "bias_c": (
        {"bias": _per_channel((C,)), "x_shape": (1, 3, 6, C)},
        NOT_PER_CHANNEL.format(rank=1),
        True,
    ),
    "bias_spatial": (
        {"bias": np.full((1, C, 6, 6), 0.5, np.float32)},
        NOT_PER_CHANNEL.format(rank=4),
        True,
    ),
    "bias_c111": (
        {"bias": _per_channel((C, 1, 1, 1)), "y_shape": (C, C, 6, 6)},
        NOT_PER_CHANNEL.format(rank=4),
        True,
    ),
    "bias_rank5": (
        {"bias": _per_channel((1, 1, C, 1, 1)), "y_shape": (1, 1, C, 6, 6)},
        "added bias has more axes than the conv output",
        True,
    ),
    "bias_graph_input": (
        {"bias": None, "extra_inputs": (value("bias", [C, 1, 1]),)},
        plain_input_not_constant("added bias"),
        True,
    ),
    "bias_overridable": (
        {"bias": _per_channel((C, 1, 1)), "extra_inputs": (value("bias", [C, 1, 1]),)},
        "added bias is a graph input (an overridable initializer), not a constant",
        True,
    ),
    "conv_bias_graph_input": (
        {
            "bias": _per_channel((C, 1, 1)),
            "conv_inputs": ("x", "w", "b"),
            "extra_inputs": (value("b", [C]),),
        },
        plain_input_not_constant("Conv bias"),
        True,
    ),
    "conv_output_shared": (
        {
            "bias": _per_channel((C, 1, 1)),
            "extra_nodes": (helper.make_node("Relu", ["conv"], ["r"], name="relu"),),
            "extra_outputs": (value("r", [1, C, 6, 6]),),
        },
        "an intermediate value (Conv output) is also used by Relu outside the match",
        True,
    ),
    "conv_output_is_graph_output": (
        {"bias": _per_channel((C, 1, 1)), "extra_outputs": (value("conv", [1, C, 6, 6]),)},
        "an intermediate value (Conv output) is a graph output",
        True,
    ),
    # Not valid ONNX (Add needs one element type); fusectl must still leave it alone.
    "dtype_mismatch": (
        {"bias": _per_channel((C, 1, 1)).astype(np.float64), "check": False},
        "added bias and Conv weight have different element types",
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(BIAS_ADD_DECLINES))
def test_conv_bias_add_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason, valid = BIAS_ADD_DECLINES[case]
    model = _conv_add_model(tmp_path / f"bias_{case}.onnx", **kwargs)
    run = optimize_checked(model, tmp_path) if valid else optimize(model, tmp_path)
    assert_declined(run, BIAS_ADD, reason, "add")
    assert run.op_counts()["Add"] == 1


# ---------------------------------------------------------------------------------------------
# The onnx wheel's zoo CNNs: every BatchNormalization fed by a Conv is folded, and every
# activation a Conv (or its folded BatchNormalization / scale / bias) feeds becomes FusedConv.
# ---------------------------------------------------------------------------------------------

# name: (Conv -> BN pairs in the input, Conv + activation fused into FusedConv)
ZOO_EXPECTED = {
    "resnet50": (53, 49),  # 16 of the 49 with the residual Sum as FusedConv's fourth input
    "densenet121": (59, 59),  # its other 62 BNs follow a Concat or a pooling
    "inception_v1": (0, 57),
    "inception_v2": (69, 69),  # Conv -> BN -> Mul -> Add -> Relu folds whole
    "shufflenet": (49, 30),
    "squeezenet": (0, 26),
    "vgg19": (0, 16),
    "zfnet512": (0, 5),
    "bvlc_alexnet": (0, 5),
}
ACTIVATIONS = {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "Clip", "HardSigmoid"}


def _zoo_model(name: str, zoo_dir: Path) -> Path:
    path = zoo_dir / f"{name}.onnx"
    return path if path.exists() else zoo.materialize(name, zoo_dir)


def _conv_bn_pairs(model: onnx.ModelProto) -> int:
    producers = {out: node for node in model.graph.node for out in node.output}
    return sum(
        1
        for node in model.graph.node
        if node.op_type == "BatchNormalization"
        and getattr(producers.get(node.input[0]), "op_type", None) == "Conv"
    )


def _activations_after_conv(model: onnx.ModelProto) -> int:
    producers = {out: node for node in model.graph.node for out in node.output}
    return sum(
        1
        for node in model.graph.node
        if node.op_type in ACTIVATIONS
        and getattr(producers.get(node.input[0]), "op_type", None) in ("Conv", "FusedConv")
    )


@pytest.mark.parametrize("name", zoo.ZOO)
def test_zoo_cnn_fully_fused(name: str, zoo_dir: Path, tmp_path: Path) -> None:
    model = _zoo_model(name, zoo_dir)
    pairs, fused = ZOO_EXPECTED[name]
    assert _conv_bn_pairs(onnx.load(str(model), load_external_data=False)) == pairs
    run = optimize(model, tmp_path)
    assert run.counts(BN) == (pairs, pairs)
    assert reasons(run, BN) == {}
    assert run.counts(ACT) == (fused, fused)
    optimized = onnx.load(str(run.output))
    assert _conv_bn_pairs(optimized) == 0
    assert _activations_after_conv(optimized) == 0
    assert Counter(n.op_type for n in optimized.graph.node)["FusedConv"] == fused
    check_output(run)
    assert_same_outputs(model, run.output, atol=1e-4)
    # --target onnx keeps standard ops only: the BatchNormalizations still fold.
    portable = optimize(model, tmp_path, "--target", "onnx")
    assert portable.counts(BN) == (pairs, pairs)
    assert {n.domain for n in onnx.load(str(portable.output)).graph.node} <= {"", "ai.onnx"}
