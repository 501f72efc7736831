"""EinsumMatMulCanonicalizationPass: a two-operand Einsum that is a matrix product becomes
Transpose + MatMul, the form the attention and linear passes read. Equations it must read and
decline, attention written with einsum fused end to end, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from fusectl.passes.einsum import plan
from tests.pass_helpers import (
    compare_on_feeds,
    const,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

EINSUM = "EinsumMatMulCanonicalizationPass"


@pytest.mark.parametrize(
    ("equation", "ranks", "expected"),
    [
        # scores of heads split [B, S, N, H]: q -> [B, N, S, H], k -> [B, N, H, L]
        ("bind,bjnd->bnij", (4, 4), ([0, 2, 1, 3], [0, 2, 3, 1], [0, 1, 2, 3])),
        # the context: probabilities [B, N, S, L] by values [B, L, N, H], back to [B, S, N, H]
        ("bnij,bjnd->bind", (4, 4), ([0, 1, 2, 3], [0, 2, 1, 3], [0, 2, 1, 3])),
        ("bhqd,bhkd->bhqk", (4, 4), ([0, 1, 2, 3], [0, 1, 3, 2], [0, 1, 2, 3])),
        # an ellipsis over two batch axes (LongT5's blocks)
        ("...qhd,...khd->...hqk", (5, 5), ([0, 1, 3, 2, 4], [0, 1, 3, 4, 2], [0, 1, 2, 3, 4])),
        # a linear layer: several free labels of A, none shared
        ("bsd,df->bsf", (3, 2), ([0, 1, 2], [0, 1], [0, 1, 2])),
        ("...d,df->...f", (3, 2), ([0, 1, 2], [0, 1], [0, 1, 2])),
    ],
)
def test_matrix_product_equations(equation: str, ranks: tuple, expected: tuple) -> None:
    found = plan(equation, ranks)
    assert not isinstance(found, str), found
    a_perm, b_perm, _, out_perm = found
    assert (a_perm, b_perm, out_perm) == expected


@pytest.mark.parametrize(
    ("equation", "ranks", "reason"),
    [
        ("ii,ij->j", (2, 2), "a label repeats within a term (a diagonal)"),
        ("bij,bjk", (3, 3), "the equation has no explicit output"),
        ("bij,bkj->b", (3, 3), "a label is summed over in one operand only"),
        ("bij,bjk,bkl->bil", (3, 3, 3), "not two operands"),
        ("bijk,bjkl->bil", (4, 4), "not one matrix product (one contracted label, one free "
         "label of B)"),
        ("...ij,jk->...ik", (None, 2), "an ellipsis over an operand of unknown rank"),
    ],
)  # fmt: skip
def test_other_equations_declined(equation: str, ranks: tuple, reason: str) -> None:
    assert plan(equation, ranks[:2]) == reason


HEADS, HEAD, HIDDEN = 4, 8, 32


def _einsum_attention(path: Path, *, context: str = "bnij,bjnd->bind") -> Path:
    """Self-attention written with einsum on [B, S, N, H] heads, as Funnel writes it."""
    rng = np.random.default_rng(0)
    nodes, initializers = (
        [],
        [
            const("split", [0, 0, HEADS, HEAD], np.int64),
            const("merge", [0, 0, HIDDEN], np.int64),
            const("s", np.array(HEAD**-0.5)),
        ],
    )
    for name in ("Q", "K", "V"):
        initializers.append(const(f"w{name}", rng.normal(size=(HIDDEN, HIDDEN)) * 0.3))
        nodes += [
            helper.make_node("MatMul", ["x", f"w{name}"], [name], name=name),
            helper.make_node("Reshape", [name, "split"], [name.lower()], name=f"{name}_heads"),
        ]
    nodes += [
        helper.make_node("Einsum", ["q", "k"], ["scores"], equation="bind,bjnd->bnij"),
        helper.make_node("Mul", ["scores", "s"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1, name="probs"),
        helper.make_node("Einsum", ["probs", "v"], ["context"], equation=context),
        helper.make_node("Reshape", ["context", "merge"], ["y"]),
    ]
    inputs = [value("x", ["batch", "seq", HIDDEN])]
    return save_model(
        path, nodes, inputs, [value("y", ["batch", "seq", HIDDEN])], initializers, opset=17
    )


def test_einsum_attention_becomes_a_fused_attention(tmp_path: Path) -> None:
    """Both Einsums become MatMuls with the head-split and merge Transposes the attention
    passes read; the attention then fuses (packed QKV: one input feeds the projections)."""
    model = _einsum_attention(tmp_path / "einsum_attention.onnx")
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, EINSUM)["EinsumMatMul"] == (2, 2)
    counts = run.op_counts()
    assert (counts["Einsum"], counts["Softmax"], counts["Attention"]) == (0, 0, 1)
    for batch, seq in [(2, 5), (1, 1)]:
        rng = np.random.default_rng(batch)
        feeds = {"x": rng.normal(size=(batch, seq, HIDDEN)).astype(np.float32)}
        compare_on_feeds(model, run.output, feeds)


def test_einsum_that_is_no_matrix_product_stays(tmp_path: Path) -> None:
    """A context summed over the heads too ('bnij,bjnd->bid') is no MatMul: the Einsum stays,
    said why, and the attention around it is reported, not silently skipped."""
    model = _einsum_attention(tmp_path / "summed.onnx", context="bnij,bjnd->bind")
    graph = onnx.load(str(model))
    graph.graph.node[-2].attribute[0].s = b"bnij,bjnd->bid"
    graph.graph.node[-1].input[1] = "flat"
    graph.graph.initializer.append(const("flat", [0, 0, HEAD], np.int64))
    del graph.graph.output[:]
    graph.graph.output.append(value("y", ["batch", "seq", HEAD]))
    onnx.save(graph, str(model))
    run = optimize_checked(model, tmp_path)
    assert reasons(run, EINSUM) == {
        "not one matrix product (one contracted label, one free label of B)": 1
    }
    assert run.op_counts()["Einsum"] == 1
    assert run.report["coverage"]["attention"]["total"] == 1
