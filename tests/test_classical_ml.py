"""Classical-ML models (scikit-learn through skl2onnx): map-typed inputs and outputs, which
onnx-ir has no type for, string tensors, and the ai.onnx.ml ops no pass rewrites.

Fixtures: tests/fixtures/make_ml_fixtures.py (run in a venv with scikit-learn and skl2onnx).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import fusectl
from fusectl.diagnostics.verify import Tolerance, compare
from tests.conftest import digest, optimize, run_cli
from tests.pass_helpers import check_output, fixture_path

MLP = fixture_path("sklearn_mlp_zipmap")
FOREST = fixture_path("sklearn_forest_zipmap")
DICT_INPUT = fixture_path("sklearn_dictvectorizer")


def _outputs(path: Path, features: np.ndarray) -> list:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"X": features})


def _type_of(model: onnx.ModelProto, name: str) -> onnx.TypeProto:
    return next(info.type for info in model.graph.output if info.name == name)


@pytest.mark.parametrize(
    ("fixture", "key", "ops"),
    [
        (MLP, "string", {"FusedGemm": 2, "Gemm": 1, "MatMul": 0, "Add": 0, "Relu": 0}),
        (FOREST, "int64", {"TreeEnsembleClassifier": 1, "ZipMap": 1}),
    ],
)
def test_a_zipmap_classifier_is_optimized_with_its_map_output_kept(
    fixture: Path, key: str, ops: dict[str, int], tmp_path: Path
) -> None:
    """onnx-ir raises on map types: these models were refused as "malformed" before."""
    run = optimize(fixture, tmp_path)
    check_output(run)
    counts = run.op_counts()
    assert {op: counts.get(op, 0) for op in ops} == ops
    original, saved = onnx.load(str(fixture)), onnx.load(str(run.output))
    assert _type_of(saved, "output_probability") == _type_of(original, "output_probability")
    assert fusectl.verify(fixture, run.output).passed
    features = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    (want_labels, want_maps), (labels, maps) = (
        _outputs(fixture, features),
        _outputs(run.output, features),
    )
    np.testing.assert_array_equal(labels, want_labels)
    assert [sorted(m) for m in maps] == [sorted(m) for m in want_maps]
    for got, want in zip(maps, want_maps, strict=True):
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), atol=1e-5)


def test_the_mlp_layers_fuse_with_exact_counts(tmp_path: Path) -> None:
    run = optimize(MLP, tmp_path)
    assert run.counts("MatMulBiasAddFusionPass") == (3, 3)
    assert run.counts("GemmActivationFusionPass") == (2, 2)
    assert run.report["model"]["before"]["nodes"] == 15
    assert run.report["model"]["after"]["nodes"] == 8


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    folders = [tmp_path / name for name in "abc"]
    for folder in folders:
        folder.mkdir()
    first = optimize(MLP, folders[0])
    second = optimize(first.output, folders[1])
    assert second.report["model"]["after"]["nodes"] == first.report["model"]["after"]["nodes"]
    third = optimize(second.output, folders[2])
    assert digest(third.output) == digest(second.output)


def test_the_in_memory_model_is_left_as_it_was_and_the_result_keeps_its_maps() -> None:
    proto = onnx.load(str(MLP))
    before = proto.SerializeToString()
    result = fusectl.optimize(proto)
    assert proto.SerializeToString() == before
    saved = result.to_proto()
    onnx.checker.check_model(saved, full_check=True)
    assert _type_of(saved, "output_probability") == _type_of(proto, "output_probability")


def test_every_graph_dump_is_a_valid_model(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    optimize(MLP, tmp_path, "--dump_graph", dumps)
    files = sorted(dumps.glob("*.onnx"))
    assert [f.name.split("_", 1)[1] for f in files] == [
        "original.onnx",
        "IdentityEliminationPass.onnx",
        "MatMulBiasAddFusionPass.onnx",
        "GemmActivationFusionPass.onnx",
    ]
    for dump in files:
        onnx.checker.check_model(str(dump), full_check=True)


def test_verify_compares_the_sequence_of_maps(tmp_path: Path) -> None:
    run = optimize(FOREST, tmp_path)
    result = run_cli("verify", FOREST, run.output, "--json")
    assert result.exit_code == 0, result.stderr
    outputs = {o["name"]: o for o in json.loads(result.stdout)["outputs"]}
    assert outputs["output_probability"]["dtype"] == "seq(map(int64, float64))"
    assert outputs["output_probability"]["shape"] == [8 * 3]  # 8 generated rows, 3 classes
    assert outputs["output_label"]["passed"] and outputs["output_probability"]["passed"]


def test_a_map_input_is_optimized_and_verify_says_it_cannot_feed_it(tmp_path: Path) -> None:
    run = optimize(DICT_INPUT, tmp_path)
    check_output(run)
    saved = onnx.load(str(run.output))
    assert saved.graph.input[0].type == onnx.load(str(DICT_INPUT)).graph.input[0].type
    result = run_cli("verify", DICT_INPUT, run.output)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "fusectl: error: input 'features' is a map(string, tensor(float)), not a tensor; "
        "fusectl generates tensors only, and an .npz file holds tensors only"
    )


def _string_lookup(path: Path) -> Path:
    """ai.onnx.ml's LabelEncoder from strings to ids, then a float Mul: a string input."""
    encode = helper.make_node(
        "LabelEncoder",
        ["word"],
        ["id"],
        domain="ai.onnx.ml",
        keys_strings=["a", "b", "c"],
        values_int64s=[1, 2, 3],
        default_int64=0,
    )
    nodes = [
        encode,
        helper.make_node("Cast", ["id"], ["idf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["idf", "one"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lookup",
        [helper.make_tensor_value_info("word", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


def test_string_inputs_come_from_an_npz_file(tmp_path: Path) -> None:
    model = _string_lookup(tmp_path / "lookup.onnx")
    run = optimize(model, tmp_path)
    assert run.op_counts()["Mul"] == 0  # x * 1
    feeds = tmp_path / "words.npz"
    np.savez(feeds, word=np.array(["a", "c", "zz", "b"]))
    result = run_cli("verify", model, run.output, "--inputs", feeds, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["inputs"]["word"] == {
        "dtype": "<U2",
        "shape": [4],
        "kind": "file",
        "high": None,
    }
    np.savez(feeds, word=np.arange(4.0))
    result = run_cli("verify", model, run.output, "--inputs", feeds)
    assert result.exit_code == 2
    assert "input 'word' is float64, the model declares strings" in result.stderr


def test_compare_names_where_a_structure_differs() -> None:
    tolerance = Tolerance(1e-6, 1e-5, "exact")
    want = [{0: 0.25, 1: 0.75}, {0: 0.5, 1: 0.5}]
    assert compare("p", want, [dict(m) for m in want], tolerance).passed
    moved = compare("p", want, [{0: 0.25, 1: 0.75}, {0: 0.5, 1: 0.6}], tolerance)
    assert not moved.passed
    assert moved.note == "worst at [1][1]"
    assert moved.max_abs == pytest.approx(0.1)
    keys = compare("p", want, [{0: 0.25, 1: 0.75}, {0: 0.5, 2: 0.5}], tolerance)
    assert not keys.passed
    assert (
        keys.note == "seq(map(int64, float64)) with 4 value(s) expected; first difference at [1][1]"
    )
    shorter = compare("p", want, want[:1], tolerance)
    assert not shorter.passed and shorter.shape == (2,)


def test_compare_strings_exactly() -> None:
    tolerance = Tolerance(1e-6, 1e-5, "exact")
    words = np.array(["cat", "dog", "bird"], dtype=object)
    assert compare("label", words, words.copy(), tolerance).passed
    changed = compare("label", words, np.array(["cat", "dog", "fish"], dtype=object), tolerance)
    assert not changed.passed
    assert changed.note == "1 of 3 differ; first 'fish', expected 'bird'"
    assert changed.worst_index == (2,)
