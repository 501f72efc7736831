"""FlattenedGemmCanonicalizationPass: GPT-2's Conv1D exports, near misses built with onnx.helper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from tests.conftest import random_feeds
from tests.pass_helpers import (
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

PASS = "FlattenedGemmCanonicalizationPass"
PATTERN = "FlattenedGemm"


@pytest.mark.parametrize(
    ("name", "nodes"),
    [
        # Two layers x (c_attn, c_proj, c_fc, mlp c_proj). TorchScript reads the restored sizes
        # with Shape -> Gather -> Unsqueeze from the 3-D input; dynamo with Shape(start, end)
        # from the attention mask, and flattens the attention's heads and tokens in one
        # Reshape (a [0, 0, -1] head merge is put back in front of the MatMul). The position
        # embeddings are a proven [1, S, H] skip of the first norm under both exporters.
        # With a KV cache, MultiHeadAttention appends to it (no head split, Concat, Transpose).
        # TorchScript's position ids and context merges get constant targets, their sizes
        # traced to the data's (8 shape ops fewer than before that).
        ("gpt2_tiny_ts17", 64),
        ("gpt2_tiny_dynamo", 54),
        ("gpt2_tiny_past_dynamo", 63),
    ],
)
def test_every_conv1d_of_gpt2_becomes_matmul_add(name: str, nodes: int, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path, compare="_past_" not in name)
    assert pattern_counts(run, PASS) == {PATTERN: (8, 8)}
    assert reasons(run, PASS) == {}
    counts = run.op_counts()
    assert counts["Gemm"] == 0
    assert counts["MatMul"] == 8
    assert run.report["model"]["after"]["nodes"] == nodes


def test_switched_off_keeps_the_gemms(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("gpt2_tiny_ts17"), tmp_path, "--disable_pass", PASS)
    assert run.op_counts()["Gemm"] == 8
    # 138 before the shapes were re-derived through the fused ops for the passes that run
    # again after the fusions: constant folding then folds two Slices and two Concats more;
    # 134 before a Reshape's -1 was counted from sizes traced through the ops: each layer's
    # context merge is then a constant target, and its shape arithmetic (Gathers, Unsqueezes,
    # a Concat) goes; 124 before a size read from another tensor was proven the data's by
    # the sizes traced to it (the position ids' targets) and the sizes read outside the
    # fused attention came from the graph input, one read for both layers.
    assert run.report["model"]["after"]["nodes"] == 116


K, N = 8, 6


def _layer(
    path: Path,
    *,
    gemm: dict | None = None,
    bias_shape: tuple[int, ...] = (N,),
    restored: tuple[int, int] = (0, 1),
    last: int = N,
    weight_shape: tuple[int, int] = (K, N),
    gemm_output_read: bool = False,
    flat_output_read: bool = False,
    split: tuple[int | str, ...] = (),
) -> Path:
    """x[B, S, K] -> Reshape [-1, K] -> Gemm -> Reshape to [x.size(i), x.size(j), last], or
    to [x.size(i), x.size(j), *split] (a split entry "fed": the size of another input)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w", "b"], ["y2"], **(gemm or {})),
        helper.make_node("Shape", ["x"], ["x_shape"]),
    ]
    parts = []
    for position in range(len(restored)):
        nodes += [
            helper.make_node("Gather", ["x_shape", f"axis{position}"], [f"size{position}"]),
            helper.make_node("Unsqueeze", [f"size{position}", "zero"], [f"part{position}"]),
        ]
        parts.append(f"part{position}")
    tail = [f"split{i}" if size != "fed" else "fed" for i, size in enumerate(split)] or ["last"]
    if "fed" in split:
        nodes.append(helper.make_node("Shape", ["h"], ["fed"]))
    nodes += [
        helper.make_node("Concat", [*parts, *tail], ["target"], axis=0),
        helper.make_node("Reshape", ["y2", "target"], ["y"]),
    ]
    initializers = [
        const("flat_shape", [-1, K], np.int64),
        const("w", rng.standard_normal(weight_shape)),
        const("b", rng.standard_normal(bias_shape)),
        const("zero", [0], np.int64),
        const("last", [last], np.int64),
        *(const(f"axis{i}", axis, np.int64) for i, axis in enumerate(restored)),
        *(const(f"split{i}", [size], np.int64) for i, size in enumerate(split) if size != "fed"),
    ]
    fed = [value("h", ["H"])] if "fed" in split else []
    outputs = [value("y", [f"d{i}" for i in range(len(restored) + max(len(split), 1))])]
    return save_model(
        path,
        nodes,
        [value("x", ["B", "S", K]), *fed],
        [
            *outputs,
            *([value("y2", ["r", N])] if gemm_output_read else []),
            *([value("flat", ["r", K])] if flat_output_read else []),
        ],
        initializers,
    )


def test_transposed_weights_are_transposed_once(tmp_path: Path) -> None:
    model = _layer(tmp_path / "trans_b.onnx", gemm={"transB": 1}, weight_shape=(N, K))
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 1)}
    assert run.op_counts() == {"MatMul": 1, "Add": 1}


@pytest.mark.parametrize(
    ("options", "reason", "runs"),
    [
        ({"gemm": {"alpha": 2.0}}, "Gemm scales the product (alpha != 1)", True),
        ({"gemm": {"beta": 0.5}}, "Gemm scales the bias (beta != 1)", True),
        # The 2-D product is read elsewhere too (a graph output): the Gemm must stay for it.
        (
            {"gemm_output_read": True},
            "an intermediate value (Gemm output) is a graph output",
            True,
        ),
        # Reshaping to [S, B, N] is another tensor than MatMul on x gives.
        ({"restored": (1, 0)}, "the second Reshape's size 0 is not the activation's", True),
        # These two are valid models that fail at run time for most batch sizes: the
        # checker passes them, onnxruntime runs them only where the sizes happen to fit.
        (
            {"bias_shape": (4, N)},
            "the Gemm bias does not broadcast along the output's last axis only",
            False,
        ),
        ({"last": 3}, "the second Reshape's last size is not the Gemm's 6 outputs", False),
        (
            {"split": (2, "fed")},
            "the second Reshape splits the outputs into sizes not known before run time",
            False,
        ),
        (
            {"split": (4, 3)},
            "the second Reshape splits the outputs into sizes that are not the Gemm's 6",
            False,
        ),
    ],
)
def test_near_misses_keep_the_gemm(options: dict, reason: str, runs: bool, tmp_path: Path) -> None:
    model = _layer(tmp_path / "near_miss.onnx", **options)
    run = optimize_checked(model, tmp_path, compare=runs)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 0)}
    assert reasons(run, PASS) == {reason: 1}
    assert run.op_counts()["Gemm"] == 1


def test_a_flatten_read_as_a_graph_output_stays_for_it(tmp_path: Path) -> None:
    """The 2-D activation is a graph output too: the layer is MatMul + Add on x all the same,
    and the flatten stays for the output (removing it was an internal error; found by fuzzing
    graph outputs on ImageGPT)."""
    model = _layer(tmp_path / "flat_output.onnx", flat_output_read=True)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 1)}
    assert run.op_counts() == {"MatMul": 1, "Add": 1, "Reshape": 1}


@pytest.mark.parametrize("split", [(2, 3), (-1, 3), (3, 2, 1)])
def test_outputs_split_into_heads_at_once(split: tuple[int, ...], tmp_path: Path) -> None:
    """Restored to the leading axes and split ([B, S, heads, head_size]) in one Reshape: the
    layer is MatMul + Add on x, and the split its own Reshape after it."""
    model = _layer(tmp_path / "split.onnx", split=split)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 1)}
    assert run.op_counts() == {"MatMul": 1, "Add": 1, "Reshape": 1}


def test_flax_projections_split_to_heads(tmp_path: Path) -> None:
    """Flax's encoder block through jax2onnx (tests/fixtures/make_jax_fixtures.py): every
    dense layer is Reshape -> Gemm -> Reshape, the attention's query, key and value reshaped
    straight to [B, 8, heads, head_size]. All six become MatMul + Add on the activation, and the
    attention fuses on the projections."""
    run = optimize_checked(fixture_path("flax_encoder_jax2onnx"), tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (6, 6)}
    assert reasons(run, PASS) == {}
    ops = run.op_counts()
    assert (ops["Gemm"], ops["MatMul"], ops["Attention"]) == (0, 6, 1)
    assert run.report["model"]["after"]["nodes"] == 14


def test_mindspore_query_key_value_share_one_flatten(tmp_path: Path) -> None:
    """A BERT layer through MindSpore's exporter (tests/fixtures/make_mindspore_fixtures.py):
    the query, key and value read one flatten of their input. Each layer becomes MatMul + Add
    on the input, the shared flatten staying until the last of them, and the attention fuses
    on the projections."""
    run = optimize_checked(fixture_path("mindspore_bert_ms"), tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (6, 6)}
    assert reasons(run, PASS) == {}
    ops = run.op_counts()
    assert (ops["Gemm"], ops["Attention"]) == (0, 1)


def test_onnx_simplifier_linear_layers_become_matmul_add(tmp_path: Path) -> None:
    """onnx-simplifier writes each 3-D linear layer of a ViT as Reshape [-1, K] -> Gemm ->
    Reshape to a constant [-1, 17, N] (tests/fixtures/make_preprocessed_fixtures.py): the -1
    is the batch, since 17 and N are the activation's other sizes. All ten layers become
    MatMul + Add, and the attention fuses on them as on the export (it fused none)."""
    run = optimize_checked(fixture_path("preprocessed/vit_tiny_ts17_onnxsim"), tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (10, 10)}
    assert reasons(run, PASS) == {}
    attention = run.report["coverage"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2)


def _constant_unflatten(path: Path, x: list[int | str], target: list[int]) -> Path:
    """x -> Reshape [-1, K] -> Gemm -> Reshape to a constant target, as onnx-simplifier
    writes a 3-D linear layer."""
    rng = np.random.default_rng(0)
    return save_model(
        path,
        [
            helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
            helper.make_node("Gemm", ["flat", "w", "b"], ["y2"]),
            helper.make_node("Reshape", ["y2", "target"], ["y"]),
        ],
        [value("x", x)],
        [value("y", ["r", *target[1:-1], N])],
        [
            const("flat_shape", [-1, K], np.int64),
            const("w", rng.standard_normal((K, N))),
            const("b", rng.standard_normal(N)),
            const("target", target, np.int64),
        ],
    )


def test_a_constant_target_with_a_leading_minus_one_restores_the_batch(tmp_path: Path) -> None:
    model = _constant_unflatten(tmp_path / "batch.onnx", ["B", 4, K], [-1, 4, N])
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 1)}
    assert run.op_counts() == {"MatMul": 1, "Add": 1}


@pytest.mark.parametrize(
    ("x", "target"),
    [
        # [-1, 2, N] of [4B, N] rows is [2B, 2, N]: not the activation's leading axes.
        (["B", 4, K], [-1, 2, N]),
        # Swin's window partition merged into the flatten (onnx-simplifier's): [B, 2, 3, K]
        # windows of 3 tokens, [2B, 3, N].
        (["B", 2, 3, K], [-1, 3, N]),
    ],
)
def test_a_constant_target_that_regroups_the_rows_regroups_the_activation(
    x: list[int | str], target: list[int], tmp_path: Path
) -> None:
    """The rows the first Reshape made are the activation's leading elements in order (its
    last axis is the Gemm's K), so the activation viewed as [..., K] regroups them as the
    second Reshape does: Reshape -> MatMul -> Add."""
    model = _constant_unflatten(tmp_path / "regroup.onnx", x, target)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 1)}
    assert run.op_counts() == {"Reshape": 1, "MatMul": 1, "Add": 1}


def test_onnx_simplifier_swin_windows_regroup_the_activation(tmp_path: Path) -> None:
    """Swin through onnx-simplifier (tests/fixtures/make_preprocessed_fixtures.py): the window
    partition is merged into the flatten, [B, 2, 2, 4, 4, 16] -> [-1, 16] -> Gemm -> [-1, 16,
    16]. All ten layers are MatMul + Add on the windows, and the attention fuses 2/2 (none
    before)."""
    run = optimize_checked(fixture_path("preprocessed/swin_ts17_onnxsim"), tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (10, 10)}
    assert reasons(run, PASS) == {}
    attention = run.report["coverage"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2)


@pytest.mark.parametrize(
    ("x", "target", "reason", "runs"),
    [
        # A 0 copies the Gemm output's rows: [4B, 1, N], and from the activation it would copy
        # B.
        (["B", 4, K], [0, 1, N], "the second Reshape's size 0 is not the activation's", True),
        # The first Reshape may have merged part of the last axis into the rows (the model
        # runs only where it is K: the feeds verify generates give it another size).
        (
            ["B", 4, "k"],
            [-1, 4, N],
            f"the activation's last axis is not known to be the Gemm's {K} inputs",
            False,
        ),
    ],
)
def test_a_leading_minus_one_needs_every_other_size_proven(
    x: list[int | str], target: list[int], reason: str, runs: bool, tmp_path: Path
) -> None:
    model = _constant_unflatten(tmp_path / "near_miss.onnx", x, target)
    run = optimize_checked(model, tmp_path, compare=runs)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 0)}
    assert reasons(run, PASS) == {reason: 1}
    assert run.op_counts()["Gemm"] == 1


def _computed_unflatten(path: Path, restored: list[str]) -> Path:
    """x [B, S, K] -> Reshape [-1, K] -> Gemm -> Reshape to [B, S * 2 / 2, 2, 3], the
    sequence computed past reading (wav2vec2's, from its feature extractor's arithmetic); the
    result declared [*restored, 2, 3]."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w", "b"], ["y2"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "axis0"], ["batch"]),
        helper.make_node("Gather", ["x_shape", "axis1"], ["sequence"]),
        helper.make_node("Mul", ["sequence", "two"], ["doubled"]),
        helper.make_node("Div", ["doubled", "two"], ["computed"]),
        helper.make_node("Unsqueeze", ["batch", "zero"], ["part0"]),
        helper.make_node("Unsqueeze", ["computed", "zero"], ["part1"]),
        helper.make_node("Concat", ["part0", "part1", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["y2", "target"], ["y"]),
    ]
    return save_model(
        path,
        nodes,
        [value("x", ["B", "S", K])],
        [value("y", [*restored, 2, 3])],
        [
            const("flat_shape", [-1, K], np.int64),
            const("w", rng.standard_normal((K, N))),
            const("b", rng.standard_normal(N)),
            const("axis0", np.array(0), np.int64),
            const("axis1", np.array(1), np.int64),
            const("two", np.array(2), np.int64),
            const("zero", [0], np.int64),
            const("heads", [2, 3], np.int64),
        ],
    )


def test_a_target_computed_past_reading_restores_by_the_shapes(tmp_path: Path) -> None:
    """The result's leading sizes are the activation's by name: the layer is MatMul + Add on
    x and the split to heads its own Reshape (the shape arithmetic goes)."""
    model = _computed_unflatten(tmp_path / "computed.onnx", ["B", "S"])
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 1)}
    assert run.op_counts() == {"MatMul": 1, "Add": 1, "Reshape": 1}


def test_a_target_computed_past_reading_needs_the_shapes_to_say_so(tmp_path: Path) -> None:
    """The result's sequence is named otherwise: nothing proves it the activation's."""
    model = _computed_unflatten(tmp_path / "computed.onnx", ["B", "T"])
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (1, 0)}
    reason = "the second Reshape does not restore the activation's leading axes"
    assert reasons(run, PASS) == {reason: 1}


def test_onnx_simplifier_wav2vec2_projections_viewed_to_heads(tmp_path: Path) -> None:
    """wav2vec2 (dynamo) through onnx-simplifier: each projection's Gemm output is viewed
    straight to heads by a target whose sequence is computed from the feature extractor's
    arithmetic. All 13 layers are MatMul + Add, and the attention fuses 2/2 (none before)."""
    model = fixture_path("preprocessed/wav2vec2_dynamo_onnxsim")
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PASS) == {PATTERN: (13, 13)}
    assert reasons(run, PASS) == {}
    attention = run.report["coverage"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2)
    # Audio long enough for the feature extractor's convolutions: 400 samples, 39 frames.
    compare_on_feeds(model, run.output, random_feeds(model, dims={"samples": 400}))


def test_a_product_read_by_the_next_layers_is_flattened_again_for_them(tmp_path: Path) -> None:
    """x -> flatten -> Gemm, its 2-D product restored to [B, 4, N] and read as it is by a second
    Gemm (onnx-simplifier takes away the view back and the flatten again): both layers are
    MatMul + Add, the second on the first's 3-D result, and no Reshape is left."""
    rng = np.random.default_rng(0)
    model = save_model(
        tmp_path / "chained.onnx",
        [
            helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
            helper.make_node("Gemm", ["flat", "w", "b"], ["y2"]),
            helper.make_node("Reshape", ["y2", "target"], ["y"]),
            helper.make_node("Gemm", ["y2", "w2", "b2"], ["z2"]),
            helper.make_node("Reshape", ["z2", "target"], ["z"]),
        ],
        [value("x", ["B", 4, K])],
        [value("y", ["B", 4, N]), value("z", ["B", 4, N])],
        [
            const("flat_shape", [-1, K], np.int64),
            const("w", rng.standard_normal((K, N))),
            const("b", rng.standard_normal(N)),
            const("w2", rng.standard_normal((N, N))),
            const("b2", rng.standard_normal(N)),
            const("target", [-1, 4, N], np.int64),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (2, 2)}
    assert run.op_counts() == {"MatMul": 2, "Add": 2}


def test_onnx_simplifier_albert_projection_read_by_query_key_value(tmp_path: Path) -> None:
    """ALBERT (dynamo) through onnx-simplifier: the embedding projection's 2-D product is read
    by the residual's view and straight by the query, key and value Gemms. All 13 layers are
    MatMul + Add, the attention fuses 2/2 (1/2 before), with the ops the export's output has."""
    run = optimize_checked(fixture_path("preprocessed/albert_dynamo_onnxsim"), tmp_path)
    assert pattern_counts(run, PASS) == {PATTERN: (13, 13)}
    assert reasons(run, PASS) == {}
    attention = run.report["coverage"]["attention"]
    assert (attention["fused"], attention["total"]) == (2, 2)
    (tmp_path / "export").mkdir()
    export = optimize_checked(fixture_path("arch/albert_dynamo"), tmp_path / "export")
    assert run.op_counts() == export.op_counts()
