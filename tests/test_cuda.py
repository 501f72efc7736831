"""On onnxruntime's CUDA provider: `fusectl tune --providers cuda` measuring on the GPU, the
optimized model applying those verdicts, bench keeping inputs and outputs in device memory, and
the fused kernels agreeing with the original on the GPU.

Skipped where onnxruntime has no CUDA provider (CI's machines); run on a GPU with
onnxruntime-gpu installed (benchmarks/README.md, "CUDA").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

import fusectl
from fusectl.core.repository import DECISIONS, UNSUPPORTED, device_identity, load_repository
from tests.conftest import FIXTURES, optimize, random_feeds, run_cli
from tests.test_tune import (  # the tiny BERT's tuned sites, the shipped section's refusals
    BERT,
    CUDA_GQA_REFUSALS,
    SHAPES,
    TUNED_SITES,
)

CUDA = "CUDAExecutionProvider"
pytestmark = pytest.mark.skipif(
    CUDA not in ort.get_available_providers(), reason="needs onnxruntime's CUDA provider"
)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    repository = tmp_path_factory.mktemp("cuda") / "repository.json"
    result = run_cli(
        "tune", BERT, "--providers", "cuda", "--input_shape", SHAPES, "--repository", repository,
        "--budget", "0.5",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr + result.stdout
    return repository, result


def test_tune_measures_every_class_on_the_gpu(tuned: tuple[Path, Any]) -> None:
    repository, _ = tuned
    section, warning = load_repository(repository).section(CUDA)
    assert warning is None and section is not None
    assert section.provider == CUDA
    assert section.device == device_identity(CUDA) != "unknown GPU"
    assert section.onnxruntime == ort.__version__
    # As on CPU (test_tune.py): every tuned site is in a measured class.
    measured = {key.split("/", 1)[0] for key in section.sites}
    assert measured == set(TUNED_SITES)
    for entry in section.sites.values():
        assert entry["decision"] in DECISIONS
        if entry["decision"] != UNSUPPORTED:
            assert entry["fused_ms"] > 0 and entry["unfused_ms"] > 0


def test_optimize_for_cuda_applies_its_verdicts(tuned: tuple[Path, Any], tmp_path: Path) -> None:
    repository, _ = tuned
    run = optimize(BERT, tmp_path, "--providers", "cuda", "--repository", repository)
    ub = run.fusion_result["session_and_graph_id_0_0"]["ub_fusion"]
    hits = sum(int(entry["repository_hit_times"]) for entry in ub.values())
    assert hits == sum(TUNED_SITES.values())
    decisions = run.report["repository"]["decisions"]
    assert decisions and all(d["decision"] in DECISIONS for d in decisions)
    verified = fusectl.verify(BERT, run.output, providers="cuda", input_shape=SHAPES)
    assert verified.passed, verified.to_json()


def test_bench_keeps_inputs_and_outputs_on_the_device(tmp_path: Path) -> None:
    optimized = optimize(BERT, tmp_path, "--providers", "cuda").output
    result = fusectl.bench(
        [BERT, optimized], providers="cuda", runs=5, warmup=2, input_shape=SHAPES, session_runs=1
    )
    assert result.on_device
    assert all(timing.median_ms > 0 for timing in result.timings.values())
    assert result.to_json()["io_on_device"] is True


def test_a_fused_op_cuda_cannot_run_is_recorded_and_declined(tmp_path: Path) -> None:
    # MobileNet-V2's ReLU6 is a Clip: CUDA's FusedConv refuses that activation when the
    # session is created, so tune records the class unsupported and optimize declines it.
    model = FIXTURES / "mobilenetv2_tiny_torchscript.onnx"
    repository = tmp_path / "repository.json"
    tuned = run_cli(
        "tune", model, "--providers", "cuda", "--repository", repository, "--budget", "0.3"
    )
    assert tuned.exit_code == 0, tuned.stderr + tuned.stdout
    section, _ = load_repository(repository).section(CUDA)
    assert section is not None
    refused = [e for e in section.sites.values() if e["decision"] == UNSUPPORTED]
    assert refused and all('"Clip"' in e["error"] for e in refused)
    assert all(e["attributes"]["activation"] == "Clip" for e in refused)
    run = optimize(model, tmp_path, "--providers", "cuda", "--repository", repository)
    reasons = [
        miss["reason"] for entry in run.report["passes"] for miss in entry.get("near_misses", [])
    ]
    assert any(r.startswith("does not run on CUDAExecutionProvider: ") for r in reasons)
    session = ort.InferenceSession(str(run.output), providers=[CUDA])
    assert session.get_providers()[0] == CUDA


GQA = "com.microsoft.GroupQueryAttention"
NO_KERNEL = CUDA_GQA_REFUSALS["llama_tiny_ts17"]


def _tuned_gqa(model: Path, repository: Path) -> list[dict[str, Any]]:
    tuned = run_cli(
        "tune", model, "--providers", "cuda", "--repository", repository, "--budget", "0.3"
    )
    assert tuned.exit_code == 0, tuned.stderr + tuned.stdout
    section, _ = load_repository(repository).section(CUDA)
    assert section is not None
    return [e for e in section.sites.values() if GQA in e["fused"]]


def test_a_fused_op_cuda_leaves_to_the_cpu_is_recorded_and_declined(tmp_path: Path) -> None:
    # CUDA has GroupQueryAttention kernels for float16 and bfloat16 only: a float32 one loads,
    # onnxruntime places it on the CPU provider with copies around it, and a timing would
    # measure the CPU's kernel. tune records the placement as unsupported instead.
    repository = tmp_path / "repository.json"
    entries = _tuned_gqa(FIXTURES / "llama_tiny_ts17.onnx", repository)
    assert entries and all(e["decision"] == UNSUPPORTED for e in entries)
    assert all(e["error"] == NO_KERNEL for e in entries)
    # The placement decides another export of another layout alike: no GroupQueryAttention.
    run = optimize(
        FIXTURES / "llama_tiny_dynamo.onnx", tmp_path, "--providers", "cuda",
        "--repository", repository,
    )  # fmt: skip
    assert run.op_counts()["GroupQueryAttention"] == 0
    reasons = [
        miss["reason"] for entry in run.report["passes"] for miss in entry.get("near_misses", [])
    ]
    assert f"does not run on {CUDA}: {NO_KERNEL}" in reasons


def test_a_fused_op_cuda_refuses_when_it_runs_is_recorded_and_declined(tmp_path: Path) -> None:
    # CUDA's float16 GroupQueryAttention loads and then refuses to run without present_key /
    # present_value outputs, on the inputs the unfused attention computes with: a refusal of
    # the op as written, recorded as such, which declines it in every export.
    repository = tmp_path / "repository.json"
    entries = _tuned_gqa(FIXTURES / "fp16_llama_tiny_dynamo.onnx", repository)
    assert entries and all(e["decision"] == UNSUPPORTED for e in entries)
    assert all(e["error"].endswith(CUDA_GQA_REFUSALS["fp16_llama_tiny_dynamo"]) for e in entries)
    assert all(e["kernel_types"] == ["float16"] for e in entries)


def _cuda_outputs(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs on CUDA in true float32 (TF32 matrix products off: with them on,
    two spellings of one product differ by TF32's rounding, not by the fusion)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        str(model), options, providers=[(CUDA, {"use_tf32": "0"}), "CPUExecutionProvider"]
    )
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


@pytest.mark.parametrize(
    "fixture",
    ["bert_tiny_ts17", "gpt2_tiny_ts17", "llama_tiny_ts17", "llama_tiny_dynamo", "cnn_torchscript"],
)
def test_fused_kernels_agree_with_the_original_on_the_gpu(fixture: str, tmp_path: Path) -> None:
    model = FIXTURES / f"{fixture}.onnx"
    optimized = optimize(model, tmp_path, "--providers", "cuda").output
    feeds = random_feeds(model)  # as assert_same_outputs draws them on CPU
    for expected, got in zip(
        _cuda_outputs(model, feeds), _cuda_outputs(optimized, feeds), strict=True
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
