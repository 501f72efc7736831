"""TileExpandCanonicalizationPass: a Tile that repeats only axes of size 1 is an Expand.
gemma_pytorch's ``repeat_interleave`` of key/value heads under TorchScript (then
GroupQueryAttention), the Tiles that are no broadcast, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tests.pass_helpers import (
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    save_model,
    value,
)

TILE = "TileExpandCanonicalizationPass"
GQA = "GroupQueryAttentionFusionPass"


@pytest.mark.parametrize(("exporter", "tiles", "nodes"), [("ts17", 4, 59), ("dynamo", 0, 45)])
def test_gemma_pytorch_repeat_interleave_is_grouped_attention(
    tmp_path: Path, exporter: str, tiles: int, nodes: int
) -> None:
    """gemma_pytorch repeats key and value heads with ``repeat_interleave(k, 2, dim=2)`` on
    [B, L, KV, H]: TorchScript tiles an Unsqueeze'd unit axis, dynamo expands it. As an
    Expand, the repeat moves behind the head transpose and GroupQueryAttention takes both
    layers under both exporters (0/2 under TorchScript before)."""
    run = optimize_checked(fixture_path(f"gemmapt_{exporter}"), tmp_path)
    assert run.counts(TILE) == (tiles, tiles)
    assert run.counts(GQA) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    assert run.op_counts()["Tile"] == 0
    assert run.report["model"]["after"]["nodes"] == nodes


def test_without_the_pass_the_torchscript_attention_stays(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("gemmapt_ts17"), tmp_path, "--disable_pass", TILE)
    unfused = run.report["coverage"]["attention"]["unfused"]
    assert len(unfused) == 2
    assert all(
        "MultiHeadAttentionFusionPass: a Q/K/V projection is not 3-D" in site["reason"]
        for site in unfused
    )


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("gemmapt_ts17"), tmp_path)
    assert_second_run_changes_nothing(run, tmp_path, TILE)


def _tiled(path: Path, shape: list, repeats: list[int]) -> Path:
    """x of ``shape`` tiled by ``repeats``, then doubled."""
    nodes = [
        helper.make_node("Tile", ["x", "repeats"], ["tiled"]),
        helper.make_node("Add", ["tiled", "tiled"], ["out"]),
    ]
    out = [value("out", [None] * len(shape))]
    return save_model(path, nodes, [value("x", shape)], out, [const("repeats", repeats, np.int64)])


def _feeds(shape: list) -> dict:
    sizes = [2 if isinstance(size, str) else size for size in shape]
    return {"x": np.random.default_rng(0).normal(size=sizes).astype(np.float32)}


def test_a_tile_of_unit_axes_becomes_an_expand(tmp_path: Path) -> None:
    shape = ["batch", 3, 1, 1, 4]
    model = _tiled(tmp_path / "unit.onnx", shape, [1, 1, 2, 3, 1])
    run = optimize_checked(model, tmp_path)
    assert run.counts(TILE) == (1, 1)
    ops = run.op_counts()
    assert (ops["Expand"], ops["Tile"]) == (1, 0)
    compare_on_feeds(model, run.output, _feeds(shape))


@pytest.mark.parametrize(
    ("shape", "repeats"),
    [
        (["batch", 3, 1, 4], [1, 2, 1, 1]),  # copies of three slices: a tiling
        (["batch", "heads", 4], [1, 2, 1]),  # an axis of a size not known to be 1
        (["batch", 3, 1, 4], [1, 1, 1, 1]),  # nothing repeated
    ],
)
def test_tiles_that_are_no_broadcast_stay(tmp_path: Path, shape: list, repeats: list) -> None:
    model = _tiled(tmp_path / "tile.onnx", shape, repeats)
    run = optimize_checked(model, tmp_path)
    assert run.counts(TILE) == (0, 0)
    compare_on_feeds(model, run.output, _feeds(shape))
