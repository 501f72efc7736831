"""The library API as Python users call it: the same bytes as the CLI, no files unless asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

import fusectl
from tests.conftest import SAMPLE, assert_same_outputs, digest, run_cli


def _cli(sample: Path, tmp_path: Path, *args: str | Path) -> Path:
    output = tmp_path / "cli.onnx"
    result = run_cli(
        "optimize", sample, "-o", output, "--fusion_result", tmp_path / "cli.json", *args
    )
    assert result.exit_code == 0, result.stderr
    return output


def test_python_one_liner_writes_the_cli_bytes(tmp_path: Path) -> None:
    """The issue's one-liner, run in a fresh interpreter from a folder holding samples/."""
    models = tmp_path / "samples" / "models"
    models.mkdir(parents=True)
    (models / "tiny_cnn.onnx").write_bytes(SAMPLE.read_bytes())
    code = "import fusectl; fusectl.optimize('samples/models/tiny_cnn.onnx', 'x.onnx')"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    # Only the output: the API has no implicit ./fusion_result.json.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples", "x.onnx"]
    cli_output = _cli(models / "tiny_cnn.onnx", tmp_path)
    assert (tmp_path / "x.onnx").read_bytes() == cli_output.read_bytes()


def test_external_data_keyword_writes_the_cli_bytes(sample: Path, tmp_path: Path) -> None:
    result = fusectl.optimize(sample, tmp_path / "api.onnx", external_data=True)
    data = tmp_path / "api.onnx.data"
    assert result.paths["external_data"] == data
    cli_output = _cli(sample, tmp_path, "--external_data")
    assert data.read_bytes() == (tmp_path / "cli.onnx.data").read_bytes()
    # The model files differ only in the data file's name they refer to.
    api_text = (tmp_path / "api.onnx").read_bytes().replace(b"api.onnx.data", b"cli.onnx.data")
    assert api_text == cli_output.read_bytes()


def test_result_holds_model_report_and_fusion_result(sample: Path, tmp_path: Path) -> None:
    fusion_result = tmp_path / "api.json"
    report = tmp_path / "report.json"
    result = fusectl.optimize(
        sample,
        tmp_path / "api.onnx",
        fusion_result=fusion_result,
        report=report,
        disable_pass=["ConvActivationFusionPass"],
    )
    cli_output = _cli(sample, tmp_path, "--disable_pass", "ConvActivationFusionPass")
    assert (tmp_path / "api.onnx").read_bytes() == cli_output.read_bytes()
    assert fusion_result.read_text() == (tmp_path / "cli.json").read_text()
    assert result.fusion_result_text == fusion_result.read_text()
    assert json.loads(report.read_text()) == result.report
    states = {p["name"]: p["state"] for p in result.report["passes"]}
    assert states["ConvActivationFusionPass"] == "off"
    assert result.fusion_result["session_and_graph_id_0_0"]["graph_fusion"][
        "ConvBatchnormFusionPass"
    ] == {"effect_times": "2", "match_times": "2"}
    assert result.paths == {
        "output": tmp_path / "api.onnx",
        "fusion_result": fusion_result,
        "report": report,
    }
    assert len(result.model.graph) == result.report["model"]["after"]["nodes"] < 12


def test_in_memory_models_are_left_unchanged_and_nothing_is_written(
    sample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proto = onnx.load(str(sample))
    before = proto.SerializeToString()
    model = ir.serde.deserialize_model(onnx.load(str(sample)))
    model_before = ir.serde.serialize_model(model).SerializeToString()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    from_proto = fusectl.optimize(proto)
    from_ir = fusectl.optimize(model)
    assert list(work.iterdir()) == []
    assert proto.SerializeToString() == before
    assert ir.serde.serialize_model(model).SerializeToString() == model_before
    assert from_proto.paths == {} and from_proto.report["paths"]["model"] is None
    cli_bytes = _cli(sample, tmp_path).read_bytes()
    for result in (from_proto, from_ir):
        written = tmp_path / "from_memory.onnx"
        onnx.save(result.to_proto(), str(written))
        assert written.read_bytes() == cli_bytes


def test_verify_without_files_runs_in_a_temporary_folder(sample: Path) -> None:
    result = fusectl.optimize(onnx.load(str(sample)), verify=True)
    assert result.verify is not None and result.verify.passed and result.passed
    assert result.report["verify"]["passed"] is True


def test_bad_input_raises_fusectl_error(tmp_path: Path) -> None:
    with pytest.raises(fusectl.FusectlError, match="no such file"):
        fusectl.optimize(tmp_path / "missing.onnx")
    with pytest.raises(fusectl.FusectlError, match="not int"):
        fusectl.optimize(3)  # type: ignore[arg-type]


def test_a_plugin_given_to_one_call_runs_in_that_call_only() -> None:
    """A pipeline optimizing several models in one process: the second call, without the
    plugin, does not run the first one's pass; a third call with it runs it again."""
    plugin = Path(__file__).resolve().parents[1] / "samples" / "plugins" / "hardswish_fusion.py"
    model = Path(__file__).resolve().parent / "fixtures" / "hardswish_cnn_torchscript.onnx"

    def hard_swishes(result: fusectl.OptimizeResult) -> list[tuple[str, int]]:
        passes = result.report["passes"]
        return [(p["name"], p["effected"]) for p in passes if p["name"] == "HardSwishFusionPass"]

    # The built-in ActivationRecognitionPass writes these hard-swishes itself, before plugins.
    off = {"disable_pass": ["ActivationRecognitionPass"]}
    with_plugin = fusectl.optimize(model, plugins=[plugin], **off)
    assert hard_swishes(with_plugin) == [("HardSwishFusionPass", 3)]
    assert hard_swishes(fusectl.optimize(model, **off)) == []
    assert fusectl.REGISTRY.canonical("HardSwishFusionPass") is None
    with_plugin = fusectl.optimize(model, plugins=[plugin], **off)
    assert hard_swishes(with_plugin) == [("HardSwishFusionPass", 3)]


def test_fusectl_pass_composes_in_an_onnx_ir_sequential(sample: Path, tmp_path: Path) -> None:
    model = ir.load(sample)
    pipeline = ir.passes.Sequential(
        fusectl.FusectlPass(disable_pass=["ConvActivationFusionPass"]),
        fusectl.FusectlPass(),
    )
    result = pipeline(model)
    assert result.modified
    assert len(result.model.graph) < 12
    output = tmp_path / "pass.onnx"
    ir.save(result.model, output)
    assert_same_outputs(sample, output)
    # Nothing left to fuse: a second run reports no change.
    assert not fusectl.FusectlPass()(result.model).modified


def test_diagnostics_functions(sample: Path, tmp_path: Path) -> None:
    output = tmp_path / "out.onnx"
    fusectl.optimize(sample, output)
    checked = fusectl.verify(sample, output)
    assert checked.passed and len(checked.checks) == 1
    timed = fusectl.bench([sample, output], runs=2, warmup=0, opt_levels="none")
    assert len(timed.to_json()["models"]) == 2
    before = sorted(tmp_path.iterdir())
    found = fusectl.bisect(sample)
    assert found.full.passed and found.switch_file is None
    assert sorted(tmp_path.iterdir()) == before
    assert digest(sample) == digest(SAMPLE)
