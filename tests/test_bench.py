"""`fusectl bench` on a real fixture and its optimized output: structure, sanity, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from fusectl.diagnostics.bench import rotations
from tests.conftest import FIXTURES, optimize, run_cli

BERT = FIXTURES / "bert_tiny_ts17.onnx"
QUICK = ("--runs", "3", "--warmup", "1")


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return optimize(BERT, tmp_path_factory.mktemp("bench")).output


def bench_json(*args: str | Path) -> dict:
    result = run_cli("bench", *args, *QUICK, "--json")
    assert result.exit_code == 0, result.stderr + result.stdout
    return json.loads(result.stdout)


def test_json_has_sane_timings_per_model_and_level(optimized: Path) -> None:
    document = bench_json(BERT, optimized)
    assert document["runs"] == 3 and document["warmup"] == 1 and document["threads"] == 1
    assert document["providers"] == ["CPUExecutionProvider"]
    assert set(document["inputs"]) == {"input_ids", "attention_mask"}
    assert [m["path"] for m in document["models"]] == [str(BERT), str(optimized)]
    for index, model in enumerate(document["models"]):
        assert list(model["levels"]) == ["all", "none"]
        for timing in model["levels"].values():
            assert timing["runs"] == 3
            assert timing["session_s"] > 0
            assert 0 < timing["p10_ms"] <= timing["median_ms"] <= timing["p90_ms"]
            assert timing["session_runs"] == 3
            if index == 0:
                assert timing["ratio"] == timing["session_ratio"] == 1.0
            else:
                assert timing["ratio"] > 0 and timing["session_ratio"] > 0
    # The cold start compares the optimized model's session without onnxruntime's optimizer
    # with the original's with it fully on.
    original, fused = document["models"]
    assert original["cold_start"] == pytest.approx(
        original["levels"]["none"]["session_s"] / original["levels"]["all"]["session_s"]
    )
    assert fused["cold_start"] == pytest.approx(
        fused["levels"]["none"]["session_s"] / original["levels"]["all"]["session_s"]
    )
    assert document["session_runs"] == 3


def test_one_level_and_more_than_two_models(optimized: Path) -> None:
    document = bench_json(BERT, optimized, BERT, "--opt-levels", "none", "--threads", "2")
    assert len(document["models"]) == 3 and document["threads"] == 2
    for model in document["models"]:
        assert list(model["levels"]) == ["none"]
        assert model["cold_start"] is None  # needs both levels


def test_table_on_stderr(optimized: Path) -> None:
    result = run_cli("bench", BERT, optimized, *QUICK)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    for text in ("median ms", "p10 ms", "p90 ms", "session s", "1.00x", "input_ids int64[2,8]"):
        assert text in result.stderr
    assert "3 timed run(s) per model, interleaved, after 1 warm-up" in result.stderr
    assert "session time: median of 3 creation(s)" in result.stderr
    assert f"cold start: {optimized.name} creates its session" in result.stderr


def _broken_model(path: Path) -> Path:
    """Loads fine, fails at run time: a Reshape of the token ids to an impossible shape."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [3])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["input_ids", "shape"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [3])],
        [shape],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("missing.onnx",), "missing.onnx: no such file"),
        (("junk.onnx",), "junk.onnx"),
        (("broken.onnx",), "broken.onnx: onnxruntime cannot run it"),
        ((str(FIXTURES / "cnn_dynamo.onnx"),), "cnn_dynamo.onnx: needs input(s) 'x'"),
        (("--runs", "0"), "--runs must be at least 1"),
        (("--warmup", "-1"), "--warmup must be 0 or more"),
        (("--session_runs", "0"), "--session_runs must be at least 1"),
        (("--opt-levels", "fast"), "--opt-levels: 'fast' is not a level"),
        (("--providers", "nope"), "--providers: 'nope' is not available"),
    ],
    ids=[
        "missing",
        "not-onnx",
        "fails-to-run",
        "other-inputs",
        "runs",
        "warmup",
        "session-runs",
        "opt-levels",
        "providers",
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    args: tuple[str, ...], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "junk.onnx").write_text("not a model")
    _broken_model(tmp_path / "broken.onnx")
    models = [BERT, *(a for a in args if a.endswith(".onnx"))]
    if len(models) == 1:
        models.append(BERT)
    options = [a for a in args if not a.endswith(".onnx")]
    result = run_cli("bench", *models, *QUICK, *options)
    assert result.exit_code == 2, result.stderr + result.stdout
    assert named in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_one_model_is_not_a_comparison() -> None:
    result = run_cli("bench", BERT)
    assert result.exit_code == 2
    assert "bench takes ORIGINAL and OPTIMIZED (or more), got 1" in result.stderr


def test_a_model_with_onnxruntime_only_ops_is_benched(tmp_path: Path) -> None:
    """Another optimizer's output may hold ops only onnxruntime knows in the ONNX domain
    (its SimplifiedLayerNormalization): onnxruntime runs it, so bench times it."""
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [4], [1.0] * 4)
    shape = [2, 4]
    io = helper.make_tensor_value_info
    plain = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "plain",
        [io("x", TensorProto.FLOAT, shape)],
        [io("y", TensorProto.FLOAT, shape)],
    )
    rms = helper.make_graph(
        [helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], ["y"], axis=-1)],
        "rms",
        [io("x", TensorProto.FLOAT, shape)],
        [io("y", TensorProto.FLOAT, shape)],
        [scale],
    )
    opsets = [helper.make_opsetid("", 17)]
    onnx.save(helper.make_model(plain, opset_imports=opsets), tmp_path / "plain.onnx")
    onnx.save(helper.make_model(rms, opset_imports=opsets), tmp_path / "rms.onnx")
    document = bench_json(tmp_path / "plain.onnx", tmp_path / "rms.onnx")
    assert [m["path"] for m in document["models"]][1] == str(tmp_path / "rms.onnx")


def test_rotations_visit_every_item_each_round_and_rotate_the_lead() -> None:
    orders = list(rotations(3, 4))
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert all(sorted(order) == [0, 1, 2] for order in orders)
