"""LeadingSplitTransposeCanonicalizationPass: a key transposed with its heads folded into the
batch and split afterwards, ``Reshape(Transpose(k [B*N, L, D], [0, 2, 1]), [B, N, D, L])``, is
``Transpose(Reshape(k, [B, N, L, D]), [0, 1, 3, 2])``: transposed heads, as the attention
fusions read a key. SAM's vision attention (transformers 5, dynamo) is spelled so once fusectl
has unfolded its scores: its two attentions fuse (0/2 before; the fixture is in the
architecture matrix, tests/test_arch_matrix.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from tests.conftest import FIXTURES
from tests.pass_helpers import const, optimize_checked, save_model, value

PASS = "LeadingSplitTransposeCanonicalizationPass"
SAM = FIXTURES / "arch" / "sam_vision_dynamo.onnx"


def test_sam_keys_become_transposed_heads_and_the_attention_fuses(tmp_path: Path) -> None:
    run = optimize_checked(SAM, tmp_path)
    assert run.counts(PASS) == (2, 2)
    assert run.counts("MultiHeadAttentionFusionPass") == (2, 2)


def test_without_it_sam_keys_are_not_read_as_heads(tmp_path: Path) -> None:
    run = optimize_checked(SAM, tmp_path, "--disable_pass", PASS)
    assert run.counts("MultiHeadAttentionFusionPass") == (2, 0)
    (miss,) = run.passed("MultiHeadAttentionFusionPass")["near_misses"]
    assert miss["reason"] == (
        "the key is not transposed heads [batch, heads, head size, length] of a tensor"
    )


def _transposed_split(path: Path, target: list[int], perm: list[int]) -> Path:
    """y = Reshape(Transpose(x [6, 5, 4], perm), target) + 1."""
    return save_model(
        path,
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=perm),
            helper.make_node("Reshape", ["t", "target"], ["r"], name="split"),
            helper.make_node("Add", ["r", "one"], ["y"]),
        ],
        [value("x", [6, 5, 4])],
        [value("y", target)],
        [const("target", target, np.int64), const("one", 1.0)],
    )


def test_a_split_of_the_leading_axis_moves_before_the_transpose(tmp_path: Path) -> None:
    model = _transposed_split(tmp_path / "leading.onnx", [2, 3, 4, 5], [0, 2, 1])
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    transpose = next(n for n in graph.node if n.op_type == "Transpose")
    assert list(transpose.attribute[0].ints) == [0, 1, 3, 2]


def test_a_transpose_also_read_elsewhere_is_declined(tmp_path: Path) -> None:
    """Near miss: the transposed value is also a graph output; moving the Transpose would
    lose it (the first version of the pass did, an internal error)."""
    model = _transposed_split(tmp_path / "leading.onnx", [2, 3, 4, 5], [0, 2, 1])
    proto = onnx.load(str(model))
    proto.graph.output.append(helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [6, 4, 5]))
    onnx.save(proto, str(model))
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 0)
    (miss,) = run.passed(PASS)["near_misses"]
    assert miss["reason"] == "the transposed value is also read elsewhere"


def test_other_splits_are_no_candidates(tmp_path: Path) -> None:
    """A split of another axis, or a Transpose that moves the leading axis: the Reshape does
    not commute with it, and nothing is counted."""
    for name, target, perm in (
        ("inner", [6, 2, 2, 5], [0, 2, 1]),  # splits the transposed 4 into 2 x 2
        ("moved", [2, 2, 6, 5], [2, 0, 1]),  # the leading axis is the old last one
    ):
        model = _transposed_split(tmp_path / f"{name}.onnx", target, perm)
        run = optimize_checked(model, tmp_path)
        assert run.counts(PASS) == (0, 0), name
