"""ConvActivationFusionPass and GemmActivationFusionPass (UB, com.microsoft FusedConv /
FusedGemm): exporter fixtures, near misses built with onnx.helper, and --target onnx."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import optimize, run_cli, run_model
from tests.pass_helpers import (
    assert_declined,
    const,
    fixture_path,
    lineage,
    optimize_checked,
    plain_input_not_constant,
    reasons,
    save_model,
    value,
)

CONV = "ConvActivationFusionPass"
GEMM = "GemmActivationFusionPass"
MS = "com.microsoft"
FLOAT_MAX = float(np.finfo(np.float32).max)


def _fused(path: Path, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == op_type]


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _patterns(run, name: str) -> dict[str, tuple[int, int]]:
    """The pass's patterns that matched something: name -> (matched, effected)."""
    return {
        pattern: (counts["matched"], counts["effected"])
        for pattern, counts in run.passed(name)["patterns"].items()
        if counts["matched"]
    }


# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py).
# ---------------------------------------------------------------------------------------------

FIXTURE_EXPECTED = {
    # name: ({pass: {pattern: (matched, effected)}}, FusedConv/FusedGemm count with 4 inputs)
    # cnn: Conv+BN+ReLU (the BN folds first, in graph fusion).
    "cnn_torchscript": ({CONV: {"ConvRelu": (1, 1)}, GEMM: {}}, 0),
    "cnn_torchscript_eval": ({CONV: {"ConvRelu": (1, 1)}, GEMM: {}}, 0),
    "cnn_dynamo": ({CONV: {"ConvRelu": (1, 1)}, GEMM: {}}, 0),
    # The computed zero bias is folded into a constant first, so the BN folds as well.
    "cnn_dynamo_noopt": ({CONV: {"ConvRelu": (1, 1)}, GEMM: {}}, 0),
    # resnet: every Relu, four of them after the residual Add of a bottleneck.
    "resnet_tiny_torchscript": ({CONV: {"ConvAddRelu": (4, 4), "ConvRelu": (9, 9)}, GEMM: {}}, 4),
    "resnet_tiny_dynamo": ({CONV: {"ConvAddRelu": (4, 4), "ConvRelu": (9, 9)}, GEMM: {}}, 4),
    "resnet_basic_tiny_torchscript": (
        {CONV: {"ConvAddRelu": (4, 4), "ConvRelu": (5, 5)}, GEMM: {}},
        4,
    ),
    # mobilenetv2: ReLU6 is Clip(0, 6). ConvToFullyConnectionFusionPass is off by default, so
    # no Conv became a Gemm first: all 35 fuse in both exports.
    "mobilenetv2_tiny_torchscript": ({CONV: {"ConvClip": (35, 35)}, GEMM: {}}, 0),
    "mobilenetv2_tiny_dynamo": ({CONV: {"ConvClip": (35, 35)}, GEMM: {}}, 0),
    # mlp: two MatMul+Add+ReLU, made Gemm by MatMulBiasAddFusionPass first.
    "mlp_torchscript": ({CONV: {}, GEMM: {"GemmRelu": (2, 2)}}, 0),
    "mlp_dynamo": ({CONV: {}, GEMM: {"GemmRelu": (2, 2)}}, 0),
}


@pytest.mark.parametrize("name", sorted(FIXTURE_EXPECTED))
def test_exported_fixtures(name: str, tmp_path: Path) -> None:
    expected, residuals = FIXTURE_EXPECTED[name]
    run = optimize_checked(fixture_path(name), tmp_path)
    for pass_name, patterns in expected.items():
        total = sum(m for m, _ in patterns.values()), sum(e for _, e in patterns.values())
        assert run.counts(pass_name) == total, pass_name
        assert _patterns(run, pass_name) == patterns, pass_name
        assert reasons(run, pass_name) == {}, pass_name
    ops = run.op_counts()
    assert ops["FusedConv"] == run.counts(CONV)[1]
    assert ops["FusedGemm"] == run.counts(GEMM)[1]
    fused = _fused(run.output, "FusedConv")
    assert sum(len(node.input) == 4 for node in fused) == residuals
    assert all(node.domain == MS for node in fused + _fused(run.output, "FusedGemm"))
    for attributes in map(_attributes, fused):
        if attributes["activation"] == b"Clip":  # ReLU6
            assert attributes["activation_params"] == pytest.approx([0.0, 6.0])


def test_exported_fused_lineage(tmp_path: Path) -> None:
    """Lineage accumulates across passes: Conv+BN (graph) then +Relu (UB); MatMul+Add then
    +Relu."""
    cnn = optimize(fixture_path("cnn_torchscript"), tmp_path)
    assert lineage(cnn)[f"{CONV}//Relu"] == (
        ["ConvBatchnormFusionPass", CONV],
        ["/conv1/Conv", "/bn1/BatchNormalization", "/Relu"],
    )
    mlp = optimize(fixture_path("mlp_torchscript"), tmp_path)
    assert lineage(mlp)[f"{GEMM}//Relu"] == (
        ["MatMulBiasAddFusionPass", GEMM],
        ["/MatMul", "/Add", "/Relu"],
    )
    assert mlp.fusion_result["session_and_graph_id_0_0"]["ub_fusion"] == {
        GEMM: {"effect_times": "2", "match_times": "2", "repository_hit_times": "0"}
    }


@pytest.mark.parametrize(
    "name", ["cnn_torchscript", "resnet_tiny_torchscript", "mobilenetv2_tiny_dynamo", "mlp_dynamo"]
)
def test_target_onnx_emits_no_contrib_op(name: str, tmp_path: Path) -> None:
    """UB passes that would fire on these fixtures are off for --target onnx: no
    com.microsoft node or opset import, no ub_fusion entry, same outputs."""
    run = optimize_checked(fixture_path(name), tmp_path, "--target", "onnx")
    model = onnx.load(str(run.output))
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}
    assert [o.domain for o in model.opset_import if o.domain not in ("", "ai.onnx")] == []
    for pass_name in (CONV, GEMM):
        entry = run.passed(pass_name)
        assert (entry["state"], entry["reason"]) == ("off", "target")
        assert run.counts(pass_name) == (0, 0)
    assert "ub_fusion" not in run.fusion_result["session_and_graph_id_0_0"]
    ops = run.op_counts()
    assert ops["FusedConv"] == ops["FusedGemm"] == 0
    assert ops["Relu"] + ops["Clip"] > 0


# ---------------------------------------------------------------------------------------------
# ConvActivationFusionPass built with onnx.helper: x [1,3,5,5] -> Conv -> activation -> y
# ---------------------------------------------------------------------------------------------

C = 4
WEIGHT = np.random.default_rng(3).normal(0.0, 0.4, (C, 3, 3, 3)).astype(np.float32)
BIAS = np.linspace(-0.5, 0.5, C).astype(np.float32)


def _conv_model(
    path: Path,
    nodes: list[onnx.NodeProto],
    *,
    conv_inputs: tuple[str, ...] = ("x", "w"),
    elem: int = onnx.TensorProto.FLOAT,
    opset: int = 17,
    initializers: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
) -> Path:
    """Conv(x, w[, b]) -> 'c' (pads 1), then `nodes`, which end in y."""
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    conv = helper.make_node("Conv", list(conv_inputs), ["c"], name="conv", pads=[1, 1, 1, 1])
    weights = [const("w", WEIGHT, dtype)]
    if "b" in conv_inputs:
        weights.append(const("b", BIAS, dtype))
    return save_model(
        path,
        [conv, *nodes],
        [value("x", [1, 3, 5, 5], elem), *extra_inputs],
        [value("y", [1, C, 5, 5], elem), *extra_outputs],
        [*weights, *initializers],
        opset=opset,
    )


def _act(op_type: str, inputs: tuple[str, ...] = ("c",), **attrs) -> onnx.NodeProto:
    return helper.make_node(op_type, list(inputs), ["y"], name="act", **attrs)


CONV_FIRES = {
    # name: (activation node, initializers, opset, expected FusedConv attributes)
    "relu": (_act("Relu"), (), 17, {"activation": b"Relu"}),
    "sigmoid": (_act("Sigmoid"), (), 17, {"activation": b"Sigmoid"}),
    "tanh": (_act("Tanh"), (), 17, {"activation": b"Tanh"}),
    "leaky_relu": (
        _act("LeakyRelu", alpha=0.2),
        (),
        17,
        {"activation": b"LeakyRelu", "activation_params": [0.2]},
    ),
    "leaky_relu_default_alpha": (
        _act("LeakyRelu"),
        (),
        17,
        {"activation": b"LeakyRelu", "activation_params": [0.01]},
    ),
    "hard_sigmoid": (
        _act("HardSigmoid", alpha=0.3, beta=0.4),
        (),
        17,
        {"activation": b"HardSigmoid", "activation_params": [0.3, 0.4]},
    ),
    "clip_inputs": (
        _act("Clip", ("c", "low", "high")),
        (const("low", -0.5), const("high", 0.75)),
        17,
        {"activation": b"Clip", "activation_params": [-0.5, 0.75]},
    ),
    "clip_max_only": (
        _act("Clip", ("c", "", "high")),
        (const("high", 6.0),),
        17,
        {"activation": b"Clip", "activation_params": [-FLOAT_MAX, 6.0]},
    ),
    "clip_min_only": (
        _act("Clip", ("c", "low")),
        (const("low", 0.0),),
        13,
        {"activation": b"Clip", "activation_params": [0.0, FLOAT_MAX]},
    ),
    "clip_opset10_attributes": (
        _act("Clip", min=-1.0, max=1.0),
        (),
        10,
        {"activation": b"Clip", "activation_params": [-1.0, 1.0]},
    ),
}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("case", sorted(CONV_FIRES))
def test_conv_activation_fires(case: str, with_bias: bool, tmp_path: Path) -> None:
    node, initializers, opset, attributes = CONV_FIRES[case]
    conv_inputs = ("x", "w", "b") if with_bias else ("x", "w")
    model = _conv_model(
        tmp_path / f"conv_{case}.onnx",
        [node],
        conv_inputs=conv_inputs,
        initializers=initializers,
        opset=opset,
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(CONV) == (1, 1)
    assert _patterns(run, CONV) == {f"Conv{node.op_type}": (1, 1)}
    assert reasons(run, CONV) == {}
    assert run.op_counts() == Counter({"FusedConv": 1})
    (fused,) = _fused(run.output, "FusedConv")
    assert fused.domain == MS
    assert list(fused.input) == list(conv_inputs)
    got = _attributes(fused)
    assert got.pop("pads") == [1, 1, 1, 1]
    if "activation_params" in attributes:
        assert got.pop("activation_params") == pytest.approx(attributes["activation_params"])
    assert got == {k: v for k, v in attributes.items() if k != "activation_params"}
    assert lineage(run) == {f"{CONV}/act": ([CONV], ["conv", "act"])}
    assert run.fusion_result["session_and_graph_id_0_0"]["ub_fusion"] == {
        CONV: {"effect_times": "1", "match_times": "1", "repository_hit_times": "0"}
    }


RESIDUAL = value("z", [1, C, 5, 5])


@pytest.mark.parametrize("join", ["Add", "Sum"])
@pytest.mark.parametrize("conv_first", [True, False], ids=["conv_first", "residual_first"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_conv_residual_relu_fires(
    join: str, conv_first: bool, with_bias: bool, tmp_path: Path
) -> None:
    """Relu(Conv + z) -> FusedConv(x, w, b, z); an absent bias stays an empty input."""
    model = _conv_model(
        tmp_path / f"residual_{join}.onnx",
        [
            helper.make_node(join, ["c", "z"] if conv_first else ["z", "c"], ["s"], name="join"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
        conv_inputs=("x", "w", "b") if with_bias else ("x", "w"),
        extra_inputs=(RESIDUAL,),
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(CONV) == (1, 1)
    assert _patterns(run, CONV) == {f"Conv{join}Relu": (1, 1)}
    assert run.op_counts() == Counter({"FusedConv": 1})
    (fused,) = _fused(run.output, "FusedConv")
    assert list(fused.input) == ["x", "w", "b" if with_bias else "", "z"]
    assert _attributes(fused)["activation"] == b"Relu"
    assert lineage(run) == {f"{CONV}/relu": ([CONV], ["conv", "join", "relu"])}


def test_conv_residual_relu_verifies_at_its_declared_tolerance(tmp_path: Path) -> None:
    """FusedConv adds the residual in another order than Conv, then Add: on a residual block
    whose outputs reach a few hundred (as a ResNet's do) a few elements move by more than the
    exact tolerance, so the pass is declared reassociating, and `fusectl verify` (which picks
    the tolerance from the passes that fired) passes the model fusectl wrote. Declared exact,
    verify failed every torchvision ResNet backbone (FCN, RetinaNet, Keypoint R-CNN)."""
    rng = np.random.default_rng(0)
    channels = 64
    model = save_model(
        tmp_path / "residual_block.onnx",
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Add", ["c", "x"], ["s"], name="join"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
        [value("x", [1, channels, 16, 16])],
        [value("y", [1, channels, 16, 16])],
        [
            const("w", rng.standard_normal((channels, channels, 3, 3)) * 0.5),
            const("b", rng.standard_normal(channels) * 3),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert run.op_counts() == Counter({"FusedConv": 1})
    assert run.passed(CONV)["numerics"] == "reassociating"
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, x=(rng.standard_normal((1, channels, 16, 16)) * 10).astype(np.float32))
    verified = run_cli("verify", model, run.output, "--inputs", feeds)
    assert verified.exit_code == 0, verified.output
    assert "reassociating passes fired" in verified.output


def _downsample_block(path: Path, residual: str) -> Path:
    """A ResNet downsampling block exported with symbolic height and width: a 3x3 Conv of
    stride 2 (+ Relu) and a 3x3 Conv, added to the residual and Relu'd; the residual is a 1x1
    Conv of stride 2 ("downsample") or a per-channel [N, C, 1, 1] mean ("pooled", which the
    Add broadcasts). onnx names each Conv output's size afresh, so only their arithmetic,
    floor((H - 1) / 2) + 1 for both strided Convs, shows the downsample's shape is the sum's."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["h1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Add", ["c", "z"], ["s"], name="join"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    if residual == "downsample":
        nodes.insert(0, helper.make_node("Conv", ["x", "wd"], ["z"], strides=[2, 2]))
    else:
        nodes.insert(2, helper.make_node("ReduceMean", ["a1"], ["z"], axes=[2, 3]))
    weights = {"w1": (8, 4, 3, 3), "w2": (8, 8, 3, 3), "wd": (8, 4, 1, 1)}
    return save_model(
        path,
        nodes,
        [value("x", ["N", 4, "H", "W"])],
        [value("y", ["N", 8, "Y", "X"])],
        [const(name, rng.standard_normal(shape) * 0.3) for name, shape in weights.items()],
    )


@pytest.mark.parametrize("size", [(15, 16), (16, 15)])
def test_conv_residual_of_symbolic_size_is_proven_by_its_arithmetic(
    size: tuple[int, int], tmp_path: Path
) -> None:
    """Both strided Convs' output sizes are floor((H - 1) / 2) + 1 in onnxruntime's symbolic
    inference: the residual Add fuses into the second Conv (torchvision's ResNet-18 exported
    with dynamic height and width: 9 of its 17 FusedConvs before, all 17 now)."""
    model = _downsample_block(tmp_path / "downsample.onnx", "downsample")
    run = optimize_checked(model, tmp_path, compare=False)
    assert _patterns(run, CONV) == {"ConvAddRelu": (1, 1), "ConvRelu": (1, 1)}
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 4, *size)).astype(np.float32)}
    [want], [got] = run_model(model, feeds), run_model(run.output, feeds)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_conv_residual_broadcast_by_the_add_is_declined(tmp_path: Path) -> None:
    """Near miss: a [N, C, 1, 1] residual is broadcast by the Add; FusedConv's sum input
    must be the Conv output's shape, so it stays an Add (the first Conv + Relu still fuses)."""
    model = _downsample_block(tmp_path / "pooled.onnx", "pooled")
    run = optimize_checked(model, tmp_path)
    assert _patterns(run, CONV) == {"ConvAddRelu": (1, 0), "ConvRelu": (1, 1)}
    (miss,) = run.passed(CONV)["near_misses"]
    assert miss["reason"] == "the residual is not known to have the Conv output's shape"


CONV_DECLINES = {
    # name: (nodes, kwargs, reason, example, pattern)
    "clip_min_fed": (
        [_act("Clip", ("c", "low", "high"))],
        {"extra_inputs": (value("low", []),), "initializers": (const("high", 6.0),)},
        plain_input_not_constant("Clip min"),
        "act",
        "ConvClip",
    ),
    "clip_max_computed": (
        [
            helper.make_node("Abs", ["m"], ["high"], name="abs"),
            _act("Clip", ("c", "low", "high")),
        ],
        {"extra_inputs": (value("m", []),), "initializers": (const("low", 0.0),)},
        "Clip max is not a constant",
        "act",
        "ConvClip",
    ),
    "clip_max_overridable": (
        [_act("Clip", ("c", "", "high"))],
        {"extra_inputs": (value("high", []),), "initializers": (const("high", 6.0),)},
        "Clip max is a graph input (an overridable initializer), not a constant",
        "act",
        "ConvClip",
    ),
    "residual_broadcast": (
        [
            helper.make_node("Add", ["c", "z"], ["s"], name="join"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
        {"extra_inputs": (value("z", [1, C, 1, 1]),)},
        "the residual is not known to have the Conv output's shape",
        "relu",
        "ConvAddRelu",
    ),
    "residual_dynamic": (
        [
            helper.make_node("Sum", ["z", "c"], ["s"], name="join"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
        {"extra_inputs": (value("z", ["N", C, 5, 5]),)},
        "the residual is not known to have the Conv output's shape",
        "relu",
        "ConvSumRelu",
    ),
    "conv_output_shared": (
        [_act("Relu"), helper.make_node("Neg", ["c"], ["n"], name="neg")],
        {"extra_outputs": (value("n", [1, C, 5, 5]),)},
        "an intermediate value (Conv output) is also used by Neg outside the match",
        "act",
        "ConvRelu",
    ),
    "conv_output_is_graph_output": (
        [_act("Tanh")],
        {"extra_outputs": (value("c", [1, C, 5, 5]),)},
        "an intermediate value (Conv output) is a graph output",
        "act",
        "ConvTanh",
    ),
}


@pytest.mark.parametrize("case", sorted(CONV_DECLINES))
def test_conv_activation_declines(case: str, tmp_path: Path) -> None:
    nodes, kwargs, reason, example, pattern = CONV_DECLINES[case]
    run = optimize_checked(_conv_model(tmp_path / f"conv_{case}.onnx", nodes, **kwargs), tmp_path)
    assert_declined(run, CONV, reason, example)
    assert _patterns(run, CONV) == {pattern: (1, 0)}
    assert run.op_counts()["FusedConv"] == 0
    assert run.op_counts()["Conv"] == 1
    assert run.fusion_result["session_and_graph_id_0_0"]["ub_fusion"] == {
        CONV: {"effect_times": "0", "match_times": "1", "repository_hit_times": "0"}
    }


def test_conv_activation_in_half_precision(tmp_path: Path) -> None:
    """onnxruntime's CPU provider runs a float16 FusedConv in float32, casting around it: fused.
    No provider runs a bfloat16 one: declined for --target ort (and off for --target onnx);
    onnxruntime runs neither bfloat16 model, so only the checker."""
    half = _conv_model(tmp_path / "conv_fp16.onnx", [_act("Relu")], elem=onnx.TensorProto.FLOAT16)
    run = optimize_checked(half, tmp_path, atol=1e-2)
    assert run.counts(CONV) == (1, 1)
    assert run.op_counts() == Counter({"FusedConv": 1})
    bf16 = onnx.TensorProto.BFLOAT16
    model = _conv_model(tmp_path / "conv_bf16.onnx", [_act("Relu")], elem=bf16, opset=22)
    run = optimize_checked(model, tmp_path, compare=False)
    assert_declined(run, CONV, f"onnxruntime has no {MS}.FusedConv kernel for BFLOAT16", "act")
    assert run.op_counts() == Counter({"Conv": 1, "Relu": 1})


def test_conv_activation_switched_off_by_alias(tmp_path: Path) -> None:
    model = _conv_model(tmp_path / "conv_alias.onnx", [_act("Relu")])
    run = optimize_checked(model, tmp_path, "--disable_pass", "TbeConv2DReluv2Pass")
    assert run.passed(CONV)["state"] == "off"
    assert run.op_counts() == Counter({"Conv": 1, "Relu": 1})


@pytest.mark.parametrize("join", ["Add", "Sum"])
def test_conv_residual_is_the_conv_output(join: str, tmp_path: Path) -> None:
    model = _conv_model(
        tmp_path / f"self_residual_{join}.onnx",
        [
            helper.make_node(join, ["c", "c"], ["s"], name="join"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(CONV)[0] == 1


# ---------------------------------------------------------------------------------------------
# GemmActivationFusionPass built with onnx.helper: x [2,3] -> Gemm(w, b) -> activation -> y
# ---------------------------------------------------------------------------------------------

GEMM_WEIGHT = np.random.default_rng(5).normal(0.0, 0.5, (3, 5))


def _gemm_model(
    path: Path,
    activation: onnx.NodeProto,
    *,
    elem: int = onnx.TensorProto.FLOAT,
    gemm_inputs: tuple[str, ...] = ("x", "w", "b"),
    extra_nodes: tuple = (),
    extra_outputs: tuple = (),
    **gemm_attrs,
) -> Path:
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    weight = GEMM_WEIGHT.T if gemm_attrs.get("transB") else GEMM_WEIGHT
    return save_model(
        path,
        [
            helper.make_node("Gemm", list(gemm_inputs), ["g"], name="gemm", **gemm_attrs),
            activation,
            *extra_nodes,
        ],
        [value("x", [2, 3], elem)],
        [value("y", [2, 5], elem), *extra_outputs],
        [const("w", weight, dtype), const("b", np.linspace(-1, 1, 5), dtype)],
    )


def _gemm_act(op_type: str, **attrs) -> onnx.NodeProto:
    return helper.make_node(op_type, ["g"], ["y"], name="act", **attrs)


GEMM_FIRES = {
    "relu": (_gemm_act("Relu"), {}),
    "sigmoid": (_gemm_act("Sigmoid"), {}),
    "tanh": (_gemm_act("Tanh"), {}),
    "leaky_relu": (_gemm_act("LeakyRelu", alpha=0.3), {"activation_alpha": 0.3}),
    "leaky_relu_default_alpha": (_gemm_act("LeakyRelu"), {"activation_alpha": 0.01}),
    "hard_sigmoid": (
        _gemm_act("HardSigmoid", alpha=0.25, beta=0.6),
        {"activation_alpha": 0.25, "activation_beta": 0.6},
    ),
}


@pytest.mark.parametrize("case", sorted(GEMM_FIRES))
def test_gemm_activation_fires(case: str, tmp_path: Path) -> None:
    node, params = GEMM_FIRES[case]
    model = _gemm_model(tmp_path / f"gemm_{case}.onnx", node, alpha=0.5, beta=2.0, transB=1)
    run = optimize_checked(model, tmp_path)
    assert run.counts(GEMM) == (1, 1)
    assert _patterns(run, GEMM) == {f"Gemm{node.op_type}": (1, 1)}
    assert reasons(run, GEMM) == {}
    assert run.op_counts() == Counter({"FusedGemm": 1})
    (fused,) = _fused(run.output, "FusedGemm")
    assert fused.domain == MS
    assert list(fused.input) == ["x", "w", "b"]
    got = _attributes(fused)
    # The Gemm's own attributes stay.
    assert (got.pop("alpha"), got.pop("beta"), got.pop("transB")) == (0.5, 2.0, 1)
    assert got.pop("activation") == node.op_type.encode()
    assert got == pytest.approx(params)
    assert lineage(run) == {f"{GEMM}/act": ([GEMM], ["gemm", "act"])}


def test_gemm_without_bias_fires(tmp_path: Path) -> None:
    model = _gemm_model(tmp_path / "gemm_no_bias.onnx", _gemm_act("Relu"), gemm_inputs=("x", "w"))
    run = optimize_checked(model, tmp_path)
    assert run.counts(GEMM) == (1, 1)
    (fused,) = _fused(run.output, "FusedGemm")
    assert list(fused.input) == ["x", "w"]


def test_gemm_clip_is_not_a_candidate(tmp_path: Path) -> None:
    """FusedGemm takes no Clip: no pattern for it, no match."""
    model = _gemm_model(tmp_path / "gemm_clip.onnx", _gemm_act("Clip"))
    run = optimize_checked(model, tmp_path)
    assert run.counts(GEMM) == (0, 0)
    assert run.op_counts() == Counter({"Gemm": 1, "Clip": 1})


GEMM_DECLINES = {
    "double": (
        {"elem": onnx.TensorProto.DOUBLE},
        f"onnxruntime has no {MS}.FusedGemm kernel for DOUBLE",
    ),
    "gemm_output_shared": (
        {
            "extra_nodes": (helper.make_node("Neg", ["g"], ["n"], name="neg"),),
            "extra_outputs": (value("n", [2, 5]),),
        },
        "an intermediate value (Gemm output) is also used by Neg outside the match",
    ),
    "gemm_output_is_graph_output": (
        {"extra_outputs": (value("g", [2, 5]),)},
        "an intermediate value (Gemm output) is a graph output",
    ),
}


@pytest.mark.parametrize("case", sorted(GEMM_DECLINES))
def test_gemm_activation_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = GEMM_DECLINES[case]
    run = optimize_checked(
        _gemm_model(tmp_path / f"gemm_{case}.onnx", _gemm_act("Relu"), **kwargs), tmp_path
    )
    assert_declined(run, GEMM, reason, "act")
    assert run.op_counts()["Gemm"] == run.op_counts()["Relu"] == 1


def test_gemm_activation_off_for_target_onnx(tmp_path: Path) -> None:
    """--target onnx switches the UB pass off instead: nothing to decline."""
    model = _gemm_model(
        tmp_path / "gemm_double.onnx", _gemm_act("Relu"), elem=onnx.TensorProto.DOUBLE
    )
    run = optimize_checked(model, tmp_path, "--target", "onnx")
    assert run.passed(GEMM)["state"] == "off"
    assert "near_misses" not in run.passed(GEMM)
    assert run.op_counts() == Counter({"Gemm": 1, "Relu": 1})
