"""EinsumRestorationPass: the Transposes and MatMul the Einsum canonicalization wrote for an
Einsum no fusion took become that Einsum again. XLNet's relative attention (TorchScript),
Funnel's einsum attention (fused, so nothing is restored), the equation read back from the
perms checked against numpy, and numerics on onnxruntime."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusectl.passes.einsum import plan
from fusectl.passes.einsum_restore import equation
from tests.pass_helpers import ARCH_FIXTURES, optimize_checked, pattern_counts

RESTORE = "EinsumRestorationPass"


def _einsums(path: Path) -> Counter[str]:
    graph = onnx.load(str(path)).graph
    return Counter(
        attribute.s.decode()
        for node in graph.node
        if node.op_type == "Einsum"
        for attribute in node.attribute
        if attribute.name == "equation"
    )


def test_xlnet_attention_einsums_come_back(tmp_path: Path) -> None:
    """XLNet's scores (ibnd,jbnd->bnij, twice) and context (bnij,jbnd->ibnd) einsums are
    canonicalized, the attention around them does not fuse (the scale follows the position
    term), and each comes back as one Einsum: the same products, relabelled."""
    source = ARCH_FIXTURES / "xlnet_ts17.onnx"
    run = optimize_checked(source, tmp_path)
    assert pattern_counts(run, RESTORE) == {"EinsumRestoration": (6, 6)}
    before, after = _einsums(source), _einsums(run.output)
    assert sum(after.values()) == sum(before.values()) == 17
    ops = run.op_counts()
    assert ops["MatMul"] == 4  # the feed-forward layers', never einsums
    assert ops["Transpose"] == 3  # the model's own: none of the canonicalization's is left


@pytest.mark.parametrize("model", ["funnel_ts17", "funnel_dynamo"])
def test_einsums_the_attention_took_stay_taken(tmp_path: Path, model: str) -> None:
    """Funnel's attention einsums are fused: nothing is left to restore. (Its numerics need
    token ids inside its tables: tests/test_arch_matrix.py compares them.)"""
    run = optimize_checked(ARCH_FIXTURES / f"{model}.onnx", tmp_path, compare=False)
    assert run.counts(RESTORE) == (0, 0)
    assert run.op_counts()["Einsum"] == _einsums(ARCH_FIXTURES / f"{model}.onnx").total() - 4


@pytest.mark.parametrize(
    "written",
    ["ibnd,jbnd->bnij", "bnij,jbnd->ibnd", "bind,bjnd->bnij", "bsd,df->bsf", "abc,acd->abd"],
)
def test_the_equation_read_back_computes_the_same(written: str) -> None:
    """plan() is how the canonicalization writes an Einsum; equation() reads its layouts
    back: both Einsums give one result on the same operands."""
    terms = written.split("->")[0].split(",")
    sizes = {label: size for size, label in enumerate("abcdfijnsx", start=2)}
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=[sizes[c] for c in term]) for term in terms)
    a_perm, b_perm, _, out_perm = plan(written, (a.ndim, b.ndim))
    formula = equation(a.ndim, b.ndim, a_perm, b_perm, out_perm)
    np.testing.assert_allclose(np.einsum(formula, a, b), np.einsum(written, a, b), rtol=1e-12)
