"""Layer coverage in --report / --json and the console summary: a pass that fuses in some
but not all of the model's layers says how many and which layers it missed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from fusectl.core import reports
from fusectl.rewrite.context import LINEAGE_NAMES, LINEAGE_PASSES, LINEAGE_TYPES, _json_strings
from tests.conftest import Run, optimize
from tests.pass_helpers import const, fixture_path, optimize_checked, save_model, value

GELU = "BiasGeluFusionPass"  # erf GELU -> com.microsoft Gelu below opset 20
SHAPE = [2, 3, 8]


def _gelu_layers(
    path: Path,
    halves: list[float],
    prefix: str = "/layers.{}/mlp/",
    namespace: str | None = None,
) -> Path:
    """One erf GELU per layer, 0.5 * x * (1 + erf(x / sqrt2)), each layer's nodes named
    ``prefix`` (formatted with the layer index) + op; ``halves`` gives each layer's 0.5;
    ``namespace`` (formatted likewise) is dynamo's namespace metadata for the nodes."""
    nodes = []
    initializers = [const("root2", np.array(math.sqrt(2))), const("one", np.array(1.0))]
    x = "x"
    for layer, half in enumerate(halves):
        scope = prefix.format(layer)
        initializers.append(const(f"half{layer}", np.array(half)))
        steps = [
            ("Div", "Div", [x, "root2"]),
            ("Erf", "Erf", ["Div"]),
            ("Add", "Add", ["Erf", "one"]),
            ("Mul", "Mul", [x, "Add"]),
            ("Mul", "Mul_1", ["Mul", f"half{layer}"]),
        ]
        local = {}
        for op, name, inputs in steps:
            local[name] = f"{scope}{name}_output_0"
            reads = [local.get(i, i) for i in inputs]
            node = helper.make_node(op, reads, [local[name]], name=scope + name)
            if namespace is not None:
                helper.set_metadata_props(node, {"namespace": namespace.format(layer)})
            nodes.append(node)
        x = local["Mul_1"]
    nodes.append(helper.make_node("Identity", [x], ["y"], name="/final/Identity"))
    return save_model(path, nodes, [value("x", SHAPE)], [value("y", SHAPE)], initializers)


def _layer_1_declined(run: Run, site: str = "/layers.1/mlp/Mul_1") -> None:
    """Layer 0's GELU fused, layer 1's declined for its 0.6."""
    assert run.counts(GELU) == (2, 1)
    (miss,) = run.passed(GELU)["near_misses"]
    assert miss["reason"] == "the halving constant is 0.6, the GELU formula needs 0.5"
    assert miss["examples"] == [site]


def _coverage_lines(run: Run) -> list[str]:
    return [line for line in run.stderr.splitlines() if "layers; none in" in line]


def test_a_layer_without_the_fusion_is_named(tmp_path: Path) -> None:
    """Layer 0's GELU fuses, layer 1's has 0.6 for 0.5 (declined): 1 of 2 layers, layers.1
    missing, in the report and on stderr; passes that fused nowhere say nothing."""
    model = _gelu_layers(tmp_path / "partial.onnx", [0.5, 0.6])
    run = optimize_checked(model, tmp_path)
    _layer_1_declined(run)
    assert run.op_counts()["Gelu"] == 1 and run.op_counts()["Erf"] == 1
    coverage = {p["name"]: p.get("layers") for p in run.report["passes"]}
    assert coverage[GELU] == {"fused": 1, "total": 2, "missing": ["layers.1"]}
    assert {name for name, layers in coverage.items() if layers is not None} == {GELU}
    assert _coverage_lines(run) == [f"{GELU} fused in 1 of 2 layers; none in layers.1"]


def test_layers_missing_are_listed_in_order(tmp_path: Path) -> None:
    """Eleven layers, GELU only in layer 0: the missing ones in numeric order (layers.2 before
    layers.10), on the --json document too."""
    model = _gelu_layers(tmp_path / "eleven.onnx", [0.5] + [0.6] * 10)
    run = optimize(model, tmp_path, "--json")
    missing = [f"layers.{i}" for i in range(1, 11)]
    document = json.loads(run.stdout)
    entry = next(p for p in document["passes"] if p["name"] == GELU)
    assert entry["layers"] == {"fused": 1, "total": 11, "missing": missing}
    assert run.passed(GELU)["layers"] == entry["layers"]
    assert _coverage_lines(run) == [f"{GELU} fused in 1 of 11 layers; none in {', '.join(missing)}"]


@pytest.mark.parametrize(
    "prefix",
    ["/layers.{}/mlp/", "/encoder/layer.{}/ffn/", "/inner/h.{}/mlp/", "/blocks.{}/mlp/"],
    ids=["layers", "layer", "h", "blocks"],
)
def test_every_layer_fused_reports_no_coverage(prefix: str, tmp_path: Path) -> None:
    model = _gelu_layers(tmp_path / "full.onnx", [0.5, 0.5], prefix)
    run = optimize_checked(model, tmp_path)
    assert run.counts(GELU) == (2, 2)
    assert all(p.get("layers") is None for p in run.report["passes"])
    assert _coverage_lines(run) == []
    assert "fused in" not in run.stderr


@pytest.mark.parametrize("prefix", ["/encoder/layer.{}/ffn/", "/inner/h.{}/mlp/"])
def test_coverage_uses_the_layer_names_exporters_write(prefix: str, tmp_path: Path) -> None:
    model = _gelu_layers(tmp_path / "named.onnx", [0.6, 0.5], prefix)
    run = optimize_checked(model, tmp_path)
    missing = prefix.strip("/").split("/")[-2].format(0)
    assert run.passed(GELU)["layers"] == {"fused": 1, "total": 2, "missing": [missing]}
    assert _coverage_lines(run) == [f"{GELU} fused in 1 of 2 layers; none in {missing}"]


def test_coverage_from_dynamo_namespace_metadata(tmp_path: Path) -> None:
    """dynamo names nodes node_<op>_<n>: the layer is in their namespace metadata."""
    namespace = "layers.{}: LlamaDecoderLayer/mlp: LlamaMLP"
    model = _gelu_layers(tmp_path / "dynamo.onnx", [0.5, 0.6], "node_{}_", namespace)
    run = optimize_checked(model, tmp_path)
    _layer_1_declined(run, "node_1_Mul_1")
    assert run.passed(GELU)["layers"] == {"fused": 1, "total": 2, "missing": ["layers.1"]}
    assert _coverage_lines(run) == [f"{GELU} fused in 1 of 2 layers; none in layers.1"]


def test_a_model_without_layers_reports_no_coverage(tmp_path: Path) -> None:
    model = _gelu_layers(tmp_path / "flat.onnx", [0.5, 0.6], "/mlp{}/")
    run = optimize_checked(model, tmp_path)
    _layer_1_declined(run, "/mlp1/Mul_1")
    assert run.passed(GELU)["layers"] is None
    assert _coverage_lines(run) == []


def test_log_null_prints_no_coverage(tmp_path: Path) -> None:
    model = _gelu_layers(tmp_path / "quiet.onnx", [0.5, 0.6])
    run = optimize(model, tmp_path, "--log", "null")
    assert run.passed(GELU)["layers"] == {"fused": 1, "total": 2, "missing": ["layers.1"]}
    assert run.stderr == ""
    assert onnx.load(str(run.output)).graph.node  # the model is written all the same


def test_report_file_is_what_json_writes(tmp_path: Path) -> None:
    """The report is written by fusectl's own indenting writer (json's is several times
    slower at 100k nodes); its text must be json.dumps(document, indent=2) to the byte,
    for a real report and for the values json treats specially."""
    model = _gelu_layers(tmp_path / "gelu.onnx", [0.5, 0.5, 0.25])
    run = optimize(model, tmp_path)
    report = tmp_path / f"{model.stem}_report.json"
    assert run.exit_code == 0 and run.report is not None and run.report["passes"]
    assert report.read_text() == json.dumps(run.report, indent=2) + "\n"
    special = {
        "empty": [{}, [], ()],
        "nested": [[[]], {"a": {"b": ("c", 1)}}],
        "text": ["é", '"quoted"\n', "\u2028"],
        "numbers": [0, -1, 2**70, 1.5, -0.0, 1e100, float("nan"), float("inf"), -float("inf")],
        "constants": [None, True, False],
        3: "int key",
        2.5: "float key",
        None: "None key",
        True: "bool key",
    }
    written = tmp_path / "special.json"
    reports.write_report(written, special)
    assert written.read_text() == json.dumps(special, indent=2) + "\n"
    with pytest.raises(TypeError):
        reports.write_report(tmp_path / "bad.json", {"x": object()})
    with pytest.raises(TypeError):
        reports.write_report(tmp_path / "bad.json", {(1, 2): 0})


def test_lineage_is_what_json_writes(tmp_path: Path) -> None:
    """Lineage metadata is written by joining json's string encoder (three json.dumps per
    rewrite showed at 100k nodes); it must read as json.dumps writes it."""
    model = _gelu_layers(tmp_path / "gelu.onnx", [0.5, 0.5])
    run = optimize(model, tmp_path)
    fused = [node for node in onnx.load(str(run.output)).graph.node if node.metadata_props]
    assert run.exit_code == 0 and fused
    for node in fused:
        for prop in node.metadata_props:
            if prop.key in (LINEAGE_NAMES, LINEAGE_TYPES, LINEAGE_PASSES):
                assert prop.value == json.dumps(json.loads(prop.value))
    for texts in ([], ["a"], ["é", '"quoted"\n', "\u2028", "\x00", "😀", "back\\slash"]):
        assert _json_strings(texts) == json.dumps(texts)


@pytest.mark.parametrize("name", ["llama_tiny_ts17", "sd_block_classic_ts17"])
def test_each_pass_counts_the_nodes_its_own_runs_changed(name: str, tmp_path: Path) -> None:
    """A pass that runs in rounds (the canonical ones, those that run again after the fusions)
    reported the nodes before its first run and after its last, so the other passes' work in
    between showed as its own (onnxruntime-genai's LLaMA: Reshape/Transpose passes "removing"
    the two nodes QuickGelu fused). Each pass's difference is its own now: over a model without
    subgraphs they add up to the model's."""
    run = optimize(fixture_path(name), tmp_path)
    passes = [p for p in run.report["passes"] if p.get("nodes_before") is not None]
    moved = sum(p["nodes_after"] - p["nodes_before"] for p in passes)
    model = run.report["model"]
    assert moved == model["after"]["nodes"] - model["before"]["nodes"]
    unchanged = [p for p in passes if p["effected"] == 0 and p["name"] != "ConstantFoldingPass"]
    assert unchanged and all(p["nodes_after"] == p["nodes_before"] for p in unchanged)
