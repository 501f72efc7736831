"""Test helpers: run fusectl as users do, and compare models on onnxruntime."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from fusectl.cli import cli
from fusectl.diagnostics.inputs import generate_feeds, graph_inputs

# A built-in pass that raises is a bug the suite must see (exit 3), not one fusectl works
# around by optimizing again without the pass, as it does for users (tests/test_pass_errors.py).
os.environ.setdefault("FUSECTL_PASS_ERRORS", "raise")

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLE = Path(__file__).parents[1] / "samples" / "models" / "tiny_cnn.onnx"

# Fused op types per class, whatever their domain (the standard Attention, Gelu,
# RMSNormalization and RotaryEmbedding count like their com.microsoft forms): what
# tests/test_arch_matrix.py and benchmarks/arch_matrix.py count in an optimized model.
FUSED_OP_CLASSES: dict[str, frozenset[str]] = {
    "attention": frozenset({
        "Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
        "PackedMultiHeadAttention", "DecoderMaskedMultiHeadAttention",
        "DecoderMaskedSelfAttention", "PagedAttention", "SparseAttention", "QAttention",
    }),
    "norm": frozenset({
        "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
        "SkipSimplifiedLayerNormalization", "RMSNormalization", "EmbedLayerNormalization",
    }),
    "skip_norm": frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}),
    "gelu": frozenset({
        "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasFastGelu", "BiasSplitGelu",
    }),
    "rotary": frozenset({"RotaryEmbedding"}),
}  # fmt: skip


def fused_op_classes(ops: Counter[str]) -> dict[str, int]:
    """How many fused ops of each FUSED_OP_CLASSES class an op-type count holds."""
    return {cls: sum(ops.get(op, 0) for op in types) for cls, types in FUSED_OP_CLASSES.items()}


class Run:
    """The outcome of one `fusectl optimize` invocation."""

    def __init__(self, result: Any, output: Path, report: Path, fusion_result: Path) -> None:
        self.exit_code: int = result.exit_code
        self.stdout: str = result.stdout
        self.stderr: str = result.stderr
        self.output = output
        self.report = json.loads(report.read_text()) if report.exists() else None
        self.fusion_result_path = fusion_result
        self.fusion_result = (
            json.loads(fusion_result.read_text()) if fusion_result.exists() else None
        )

    def passed(self, name: str) -> dict[str, Any]:
        assert self.report is not None, self.stderr
        return next(p for p in self.report["passes"] if p["name"] == name)

    def counts(self, name: str) -> tuple[int, int]:
        entry = self.passed(name)
        return entry.get("matched", 0), entry.get("effected", 0)

    def op_counts(self) -> Counter[str]:
        return Counter(node.op_type for node in onnx.load(str(self.output)).graph.node)


def run_cli(*args: str | Path) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def optimize(model: Path, tmp_path: Path, *args: str | Path, expect: int = 0) -> Run:
    """`fusectl optimize MODEL -o OUT --report R --fusion_result F [args]` in-process."""
    output = tmp_path / f"{model.stem}_opt.onnx"
    report = tmp_path / f"{model.stem}_report.json"
    fusion_result = tmp_path / f"{model.stem}_fusion_result.json"
    result = run_cli(
        "optimize",
        model,
        "-o",
        output,
        "--report",
        report,
        "--fusion_result",
        fusion_result,
        *args,
    )
    assert result.exit_code == expect, result.stderr + result.stdout
    return Run(result, output, report, fusion_result)


def random_feeds(
    model_path: Path, seed: int = 0, dims: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input; symbolic dimensions take `dims` or 2."""
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else (dims or {}).get(str(d), 2) for d in value.shape]
        if "int" in value.type:
            feeds[value.name] = rng.integers(0, 4, shape).astype(
                np.int64 if "int64" in value.type else np.int32
            )
        else:
            dtypes = {"tensor(float16)": np.float16, "tensor(double)": np.float64}
            feeds[value.name] = rng.normal(size=shape).astype(dtypes.get(value.type, np.float32))
    return feeds


def named_dim_feeds(model_path: Path, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """fusectl's generated feeds (token ids inside the vocabulary, masks) with each symbolic
    axis at its size in `dims`; the last row of every 2-D mask loses its last two positions,
    so that the padding path is compared too (tests/fixtures/make_arch_matrix.py models)."""
    model = ir.load(str(model_path))
    shapes = {
        spec.name: [d if isinstance(d, int) else dims[d] for d in spec.dims or ()]
        for spec in graph_inputs(model)
    }
    feeds, _ = generate_feeds(model, shapes, seed)
    for name, array in feeds.items():
        if "mask" in name and array.ndim == 2:
            array[-1, -2:] = 0
    return feeds


def run_model(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def reference_outputs(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs as onnx defines them (its reference evaluator): for exports onnxruntime
    rejects at some sizes, such as the dynamo exporter's opset-23 RotaryEmbedding above batch 1."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(str(path)).run(None, feeds)


def assert_same_outputs(
    original: Path, optimized: Path, *, atol: float = 1e-4, rtol: float = 1e-3, seed: int = 0
) -> None:
    """Both models give the same outputs on onnxruntime (optimizer off) for seeded inputs."""
    feeds = random_feeds(original, seed)
    expected = run_model(original, feeds)
    actual = run_model(optimized, feeds)
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual, strict=True):
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture
def restore_registry() -> Iterator[None]:
    """Take back every pass a test registers (plugins, API calls): the registry is global."""
    from fusectl.core.plugins import load_builtin_passes
    from fusectl.rewrite.registry import REGISTRY

    load_builtin_passes()
    saved = REGISTRY.snapshot()
    try:
        yield
    finally:
        REGISTRY.restore(saved)


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    """A copy of the shipped sample model in the test's own folder."""
    copy = tmp_path / "tiny_cnn.onnx"
    shutil.copy(SAMPLE, copy)
    return copy


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
