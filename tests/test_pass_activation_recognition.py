"""ActivationRecognitionPass: activations recognized by the function a cluster computes.

Real exporter output (Bloom's tanh GELU, which no enumerated pattern spells; hard-swish and
hard-sigmoid written out, from TorchScript at opsets 13 and 17, dynamo and tf2onnx), hand-written
spellings of GELU, SiLU, QuickGELU and the hard activations that no pattern lists, the
near-misses it must leave alone, idempotence, and numerics on onnxruntime.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import FIXTURES, Run, assert_same_outputs, digest, optimize
from tests.pass_helpers import assert_second_run_changes_nothing

PASS = "ActivationRecognitionPass"
ARCH = FIXTURES / "arch"


def _model(
    nodes: list[onnx.NodeProto],
    constants: dict[str, object],
    tmp_path: Path,
    opset_version: int = 17,
    rank: int = 3,
) -> Path:
    """y = f(x) over a [2, 8, 16] input (or its last ``rank`` axes) that a bias Add feeds, as
    an MLP's activation sees it."""
    bias = numpy_helper.from_array(np.linspace(-1, 1, 16, dtype=np.float32), "bias")
    inits = [bias]
    for name, value in constants.items():
        inits.append(numpy_helper.from_array(np.array(value, dtype=np.float32), name))
    opset = [helper.make_opsetid("", opset_version)]
    graph = helper.make_graph(
        [helper.make_node("Add", ["h", "bias"], ["x"]), *nodes],
        "activation",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 8, 16][-rank:])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opset), path)
    return path


def _n(op: str, inputs: list[str], output: str) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output])


# Bloom's association of the tanh GELU: x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 x x)))
BLOOM_TANH = (
    [
        _n("Mul", ["x", "half"], "xh"),
        _n("Mul", ["x", "k"], "kx"),
        _n("Mul", ["x", "c"], "cx"),
        _n("Mul", ["cx", "x"], "cxx"),
        _n("Add", ["one", "cxx"], "poly"),
        _n("Mul", ["kx", "poly"], "arg"),
        _n("Tanh", ["arg"], "t"),
        _n("Add", ["t", "one"], "bracket"),
        _n("Mul", ["xh", "bracket"], "y"),
    ],
    {"half": 0.5, "k": 0.79788456, "c": 0.044715, "one": 1.0},
)
# The erf GELU through the normal CDF: x * (erf(x * (1/sqrt 2)) * 0.5 + 0.5)
ERF_AS_CDF = (
    [
        _n("Mul", ["x", "inv_root2"], "s"),
        _n("Erf", ["s"], "e"),
        _n("Mul", ["e", "half"], "eh"),
        _n("Add", ["eh", "half"], "cdf"),
        _n("Mul", ["x", "cdf"], "y"),
    ],
    {"inv_root2": 1 / math.sqrt(2), "half": 0.5},
)
# SiLU as x / (1 + exp(-x)) and QuickGELU as x / (1 + exp(-1.702 x)).
SILU_BY_EXP = (
    [
        _n("Neg", ["x"], "nx"),
        _n("Exp", ["nx"], "e"),
        _n("Add", ["one", "e"], "d"),
        _n("Div", ["x", "d"], "y"),
    ],
    {"one": 1.0},
)
QUICK_BY_EXP = (
    [
        _n("Mul", ["x", "alpha"], "ax"),
        _n("Neg", ["ax"], "nx"),
        _n("Exp", ["nx"], "e"),
        _n("Add", ["e", "one"], "d"),
        _n("Div", ["x", "d"], "y"),
    ],
    {"alpha": 1.702, "one": 1.0},
)


# Flax's tanh GELU through jax2tf and tf2onnx (Google's Magika): the cube as x * (x * c x), one
# of its constants [1, 1, 1]. The GELU passes' skeletons fit it, their patterns do not bind.
FLAX_TANH = (
    [
        _n("Mul", ["c", "x"], "cx"),
        _n("Mul", ["x", "cx"], "cxx"),
        _n("Mul", ["x", "cxx"], "cube"),
        _n("Add", ["x", "cube"], "poly"),
        _n("Mul", ["k", "poly"], "arg"),
        _n("Tanh", ["arg"], "t"),
        _n("Add", ["one3", "t"], "bracket"),
        _n("Mul", ["half", "bracket"], "hb"),
        _n("Mul", ["x", "hb"], "y"),
    ],
    {"c": 0.044715, "k": 0.7978846, "one3": np.ones((1, 1, 1)), "half": 0.5},
)


@pytest.mark.parametrize(
    ("spelling", "fused", "nodes"),
    [
        (BLOOM_TANH, "FastGelu", 1),  # the bias Add goes into the kernel
        (FLAX_TANH, "FastGelu", 1),
        (ERF_AS_CDF, "BiasGelu", 1),
        (SILU_BY_EXP, "QuickGelu", 2),  # QuickGelu takes no bias
        (QUICK_BY_EXP, "QuickGelu", 2),
    ],
    ids=["bloom-tanh", "flax-tanh", "erf-as-cdf", "silu-by-exp", "quickgelu-by-exp"],
)
def test_spellings_no_pattern_lists_are_fused(
    spelling: tuple[list[onnx.NodeProto], dict[str, float]],
    fused: str,
    nodes: int,
    tmp_path: Path,
) -> None:
    model = _model(*spelling, tmp_path)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    ops = run.op_counts()
    assert ops[fused] == 1 and len(onnx.load(str(run.output)).graph.node) == nodes
    assert_same_outputs(model, run.output)


def test_bloom_exports_fuse_gelu_in_every_layer(tmp_path: Path) -> None:
    for name in ("bloom_ts17", "bloom_dynamo"):
        run = optimize(ARCH / f"{name}.onnx", tmp_path, "--repository", "none")
        assert run.counts(PASS) == (2, 2), name
        assert run.passed(PASS)["patterns"] == {"GELU (tanh)": {"matched": 2, "effected": 2}}
        assert run.op_counts()["FastGelu"] == 2, name
        assert run.report["coverage"]["GELU"]["fused"] == 2


def test_canonical_spellings_are_left_alone(tmp_path: Path) -> None:
    """GPT-2's tanh GELU and BERT's erf GELU are the spellings the GELU passes match."""
    for name in ("gpt2_tiny_ts17", "bert_tiny_ts17"):
        run = optimize(FIXTURES / f"{name}.onnx", tmp_path)
        assert run.counts(PASS) == (0, 0), name


def _left_unfused(model: Path, tmp_path: Path, seed: str) -> Run:
    """The cluster around the one ``seed`` op is left as it is, and the coverage line names
    it unfused for want of a pass that recognizes it."""
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0) and run.op_counts()[seed] == 1
    (unfused,) = run.report["coverage"]["GELU"]["unfused"]
    assert unfused["reason"] == "no pass recognized this spelling"
    return run


def test_near_misses_are_not_rewritten(tmp_path: Path) -> None:
    # A tanh GELU with a cube coefficient off by 0.08 %: another function, named as unfused.
    nodes, constants = BLOOM_TANH
    _left_unfused(_model(nodes, {**constants, "c": 0.04475}, tmp_path), tmp_path, "Tanh")
    # Soft-capping (cap * tanh(x / cap)) is a Tanh cluster of one input, and no activation.
    softcap = [_n("Div", ["x", "cap"], "s"), _n("Tanh", ["s"], "t"), _n("Mul", ["t", "cap"], "y")]
    run = optimize(_model(softcap, {"cap": 30.0}, tmp_path), tmp_path)
    assert run.counts(PASS) == (0, 0) and run.op_counts()["Tanh"] == 1
    # The intermediate tanh also read elsewhere (a second output): the cluster is not closed.
    graph_nodes = [*BLOOM_TANH[0], _n("Identity", ["t"], "t_out")]
    path = _model(graph_nodes, BLOOM_TANH[1], tmp_path)
    model = onnx.load(path)
    model.graph.output.append(helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None))
    onnx.save(model, path)
    run = optimize(path, tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert_same_outputs(path, run.output)


def test_standard_only_output_is_canonical_and_idempotent(tmp_path: Path) -> None:
    """With --target onnx at opset 17 no GELU op exists: the canonical spelling stays written
    out, and a second run finds nothing to change."""
    model = _model(*BLOOM_TANH, tmp_path)
    first = optimize(model, tmp_path, "--target", "onnx")
    assert first.counts(PASS) == (1, 1)
    again = tmp_path / "again"
    again.mkdir()
    second = optimize(first.output, again, "--target", "onnx")
    assert second.counts(PASS) == (0, 0)
    assert digest(second.output) == digest(first.output)
    assert_same_outputs(model, first.output)


# --- hard-sigmoid and hard-swish -------------------------------------------------------------

HARD = {
    # MobileNetV3 blocks with the activations written out (tests/fixtures/make_fixtures.py,
    # HardActivations): two hard-swish spellings and a squeeze-excite gate relu6(c + 3) / 6,
    # whose + 3 an earlier pass folds into the Conv's bias (relu6(c') / 6: alpha 1/6, beta 0).
    # At opset 13 there is no HardSwish op: x * HardSigmoid(x).
    "hard_activations_ts13": {"HardSigmoid": 2, "Mul": 4},
    "hard_activations_ts17": {"HardSwish": 2, "Mul": 2},
    "hard_activations_dynamo": {"HardSwish": 2, "Mul": 2},
}


@pytest.mark.parametrize("name", sorted(HARD))
def test_written_out_hard_activations_of_both_exporters(name: str, tmp_path: Path) -> None:
    model = FIXTURES / f"{name}.onnx"
    original = onnx.load(model).graph.node
    assert sum(node.op_type == "Clip" for node in original) == 4  # what the exporter wrote
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (3, 3)
    assert run.passed(PASS)["patterns"] == {
        "HardSwish": {"matched": 2, "effected": 2},
        "HardSigmoid (alpha 0.166667, beta 0)": {"matched": 1, "effected": 1},
    }
    ops = run.op_counts()
    # The gate's HardSigmoid goes into its Conv; the near miss (relu6(h + 3) also added to the
    # block's output) keeps its Clip; no Div is left.
    assert ops["FusedConv"] == 1 and ops["Clip"] == 1 and ops["Div"] == 0
    assert {op: ops[op] for op in HARD[name]} == HARD[name]
    assert_same_outputs(model, run.output)
    again = tmp_path / "again"
    again.mkdir()
    assert optimize(run.output, again).counts(PASS) == (0, 0)


def test_keras_hard_activations_through_tf2onnx(tmp_path: Path) -> None:
    """Keras's MobileNetV3 spelling, x * (relu6(x + 3) * (1 / 6)), as tf2onnx writes it
    (tests/fixtures/make_keras_fixtures.py): a hard-swish and a squeeze-excite hard-sigmoid,
    whose + 3 goes into the Conv before it once the Transposes between them are gone."""
    model = FIXTURES / "keras_mobile_blocks_tf2onnx.onnx"
    run = optimize(model, tmp_path)
    assert run.passed(PASS)["patterns"] == {
        "HardSwish": {"matched": 1, "effected": 1},
        "HardSigmoid (alpha 0.166667, beta 0)": {"matched": 1, "effected": 1},
    }
    ops = run.op_counts()
    # The gate's HardSigmoid goes into the Conv before it.
    assert (ops["HardSwish"], ops["HardSigmoid"], ops["Clip"], ops["FusedConv"]) == (1, 0, 0, 3)
    assert_same_outputs(model, run.output)


# Keras's hard sigmoid clip(0.2 x + 0.5, 0, 1); hard-swish at opset 10 as Paddle2ONNX writes it,
# the Clip's bounds as attributes and 1/6 a factor; at opset 17, x * relu6(x + 3) / 6.
KERAS_HARD_SIGMOID = [
    _n("Mul", ["x", "slope"], "sx"),
    _n("Add", ["sx", "offset"], "lin"),
    _n("Clip", ["lin", "zero", "one"], "y"),
]
PADDLE_HARD_SWISH_OPSET10 = [
    _n("Add", ["x", "three"], "x3"),
    helper.make_node("Clip", ["x3"], ["r6"], min=0.0, max=6.0),
    _n("Mul", ["x", "r6"], "xr"),
    _n("Mul", ["xr", "sixth"], "y"),
]
HARD_SWISH = [
    _n("Add", ["x", "three"], "x3"),
    _n("Clip", ["x3", "zero", "six"], "r6"),
    _n("Mul", ["x", "r6"], "xr"),
    _n("Div", ["xr", "six"], "y"),
]
HARD_CONSTANTS = {
    "slope": 0.2,
    "offset": 0.5,
    "zero": 0.0,
    "one": 1.0,
    "three": 3.0,
    "six": 6.0,
    "sixth": 1 / 6,
}


@pytest.mark.parametrize(
    ("nodes", "opset", "pattern", "ops"),
    [
        (KERAS_HARD_SIGMOID, 17, "HardSigmoid (alpha 0.2, beta 0.5)", {"HardSigmoid": 1}),
        (PADDLE_HARD_SWISH_OPSET10, 10, "HardSwish", {"HardSigmoid": 1, "Mul": 1}),
        (HARD_SWISH, 17, "HardSwish", {"HardSwish": 1}),
    ],
    ids=["keras-hard-sigmoid", "paddle-hard-swish-opset10", "hard-swish-opset17"],
)
def test_hard_spellings_are_written_as_the_op(
    nodes: list[onnx.NodeProto], opset: int, pattern: str, ops: dict[str, int], tmp_path: Path
) -> None:
    model = _model(nodes, HARD_CONSTANTS, tmp_path, opset_version=opset)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.passed(PASS)["patterns"] == {pattern: {"matched": 1, "effected": 1}}
    counts = run.op_counts()
    assert {op: counts[op] for op in ops} == ops and counts["Clip"] == 0
    assert_same_outputs(model, run.output)


def test_hard_near_misses_are_left_alone(tmp_path: Path) -> None:
    # Divided by 5.9: x * clip(x + 3, 0, 6) / 5.9 is no hard-swish (its gate passes 1).
    divided = [*HARD_SWISH[:3], _n("Div", ["xr", "d"], "y")]
    model = _model(divided, {**HARD_CONSTANTS, "d": 5.9}, tmp_path)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0) and run.op_counts()["Clip"] == 1
    assert_same_outputs(model, run.output)
    # ReLU6 (MobileNet-V2's) is no hard activation, and clip(x, 0, 1) is HardSigmoid(1, 0)
    # in as many nodes: both stay as written.
    for high in ("six", "one"):
        model = _model([_n("Clip", ["x", "zero", high], "y")], HARD_CONSTANTS, tmp_path)
        run = optimize(model, tmp_path)
        assert run.counts(PASS) == (0, 0) and run.op_counts()["Clip"] == 1
    # Gemma-2's soft cap of its scaled scores, 50 tanh(x / 16 / 50), is within 1e-5 of x / 16
    # over the probes: a gate that never reaches 0 or 1 is no hard sigmoid.
    softcap = [
        _n("Mul", ["x", "scale"], "s"),
        _n("Div", ["s", "cap"], "c"),
        _n("Tanh", ["c"], "t"),
        _n("Mul", ["t", "cap"], "y"),
    ]
    model = _model(softcap, {"scale": 0.0625, "cap": 50.0}, tmp_path)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0) and run.op_counts()["Tanh"] == 1
    # nn.Hardswish at opset 13 is already x * HardSigmoid(x): no fewer nodes to write.
    gate = helper.make_node("HardSigmoid", ["x"], ["g"], alpha=1 / 6)
    model = _model([gate, _n("Mul", ["x", "g"], "y")], {}, tmp_path, opset_version=13)
    assert optimize(model, tmp_path).counts(PASS) == (0, 0)
    # A [1, 1, 1] divisor broadcasts a 2-D x up to 3-D, which the op would not.
    lifted = [*HARD_SWISH[:3], _n("Div", ["xr", "six3"], "y")]
    constants = {**HARD_CONSTANTS, "six3": np.full((1, 1, 1), 6.0)}
    model = _model(lifted, constants, tmp_path, rank=2)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert_same_outputs(model, run.output)


def test_hard_swish_in_double_is_left_written_out(tmp_path: Path) -> None:
    """onnxruntime has no double HardSigmoid or HardSwish kernel."""
    model = _model(HARD_SWISH, HARD_CONSTANTS, tmp_path)
    proto = onnx.load(model)
    for value in [*proto.graph.input, *proto.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for tensor in proto.graph.initializer:
        array = numpy_helper.to_array(tensor).astype(np.float64)
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    onnx.save(proto, model)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0) and run.op_counts()["Clip"] == 1
    assert_same_outputs(model, run.output)


def test_other_hard_gates_are_x_times_hard_sigmoid(tmp_path: Path) -> None:
    """x * clip(x + 3, 0, 5.9) / 5.9 is x * clip(x / 5.9 + 3 / 5.9, 0, 1): a hard-sigmoid gate
    other than HardSwish's, written as x * HardSigmoid(x) in 2 nodes instead of 4."""
    model = _model(HARD_SWISH, {**HARD_CONSTANTS, "six": 5.9}, tmp_path)
    run = optimize(model, tmp_path)
    assert run.passed(PASS)["patterns"] == {
        "x * HardSigmoid (alpha 0.169492, beta 0.508475)": {"matched": 1, "effected": 1}
    }
    counts = run.op_counts()
    assert (counts["HardSigmoid"], counts["Mul"], counts["HardSwish"], counts["Clip"]) == (
        1,
        1,
        0,
        0,
    )
    assert_same_outputs(model, run.output)


# --- a constant multiple of an activation ----------------------------------------------------

# The erf GELU without its halving: x * (1 + erf(x / sqrt 2)), twice the GELU.
TWICE_ERF = (
    [
        _n("Div", ["x", "root2"], "s"),
        _n("Erf", ["s"], "e"),
        _n("Add", ["e", "one"], "bracket"),
        _n("Mul", ["x", "bracket"], "y"),
    ],
    {"root2": math.sqrt(2), "one": 1.0},
)


def test_gelu_after_onnx_simplifier_is_twice_the_gelu(tmp_path: Path) -> None:
    """onnx-simplifier folds the GELU's ``* 0.5`` into the Conv after it
    (tests/fixtures/make_preprocessed_fixtures.py). The cluster is recognized as twice the
    GELU, written as the GELU times 2, and the 2 folds back into the Conv: the output has
    the nodes the export's own output has."""
    model = FIXTURES / "preprocessed" / "channel_affine_conv_ts17_onnxsim.onnx"
    run = optimize(model, tmp_path)
    assert run.passed(PASS)["patterns"] == {"GELU (erf) times 2": {"matched": 1, "effected": 1}}
    gelu = run.report["coverage"]["GELU"]
    assert (gelu["fused"], gelu["total"]) == (1, 1)
    ops = run.op_counts()
    assert ops["Gelu"] == 1 and ops["Erf"] == 0 and ops["Mul"] == 0
    (tmp_path / "export").mkdir()
    export = optimize(FIXTURES / "channel_affine_conv_ts17.onnx", tmp_path / "export")
    assert ops == export.op_counts()
    assert_same_outputs(model, run.output)
    assert_second_run_changes_nothing(run, tmp_path, PASS)


def test_a_multiple_of_a_spelling_no_pattern_lists_is_fused(tmp_path: Path) -> None:
    """Twice the erf GELU, and Bloom's tanh GELU with x * 1.5 for its x * 0.5 (three times
    the GELU): the bias Add and the activation fuse into one kernel, and the multiple stays a
    Mul (no Conv after it to take it)."""
    nodes, constants = BLOOM_TANH
    cases = [
        (TWICE_ERF, "GELU (erf) times 2", "BiasGelu"),
        ((nodes, {**constants, "half": 1.5}), "GELU (tanh) times 3", "FastGelu"),
    ]
    for spelling, pattern, fused in cases:
        model = _model(*spelling, tmp_path)
        run = optimize(model, tmp_path)
        assert run.passed(PASS)["patterns"] == {pattern: {"matched": 1, "effected": 1}}
        assert run.op_counts() == {fused: 1, "Mul": 1}, pattern
        # The kernel's site lists each original node once: the bias Add and the cluster (the
        # canonical nodes it takes share the cluster's lineage).
        (site,) = run.passed(f"{fused}FusionPass")["sites"]
        assert len(site["original_types"]) == 1 + len(spelling[0]), site
        assert_same_outputs(model, run.output)


def test_multiples_are_not_read_into_what_is_no_multiple(tmp_path: Path) -> None:
    # x * (1.1 + erf(x / sqrt 2)) is no multiple of the GELU: y(6) - y(-6) reads 2.2 as the
    # multiple, and y / 2.2 is no activation.
    nodes, constants = TWICE_ERF
    model = _model(nodes, {**constants, "one": 1.1}, tmp_path)
    assert_same_outputs(model, _left_unfused(model, tmp_path, "Erf").output)
    # The GELU in the spelling the GELU passes match, then doubled: the GELU is fused as it is
    # and the Mul after it is left, not the whole rewritten as a multiple.
    half = [*nodes[:-1], _n("Mul", ["x", "bracket"], "xb"), _n("Mul", ["xb", "half"], "g")]
    doubled = [*half, _n("Mul", ["g", "two"], "y")]
    model = _model(doubled, {**constants, "half": 0.5, "two": 2.0}, tmp_path)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert run.op_counts() == {"BiasGelu": 1, "Mul": 1}
    assert_same_outputs(model, run.output)
