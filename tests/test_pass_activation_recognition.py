"""ActivationRecognitionPass: activations recognized by the function a cluster computes.

Real exporter output (Bloom's tanh GELU, which no enumerated pattern spells), hand-written
spellings of GELU, SiLU and QuickGELU that no pattern lists, the near-misses it must leave
alone, idempotence, and numerics on onnxruntime.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import FIXTURES, assert_same_outputs, digest, optimize

PASS = "ActivationRecognitionPass"
ARCH = FIXTURES / "arch"


def _model(nodes: list[onnx.NodeProto], constants: dict[str, float], tmp_path: Path) -> Path:
    """y = f(x) over a [2, 8, 16] input that a bias Add feeds, as an MLP's activation sees it."""
    bias = numpy_helper.from_array(np.linspace(-1, 1, 16, dtype=np.float32), "bias")
    inits = [bias]
    for name, value in constants.items():
        inits.append(numpy_helper.from_array(np.array(value, dtype=np.float32), name))
    graph = helper.make_graph(
        [helper.make_node("Add", ["h", "bias"], ["x"]), *nodes],
        "activation",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16])],
        inits,
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
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


@pytest.mark.parametrize(
    ("spelling", "fused", "nodes"),
    [
        (BLOOM_TANH, "FastGelu", 1),  # the bias Add goes into the kernel
        (ERF_AS_CDF, "BiasGelu", 1),
        (SILU_BY_EXP, "QuickGelu", 2),  # QuickGelu takes no bias
        (QUICK_BY_EXP, "QuickGelu", 2),
    ],
    ids=["bloom-tanh", "erf-as-cdf", "silu-by-exp", "quickgelu-by-exp"],
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


def test_near_misses_are_not_rewritten(tmp_path: Path) -> None:
    # A tanh GELU with a cube coefficient off by 0.08 %: another function, named as unfused.
    nodes, constants = BLOOM_TANH
    model = _model(nodes, {**constants, "c": 0.04475}, tmp_path)
    run = optimize(model, tmp_path)
    assert run.counts(PASS) == (0, 0) and run.op_counts()["Tanh"] == 1
    (unfused,) = run.report["coverage"]["GELU"]["unfused"]
    assert unfused["reason"] == "no pass recognized this spelling"
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
