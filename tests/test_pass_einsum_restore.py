"""EinsumRestorationPass: the Transposes and MatMul the Einsum canonicalization wrote for an
Einsum no fusion took become that Einsum again; TransposeEinsumFusionPass: an Einsum reads a
Transpose's input with its labels permuted back. XLNet's relative attention (TorchScript),
Funnel's einsum attention (fused, so nothing is restored), the equation read back from the
perms checked against numpy, the Transposes that must stay, and numerics on onnxruntime."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from fusectl.passes.einsum import plan
from fusectl.passes.einsum_restore import equation
from tests.pass_helpers import (
    ARCH_FIXTURES,
    compare_on_feeds,
    const,
    optimize_checked,
    pattern_counts,
    save_model,
    value,
)

RESTORE = "EinsumRestorationPass"
TRANSPOSE = "TransposeEinsumFusionPass"


def _einsums(path: Path) -> Counter[str]:
    graph = onnx.load(str(path)).graph
    return Counter(
        attribute.s.decode()
        for node in graph.node
        if node.op_type == "Einsum"
        for attribute in node.attribute
        if attribute.name == "equation"
    )


def test_xlnet_position_einsums_come_back(tmp_path: Path) -> None:
    """XLNet's scores (ibnd,jbnd->bnij: content and position) and context (bnij,jbnd->ibnd)
    einsums are canonicalized. The attention takes the content scores and the context; the
    position term, added before the scale, is its bias, and each layer's comes back as one
    Einsum. The output projection reads the fused output through its own equation: the
    Transpose back to sequence-first is absorbed (TransposeEinsumFusionPass)."""
    source = ARCH_FIXTURES / "xlnet_ts17.onnx"
    run = optimize_checked(source, tmp_path)
    assert pattern_counts(run, RESTORE) == {"EinsumRestoration": (2, 2)}
    assert pattern_counts(run, TRANSPOSE) == {"TransposeEinsum": (2, 2)}
    assert _einsums(run.output) == {
        "ibh,hnd->ibnd": 8,  # the projections, never canonicalized
        "cabd,eabd->abce": 2,  # the position term, restored
        "bind,hnd->ibh": 2,  # the output projection, reading [B, S, N, H]
        "ijbn->bnij": 1,  # the mask's layout
    }
    assert run.op_counts()["MatMul"] == 4  # the feed-forward layers', never einsums


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


def _transposed_einsum(path: Path, shared: bool = False, both: bool = False) -> Path:
    """y = Einsum("bind,hnd->ibh", Transpose(x, [1, 0, 2, 3]), w), x [S, B, N, H]; ``shared``
    also outputs the Transpose; ``both`` reads w as Transpose(v, [2, 1, 0]) too."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2, 3]),
        helper.make_node("Einsum", ["t", "w"], ["y"], equation="bind,hnd->ibh"),
    ]
    outputs = [value("y", ["S", "B", 6])]
    outputs += [value("t", ["B", "S", 2, 4])] if shared else []
    weights = [const("w", rng.normal(size=(6, 2, 4)))]
    if both:
        nodes.insert(0, helper.make_node("Transpose", ["v"], ["w"], perm=[2, 1, 0]))
        weights = [const("v", rng.normal(size=(4, 2, 6)))]
    return save_model(path, nodes, [value("x", ["S", "B", 2, 4])], outputs, weights)


@pytest.mark.parametrize("both", [False, True], ids=["one", "both"])
def test_transpose_read_by_an_einsum_is_absorbed(tmp_path: Path, both: bool) -> None:
    """Each operand's Transpose in one run (a second run finds none left)."""
    model = _transposed_einsum(tmp_path / "transposed.onnx", both=both)
    run = optimize_checked(model, tmp_path, "--disable_pass", "ConstantFoldingPass", compare=False)
    count = 2 if both else 1
    assert pattern_counts(run, TRANSPOSE) == {"TransposeEinsum": (count, count)}
    assert _einsums(run.output) == {"ibnd,dnh->ibh" if both else "ibnd,hnd->ibh": 1}
    assert "Transpose" not in run.op_counts()
    feeds = {"x": np.random.default_rng(1).normal(size=(3, 2, 2, 4)).astype(np.float32)}
    compare_on_feeds(model, run.output, feeds)


def test_transpose_read_elsewhere_stays(tmp_path: Path) -> None:
    run = optimize_checked(_transposed_einsum(tmp_path / "shared.onnx", shared=True), tmp_path)
    assert run.counts(TRANSPOSE) == (0, 0)
    assert run.op_counts()["Transpose"] == 1
