"""The architecture matrix: every committed export of tests/fixtures/arch optimized as users run it.

The fixtures (``make_arch_matrix.py --fixtures``; the whole matrix, more architectures, goes to a
cache for benchmarks/arch_matrix.py) are tiny transformers of many families, each exported by
TorchScript (opset 17) and dynamo (opset 18). Per fixture:

* the output passes the full checker and matches the original on onnxruntime within the
  tolerance of the loosest numerics class among the passes that fired (fusectl.diagnostics.verify);
* so does the ``--target onnx`` output, which has only standard-domain ops;
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

from fusectl.diagnostics.verify import default_tolerance
from tests.conftest import FIXTURES, Run, fused_op_classes, named_dim_feeds, optimize, run_model

ARCH = FIXTURES / "arch"
MANIFEST = json.loads((ARCH / "manifest.json").read_text())
ENTRIES = {Path(entry["file"]).stem: entry for entry in MANIFEST["models"]}
CLASSES = ("attention", "norm", "skip_norm", "gelu", "rotary")
TARGETED = ("attention", "norm", "gelu", "rotary")  # skip norms: PyTorch does not say where

# fixture: (today, target), each per class (attention, norm, skip norm, GELU-class, rotary);
# the target has no skip-norm figure (None). `python benchmarks/arch_matrix.py --fixture-rows`
# prints ROWS and WHY for fusectl as it is: paste them here when a pass changes the counts.
ROWS: dict[str, tuple[tuple[int, ...], tuple[int | None, ...]]] = {
    "albert_dynamo": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "albert_ts17": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "bart_dynamo": ((6, 12, 12, 4, 0), (6, 12, None, 4, 0)),
    "bart_past_dynamo": ((4, 7, 7, 2, 0), (4, 7, None, 2, 0)),
    "bart_past_ts17": ((4, 7, 7, 2, 0), (4, 7, None, 2, 0)),
    "bart_ts17": ((6, 12, 12, 4, 0), (6, 12, None, 4, 0)),
    "bloom_dynamo": ((2, 6, 4, 2, 0), (2, 6, None, 2, 0)),
    "bloom_ts17": ((2, 6, 4, 2, 0), (2, 6, None, 2, 0)),
    "clip_text_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "clip_text_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "clip_vision_dynamo": ((2, 6, 4, 2, 0), (2, 6, None, 2, 0)),
    "clip_vision_ts17": ((2, 6, 4, 2, 0), (2, 6, None, 2, 0)),
    "convbert_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "convbert_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "deberta_v2_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "deberta_v2_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "deepseek_v3_dynamo": ((2, 9, 9, 3, 4), (2, 9, None, 3, 4)),
    "deepseek_v3_ts17": ((2, 9, 9, 3, 4), (2, 9, None, 3, 4)),
    "deit_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "deit_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "dpt_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "dpt_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "ernie_dynamo": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "ernie_ts17": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "falcon_dynamo": ((2, 3, 2, 2, 4), (2, 3, None, 2, 4)),
    "falcon_new_dynamo": ((2, 5, 2, 2, 4), (2, 5, None, 2, 4)),
    "falcon_new_ts17": ((2, 5, 2, 2, 4), (2, 5, None, 2, 4)),
    "falcon_ts17": ((2, 3, 2, 2, 4), (2, 3, None, 2, 4)),
    "funnel_dynamo": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "funnel_ts17": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "gemma2_dynamo": ((2, 9, 9, 2, 4), (2, 9, None, 2, 4)),
    "gemma2_ts17": ((2, 9, 9, 2, 4), (2, 9, None, 2, 4)),
    "gemma3_dynamo": ((2, 13, 13, 2, 4), (2, 13, None, 2, 4)),
    "gemma3_ts17": ((2, 13, 13, 2, 4), (2, 13, None, 2, 4)),
    "gemma3n_text_dynamo": ((2, 24, 24, 4, 4), (2, 24, None, 4, 4)),
    "gemma3n_text_ts17": ((2, 24, 24, 4, 4), (2, 24, None, 4, 4)),
    "gemma_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "gemma_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "gpt_bigcode_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "gpt_bigcode_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "gpt_neo_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "gpt_neo_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "gpt_neox_dynamo": ((2, 5, 2, 2, 4), (2, 5, None, 2, 4)),
    "gpt_neox_japanese_dynamo": ((2, 5, 4, 2, 4), (2, 5, None, 2, 4)),
    "gpt_neox_japanese_ts17": ((2, 5, 4, 2, 4), (2, 5, None, 2, 4)),
    "gpt_neox_ts17": ((2, 5, 2, 2, 4), (2, 5, None, 2, 4)),
    "gpt_oss_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "gpt_oss_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "gptj_dynamo": ((2, 3, 2, 2, 4), (2, 3, None, 2, 4)),
    "gptj_ts17": ((2, 3, 2, 2, 4), (2, 3, None, 2, 4)),
    "granite_swa_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "granite_swa_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "imagegpt_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "imagegpt_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "inkling_text_dynamo": ((2, 10, 10, 3, 0), (2, 10, None, 3, 0)),
    "inkling_text_ts17": ((2, 10, 10, 3, 0), (2, 10, None, 3, 0)),
    "levit_dynamo": ((5, 0, 0, 0, 0), (5, 0, None, 0, 0)),
    "levit_ts17": ((5, 0, 0, 0, 0), (5, 0, None, 0, 0)),
    "lfm2_dynamo": ((1, 7, 7, 2, 2), (1, 7, None, 2, 2)),
    "lfm2_ts17": ((1, 7, 7, 2, 2), (1, 7, None, 2, 2)),
    "lfm3_dynamo": ((2, 17, 17, 3, 4), (2, 17, None, 3, 4)),
    "lfm3_ts17": ((2, 17, 17, 3, 4), (2, 17, None, 3, 4)),
    "llama_past_positions_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "llama_past_positions_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "llama_positions_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "llama_positions_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "mimo_v2_flash_dynamo": ((1, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "mimo_v2_flash_ts17": ((1, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "mistral_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "mistral_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "modernbert_dynamo": ((2, 5, 4, 2, 4), (2, 5, None, 2, 4)),
    "modernbert_ts17": ((2, 5, 4, 2, 4), (2, 5, None, 2, 4)),
    "moshi_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "moshi_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "mpt_dynamo": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "mpt_ts17": ((2, 5, 4, 2, 0), (2, 5, None, 2, 0)),
    "nanochat_dynamo": ((2, 10, 10, 0, 4), (2, 10, None, 0, 4)),
    "nanochat_ts17": ((2, 10, 10, 0, 4), (2, 10, None, 0, 4)),
    "openai_gpt_dynamo": ((2, 4, 4, 2, 0), (2, 4, None, 2, 0)),
    "openai_gpt_ts17": ((2, 4, 4, 2, 0), (2, 4, None, 2, 0)),
    "openai_privacy_filter_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "openai_privacy_filter_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "phi3_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "phi3_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "phi_dynamo": ((2, 3, 2, 2, 4), (2, 3, None, 2, 4)),
    "phi_ts17": ((2, 3, 2, 2, 4), (2, 3, None, 2, 4)),
    "qwen2_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "qwen2_past_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "qwen2_past_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "qwen2_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "qwen2_vl_text_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "qwen2_vl_text_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "qwen3_dynamo": ((2, 9, 9, 2, 4), (2, 9, None, 2, 4)),
    "qwen3_ts17": ((2, 9, 9, 2, 4), (2, 9, None, 2, 4)),
    "roberta_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "roberta_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "roformer_dynamo": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "roformer_ts17": ((2, 5, 5, 2, 4), (2, 5, None, 2, 4)),
    "sam_vision_dynamo": ((2, 6, 0, 2, 0), (2, 6, None, 2, 0)),
    "sam_vision_ts17": ((2, 6, 0, 2, 0), (2, 6, None, 2, 0)),
    "siglip_vision_dynamo": ((3, 6, 5, 3, 0), (3, 6, None, 3, 0)),
    "siglip_vision_ts17": ((3, 6, 5, 3, 0), (3, 6, None, 3, 0)),
    "squeezebert_dynamo": ((2, 5, 1, 2, 0), (2, 5, None, 2, 0)),
    "squeezebert_ts17": ((2, 5, 1, 2, 0), (2, 5, None, 2, 0)),
    "swin_dynamo": ((2, 7, 3, 2, 0), (2, 7, None, 2, 0)),
    "swin_ts17": ((2, 7, 3, 2, 0), (2, 7, None, 2, 0)),
    "swinv2_dynamo": ((2, 7, 1, 2, 0), (2, 7, None, 2, 0)),
    "swinv2_ts17": ((2, 7, 1, 2, 0), (2, 7, None, 2, 0)),
    "vitdet_dynamo": ((2, 4, 0, 2, 0), (2, 4, None, 2, 0)),
    "vitdet_ts17": ((2, 4, 0, 2, 0), (2, 4, None, 2, 0)),
    "wav2vec2_dynamo": ((2, 6, 5, 5, 0), (2, 6, None, 5, 0)),
    "wav2vec2_ts17": ((2, 6, 5, 5, 0), (2, 6, None, 5, 0)),
    "whisper_dynamo": ((6, 12, 12, 6, 0), (6, 12, None, 6, 0)),
    "whisper_ts17": ((6, 12, 12, 6, 0), (6, 12, None, 6, 0)),
    "xglm_dynamo": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "xglm_ts17": ((2, 5, 5, 2, 0), (2, 5, None, 2, 0)),
    "xlnet_ts17": ((2, 4, 4, 2, 0), (2, 4, None, 2, 0)),
}

# (fixture, class) below target today: the near-misses of that class's fusectl passes.
WHY: dict[tuple[str, str], str] = {
    ("mimo_v2_flash_dynamo", "attention"): (
        "AttentionFusionPass: Attention needs opset >= 23, model has 18; "
        "GroupQueryAttentionFusionPass: the key/value projections' hidden size is unknown"
        " or differs; MultiHeadAttentionFusionPass: the Softmax has a sink per head (a "
        "logit joined to the scores and dropped after it), which MultiHeadAttention "
        "cannot take (GroupQueryAttention's head_sink)"
    ),
    ("mimo_v2_flash_ts17", "attention"): (
        "AttentionFusionPass: Attention needs opset >= 23, model has 17; "
        "GroupQueryAttentionFusionPass: the key/value projections' hidden size is unknown"
        " or differs; MultiHeadAttentionFusionPass: the Softmax has a sink per head (a "
        "logit joined to the scores and dropped after it), which MultiHeadAttention "
        "cannot take (GroupQueryAttention's head_sink)"
    ),
}  # fmt: skip


def _target_params() -> list:
    params = []
    for name, (today, target) in sorted(ROWS.items()):
        for cls in TARGETED:
            index = CLASSES.index(cls)
            below = target[index] is not None and today[index] < target[index]
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


def assert_valid_and_equal(name: str, output: Path) -> None:
    """The full checker passes, and onnxruntime gives the original's outputs within the
    tolerance of the loosest numerics class among the passes that fired."""
    onnx.checker.check_model(onnx.load(str(output)), full_check=True)
    original = ARCH / f"{name}.onnx"
    feeds = named_dim_feeds(original, MANIFEST["dims"])
    tolerance = default_tolerance(ir.load(str(output)))
    want, got = run_model(original, feeds), run_model(output, feeds)
    assert len(got) == len(want)
    for expected, actual in zip(want, got, strict=True):
        np.testing.assert_allclose(actual, expected, atol=tolerance.atol, rtol=tolerance.rtol)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_valid_equal_and_fused_as_today(name: str, optimized: Callable[[str], Run]) -> None:
    run = optimized(name)
    assert_valid_and_equal(name, run.output)
    assert counts(run) == ROWS[name][0]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_target_onnx_has_only_standard_ops(name: str, tmp_path: Path) -> None:
    run = optimize(ARCH / f"{name}.onnx", tmp_path, "--target", "onnx")
    assert_valid_and_equal(name, run.output)
    model = onnx.load(str(run.output))
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}
    assert {opset.domain for opset in model.opset_import} <= {"", "ai.onnx"}


@pytest.mark.parametrize(("name", "cls"), _target_params())
def test_fused_in_every_place(name: str, cls: str, optimized: Callable[[str], Run]) -> None:
    index = CLASSES.index(cls)
    assert counts(optimized(name))[index] == ROWS[name][1][index]


def _nodes(path: Path) -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [(n.domain, n.op_type, tuple(n.input), tuple(n.output)) for n in graph.node]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_second_run_changes_no_node(
    name: str, optimized: Callable[[str], Run], tmp_path: Path
) -> None:
    """The passes reach their fixed point in one run: chains the fusions make adjacent (two
    Reshapes a fused op stood between) are merged by the graph passes run again after them,
    so fusectl on its own output changes no node. (A second run may still write value_info
    for values the first left untyped, and take XLNet's restored Einsum apart and restore it
    again: a round trip that ends where it began.)"""
    first = optimized(name)
    second = optimize(first.output, tmp_path, "--log", "null")
    assert _nodes(second.output) == _nodes(first.output)
