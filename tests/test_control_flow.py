"""Fusions inside If/Loop/Scan bodies and model-local functions, counted per graph.

Real exporter output (tests/fixtures/make_control_flow_fixtures.py: a scripted decode loop, a
step exported as a model-local function, torch.cond) and onnx.helper models for what the
exporters do not write: nested bodies, Scan, a growing loop state, a body reading an outer
intermediate, weights as Constant nodes in a function, clashing names across graphs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusectl import optimize as optimize_api
from fusectl.core.graphs import graph_scopes
from fusectl.core.repository import UNFUSED
from tests.conftest import Run, named_dim_feeds, optimize, run_cli, run_model
from tests.pass_helpers import (
    IR_VERSION,
    check_output,
    const,
    conv_batchnorm_params,
    fixture_path,
    value,
)
from tests.test_bisect import MARKED_ROOT2, wrong_pass  # noqa: F401 (a fixture)
from tests.test_tune import with_decision

BN = "ConvBatchnormFusionPass"
ACT = "ConvActivationFusionPass"
IDENTITY = "IdentityEliminationPass"
GELU = "GeluFusionPass"
BIAS_GELU = "BiasGeluFusionPass"
MATMUL_BIAS = "MatMulBiasAddFusionPass"
LAYER_NORM = "LayerNormFusionPass"
ADD_LAYER_NORM = "AddLayerNormFusionPass"
FOLD = "ConstantFoldingPass"
ELTWISE = ("--enable_pass", "TbeEltwiseFusionPass")


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _save(path: Path, graph: onnx.GraphProto, functions: Sequence[onnx.FunctionProto] = ()) -> Path:
    imports = [helper.make_opsetid("", 17)]
    imports += [helper.make_opsetid(domain, 1) for domain in {f.domain for f in functions}]
    model = helper.make_model(
        graph, opset_imports=imports, ir_version=IR_VERSION, functions=list(functions)
    )
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _conv_bn_relu(p: str, x: str, weight: str, out: str) -> list[onnx.NodeProto]:
    bn = [f"{p}_conv", *(f"{p}_bn_{k}" for k in ("scale", "bias", "mean", "var"))]
    return [
        helper.make_node("Conv", [x, weight], [f"{p}_conv"], name=f"{p}_Conv", pads=[1] * 4),
        helper.make_node("BatchNormalization", bn, [f"{p}_bn"], name=f"{p}_BN"),
        helper.make_node("Relu", [f"{p}_bn"], [out], name=f"{p}_Relu"),
    ]


def _body(
    nodes: list[onnx.NodeProto],
    name: str,
    out: str,
    shape: list[int],
    inits: Sequence[onnx.TensorProto] = (),
) -> onnx.GraphProto:
    """An If branch: no inputs, one output."""
    return helper.make_graph(nodes, name, [], [value(out, shape)], list(inits))


def _if(name: str, cond: str, out: str, then: onnx.GraphProto, other: onnx.GraphProto):
    return helper.make_node("If", [cond], [out], name=name, then_branch=then, else_branch=other)


def _neg(x: str, out: str, shape: list[int]) -> onnx.GraphProto:
    """An else-branch that negates ``x``."""
    return _body([helper.make_node("Neg", [x], [out], name="neg")], "else", out, shape)


def _weight(name: str, out_channels: int, in_channels: int, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return const(name, rng.normal(0, 0.3, (out_channels, in_channels, 3, 3)))


def _conv_then(x: str, out_channels: int, in_channels: int, seed: int = 0) -> onnx.GraphProto:
    """A then-branch: Conv+BN+Relu of the enclosing graph's ``x``, with its own weights."""
    weights = [
        _weight("t_w", out_channels, in_channels, seed),
        *conv_batchnorm_params(out_channels, "t_bn", seed),
    ]
    nodes = _conv_bn_relu("t", x, "t_w", "t_y")
    return _body(nodes, "then", "t_y", [1, out_channels, 8, 8], weights)


def _erf_gelu(prefix: str, x: str, out: str, root2: str = "sqrt2") -> list[onnx.NodeProto]:
    return [
        helper.make_node("Div", [x, root2], [f"{prefix}_d"], name=f"{prefix}_Div"),
        helper.make_node("Erf", [f"{prefix}_d"], [f"{prefix}_e"], name=f"{prefix}_Erf"),
        helper.make_node("Add", [f"{prefix}_e", "one"], [f"{prefix}_a"], name=f"{prefix}_Add"),
        helper.make_node("Mul", [x, f"{prefix}_a"], [f"{prefix}_m"], name=f"{prefix}_Mul"),
        helper.make_node("Mul", [f"{prefix}_m", "half"], [out], name=f"{prefix}_Mul_1"),
    ]


GELU_CONSTANTS = [const("sqrt2", math.sqrt(2)), const("one", 1.0), const("half", 0.5)]


def _layer_norm(prefix: str, x: str, out: str, axes: list[int]) -> list[onnx.NodeProto]:
    p = prefix
    return [
        helper.make_node("ReduceMean", [x], [f"{p}_mean"], name=f"{p}_Mean", axes=axes),
        helper.make_node("Sub", [x, f"{p}_mean"], [f"{p}_c"], name=f"{p}_Sub"),
        helper.make_node("Pow", [f"{p}_c", f"{p}_two"], [f"{p}_sq"], name=f"{p}_Pow"),
        helper.make_node("ReduceMean", [f"{p}_sq"], [f"{p}_var"], name=f"{p}_Var", axes=axes),
        helper.make_node("Add", [f"{p}_var", f"{p}_eps"], [f"{p}_ve"], name=f"{p}_AddEps"),
        helper.make_node("Sqrt", [f"{p}_ve"], [f"{p}_std"], name=f"{p}_Sqrt"),
        helper.make_node("Div", [f"{p}_c", f"{p}_std"], [f"{p}_n"], name=f"{p}_Div"),
        helper.make_node("Mul", [f"{p}_n", f"{p}_gamma"], [f"{p}_g"], name=f"{p}_Mul"),
        helper.make_node("Add", [f"{p}_g", f"{p}_beta"], [out], name=f"{p}_AddBeta"),
    ]


def _layer_norm_constants(prefix: str, size: int) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(1)
    return [
        const(f"{prefix}_two", 2.0),
        const(f"{prefix}_eps", 1e-5),
        const(f"{prefix}_gamma", rng.uniform(0.5, 1.5, size)),
        const(f"{prefix}_beta", rng.normal(0, 0.1, size)),
    ]


def _loop_cond() -> onnx.NodeProto:
    return helper.make_node("Identity", ["cond_in"], ["cond_out"], name="cond")


LOOP_INPUTS = [value("i", [], TensorProto.INT64), value("cond_in", [], TensorProto.BOOL)]
IMAGE = [1, 3, 8, 8]
FOUR = [1, 4, 8, 8]


def if_conv(path: Path) -> Path:
    """If: Conv+BN+Relu in each branch; the then-branch holds its weights, the else-branch
    reads the main graph's."""
    then = _conv_then("x", 4, 3, seed=1)
    other = _body(_conv_bn_relu("e", "x", "w", "e_y"), "else", "e_y", FOUR)
    graph = helper.make_graph(
        [_if("branch", "cond", "y", then, other)],
        "if_conv",
        [value("x", IMAGE), value("cond", [], TensorProto.BOOL)],
        [value("y", [1, 4, 8, 8])],
        [_weight("w", 4, 3, 2), *conv_batchnorm_params(4, "e_bn", 2)],
    )
    return _save(path, graph)


def loop_gelu(path: Path) -> Path:
    """Loop: MatMul + bias Add + erf GELU on the carried state, weights from the main graph."""
    rng = np.random.default_rng(3)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "lw"], ["mm"], name="body_MatMul"),
            helper.make_node("Add", ["mm", "lb"], ["mb"], name="body_Add"),
            *_erf_gelu("g", "mb", "h_out"),
            _loop_cond(),
        ],
        "body",
        [*LOOP_INPUTS, value("h_in", [2, 8])],
        [value("cond_out", [], TensorProto.BOOL), value("h_out", [2, 8])],
        GELU_CONSTANTS,
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "h0"], ["h"], name="loop", body=body)],
        "loop_gelu",
        [value("h0", [2, 8]), value("n", [], TensorProto.INT64)],
        [value("h", [2, 8])],
        [const("lw", rng.normal(0, 0.3, (8, 8))), const("lb", rng.normal(0, 0.1, 8))],
    )
    return _save(path, graph)


def scan_layer_norm(path: Path) -> Path:
    """Scan: state + step input, then a LayerNorm decomposition; the result is the next state."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["sx"], name="scan_Add"),
            *_layer_norm("ln", "sx", "s_out", [-1]),
            helper.make_node("Identity", ["s_out"], ["y_t"], name="scan_y"),
        ],
        "scan_body",
        [value("s_in", [2, 8]), value("x_t", [2, 8])],
        [value("s_out", [2, 8]), value("y_t", [2, 8])],
        _layer_norm_constants("ln", 8),
    )
    node = helper.make_node(
        "Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body, num_scan_inputs=1
    )
    graph = helper.make_graph(
        [node],
        "scan_layer_norm",
        [value("s0", [2, 8]), value("xs", [5, 2, 8])],
        [value("s", [2, 8]), value("ys", [5, 2, 8])],
    )
    return _save(path, graph)


def function_conv(path: Path) -> Path:
    """A model-local function with Conv+BN+Relu, its weights as Constant nodes (a function has
    no initializers), called twice."""
    weights = [_weight("f_w", 3, 3, 4), *conv_batchnorm_params(3, "f_bn", 4)]
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in weights]
    nodes += _conv_bn_relu("f", "fx", "f_w", "fy")
    onnx17 = [helper.make_opsetid("", 17)]
    block = helper.make_function("local", "ConvBlock", ["fx"], ["fy"], nodes, onnx17)
    calls = [
        helper.make_node("ConvBlock", ["x"], ["a"], domain="local", name="block1"),
        helper.make_node("ConvBlock", ["a"], ["y"], domain="local", name="block2"),
    ]
    graph = helper.make_graph(calls, "function_conv", [value("x", IMAGE)], [value("y", IMAGE)])
    return _save(path, graph, [block])


def nested(path: Path) -> Path:
    """A Loop body holding an If whose then-branch has Conv+BN+Relu on the loop state."""
    then = _conv_then("s_in", 3, 3, seed=5)
    body = helper.make_graph(
        [_if("inner", "flag", "s_out", then, _neg("s_in", "e_y", IMAGE)), _loop_cond()],
        "body",
        [*LOOP_INPUTS, value("s_in", IMAGE)],
        [value("cond_out", [], TensorProto.BOOL), value("s_out", IMAGE)],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)],
        "nested",
        [value("x", IMAGE), value("n", [], TensorProto.INT64), value("flag", [], TensorProto.BOOL)],
        [value("y", IMAGE)],
    )
    return _save(path, graph)


HELPER_MODELS = {
    "if_conv": if_conv,
    "loop_gelu": loop_gelu,
    "scan_layer_norm": scan_layer_norm,
    "function_conv": function_conv,
    "nested": nested,
}


# ---------------------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------------------


def _feeds(path: Path, seed: int = 0, **fixed: Any) -> dict[str, np.ndarray]:
    """Seeded inputs; bool inputs True, integer ones 3 (trip counts), unless given in fixed."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in spec.shape]
        if spec.name in fixed:
            feeds[spec.name] = np.asarray(fixed[spec.name])
        elif spec.type == "tensor(bool)":
            feeds[spec.name] = np.ones(shape, bool)
        elif spec.type == "tensor(int64)":
            feeds[spec.name] = np.full(shape, 3, np.int64)
        else:
            feeds[spec.name] = rng.normal(size=shape).astype(np.float32)
    return feeds


def _same_outputs(original: Path, optimized: Path, *feed_sets: dict[str, Any]) -> None:
    """Equal outputs on onnxruntime (its optimizer off) for each set of fixed inputs."""
    for fixed in feed_sets or ({},):
        feeds = _feeds(original, **fixed)
        for want, got in zip(run_model(original, feeds), run_model(optimized, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def _idempotent(run: Run, tmp_path: Path, *args: str) -> None:
    """The output through fusectl again comes back byte for byte."""
    again = tmp_path / "again"
    again.mkdir()
    second = optimize(run.output, again, *args)
    assert second.output.read_bytes() == run.output.read_bytes()


def _graph_sections(run: Run) -> dict[str, dict[str, Any]]:
    assert run.report is not None
    return {graph["graph_id"]: graph for graph in run.report["graphs"]}


def _per_graph(run: Run, name: str) -> dict[str, tuple[int, int]]:
    """(matched, effected) of a pass in each graph where it matched."""
    return {
        graph_id: (entry["passes"][name]["matched"], entry["passes"][name]["effected"])
        for graph_id, entry in _graph_sections(run).items()
        if name in entry["passes"]
    }


def _near_misses(run: Run, graph_id: str, name: str) -> dict[str, list[str]]:
    misses = _graph_sections(run)[graph_id]["passes"][name]["near_misses"]
    return {miss["reason"]: miss["examples"] for miss in misses}


def _entry(effected: int, matched: int, ub: bool = False) -> dict[str, str]:
    entry = {"effect_times": str(effected), "match_times": str(matched)}
    return entry | ({"repository_hit_times": "0"} if ub else {})


# ---------------------------------------------------------------------------------------------
# onnx.helper models: exact per-graph counts, outputs, idempotence
# ---------------------------------------------------------------------------------------------

CONV_IN_BODY = {"graph_fusion": {BN: _entry(1, 1)}, "ub_fusion": {ACT: _entry(1, 1, ub=True)}}
# Per model: fusion_result.json, the graph lines of the summary, fixed inputs to compare under.
HELPER_EXPECTED: dict[str, tuple[dict, list[str], list[dict]]] = {
    # onnx.helper writes a node's attributes sorted by name: else_branch is 0_1.
    "if_conv": (
        {"session_and_graph_id_0_1": CONV_IN_BODY, "session_and_graph_id_0_2": CONV_IN_BODY},
        [
            "graph 0_1 (If 'branch'.else_branch): 2 matched, 2 effected, nodes 3 -> 1",
            "graph 0_2 (If 'branch'.then_branch): 2 matched, 2 effected, nodes 3 -> 1",
        ],
        [{"cond": True}, {"cond": False}],
    ),
    "loop_gelu": (
        {
            "session_and_graph_id_0_1": {
                "graph_fusion": {
                    GELU: _entry(0, 1),
                    IDENTITY: _entry(0, 1),
                    MATMUL_BIAS: _entry(1, 1),
                },
                "ub_fusion": {BIAS_GELU: _entry(1, 1, ub=True)},
            }
        },
        ["graph 0_1 (Loop 'loop'.body): 4 matched, 2 effected, nodes 8 -> 3"],
        [{"n": 0}, {"n": 3}],
    ),
    "scan_layer_norm": (
        {
            "session_and_graph_id_0_1": {
                "graph_fusion": {IDENTITY: _entry(0, 1), LAYER_NORM: _entry(1, 1)},
                "ub_fusion": {ADD_LAYER_NORM: _entry(0, 1, ub=True)},
            }
        },
        ["graph 0_1 (Scan 'scan'.body): 3 matched, 1 effected, nodes 11 -> 3"],
        [],
    ),
    "function_conv": (
        {"session_and_graph_id_0_1": CONV_IN_BODY},
        ["graph 0_1 (function local::ConvBlock): 2 matched, 2 effected, nodes 8 -> 3"],
        [],
    ),
    "nested": (
        {
            "session_and_graph_id_0_1": {"graph_fusion": {IDENTITY: _entry(0, 1)}},
            "session_and_graph_id_0_3": CONV_IN_BODY,
        },
        [
            "graph 0_1 (Loop 'loop'.body): 1 matched, 0 effected, nodes 2 -> 2",
            "graph 0_3 (Loop 'loop'.body > If 'inner'.then_branch): 2 matched, 2 effected, "
            "nodes 3 -> 1",
        ],
        [{"flag": True}, {"flag": False}],
    ),
}


@pytest.mark.parametrize("name", sorted(HELPER_MODELS))
def test_fusions_run_in_every_graph(name: str, tmp_path: Path) -> None:
    model = HELPER_MODELS[name](tmp_path / f"{name}.onnx")
    expected, lines, feed_sets = HELPER_EXPECTED[name]
    run = optimize(model, tmp_path)
    assert run.fusion_result == expected
    assert [line for line in run.stderr.splitlines() if line.startswith("graph ")] == lines
    # The report's graph sections carry the same counts as fusion_result.json.
    for key, sections in expected.items():
        passes = _graph_sections(run)[key.removeprefix("session_and_graph_id_")]["passes"]
        for entries in sections.values():
            for pass_name, entry in entries.items():
                assert passes[pass_name]["matched"] == int(entry["match_times"])
                assert passes[pass_name]["effected"] == int(entry["effect_times"])
    check_output(run)
    _same_outputs(model, run.output, *feed_sets)
    _idempotent(run, tmp_path)


def test_graph_ids_follow_the_documented_order(tmp_path: Path) -> None:
    """Main graph, then bodies depth first in node and attribute order, then functions."""
    model = ir.load(str(nested(tmp_path / "nested.onnx")))
    scopes = graph_scopes(model)
    assert [(s.graph_id, s.label, s.kind) for s in scopes] == [
        ("0_0", "main", "main"),
        ("0_1", "Loop 'loop'.body", "subgraph"),
        ("0_2", "Loop 'loop'.body > If 'inner'.else_branch", "subgraph"),
        ("0_3", "Loop 'loop'.body > If 'inner'.then_branch", "subgraph"),
    ]
    functions = graph_scopes(ir.load(str(function_conv(tmp_path / "function.onnx"))))
    assert [(s.graph_id, s.label, s.kind) for s in functions] == [
        ("0_0", "main", "main"),
        ("0_1", "function local::ConvBlock", "function"),
    ]


def test_report_graph_sections_and_sites(tmp_path: Path) -> None:
    run = optimize(if_conv(tmp_path / "if_conv.onnx"), tmp_path)
    graphs = _graph_sections(run)
    assert [(g["graph_id"], g["graph"], g["kind"]) for g in graphs.values()] == [
        ("0_0", "main", "main"),
        ("0_1", "If 'branch'.else_branch", "subgraph"),
        ("0_2", "If 'branch'.then_branch", "subgraph"),
    ]
    assert (graphs["0_1"]["nodes_before"], graphs["0_1"]["nodes_after"]) == (3, 1)
    # The totals per pass are over all graphs; each site names its graph.
    assert run.counts(BN) == (2, 2)
    assert [site["graph"] for site in run.passed(BN)["sites"]] == ["0_1", "0_2"]
    assert run.report["fusion_result"] == run.fusion_result


def test_older_layouts_list_each_graph_or_sum_them(tmp_path: Path) -> None:
    model = if_conv(tmp_path / "if_conv.onnx")
    listed = optimize(model, tmp_path, "--fusion_result_format", "list").fusion_result
    assert [entry["session_and_graph_id"] for entry in listed] == ["0_1", "0_2"]
    assert listed[0]["graph_fusion"] == {BN: _entry(1, 1)}
    # The CANN 5 object holds one graph: the counts over all graphs, under the main graph's id.
    single = optimize(model, tmp_path, "--fusion_result_format", "object").fusion_result
    assert single == {
        "graph_fusion": {BN: _entry(2, 2)},
        "ub_fusion": {ACT: _entry(2, 2)},
        "session_and_graph_id": "0_0",
    }


def test_logs_name_the_graph(tmp_path: Path) -> None:
    run = optimize(if_conv(tmp_path / "if_conv.onnx"), tmp_path, "--log", "info")
    lines = [line.split(" ", 2)[2] for line in run.stderr.splitlines() if "] fusectl(" in line]
    assert [line for line in lines if line.startswith("GraphId[")] == [
        f"GraphId[{n}], GraphFusionPass[{BN}]: pattern=ConvBatchnorm, matched_times=1, "
        "effected_times=1."
        for n in (1, 2)
    ]
    assert any(line.startswith(f"Pass [{BN}] took ") and "in graph 0_2." in line for line in lines)


# ---------------------------------------------------------------------------------------------
# Real exporter output
# ---------------------------------------------------------------------------------------------

# Per fixture: fusion_result.json, near misses per (graph, pass), fixed inputs to compare under.
EXPORTED: dict[str, tuple[dict, dict[tuple[str, str], dict[str, list[str]]], list[dict]]] = {
    # A scripted decode loop: the step's bias GELU and residual LayerNorm fuse in the body.
    "decoder_loop_ts17": (
        {
            "session_and_graph_id_0_1": {
                "graph_fusion": {
                    GELU: _entry(0, 1),
                    IDENTITY: _entry(0, 1),
                    MATMUL_BIAS: _entry(0, 1),
                },
                "ub_fusion": {
                    ADD_LAYER_NORM: _entry(1, 1, ub=True),
                    BIAS_GELU: _entry(1, 1, ub=True),
                },
            }
        },
        {
            # The body's condition output copies the main graph's constant True.
            ("0_1", IDENTITY): {
                "it copies a value of an enclosing graph to a subgraph output": ["/Identity"]
            },
            ("0_1", MATMUL_BIAS): {"MatMul input A is 3-D; Gemm needs 2-D": ["/step/fc/Add"]},
        },
        [{"n": 0}, {"n": 3}],
    ),
    # The step as a model-local function: its inputs have no shapes and its weights are
    # inputs, so only the bias GELU fuses; the others say why not.
    "decoder_functions_ts17": (
        {
            "session_and_graph_id_0_1": {
                "graph_fusion": {GELU: _entry(0, 1), MATMUL_BIAS: _entry(0, 1)},
                "ub_fusion": {
                    ADD_LAYER_NORM: _entry(0, 1, ub=True),
                    BIAS_GELU: _entry(1, 1, ub=True),
                },
            }
        },
        {
            ("0_1", MATMUL_BIAS): {"rank of MatMul input A is unknown": ["Add_1"]},
            ("0_1", ADD_LAYER_NORM): {
                "gamma is a graph input (fed), not a constant": ["LayerNormalization_11"]
            },
        },
        [],
    ),
    # torch.cond: one step per branch, each fully fused.
    "decoder_cond_dynamo": (
        {
            f"session_and_graph_id_0_{n}": {
                "graph_fusion": {GELU: _entry(0, 1), MATMUL_BIAS: _entry(0, 1)},
                "ub_fusion": {
                    ADD_LAYER_NORM: _entry(1, 1, ub=True),
                    BIAS_GELU: _entry(1, 1, ub=True),
                },
            }
            for n in (1, 2)
        },
        {("0_2", GELU): {"Gelu needs opset >= 20, model has 18": ["node_gelu_2"]}},
        [{}, {"h": -np.abs(np.random.default_rng(0).normal(size=(1, 4, 16))).astype(np.float32)}],
    ),
}


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_exported_control_flow(name: str, tmp_path: Path) -> None:
    model = fixture_path(name)
    expected, misses, feed_sets = EXPORTED[name]
    run = optimize(model, tmp_path)
    assert run.fusion_result == expected
    for (graph_id, pass_name), reasons in misses.items():
        assert _near_misses(run, graph_id, pass_name) == reasons
    check_output(run)
    _same_outputs(model, run.output, *feed_sets)
    _idempotent(run, tmp_path)


def test_exported_bodies_hold_the_fused_ops(tmp_path: Path) -> None:
    run = optimize(fixture_path("decoder_loop_ts17"), tmp_path)
    (loop,) = [node for node in onnx.load(str(run.output)).graph.node if node.op_type == "Loop"]
    body = loop.attribute[0].g
    assert [node.op_type for node in body.node] == [
        "MatMul",
        "BiasGelu",
        "SkipLayerNormalization",
        "Identity",
    ]


# ---------------------------------------------------------------------------------------------
# Care points: outer values, loop-carried state, functions, names
# ---------------------------------------------------------------------------------------------


def test_a_value_a_body_reads_is_not_fused_away(tmp_path: Path) -> None:
    """Conv+BN in the main graph whose Conv output both If branches read: a near miss."""
    twice = helper.make_node("Mul", ["m_conv", "two"], ["t_y"], name="twice")
    then = _body([twice], "then", "t_y", FOUR, [const("two", 2.0)])
    graph = helper.make_graph(
        [
            *_conv_bn_relu("m", "x", "w", "y"),
            _if("branch", "cond", "z", then, _neg("m_conv", "e_y", FOUR)),
        ],
        "outer_read",
        [value("x", IMAGE), value("cond", [], TensorProto.BOOL)],
        [value("y", FOUR), value("z", FOUR)],
        [_weight("w", 4, 3), *conv_batchnorm_params(4, "m_bn")],
    )
    model = _save(tmp_path / "outer_read.onnx", graph)
    run = optimize(model, tmp_path)
    assert run.fusion_result == {"session_and_graph_id_0_0": {"graph_fusion": {BN: _entry(0, 1)}}}
    assert _near_misses(run, "0_0", BN) == {
        "an intermediate value (Conv output) is also used by Neg in the subgraph 'else'": ["m_BN"]
    }
    check_output(run)
    _same_outputs(model, run.output, {"cond": True}, {"cond": False})


def test_loop_carried_state_is_never_folded(tmp_path: Path) -> None:
    """The state grows each iteration (Concat): the Shape of it is not a constant, though a
    Shape of a loop-invariant weight in the same body is."""
    body = helper.make_graph(
        [
            helper.make_node("Concat", ["acc_in", "x"], ["acc_out"], name="grow", axis=0),
            helper.make_node("Shape", ["acc_out"], ["rows"], name="rows", start=0, end=1),
            helper.make_node("Shape", ["x"], ["width"], name="width", start=1),
            helper.make_node("Concat", ["rows", "width"], ["size"], name="size", axis=0),
            _loop_cond(),
        ],
        "body",
        [*LOOP_INPUTS, value("acc_in", None)],
        [
            value("cond_out", [], TensorProto.BOOL),
            value("acc_out", None),
            value("size", [2], TensorProto.INT64),
        ],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["acc", "sizes"], name="loop", body=body)],
        "loop_grow",
        [value("x", [2, 3]), value("n", [], TensorProto.INT64)],
        [value("acc", ["r", 3]), value("sizes", ["k", 2], TensorProto.INT64)],
    )
    model = _save(tmp_path / "loop_grow.onnx", graph)
    run = optimize(model, tmp_path)
    assert _per_graph(run, FOLD) == {"0_1": (1, 1)}  # the width, from the main graph's input
    (loop,) = onnx.load(str(run.output)).graph.node
    assert [node.name for node in loop.attribute[0].g.node] == ["grow", "rows", "size", "cond"]
    check_output(run)
    _same_outputs(model, run.output, {"n": 0}, {"n": 1}, {"n": 4})
    _idempotent(run, tmp_path)


def test_function_bodies_get_constants_not_initializers(tmp_path: Path) -> None:
    run = optimize(function_conv(tmp_path / "function.onnx"), tmp_path)
    model = onnx.load(str(run.output))
    (function,) = model.functions
    # The folded weight and bias are Constant nodes at the top of the body.
    assert [(n.op_type, n.output[0]) for n in function.node] == [
        ("Constant", f"{BN}/f_BN/weight"),
        ("Constant", f"{BN}/f_BN/bias"),
        ("FusedConv", "fy"),
    ]
    assert [i.name for i in model.graph.initializer] == []
    imports = {(o.domain, o.version) for o in function.opset_import}
    assert imports == {("", 17), ("com.microsoft", 1)}


def test_names_made_in_two_graphs_do_not_shadow(tmp_path: Path) -> None:
    """Conv+BN in the main graph and in a branch, with the same node names: the branch's new
    weights take a suffix instead of shadowing the main graph's."""
    main = _conv_bn_relu("m", "x", "w", "mid")
    inner = _conv_bn_relu("t", "mid", "t_w", "t_y")
    for node in (*main, *inner):
        node.name = node.name.replace("m_", "blk_").replace("t_", "blk_")
    weights = [_weight("t_w", 4, 4, 1), *conv_batchnorm_params(4, "t_bn", 1)]
    then = _body(inner, "then", "t_y", FOUR, weights)
    graph = helper.make_graph(
        [*main, _if("branch", "cond", "y", then, _neg("mid", "e_y", FOUR))],
        "shadow",
        [value("x", IMAGE), value("cond", [], TensorProto.BOOL)],
        [value("y", FOUR)],
        [_weight("w", 4, 3), *conv_batchnorm_params(4, "m_bn")],
    )
    model = _save(tmp_path / "shadow.onnx", graph)
    run = optimize(model, tmp_path)
    assert _per_graph(run, BN) == {"0_0": (1, 1), "0_2": (1, 1)}
    saved = onnx.load(str(run.output))
    weights = [f"{BN}/blk_BN/weight", f"{BN}/blk_BN/bias"]
    assert [i.name for i in saved.graph.initializer] == weights
    branch = next(a.g for a in saved.graph.node[-1].attribute if a.name == "then_branch")
    assert [i.name for i in branch.initializer] == [f"{name}_1" for name in weights]
    check_output(run)
    _same_outputs(model, run.output, {"cond": True}, {"cond": False})
    _idempotent(run, tmp_path)


def test_a_removed_body_reports_no_size(tmp_path: Path) -> None:
    """An If nothing reads: its branch is optimized, then dead-node removal takes the If."""
    then = _conv_then("x", 3, 3)
    graph = helper.make_graph(
        [
            _if("dead", "cond", "unused", then, _neg("x", "e_y", IMAGE)),
            helper.make_node("Relu", ["x"], ["y"], name="relu"),
        ],
        "dead_if",
        [value("x", IMAGE), value("cond", [], TensorProto.BOOL)],
        [value("y", IMAGE)],
    )
    run = optimize(_save(tmp_path / "dead_if.onnx", graph), tmp_path)
    graphs = _graph_sections(run)
    assert graphs["0_2"]["nodes_after"] is None and graphs["0_2"]["passes"][BN]["effected"] == 1
    assert [node.op_type for node in onnx.load(str(run.output)).graph.node] == ["Relu"]
    check_output(run)


def test_attributes_a_function_takes_from_its_caller_are_not_read(tmp_path: Path) -> None:
    """A body node whose attribute is the function's (``alpha = @alpha``) has no value until
    the call: a match holding one is a near miss, and it joins no element-wise cluster."""
    conv = helper.make_node("Conv", ["fx", "f_w"], ["fc"], name="f_Conv")
    leaky = helper.make_node("LeakyRelu", ["fc"], ["fl"], name="f_Leaky")
    conv.attribute.append(helper.make_attribute_ref("pads", onnx.AttributeProto.INTS))
    leaky.attribute.append(helper.make_attribute_ref("alpha", onnx.AttributeProto.FLOAT))
    weights = [_weight("f_w", 3, 3), const("f_s", 2.0)]
    nodes = [
        *(helper.make_node("Constant", [], [t.name], value=t) for t in weights),
        conv,
        leaky,
        helper.make_node("Mul", ["fl", "f_s"], ["fy"], name="f_Mul"),
    ]
    onnx17 = [helper.make_opsetid("", 17)]
    act = helper.make_function(
        "local", "Act", ["fx"], ["fy"], nodes, onnx17, attributes=["alpha", "pads"]
    )
    calls = [
        helper.make_node("Act", [x], [y], domain="local", name=y, alpha=a, pads=[1] * 4)
        for x, y, a in (("x", "a", 0.1), ("a", "y", 0.2))
    ]
    graph = helper.make_graph(calls, "refs", [value("x", IMAGE)], [value("y", IMAGE)])
    model = _save(tmp_path / "refs.onnx", graph, [act])
    run = optimize(model, tmp_path, *ELTWISE)
    assert run.fusion_result == {
        "session_and_graph_id_0_1": {"ub_fusion": {ACT: _entry(0, 1, ub=True)}}
    }
    assert _near_misses(run, "0_1", ACT) == {
        "LeakyRelu 'f_Leaky' takes its attribute 'alpha' from the function's 'alpha'": ["f_Leaky"]
    }
    check_output(run)
    _same_outputs(model, run.output)
    _idempotent(run, tmp_path, *ELTWISE)


# ---------------------------------------------------------------------------------------------
# Element-wise clustering, bisect, the library API
# ---------------------------------------------------------------------------------------------


def test_eltwise_clusters_in_a_body_and_keeps_its_functions(tmp_path: Path) -> None:
    """The clustering runs in a Loop body; the functions it makes are fusion results, not
    input: a second run leaves them as they are."""
    args = (*ELTWISE, "--disable_pass", BIAS_GELU)
    run = optimize(loop_gelu(tmp_path / "loop.onnx"), tmp_path, *args)
    assert _per_graph(run, "TbeEltwiseFusionPass") == {"0_1": (1, 1)}
    model = onnx.load(str(run.output))
    assert [(f.domain, f.name) for f in model.functions] == [
        ("fusectl.eltwise", "Fused_Div_Erf_Add_Mul_5ops")
    ]
    check_output(run)
    _same_outputs(tmp_path / "loop.onnx", run.output, {"n": 3})
    _idempotent(run, tmp_path, *args)
    blocks = optimize(fixture_path("eltwise_blocks_ts17"), tmp_path, *ELTWISE)
    _idempotent(blocks, tmp_path / "again", *ELTWISE)


@pytest.mark.usefixtures("wrong_pass")
def test_bisect_finds_a_wrong_rewrite_in_a_body(tmp_path: Path) -> None:
    """An erf GELU in the main graph (right divisor) and one in the Loop body marked for the
    wrong pass: bisect numbers rewrites across graphs and pins the body's."""
    rng = np.random.default_rng(0)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "w"], ["mm"], name="body/MatMul"),
            *_erf_gelu("body", "mm", "h_out", root2="marked"),
            _loop_cond(),
        ],
        "body",
        [*LOOP_INPUTS, value("h_in", [4, 16])],
        [value("cond_out", [], TensorProto.BOOL), value("h_out", [4, 16])],
        [const("marked", MARKED_ROOT2)],
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["mm0"], name="main/MatMul"),
            *_erf_gelu("main", "mm0", "h0"),
            helper.make_node("Loop", ["n", "", "h0"], ["y"], name="loop", body=body),
        ],
        "bisect_loop",
        [value("x", [4, 16]), value("n", [], TensorProto.INT64)],
        [value("y", [4, 16])],
        [const("w", rng.normal(0, 0.4, (16, 16))), *GELU_CONSTANTS],
    )
    model = _save(tmp_path / "bisect_loop.onnx", graph)
    result = run_cli("bisect", model, "--output_switch", tmp_path / "s.cfg", "--json")
    assert result.exit_code == 1, result.stderr
    (culprit,) = json.loads(result.stdout)["culprits"]
    assert (culprit["pass"], culprit["graph"]) == ("WrongGeluPass", "0_1")
    assert culprit["original_nodes"][0] == "body_Div"
    assert "(graph 0_1)" in result.stderr


def test_tune_measures_body_sites_and_the_repository_gates_them(tmp_path: Path) -> None:
    """The Loop body's sites are tuned; a verdict that one is slower declines it there."""
    model = fixture_path("decoder_loop_ts17")
    repository = tmp_path / "repository.json"
    tuned = run_cli("tune", model, "--repository", repository, "--budget", "0.2")
    assert tuned.exit_code == 0, tuned.stderr
    assert "2 site(s) in 2 class(es) to measure" in tuned.stderr
    slow = with_decision(
        repository,
        tmp_path / "slow.json",
        ADD_LAYER_NORM,
        decision=UNFUSED,
        fused_ms=0.5,
        unfused_ms=0.1,
    )
    run = optimize(model, tmp_path, "--repository", slow)
    assert run.fusion_result["session_and_graph_id_0_1"]["ub_fusion"] == {
        ADD_LAYER_NORM: {"effect_times": "0", "match_times": "1", "repository_hit_times": "1"},
        BIAS_GELU: {"effect_times": "1", "match_times": "1", "repository_hit_times": "1"},
    }
    assert _near_misses(run, "0_1", ADD_LAYER_NORM) == {
        "slower on CPUExecutionProvider: 0.5 vs 0.1 ms": ["/step/norm/LayerNormalization"]
    }
    check_output(run)
    _same_outputs(model, run.output, {"n": 3})


def test_library_result_has_the_graphs(tmp_path: Path) -> None:
    result = optimize_api(nested(tmp_path / "nested.onnx"))
    graphs = result.run.graphs
    assert [graph.scope.graph_id for graph in graphs] == ["0_0", "0_1", "0_2", "0_3"]
    assert set(result.fusion_result) == {"session_and_graph_id_0_1", "session_and_graph_id_0_3"}
    assert (result.run.nodes_before, result.run.nodes_after) == (7, 5)


# A merged decoder as optimum writes it for generation: If(use_cache_branch) choosing between
# two copies of the decoder, its weights in the outer graph. Here both branches are the tiny
# LLaMA with a KV cache (each value renamed per branch, its declared shapes kept), reading the
# outer inputs.


def _merged_decoder(path: Path, name: str) -> Path:
    model = onnx.load(str(fixture_path(name)))
    outer = {v.name for v in model.graph.input} | {t.name for t in model.graph.initializer}

    def branch(prefix: str) -> onnx.GraphProto:
        def renamed(names: Sequence[str]) -> list[str]:
            return [n if n in outer or not n else prefix + n for n in names]

        nodes = []
        for node in model.graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = prefix + node.name
            del copy.input[:], copy.output[:]
            copy.input.extend(renamed(node.input))
            copy.output.extend(renamed(node.output))
            nodes.append(copy)
        declared: list[list[onnx.ValueInfoProto]] = [[], []]
        for infos, found in zip(
            declared, (model.graph.output, model.graph.value_info), strict=True
        ):
            for info in found:
                copy = onnx.ValueInfoProto()
                copy.CopyFrom(info)
                (copy.name,) = renamed([info.name])
                infos.append(copy)
        outputs, value_info = declared
        return helper.make_graph(nodes, prefix + "decoder", [], outputs, value_info=value_info)

    choose = helper.make_node(
        "If",
        ["use_cache_branch"],
        [o.name for o in model.graph.output],
        then_branch=branch("with_past_"),
        else_branch=branch("without_past_"),
    )
    graph = helper.make_graph(
        [choose],
        "merged",
        [*model.graph.input, value("use_cache_branch", [1], TensorProto.BOOL)],
        list(model.graph.output),
        list(model.graph.initializer),
    )
    merged = helper.make_model(graph, opset_imports=model.opset_import, ir_version=IR_VERSION)
    onnx.save(merged, str(path))
    return path


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_merged_decoder_fuses_in_both_branches(exporter: str, tmp_path: Path) -> None:
    """Each branch gets what the decoder alone gets: both layers' attention, rotary on q and k,
    the five norms; the weights stay in the outer graph, read by both."""
    model = _merged_decoder(tmp_path / "merged.onnx", f"llama_tiny_past_{exporter}")
    run = optimize(model, tmp_path)
    check_output(run)
    attention = ("MultiHeadAttentionFusionPass", "GroupQueryAttentionFusionPass")
    per_branch = [_per_graph(run, name) for name in attention]
    fused = {
        graph: sum(found.get(graph, (0, 0))[1] for found in per_branch) for graph in ("0_1", "0_2")
    }
    assert fused == {"0_1": 2, "0_2": 2}  # the two branches; the main graph has no attention
    assert _per_graph(run, "RotaryEmbeddingFusionPass") == {"0_1": (4, 4), "0_2": (4, 4)}
    (choose,) = onnx.load(str(run.output)).graph.node
    for branch in choose.attribute:
        ops = [node.op_type for node in branch.g.node]
        assert (ops.count("RotaryEmbedding"), ops.count("Softmax"), ops.count("ReduceMean")) == (
            4,
            0,
            0,
        )
        assert ops.count("SkipSimplifiedLayerNormalization") == 5
    dims = {"batch": 2, "sequence": 3, "past_sequence": 4, "total_sequence": 7}
    for use_cache in (True, False):
        feeds = named_dim_feeds(model, {k: v for k, v in dims.items() if k != "use_cache"})
        feeds["use_cache_branch"] = np.array([use_cache])
        _same_outputs(model, run.output, feeds)
