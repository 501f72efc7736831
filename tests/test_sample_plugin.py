"""The shipped sample plugin, samples/plugins/hardswish_fusion.py, run as users run it.

Real exporter output (tests/fixtures/make_plugin_fixtures.py): a YOLOv5-style CNN with three
Conv -> BN -> Hardswish blocks. The TorchScript (opset 17) and dynamo (opset 18) exports write
YOLOv5's Hardswish as Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6); nn.Hardswish exported at opset 13
is Mul(x, HardSigmoid(x, alpha=1/6)). Near misses are built with onnx.helper.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, version_converter

from tests.conftest import assert_same_outputs, optimize, run_cli
from tests.pass_helpers import (
    assert_declined,
    check_output,
    const,
    fixture_path,
    lineage,
    optimize_checked,
    reasons,
    save_model,
    value,
)

pytestmark = pytest.mark.usefixtures("restore_registry")

PLUGIN = Path(__file__).resolve().parents[1] / "samples" / "plugins" / "hardswish_fusion.py"
# fusectl's ActivationRecognitionPass writes every hard-swish as HardSwish itself, before any
# custom pass runs: the plugin meets these sites with it off (test_the_built_in_pass_runs_first).
BUILTIN_OFF = ("--disable_pass", "ActivationRecognitionPass")
WITH_PLUGIN = ("--plugin", PLUGIN, *BUILTIN_OFF)
HS = "HardSwishFusionPass"
SITES = ("/stem/act", "/block/cv1/act", "/block/cv2/act")

# ---------------------------------------------------------------------------------------------
# The committed fixtures.
# ---------------------------------------------------------------------------------------------

# fixture -> the pass's (matched, effected), per pattern, and the output's op counts.
FIXTURES = {
    "hardswish_cnn_torchscript": (3, 3, {"Conv": 4, "HardSwish": 3, "Add": 1}),
    "hardswish_cnn_dynamo": (3, 3, {"Conv": 4, "HardSwish": 3, "Add": 1}),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_plugin_fuses_every_yolov5_hardswish(name: str, tmp_path: Path) -> None:
    matched, effected, ops = FIXTURES[name]
    model = fixture_path(name)
    original = Counter(node.op_type for node in onnx.load(str(model)).graph.node)
    assert (original["Clip"], original["Div"]) == (3, 3)  # what the exporter wrote
    run = optimize_checked(model, tmp_path, *WITH_PLUGIN)
    assert run.counts(HS) == (matched, effected)
    assert reasons(run, HS) == {}
    assert run.passed(HS)["patterns"] == {
        "yolov5_hardswish": {"matched": 3, "effected": 3},
        "x_times_hardsigmoid": {"matched": 0, "effected": 0},
    }
    assert run.op_counts() == Counter(ops)
    fused = {node: entry for node, entry in lineage(run).items() if entry[0] == [HS]}
    assert len(fused) == 3
    assert all(len(originals) == 4 for _, originals in fused.values())
    assert run.fusion_result is not None
    graph_fusion = run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"]
    assert graph_fusion[HS] == {"effect_times": "3", "match_times": "3"}
    assert HS not in run.fusion_result["session_and_graph_id_0_0"].get("ub_fusion", {})


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_built_in_pass_runs_first(name: str, tmp_path: Path) -> None:
    """With ActivationRecognitionPass on (the default), it writes the three hard-swishes as
    HardSwish before the plugin's pass runs, which then finds nothing: the same output."""
    model = fixture_path(name)
    run = optimize_checked(model, tmp_path, "--plugin", PLUGIN)
    assert run.counts("ActivationRecognitionPass") == (3, 3)
    assert run.counts(HS) == (0, 0)
    assert run.op_counts() == Counter(FIXTURES[name][2])
    (tmp_path / "plugin").mkdir()
    plugin = optimize(model, tmp_path / "plugin", *WITH_PLUGIN)
    assert_same_outputs(plugin.output, run.output, atol=0.0, rtol=0.0)


def test_opset13_nn_hardswish_is_declined_for_the_opset(tmp_path: Path) -> None:
    """nn.Hardswish at opset 13 is x * HardSigmoid(x): matched, but HardSwish needs opset 14."""
    model = fixture_path("hardswish_cnn_nn_ts13")
    run = optimize_checked(model, tmp_path, *WITH_PLUGIN)
    assert run.counts(HS) == (3, 0)
    (miss,) = run.passed(HS)["near_misses"]
    assert miss["reason"] == "HardSwish needs opset >= 14, model has 13"
    assert miss["count"] == 3
    assert miss["examples"] == [f"{site}/Mul" for site in SITES]
    assert run.op_counts()["HardSigmoid"] == 3


def test_opset13_nn_hardswish_converted_to_opset14_is_fused_exactly(tmp_path: Path) -> None:
    """The same model after onnx's version converter: the HardSigmoid spelling fuses, and
    onnxruntime runs HardSwish as its function body, HardSigmoid + Mul: the same bits."""
    converted = version_converter.convert_version(
        onnx.load(str(fixture_path("hardswish_cnn_nn_ts13"))), 14
    )
    model = tmp_path / "hardswish_cnn_nn_ts14.onnx"
    onnx.save(converted, str(model))
    run = optimize_checked(model, tmp_path, *WITH_PLUGIN)
    assert run.counts(HS) == (3, 3)
    assert run.passed(HS)["patterns"]["x_times_hardsigmoid"] == {"matched": 3, "effected": 3}
    assert run.op_counts() == Counter({"Conv": 4, "HardSwish": 3, "Add": 1})
    assert_same_outputs(model, run.output, atol=0.0, rtol=0.0)


# ---------------------------------------------------------------------------------------------
# Switching the plugin's pass off leaves exactly what a run without the plugin writes.
# ---------------------------------------------------------------------------------------------

SWITCHED_OFF = {
    "disable_pass": ("--disable_pass", HS),
    "disable_alias": ("--disable_pass", "hardswish_fusion"),
    "pattern_fusion_pass": ("--pattern_fusion_pass", "off"),
    "switch_file": ("--fusion_switch_file", "SWITCH"),
}


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
@pytest.mark.parametrize("how", sorted(SWITCHED_OFF))
def test_switched_off_is_byte_identical_to_no_plugin(
    fixture: str, how: str, tmp_path: Path
) -> None:
    model = fixture_path(fixture)
    switch = tmp_path / "switch.json"
    switch.write_text(json.dumps({"Switch": {"GraphFusion": {HS: "off"}}}))
    args = [switch if arg == "SWITCH" else arg for arg in SWITCHED_OFF[how]]
    (tmp_path / "without").mkdir()
    (tmp_path / "off").mkdir()
    without = optimize(model, tmp_path / "without", *BUILTIN_OFF)
    off = optimize(model, tmp_path / "off", *WITH_PLUGIN, *args)
    assert off.counts(HS) == (0, 0)
    assert off.passed(HS)["state"] == "off"
    assert off.output.read_bytes() == without.output.read_bytes()
    assert off.fusion_result == without.fusion_result


def test_pattern_fusion_pass_off_then_enable_pass_turns_it_back_on(tmp_path: Path) -> None:
    run = optimize(
        fixture_path("hardswish_cnn_dynamo"),
        tmp_path,
        *WITH_PLUGIN,
        "--pattern_fusion_pass",
        "off",
        "--enable_pass",
        "hardswish_fusion",
    )
    assert run.counts(HS) == (3, 3)


# ---------------------------------------------------------------------------------------------
# The catalogue, --verify and --check_custom.
# ---------------------------------------------------------------------------------------------


def test_passes_lists_the_plugin_pass_with_its_origin() -> None:
    result = run_cli("passes", "--plugin", PLUGIN, "--json")
    assert result.exit_code == 0, result.stderr
    entry = next(p for p in json.loads(result.stdout) if p["name"] == HS)
    assert entry["origin"] == f"plugin {PLUGIN}"
    assert entry["category"] == "GraphFusion"
    assert entry["aliases"] == ["hardswish_fusion", "HardSwishFusion"]
    assert (entry["numerics"], entry["min_opset"], entry["emits"]) == (
        "reassociating",
        14,
        ["HardSwish"],
    )
    text = run_cli("passes", "--plugin", PLUGIN).stdout
    (line,) = [line for line in text.splitlines() if line.strip().startswith(HS)]
    assert f"(plugin {PLUGIN})" in line


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_verify_with_the_plugin_checks_every_site(name: str, tmp_path: Path) -> None:
    run = optimize(fixture_path(name), tmp_path, *WITH_PLUGIN, "--verify")
    assert run.report is not None
    assert run.report["options"]["check_custom"] is True
    assert run.report["check_custom"] == {
        "checked": 3,
        "mismatched": 0,
        "unchecked": 0,
        "sites": [],
    }
    assert run.report["verify"]["passed"] is True
    assert run.counts(HS) == (3, 3)


def test_check_custom_catches_a_wrong_replacement_at_each_site(tmp_path: Path) -> None:
    """The README's example of a mistake: the replacement forgets the `x *`."""
    source = PLUGIN.read_text()
    right = "    return op.HardSwish(x)\n"
    assert source.count(right) == 1
    wrong = tmp_path / "wrong_hardswish.py"
    wrong.write_text(source.replace(right, "    return op.HardSigmoid(x, alpha=1 / 6)\n"))
    model = fixture_path("hardswish_cnn_torchscript")
    run = optimize(model, tmp_path, "--plugin", wrong, *BUILTIN_OFF, "--check_custom", expect=1)
    assert run.counts(HS) == (3, 0)
    assert run.report is not None
    report = run.report["check_custom"]
    assert (report["checked"], report["mismatched"], report["unchecked"]) == (3, 3, 0)
    assert [site["site"] for site in report["sites"]] == [f"{site}/Div" for site in SITES]
    assert all(site["verdict"] == "mismatch" for site in report["sites"])
    assert "compute something else" in run.stderr
    assert run.op_counts()["Clip"] == 3  # every site left as it was
    # Bit for bit what fusectl writes without the plugin (its own reassociating passes still
    # run: ChannelAffineConvFusionPass folds each hard-swish's `/ 6` into the Conv after it).
    (tmp_path / "without").mkdir()
    without = optimize(model, tmp_path / "without", *BUILTIN_OFF)
    assert_same_outputs(without.output, run.output, atol=0.0, rtol=0.0)
    assert_same_outputs(model, run.output)


# ---------------------------------------------------------------------------------------------
# One hard-swish built with onnx.helper: x [1, 8, 4, 4] -> Add(3) -> Clip(0, 6) -> Mul(x) -> Div(6).
# ---------------------------------------------------------------------------------------------

SHAPE = [1, 8, 4, 4]


def _clip_spelling(
    path: Path,
    *,
    three: float | list[float] = 3.0,
    low: float = 0.0,
    high: float = 6.0,
    six: float = 6.0,
    commuted: bool = False,
    clip_is_output: bool = False,
    clip_used_elsewhere: bool = False,
    opset: int = 17,
    elem: int = TensorProto.FLOAT,
) -> Path:
    dtype = helper.tensor_dtype_to_np_dtype(elem).type
    nodes = [
        helper.make_node("Add", ["three", "x"] if commuted else ["x", "three"], ["a"], name="add"),
        helper.make_node("Clip", ["a", "low", "high"], ["c"], name="clip"),
        helper.make_node("Mul", ["c", "x"] if commuted else ["x", "c"], ["m"], name="mul"),
        helper.make_node("Div", ["m", "six"], ["y"], name="div"),
    ]
    outputs = [value("y", SHAPE, elem)]
    if clip_is_output:
        outputs.append(value("c", SHAPE, elem))
    if clip_used_elsewhere:
        nodes.append(helper.make_node("Neg", ["c"], ["other"], name="other"))
        outputs.append(value("other", SHAPE, elem))
    initializers = [
        const("three", three, dtype),
        const("low", low, dtype),
        const("high", high, dtype),
        const("six", six, dtype),
    ]
    return save_model(path, nodes, [value("x", SHAPE, elem)], outputs, initializers, opset=opset)


def _hardsigmoid_spelling(path: Path, **attributes: float) -> Path:
    nodes = [
        helper.make_node("HardSigmoid", ["x"], ["s"], name="hardsigmoid", **attributes),
        helper.make_node("Mul", ["x", "s"], ["y"], name="mul"),
    ]
    return save_model(path, nodes, [value("x", SHAPE)], [value("y", SHAPE)])


FIRES = {
    "as_exported": {},
    "commuted": {"commuted": True},
    "float16": {"elem": TensorProto.FLOAT16},
    "opset14": {"opset": 14},
}


@pytest.mark.parametrize("case", sorted(FIRES))
def test_clip_spelling_fires(case: str, tmp_path: Path) -> None:
    model = _clip_spelling(tmp_path / f"hs_{case}.onnx", **FIRES[case])
    atol = 1e-2 if case == "float16" else 1e-4
    run = optimize_checked(model, tmp_path, *WITH_PLUGIN, atol=atol)
    assert run.counts(HS) == (1, 1)
    assert run.op_counts() == Counter({"HardSwish": 1})


def test_hardsigmoid_spelling_fires(tmp_path: Path) -> None:
    model = _hardsigmoid_spelling(tmp_path / "hsig.onnx", alpha=float(np.float32(1 / 6)))
    run = optimize_checked(model, tmp_path, *WITH_PLUGIN)
    assert run.counts(HS) == (1, 1)
    assert run.op_counts() == Counter({"HardSwish": 1})


DECLINED = {
    "add_2": ({"three": 2.0}, "the constant added to x is 2, not 3"),
    "clip_max_5": ({"high": 5.0}, "the Clip's max is 5, not 6"),
    "clip_min_minus_1": ({"low": -1.0}, "the Clip's min is -1, not 0"),
    "div_5": ({"six": 5.0}, "the divisor is 5, not 6"),
    "add_shape_1": ({"three": [3.0]}, "the constant added to x has shape [1], not a scalar"),
    "opset13": ({"opset": 13}, "HardSwish needs opset >= 14, model has 13"),
    "double": (
        {"elem": TensorProto.DOUBLE},
        "onnxruntime runs HardSwish in float16 and float only, not DOUBLE",
    ),
    "int32": (
        {"elem": TensorProto.INT32},
        "onnxruntime runs HardSwish in float16 and float only, not INT32",
    ),
    "clip_is_output": (
        {"clip_is_output": True},
        "an intermediate value (Clip output) is a graph output",
    ),
    "clip_used_elsewhere": (
        {"clip_used_elsewhere": True},
        "an intermediate value (Clip output) is also used by Neg outside the match",
    ),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_clip_spelling_near_misses_are_declined_with_the_reason(case: str, tmp_path: Path) -> None:
    kwargs, reason = DECLINED[case]
    model = _clip_spelling(tmp_path / f"hs_{case}.onnx", **kwargs)
    run = optimize(model, tmp_path, *WITH_PLUGIN)
    check_output(run)
    assert_declined(run, HS, reason, "div")
    assert run.op_counts()["Clip"] == 1


@pytest.mark.parametrize(
    ("attributes", "reason"),
    [
        ({}, "HardSigmoid has alpha 0.2, beta 0.5; HardSwish needs 1/6, 0.5"),
        (
            {"alpha": float(np.float32(1 / 6)), "beta": 0.4},
            "HardSigmoid has alpha 0.166667, beta 0.4; HardSwish needs 1/6, 0.5",
        ),
    ],
)
def test_hardsigmoid_spelling_with_other_attributes_is_declined(
    attributes: dict[str, float], reason: str, tmp_path: Path
) -> None:
    model = _hardsigmoid_spelling(tmp_path / "hsig.onnx", **attributes)
    run = optimize(model, tmp_path, *WITH_PLUGIN)
    assert_declined(run, HS, reason, "mul")
    assert run.op_counts() == Counter({"HardSigmoid": 1, "Mul": 1})
