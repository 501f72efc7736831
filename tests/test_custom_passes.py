"""Custom passes: register_replacement, --plugin and entry points, the custom-pass switch,
--check_custom, and bisect on a plugin's pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusectl import Site, register_replacement
from fusectl.core.plugins import load_builtin_passes
from fusectl.rewrite.registry import REGISTRY, Category, Numerics
from tests.conftest import FIXTURES, assert_same_outputs, optimize, run_cli
from tests.pass_helpers import optimize_checked, pattern_counts, reasons, save_model, value

pytestmark = pytest.mark.usefixtures("restore_registry")

# One HardSwish spelled out per block, as YOLOv5 writes it: x * clip(x + a, 0, 6) / 6.
BLOCK_SHIFTS = (3.0, 3.0, 2.0, 3.0)


def _blocks(path: Path, shifts: tuple[float, ...] = BLOCK_SHIFTS, opset: int = 17) -> Path:
    """x -> MatMul -> spelled-out hardswish, per block; block i adds shifts[i]."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    h = "x"
    for i, shift in enumerate(shifts):
        p = f"block{i}"
        inits += [
            numpy_helper.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(np.array(shift, np.float32), f"shift{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [h, f"w{i}"], [f"{p}/mm"], name=f"{p}/MatMul"),
            helper.make_node("Add", [f"{p}/mm", f"shift{i}"], [f"{p}/a"], name=f"{p}/Add"),
            helper.make_node("Clip", [f"{p}/a", "zero", "six"], [f"{p}/c"], name=f"{p}/Clip"),
            helper.make_node("Mul", [f"{p}/mm", f"{p}/c"], [f"{p}/m"], name=f"{p}/Mul"),
            helper.make_node("Div", [f"{p}/m", "six"], [f"{p}/y"], name=f"{p}/Div"),
        ]
        h = f"{p}/y"
    inits += [
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(6.0, np.float32), "six"),
    ]
    graph = helper.make_graph(
        nodes,
        "blocks",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info(h, onnx.TensorProto.FLOAT, ["batch", 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.save(model, path)
    return path


# The plugin a user writes; {check} decides whether it looks at the constants.
PLUGIN = """
from fusectl import register_replacement


def spelled_hardswish(op, x, shift, low, high, divisor):
    return op.Div(op.Mul(x, op.Clip(op.Add(x, shift), low, high)), divisor)


def constants_are_hardswish(site, shift, low, high, divisor):
    values = [site.constant(v) for v in (shift, low, high, divisor)]
    if any(v is None or v.size != 1 for v in values):
        return "the constants are not scalars"
    return [float(v) for v in values] == [3.0, 0.0, 6.0, 6.0] or "not 3, 0, 6, 6"


def hardswish(op, x):
    return op.{op}(x)


register_replacement(
    "{name}",
    spelled_hardswish,
    hardswish,
    extra_check={check},
    category="GraphFusion",
    numerics="reassociating",
    min_opset=14,
    priority=4200,  # before ActivationRecognitionPass (4300), which writes hard-swish itself
)
"""


def _plugin(
    tmp_path: Path, name: str = "HardSwishPlugin", op: str = "HardSwish", check: bool = True
) -> Path:
    path = tmp_path / f"{name.lower()}.py"
    path.write_text(
        PLUGIN.format(name=name, op=op, check="constants_are_hardswish" if check else "None")
    )
    return path


def _sub(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    return folder


def _hardswish_model(tmp_path: Path, **kwargs: Any) -> Path:
    return _blocks(tmp_path / "blocks.onnx", **kwargs)


def test_plugin_pass_fires_counts_reports_and_matches(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    run = optimize(model, tmp_path, "--plugin", _plugin(tmp_path))
    assert run.counts("HardSwishPlugin") == (4, 3)
    entry = run.passed("HardSwishPlugin")
    assert entry["near_misses"] == [
        {"reason": "not 3, 0, 6, 6", "count": 1, "examples": ["block2/Div"]}
    ]
    # The declined block2 (x + 2: a hard-sigmoid gate of other constants) is left to the
    # built-in ActivationRecognitionPass, which runs after: x * HardSigmoid(x).
    ops = run.op_counts()
    assert (ops["HardSwish"], ops["HardSigmoid"], ops["Clip"]) == (3, 1, 0)
    graph_fusion = next(iter(run.fusion_result.values()))["graph_fusion"]
    assert graph_fusion["HardSwishPlugin"] == {"effect_times": "3", "match_times": "4"}
    assert_same_outputs(model, run.output)


def test_custom_passes_switch_like_built_in_ones(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    plugin = _plugin(tmp_path)
    plain = optimize(model, _sub(tmp_path, "plain"))
    switch = tmp_path / "switch.cfg"
    switch.write_text(json.dumps({"Switch": {"GraphFusion": {"HardSwishPlugin": "off"}}}))
    for args in (
        ("--pattern_fusion_pass", "off"),
        ("--disable_pass", "HardSwishPlugin"),
        ("--fusion_switch_file", switch),
    ):
        run = optimize(model, _sub(tmp_path, args[0].strip("-")), "--plugin", plugin, *args)
        assert run.counts("HardSwishPlugin") == (0, 0)
        assert run.output.read_bytes() == plain.output.read_bytes(), args
    state = optimize(
        model, _sub(tmp_path, "off"), "--plugin", plugin, "--pattern_fusion_pass", "off"
    )
    entry = state.passed("HardSwishPlugin")
    assert (entry["state"], entry["reason"]) == ("off", "pattern_fusion_pass")
    # Naming the pass beats the global switch, as naming a built-in pass beats ALL.
    run = optimize(
        model,
        _sub(tmp_path, "named"),
        "--plugin",
        plugin,
        "--pattern_fusion_pass",
        "off",
        "--enable_pass",
        "HardSwishPlugin",
    )
    assert run.counts("HardSwishPlugin") == (4, 3)


def test_pattern_fusion_pass_off_leaves_built_in_passes_on(tmp_path: Path) -> None:
    model = FIXTURES / "mlp_torchscript.onnx"
    plain = optimize(model, _sub(tmp_path, "plain"))
    run = optimize(
        model, _sub(tmp_path, "off"), "--plugin", _plugin(tmp_path), "--pattern_fusion_pass", "off"
    )
    assert run.counts("MatMulBiasAddFusionPass") == plain.counts("MatMulBiasAddFusionPass")
    assert run.counts("MatMulBiasAddFusionPass")[1] > 0
    assert run.output.read_bytes() == plain.output.read_bytes()


def test_dump_graph_and_log_lines_name_the_custom_pass(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    dump = _sub(tmp_path, "dump")
    run = optimize(
        model, tmp_path, "--plugin", _plugin(tmp_path), "--dump_graph", dump, "--log", "info"
    )
    assert any("HardSwishPlugin" in path.name for path in dump.iterdir())
    assert "GraphFusionPass[HardSwishPlugin]: pattern=HardSwishPlugin" in run.stderr


def test_passes_lists_custom_passes_with_their_origin(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path)
    result = run_cli("passes", "--plugin", plugin, "--json")
    assert result.exit_code == 0, result.stderr
    entries = {entry["name"]: entry for entry in json.loads(result.stdout)}
    assert entries["HardSwishPlugin"]["origin"] == f"plugin {plugin}"
    assert entries["HardSwishPlugin"]["category"] == "GraphFusion"
    assert entries["MatMulBiasAddFusionPass"]["origin"] == "built-in"
    text = run_cli("passes", "--plugin", plugin).stdout
    line = next(line for line in text.splitlines() if "HardSwishPlugin" in line)
    assert f"(plugin {plugin})" in line
    template = json.loads(run_cli("switch-template", "--plugin", plugin).stdout)
    assert template["Switch"]["GraphFusion"]["HardSwishPlugin"] == "on"


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("import no_such_module\n", "ModuleNotFoundError: No module named 'no_such_module'"),
        ("def broken(:\n", "SyntaxError"),
        ("x = 1\nraise RuntimeError('boom')\n", "RuntimeError: boom (line 2)"),
        (
            "from fusectl import register_replacement\n"
            "register_replacement('MatMulBiasAddFusionPass', lambda op, x: op.Relu(x), "
            "lambda op, x: op.Relu(x))\n",
            "ValueError: a pass named 'MatMulBiasAddFusionPass' is already registered (built-in)",
        ),
    ],
)
def test_a_plugin_that_fails_to_load_exits_2_naming_it(
    tmp_path: Path, source: str, reason: str
) -> None:
    plugin = tmp_path / "bad_plugin.py"
    plugin.write_text(source)
    output = tmp_path / "out.onnx"
    result = run_cli(
        "optimize", FIXTURES / "mlp_torchscript.onnx", "-o", output, "--plugin", plugin
    )
    assert result.exit_code == 2
    message = result.stderr.strip()
    assert message.count("\n") == 0, message
    assert message.startswith(f"fusectl: error: plugin {plugin} failed to load: "), message
    assert reason in message
    assert not output.exists()
    assert REGISTRY.canonical("MatMulBiasAddFusionPass") == "MatMulBiasAddFusionPass"


def test_a_missing_plugin_file_exits_2(tmp_path: Path) -> None:
    result = run_cli("passes", "--plugin", tmp_path / "nowhere.py")
    assert result.exit_code == 2
    assert f"{tmp_path / 'nowhere.py'}: plugin does not exist" in result.stderr


def test_loading_a_plugin_twice_registers_it_once(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path)
    model = _hardswish_model(tmp_path)
    run = optimize(model, tmp_path, "--plugin", plugin, "--plugin", plugin)
    assert run.counts("HardSwishPlugin") == (4, 3)


def test_check_custom_catches_a_wrong_replacement_at_its_sites(tmp_path: Path) -> None:
    """A plugin without its constant check rewrites block2 (x + 2) too: only that site is
    wrong, and only that site is reported and left unfused."""
    model = _hardswish_model(tmp_path)
    plugin = _plugin(tmp_path, "UncheckedHardSwish", check=False)
    run = optimize(model, tmp_path, "--plugin", plugin, "--check_custom", expect=1)
    assert run.counts("UncheckedHardSwish") == (4, 3)
    report = run.report["check_custom"]
    assert (report["checked"], report["mismatched"], report["unchecked"]) == (4, 1, 0)
    (site,) = report["sites"]
    assert site["site"] == "block2/Div"
    assert site["nodes"] == ["block2/Add", "block2/Clip", "block2/Mul", "block2/Div"]
    assert site["verdict"] == "mismatch" and site["max_abs"] > 0.1
    assert "check_custom: UncheckedHardSwish at block2/Div (nodes block2/Add, " in run.stderr
    assert "1 site(s) of UncheckedHardSwish compute something else" in run.stderr
    # The output is written, without the wrong site, and computes what the original does.
    assert run.op_counts()["HardSwish"] == 3
    assert_same_outputs(model, run.output)


def test_check_custom_is_on_with_plugin_and_verify(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    wrong = _plugin(tmp_path, "HardSigmoidForHardSwish", op="HardSigmoid")
    run = optimize(model, tmp_path, "--plugin", wrong, "--verify", expect=1)
    assert run.report["check_custom"]["mismatched"] == 3
    assert run.counts("HardSigmoidForHardSwish") == (4, 0)
    assert [s["site"] for s in run.report["check_custom"]["sites"]] == [
        "block0/Div",
        "block1/Div",
        "block3/Div",
    ]
    assert run.report["verify"]["passed"] is True  # nothing wrong was left in the output
    misses = {m["reason"]: m["count"] for m in run.passed("HardSigmoidForHardSwish")["near_misses"]}
    assert misses == {
        "check_custom: the replacement differs from the matched nodes beyond reassociating "
        "tolerance (atol 0.0001, rtol 0.001)": 3,
        "not 3, 0, 6, 6": 1,
    }


def test_check_custom_passes_a_right_replacement(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    right = optimize(model, tmp_path, "--plugin", _plugin(tmp_path), "--verify")
    assert right.report["check_custom"] == {
        "checked": 3,
        "mismatched": 0,
        "unchecked": 0,
        "sites": [],
    }


def test_no_check_custom_lets_a_wrong_replacement_through_to_verify(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    wrong = _plugin(tmp_path, "HardSigmoidForHardSwish", op="HardSigmoid")
    unchecked = optimize(
        model, tmp_path, "--plugin", wrong, "--verify", "--no_check_custom", expect=1
    )
    assert "check_custom" not in unchecked.report
    assert unchecked.report["verify"]["passed"] is False


def test_check_custom_leaves_built_in_passes_alone(tmp_path: Path) -> None:
    run = optimize(FIXTURES / "bert_tiny_ts17.onnx", tmp_path, "--check_custom")
    assert run.report["check_custom"]["checked"] == 0


def test_bisect_finds_the_plugin_pass(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    wrong = _plugin(tmp_path, "HardSigmoidForHardSwish", op="HardSigmoid")
    switch = tmp_path / "switch.cfg"
    result = run_cli("bisect", model, "--plugin", wrong, "--output_switch", switch, "--json")
    assert result.exit_code == 1, result.stderr
    found = json.loads(result.stdout)
    assert found["culprit_passes"] == ["HardSigmoidForHardSwish"]
    assert json.loads(switch.read_text()) == {
        "Switch": {"GraphFusion": {"HardSigmoidForHardSwish": "off"}}
    }


def _double_relu(op: Any, x: Any) -> Any:
    return op.Relu(op.Relu(x))


def test_register_replacement_refuses_a_taken_name_unless_replace() -> None:
    load_builtin_passes()
    first = register_replacement("DoubleReluPass", _double_relu, lambda op, x: op.Relu(x))
    assert first.spec.origin == f"python {__name__}"
    assert first.spec.custom and first.spec.category is Category.UB
    with pytest.raises(ValueError, match="'DoubleReluPass' is already registered"):
        register_replacement("DoubleReluPass", _double_relu, lambda op, x: op.Relu(x))
    second = register_replacement(
        "DoubleReluPass", _double_relu, lambda op, x: op.Relu(x), replace=True
    )
    assert REGISTRY["DoubleReluPass"] is second
    with pytest.raises(ValueError, match="name 'softmax_fusion' of pass Other is already used"):
        register_replacement(
            "Other", _double_relu, lambda op, x: op.Relu(x), aliases=("softmax_fusion",)
        )
    with pytest.raises(ValueError, match="category 'CubeFusion' is not one of"):
        register_replacement("Other", _double_relu, lambda op, x: op.Relu(x), category="CubeFusion")
    with pytest.raises(TypeError, match="replacement must be a function"):
        register_replacement("Other", _double_relu, "Relu")  # type: ignore[arg-type]
    assert REGISTRY.canonical("Other") is None


def test_built_in_passes_use_the_same_api() -> None:
    load_builtin_passes()
    spec = REGISTRY["MatMulBiasAddFusionPass"].spec
    assert spec.origin == "built-in" and not spec.custom
    assert spec.numerics is Numerics.REASSOCIATING


def _swish_model(path: Path, *, swap: bool) -> Path:
    """Two x * sigmoid(x) blocks; ``swap`` writes the second one as sigmoid(x) * x."""
    nodes = []
    h = "x"
    for i in range(2):
        operands = [f"s{i}", h] if swap and i == 1 else [h, f"s{i}"]
        nodes += [
            helper.make_node("Sigmoid", [h], [f"s{i}"], name=f"b{i}/Sigmoid"),
            helper.make_node("Mul", operands, [f"y{i}"], name=f"b{i}/Mul"),
        ]
        h = f"y{i}"
    graph = helper.make_graph(
        nodes,
        "swish",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(h, onnx.TensorProto.FLOAT, [2, 4])],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path
    )
    return path


def test_commutative_inputs_match_in_either_order_and_checks_see_the_match(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, tuple[int, ...] | None]] = []

    def rank_two(site: Site, x: Any) -> np.bool_:
        shape = site.shape(x)
        seen.append((site.root.name, None if shape is None else tuple(shape)))
        # A numpy bool, as comparisons of constants give: it counts as the bool it is.
        return np.bool_(site.dtype(x) is not None and shape is not None and len(shape) == 2)

    def swish(op: Any, x: Any, site: Site) -> Any:
        assert site.root.op_type == "Mul"
        return op.Div(x, op.Add(op.Exp(op.Neg(x)), op.Constant(value_float=1.0)))

    register_replacement(
        "SwishRoundTrip",
        lambda op, x: op.Mul(x, op.Sigmoid(x)),
        swish,
        extra_check=rank_two,
        numerics="reassociating",
        description="test: x*sigmoid(x) rebuilt",
    )
    model = _swish_model(tmp_path / "swish.onnx", swap=True)
    run = optimize(model, tmp_path, "--enable_pass", "SwishRoundTrip")
    assert run.counts("SwishRoundTrip") == (2, 2)
    assert seen == [("b0/Mul", (2, 4)), ("b1/Mul", (2, 4))]
    assert_same_outputs(model, run.output)


ENTRY_POINT_PLUGIN = """
from fusectl import register_replacement

def register():
    register_replacement(
        "EntryPointRelu", lambda op, x: op.Relu(op.Relu(x)), lambda op, x: op.Relu(x)
    )
"""


def _installed_plugin(tmp_path: Path, target: str) -> dict[str, str]:
    """A package installed the way pip leaves one: a module and a dist-info folder whose
    entry_points.txt declares it in the fusectl.passes group."""
    site = _sub(tmp_path, "site")
    (site / "fake_fusectl_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "fake_fusectl_plugin.py").write_text(ENTRY_POINT_PLUGIN)
    info = site / "fake_fusectl_plugin-1.0.dist-info"
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fake-fusectl-plugin\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(f"[fusectl.passes]\nrelu = {target}\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env.pop("FUSECTL_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def _fusectl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fusectl", *args], env=env, capture_output=True, text=True
    )


def test_entry_point_plugins_load_and_show_their_origin(tmp_path: Path) -> None:
    env = _installed_plugin(tmp_path, "fake_fusectl_plugin:register")
    result = _fusectl(env, "passes", "--json")
    assert result.returncode == 0, result.stderr
    entries = {entry["name"]: entry for entry in json.loads(result.stdout)}
    assert entries["EntryPointRelu"]["origin"] == ("entry point relu (fake-fusectl-plugin 1.0)")
    env["FUSECTL_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    skipped = _fusectl(env, "passes", "--json")
    assert "EntryPointRelu" not in {e["name"] for e in json.loads(skipped.stdout)}


def test_a_broken_entry_point_exits_2_naming_it(tmp_path: Path) -> None:
    env = _installed_plugin(tmp_path, "fake_fusectl_plugin:no_such_function")
    result = _fusectl(env, "passes")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "fusectl: error: plugin entry point relu (fake-fusectl-plugin 1.0) failed to load: "
        "AttributeError: module 'fake_fusectl_plugin' has no attribute 'no_such_function'"
    )


def test_a_replacement_its_own_search_matches_stops_with_an_error(tmp_path: Path) -> None:
    register_replacement(
        "SelfMatching",
        lambda op, x: op.Mul(x, op.Sigmoid(x)),
        lambda op, x: op.Mul(op.Sigmoid(x), x),
    )
    model = _swish_model(tmp_path / "swish.onnx", swap=False)
    output = tmp_path / "out.onnx"
    result = run_cli("optimize", model, "-o", output, "--fusion_result", tmp_path / "f.json")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "fusectl: error: SelfMatching stopped after 11 rewrites of a 4-node graph: "
        "pattern SelfMatching matches its own replacement again"
    )
    assert not output.exists() and not (tmp_path / "f.json").exists()


def test_verify_per_pass_attributes_error_to_the_plugin_pass(tmp_path: Path) -> None:
    model = _hardswish_model(tmp_path)
    wrong = _plugin(tmp_path, "HardSigmoidForHardSwish", op="HardSigmoid")
    run = optimize(model, tmp_path, "--plugin", wrong, "--no_check_custom")
    result = run_cli("verify", model, run.output, "--per_pass", "--plugin", wrong, "--json")
    assert result.exit_code == 1, result.stderr
    rows = {row["pass"]: row for row in json.loads(result.stdout)["per_pass"]}
    assert rows["HardSigmoidForHardSwish"]["rewrites"] == 3
    assert rows["HardSigmoidForHardSwish"]["passed"] is False


CARELESS_PLUGIN = """
import onnx_ir as ir
from fusectl import Category, FusionPass, PassSpec, register_pass
from fusectl.rewrite.graph import replace_subgraph


@register_pass
class DoubleNegationPass(FusionPass):
    spec = PassSpec(name="DoubleNegationPass", category=Category.GRAPH,
                    description="Neg(Neg(x)) -> x", priority=4200)

    def run(self, model, ctx):
        for outer in list(model.graph):
            inner = outer.inputs[0].producer() if outer.op_type == "Neg" else None
            if inner is None or inner.op_type != "Neg" or outer.graph is None:
                continue
            same = ir.node("Identity", [inner.inputs[0]])
            replace_subgraph(ctx, "DoubleNegation", outer, [inner, outer], [same],
                             outer.outputs, same.outputs)
"""


def test_a_plugin_that_forgets_a_value_read_elsewhere_is_declined_not_broken(
    tmp_path: Path,
) -> None:
    """A plugin pass removes Neg(Neg(x)) without asking whether the inner Neg's output is read
    elsewhere: where it is a graph output the toolkit declines the site with the reason
    (removing it was an internal error), and the other site is rewritten."""
    plugin = tmp_path / "careless.py"
    plugin.write_text(CARELESS_PLUGIN)
    nodes = [
        helper.make_node("Neg", ["x"], ["a"]),
        helper.make_node("Neg", ["a"], ["y"]),
        helper.make_node("Neg", ["x"], ["b"]),
        helper.make_node("Neg", ["b"], ["z"]),
    ]
    outputs = [value("y", [2, 3]), value("z", [2, 3]), value("a", [2, 3])]
    model = save_model(tmp_path / "negations.onnx", nodes, [value("x", [2, 3])], outputs)
    run = optimize_checked(model, tmp_path, "--plugin", plugin)
    assert pattern_counts(run, "DoubleNegationPass") == {"DoubleNegation": (2, 1)}
    assert reasons(run, "DoubleNegationPass") == {
        "an intermediate value (Neg output) is a graph output": 1
    }
    assert run.op_counts() == {"Neg": 2, "Identity": 1}  # z = x: an input and an output
