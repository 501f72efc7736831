"""The architecture matrix: every committed export of tests/fixtures/arch optimized as users run it.

The fixtures (``make_arch_matrix.py --fixtures``; the whole matrix, more architectures, goes to a
cache for benchmarks/arch_matrix.py) are tiny transformers of many families, each exported by
TorchScript (opset 17) and dynamo (opset 18). Per fixture:

* the output passes the full checker and matches the original on onnxruntime within the
  tolerance of the loosest numerics class among the passes that fired (fusectl.verify);
* ``--target onnx`` leaves only standard-domain ops;
* fusectl's fused ops per class are exactly TODAY's (a change, better or worse, shows up here);
* each class reaches its TARGET: one fused op per place PyTorch computes one (the manifest's
  counts of attention, norm, GELU / SiLU module calls; rotary: query and key of every attention
  of a rotary model). Targets not reached yet are strict xfails whose reason is fusectl's
  near-miss for that class: once reached they fail, and the row gets updated.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fusectl.verify import default_tolerance
from tests.conftest import FIXTURES, Run, fused_op_classes, named_dim_feeds, optimize, run_model

ARCH = FIXTURES / "arch"
MANIFEST = json.loads((ARCH / "manifest.json").read_text())
ENTRIES = {Path(entry["file"]).stem: entry for entry in MANIFEST["models"]}
CLASSES = ("attention", "norm", "skip_norm", "gelu", "rotary")
TARGETED = ("attention", "norm", "gelu", "rotary")  # skip norms: PyTorch does not say where

# fixture: (today, target), each per class (attention, norm, skip norm, GELU-class, rotary);
# the target has no skip-norm figure (None).
ROWS: dict[str, tuple[tuple[int, ...], tuple[int | None, ...]]] = {
}

# (fixture, class) below target today: fusectl's near-miss for that class, first reason.
WHY: dict[tuple[str, str], str] = {
}


def _target_params() -> list:
    params = []
    for name, (today, target) in sorted(ROWS.items()):
        for cls in TARGETED:
            index = CLASSES.index(cls)
            below = today[index] < (target[index] or 0)
            marks = [pytest.mark.xfail(strict=True, reason=WHY[name, cls])] if below else []
            params.append(pytest.param(name, cls, marks=marks, id=f"{name}-{cls}"))
    return params


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """The default optimization of each fixture, run once for all the checks on it."""
    runs: dict[str, Run] = {}

    def run(name: str) -> Run:
        if name not in runs:
            runs[name] = optimize(ARCH / f"{name}.onnx", tmp_path_factory.mktemp(name))
        return runs[name]

    return run


def counts(run: Run) -> tuple[int, ...]:
    found = fused_op_classes(Counter(n.op_type for n in onnx.load(str(run.output)).graph.node))
    return tuple(found[cls] for cls in CLASSES)


def test_rows_cover_every_fixture() -> None:
    assert set(ROWS) == set(ENTRIES) == {path.stem for path in ARCH.glob("*.onnx")}


def test_targets_are_what_pytorch_computes() -> None:
    """The TARGET column is the manifest's count of what the model computes."""
    for name, (_, target) in ROWS.items():
        expected = ENTRIES[name]["expected"]
        gelu = expected["gelu"] + expected["silu"]
        want = (expected["attention"], expected["norm"], None, gelu, expected["rotary"])
        assert target == want, name


@pytest.mark.parametrize("name", sorted(ROWS))
def test_valid_equal_and_fused_as_today(name: str, optimized: Callable[[str], Run]) -> None:
    run = optimized(name)
    onnx.checker.check_model(onnx.load(str(run.output)), full_check=True)
    original = ARCH / f"{name}.onnx"
    feeds = named_dim_feeds(original, MANIFEST["dims"])
    tolerance = default_tolerance(ir.load(str(run.output)))
    want, got = run_model(original, feeds), run_model(run.output, feeds)
    assert len(got) == len(want)
    for expected, actual in zip(want, got, strict=True):
        np.testing.assert_allclose(actual, expected, atol=tolerance.atol, rtol=tolerance.rtol)
    assert counts(run) == ROWS[name][0]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_target_onnx_has_only_standard_ops(name: str, tmp_path: Path) -> None:
    run = optimize(ARCH / f"{name}.onnx", tmp_path, "--target", "onnx")
    model = onnx.load(str(run.output))
    onnx.checker.check_model(model, full_check=True)
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}
    assert {opset.domain for opset in model.opset_import} <= {"", "ai.onnx"}


@pytest.mark.parametrize(("name", "cls"), _target_params())
def test_fused_in_every_place(name: str, cls: str, optimized: Callable[[str], Run]) -> None:
    index = CLASSES.index(cls)
    assert counts(optimized(name))[index] == ROWS[name][1][index]
