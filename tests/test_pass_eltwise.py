"""TbeEltwiseFusionPass: the two examples of MindSpore's graph-kernel fusion tutorial (seed 002)
as PyTorch exports (tests/fixtures/make_eltwise_fixtures.py), near misses built with
onnx.helper, --graph_kernel_flags, shared functions, idempotence and bisect."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from fusectl.core.engine import run_plan
from fusectl.core.model_io import load_model
from fusectl.core.model_io import save_model as write_model
from fusectl.core.plugins import load_builtin_passes
from fusectl.core.switches import SwitchRequest, resolve
from fusectl.passes.eltwise import DEFAULT_CLUSTER_OPS, parse_graph_kernel_flags
from fusectl.rewrite.context import Rewrites
from tests.conftest import Run, assert_same_outputs, optimize, run_cli, run_model
from tests.pass_helpers import IR_VERSION, const, fixture_path, reasons, save_model, value

ELTWISE = "TbeEltwiseFusionPass"
ENABLE = ("--enable_pass", ELTWISE)
DOMAIN = "fusectl.eltwise"
# The seed's inputs and what it prints.
SEED1_X = np.full((4, 4), 0.5, np.float32)
SEED2_X = np.full((4, 4), 0.2, np.float32)
SEED2_Y = np.full((4, 4), 0.3, np.float32)
SEED2_RESULT = -0.015104


def _load(run: Run) -> onnx.ModelProto:
    """The optimized model, after the full checker."""
    model = onnx.load(str(run.output))
    onnx.checker.check_model(model, full_check=True)
    return model


def _ops(model: onnx.ModelProto) -> list[str]:
    """The graph's op types in order, fused calls as domain.name."""
    return [f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in model.graph.node]


def _functions(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Model-local functions by domain.name, with their body op types."""
    return {f"{f.domain}.{f.name}": [n.op_type for n in f.node] for f in model.functions}


def _enabled(model: Path, tmp_path: Path, *args: str, expect: int = 0) -> Run:
    return optimize(model, tmp_path, *ENABLE, *args, expect=expect)


# ---------------------------------------------------------------------------------------------
# Seed 002, first example: res = x * 2.0 + 1.0 becomes one op.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["seed002_basic_ts17", "seed002_basic_dynamo"])
def test_seed_example_1_is_one_fused_op(name: str, tmp_path: Path) -> None:
    run = _enabled(fixture_path(name), tmp_path)
    model = _load(run)
    assert _ops(model) == [f"{DOMAIN}.Fused_Mul_Add"]
    assert _functions(model) == {f"{DOMAIN}.Fused_Mul_Add": ["Constant", "Mul", "Constant", "Add"]}
    assert run.counts(ELTWISE) == (1, 1)
    assert run.fusion_result["session_and_graph_id_0_0"]["ub_fusion"][ELTWISE] == {
        "effect_times": "1",
        "match_times": "1",
        "repository_hit_times": "0",
    }
    (res,) = run_model(run.output, {"x": SEED1_X})
    np.testing.assert_array_equal(res, np.full((4, 4), 2.0, np.float32))


def test_seed_example_1_site_and_lineage(tmp_path: Path) -> None:
    run = _enabled(fixture_path("seed002_basic_ts17"), tmp_path)
    assert run.passed(ELTWISE)["sites"] == [
        {
            "pattern": "EltwiseCluster",
            # the scalars are initializers (ConstantFoldingPass lifts the Constants), copied
            # into the body as its own Constants
            "original_nodes": ["/Mul", "/Add"],
            "original_types": ["Mul", "Add"],
            "new_nodes": [f"{ELTWISE}//Add"],
            "graph": "0_0",
        }
    ]
    graph = _load(run).graph
    assert [o.name for o in graph.output] == [
        o.name for o in onnx.load(str(fixture_path("seed002_basic_ts17"))).graph.output
    ]


# ---------------------------------------------------------------------------------------------
# Seed 002, second example: MyOp(pow(x * 2, 3), y) with MyOp(x, y) = (x - y) * x fuses across
# the composite's boundary.
# ---------------------------------------------------------------------------------------------


def _my_op_model(path: Path, *, softmax: bool = False) -> Path:
    """Seed example 2 with onnx.helper: MyOp is a model-local function in domain custom.ops
    (with ``softmax``, MyOp(x, y) = Softmax(x - y) * x, which is not element-wise)."""
    sub = helper.make_node("Sub", ["a", "b"], ["d"])
    body = [sub, helper.make_node("Mul", ["d", "a"], ["out"])]
    if softmax:
        body = [
            sub,
            helper.make_node("Softmax", ["d"], ["s"]),
            helper.make_node("Mul", ["s", "a"], ["out"]),
        ]
    my_op = helper.make_function(
        "custom.ops", "MyOp", ["a", "b"], ["out"], body, [helper.make_opsetid("", 17)]
    )
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["m"], name="mul"),
        helper.make_node("Pow", ["m", "three"], ["p"], name="pow"),
        helper.make_node("MyOp", ["p", "y"], ["res"], name="my_op", domain="custom.ops"),
    ]
    graph = helper.make_graph(
        nodes,
        "seed002",
        [value("x", [4, 4]), value("y", [4, 4])],
        [value("res", [4, 4])],
        [const("two", 2.0), const("three", 3.0)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom.ops", 1)],
        functions=[my_op],
        ir_version=IR_VERSION,
    )
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture
def helper_my_op(tmp_path: Path) -> Path:
    return _my_op_model(tmp_path / "seed002_custom_op_helper.onnx")


@pytest.mark.parametrize("name", ["seed002_custom_op_ts17", "seed002_custom_op_dynamo", "helper"])
def test_seed_example_2_fuses_across_the_composite(
    name: str, helper_my_op: Path, tmp_path: Path
) -> None:
    source = helper_my_op if name == "helper" else fixture_path(name)
    composites = [f.name for f in onnx.load(str(source)).functions]
    assert composites == ([] if name.endswith("dynamo") else ["MyOp"])
    run = _enabled(source, tmp_path)
    model = _load(run)
    fused = f"{DOMAIN}.Fused_Mul_Pow_Sub_Mul"
    assert _ops(model) == [fused]
    # MyOp is gone (TorchScript: __main__.MyOp; helper: custom.ops.MyOp), and its domain import.
    assert _functions(model) == {fused: ["Constant", "Mul", "Constant", "Pow", "Sub", "Mul"]}
    assert {o.domain for o in model.opset_import} == {"", DOMAIN}
    assert run.counts(ELTWISE) == (1, 1)
    (res,) = run_model(run.output, {"x": SEED2_X, "y": SEED2_Y})
    np.testing.assert_allclose(res, np.full((4, 4), SEED2_RESULT, np.float32), rtol=1e-5)


def test_the_composite_call_is_in_the_lineage(tmp_path: Path) -> None:
    run = _enabled(fixture_path("seed002_custom_op_ts17"), tmp_path)
    (site,) = run.passed(ELTWISE)["sites"]
    assert site["original_nodes"] == ["/Mul", "/Pow", "/my_op/MyOp"]
    assert site["original_types"] == ["Mul", "Pow", "MyOp"]


def test_default_off_leaves_the_model_as_it_is(tmp_path: Path) -> None:
    source = fixture_path("seed002_custom_op_ts17")
    run = optimize(source, tmp_path)
    assert run.passed(ELTWISE)["state"] == "off"
    assert run.counts(ELTWISE) == (0, 0)
    # Nothing clustered: the same nodes, but for the Constants, which are initializers now
    # (ConstantFoldingPass lifts them, as onnxruntime does on load), and the same functions.
    original, optimized = onnx.load(str(source)), _load(run)
    kept = [(n.name, n.op_type) for n in original.graph.node if n.op_type != "Constant"]
    assert [(n.name, n.op_type) for n in optimized.graph.node] == kept
    text = onnx.printer.to_text
    assert [text(f) for f in optimized.functions] == [text(f) for f in original.functions]
    assert_same_outputs(source, run.output)


# ---------------------------------------------------------------------------------------------
# Near misses: convexity, non-element-wise ops, graph outputs, composites that stay whole.
# ---------------------------------------------------------------------------------------------


def _diamond(path: Path, through: str) -> Path:
    """x -> Relu -> Mul(2) = m; m -> ``through`` -> Add(m, .) -> Sigmoid -> Mul(3). Joining the
    Add to m's cluster would put ``through`` both after and before the fused op."""
    middle = (
        helper.make_node("MatMul", ["m", "w"], ["t"], name="through")
        if through == "MatMul"
        else helper.make_node("Softmax", ["m"], ["t"], name="through")
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "two"], ["m"], name="mul"),
        middle,
        helper.make_node("Add", ["m", "t"], ["a"], name="add"),
        helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"),
        helper.make_node("Mul", ["s", "three"], ["out"], name="mul3"),
    ]
    weights = [const("w", np.eye(4) * 0.5), const("two", 2.0), const("three", 3.0)]
    return save_model(path, nodes, [value("x", [2, 4])], [value("out", [2, 4])], weights)


@pytest.mark.parametrize("through", ["MatMul", "Softmax"])
def test_a_diamond_through_another_op_gives_two_clusters(through: str, tmp_path: Path) -> None:
    source = _diamond(tmp_path / "diamond.onnx", through)
    run = _enabled(source, tmp_path)
    model = _load(run)
    assert _ops(model) == [f"{DOMAIN}.Fused_Relu_Mul", through, f"{DOMAIN}.Fused_Add_Sigmoid_Mul"]
    assert run.counts(ELTWISE) == (3, 2)
    assert reasons(run, ELTWISE) == {f"joining would create a cycle through {through}": 1}
    assert run.passed(ELTWISE)["near_misses"][0]["examples"] == ["add"]
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


def test_a_cluster_blocked_through_another_cluster_stays_apart(tmp_path: Path) -> None:
    """The Add reads two clusters, and the second one reads the first through a MatMul:
    the Add joins the second only."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Neg", ["r"], ["n"], name="neg"),
        helper.make_node("MatMul", ["n", "w"], ["t"], name="matmul"),
        helper.make_node("Sigmoid", ["t"], ["s"], name="sigmoid"),
        helper.make_node("Exp", ["s"], ["e"], name="exp"),
        helper.make_node("Add", ["n", "e"], ["out"], name="add"),
    ]
    source = save_model(
        tmp_path / "blocked.onnx",
        nodes,
        [value("x", [2, 4])],
        [value("out", [2, 4])],
        [const("w", np.eye(4) * 0.5)],
    )
    run = _enabled(source, tmp_path)
    assert _ops(_load(run)) == [
        f"{DOMAIN}.Fused_Relu_Neg",
        "MatMul",
        f"{DOMAIN}.Fused_Sigmoid_Exp_Add",
    ]
    assert run.counts(ELTWISE) == (3, 2)
    assert reasons(run, ELTWISE) == {"joining would create a cycle through MatMul": 1}
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


def test_a_value_a_subgraph_reads_is_an_input_of_its_node(tmp_path: Path) -> None:
    """The If reads b only inside its branches; the Add reading the If's output must still
    not join b's cluster, or the fused op would feed the If that feeds it."""
    branch = {
        name: helper.make_graph(
            [helper.make_node(op, ["b"], [f"{name}_out"])], name, [], [value(f"{name}_out", None)]
        )
        for name, op in (("then", "Neg"), ("else", "Abs"))
    }
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Mul", ["a", "two"], ["b"], name="mul"),
        helper.make_node(
            "If", ["cond"], ["i"], name="if", then_branch=branch["then"], else_branch=branch["else"]
        ),
        helper.make_node("Add", ["a", "i"], ["out"], name="add"),
    ]
    inputs = [value("x", [2, 4]), value("cond", [], onnx.TensorProto.BOOL)]
    source = save_model(
        tmp_path / "if.onnx", nodes, inputs, [value("out", [2, 4])], [const("two", 2.0)]
    )
    run = _enabled(source, tmp_path)
    assert _ops(_load(run)) == [f"{DOMAIN}.Fused_Relu_Mul", "If", "Add"]
    assert reasons(run, ELTWISE) == {"joining would create a cycle through If": 1}
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        np.testing.assert_array_equal(run_model(run.output, feeds), run_model(source, feeds))


def test_two_chains_join_at_a_binary_op(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Mul", ["r", "two"], ["a"]),
        helper.make_node("Sigmoid", ["y"], ["s"]),
        helper.make_node("Neg", ["s"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["out"]),
    ]
    inputs = [value("x", [2, 4]), value("y", [1, 4])]
    source = save_model(
        tmp_path / "join.onnx", nodes, inputs, [value("out", [2, 4])], [const("two", 2.0)]
    )
    run = _enabled(source, tmp_path)
    model = _load(run)
    assert _ops(model) == [f"{DOMAIN}.Fused_Relu_Mul_Sigmoid_Neg_5ops"]
    assert list(model.graph.node[0].input) == ["x", "y"]
    assert run.counts(ELTWISE) == (1, 1)
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


def test_a_graph_output_in_the_chain_keeps_its_name(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["mid"]),
        helper.make_node("Add", ["mid", "one"], ["a"]),
        helper.make_node("Relu", ["a"], ["out"]),
    ]
    outputs = [value("mid", [2, 4]), value("out", [2, 4])]
    weights = [const("two", 2.0), const("one", 1.0)]
    source = save_model(tmp_path / "mid.onnx", nodes, [value("x", [2, 4])], outputs, weights)
    run = _enabled(source, tmp_path)
    model = _load(run)
    (node,) = model.graph.node
    assert (node.op_type, list(node.output)) == ("Fused_Mul_Add_Relu", ["mid", "out"])
    assert [o.name for o in model.graph.output] == ["mid", "out"]
    assert len(model.functions[0].output) == 2
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


def test_small_constants_are_copied_in_and_large_ones_passed(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["a"]),
        helper.make_node("Add", ["a", "bias"], ["out"]),
    ]
    weights = [const("scale", [[0.5], [2.0]]), const("bias", np.arange(17) * 0.1)]
    inputs = [value("x", [2, 17])]
    source = save_model(tmp_path / "consts.onnx", nodes, inputs, [value("out", [2, 17])], weights)
    run = _enabled(source, tmp_path)
    model = _load(run)
    (node,) = model.graph.node
    assert list(node.input) == ["x", "bias"]
    assert [i.name for i in model.graph.initializer] == ["bias"]
    assert _functions(model) == {f"{DOMAIN}.Fused_Mul_Add": ["Constant", "Mul", "Add"]}
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


def test_a_composite_with_a_non_elementwise_op_stays_whole(tmp_path: Path) -> None:
    source = _my_op_model(tmp_path / "softmax_op.onnx", softmax=True)
    run = _enabled(source, tmp_path)
    model = _load(run)
    assert _ops(model) == [f"{DOMAIN}.Fused_Mul_Pow", "custom.ops.MyOp"]
    assert set(_functions(model)) == {f"{DOMAIN}.Fused_Mul_Pow", "custom.ops.MyOp"}
    assert run.counts(ELTWISE) == (1, 1)
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


def test_enable_cluster_ops_lets_a_composite_expand(tmp_path: Path) -> None:
    source = _my_op_model(tmp_path / "softmax_op.onnx", softmax=True)
    run = _enabled(source, tmp_path, "--graph_kernel_flags", "--enable_cluster_ops=Softmax")
    model = _load(run)
    assert _ops(model) == [f"{DOMAIN}.Fused_Mul_Pow_Sub_Softmax_5ops"]
    assert set(_functions(model)) == {f"{DOMAIN}.Fused_Mul_Pow_Sub_Softmax_5ops"}
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# --graph_kernel_flags
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "flags", "ops", "counts"),
    [
        # Mul alone, Pow left out, MyOp alone: each already one op.
        (
            "seed002_custom_op_ts17",
            "--disable_cluster_ops=Pow",
            ["Mul", "Pow", "__main__.MyOp"],
            (0, 0),
        ),
        # Written inline by dynamo, MyOp's Sub and Mul still fuse behind the Pow.
        (
            "seed002_custom_op_dynamo",
            "--disable_cluster_ops=Pow",
            ["Mul", "Pow", f"{DOMAIN}.Fused_Sub_Mul"],
            (1, 1),
        ),
        # Sub may not cluster, so MyOp is no composite; Mul and Pow fuse.
        (
            "seed002_custom_op_ts17",
            "--enable_cluster_ops_only=Mul,Pow",
            [f"{DOMAIN}.Fused_Mul_Pow", "__main__.MyOp"],
            (1, 1),
        ),
        (
            "seed002_custom_op_ts17",
            "--disable_expand_ops=MyOp",
            [f"{DOMAIN}.Fused_Mul_Pow", "__main__.MyOp"],
            (1, 1),
        ),
    ],
)
def test_graph_kernel_flags_split_example_2(
    name: str, flags: str, ops: list[str], counts: tuple[int, int], tmp_path: Path
) -> None:
    run = _enabled(fixture_path(name), tmp_path, f"--graph_kernel_flags={flags}")
    model = _load(run)
    assert _ops(model) == ops
    assert run.counts(ELTWISE) == counts
    (res,) = run_model(run.output, {"x": SEED2_X, "y": SEED2_Y})
    np.testing.assert_allclose(res, np.full((4, 4), SEED2_RESULT, np.float32), rtol=1e-5)


def test_flags_compose() -> None:
    config = parse_graph_kernel_flags(
        "--enable_cluster_ops_only=Mul,Pow,Exp --enable_cluster_ops=Sub "
        "--disable_cluster_ops=Pow --disable_cluster_ops=Exp --disable_expand_ops=A,B"
    )
    assert config.ops == {"Mul", "Sub"}
    assert config.no_expand == {"A", "B"}
    assert parse_graph_kernel_flags("").ops == DEFAULT_CLUSTER_OPS
    assert parse_graph_kernel_flags("--enable_cluster_ops=MatMul").ops == {
        *DEFAULT_CLUSTER_OPS,
        "MatMul",
    }


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            "--disable_cluster_ops=pow",
            "--graph_kernel_flags: unknown op 'pow' in --disable_cluster_ops; did you mean 'Pow'?",
        ),
        (
            "--fuse_everything=1",
            "--graph_kernel_flags: unknown flag '--fuse_everything' (known: --enable_cluster_ops, "
            "--disable_cluster_ops, --enable_cluster_ops_only, --disable_expand_ops)",
        ),
        (
            "--enable_cluster_ops",
            "--graph_kernel_flags: --enable_cluster_ops takes a comma-separated list, as "
            "--enable_cluster_ops=A,B",
        ),
        (
            "--enable_cluster_ops=If",
            "--graph_kernel_flags: If in --enable_cluster_ops takes a subgraph and cannot cluster",
        ),
        (
            "--enable_cluster_ops=Relu --disable_cluster_ops=Relu",
            "--graph_kernel_flags: Relu both enabled and disabled for clustering",
        ),
    ],
)
def test_a_bad_flag_exits_2_and_writes_nothing(flags: str, message: str, tmp_path: Path) -> None:
    run = _enabled(
        fixture_path("seed002_basic_ts17"), tmp_path, f"--graph_kernel_flags={flags}", expect=2
    )
    assert run.stderr == f"fusectl: error: {message}\n"
    assert not run.output.exists()


# ---------------------------------------------------------------------------------------------
# Repeated clusters share one function; whole models stay equal on onnxruntime.
# ---------------------------------------------------------------------------------------------


def test_identical_blocks_share_one_function(tmp_path: Path) -> None:
    source = fixture_path("eltwise_blocks_ts17")
    run = _enabled(source, tmp_path)
    model = _load(run)
    fused = f"{DOMAIN}.Fused_Add_Tanh_Mul_Add"
    assert _ops(model) == ["MatMul", fused] * 4
    assert _functions(model) == {fused: ["Add", "Tanh", "Constant", "Mul", "Add"]}
    assert run.counts(ELTWISE) == (4, 4)
    # The 32-element biases are passed in, one per call.
    assert [n.input[0] for n in model.graph.node[1::2]] == [f"layers.{i}.bias" for i in range(4)]
    assert_same_outputs(source, run.output, atol=1e-6, rtol=1e-5)


def test_bert_after_the_default_passes(tmp_path: Path) -> None:
    """What the default passes leave element-wise in BERT: a NaN guard per layer (one
    function, called twice). The mask arithmetic went into the attention's mask input
    (KeyPaddingMaskFusionPass)."""
    source = fixture_path("bert_tiny_ts17")
    run = _enabled(source, tmp_path)
    model = _load(run)
    calls = Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN)
    assert calls == {"Fused_IsNaN_Where": 2}
    assert set(_functions(model)) == {f"{DOMAIN}.{name}" for name in calls}
    assert run.counts(ELTWISE) == (2, 2)
    for body in _functions(model).values():
        assert set(body) <= DEFAULT_CLUSTER_OPS | {"Constant"}
    assert_same_outputs(source, run.output)


# ---------------------------------------------------------------------------------------------
# Idempotence and bisect.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["seed002_custom_op_ts17", "eltwise_blocks_ts17"])
def test_running_twice_gives_the_same_bytes(name: str, tmp_path: Path) -> None:
    runs = []
    for label, source in (("first", fixture_path(name)), ("again", None)):
        directory = tmp_path / label
        directory.mkdir()
        runs.append(_enabled(source or runs[0].output, directory))
    first, again = runs
    assert again.output.read_bytes() == first.output.read_bytes()
    assert again.counts(ELTWISE) == (0, 0)


def test_bisect_finds_nothing(tmp_path: Path) -> None:
    result = run_cli("bisect", fixture_path("eltwise_blocks_ts17"), *ENABLE)
    assert result.exit_code == 0, result.stderr
    # The four clusters.
    assert "full run: 4 rewrite(s)" in result.stderr
    assert "nothing to find" in result.stderr


def test_a_site_bisect_leaves_out_stays_unfused(tmp_path: Path) -> None:
    source = fixture_path("eltwise_blocks_ts17")
    plan = resolve(load_builtin_passes(), SwitchRequest(enable=[ELTWISE]))

    def run(skip: frozenset[int]) -> tuple[Any, Any]:
        loaded = load_model(source)
        result = run_plan(loaded.model, plan, target="ort", rewrites=Rewrites(skip=skip))
        (ctx,) = [r.ctx for r in result.runs if r.ctx and r.ctx.spec.name == ELTWISE]
        return loaded.model, ctx

    _, ctx = run(frozenset())
    first = ctx.sites[0].index
    model, ctx = run(frozenset({first}))
    assert (ctx.matched, ctx.effected) == (4, 3)
    assert ctx.declines() == {f"bisect: rewrite #{first} skipped": 1}
    output = tmp_path / "skipped.onnx"
    write_model(model, output, external=False)
    written = onnx.load(str(output))
    onnx.checker.check_model(written, full_check=True)
    unfused = ["MatMul", "Add", "Tanh", "Mul", "Add"]
    assert _ops(written) == unfused + ["MatMul", f"{DOMAIN}.Fused_Add_Tanh_Mul_Add"] * 3
    assert len(written.functions) == 1
    assert_same_outputs(source, output, atol=1e-6, rtol=1e-5)


def test_flags_without_the_pass_warn_and_change_nothing(tmp_path: Path) -> None:
    source = fixture_path("seed002_basic_ts17")
    run = optimize(source, tmp_path, "--graph_kernel_flags=--disable_cluster_ops=Pow")
    assert "--graph_kernel_flags has no effect: TbeEltwiseFusionPass is off" in run.stderr
    assert run.counts("TbeEltwiseFusionPass") == (0, 0)
    assert run.report["warnings"] == [
        "--graph_kernel_flags has no effect: TbeEltwiseFusionPass is off"
    ]


def test_a_bad_flag_stops_the_run_before_any_pass(tmp_path: Path) -> None:
    run = _enabled(
        fixture_path("seed002_basic_ts17"),
        tmp_path,
        "--graph_kernel_flags=--bogus=1",
        "--log",
        "info",
        expect=2,
    )
    assert " took " not in run.stderr  # no pass ran
