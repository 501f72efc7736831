"""Data safety: fusectl never destroys or corrupts a user's file, writes all of its outputs or
none, and the same input always gives the same bytes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import FIXTURES, assert_same_outputs, digest, run_cli
from tests.pass_helpers import fixture_path, optimize_checked


def _one_line_error(result: object, *fragments: str) -> None:
    stderr = result.stderr  # type: ignore[attr-defined]
    assert result.exit_code == 2, stderr  # type: ignore[attr-defined]
    assert len(stderr.strip().splitlines()) == 1, stderr
    for fragment in fragments:
        assert fragment in stderr, stderr


def _optimize(sample: Path, *args: str | Path) -> object:
    return run_cli("optimize", sample, *args)


def test_special_files_are_never_replaced(sample: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    out = tmp_path / "out.onnx"
    result = _optimize(sample, "-o", out, "--fusion_result", "/dev/null")
    _one_line_error(result, "/dev/null", "--fusion_result is a device")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    for option in ("--report", "--fusion_result"):
        result = _optimize(sample, "-o", out, option, fifo)
        _one_line_error(result, str(fifo), f"{option} is a FIFO")
    result = _optimize(sample, "-o", fifo, "--fusion_result", tmp_path / "fr.json")
    _one_line_error(result, "output path is a FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.onnx", "tiny_cnn.onnx"]


@pytest.mark.parametrize(
    ("role", "target", "message"),
    [
        ("--fusion_result", "input", "--fusion_result is the input model"),
        ("--report", "input", "--report is the input model"),
        ("--fusion_result", "output", "--fusion_result is the same file as output path"),
        ("--report", "fusion_result", "--report is the same file as --fusion_result"),
    ],
)
def test_outputs_never_overwrite_the_input_or_each_other(
    sample: Path, tmp_path: Path, role: str, target: str, message: str
) -> None:
    out, fusion_result = tmp_path / "out.onnx", tmp_path / "fr.json"
    paths = {"input": sample, "output": out, "fusion_result": fusion_result}
    before = digest(sample)
    args = ["-o", out, "--fusion_result", fusion_result, role, paths[target]]
    _one_line_error(_optimize(sample, *args), message)
    assert digest(sample) == before
    assert not out.exists() and not fusion_result.exists()


def test_output_is_never_the_inputs_weight_file(sample: Path, tmp_path: Path) -> None:
    external = tmp_path / "ext" / "model.onnx"
    external.parent.mkdir()
    onnx.save(onnx.load(str(sample)), str(external), save_as_external_data=True,
              location="weights.bin", size_threshold=0)  # fmt: skip
    weights = external.parent / "weights.bin"
    before = digest(weights)
    result = _optimize(external, "-o", weights, "--fusion_result", tmp_path / "fr.json")
    _one_line_error(result, "output path is the input model's external data file")
    # The output's own weight file (OUT.onnx.data) is checked as well.
    renamed = external.parent / "w.onnx.data"
    onnx.save(onnx.load(str(sample)), str(external), save_as_external_data=True,
              location=renamed.name, size_threshold=0)  # fmt: skip
    result = _optimize(external, "-o", external.parent / "w.onnx")
    _one_line_error(result, "the output's external data file is the input model's external data")
    assert digest(weights) == before


def test_outputs_never_land_on_dump_graph_files(sample: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    result = _optimize(sample, "-o", dump / "0001_mine.onnx", "--dump_graph", dump)
    _one_line_error(result, "output path is inside --dump_graph's files")
    assert not dump.exists()


@pytest.mark.parametrize("option", ["--fusion_result", "--report"])
def test_a_bad_side_path_exits_2_before_the_model_is_written(
    sample: Path, tmp_path: Path, option: str
) -> None:
    out = tmp_path / "out.onnx"
    result = _optimize(sample, "-o", out, option, tmp_path / "missing" / "x.json")
    _one_line_error(result, "output directory does not exist", option)
    assert not out.exists()


def _raising_plugin(tmp_path: Path, where: str) -> Path:
    """A plugin whose extra check or replacement raises a plain exception."""
    check = "raise RuntimeError('check exploded')" if where == "check" else "return None"
    replacement = "1 / 0" if where == "replacement" else "op.Relu(x)"
    path = tmp_path / f"raising_{where}.py"
    path.write_text(
        "from fusectl import register_replacement\n\n"
        "def relu(op, x):\n    return op.Relu(x)\n\n"
        f"def check(site, x):\n    {check}\n\n"
        f"def replace(op, x):\n    return {replacement}\n\n"
        "register_replacement('RaisingPass', relu, replace, extra_check=check)\n"
    )
    return path


@pytest.mark.usefixtures("restore_registry")
@pytest.mark.parametrize(
    ("where", "error"), [("check", "RuntimeError: check exploded"), ("replacement", "ZeroDivision")]
)
def test_a_raising_plugin_exits_2_naming_it_and_leaves_nothing(
    sample: Path, tmp_path: Path, where: str, error: str
) -> None:
    plugin = _raising_plugin(tmp_path, where)
    out, dump = tmp_path / "out.onnx", tmp_path / "dump"
    side = ("--fusion_result", tmp_path / "fr.json", "--report", tmp_path / "r.json")
    result = _optimize(sample, "-o", out, *side, "--dump_graph", dump, "--plugin", plugin)
    _one_line_error(result, "custom pass RaisingPass", plugin.name, error)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["tiny_cnn.onnx", plugin.name])


def test_dump_graph_leaves_the_output_self_contained(sample: Path, tmp_path: Path) -> None:
    out, dump = tmp_path / "out.onnx", tmp_path / "dump"
    result = _optimize(sample, "-o", out, "--dump_graph", dump, "--fusion_result", tmp_path / "f")
    assert result.exit_code == 0, result.stderr
    assert (dump / "weights.data").is_file() and (dump / "0000_original.onnx").is_file()
    proto = onnx.load(str(out), load_external_data=False)
    assert all(t.data_location != TensorProto.EXTERNAL for t in proto.graph.initializer)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "out.onnx").write_bytes(out.read_bytes())
    onnx.checker.check_model(onnx.load(str(moved / "out.onnx")), full_check=True)
    assert_same_outputs(sample, moved / "out.onnx")
    assert run_cli("verify", sample, moved / "out.onnx").exit_code == 0


def test_bisect_replaces_no_existing_file_without_force(sample: Path, tmp_path: Path) -> None:
    switch = tmp_path / "switch.cfg"
    switch.write_text("ConvBatchnormFusionPass:on\n")
    before = digest(switch)
    result = run_cli("bisect", sample, "--output_switch", switch)
    _one_line_error(result, "--output_switch exists", "--force")
    # The switch file the run reads is never the one it writes, even with --force.
    for extra in ((), ("--force",)):
        result = run_cli(
            "bisect", sample, "--fusion_switch_file", switch, "--output_switch", switch, *extra
        )
        _one_line_error(result, "--output_switch is the --fusion_switch_file given")
    assert digest(switch) == before
    other = tmp_path / "other.cfg"
    other.write_text("kept unless a culprit is found\n")
    result = run_cli("bisect", sample, "--output_switch", other, "--force")
    assert result.exit_code == 0, result.stderr  # nothing to find: nothing written
    assert other.read_text() == "kept unless a culprit is found\n"


def _sparse_model(path: Path) -> Path:
    values = numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "w")
    indices = numpy_helper.from_array(np.array([1, 5], np.int64), "w_indices")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "sparse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [8])],
        sparse_initializer=[helper.make_sparse_tensor(values, indices, [8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_sparse_initializers_survive(tmp_path: Path) -> None:
    model = _sparse_model(tmp_path / "sparse.onnx")
    out = tmp_path / "out.onnx"
    result = run_cli("optimize", model, "-o", out, "--fusion_result", tmp_path / "fr.json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("cannot be found in any scope") == 0
    saved = onnx.load(str(out))
    assert [t.values.name for t in saved.graph.sparse_initializer] == ["w"]
    onnx.checker.check_model(saved)  # onnx's shape inference takes no sparse operand (full)
    assert_same_outputs(model, out)


@pytest.mark.parametrize("name", ["deberta_v2_tiny_ts17", "deberta_v2_tiny_dynamo"])
def test_deberta_v2_optimizes_with_equal_outputs(name: str, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.report["model"]["after"]["nodes"] < run.report["model"]["before"]["nodes"]


def test_a_deeply_nested_switch_file_is_one_line(sample: Path, tmp_path: Path) -> None:
    switch = tmp_path / "deep.json"
    switch.write_text('{"Switch":' + '{"a":' * 2000 + '"on"' + "}" * 2001)
    result = _optimize(sample, "-o", tmp_path / "o.onnx", "--fusion_switch_file", switch)
    _one_line_error(result, "deep.json", "nested too deeply")


def _fp16_conv_bn(path: Path, *, mean_shift: float = 0.0) -> Path:
    """Conv + BatchNormalization in float16, as a half-precision export writes it."""
    rng = np.random.default_rng(0)
    channels, kernels = 8, 16

    def tensor(name: str, array: np.ndarray) -> TensorProto:
        return numpy_helper.from_array(array.astype(np.float16), name)

    mean = rng.normal(size=kernels) + mean_shift
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"]),
        ],
        "fp16_conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, channels, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, kernels, 8, 8])],
        [
            tensor("W", rng.normal(size=(kernels, channels, 3, 3))),
            tensor("scale", rng.uniform(0.5, 2, kernels)),
            tensor("bias", rng.normal(size=kernels)),
            tensor("mean", mean),
            tensor("var", rng.uniform(0.5, 2, kernels)),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_verify_tolerance_follows_the_output_dtype(tmp_path: Path) -> None:
    model = _fp16_conv_bn(tmp_path / "fp16.onnx")
    out = tmp_path / "out.onnx"
    result = run_cli("optimize", model, "-o", out, "--verify", "--fusion_result", tmp_path / "f")
    assert result.exit_code == 0, result.stderr
    checked = run_cli("verify", model, out, "--json")
    assert checked.exit_code == 0, checked.stderr
    (output,) = json.loads(checked.stdout)["outputs"]
    assert output["max_abs"] > 1e-4  # one float16 rounding step: beyond float32's tolerance
    # A real difference (a BatchNormalization mean off by 0.5) still fails in float16.
    wrong = _fp16_conv_bn(tmp_path / "wrong.onnx", mean_shift=0.5)
    assert run_cli("verify", model, wrong).exit_code == 1


def test_same_bytes_in_separate_processes_with_different_hash_seeds(tmp_path: Path) -> None:
    """Every fixture, optimized in two processes that hash strings differently."""
    script = (
        "import hashlib, sys, tempfile\n"
        "from pathlib import Path\n"
        "import fusectl\n"
        "with tempfile.TemporaryDirectory() as tmp:\n"
        "    for model in sorted(Path(sys.argv[1]).glob('*.onnx')):\n"
        "        out = Path(tmp, model.name)\n"
        "        fusectl.optimize(model, out)\n"
        "        print(model.name, hashlib.sha256(out.read_bytes()).hexdigest())\n"
    )
    hashes = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script, str(FIXTURES)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        hashes.append(done.stdout.splitlines())
    assert len(hashes[0]) == len(list(FIXTURES.glob("*.onnx"))) > 40
    assert hashes[0] == hashes[1]
