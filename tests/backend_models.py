"""The onnx wheel's own backend test models, run through `fusectl optimize` one at a time.

Shared by tests/test_backend_sweep.py (a deterministic subset) and benchmarks/backend_sweep.py
(every model, with counts). Each model's test_data_set_0 feeds both models on onnxruntime.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from click.testing import CliRunner
from onnx import numpy_helper

from fusectl.cli import cli

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
ATOL, RTOL = 1e-4, 1e-3


def backend_models() -> list[Path]:
    """Every model file: node/simple/pytorch-* folders' model.onnx, and light/*.onnx."""
    return sorted(DATA.rglob("*.onnx"))


@dataclass
class Outcome:
    model: Path
    exit_code: int
    message: str = ""
    input_valid: bool = False
    output_valid: bool | None = None
    original_runs: bool = False
    output_runs: bool | None = None
    mismatch: str | None = None

    @property
    def name(self) -> str:
        return str(self.model.relative_to(DATA))

    def defects(self) -> list[str]:
        """What breaks fusectl's contract: a crash, a refused model onnxruntime runs, an
        invalid output from a valid input, an output that no longer runs or computes the same."""
        found = []
        if self.exit_code not in (0, 2):
            found.append(f"exit {self.exit_code}: {self.message}")
        if self.exit_code == 2 and self.original_runs:
            found.append(f"refused a model onnxruntime runs: {self.message}")
        if self.input_valid and self.output_valid is False:
            found.append("valid input, output fails onnx.checker")
        if self.original_runs and self.output_runs is False:
            found.append("the output does not run on onnxruntime")
        if self.mismatch:
            found.append(self.mismatch)
        return found


def checker_passes(path: Path) -> bool:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception:
        return False
    return True


def _read_value(path: Path, type_proto: onnx.TypeProto) -> Any:
    """A test_data_set input as onnxruntime takes it: tensors, sequences, maps, optionals."""
    kind = type_proto.WhichOneof("value")
    message = {
        "sequence_type": onnx.SequenceProto,
        "map_type": onnx.MapProto,
        "optional_type": onnx.OptionalProto,
    }.get(kind or "", onnx.TensorProto)()
    message.ParseFromString(path.read_bytes())
    if isinstance(message, onnx.TensorProto):
        return numpy_helper.to_array(message)
    if isinstance(message, onnx.SequenceProto):
        return numpy_helper.to_list(message)
    if isinstance(message, onnx.MapProto):
        return numpy_helper.to_dict(message)
    return numpy_helper.to_optional(message)


def _feeds(model: Path) -> dict[str, Any]:
    """The model's test_data_set_0 inputs; seeded random floats for a model without them (the
    light/ models, whose weights are generated in the graph)."""
    proto = onnx.load(str(model), load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [v for v in proto.graph.input if v.name not in initializers]
    data = model.parent / "test_data_set_0"
    if not data.is_dir():
        rng = np.random.default_rng(0)
        return {
            value.name: rng.standard_normal(
                [d.dim_value for d in value.type.tensor_type.shape.dim]
            ).astype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
            for value in inputs
        }
    return {
        value.name: _read_value(data / f"input_{index}.pb", value.type)
        for index, value in enumerate(inputs)
    }


def _run(model: Path, feeds: dict[str, Any]) -> list[Any]:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _compare(expected: list[Any], actual: list[Any]) -> str | None:
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        if isinstance(want, np.ndarray) and want.dtype.kind in "fc":
            if want.shape != np.shape(got) or not np.allclose(
                got, want, atol=ATOL, rtol=RTOL, equal_nan=True
            ):
                return f"output {index} differs"
        elif isinstance(want, np.ndarray):
            if not np.array_equal(want, got):
                return f"output {index} differs"
        elif repr(want) != repr(got):
            return f"output {index} differs"
    return None


def sweep_one(model: Path, workdir: Path) -> Outcome:
    """Optimize one backend model into workdir and hold the result to the contract."""
    output = workdir / "optimized.onnx"
    result = CliRunner().invoke(
        cli,
        ["optimize", str(model), "-o", str(output), "--export_compile_stat", "0", "--log", "null"],
    )
    outcome = Outcome(model, result.exit_code, result.stderr.strip())
    outcome.input_valid = checker_passes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            feeds = _feeds(model)
            expected = _run(model, feeds)
            outcome.original_runs = True
        except Exception:
            expected = None
    if result.exit_code != 0:
        return outcome
    outcome.output_valid = checker_passes(output)
    if expected is not None:
        try:
            actual = _run(output, feeds)
            outcome.output_runs = True
        except Exception as error:
            outcome.output_runs = False
            outcome.mismatch = f"output fails on onnxruntime: {str(error)[:200]}"
            return outcome
        outcome.mismatch = _compare(expected, actual)
    output.unlink()
    return outcome
