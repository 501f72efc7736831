"""A built-in pass that raises on a model (a fusectl bug) costs that pass, not the run: the model
is optimized again from the input without it, with a warning that names it, unless the user
asks for the error (``--pass_errors raise`` / FUSECTL_PASS_ERRORS=raise, which the suite sets).

The fault is injected by wrapping a real pass's ``run`` so that it raises after rewriting part
of the graph: the second run must start from the input, not from what the first one left."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import fusectl
from fusectl.core.plugins import load_builtin_passes
from tests.conftest import SAMPLE, run_cli

BROKEN = "ConvActivationFusionPass"


@pytest.fixture
def broken_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """ConvActivationFusionPass rewrites the sample's Conv + Relu pairs, then raises."""
    cls = type(load_builtin_passes()[BROKEN])
    original = cls.run

    def run(self: object, model: object, ctx: object) -> None:
        original(self, model, ctx)
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(cls, "run", run)
    monkeypatch.setenv("FUSECTL_PASS_ERRORS", "skip")


def _optimize(tmp_path: Path, name: str, *args: str | Path) -> tuple[object, Path]:
    output = tmp_path / f"{name}.onnx"
    report = tmp_path / f"{name}.json"
    result = run_cli("optimize", SAMPLE, "-o", output, "--report", report,
                     "--fusion_result", tmp_path / f"{name}_fusion.json", *args)  # fmt: skip
    return result, output


@pytest.mark.usefixtures("broken_pass")
def test_a_pass_that_raises_is_turned_off_and_the_input_optimized_again(tmp_path: Path) -> None:
    before = SAMPLE.read_bytes()
    result, output = _optimize(tmp_path, "skipped")
    assert result.exit_code == 0, result.stderr
    warning = (
        f"{SAMPLE}: {BROKEN} raised IndexError: tuple index out of range; the model was "
        "optimized again without it. This is a fusectl bug: please report it with the model "
        "(FUSECTL_PASS_ERRORS=raise and --log debug show the traceback)"
    )
    assert warning in " ".join(result.stderr.split())
    report = json.loads((tmp_path / "skipped.json").read_text())
    assert warning in report["warnings"]
    entry = next(p for p in report["passes"] if p["name"] == BROKEN)
    assert (entry["state"], entry["reason"]) == ("off", "failed")
    assert entry["reason_detail"] == "it raised IndexError: tuple index out of range on this model"
    fused = json.loads((tmp_path / "skipped_fusion.json").read_text())
    assert BROKEN not in json.dumps(fused)
    # What the run wrote is the model optimized without the pass, from the input: the Conv +
    # Relu pairs the failed run fused are not in it, nor is anything else that run did.
    _, without = _optimize(tmp_path, "without", "--disable_pass", BROKEN)
    assert output.read_bytes() == without.read_bytes()
    ops = [node.op_type for node in onnx.load(str(output)).graph.node]
    assert ops.count("Relu") == 2 and "FusedConv" not in ops
    assert SAMPLE.read_bytes() == before


@pytest.mark.usefixtures("broken_pass")
def test_asked_for_the_error_the_run_stops_and_writes_nothing(tmp_path: Path) -> None:
    result, _ = _optimize(tmp_path, "raised", "--pass_errors", "raise")
    assert result.exit_code == 3
    assert result.stderr.strip() == (
        f"fusectl: internal error: PassFailure: {BROKEN} raised IndexError: tuple index out of "
        "range (run with --log debug for the traceback)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.usefixtures("broken_pass")
def test_the_api_skips_the_pass_and_its_dumps_start_again(tmp_path: Path) -> None:
    """In memory, with --dump_graph: the dumps are the second run's alone."""
    model = onnx.load(str(SAMPLE))
    copy = model.SerializeToString()
    result = fusectl.optimize(model, dump_graph=tmp_path / "dumps")
    assert model.SerializeToString() == copy
    assert not any(d.name == BROKEN and d.enabled for d in result.plan.decisions)
    dumps = sorted(p.name for p in (tmp_path / "dumps").glob("*.onnx"))
    assert dumps[0] == "0000_original.onnx" and not any(BROKEN in name for name in dumps)
    assert len(dumps) == len(set(name[5:] for name in dumps))
    with pytest.raises(fusectl.FusectlError, match="pass_errors is skip or raise, not 'later'"):
        fusectl.optimize(model, pass_errors="later")


def test_a_bad_pass_errors_setting_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUSECTL_PASS_ERRORS", "ignore")
    result, _ = _optimize(tmp_path, "bad")
    assert result.exit_code == 2
    expected = "fusectl: error: FUSECTL_PASS_ERRORS is skip or raise, not 'ignore'"
    assert result.stderr.strip() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == []
