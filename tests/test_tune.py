"""The knowledge repository: `fusectl tune` on a real model, the file format and provenance, and
`fusectl optimize --providers/--repository` applying a decision (declines, reasons, counts)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import fusectl
from fusectl import register_replacement
from fusectl.core.plugins import load_builtin_passes
from fusectl.core.repository import (
    DECISIONS,
    FORMAT,
    FUSED,
    UNFUSED,
    UNSUPPORTED,
    device_identity,
    load_repository,
    shipped_path,
)
from fusectl.diagnostics import tune as tune_module
from fusectl.diagnostics.tune import time_pair
from fusectl.errors import FusectlError
from tests.conftest import (
    FIXTURES,
    assert_same_outputs,
    optimize,
    random_feeds,
    run_cli,
    run_model,
)

BERT = FIXTURES / "bert_tiny_ts17.onnx"
# The tiny BERT has 32 positions: tune it at sequence 16 (the default 128 would not fit).
SHAPES = "input_ids:1,16;attention_mask:1,16"
SKIP_LN = "AddLayerNormFusionPass"
MS = "com.microsoft"
# Sites of tuned passes in the tiny BERT (`fusectl optimize` fuses each of them).
TUNED_SITES = {
    "QkvAttentionFusionPass": 2,
    "AddLayerNormFusionPass": 4,
    "BiasGeluFusionPass": 2,
    "GemmActivationFusionPass": 1,
    "EmbedLayerNormFusionPass": 1,
    "KeyPaddingMaskFusionPass": 2,
}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The tiny BERT tuned on CPU through the CLI: (repository file, CLI result)."""
    repository = tmp_path_factory.mktemp("tune") / "repository.json"
    result = run_cli(
        "tune", BERT, "--input_shape", SHAPES, "--repository", repository, "--budget", "0.5"
    )
    assert result.exit_code == 0, result.stderr + result.stdout
    return repository, result


def subdir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def with_decision(source: Path, target: Path, pass_name: str, **entry: Any) -> Path:
    """The repository at ``source`` with every class of ``pass_name`` given ``entry``, and
    every other class fused: a class measured near parity (the key padding mask) may come
    out either way in a short tune, and the tests count the declines."""
    document = json.loads(source.read_text())
    (section,) = document["sections"]
    changed = 0
    for key, site in section["sites"].items():
        if key.startswith(f"{pass_name}/"):
            site.update(entry)
            changed += 1
        else:
            site["decision"] = FUSED
    assert changed, f"no {pass_name} class in {source}"
    target.write_text(json.dumps(document))
    return target


def ort_enable_all_ops(model: Path, tmp_path: Path) -> Counter[str]:
    """The op types of ``model`` after onnxruntime's own ORT_ENABLE_ALL optimizations."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / f"{model.stem}.ort_all.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    return Counter(node.op_type for node in optimized.graph.node)


def test_tune_records_every_class_with_provenance(tuned: tuple[Path, Any]) -> None:
    repository, result = tuned
    assert "tune: 12 site(s) in " in result.stderr
    document = json.loads(repository.read_text())
    assert document["format"] == FORMAT and document["version"] == 1
    (section,) = document["sections"]
    assert section["provider"] == "CPUExecutionProvider"
    assert section["onnxruntime"] == ort.__version__
    assert section["device"] == device_identity("CPUExecutionProvider")
    assert section["threads"] == 1 and section["models"] == [BERT.name]
    assert section["measured"].endswith("Z") and section["fusectl"] == fusectl.__version__
    sites = section["sites"]
    counted: Counter[str] = Counter()
    for key, entry in sites.items():
        assert key.startswith(f"{entry['pass']}/{entry['pattern']}: ")
        assert entry["decision"] in DECISIONS
        assert entry["fused_ms"] > 0 and entry["unfused_ms"] > 0 and entry["rounds"] >= 7
        assert entry["measured_shapes"] and entry["model"] == BERT.name
        # What the fused kernels compute on: float32 here, but for the embedding kernel, whose
        # only inputs that are not weights are integer ids.
        embedding = entry["pass"] == "EmbedLayerNormFusionPass"
        assert entry["kernel_types"] == ([] if embedding else ["float"])
        counted[entry["pass"]] += entry["sites_in_model"]
    # Every tuned site is in a measured class. The embedding layer norm too: at the tuning
    # shapes its position Gather folds to a constant and another pattern of the pass (position
    # rows as a constant) fuses the same nodes.
    assert counted == TUNED_SITES
    assert "0 not measured" in result.stderr
    # Symbolic dimensions stay '?': the verdict serves every batch and sequence length.
    skip = next(key for key in sites if key.startswith(f"{SKIP_LN}/"))
    assert "float[?,?,32]" in skip and "com.microsoft.SkipLayerNormalization" in skip


def test_tune_again_merges_into_one_section(tuned: tuple[Path, Any], tmp_path: Path) -> None:
    repository = tmp_path / "repository.json"
    repository.write_text(tuned[0].read_text())
    before = load_repository(repository).sections[0]
    result = fusectl.tune(
        str(BERT), input_shape=SHAPES, repository=repository, budget_s=0.3, seed=1
    )
    (after,) = load_repository(repository).sections
    assert (
        set(after.sites)
        == set(before.sites)
        == {c.site_class.key for c in result.classes if c.verdict is not None}
    )
    assert after.models == [BERT.name]


def test_a_slower_decision_declines_with_the_measured_reason(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    repository = with_decision(
        tuned[0], tmp_path / "slow.json", SKIP_LN, decision=UNFUSED, fused_ms=0.49, unfused_ms=0.06
    )
    kept = optimize(BERT, tmp_path, "--repository", repository)
    assert kept.op_counts()["SkipLayerNormalization"] == 0
    entry = kept.passed(SKIP_LN)
    # 4: the embeddings' norm is EmbedLayerNormalization's (that pass runs first)
    assert (entry["matched"], entry["effected"], entry["repository_hits"]) == (4, 0, 4)
    reasons = {miss["reason"]: miss["count"] for miss in entry["near_misses"]}
    assert reasons["slower on CPUExecutionProvider: 0.49 vs 0.06 ms"] == 4
    ub = kept.fusion_result["session_and_graph_id_0_0"]["ub_fusion"]
    assert ub[SKIP_LN] == {"effect_times": "0", "match_times": "4", "repository_hit_times": "4"}
    report = kept.report["repository"]
    assert report["provider"] == "CPUExecutionProvider" and report["declined"] == 4
    assert "left unfused as slower on CPUExecutionProvider" in kept.stderr
    assert_same_outputs(BERT, kept.output)
    assert onnx.checker.check_model(onnx.load(str(kept.output)), full_check=True) is None
    # Each kept residual Add is written as the Sum it equals: onnxruntime's online optimizer
    # would otherwise fuse it into the slow kernel at ORT_ENABLE_ALL, as it does the Add.
    assert kept.op_counts()["Sum"] == 4
    assert ort_enable_all_ops(kept.output, tmp_path)["SkipLayerNormalization"] == 0
    as_add = onnx.load(str(kept.output))
    for node in as_add.graph.node:
        if node.op_type == "Sum":
            node.op_type = "Add"
    onnx.save(as_add, str(tmp_path / "as_add.onnx"))
    assert ort_enable_all_ops(tmp_path / "as_add.onnx", tmp_path)["SkipLayerNormalization"] == 4

    fused = optimize(BERT, subdir(tmp_path, "none"), "--repository", "none")
    assert fused.op_counts()["SkipLayerNormalization"] == 4
    assert fused.fusion_result["session_and_graph_id_0_0"]["ub_fusion"][SKIP_LN] == {
        "effect_times": "4",
        "match_times": "4",
        "repository_hit_times": "0",
    }
    assert "repository" not in fused.report


def test_a_declined_mask_site_takes_its_shared_mask_copy_with_it(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    # On CUDA the first layer's site (the int32 Cast of the mask with its attention) measured
    # slower and the next layer's (the attention alone, reading that Cast) did not: the second
    # must not read a Cast that was never added (the output failed onnx.checker).
    document = json.loads(tuned[0].read_text())
    (section,) = document["sections"]
    first_layer = 0
    for key, site in section["sites"].items():
        if key.startswith("KeyPaddingMaskFusionPass/"):
            cast = key.split(": ", 1)[1].startswith("Cast + ")
            first_layer += cast
            site.update(decision=UNFUSED if cast else FUSED, fused_ms=0.07, unfused_ms=0.06)
        else:
            site["decision"] = FUSED
    assert first_layer == 1
    repository = tmp_path / "mask.json"
    repository.write_text(json.dumps(document))
    run = optimize(BERT, tmp_path, "--repository", repository)
    entry = run.passed("KeyPaddingMaskFusionPass")
    reasons = {miss["reason"]: miss["count"] for miss in entry["near_misses"]}
    # Each layer then needs its own copy, so each is the measured-slower class.
    assert reasons == {"slower on CPUExecutionProvider: 0.07 vs 0.06 ms": 2}
    attentions = [n for n in onnx.load(str(run.output)).graph.node if n.op_type == "Attention"]
    assert len(attentions) == 2
    assert all(len(n.input) > 5 and n.input[5] and not n.input[3] for n in attentions)
    assert onnx.checker.check_model(onnx.load(str(run.output)), full_check=True) is None
    assert_same_outputs(BERT, run.output)


# What each tuned class of the tiny BERT frees besides its matched nodes, cut at the model's
# own sizes: [(op types of the part, how many sites share it)], the site's own part first.
RELEASED = {
    # Each layer's Where turns the boolean padding mask into its additive bias (own); the
    # boolean mask, built once over Range grids, goes when both layers read the mask itself.
    "KeyPaddingMaskFusionPass": [
        ({"Where": 1}, 1),
        (
            {"Cast": 1, "Shape": 3, "Gather": 5, "Range": 3, "Unsqueeze": 12, "GreaterOrEqual": 1}
            | {"And": 2, "Flatten": 1, "Mul": 1, "Add": 1, "Reshape": 3, "Concat": 1}
            | {"Equal": 1, "Where": 1, "Expand": 1},
            2,
        ),
    ],
    # The output projection's bias Add, which SkipLayerNormalization takes in as its bias.
    "AddLayerNormFusionPass": [({"Add": 1}, 1)],
    # The position ids, which the embedding kernel computes itself.
    "EmbedLayerNormFusionPass": [
        (
            {"Gather": 2, "Unsqueeze": 2, "Slice": 1, "Shape": 1, "Concat": 1, "Reshape": 1}
            | {"Equal": 1, "Where": 1, "Expand": 2, "GatherElements": 1},
            1,
        ),
    ],
}


def _released_parts(
    model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[dict[str, list[tuple[dict[str, int], int]]], dict[str, Any], str]:
    """tune's freed parts per pass (each part's op types and sharing sites, as cut for the
    first site of each pass), the repository's sites it wrote and its progress."""
    parts: dict[str, list[tuple[dict[str, int], int]]] = {}
    cut_released = tune_module.cut_released

    def recording(ctx: Any, *args: Any) -> list[tuple[onnx.ModelProto, int]]:
        found = cut_released(ctx, *args)
        ops = [(dict(Counter(n.op_type for n in m.graph.node)), k) for m, k in found]
        parts.setdefault(ctx.spec.name, ops)
        return found

    monkeypatch.setattr(tune_module, "cut_released", recording, raising=True)
    repository = tmp_path / "released.json"
    result = run_cli(
        "tune", model, "--input_shape", SHAPES, "--repository", repository, "--budget", "0.3"
    )
    assert result.exit_code == 0, result.stderr + result.stdout
    (section,) = json.loads(repository.read_text())["sections"]
    return parts, section["sites"], result.stderr


def test_tune_charges_the_unfused_side_with_what_the_fusion_frees(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    parts, sites, progress = _released_parts(BERT, monkeypatch, tmp_path)
    # Progress says how much of the unfused time is freed work, and how widely it is shared.
    assert progress.count("freed with it, shared by 2 sites) -> ") == 2  # the two mask classes
    for pass_name, expected in RELEASED.items():
        assert parts[pass_name] == expected, pass_name
    # Passes whose match already holds all it frees have nothing more to charge.
    assert all(not parts[name] for name in TUNED_SITES if name not in RELEASED)
    for key, entry in sites.items():
        freed = RELEASED.get(entry["pass"])
        if freed is None:
            assert "released_ms" not in entry and "released_shared_by" not in entry, key
            continue
        # The charge is inside unfused_ms: the site's own part, and the shared part divided
        # among the layers that share it.
        assert 0 < entry["released_ms"] < entry["unfused_ms"], key
        shared_by = max((sites for _, sites in freed if sites > 1), default=0)
        assert entry.get("released_shared_by", 0) == shared_by, key


def test_what_a_graph_output_keeps_is_not_charged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The same BERT with the shared boolean mask also a graph output: it stays whatever the
    # attentions do, so only each layer's own conversion is charged.
    model = onnx.load(str(BERT))
    read_by_where = {name for n in model.graph.node if n.op_type == "Where" for name in n.input}
    expand = next(
        n for n in model.graph.node if n.op_type == "Expand" and n.output[0] in read_by_where
    )
    model.graph.output.append(
        helper.make_tensor_value_info(expand.output[0], TensorProto.BOOL, None)
    )
    kept = tmp_path / "kept_mask.onnx"
    onnx.save(model, str(kept))
    parts, sites, progress = _released_parts(kept, monkeypatch, tmp_path)
    assert parts["KeyPaddingMaskFusionPass"] == [({"Where": 1}, 1)]
    assert "shared by" not in progress
    masks = [e for e in sites.values() if e["pass"] == "KeyPaddingMaskFusionPass"]
    assert masks and all("released_shared_by" not in e and e["released_ms"] > 0 for e in masks)
    # The model optimized with that repository computes what the original does.
    run = optimize(kept, subdir(tmp_path, "out"), "--repository", tmp_path / "released.json")
    assert_same_outputs(kept, run.output)


def test_a_fused_op_the_provider_cannot_run_is_declined_with_its_refusal(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    # What tune records when the provider refuses the fused op (CUDA's FusedConv takes no
    # Clip): every site of the class stays unfused, the refusal is the reason.
    refusal = 'unsupported conv activation mode "Clip"'
    repository = with_decision(
        tuned[0], tmp_path / "refused.json", SKIP_LN, decision=UNSUPPORTED, error=refusal
    )
    run = optimize(BERT, tmp_path, "--repository", repository)
    assert run.op_counts()["SkipLayerNormalization"] == 0
    reasons = {miss["reason"]: miss["count"] for miss in run.passed(SKIP_LN)["near_misses"]}
    assert reasons == {f"does not run on CPUExecutionProvider: {refusal}": 4}
    report = run.report["repository"]
    assert report["declined"] == 4
    assert {d["error"] for d in report["decisions"] if d["pass"] == SKIP_LN} == {refusal}
    assert "4 as fused ops it does not run" in run.stderr
    ub = run.fusion_result["session_and_graph_id_0_0"]["ub_fusion"]
    assert ub[SKIP_LN]["repository_hit_times"] == "4"
    assert_same_outputs(BERT, run.output)
    listing = run_cli("passes", "--repository", repository)
    assert f"SkipLayerNormalization does not run: {refusal}" in listing.stdout


def test_a_refusal_decides_the_same_fusion_at_other_sizes(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    # A provider refuses a fused op for what it computes, not for its sizes: a refusal measured
    # at hidden size 768 decides the tiny BERT's hidden-32 norms; one of another activation
    # decides nothing (CUDA's FusedConv refuses Clip and runs Relu).
    document = json.loads(tuned[0].read_text())
    (section,) = document["sections"]
    sites = {}
    for key, site in section["sites"].items():
        at_768 = [signature.replace("32", "768") for signature in site["inputs"]]
        if site["pass"] == SKIP_LN:
            site = dict(site, decision=UNSUPPORTED, error="no kernel", inputs=at_768)
        elif site["pass"] == "GemmActivationFusionPass":
            relu = dict(site["attributes"], activation="Relu")
            site = dict(site, decision=UNSUPPORTED, error="no Relu", inputs=at_768, attributes=relu)
        else:
            site = dict(site, decision=FUSED)
        sites[key.replace("32", "768").replace("Tanh", "Relu")] = site
    section["sites"] = sites
    repository = tmp_path / "refusals.json"
    repository.write_text(json.dumps(document))
    run = optimize(BERT, tmp_path, "--repository", repository)
    assert run.op_counts()["SkipLayerNormalization"] == 0
    reasons = {miss["reason"]: miss["count"] for miss in run.passed(SKIP_LN)["near_misses"]}
    assert reasons == {"does not run on CPUExecutionProvider: no kernel": 4}
    assert run.op_counts()["FusedGemm"] == 1
    gemm = run.passed("GemmActivationFusionPass").get("near_misses", [])
    assert not [miss for miss in gemm if miss["reason"].startswith("does not run on")]
    assert_same_outputs(BERT, run.output)


def _conv_relu(path: Path, size: int, *, named: bool = True) -> Path:
    """x [1, 3, size, size] -> Conv (1x1, 4 channels) -> Relu (nodes named, or not)."""
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array(rng.normal(size=(4, 3, 1, 1)).astype(np.float32), "w"),
        onnx.numpy_helper.from_array(np.zeros(4, np.float32), "b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv" if named else ""),
        helper.make_node("Relu", ["c"], ["y"], name="relu" if named else ""),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, size, size])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_tune_measures_a_model_whose_nodes_have_no_names(tmp_path: Path) -> None:
    # onnx.helper writes nodes without names; a site is then found again at the tuning shapes
    # by its nodes' outputs (it was "not there once the inputs are fixed", never measured).
    model = _conv_relu(tmp_path / "unnamed.onnx", 8, named=False)
    repository = tmp_path / "repository.json"
    tuned = run_cli("tune", model, "--repository", repository, "--budget", "0.2")
    assert tuned.exit_code == 0, tuned.stderr
    assert "1 site(s) in 1 class(es)" in tuned.stderr and "0 not measured" in tuned.stderr
    (section,) = load_repository(repository).sections
    (entry,) = section.sites.values()
    assert entry["pass"] == "ConvActivationFusionPass" and entry["fused_ms"] > 0


@pytest.mark.usefixtures("restore_registry")
def test_tune_records_a_fused_op_the_provider_refuses(tmp_path: Path) -> None:
    # A custom pass emitting a FusedConv whose activation no CPU kernel knows: the unfused Conv
    # and Relu load, the fused op does not. tune records the refusal; optimize then declines
    # the site, and the refusal decides the same fusion at another input size.
    load_builtin_passes()
    register_replacement(
        "UnknownActivationConvPass",
        lambda op, x, w, b: op.Relu(op.Conv(x, w, b)),
        lambda op, x, w, b: op.FusedConv(x, w, b, activation="Unknown", _domain=MS),
        emits=("FusedConv",),
        emits_domain=MS,
        targets=("ort",),
    )
    model = _conv_relu(tmp_path / "conv_relu.onnx", 8)
    repository = tmp_path / "repository.json"
    switches = ("--disable_pass", "ConvActivationFusionPass")
    tuned = run_cli("tune", model, "--repository", repository, "--budget", "0.2", *switches)
    assert tuned.exit_code == 0, tuned.stderr
    assert "the fused op does not run on CPUExecutionProvider: " in tuned.stderr
    assert "1 not run by the provider fused" in tuned.stderr
    (section,) = load_repository(repository).sections
    (entry,) = section.sites.values()
    assert entry["decision"] == UNSUPPORTED and "fused_ms" not in entry
    # onnxruntime's status prefix is trimmed to its reason
    assert "GetFusedActivationAttr" in entry["error"] and "[ONNXRuntimeError]" not in entry["error"]
    for size in (8, 16):
        source = _conv_relu(tmp_path / f"conv_relu_{size}.onnx", size)
        run = optimize(source, subdir(tmp_path, str(size)), "--repository", repository, *switches)
        assert run.op_counts()["FusedConv"] == 0 and run.op_counts()["Relu"] == 1
        reasons = [m["reason"] for m in run.passed("UnknownActivationConvPass")["near_misses"]]
        assert reasons == [f"does not run on CPUExecutionProvider: {entry['error']}"]
        assert_same_outputs(source, run.output)


def _residual_norm(path: Path, size: int) -> Path:
    """x [1, size, 8] + a constant [8] row -> LayerNormalization: a residual broadcast."""
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array(rng.normal(size=8).astype(np.float32), name)
        for name in ("row", "gamma", "beta")
    ]
    nodes = [
        helper.make_node("Add", ["x", "row"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "residual_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, size, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, size, 8])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.usefixtures("restore_registry")
def test_tune_records_a_fused_op_the_provider_refuses_at_run_time(tmp_path: Path) -> None:
    # A custom pass hands SkipLayerNormalization a one-dimensional skip: the session loads, and
    # the kernel refuses it when it runs ("skip is expected to have 3 or 2 dimensions"), on the
    # inputs the unfused Add and LayerNormalization compute with. That is the provider's
    # refusal, recorded as such (as CUDA's of GroupQueryAttention without present outputs).
    load_builtin_passes()
    register_replacement(
        "OneDimensionalSkipPass",
        lambda op, x, row, g, b: op.LayerNormalization(op.Add(x, row), g, b, axis=-1),
        lambda op, x, row, g, b: op.SkipLayerNormalization(x, row, g, b, _domain=MS),
        emits=("SkipLayerNormalization",),
        emits_domain=MS,
        targets=("ort",),
    )
    model = _residual_norm(tmp_path / "residual_norm.onnx", 4)
    repository = tmp_path / "repository.json"
    switches = ("--disable_pass", SKIP_LN)
    tuned = run_cli("tune", model, "--repository", repository, "--budget", "0.2", *switches)
    assert tuned.exit_code == 0, tuned.stderr
    assert "1 not run by the provider fused" in tuned.stderr
    (section,) = load_repository(repository).sections
    (entry,) = section.sites.values()
    assert entry["decision"] == UNSUPPORTED and "fused_ms" not in entry
    assert entry["error"].endswith("skip is expected to have 3 or 2 dimensions, got 1")
    for size in (4, 6):
        source = _residual_norm(tmp_path / f"residual_norm_{size}.onnx", size)
        run = optimize(source, subdir(tmp_path, str(size)), "--repository", repository, *switches)
        assert run.op_counts()["SkipLayerNormalization"] == 0
        reasons = [m["reason"] for m in run.passed("OneDimensionalSkipPass")["near_misses"]]
        assert reasons == [f"does not run on CPUExecutionProvider: {entry['error']}"]
        assert_same_outputs(source, run.output)


def test_a_fused_op_failing_on_a_value_only_it_reads_is_not_measured(tmp_path: Path) -> None:
    # Near miss: the tiny LLaMA's later GroupQueryAttention sites read the total length the
    # first one computes. Cut out alone, that value is generated and the kernel rejects it:
    # the inputs', not the provider's, so the class is left unmeasured, not refused.
    repository = tmp_path / "repository.json"
    model = FIXTURES / "llama_tiny_ts17.onnx"
    tuned = run_cli("tune", model, "--repository", repository, "--budget", "0.2")
    assert tuned.exit_code == 0, tuned.stderr
    assert "1 not measured" in tuned.stderr and "0 not run by the provider" in tuned.stderr
    assert "total_sequence_length must be at least kv_sequence_length" in tuned.stderr
    (section,) = load_repository(repository).sections
    assert all(entry["decision"] != UNSUPPORTED for entry in section.sites.values())


def test_a_class_measured_with_symbolic_sizes_covers_fixed_ones(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    """Measured as float[?,?,32] (any batch and length), the verdict holds for a model whose
    sizes are fixed: the same export with --input_shape."""
    repository = with_decision(
        tuned[0], tmp_path / "slow.json", SKIP_LN, decision=UNFUSED, fused_ms=0.49, unfused_ms=0.06
    )
    run = optimize(BERT, tmp_path, "--repository", repository, "--input_shape", SHAPES)
    # At fixed sizes the embeddings (their position rows a constant) are still
    # EmbedLayerNormalization's, before the skip norm could take their sum.
    assert run.op_counts()["SkipLayerNormalization"] == 0
    assert run.op_counts()["EmbedLayerNormalization"] == 1
    decided = [d for d in run.report["repository"]["decisions"] if d["pass"] == SKIP_LN]
    assert len(decided) == 4 and all("float[?,?,32]" in d["class"] for d in decided)
    feeds = random_feeds(run.output)  # at the fixed sizes
    for want, got in zip(run_model(BERT, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_faster_decisions_fuse_and_count_as_hits(tuned: tuple[Path, Any], tmp_path: Path) -> None:
    repository = with_decision(tuned[0], tmp_path / "fast.json", SKIP_LN, decision="fused")
    run = optimize(BERT, tmp_path, "--repository", repository)
    assert run.op_counts()["SkipLayerNormalization"] == 4
    ub = run.fusion_result["session_and_graph_id_0_0"]["ub_fusion"]
    assert ub[SKIP_LN]["repository_hit_times"] == "4"
    assert sum(int(entry["repository_hit_times"]) for entry in ub.values()) == sum(
        TUNED_SITES.values()
    )


def test_unseen_classes_and_other_providers_keep_the_pass_default(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    repository = with_decision(
        tuned[0], tmp_path / "slow.json", SKIP_LN, decision=UNFUSED, fused_ms=0.5, unfused_ms=0.1
    )
    # A model whose sites are of other classes (other fused ops: RMS norms, rotary, grouped
    # attention): nothing is declined. (GPT-2's skip norms are BERT's class but for their
    # epsilon, which decides nothing: test_a_decision_holds_for_another_epsilon.)
    llama = optimize(
        FIXTURES / "llama_tiny_ts17.onnx", subdir(tmp_path, "llama"), "--repository", repository
    )
    ub = llama.fusion_result["session_and_graph_id_0_0"]["ub_fusion"]
    assert all(entry["repository_hit_times"] == "0" for entry in ub.values())
    assert sum(int(entry["effect_times"]) for entry in ub.values()) > 0
    # The repository measured CPU only: for CUDA (installed here or not) it decides nothing.
    cuda = optimize(
        BERT, subdir(tmp_path, "cuda"), "--providers", "cuda", "--repository", repository
    )
    assert cuda.op_counts()["SkipLayerNormalization"] == 4
    assert cuda.report["options"]["providers"] == ["CUDAExecutionProvider"]


def test_a_section_measured_elsewhere_applies_with_a_warning(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    document = json.loads(tuned[0].read_text())
    document["sections"][0]["onnxruntime"] = "0.0.1"
    other = tmp_path / "old.json"
    other.write_text(json.dumps(document))
    repository = with_decision(other, other, SKIP_LN, decision=UNFUSED)
    run = optimize(BERT, tmp_path, "--repository", repository)
    assert "measured with onnxruntime 0.0.1, this is " + ort.__version__ in run.stderr
    assert run.op_counts()["SkipLayerNormalization"] == 0


@pytest.mark.parametrize("here_decides", [UNFUSED, FUSED])
def test_the_section_of_this_cpu_decides_among_several(
    tuned: tuple[Path, Any], tmp_path: Path, here_decides: str
) -> None:
    """A repository measured on several CPUs (the shipped one is) decides by the section of
    this machine's CPU, wherever it stands in the file, and without a warning."""
    here = json.loads(
        with_decision(tuned[0], tmp_path / "here.json", SKIP_LN, decision=here_decides).read_text()
    )["sections"][0]
    elsewhere = json.loads(json.dumps(here))
    elsewhere["device"] = "a CPU no machine has"
    for site in elsewhere["sites"].values():
        if site["pass"] == SKIP_LN:
            site["decision"] = FUSED if here_decides == UNFUSED else UNFUSED
    document = json.loads(tuned[0].read_text())
    document["sections"] = [here, elsewhere]  # the other CPU's last: not taken by position
    repository = tmp_path / "two_cpus.json"
    repository.write_text(json.dumps(document))
    run = optimize(BERT, tmp_path, "--repository", repository)
    assert "measured on" not in run.stderr
    assert run.op_counts()["SkipLayerNormalization"] == (0 if here_decides == UNFUSED else 4)
    assert run.passed(SKIP_LN)["repository_hits"] == 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "knowledge repository is not valid JSON"),
        ("[]", "not a fusectl knowledge repository: the document is not an object"),
        ('{"format": "x", "version": 1, "sections": []}', '"format" is not "fusectl-repository"'),
        ('{"format": "fusectl-repository", "version": 9, "sections": []}', '"version" 9'),
        (
            '{"format": "fusectl-repository", "version": 1, "sections": [{"provider": '
            '"CPUExecutionProvider", "onnxruntime": "1", "device": "d", "sites": {"k": '
            '{"decision": "maybe", "fused_ms": 1, "unfused_ms": 1}}}]}',
            "sections[0].sites['k'].decision is 'maybe'",
        ),
        (
            '{"format": "fusectl-repository", "version": 1, "sections": [{"provider": '
            '"CPUExecutionProvider", "onnxruntime": "1", "device": "d", "sites": {"k": '
            '{"decision": "unfused", "fused_ms": -1, "unfused_ms": 1}}}]}',
            "fused_ms is not a non-negative number",
        ),
        (
            '{"format": "fusectl-repository", "version": 1, "sections": [{"provider": '
            '"CPUExecutionProvider", "onnxruntime": "1", "device": "d", "sites": {"k": '
            '{"decision": "unsupported"}}}]}',
            "sections[0].sites['k'].error is not a string",
        ),
    ],
)
def test_a_bad_repository_is_one_line_and_exit_2(
    tmp_path: Path, content: str, message: str
) -> None:
    repository = tmp_path / "bad.json"
    repository.write_text(content)
    run = optimize(BERT, tmp_path, "--repository", repository, expect=2)
    assert message in run.stderr and str(repository) in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not run.output.exists() and not run.fusion_result_path.exists()


def test_missing_repository_unknown_provider_and_repository_over_the_input(tmp_path: Path) -> None:
    missing = optimize(BERT, tmp_path, "--repository", tmp_path / "nope.json", expect=2)
    assert "knowledge repository not found" in missing.stderr
    unknown = optimize(BERT, tmp_path, "--providers", "abacus", expect=2)
    assert "--providers: 'abacus' is not an onnxruntime execution provider" in unknown.stderr
    model = tmp_path / "model.onnx"
    model.write_bytes(BERT.read_bytes())
    over = run_cli("tune", model, "--repository", model, "--input_shape", SHAPES)
    assert over.exit_code == 2 and "fusectl never modifies its input" in over.stderr
    assert model.read_bytes() == BERT.read_bytes()


def test_the_shipped_repository_and_its_provenance() -> None:
    shipped = load_repository(shipped_path())
    sections = [s for s in shipped.sections if s.provider == "CPUExecutionProvider"]
    # One section per CPU it was measured on (an AMD EPYC and an Intel Xeon).
    assert len({section.device for section in sections}) == len(sections) == 2
    listing = run_cli("passes")
    assert listing.exit_code == 0
    catalogue = json.loads(run_cli("passes", "--json").stdout)
    (skip,) = (entry for entry in catalogue if entry["name"] == SKIP_LN)
    verdicts = {verdict["provenance"]: verdict for verdict in skip["repository"]}
    taken, _ = shipped.section("CPUExecutionProvider")
    for section in sections:
        assert section.onnxruntime and section.device and section.measured and section.models
        unfused = {e["pass"] for e in section.sites.values() if e["decision"] == UNFUSED}
        assert SKIP_LN in unfused  # onnxruntime's CPU SkipLayerNormalization is the slow kernel
        (line,) = [
            line
            for line in listing.stdout.splitlines()
            if line.startswith(f"  {section.provenance}: {len(section.sites)} site class(es)")
        ]
        # the section this machine's CPU takes is marked, and only that one
        assert line.endswith("; the one this machine takes") == (section is taken)
        assert verdicts[section.provenance]["unfused"]


CUDA_GQA_REFUSALS = {
    # CUDA has no float32 GroupQueryAttention: onnxruntime places it on the CPU (measured).
    "llama_tiny_ts17": "no CUDAExecutionProvider kernel for com.microsoft.GroupQueryAttention "
    "with these types: onnxruntime runs it on CPUExecutionProvider",
    "llama_tiny_dynamo": "no CUDAExecutionProvider kernel for com.microsoft.GroupQueryAttention "
    "with these types: onnxruntime runs it on CPUExecutionProvider",
    # This float16 export runs its attention in float32 (Casts before it): the same.
    "fp16_llama_tiny_ts17": "no CUDAExecutionProvider kernel for "
    "com.microsoft.GroupQueryAttention with these types: onnxruntime runs it on "
    "CPUExecutionProvider",
    # The float16 kernel loads and refuses to run without present_key / present_value.
    "fp16_llama_tiny_dynamo": "present_key and present_value are required unless borrowing a "
    "non-quantized KV cache",
}


@pytest.mark.parametrize("fixture", sorted(CUDA_GQA_REFUSALS))
def test_the_shipped_cuda_section_declines_the_attention_cuda_cannot_run(
    fixture: str, tmp_path: Path
) -> None:
    # Measured on the shipped section's LLaMA (hidden 2048, 16/4 heads); refusals decide every
    # size and export of the same kernel and types. MultiHeadAttention takes the attention.
    model = FIXTURES / f"{fixture}.onnx"
    run = optimize(model, tmp_path, "--providers", "cuda")
    ops = run.op_counts()
    assert ops["GroupQueryAttention"] == 0 and ops["MultiHeadAttention"] == 2
    reasons = {m["reason"] for m in run.passed("GroupQueryAttentionFusionPass")["near_misses"]}
    (reason,) = reasons
    assert reason.startswith("does not run on CUDAExecutionProvider: ")
    assert reason.endswith(CUDA_GQA_REFUSALS[fixture])
    # The declined sites leave nothing behind (the constants their replacement would read).
    written = onnx.load(str(run.output))
    read = {name for node in written.graph.node for name in node.input}
    assert [i.name for i in written.graph.initializer if i.name not in read] == []
    tolerance = 1e-2 if fixture.startswith("fp16") else 1e-4
    assert_same_outputs(model, run.output, atol=tolerance, rtol=tolerance)
    # For the CPU provider (the default) the same model keeps its GroupQueryAttention.
    assert optimize(model, subdir(tmp_path, "cpu")).op_counts()["GroupQueryAttention"] == 2


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> ort.InferenceSession:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_timing_separates_a_clearly_slower_kernel() -> None:
    weight = onnx.numpy_helper.from_array(np.eye(256, dtype=np.float32), "w")
    chain = [helper.make_node("MatMul", ["x", "w"], ["m0"])]
    chain += [helper.make_node("MatMul", [f"m{i}", "w"], [f"m{i + 1}"]) for i in range(7)]
    chain.append(helper.make_node("Identity", ["m7"], ["y"]))
    slow = _model(chain, [weight])
    fast = _model([helper.make_node("Identity", ["x"], ["y"])], [])
    feeds = {"x": np.ones((64, 256), np.float32)}
    assert time_pair(slow, fast, feeds, budget_s=2.0).verdict == UNFUSED
    assert time_pair(fast, slow, feeds, budget_s=2.0).verdict == "fused"


def test_tune_feeds_a_cut_mask_as_the_model_is_fed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The key-padding-mask cut reads the model's attention_mask as its input v<n>. Fed random
    # 0/1 keys, the fused attention took a slower masked path on the CPU (4.8 vs 3.6 ms a site
    # in BERT-base) than the unfused one, whose generated additive mask drops nothing.
    generate = tune_module.generate_feeds
    kinds: dict[str, str] = {}

    def recording(model: Any, *args: Any, **kwargs: Any) -> Any:
        feeds, plans = generate(model, *args, **kwargs)
        for name, plan in plans.items():
            kinds[(kwargs.get("names") or {}).get(name, name)] = plan.kind
        return feeds, plans

    monkeypatch.setattr(tune_module, "generate_feeds", recording, raising=True)
    result = run_cli(
        "tune",
        BERT,
        "--input_shape",
        SHAPES,
        "--repository",
        tmp_path / "r.json",
        "--budget",
        "0.2",
    )
    assert result.exit_code == 0, result.stderr + result.stdout
    assert kinds["attention_mask"] == "mask"


def test_timing_charges_the_unfused_side_with_freed_work() -> None:
    # The same kernel on both sides, but the unfused one keeps the slow chain alive: its share
    # (here all of it) is charged to the unfused side, so fusing is the faster.
    weight = onnx.numpy_helper.from_array(np.eye(256, dtype=np.float32), "w")
    chain = [helper.make_node("MatMul", ["x", "w"], ["m0"])]
    chain += [helper.make_node("MatMul", [f"m{i}", "w"], [f"m{i + 1}"]) for i in range(7)]
    chain.append(helper.make_node("Identity", ["m7"], ["y"]))
    freed = tune_module.Freed(_model(chain, [weight]), {"x": np.ones((64, 256), np.float32)}, 1)
    same = _model([helper.make_node("Identity", ["x"], ["y"])], [])
    feeds = {"x": np.ones((64, 256), np.float32)}
    timing = time_pair(same, same, feeds, budget_s=2.0, freed=[freed])
    assert timing.verdict == "fused"
    assert 0 < timing.released_ms < timing.unfused_ms


def test_api_optimize_takes_providers_and_repository(
    tuned: tuple[Path, Any], tmp_path: Path
) -> None:
    repository = with_decision(
        tuned[0], tmp_path / "slow.json", SKIP_LN, decision=UNFUSED, fused_ms=0.49, unfused_ms=0.06
    )
    result = fusectl.optimize(str(BERT), providers="cpu", repository=repository)
    assert result.repository is not None and len(result.repository.decisions) == 12
    ops = Counter(node.op_type for node in result.model.graph)
    assert ops["SkipLayerNormalization"] == 0
    with pytest.raises(FusectlError, match="not an onnxruntime execution provider"):
        fusectl.optimize(str(BERT), providers="abacus")


def test_a_section_measured_on_another_device_warns_only_after_a_run(tmp_path: Path) -> None:
    """The shipped CPU section measured on another CPU applies with a warning once the run has
    succeeded; a bad input gets its one line and nothing before it (on a CPU other than the
    one the shipped repository was measured on, the warning came first)."""
    document = json.loads((Path(fusectl.__file__).parent / "data/repository.json").read_text())
    for section in document["sections"]:
        section["device"] = "a CPU no machine has"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(document))
    good = optimize(BERT, subdir(tmp_path, "good"), "--repository", elsewhere)
    assert "measured on a CPU no machine has" in good.stderr
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(BERT.read_bytes()[:1000])
    result = run_cli("optimize", broken, "-o", tmp_path / "out.onnx", "--repository", elsewhere)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusectl: error: "), result.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_a_decision_holds_for_another_epsilon(tuned: tuple[Path, Any], tmp_path: Path) -> None:
    """A norm measured with BERT's epsilon of 1e-12 decides for the same norm with Flax's 1e-6:
    a floating-point attribute changes what a kernel computes, not how long it takes. (A Flax
    encoder's skip norms were fused, 5% slower, for want of a class with its epsilon.)"""
    repository = with_decision(
        tuned[0], tmp_path / "slow.json", SKIP_LN, decision=UNFUSED, fused_ms=0.49, unfused_ms=0.06
    )
    model = onnx.load(str(BERT))
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            for attribute in node.attribute:
                if attribute.name == "epsilon":
                    attribute.f = 1e-6
    other = tmp_path / "bert_epsilon.onnx"
    onnx.save(model, str(other))
    kept = optimize(other, subdir(tmp_path, "kept"), "--repository", repository)
    entry = kept.passed(SKIP_LN)
    assert (entry["matched"], entry["effected"], entry["repository_hits"]) == (4, 0, 4)
    assert kept.op_counts()["SkipLayerNormalization"] == 0
    assert_same_outputs(other, kept.output)


@pytest.mark.parametrize(("fused_ms", "declined"), [(0.49, 4), (0.07, 0)])
def test_a_decisive_verdict_holds_for_another_spelling(
    tuned: tuple[Path, Any], tmp_path: Path, fused_ms: float, declined: int
) -> None:
    """The skip norm measured where BERT's norm is a LayerNormalization (opset 17) decides
    where the same norm is written out (opset 14: pattern AddLayerNormPow, its epsilon and
    exponent inputs of the site) when the verdict is decisive (the kernel 8x slower), not
    when it is close (a few element-wise ops more or less could turn it)."""
    repository = with_decision(
        tuned[0], tmp_path / "r.json", SKIP_LN, decision=UNFUSED, fused_ms=fused_ms, unfused_ms=0.06
    )
    written_out = FIXTURES / "bert_tiny_ts14.onnx"
    run = optimize(written_out, tmp_path, "--input_shape", SHAPES, "--repository", repository)
    entry = run.passed(SKIP_LN)
    assert run.passed(SKIP_LN)["patterns"]["AddLayerNormPow"]["matched"] == 4
    assert (entry["effected"], entry["repository_hits"]) == (4 - declined, declined)
    assert run.op_counts()["SkipLayerNormalization"] == 4 - declined
