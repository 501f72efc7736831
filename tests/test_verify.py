"""`fusectl verify` and `optimize --verify` on real fixtures: verdicts, inputs, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from fusectl.core.model_io import load_model
from fusectl.diagnostics.inputs import InputSpec, generate_feeds, resolve_dims
from fusectl.diagnostics.verify import TOLERANCES, default_tolerance
from fusectl.rewrite.registry import Numerics
from tests.conftest import FIXTURES, optimize, run_cli, run_model
from tests.pass_helpers import const, save_model, value

LLAMA = FIXTURES / "llama_tiny_ts17.onnx"
BERT = FIXTURES / "bert_tiny_dynamo.onnx"
GPT2 = FIXTURES / "gpt2_tiny_ts17.onnx"


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each transformer fixture optimized once for the whole module."""
    out = tmp_path_factory.mktemp("verify")
    return {model.stem: optimize(model, out).output for model in (LLAMA, BERT, GPT2)}


def verify_json(*args: str | Path, expect: int) -> dict:
    result = run_cli("verify", *args, "--json")
    assert result.exit_code == expect, result.stderr + result.stdout
    return json.loads(result.stdout)


@pytest.mark.parametrize("model", [LLAMA, BERT, GPT2], ids=lambda p: p.stem)
def test_optimized_fixture_verifies(model: Path, optimized: dict[str, Path]) -> None:
    result = run_cli("verify", model, optimized[model.stem])
    assert result.exit_code == 0, result.stderr
    assert "all outputs within tolerance" in result.stderr
    document = verify_json(model, optimized[model.stem], expect=0)
    # Attention / norm fusions reassociate: SPEC §6's tolerance, and the passes are named.
    assert document["tolerance"]["atol"] == 1e-4 and document["tolerance"]["rtol"] == 1e-3
    assert document["tolerance"]["numerics"] == "reassociating"
    assert "AttentionFusionPass" in " ".join(document["tolerance"]["passes"])
    for output in document["outputs"]:
        assert output["passed"] and output["max_abs"] < 1e-4


def test_a_model_against_itself_is_exact() -> None:
    document = verify_json(LLAMA, LLAMA, expect=0)
    assert document["tolerance"]["numerics"] == "exact"
    assert (document["tolerance"]["atol"], document["tolerance"]["rtol"]) == TOLERANCES[
        Numerics.EXACT
    ]
    assert document["outputs"][0]["max_abs"] == 0 and document["outputs"][0]["worst_index"] is None


def _pair(tmp_path: Path, delta_at: tuple[int, int], delta: float) -> tuple[Path, Path]:
    """Y = X + C, and a copy whose C differs in one element."""
    c = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    changed = c.copy()
    changed[delta_at] += delta
    paths = []
    for name, constant in (("a", c), ("b", changed)):
        paths.append(
            save_model(
                tmp_path / f"{name}.onnx",
                [helper.make_node("Add", ["X", "C"], ["Y"])],
                [value("X", [3, 4])],
                [value("Y", [3, 4])],
                [const("C", constant)],
            )
        )
    return paths[0], paths[1]


def test_mismatch_exits_1_with_the_worst_index(tmp_path: Path) -> None:
    original, changed = _pair(tmp_path, (1, 2), 0.5)
    result = run_cli("verify", original, changed)
    assert result.exit_code == 1
    assert "FAIL" in result.stderr and "[1, 2]" in result.stderr
    assert "verification failed: 1 of 1 output(s) beyond tolerance" in result.stderr
    check = verify_json(original, changed, expect=1)["outputs"][0]
    assert check["worst_index"] == [1, 2] and not check["passed"]
    assert check["max_abs"] == pytest.approx(0.5, rel=1e-5)
    assert check["actual"] - check["expected"] == pytest.approx(0.5, rel=1e-5)
    # A tolerance wide enough for the change passes; --atol/--rtol replace the default.
    assert verify_json(original, changed, "--atol", "0.6", expect=0)["passed"]


def test_nan_agrees_only_where_both_sides_have_it(tmp_path: Path) -> None:
    """A model whose output holds NaN (a mutated norm: the root of a negative mean) verifies
    against a copy with NaN in the same places; NaN on one side only is a mismatch."""
    (tmp_path / "both").mkdir()
    (tmp_path / "one").mkdir()
    original, same = _pair(tmp_path / "both", (0, 0), 0.0)
    for path in (original, same):
        model = onnx.load(path)
        model.graph.initializer[0].CopyFrom(
            numpy_helper.from_array(np.full((3, 4), np.nan, dtype=np.float32), "C")
        )
        onnx.save(model, path)
    document = verify_json(original, same, expect=0)
    assert document["passed"] and document["outputs"][0]["max_abs"] == 0
    finite, one_nan = _pair(tmp_path / "one", (2, 3), np.nan)
    check = verify_json(finite, one_nan, expect=1)["outputs"][0]
    assert not check["passed"] and check["worst_index"] == [2, 3]


def test_a_scalar_output_is_compared(tmp_path: Path) -> None:
    """An output of rank 0 (a sum over everything) verifies, and differs where it differs (its
    difference was a NumPy scalar, which the comparison could not index: an internal error)."""
    paths = []
    for name, offset in (("a", 0.0), ("b", 0.0), ("c", 0.5)):
        paths.append(
            save_model(
                tmp_path / f"{name}.onnx",
                [
                    helper.make_node("ReduceSum", ["X"], ["total"], keepdims=0),
                    helper.make_node("Add", ["total", "offset"], ["Y"]),
                ],
                [value("X", [3, 4])],
                [value("Y", [])],
                [const("offset", np.array(offset, np.float32))],
            )
        )
    same = verify_json(paths[0], paths[1], expect=0)["outputs"][0]
    assert same["passed"] and same["max_abs"] == 0 and same["shape"] == []
    differs = verify_json(paths[0], paths[2], expect=1)["outputs"][0]
    assert not differs["passed"] and differs["worst_index"] == []
    assert differs["max_abs"] == pytest.approx(0.5)


def test_perturbed_weight_of_an_optimized_llama_fails(
    tmp_path: Path, optimized: dict[str, Path]
) -> None:
    proto = onnx.load(str(optimized["llama_tiny_ts17"]))
    weights = max(
        (t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT),
        key=lambda t: int(np.prod(t.dims)),
    )
    array = numpy_helper.to_array(weights) + np.float32(0.05)  # every row a token may use
    weights.CopyFrom(numpy_helper.from_array(array, weights.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(proto, str(broken))
    result = run_cli("verify", LLAMA, broken)
    assert result.exit_code == 1, result.stderr
    assert "FAIL" in result.stderr and "last_hidden_state" in result.stderr


def test_integer_inputs_stay_in_range() -> None:
    model = load_model(LLAMA).model
    feeds, plans = generate_feeds(model, {"input_ids": [3, 50]}, seed=1)
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    assert ids.shape == mask.shape == (3, 50)  # the mask follows the shared symbolic dims
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 100
    assert len(np.unique(ids)) > 20  # spread over the vocabulary, not a constant
    assert plans["input_ids"].kind == "ids" and plans["input_ids"].high == 100
    assert set(np.unique(mask)) == {1} and plans["attention_mask"].kind == "mask"
    again, _ = generate_feeds(model, {"input_ids": [3, 50]}, seed=1)
    assert np.array_equal(again["input_ids"], ids)  # deterministic per seed
    other, _ = generate_feeds(model, {"input_ids": [3, 50]}, seed=2)
    assert not np.array_equal(other["input_ids"], ids)


def test_long_sequence_runs_without_gather_errors(optimized: dict[str, Path]) -> None:
    document = verify_json(
        LLAMA, optimized["llama_tiny_ts17"], "--input_shape", "input_ids:1,300", expect=0
    )
    assert document["inputs"]["input_ids"] == {
        "dtype": "int64",
        "shape": [1, 300],
        "kind": "ids",
        "high": 100,
    }
    assert document["inputs"]["attention_mask"]["shape"] == [1, 300]


def test_position_ids_are_in_range(tmp_path: Path) -> None:
    """ids gathered through a Cast, position ids 0..n-1, a mask found by its Cast to bool."""
    model = save_model(
        tmp_path / "pos.onnx",
        [
            helper.make_node("Cast", ["tok"], ["tok32"], to=onnx.TensorProto.INT32),
            helper.make_node("Gather", ["E", "tok32"], ["e"]),
            helper.make_node("Gather", ["P", "position_ids"], ["p"]),
            helper.make_node("Add", ["e", "p"], ["s"]),
            helper.make_node("Cast", ["keep"], ["keep_b"], to=onnx.TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["keep_b", "axes"], ["keep_u"]),
            helper.make_node("Where", ["keep_u", "s", "zero"], ["Y"]),
        ],
        [
            value("tok", ["b", "n"], onnx.TensorProto.INT64),
            value("position_ids", ["b", "n"], onnx.TensorProto.INT64),
            value("keep", ["b", "n"], onnx.TensorProto.INT64),
        ],
        [value("Y", ["b", "n", 4])],
        [
            const("E", np.ones((7, 4))),
            const("P", np.ones((5, 4))),
            const("axes", [-1], np.int64),
            const("zero", [0.0]),
        ],
    )
    feeds, plans = generate_feeds(load_model(model).model, {"tok": [2, 5]})
    assert plans["tok"].high == 7 and feeds["tok"].max() < 7
    assert feeds["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    assert plans["keep"].kind == "mask" and feeds["keep"].min() == 1


def test_a_cut_is_fed_by_what_its_inputs_were_called(tmp_path: Path) -> None:
    """tune's cuts name their inputs v0, v1... and record the model's names: a mask the cut
    only casts to int32 (the fused attention's key padding mask) is fed ones, as the whole model
    is, not random keys dropped, and position ids count up."""
    model = save_model(
        tmp_path / "cut.onnx",
        [
            helper.make_node("Cast", ["v0"], ["m32"], to=onnx.TensorProto.INT32),
            helper.make_node("Cast", ["v1"], ["p32"], to=onnx.TensorProto.INT32),
            helper.make_node("Add", ["m32", "p32"], ["Y"]),
        ],
        [
            value("v0", [2, 64], onnx.TensorProto.INT64),
            value("v1", [2, 64], onnx.TensorProto.INT64),
        ],
        [value("Y", [2, 64], onnx.TensorProto.INT32)],
        [],
    )
    cut = load_model(model).model
    blind, plans = generate_feeds(cut, seed=3)
    assert plans["v0"].kind == "integer" and blind["v0"].min() == 0  # random keys dropped
    names = {"v0": "attention_mask", "v1": "/inner/position_ids"}
    feeds, plans = generate_feeds(cut, seed=3, names=names)
    assert plans["v0"].kind == "mask" and feeds["v0"].min() == 1
    assert plans["v1"].kind == "positions" and feeds["v1"].tolist() == [list(range(64))] * 2


def test_an_original_onnxruntime_rejects_is_computed_as_onnx_defines_it(tmp_path: Path) -> None:
    """The dynamo exporter's opset-23 LLaMA runs on onnxruntime at batch 1 only (its
    RotaryEmbedding's caches have batch 1), so no generated size runs it. Its outputs come from
    onnx's reference evaluator instead, and the verdict says so; fusectl's output, which runs
    at batch 2, is compared with them. A model neither runs is still an error."""
    original = FIXTURES / "llama_tiny_dynamo23.onnx"
    output = optimize(original, tmp_path).output
    result = run_cli("verify", original, output)
    assert result.exit_code == 0, result.stderr
    assert "original computed by onnx's reference evaluator (onnxruntime cannot run it: " in (
        " ".join(result.stderr.split())
    )
    document = verify_json(original, output, expect=0)
    assert document["reference_evaluator"] == "onnx reference"
    assert "RotaryEmbedding" in document["reference_fallback"]
    assert document["inputs"]["input_ids"]["shape"] == [2, 8]
    assert all(check["passed"] and check["max_abs"] < 1e-4 for check in document["outputs"])
    ordinary = verify_json(LLAMA, LLAMA, expect=0)
    assert (ordinary["reference_evaluator"], ordinary["reference_fallback"]) == (
        "onnxruntime",
        None,
    )
    result = run_cli("verify", original, original)  # the optimized side must run on onnxruntime
    assert result.exit_code == 1
    assert f"verification failed: {original}: onnxruntime cannot run it: " in result.stderr


def test_a_model_that_does_not_run_on_guessed_sizes_says_so(tmp_path: Path) -> None:
    """Optimum declares an image's channels symbolic: generated 8 channels meet a 3-channel
    Conv. The one-line error names the generated inputs and the option that sets the sizes."""
    model = save_model(
        tmp_path / "channels.onnx",
        [helper.make_node("Conv", ["pixel_values", "W"], ["Y"])],
        [value("pixel_values", ["batch", "channels", "height", "width"])],
        [value("Y", ["batch", 4, "h", "w"])],
        [const("W", np.ones((4, 3, 3, 3)))],
    )
    result = run_cli("verify", model, model)
    assert result.exit_code == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"fusectl: error: {model}: onnxruntime cannot run it: ")
    # 512 would make the input 2 x 512^3 elements: the trying stops at 64.
    assert line.endswith(
        "(on generated pixel_values float32[2,8,8,8] float; free size 64 fails too; "
        "--input_shape sets the symbolic sizes, --inputs the data)"
    )
    result = run_cli("verify", model, model, "--input_shape", "pixel_values:1,3,5,5")
    assert result.exit_code == 0, result.stderr


def test_a_free_size_too_small_for_the_model_is_tried_larger(tmp_path: Path) -> None:
    """An audio front end's 50-sample window does not fit 8 generated samples (onnx-asr's
    preprocessors, wav2vec2's feature encoder): verify tries 64, and runs there."""
    model = save_model(
        tmp_path / "window.onnx",
        [helper.make_node("Conv", ["audio", "W"], ["Y"], strides=[10])],
        [value("audio", ["batch", 1, "samples"])],
        [value("Y", ["batch", 2, "frames"])],
        [const("W", np.ones((2, 1, 50)))],
    )
    result = run_cli("verify", model, model, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["inputs"]["audio"]["shape"] == [2, 1, 64]
    result = run_cli("verify", model, model, "--json", "--input_shape", "audio:1,1,50")
    assert json.loads(result.stdout)["inputs"]["audio"]["shape"] == [1, 1, 50]
    result = run_cli("verify", model, model, "--input_shape", "audio:1,1,8")
    assert result.exit_code == 2  # a size the user gave is not changed


def test_a_dimension_named_by_arithmetic_takes_its_value() -> None:
    specs = [
        InputSpec("ids", ir.DataType.INT64, ("batch", "sequence_length")),
        InputSpec("past", ir.DataType.FLOAT, ("batch", 2, "past_sequence_length", 16)),
        InputSpec("mask", ir.DataType.INT64, ("batch", "past_sequence_length + sequence_length")),
        InputSpec("both", ir.DataType.INT64, ("2*sequence_length - 1",)),
    ]
    dims = resolve_dims(specs, {"ids": [1, 5]})
    assert dims == {"ids": (1, 5), "past": (1, 2, 4, 16), "mask": (1, 9), "both": (9,)}


def test_input_shape_resolves_symbolic_dims(optimized: dict[str, Path]) -> None:
    document = verify_json(
        BERT, optimized["bert_tiny_dynamo"], "--input_shape", "input_ids:1,5", expect=0
    )
    shapes = {o["name"]: o["shape"] for o in document["outputs"]}
    assert shapes == {"last_hidden_state": [1, 5, 32], "pooler_output": [1, 32]}
    # Without --input_shape the documented defaults apply: batch 2, other dims 8.
    document = verify_json(BERT, optimized["bert_tiny_dynamo"], expect=0)
    assert document["inputs"]["input_ids"]["shape"] == [2, 8]


def test_inputs_npz_round_trip_and_wrong_names(tmp_path: Path, optimized: dict[str, Path]) -> None:
    ids = np.array([[5, 6, 7, 99]], dtype=np.int64)
    good = tmp_path / "feeds.npz"
    np.savez(good, input_ids=ids, attention_mask=np.ones_like(ids))
    document = verify_json(GPT2, optimized["gpt2_tiny_ts17"], "--inputs", good, expect=0)
    assert document["inputs"]["input_ids"]["kind"] == "file"
    assert document["outputs"][0]["shape"] == [1, 4, 32]

    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, input_ids=ids, attn_mask=np.ones_like(ids))
    result = run_cli("verify", GPT2, optimized["gpt2_tiny_ts17"], "--inputs", wrong)
    assert result.exit_code == 2
    assert "'attention_mask'" in result.stderr and "wrong.npz" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    extra = tmp_path / "extra.npz"
    np.savez(extra, input_ids=ids, attention_mask=ids, labels=ids)
    result = run_cli("verify", GPT2, optimized["gpt2_tiny_ts17"], "--inputs", extra)
    assert result.exit_code == 2 and "'labels'" in result.stderr

    floats = tmp_path / "floats.npz"
    np.savez(floats, input_ids=ids.astype(np.float32), attention_mask=ids)
    result = run_cli("verify", GPT2, optimized["gpt2_tiny_ts17"], "--inputs", floats)
    assert result.exit_code == 2 and "float32" in result.stderr


def test_per_pass_shows_where_error_enters(optimized: dict[str, Path]) -> None:
    """Every pass that rewrote BERT gets a row, in execution order, with the error of the run
    stopped after it; the last row is the whole optimization."""
    document = verify_json(BERT, optimized[BERT.stem], "--per_pass", expect=0)
    rows = document["per_pass"]
    names = [row["pass"] for row in rows]
    assert names[0] == "ConstantFoldingPass"
    assert {"QkvAttentionFusionPass", "AddLayerNormFusionPass"} <= set(names)
    assert names.index("QkvAttentionFusionPass") < names.index("AddLayerNormFusionPass")
    assert all(row["passed"] and row["rewrites"] > 0 for row in rows)
    assert rows[0]["max_abs"] == 0.0  # constant folding is exact
    assert rows[-1]["max_abs"] == pytest.approx(
        max(o["max_abs"] for o in document["outputs"]), rel=0.5, abs=1e-7
    )
    result = run_cli("verify", BERT, optimized[BERT.stem], "--per_pass")
    assert "error after each pass" in result.stderr
    result = run_cli("verify", "--golden", "g.npz", optimized[BERT.stem], "--per_pass")
    assert result.exit_code == 2 and "--per_pass" in result.stderr


def test_golden_outputs(tmp_path: Path, optimized: dict[str, Path]) -> None:
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    inputs = tmp_path / "feeds.npz"
    np.savez(inputs, **feeds)
    (expected,) = run_model(LLAMA, feeds)
    golden = tmp_path / "golden.npz"
    np.savez(golden, last_hidden_state=expected)
    model = optimized["llama_tiny_ts17"]
    document = verify_json("--golden", golden, "--inputs", inputs, model, expect=0)
    assert document["reference"] == "golden" and document["outputs"][0]["shape"] == [2, 3, 64]

    off = expected.copy()
    off[1, 2, 3] += 1.0
    np.savez(golden, last_hidden_state=off)
    document = verify_json("--golden", golden, "--inputs", inputs, model, expect=1)
    assert document["outputs"][0]["worst_index"] == [1, 2, 3]

    np.savez(golden, hidden=expected)
    result = run_cli("verify", "--golden", golden, "--inputs", inputs, model)
    assert result.exit_code == 2 and "'last_hidden_state'" in result.stderr
    result = run_cli("verify", "--golden", golden, LLAMA, model)
    assert result.exit_code == 2 and "--golden" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.onnx", LLAMA], "missing.onnx: no such file"),
        (["NOT_ONNX", LLAMA], "not an ONNX model"),
        ([LLAMA], "ORIGINAL and OPTIMIZED"),
        ([LLAMA, LLAMA, "--input_shape", "input_ids=1,2"], "--input_shape"),
        ([LLAMA, LLAMA, "--input_shape", "ids:1,2"], "not an input"),
        ([LLAMA, LLAMA, "--inputs", "none.npz"], "none.npz: no such file"),
        ([LLAMA, LLAMA, "--providers", "NoSuchProvider"], "NoSuchProvider"),
        ([LLAMA, LLAMA, "--atol", "-1"], "--atol"),
    ],
)
def test_bad_arguments_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "NOT_ONNX").write_bytes(b"this is not a protobuf \xff\xfe")
    result = run_cli("verify", *args)
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("fusectl: error:")
    assert len(result.stderr.strip().splitlines()) == 1


def test_optimize_verify(tmp_path: Path) -> None:
    run = optimize(GPT2, tmp_path, "--verify")
    assert run.output.exists()
    assert "all outputs within tolerance" in run.stderr
    assert run.report is not None and run.report["verify"]["passed"] is True
    assert run.report["verify"]["tolerance"]["numerics"] == "reassociating"


def test_default_tolerance_follows_lineage(optimized: dict[str, Path]) -> None:
    model = load_model(optimized["llama_tiny_ts17"]).model
    tolerance = default_tolerance(model)
    assert (tolerance.atol, tolerance.rtol) == TOLERANCES[Numerics.REASSOCIATING]
    assert "GroupQueryAttentionFusionPass" in tolerance.passes
    assert default_tolerance(model, atol=0.5).atol == 0.5


def _scan_after_slice(path: Path, start: int) -> Path:
    """A running sum over axis 1 of ``x[:, start:start + 100]``: onnxruntime 1.32 raises SIGFPE
    on a Scan of zero iterations, which it gets where ``start`` is past the input's end (an
    audio front end framing a waveform shorter than its window, onnx-asr's wespeaker)."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ],
        "body",
        [value("s_in", [2, 4]), value("x_t", [2, 4])],
        [value("s_out", [2, 4]), value("y_t", [2, 4])],
    )
    return save_model(
        path,
        [
            helper.make_node("Slice", ["x", "start", "end", "axis"], ["window"]),
            helper.make_node(
                "Scan",
                ["init", "window"],
                ["total", "sums"],
                body=body,
                num_scan_inputs=1,
                scan_input_axes=[1],
                scan_output_axes=[1],
            ),
        ],
        [value("x", [2, "samples", 4])],
        [value("total", [2, 4]), value("sums", [2, None, 4])],
        [
            const("start", np.array([start]), np.int64),
            const("end", np.array([start + 100]), np.int64),
            const("axis", np.array([1]), np.int64),
            const("init", np.zeros((2, 4))),
        ],
    )


def test_onnxruntime_crashing_is_one_line_not_the_end_of_fusectl(tmp_path: Path) -> None:
    never = _scan_after_slice(tmp_path / "never.onnx", 10**6)
    result = run_cli("verify", never, never)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"fusectl: error: {never}: onnxruntime cannot run it: onnxruntime crashed (SIGFPE) "
        "(on generated x float32[2,8,4] float; free sizes 64 and 512 fail too; --input_shape "
        "sets the symbolic sizes, --inputs the data)"
    )
    runs = _scan_after_slice(tmp_path / "runs.onnx", 0)
    result = run_cli("verify", runs, never)
    assert result.exit_code == 1  # the optimized model is the one that crashes: a verdict
    assert result.stderr.strip() == (
        f"fusectl: verification failed: {never}: onnxruntime cannot run it: onnxruntime "
        "crashed (SIGFPE)"
    )
    result = run_cli("bench", never, never, "--runs", "1")
    assert result.exit_code == 2
    assert "onnxruntime crashed (SIGFPE)" in result.stderr


def test_a_free_size_past_a_crash_is_tried(tmp_path: Path) -> None:
    """8 and 64 samples leave the window empty and onnxruntime crashes; 512 run."""
    model = _scan_after_slice(tmp_path / "late.onnx", 100)
    result = run_cli("verify", model, model, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["inputs"]["x"]["shape"] == [2, 512, 4]


def test_a_model_onnxruntime_cannot_load_is_tried_once(tmp_path: Path) -> None:
    """No size makes an op onnxruntime has no kernel for load: the error comes at once."""
    graph = helper.make_graph(
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="example.custom")],
        "custom",
        [value("x", ["batch", "n"])],
        [value("y", ["batch", "n"])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    model = tmp_path / "custom.onnx"
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(model))
    result = run_cli("verify", model, model)
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "Frobnicate" in line
    assert line.endswith(
        "(on generated x float32[2,8] float; --input_shape sets the symbolic sizes, "
        "--inputs the data)"
    )
