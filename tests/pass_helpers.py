"""Small onnx.helper models and assertions shared by tests/test_pass_*.py."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tests.conftest import FIXTURES, Run, assert_same_outputs, digest, optimize, run_model

# onnx 1.23 writes IR version 14 by default, which onnxruntime 1.31 does not load.
IR_VERSION = 8


def const(name: str, array: np.ndarray | Sequence, dtype: type = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=dtype), name)


def value(name: str, shape: Sequence[int | str] | None, elem: int = onnx.TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def save_model(
    path: Path,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    *,
    opset: int = 17,
    value_info: Sequence[onnx.ValueInfoProto] = (),
    check: bool = True,
    contrib: bool = False,
) -> Path:
    """Write a one-graph model; checked unless the test builds an invalid one on purpose or
    it holds onnxruntime's contrib ops (``contrib``: the com.microsoft domain imported)."""
    graph = helper.make_graph(
        nodes, path.stem, inputs, outputs, list(initializers), value_info=list(value_info)
    )
    opsets = [helper.make_opsetid("", opset)]
    if contrib:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)
    if check and not contrib:
        onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


# The architecture matrix's committed exports (tests/fixtures/make_arch_matrix.py --fixtures).
ARCH_FIXTURES = FIXTURES / "arch"


def fixture_path(name: str) -> Path:
    path = FIXTURES / f"{name}.onnx"
    assert path.exists(), f"{path} is missing: run tests/fixtures/make_fixtures.py"
    return path


def edited_fixture(
    name: str, tmp_path: Path, edit: Callable[[onnx.ModelProto], None], stem: str
) -> Path:
    """A copy of a committed export with one edit, a near miss in the exporter's own graph,
    saved as ``tmp_path/<stem>.onnx``."""
    model = onnx.load(str(fixture_path(name)))
    edit(model)
    path = tmp_path / f"{stem}.onnx"
    onnx.save(model, str(path))
    return path


def node_named(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.name == name]
    return node


def feed_scalar(model: onnx.ModelProto, node_name: str, index: int, scalar: float) -> None:
    """The named node's input ``index`` replaced by a new float32 scalar initializer."""
    name = f"{node_name}/scalar"
    model.graph.initializer.append(const(name, np.array(scalar, np.float32)))
    node_named(model, node_name).input[index] = name


def reasons(run: Run, name: str) -> dict[str, int]:
    """The pass's near-miss reasons with their counts."""
    return {miss["reason"]: miss["count"] for miss in run.passed(name)["near_misses"]}


def pattern_counts(run: Run, name: str) -> dict[str, tuple[int, int]]:
    """(matched, effected) per pattern of the pass."""
    return {k: (v["matched"], v["effected"]) for k, v in run.passed(name)["patterns"].items()}


def check_output(run: Run) -> None:
    onnx.checker.check_model(onnx.load(str(run.output)), full_check=True)


def optimize_checked(
    model: Path, tmp_path: Path, *args: str, compare: bool = True, atol: float = 1e-4
) -> Run:
    """Optimize, then check the output with the full checker and against the original on ORT."""
    run = optimize(model, tmp_path, *args)
    check_output(run)
    if compare:
        assert_same_outputs(model, run.output, atol=atol)
    return run


def conv_batchnorm_params(channels: int, prefix: str = "bn", seed: int = 0) -> list:
    """scale, bias, mean, variance initializers for a BatchNormalization of `channels`."""
    rng = np.random.default_rng(seed)
    return [
        const(f"{prefix}_scale", rng.uniform(0.5, 1.5, channels)),
        const(f"{prefix}_bias", rng.normal(0.0, 0.1, channels)),
        const(f"{prefix}_mean", rng.normal(0.0, 0.1, channels)),
        const(f"{prefix}_var", rng.uniform(0.5, 1.5, channels)),
    ]


def plain_input_not_constant(what: str) -> str:
    """The decline for a value that is a plain graph input (no initializer behind it)."""
    return f"{what} is a graph input (fed), not a constant"


def assert_declined(
    run: Run, name: str, reason: str | re.Pattern[str], example: str, *, count: int = 1
) -> None:
    """The pass matched `count` candidates, effected none, and gave this one reason."""
    assert run.counts(name) == (count, 0)
    (miss,) = run.passed(name)["near_misses"]
    if isinstance(reason, re.Pattern):
        assert reason.fullmatch(miss["reason"]), miss["reason"]
    else:
        assert miss["reason"] == reason
    assert miss["count"] == count
    assert example in miss["examples"]


def lineage(run: Run) -> dict[str, tuple[list[str], list[str]]]:
    """Per node of the optimized model that carries lineage: (fusectl.pass_name,
    fusectl.original_op_names), keyed by the node's name."""
    found = {}
    for node in onnx.load(str(run.output)).graph.node:
        props = {prop.key: prop.value for prop in node.metadata_props}
        if "fusectl.pass_name" in props:
            found[node.name] = (
                json.loads(props["fusectl.pass_name"]),
                json.loads(props["fusectl.original_op_names"]),
            )
    return found


def compare_on_feeds(original: Path, optimized: Path, feeds: dict[str, np.ndarray]) -> None:
    """Every output agrees on onnxruntime for these inputs, with no NaN in either."""
    expected, actual = run_model(original, feeds), run_model(optimized, feeds)
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual, strict=True):
        assert np.isnan(got).sum() == np.isnan(want).sum() == 0
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def assert_second_run_changes_nothing(run: Run, tmp_path: Path, name: str) -> None:
    """fusectl on its own output: the pass ``name`` finds nothing, the bytes are the same."""
    second = tmp_path / "second"
    second.mkdir()
    again = optimize(run.output, second)
    assert again.counts(name) == (0, 0)
    assert digest(again.output) == digest(run.output)
