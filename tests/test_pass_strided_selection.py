"""StridedSelectionCanonicalizationPass: position k of the last axis of a view that splits x's
last axis into [L/m, m] is x[..., k::m], written as that Slice. The complex-pair rotary of
llama2.c and torchtune and rotary-embedding-torch's rotate_half of pairs under both exporters
(then fused by the rotary pass), the three
spellings of the selection, the near misses it declines with their reasons, and numerics on
onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tests.pass_helpers import (
    assert_declined,
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

STRIDED = "StridedSelectionCanonicalizationPass"
ROTARY = "RotaryEmbeddingFusionPass"
# The cos / sin cache torchtune holds as pairs, [S, H/2, 2], viewed as [1, S, 1, H/2, 2]: two
# axes added, so no split of a last axis (its [..., 0] stays a Gather).
CACHE_VIEW = "the view does not add one axis to its data"


@pytest.mark.parametrize(
    ("model", "declined"),
    [
        ("llama2c_ts17", 0),
        ("llama2c_dynamo", 0),
        ("torchtune_ts17", 8),
        ("torchtune_dynamo", 2),
        ("lucidrains_ts17", 0),  # rotate_half of pairs: GPT-J's rotate_every_two once sliced
        ("lucidrains_dynamo", 0),
        # Through onnx-simplifier (tests/fixtures/make_preprocessed_fixtures.py): one part of
        # each pair (a Split part, a Slice of one) is read with its axis of one; the rotary
        # fused none before.
        ("preprocessed/lucidrains_ts17_onnxsim", 0),
        ("preprocessed/lucidrains_dynamo_onnxsim", 0),
    ],
)
def test_complex_pair_rotary_is_fused_in_every_layer(
    tmp_path: Path, model: str, declined: int
) -> None:
    """q and k of both layers: the two parts of each pair are strided Slices, and the four
    rotations are RotaryEmbedding (interleaved), whichever way the model then rotates them."""
    run = optimize_checked(fixture_path(model), tmp_path)
    assert pattern_counts(run, STRIDED) == {"StridedSelection": (8 + declined, 8)}
    assert reasons(run, STRIDED) == ({CACHE_VIEW: declined} if declined else {})
    assert run.counts(ROTARY) == (4, 4)
    assert run.report["coverage"]["rotary"] == {"fused": 4, "total": 4, "unfused": []}
    assert run.op_counts()["RotaryEmbedding"] == 4


def test_without_the_pass_the_rotary_stays_written_out_and_counted(tmp_path: Path) -> None:
    """The coverage line counts the complex-pair rotations (Concat of the stacked a*c - b*s
    and a*s + b*c) whether or not they are fused: before the pass, they were not even counted."""
    run = optimize_checked(fixture_path("llama2c_dynamo"), tmp_path, "--disable_pass", STRIDED)
    assert run.counts(ROTARY) == (0, 0)
    assert run.op_counts()["RotaryEmbedding"] == 0
    rotary = run.report["coverage"]["rotary"]
    assert (rotary["fused"], rotary["total"], len(rotary["unfused"])) == (0, 4, 4)


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("llama2c_ts17"), tmp_path)
    assert_second_run_changes_nothing(run, tmp_path, STRIDED)


ROWS, HEADS, SIZE = 3, 2, 8


def _model(
    path: Path, select: str, *, view: tuple[int, ...] = (ROWS, HEADS, SIZE // 2, 2), opset: int = 17
) -> Path:
    """x [2, 3, 2, 8] viewed as [2, *view], its last axis position 0 and 1 taken by
    ``select`` (gather, slice, split), each scaled so the two parts differ: out = 2 a + b."""
    nodes = [helper.make_node("Reshape", ["x", "view"], ["pairs"])]
    if select == "gather":
        nodes += [
            helper.make_node("Gather", ["pairs", "zero"], ["a"], axis=-1),
            helper.make_node("Gather", ["pairs", "one"], ["b"], axis=-1),
        ]
    elif select == "slice":
        nodes += [
            helper.make_node("Slice", ["pairs", "zeros", "ones", "last"], ["a1"]),
            helper.make_node("Slice", ["pairs", "ones", "twos", "last"], ["b1"]),
            helper.make_node("Squeeze", ["a1", "last"], ["a"]),
            helper.make_node("Squeeze", ["b1", "last"], ["b"]),
        ]
    else:
        nodes += [
            helper.make_node("Split", ["pairs", "split"], ["a1", "b1"], axis=-1),
            helper.make_node("Squeeze", ["a1", "last"], ["a"]),
            helper.make_node("Squeeze", ["b1", "last"], ["b"]),
        ]
    nodes += [
        helper.make_node("Mul", ["a", "two"], ["doubled"]),
        helper.make_node("Add", ["doubled", "b"], ["out"]),
    ]
    initializers = [
        const("view", [0, *view], np.int64),
        const("zero", np.array(0), np.int64),
        const("one", np.array(1), np.int64),
        const("zeros", [0], np.int64),
        const("ones", [1], np.int64),
        const("twos", [2], np.int64),
        const("split", [1, 1], np.int64),
        const("last", [-1], np.int64),
        const("two", np.array(2.0)),
    ]
    return save_model(
        path,
        nodes,
        [value("x", ["batch", ROWS, HEADS, SIZE])],
        [value("out", [None] * len(view))],
        initializers,
        opset=opset,
    )


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).normal(size=(2, ROWS, HEADS, SIZE)).astype(np.float32)}


@pytest.mark.parametrize("select", ["gather", "slice", "split"])
def test_every_spelling_of_the_selection_is_a_strided_slice(tmp_path: Path, select: str) -> None:
    model = _model(tmp_path / f"{select}.onnx", select)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, STRIDED) == {"StridedSelection": (2, 2)}
    counts = run.op_counts()
    assert (counts["Slice"], counts["Reshape"], counts["Squeeze"], counts["Gather"]) == (2, 0, 0, 0)
    compare_on_feeds(model, run.output, _feeds())


def _kept_part_model(path: Path, *, read_both: bool = False, sliced: bool = False) -> Path:
    """x [batch, 3, 2, 8] viewed as pairs and split (``sliced``: two Slices of one); the
    rotated pair stacked back as onnx-simplifier leaves it: Concat(Unsqueeze(-b), a) on the
    last axis, the part a read with its axis of one (no Squeeze -> Unsqueeze). ``read_both``:
    b's part is read unsqueezed too."""
    if sliced:
        parts = [
            helper.make_node("Slice", ["pairs", "zeros", "ones", "last"], ["a1"]),
            helper.make_node("Slice", ["pairs", "ones", "twos", "last"], ["b1"]),
        ]
    else:
        parts = [helper.make_node("Split", ["pairs", "split"], ["a1", "b1"], axis=-1)]
    nodes = [
        helper.make_node("Reshape", ["x", "view"], ["pairs"]),
        *parts,
        helper.make_node("Squeeze", ["b1", "last"], ["b"]),
        helper.make_node("Neg", ["b"], ["minus_b"]),
        helper.make_node("Unsqueeze", ["minus_b", "last"], ["minus_b1"]),
        helper.make_node("Concat", ["minus_b1", "a1"], ["rotated"], axis=-1),
    ]
    if read_both:
        nodes.append(helper.make_node("Add", ["rotated", "b1"], ["out"]))
    else:
        nodes.append(helper.make_node("Identity", ["rotated"], ["out"]))
    initializers = [
        const("view", [0, ROWS, HEADS, SIZE // 2, 2], np.int64),
        const("split", [1, 1], np.int64),
        const("last", [-1], np.int64),
        const("zeros", [0], np.int64),
        const("ones", [1], np.int64),
        const("twos", [2], np.int64),
    ]
    return save_model(
        path,
        nodes,
        [value("x", ["batch", ROWS, HEADS, SIZE])],
        [value("out", ["batch", ROWS, HEADS, SIZE // 2, 2])],
        initializers,
    )


@pytest.mark.parametrize("sliced", [False, True], ids=["split", "slice"])
def test_a_part_kept_with_its_axis_of_one_is_an_unsqueezed_strided_slice(
    tmp_path: Path, sliced: bool
) -> None:
    """onnx-simplifier takes away the Squeeze -> Unsqueeze between a Split part (TorchScript's
    unbind) or a Slice of one (dynamo's) and the stack of the rotated pair (lucidrains'
    decoder fused no rotary after it): the kept part is Unsqueeze(x[..., 0::2], -1), and the
    view and the Split go."""
    model = _kept_part_model(tmp_path / "kept.onnx", sliced=sliced)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, STRIDED) == {"StridedSelection": (2, 2)}
    counts = run.op_counts()
    assert (counts["Slice"], counts.get("Split", 0), counts.get("Reshape", 0)) == (2, 0, 0)
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize("sliced", [False, True], ids=["split", "slice"])
def test_a_kept_part_beside_another_part_still_read_stays(tmp_path: Path, sliced: bool) -> None:
    """Both parts are read with their axis of one: rewriting one would leave the view (and
    the Split) for the other, and add nodes."""
    model = _kept_part_model(tmp_path / "both.onnx", read_both=True, sliced=sliced)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, STRIDED) == {"StridedSelection": (1, 1)}
    counts = run.op_counts()
    # The view stays for the parts read with their axis of one (the stacked part, and the
    # other part by the Add); the squeezed read of the other part is the one strided Slice.
    parts = (0, 3) if sliced else (1, 1)
    assert (counts["Reshape"], counts["Split"], counts["Slice"]) == (1, *parts)
    compare_on_feeds(model, run.output, _feeds())


def test_a_view_that_moves_the_leading_sizes_stays(tmp_path: Path) -> None:
    """[2, 3, 2, 8] viewed as [2, 2, 3, 4, 2]: the element count is kept and the last axis is
    split, but rows and heads trade places, so a position of the pairs is no Slice of x."""
    model = _model(tmp_path / "moved.onnx", "gather", view=(HEADS, ROWS, SIZE // 2, 2))
    run = optimize_checked(model, tmp_path)
    reason = "the view does not provably keep the data's leading axes"
    assert_declined(run, STRIDED, reason, "a", count=2)


def test_a_view_whose_last_axes_are_not_the_split_last_axis_stays(tmp_path: Path) -> None:
    """[2, 3, 2, 8] viewed as [2, 3, 1, 4, 4]: one axis added, but the last two are 16
    elements, not x's last axis of 8 taken apart."""
    model = _model(tmp_path / "regrouped.onnx", "gather", view=(ROWS, 1, 4, 4))
    run = optimize_checked(model, tmp_path)
    reason = "the view does not split the data's last axis (sizes unknown or other)"
    assert_declined(run, STRIDED, reason, "a", count=2)


def test_a_view_that_splits_the_last_axis_twice_is_written_as_the_two_views(
    tmp_path: Path,
) -> None:
    """[..., 8] viewed as [..., 2, 2, 2] (onnx-simplifier merges the view of the heads and
    the view of their pairs so): the view is [..., 2, 4] then the pairs, and a position of the
    pairs is a strided Slice of [..., 2, 4]. The merged view goes."""
    model = _model(tmp_path / "deeper.onnx", "gather", view=(ROWS, HEADS, 2, 2, 2))
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, STRIDED) == {
        "StridedSelection": (2, 2),
        "MergedViewSplit": (1, 1),
    }
    counts = run.op_counts()
    assert (counts["Slice"], counts["Reshape"], counts["Gather"]) == (2, 1, 0)
    compare_on_feeds(model, run.output, _feeds())


def test_a_merged_view_that_moves_the_leading_sizes_stays(tmp_path: Path) -> None:
    """[2, 3, 2, 8] viewed as [2, 2, 3, 2, 2, 2]: the last axis is split twice, but rows and
    heads trade places, so it is no view of x's heads: neither split nor selected."""
    model = _model(tmp_path / "moved.onnx", "gather", view=(HEADS, ROWS, 2, 2, 2))
    run = optimize_checked(model, tmp_path)
    assert_declined(run, STRIDED, CACHE_VIEW, "a", count=2)
    assert run.op_counts()["Gather"] == 2


def test_onnx_simplifier_merged_views_of_heads_and_pairs(tmp_path: Path) -> None:
    """llama2.c's decoder (dynamo) through onnx-simplifier (tests/fixtures/
    make_preprocessed_fixtures.py): q and k are viewed [B, L, 64] -> [B, L, 4, 8, 2] in one
    Reshape. Each is written as the export's two views, and the rotary fuses 4/4 (none
    before), with the nodes the export's own output has."""
    run = optimize_checked(fixture_path("preprocessed/llama2c_dynamo_onnxsim"), tmp_path)
    assert pattern_counts(run, STRIDED) == {
        "StridedSelection": (8, 8),
        "MergedViewSplit": (4, 4),
    }
    assert run.report["coverage"]["rotary"] == {"fused": 4, "total": 4, "unfused": []}
    assert run.op_counts()["RotaryEmbedding"] == 4
    (tmp_path / "export").mkdir()
    export = optimize_checked(fixture_path("llama2c_dynamo"), tmp_path / "export")
    assert sum(run.op_counts().values()) == sum(export.op_counts().values())
    assert_second_run_changes_nothing(run, tmp_path, STRIDED)


def test_below_opset_10_the_selection_stays(tmp_path: Path) -> None:
    """A Slice takes steps from opset 10; the Gathers of an opset 9 model stay, with the reason."""
    model = _model(tmp_path / "old.onnx", "gather", opset=9)
    run = optimize_checked(model, tmp_path)
    reason = "a strided Slice needs opset >= 10, model has 9"
    assert_declined(run, STRIDED, reason, "a", count=2)


def test_one_position_of_a_scalar_viewed_as_one_element_stays(tmp_path: Path) -> None:
    """JetMoE's dynamo export reads a scalar back through ``Reshape(s, [1])`` and Gather 0: the
    view adds one axis, but the scalar has no last axis that the view splits."""
    nodes = [
        helper.make_node("Reshape", ["s", "one_axis"], ["viewed"]),
        helper.make_node("Gather", ["viewed", "zero"], ["item"], axis=0),
        helper.make_node("Mul", ["item", "x"], ["out"]),
    ]
    initializers = [const("one_axis", [1], np.int64), const("zero", np.array(0), np.int64)]
    model = save_model(
        tmp_path / "scalar.onnx",
        nodes,
        [value("s", []), value("x", [2, 3])],
        [value("out", [2, 3])],
        initializers,
    )
    run = optimize_checked(model, tmp_path)
    reason = "the data is a scalar: it has no last axis to split"
    assert_declined(run, STRIDED, reason, "item", count=1)
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    feeds = {"s": np.array(1.5, dtype=np.float32), "x": x}
    compare_on_feeds(model, run.output, feeds)
