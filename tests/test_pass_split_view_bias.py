"""SplitViewBiasCanonicalizationPass: Swin's shifted-window mask, added per group of windows in a
5-D view of the scores and viewed back, becomes a bias on the scores themselves, so the
attention fusions take it (torchvision's and timm's Swin-T: 7 of 12 attentions fused before,
12 now, under either exporter); so do ViTDet's decomposed relative positions (0/2 -> 2/2),
also where TorchScript computes the folded batch of heads at run time.

Fixtures: tests/fixtures/make_fixtures.py build_window_mask (ShiftedWindowAttention, the
torchvision / timm spelling, static sizes as both exporters write them by default) and
build_relative_position (ViTDet's attention, batch dynamic).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from fusectl.passes.split_view_bias import _runs
from tests.conftest import random_feeds, run_model
from tests.pass_helpers import fixture_path, optimize_checked

PASS = "SplitViewBiasCanonicalizationPass"
BATCH = (1, ("batch",))  # sizes as products of named dimensions (sizes.Size)
# Per exporter: nodes left. The window attention's QKV projection, viewed [B, L, 3, N, H] and
# cut into query, key and value (ProjectionPieceCanonicalizationPass), is three projections
# the packed Attention op takes with its weights: the whole block is three nodes.
EXPECTED = {"ts17": 3, "dynamo": 3}


@pytest.mark.parametrize("exporter", sorted(EXPECTED))
def test_the_window_mask_becomes_a_bias_and_the_attention_fuses(
    exporter: str, tmp_path: Path
) -> None:
    run = optimize_checked(fixture_path(f"window_mask_{exporter}"), tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.passed(PASS)["near_misses"] == []
    assert run.counts("QkvAttentionFusionPass") == (1, 1)
    ops = run.op_counts()
    assert ops["Attention"] == 1 and "Softmax" not in ops
    assert sum(ops.values()) == EXPECTED[exporter]
    # The mask [4, 16, 16] varies along the window axis, which merges with the batch of
    # windows: it is expanded there (to 2 x 4) and broadcast over the heads.
    graph = onnx.load(str(run.output)).graph
    expand = [n for n in graph.node if n.op_type == "Expand"]
    assert len(expand) <= 1  # folded into the bias where the mask is a constant


def test_without_the_pass_the_attention_stays_written_out(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("window_mask_dynamo"), tmp_path, "--disable_pass", PASS)
    assert run.counts("MultiHeadAttentionFusionPass") == (1, 0)
    (miss,) = run.passed("MultiHeadAttentionFusionPass")["near_misses"]
    assert miss["reason"] == (
        "the scores are not MatMul(query, key^T) with additive biases and a constant scale "
        "(they come from Reshape)"
    )
    assert "Softmax" in run.op_counts()


def test_a_sum_read_elsewhere_is_declined(tmp_path: Path) -> None:
    """Near miss: the 5-D sum is also a graph output; removing the view would lose it."""
    model = onnx.load(str(fixture_path("window_mask_ts17")))
    graph = model.graph
    add = next(n for n in graph.node if n.op_type == "Add" and any("Reshape" in i for i in n.input))
    graph.output.append(helper.make_tensor_value_info(add.output[0], onnx.TensorProto.FLOAT, None))
    edited = tmp_path / "window_mask_sum_out.onnx"
    onnx.save(model, str(edited))
    run = optimize_checked(edited, tmp_path)
    assert run.counts(PASS) == (1, 0)
    (miss,) = run.passed(PASS)["near_misses"]
    assert miss["reason"] == "the view or a partial sum is also read elsewhere"
    assert run.counts("MultiHeadAttentionFusionPass") == (1, 0)


def test_a_summand_of_the_views_own_shape_is_no_candidate(tmp_path: Path) -> None:
    """Nothing broadcast, nothing to canonicalize: a residual added in a view (Swin's
    ``x.view(B, H * W, C) + shortcut``) stays where it is, in the 3-D view the skip norms
    read, and is not counted."""
    model = onnx.load(str(fixture_path("window_mask_ts17")))
    graph = model.graph
    add = next(n for n in graph.node if n.op_type == "Add" and any("Reshape" in i for i in n.input))
    full = np.random.default_rng(0).standard_normal((2, 4, 2, 16, 16)).astype(np.float32)
    graph.initializer.append(onnx.numpy_helper.from_array(full, "full_bias"))
    add.input[next(i for i, name in enumerate(add.input) if "Reshape" not in name)] = "full_bias"
    edited = tmp_path / "window_mask_full.onnx"
    onnx.save(model, str(edited))
    run = optimize_checked(edited, tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert run.counts("MultiHeadAttentionFusionPass") == (1, 0)


def test_decomposed_relative_positions_become_biases_of_a_dynamic_batch(tmp_path: Path) -> None:
    """ViTDet's two biases, ``rel_h[..., None]`` and ``rel_w[..., None, :]``, each added in the
    [B*N, qh, qw, kh, kw] view: each is expanded along the key axis it lacks (that axis merges
    with the other into the key length) and viewed as [B*N, S, S], the batch of heads read
    from the bias itself (-1); the attention then fuses. Compared at batches 1 and 3."""
    model = fixture_path("relative_position_dynamo")
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (1, 1)
    assert run.counts("MultiHeadAttentionFusionPass") == (1, 1)
    graph = onnx.load(str(run.output)).graph
    constants = {
        t.name.rsplit("/", 1)[-1]: onnx.numpy_helper.to_array(t).tolist()
        for t in graph.initializer
        if t.name.rsplit("/", 1)[-1].startswith(("expanded", "merged"))
    }
    assert constants == {
        "expanded_0": [1, 1, 1, 1, 4],
        "merged_0": [-1, 16, 16],
        "expanded_1": [1, 1, 1, 4, 1],
        "merged_1": [-1, 16, 16],
    }
    for batch in (1, 3):
        feeds = random_feeds(model, dims={"batch": batch})
        for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_relative_positions_of_heads_folded_at_run_time(tmp_path: Path) -> None:
    """ViTDet's TorchScript export folds the heads into the batch with sizes multiplied at run
    time (``reshape(3, B*N, H*W, -1)``): inference names neither the batch of heads nor the
    head size. The batch of heads traced as a product (4·batch) on the scores, the view and
    both biases, each bias is viewed as the scores (ViTDet 0/2 -> 2/2 attentions); the head
    size is counted from those products too. Compared at batches 1 and 3."""
    model = fixture_path("arch/vitdet_ts17")
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (2, 2)
    assert run.passed(PASS)["near_misses"] == []
    assert run.counts("MultiHeadAttentionFusionPass") == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    for batch in (1, 3):
        feeds = random_feeds(model, dims={"batch": batch})
        for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("view", "shape", "runs"),
    [
        ([2, 4, 2, 16, 16], [8, 2, 16, 16], [[0, 1], [2], [3], [4]]),
        ([1, 8, 2, 16, 16], [8, 2, 16, 16], [[0, 1], [2], [3], [4]]),
        ([8, 2, 4, 4, 1], [8, 2, 16], [[0], [1], [2, 3, 4]]),
        ([16, 16, 16], [8, 2, 16, 16], None),  # 16 is no run of 8
        ([2, 4, 3], [8, 2], None),  # 3 left over
        ([BATCH, 4, 4, 4, 4], [BATCH, 16, 16], [[0], [1, 2], [3, 4]]),
        ([BATCH, 4, 4], [(1, ("other",)), 16], None),  # another name
        ([(4, ("batch",)), 4, 4], [(4, ("batch",)), 16], [[0], [1, 2]]),  # heads in the batch
        ([(4, ("batch",)), 4, 4], [(2, ("batch",)), 32], None),  # another product
    ],
)
def test_runs_of_view_axes(view: list, shape: list, runs: list[list[int]] | None) -> None:
    assert _runs(view, shape) == runs
