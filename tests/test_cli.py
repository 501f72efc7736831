"""`fusectl optimize` end to end on the shipped sample: outputs, reports, logs, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.conftest import SAMPLE, assert_same_outputs, digest, optimize, run_cli

SAMPLES = SAMPLE.parents[1]


EXPECTED_FUSION_RESULT = """{
    "session_and_graph_id_0_0": {
        "graph_fusion": {
            "ConvBatchnormFusionPass": {
                "effect_times": "2",
                "match_times": "2"
            },
            "ConvBiasAddFusionPass": {
                "effect_times": "1",
                "match_times": "1"
            },
            "MatMulBiasAddFusionPass": {
                "effect_times": "1",
                "match_times": "1"
            },
            "ReshapeReshapeFusionPass": {
                "effect_times": "1",
                "match_times": "1"
            }
        },
        "ub_fusion": {
            "ConvActivationFusionPass": {
                "effect_times": "2",
                "match_times": "2",
                "repository_hit_times": "0"
            }
        }
    }
}"""


def test_sample_is_optimized_checked_and_equivalent(sample: Path, tmp_path: Path) -> None:
    before = digest(sample)
    run = optimize(sample, tmp_path)
    assert digest(sample) == before, "the input model must never change"
    assert run.fusion_result_path.read_text() == EXPECTED_FUSION_RESULT
    assert run.op_counts() == {"FusedConv": 2, "Conv": 1, "Reshape": 1, "Gemm": 1}
    onnx.checker.check_model(str(run.output), full_check=True)
    assert_same_outputs(sample, run.output)
    assert run.report["model"]["before"]["nodes"] == 12
    assert run.report["model"]["after"]["nodes"] == 5


def test_fused_nodes_carry_lineage(sample: Path, tmp_path: Path) -> None:
    run = optimize(sample, tmp_path)
    nodes = {n.op_type: n for n in onnx.load(str(run.output)).graph.node}
    props = {p.key: p.value for p in nodes["Gemm"].metadata_props}
    assert json.loads(props["fusectl.pass_name"]) == ["MatMulBiasAddFusionPass"]
    assert json.loads(props["fusectl.original_op_names"]) == ["fc/MatMul", "fc/Add"]
    assert json.loads(props["fusectl.original_op_types"]) == ["MatMul", "Add"]


def test_running_twice_gives_the_same_bytes(sample: Path, tmp_path: Path) -> None:
    runs = []
    for name, source in (("first", sample), ("again", None), ("fresh", sample)):
        directory = tmp_path / name
        directory.mkdir()
        runs.append(optimize(source or runs[0].output, directory))
    first, again, fresh = runs
    assert again.output.read_bytes() == first.output.read_bytes()
    assert again.fusion_result == {}
    assert fresh.output.read_bytes() == first.output.read_bytes()


def test_older_fusion_result_layouts(sample: Path, tmp_path: Path) -> None:
    listed = optimize(sample, tmp_path, "--fusion_result_format", "list").fusion_result
    assert isinstance(listed, list) and len(listed) == 1
    assert listed[0]["session_and_graph_id"] == "0_0"
    assert listed[0]["graph_fusion"]["ConvBatchnormFusionPass"] == {
        "effect_times": "2",
        "match_times": "2",
    }
    obj = optimize(sample, tmp_path, "--fusion_result_format", "object").fusion_result
    assert obj["session_and_graph_id"] == "0_0"
    assert set(obj) == {"graph_fusion", "session_and_graph_id", "ub_fusion"}
    assert "repository_hit_times" not in obj["ub_fusion"]["ConvActivationFusionPass"]


def test_disabled_passes_are_absent_from_fusion_result(sample: Path, tmp_path: Path) -> None:
    run = optimize(sample, tmp_path, "--disable_pass", "shape_reshape,AABiasaddConvFusion")
    graph = run.fusion_result["session_and_graph_id_0_0"]["graph_fusion"]
    assert set(graph) == {"ConvBatchnormFusionPass", "MatMulBiasAddFusionPass"}
    entry = run.passed("ReshapeReshapeFusionPass")
    assert (entry["state"], entry["reason"]) == ("off", "CLI")
    assert run.op_counts()["Reshape"] == 2


def test_all_off_file_leaves_the_model_as_it_was(sample: Path, tmp_path: Path) -> None:
    switch = tmp_path / "off.json"
    switch.write_text('{"Switch": {"GraphFusion": {"ALL": "off"}, "UBFusion": {"ALL": "off"}}}')
    run = optimize(sample, tmp_path, "--fusion_switch_file", switch)
    assert run.fusion_result == {}
    assert run.op_counts() == {
        "Conv": 3,
        "BatchNormalization": 2,
        "Relu": 2,
        "Add": 2,
        "Reshape": 2,
        "MatMul": 1,
    }
    assert "ALL:off in GraphFusion left 3 required pass(es) on" in run.stderr


def test_atc_spellings_and_dashed_aliases(sample: Path, tmp_path: Path) -> None:
    switch = tmp_path / "switch.cfg"
    switch.write_text("ConvBatchnormFusionPass:off\n")
    out = tmp_path / "atc"
    result = run_cli(
        f"--model={sample}",
        f"--output={out}",
        f"--fusion-switch-file={switch}",
        f"--fusion_result={tmp_path / 'fr.json'}",
    )
    assert result.exit_code == 2  # options belong to the optimize command
    result = run_cli(
        "optimize",
        f"--model={sample}",
        f"--output={out}",
        f"--fusion-switch-file={switch}",
        f"--fusion_result={tmp_path / 'fr.json'}",
        "--export-compile-stat=1",
    )
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "atc.onnx").exists()  # ATC's --output takes the name without extension
    graph = json.loads((tmp_path / "fr.json").read_text())["session_and_graph_id_0_0"]
    assert "ConvBatchnormFusionPass" not in graph["graph_fusion"]


def test_default_fusion_result_location_and_stale_file(
    sample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ASCEND_WORK_PATH", raising=False)
    Path("fusion_result.json").write_text("stale")
    assert run_cli("optimize", sample, "-o", "out.onnx").exit_code == 0
    assert Path("fusion_result.json").read_text() == EXPECTED_FUSION_RESULT
    Path("fusion_result.json").unlink()
    assert (
        run_cli(
            "optimize",
            sample,
            "-o",
            "out.onnx",
            "--export_compile_stat",
            "0",
        ).exit_code
        == 0
    )
    assert not Path("fusion_result.json").exists()
    work = tmp_path / "work"
    monkeypatch.setenv("ASCEND_WORK_PATH", str(work))
    assert run_cli("optimize", sample, "-o", "out.onnx").exit_code == 0
    (written,) = work.glob("FE/*/fusion_result.json")
    assert written.read_text() == EXPECTED_FUSION_RESULT


def test_info_logs_use_the_ascend_formats_in_execution_order(sample: Path, tmp_path: Path) -> None:
    run = optimize(sample, tmp_path, "--log", "info", "--disable_pass", "ReshapeReshapeFusionPass")
    lines = [
        line.split(" ", 2)[2]
        for line in run.stderr.splitlines()
        if line.startswith("[INFO] fusectl(")
    ]
    fusion = [line for line in lines if "GraphFusionPass[" in line or "[SKIP]" in line]
    assert fusion == [
        "GraphId[0], GraphFusionPass[ConvBatchnormFusionPass]: pattern=ConvBatchnorm, "
        "matched_times=2, effected_times=2.",
        "GraphId[0], GraphFusionPass[ConvBiasAddFusionPass]: pattern=ConvBiasAdd, "
        "matched_times=1, effected_times=1.",
        "[FusionPass][SKIP] Pass [ConvToFullyConnectionFusionPass] is disabled by built-in "
        "default.",
        "[FusionPass][SKIP] Pass [ReshapeReshapeFusionPass] is disabled by --disable_pass.",
        "GraphId[0], GraphFusionPass[MatMulBiasAddFusionPass]: pattern=MatMulBiasAdd, "
        "matched_times=1, effected_times=1.",
        "[FusionPass][SKIP] Pass [SimplifiedLayerNormFusionPass] is disabled by built-in default.",
        "[FusionPass][SKIP] Pass [TbeEltwiseFusionPass] is disabled by built-in default.",
    ]
    assert any(line.startswith("Pass [ConvBatchnormFusionPass] took ") for line in lines)


def test_log_null_and_json_keep_stdout_to_one_document(sample: Path, tmp_path: Path) -> None:
    run = optimize(sample, tmp_path, "--json", "--log", "null")
    document = json.loads(run.stdout)
    assert document["fusion_result"] == json.loads(EXPECTED_FUSION_RESULT)
    assert run.stderr == ""
    entry = next(p for p in document["passes"] if p["name"] == "ConvBatchnormFusionPass")
    assert entry["matched"] == 2 and entry["effected"] == 2
    assert entry["reason"] == "default" and entry["nodes_before"] - entry["nodes_after"] == 2
    assert [s["original_nodes"] for s in entry["sites"]] == [
        ["stage0/Conv", "stage0/BatchNormalization"],
        ["stage1/Conv", "stage1/BatchNormalization"],
    ]


def test_report_states_every_pass_with_its_reason(sample: Path, tmp_path: Path) -> None:
    run = optimize(
        sample,
        tmp_path,
        "--enable_pass",
        "ConvBatchnormFusionPass",
        "--optimization_switch",
        "MatMulBiasAddFusionPass:off",
    )
    reasons = {p["name"]: (p["state"], p["reason"]) for p in run.report["passes"]}
    assert reasons["ConvBatchnormFusionPass"] == ("on", "CLI")
    assert reasons["MatMulBiasAddFusionPass"] == ("off", "CLI")
    assert reasons["ReshapeReshapeFusionPass"] == ("on", "default")
    assert reasons["DeadNodeEliminationPass"] == ("on", "forced")
    assert run.report["options"]["optimization_switch"] == "MatMulBiasAddFusionPass:off"


def test_dump_graph_writes_each_changed_stage_sharing_weights(sample: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    optimize(sample, tmp_path, "--dump_graph", dump)
    names = sorted(p.name for p in dump.glob("*.onnx"))
    assert names == [
        "0000_original.onnx",
        "0001_ConvBatchnormFusionPass.onnx",
        "0002_ConvBiasAddFusionPass.onnx",
        "0003_ReshapeReshapeFusionPass.onnx",
        "0004_MatMulBiasAddFusionPass.onnx",
        "0005_ConvActivationFusionPass.onnx",
        "0006_DeadNodeEliminationPass.onnx",
    ]
    referenced = 0
    for name in names:
        proto = onnx.load(str(dump / name), load_external_data=False)
        for tensor in proto.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                assert {e.key: e.value for e in tensor.external_data}["location"] == (
                    "weights.data"
                )
                referenced += int({e.key: e.value for e in tensor.external_data}["length"])
            else:
                assert len(tensor.raw_data) < 1024, f"{name} embeds {tensor.name}"
    # Each large weight is written once and referenced by every dump that uses it.
    assert (dump / "weights.data").stat().st_size < referenced / 3
    for name in names:
        ort.InferenceSession(str(dump / name), providers=["CPUExecutionProvider"])
    assert_same_outputs(sample, dump / names[-1])


def test_external_data_in_external_data_out(sample: Path, tmp_path: Path) -> None:
    external = tmp_path / "ext" / "model.onnx"
    external.parent.mkdir()
    onnx.save(
        onnx.load(str(sample)),
        str(external),
        save_as_external_data=True,
        location="model.onnx.weights",
        size_threshold=0,
    )
    run = optimize(external, tmp_path)
    data = run.output.with_name(run.output.name + ".data")
    assert data.exists() and data.stat().st_size > 0
    model = onnx.load(str(run.output), load_external_data=False)
    large = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert {i.name for i in large} >= {"fc.weight"} | {
        i.name for i in model.graph.initializer if i.name.endswith("/weight")
    }
    assert_same_outputs(sample, run.output)


def test_external_data_asked_for_an_inline_model(sample: Path, tmp_path: Path) -> None:
    (tmp_path / "inline").mkdir()
    (tmp_path / "external").mkdir()
    inline = optimize(sample, tmp_path / "inline")
    assert not inline.output.with_name(inline.output.name + ".data").exists()
    run = optimize(sample, tmp_path / "external", "--external_data")
    data = run.output.with_name(run.output.name + ".data")
    assert data.stat().st_size > 0
    assert run.report["paths"]["external_data"] == str(data)
    assert run.report["options"]["external_data"] is True
    model = onnx.load(str(run.output), load_external_data=False)
    external = {
        i.name for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL
    }
    assert "fc.weight" in external
    assert run.output.stat().st_size < inline.output.stat().st_size / 2
    ext, inl = onnx.load(str(run.output)).graph, onnx.load(str(inline.output)).graph
    assert ext.node == inl.node
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in inl.initializer}
    assert {i.name: onnx.numpy_helper.to_array(i).tobytes() for i in ext.initializer} == {
        name: array.tobytes() for name, array in weights.items()
    }
    assert_same_outputs(sample, run.output)


def test_external_data_refuses_a_protected_data_path(sample: Path, tmp_path: Path) -> None:
    """OUT.onnx.data is an output of the run: it must not be the input model."""
    model = tmp_path / "m.onnx.data"
    model.write_bytes(sample.read_bytes())
    before = digest(model)
    refused = run_cli("optimize", str(model), "-o", str(tmp_path / "m.onnx"), "--external_data")
    assert refused.exit_code == 2, refused.stderr
    assert "external data file" in refused.stderr
    assert digest(model) == before
    assert not (tmp_path / "m.onnx").exists()


def test_input_shape_fixes_symbolic_dims(tmp_path: Path) -> None:
    model = onnx.load(str(SAMPLE))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    symbolic = tmp_path / "symbolic.onnx"
    onnx.save(model, str(symbolic))
    run = optimize(symbolic, tmp_path, "--input_shape", "image:1,3,8,8")
    dims = onnx.load(str(run.output)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [1, 3, 8, 8]
    bad = optimize(symbolic, tmp_path, "--input_shape", "pixels:1,3,8,8", expect=2)
    assert "--input_shape names 'pixels', not an input (inputs: image)" in bad.stderr
    bad = optimize(symbolic, tmp_path, "--input_shape", "image:1,3,9,8", expect=2)
    assert "the model fixes it at 8" in bad.stderr


def test_a_dimension_declared_minus_one_is_dynamic(tmp_path: Path) -> None:
    """Paddle2ONNX declares a dynamic batch as ``dim_value: -1`` (RapidOCR's classifier), which
    onnxruntime reads as unknown: --input_shape may set it, verify generates a size for it."""
    weight = onnx.numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32) / 27, "w")
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            onnx.helper.make_node("Relu", ["c"], ["y"]),
        ],
        "minus_one",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [-1, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [-1, 4, 8, 8])],
        [weight],
    )
    declared = tmp_path / "minus_one.onnx"
    onnx.save(
        onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), declared
    )
    fixed = optimize(declared, tmp_path, "--input_shape", "x:2,3,8,8")
    dims = onnx.load(str(fixed.output)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [2, 3, 8, 8]
    (tmp_path / "free").mkdir()
    free = optimize(declared, tmp_path / "free")
    batch = onnx.load(str(free.output)).graph.output[0].type.tensor_type.shape.dim[0]
    assert not batch.HasField("dim_value") and not batch.HasField("dim_param")
    checked = run_cli("verify", declared, free.output, "--json")
    assert checked.exit_code == 0, checked.stderr
    assert json.loads(checked.stdout)["inputs"]["x"]["shape"] == [8, 3, 8, 8]


def test_target_onnx_reports_ub_off(sample: Path, tmp_path: Path) -> None:
    run = optimize(sample, tmp_path, "--target", "onnx")
    domains = {n.domain for n in onnx.load(str(run.output)).graph.node}
    assert domains <= {"", "ai.onnx"}


# --- bad input ------------------------------------------------------------------------------


def assert_clean_failure(run_result: object, output: Path, *fragments: str) -> None:
    stderr = run_result.stderr  # type: ignore[attr-defined]
    assert run_result.exit_code == 2, stderr  # type: ignore[attr-defined]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("fusectl: error: ")
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0]
    leftovers = [p for p in output.parent.iterdir() if p.name.startswith((output.name, "."))]
    assert not leftovers, leftovers


def fail(model: Path, tmp_path: Path, *args: str | Path) -> tuple[object, Path]:
    out = tmp_path / "out" / "model_opt.onnx"
    out.parent.mkdir(exist_ok=True)
    result = run_cli("optimize", model, "-o", out, "--fusion_result", tmp_path / "fr.json", *args)
    assert not (tmp_path / "fr.json").exists()
    return result, out


def test_missing_model(tmp_path: Path) -> None:
    result, out = fail(tmp_path / "nope.onnx", tmp_path)
    assert_clean_failure(result, out, "nope.onnx: no such file")


def test_file_that_is_not_onnx(tmp_path: Path) -> None:
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    result, out = fail(text, tmp_path)
    assert_clean_failure(result, out, "notes.onnx: not an ONNX model")


def test_truncated_model(sample: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(sample.read_bytes()[: sample.stat().st_size // 2])
    result, out = fail(truncated, tmp_path)
    assert_clean_failure(result, out, "truncated.onnx: ", "truncated")


def test_missing_external_data(sample: Path, tmp_path: Path) -> None:
    external = tmp_path / "ext.onnx"
    onnx.save(
        onnx.load(str(sample)),
        str(external),
        save_as_external_data=True,
        location="ext.bin",
        size_threshold=0,
    )
    (tmp_path / "ext.bin").unlink()
    result, out = fail(external, tmp_path)
    assert_clean_failure(result, out, "ext.onnx: external data file 'ext.bin'", "is missing")


def test_output_directory_that_cannot_be_written(sample: Path, tmp_path: Path) -> None:
    result = run_cli("optimize", sample, "-o", tmp_path / "no" / "such" / "dir" / "o.onnx")
    assert result.exit_code == 2 and "output directory does not exist" in result.stderr
    result = run_cli(
        "optimize", sample, "-o", "/proc/fusectl_out.onnx", "--fusion_result", tmp_path / "fr.json"
    )
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("fusectl: error: /proc")
    assert len(result.stderr.strip().splitlines()) == 1


def test_output_equal_to_input_is_refused(sample: Path, tmp_path: Path) -> None:
    before = digest(sample)
    result = run_cli("optimize", sample, "-o", sample)
    assert result.exit_code == 2
    assert "output path is the input model" in result.stderr
    assert digest(sample) == before


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"Switch": {"GraphFusion": {"A": "on",}}}', "invalid JSON at line 1"),
        ('{"Switch": {"Graph": {}}}', "key 'Switch.Graph' is not valid"),
        ('{"Switch": {"GraphFusion": {"ConvBatchnormFusionPass": "no"}}}', 'must be "on"'),
        ("ConvBatchnormFusionPass:off\nConvBatchnormFusionPass:on\n", "is repeated"),
    ],
)
def test_malformed_switch_file(sample: Path, tmp_path: Path, content: str, fragment: str) -> None:
    switch = tmp_path / "switch.cfg"
    switch.write_text(content)
    result, out = fail(sample, tmp_path, "--fusion_switch_file", switch)
    assert_clean_failure(result, out, "switch.cfg: ", fragment)


def test_unreadable_switch_file(sample: Path, tmp_path: Path) -> None:
    result, out = fail(sample, tmp_path, "--fusion_switch_file", tmp_path)
    assert_clean_failure(result, out, "switch file is a directory")
    result, out = fail(sample, tmp_path, "--fusion_switch_file", tmp_path / "absent.cfg")
    assert_clean_failure(result, out, "absent.cfg: switch file does not exist")


def test_unknown_pass_is_a_warning_unless_strict(sample: Path, tmp_path: Path) -> None:
    run = optimize(sample, tmp_path, "--disable_pass", "ConvBatchNormFusionPass")
    assert "did you mean 'ConvBatchnormFusionPass'?" in run.stderr
    result, out = fail(sample, tmp_path, "--disable_pass", "ConvBatchNormFusionPass", "--strict")
    assert_clean_failure(result, out, "unknown pass name 'ConvBatchNormFusionPass'")


# --- the other commands ----------------------------------------------------------------------


def test_passes_lists_the_catalogue() -> None:
    result = run_cli("passes", "--json")
    catalogue = {p["name"]: p for p in json.loads(result.stdout)}
    assert catalogue["MatMulBiasAddFusionPass"]["aliases"] == [
        "matmul_elem_biasadd_fusion",
        "MatMulAddFusion",
    ]
    assert catalogue["ConvBatchnormFusionPass"]["numerics"] == "reassociating"
    assert catalogue["DeadNodeEliminationPass"]["closable"] is False
    assert catalogue["ConvBatchnormFusionPass"]["providers"] == ["CPUExecutionProvider"]
    again = {name for name, p in catalogue.items() if p["again_after_fusions"]}
    assert again == {
        "ConstantFoldingPass",
        "FlattenedGemmCanonicalizationPass",
        "HeadRepeatTransposeCanonicalizationPass",
        "LayoutChainFusionPass",
        "ReshapeReshapeFusionPass",
        "ReshapeTargetCanonicalizationPass",
        "TransposePushCanonicalizationPass",
        "TransposeTransposeFusionPass",
    }
    graph_only = json.loads(run_cli("passes", "--json", "--category", "UBFusion").stdout)
    assert all(p["category"] == "UBFusion" for p in graph_only)
    table = run_cli("passes")
    assert table.exit_code == 0 and "ConvBatchnormFusionPass" in table.stdout


def test_python_dash_m_entry_point(sample: Path, tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusectl",
            "optimize",
            str(sample),
            "-o",
            str(tmp_path / "m.onnx"),
            "--export_compile_stat",
            "0",
            "--log",
            "null",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "m.onnx").exists()


def test_shipped_switch_files_parse(tmp_path: Path) -> None:
    for name in ("fusion_switch.json", "fusion_switch.cfg"):
        run = optimize(SAMPLE, tmp_path, "--fusion_switch_file", SAMPLES / name, "--strict")
        assert run.passed("ConvBatchnormFusionPass")["state"] == "off"


@pytest.mark.parametrize("stat", ["1", "2"])
def test_export_compile_stat_never_outlives_a_refused_output(
    sample: Path, tmp_path: Path, stat: str
) -> None:
    """Outputs are checked before anything is written: an unwritable -o leaves no result."""
    result_path = tmp_path / "fr.json"
    args = ("-o", "/proc/fusectl_out.onnx", "--fusion_result", result_path)
    result = run_cli("optimize", sample, *args, "--export_compile_stat", stat)
    assert result.exit_code == 2
    assert not result_path.exists()


_COMMANDS = {
    "optimize": ["-o", "out.onnx"],
    "verify": [SAMPLE],
    "bench": [],
    "bisect": [],
    "tune": [],
}


@pytest.mark.parametrize("command", [*_COMMANDS, "passes", "switch-template"])
def test_an_internal_error_says_how_to_see_its_traceback(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hint names a way the command has: verify, bench, bisect and tune had no --log."""

    def broken(level: str) -> None:
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr("fusectl.cli.logs.configure", broken)
    args = [SAMPLE, *_COMMANDS[command]] if command in _COMMANDS else []
    result = run_cli(command, *args)
    assert result.exit_code == 3
    hint = "run with --log debug" if command in _COMMANDS else "set ASCEND_GLOBAL_LOG_LEVEL=0"
    assert result.stderr.strip() == (
        f"fusectl: internal error: RuntimeError: broken on purpose ({hint} for the traceback)"
    )
    if command in _COMMANDS:
        assert run_cli(command, *args, "--log", "debug").exit_code == 3  # not a usage error
