"""HeadRepeatTransposeCanonicalizationPass: key / value heads repeated while still [B, L, KV, H]
(llama2.c's repeat_kv, Flax's jnp.repeat) are repeated after their Transpose instead, the form
the attention fusions read as grouped heads. llama2.c under both exporters (then
GroupQueryAttention), torchtune (repeated after the transpose already: nothing to do), the
spellings of the unit axis, the near misses with their reasons, and numerics on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.pass_helpers import (
    assert_declined,
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    edited_fixture,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

REPEAT = "HeadRepeatTransposeCanonicalizationPass"
GQA = "GroupQueryAttentionFusionPass"


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_llama2c_grouped_attention_is_fused_in_every_layer(tmp_path: Path, exporter: str) -> None:
    """Key and value of both layers: four repeats moved behind their Transposes (the value's
    Transpose is the one the context's matmul reads), then GroupQueryAttention takes them."""
    run = optimize_checked(fixture_path(f"llama2c_{exporter}"), tmp_path)
    assert pattern_counts(run, REPEAT) == {"HeadRepeatTranspose": (4, 4)}
    assert run.counts(GQA) == (2, 2)
    assert run.report["coverage"]["attention"] == {"fused": 2, "total": 2, "unfused": []}
    assert run.op_counts()["GroupQueryAttention"] == 2
    # The repeats went into GroupQueryAttention; its own Expand spreads the sequence lengths.
    expands = [n.name for n in onnx.load(str(run.output)).graph.node if n.op_type == "Expand"]
    assert all(name.startswith(f"{GQA}/") for name in expands), expands


def test_without_the_pass_no_grouped_attention(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("llama2c_dynamo"), tmp_path, "--disable_pass", REPEAT)
    assert run.counts(GQA)[1] == 0
    assert run.op_counts()["GroupQueryAttention"] == 0


def test_heads_repeated_after_the_transpose_are_left_to_the_attention(tmp_path: Path) -> None:
    """torchtune repeats [B, KV, L, H] heads: no Transpose moves the heads after the repeat."""
    run = optimize_checked(fixture_path("torchtune_dynamo"), tmp_path)
    assert run.counts(REPEAT) == (0, 0)
    assert run.op_counts()["GroupQueryAttention"] == 2


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("llama2c_ts17"), tmp_path)
    assert_second_run_changes_nothing(run, tmp_path, REPEAT)


KV, TIMES, LENGTH, SIZE = 2, 3, 5, 4


def _model(
    path: Path,
    *,
    unit: str = "unsqueeze",
    perm: tuple[int, ...] = (0, 2, 1, 3),
    spread: tuple[int, ...] = (1, 1, 1, TIMES, 1),
    merged: tuple[int, ...] = (0, 0, KV * TIMES, SIZE),
    reader: str = "Transpose",
    z_shape: list[int | str] | None = None,
    kv: int = KV,
) -> Path:
    """z [B, L, KV, H] with a unit axis after the heads (``unit``: Unsqueeze, or a Reshape to
    [0, 0, KV, 1, H]), expanded by ``spread``, reshaped to ``merged`` and read by a Transpose
    of ``perm`` (``reader`` Sigmoid: read by something else too)."""
    nodes = (
        [helper.make_node("Unsqueeze", ["z", "axis"], ["unit"])]
        if unit == "unsqueeze"
        else [helper.make_node("Reshape", ["z", "unit_shape"], ["unit"])]
    )
    nodes += [
        helper.make_node("Expand", ["unit", "spread"], ["spreaded"]),
        helper.make_node("Reshape", ["spreaded", "merged"], ["repeated"]),
        helper.make_node("Transpose", ["repeated"], ["out"], perm=list(perm)),
    ]
    outputs = [value("out", [None] * 4)]
    if reader != "Transpose":
        nodes.append(helper.make_node(reader, ["repeated"], ["also"]))
        outputs.append(value("also", [None] * 4))
    initializers = [
        const("axis", [3], np.int64),
        const("unit_shape", [0, 0, kv, 1, SIZE], np.int64),
        const("spread", list(spread), np.int64),
        const("merged", list(merged), np.int64),
    ]
    inputs = [value("z", z_shape or ["batch", LENGTH, kv, SIZE])]
    return save_model(path, nodes, inputs, outputs, initializers)


def _feeds(kv: int = KV) -> dict[str, np.ndarray]:
    return {"z": np.random.default_rng(0).normal(size=(2, LENGTH, kv, SIZE)).astype(np.float32)}


@pytest.mark.parametrize(
    ("unit", "perm", "transposes"),
    [
        ("unsqueeze", (0, 2, 1, 3), 1),  # q/k/v heads: [B, N, L, H]
        ("unsqueeze", (0, 2, 3, 1), 2),  # K^T: the heads moved, then the last two swapped
        ("reshape", (0, 2, 1, 3), 1),  # Flax's jnp.repeat: the unit axis by a Reshape
    ],
)
def test_the_repeat_moves_behind_the_transpose(
    tmp_path: Path, unit: str, perm: tuple[int, ...], transposes: int
) -> None:
    model = _model(tmp_path / "repeat.onnx", unit=unit, perm=perm)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, REPEAT) == {"HeadRepeatTranspose": (1, 1)}
    assert run.op_counts()["Transpose"] == transposes
    compare_on_feeds(model, run.output, _feeds())


def test_one_key_value_head_repeated_by_a_reshaped_unit_axis(tmp_path: Path) -> None:
    """One key/value head (Flax's jnp.repeat of [B, L, 1, H]): the Reshape to [B, L, 1, 1, H]
    puts its unit axis beside the head axis of 1, either place; the Expand repeats the second,
    so that is the one inserted."""
    merged = (0, 0, TIMES, SIZE)
    model = _model(tmp_path / "one_head.onnx", unit="reshape", merged=merged, kv=1)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, REPEAT) == {"HeadRepeatTranspose": (1, 1)}
    compare_on_feeds(model, run.output, _feeds(kv=1))


def test_the_moved_merge_is_a_constant_where_one_size_is_inferred(tmp_path: Path) -> None:
    """The merged target [0, -1, KV*r, H]: after the move, [0, KV*r, -1, H] (0 copies the
    batch, -1 infers the length), a constant as the Reshape canonicalization writes them."""
    model = _model(tmp_path / "inferred.onnx", merged=(0, -1, KV * TIMES, SIZE))
    run = optimize_checked(model, tmp_path)
    assert run.counts(REPEAT) == (1, 1)
    assert run.op_counts()["Shape"] == 0
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize("perm", [(0, 2, 1, 3), (0, 2, 3, 1)])
def test_sizes_a_constant_cannot_spell_are_read_from_the_moved_heads(
    tmp_path: Path, perm: tuple[int, ...]
) -> None:
    """Length and head size both unknown: the merge reads them from the transposed heads (a
    Gather of their Shape), where the size proofs of the attention fusions trace them; for
    K^T too, whose last-two swap comes after the merge."""
    unknown = ["batch", "length", KV, "size"]
    merged = (0, 0, KV * TIMES, -1)
    model = _model(tmp_path / "unknown.onnx", z_shape=unknown, merged=merged, perm=perm)
    run = optimize_checked(model, tmp_path)
    assert run.counts(REPEAT) == (1, 1)
    assert run.op_counts()["Shape"] == 1
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        (
            {"spread": (2, 1, 1, TIMES, 1)},
            "the Expand does not provably keep the sizes other than the repeat's",
        ),
        (
            {"merged": (0, LENGTH * KV, TIMES, SIZE)},
            "the Reshape does not provably keep the sizes other than the heads'",
        ),
        (
            {"merged": (0, LENGTH, KV * TIMES * 2, SIZE // 2)},
            "the Reshape does not provably merge the repeated heads",
        ),
        ({"reader": "Sigmoid"}, "the repeated heads are also read elsewhere"),
    ],
)
def test_near_misses_stay(tmp_path: Path, case: dict, reason: str) -> None:
    """An Expand that also spreads the batch, a Reshape that merges the length with the heads
    or splits the head size into them, a repeat read by more than the Transpose: each stays,
    with its reason."""
    model = _model(tmp_path / "near.onnx", **case)
    run = optimize_checked(model, tmp_path)
    assert_declined(run, REPEAT, reason, "out")


ROTARY_REPEAT = "RotaryHeadRepeatCanonicalizationPass"


def test_the_rotary_of_repeated_key_heads_moves_before_the_repeat(tmp_path: Path) -> None:
    """litgpt repeats each group's key to its queries before the rotary: the rotary moves to
    the group's key (on its projection, split after), then the repeat, which
    GroupQueryAttention takes; without the move the attention reads the repeated heads."""
    run = optimize_checked(fixture_path("litgpt_ts17"), tmp_path)
    assert pattern_counts(run, ROTARY_REPEAT) == {"RotaryHeadRepeat": (2, 2)}
    assert run.op_counts()["GroupQueryAttention"] == 2
    off = optimize_checked(fixture_path("litgpt_ts17"), tmp_path, "--disable_pass", ROTARY_REPEAT)
    ops = off.op_counts()
    assert (ops["GroupQueryAttention"], ops["MultiHeadAttention"]) == (0, 2)


def test_repeated_key_heads_read_elsewhere_keep_their_rotary(tmp_path: Path) -> None:
    """The first layer's repeated key heads are a graph output too: the repeat stays where it
    is (moving the rotary would repeat the heads twice), that layer's attention reads them as
    they are; the second layer is taken."""

    def expose(model: onnx.ModelProto) -> None:
        model.graph.output.append(value("/layers.0/attention/Reshape_4_output_0", None))

    model = edited_fixture("litgpt_ts17", tmp_path, expose, "exposed")
    run = optimize_checked(model, tmp_path)
    assert run.counts(ROTARY_REPEAT) == (2, 1)
    assert reasons(run, ROTARY_REPEAT) == {"the repeated heads are also read elsewhere": 1}
    ops = run.op_counts()
    assert (ops["GroupQueryAttention"], ops["MultiHeadAttention"]) == (1, 1)
