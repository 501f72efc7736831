"""`fusectl verify`: does the optimized model still compute what the original did?

Both models run on onnxruntime with its own graph optimizations off (ORT_DISABLE_ALL), so the
only difference between the two runs is fusectl's rewrite. Every output is compared with numpy
``allclose`` semantics, ``|optimized - expected| <= atol + rtol * |expected|``.

Default tolerances follow the numerics class of the passes that fired, read from the lineage
metadata (``fusectl.pass_name``) the passes stamp on the nodes they create; the loosest class
present wins (see ``TOLERANCES``). A pass name the registry does not know (a plugin not loaded
here) counts as reassociating. Integer and bool outputs must match exactly unless ``--atol`` /
``--rtol`` are given.
"""

from __future__ import annotations

import faulthandler
import json
import math
import multiprocessing
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from rich.console import Console
from rich.table import Table

from fusectl.core.model_io import load_model
from fusectl.core.plugins import load_builtin_passes
from fusectl.diagnostics.inputs import (
    DEFAULT_DIM,
    FeedPlan,
    describe_feeds,
    free_sizes,
    graph_inputs,
    model_feeds,
    read_npz,
)
from fusectl.errors import FusectlError
from fusectl.rewrite.context import LINEAGE_PASSES
from fusectl.rewrite.registry import Numerics
from fusectl.rewrite.shapes import parse_input_shape

# (atol, rtol) per numerics class. Exact passes only move or merge ops, but a fused kernel
# may still round once where the original rounded twice, hence not zero; reassociating is
# SPEC §6's fp32 tolerance; approximate passes (a tanh GELU for an erf one) drift by ~1e-3.
TOLERANCES: dict[Numerics, tuple[float, float]] = {
    Numerics.EXACT: (1e-6, 1e-5),
    Numerics.REASSOCIATING: (1e-4, 1e-3),
    Numerics.APPROXIMATE: (1e-2, 1e-2),
}
# An output in a float narrower than float32 rounds at its own precision: the class tolerances
# (float32's) widen to this many units in its last place, at the output's largest magnitude.
NARROW_FLOAT_ULPS = 2
_RANK = {Numerics.EXACT: 0, Numerics.REASSOCIATING: 1, Numerics.APPROXIMATE: 2}
DEFAULT_PROVIDERS = ("CPUExecutionProvider",)


class VerifyFailed(FusectlError):
    """Outputs beyond tolerance, or an optimized model onnxruntime cannot run: exit 1."""

    exit_code = 1
    label = "verification failed"


@dataclass(frozen=True)
class Tolerance:
    """The tolerance applied, and why: the numerics class and the passes that set it."""

    atol: float
    rtol: float
    numerics: str  # a Numerics value, or "given" for --atol/--rtol
    passes: tuple[str, ...] = ()
    overridden: bool = False


def fired_passes(model: ir.Model) -> list[str]:
    """Names of the passes whose rewrites appear in the model, in first-seen order."""
    found: dict[str, None] = {}
    graphs = [model.graph, *(function for function in model.functions.values())]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            text = node.metadata_props.get(LINEAGE_PASSES)
            if not text:
                continue
            try:
                names = json.loads(text)
            except ValueError:
                continue
            found.update((str(name), None) for name in names if isinstance(names, list))
    return list(found)


def default_tolerance(
    model: ir.Model, atol: float | None = None, rtol: float | None = None
) -> Tolerance:
    """The loosest class among the passes that fired; --atol / --rtol replace either part."""
    registry = load_builtin_passes()
    numerics = Numerics.EXACT
    names = fired_passes(model)
    for name in names:
        canonical = registry.canonical(name)
        cls = registry[canonical].spec.numerics if canonical else Numerics.REASSOCIATING
        if _RANK[cls] > _RANK[numerics]:
            numerics = cls
    base_atol, base_rtol = TOLERANCES[numerics]
    overridden = atol is not None or rtol is not None
    return Tolerance(
        atol if atol is not None else base_atol,
        rtol if rtol is not None else base_rtol,
        "given" if atol is not None and rtol is not None else numerics.value,
        tuple(names),
        overridden,
    )


def parse_providers(text: str | None) -> list[str]:
    """A comma list of execution providers; 'cpu' and 'cuda' are short for the full names."""
    if not text:
        return list(DEFAULT_PROVIDERS)
    available = ort.get_available_providers()
    folded = {p.lower().removesuffix("executionprovider"): p for p in available}
    chosen = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name = folded.get(item.lower().removesuffix("executionprovider"))
        if name is None:
            raise FusectlError(
                f"--providers: '{item}' is not available in this onnxruntime "
                f"(available: {', '.join(available)})"
            )
        chosen.append(name)
    if not chosen:
        raise FusectlError("--providers names no provider")
    return chosen


def run_model(
    path: Path,
    feeds: dict[str, np.ndarray],
    providers: Sequence[str],
    *,
    failure: type,
    hint: str = "",
) -> dict[str, Any]:
    """Outputs by name, in the model's order; onnxruntime's own graph optimizations off.
    ``hint`` ends the message of a model that does not run."""
    outcome = _run(path, feeds, providers)
    if isinstance(outcome, _Failed):
        raise failure(f"onnxruntime cannot run it: {outcome.message}{hint}", path=path)
    return outcome


class _Failed(NamedTuple):
    """onnxruntime's error in one line, and whether it came at load (before any input)."""

    message: str
    at_load: bool = False


def _run(
    path: Path, feeds: dict[str, np.ndarray], providers: Sequence[str]
) -> dict[str, Any] | _Failed:
    """On the CPU provider under Linux the model runs in a forked child: a crash of onnxruntime
    itself (1.32 raises SIGFPE on a Scan of zero iterations, which an audio front end gets from
    a waveform shorter than its window) is then one line of ours instead of fusectl's end.
    Other providers run here: a GPU context does not survive a fork."""
    if sys.platform.startswith("linux") and set(providers) <= {"CPUExecutionProvider"}:
        return _in_child(path, feeds, providers)
    return _outputs(path, feeds, providers)


def _outputs(
    path: Path, feeds: dict[str, np.ndarray], providers: Sequence[str]
) -> dict[str, Any] | _Failed:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # its errors come back as one line of ours
    loaded = False
    try:
        session = ort.InferenceSession(str(path), options, providers=list(providers))
        loaded = True
        names = [output.name for output in session.get_outputs()]
        wanted = {i.name for i in session.get_inputs()}
        values = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
    except Exception as error:  # onnxruntime raises its own types for load and run errors
        text = str(error).strip()
        return _Failed(text.splitlines()[0] if text else repr(error), at_load=not loaded)
    return dict(zip(names, values, strict=True))


def _in_child(
    path: Path, feeds: dict[str, np.ndarray], providers: Sequence[str]
) -> dict[str, Any] | _Failed:
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, path, feeds, providers), daemon=True)
    child.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:  # the child died before it could answer
        child.join()
        code = child.exitcode or 0
        how = signal.Signals(-code).name if code < 0 else f"exit status {code}"
        outcome = _Failed(f"onnxruntime crashed ({how})")
    finally:
        receive.close()
    child.join()
    return outcome


def _child(send: Any, path: Path, feeds: dict[str, np.ndarray], providers: Sequence[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C is the parent's to report
    faulthandler.disable()  # a crash is the parent's to report, in one line
    send.send(_outputs(path, feeds, providers))
    send.close()


@dataclass
class OutputCheck:
    """One output compared: its errors, the worst element, and the verdict."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    atol: float
    rtol: float
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_index: tuple[int, ...] | None = None
    expected: float | None = None
    actual: float | None = None
    passed: bool = True
    note: str = ""

    def failed(self, note: str) -> OutputCheck:
        """Beyond any tolerance: a shape, a structure or a string that differs."""
        self.passed, self.max_abs, self.max_rel, self.note = False, math.inf, math.inf, note
        return self

    def to_json(self) -> dict[str, Any]:
        def number(x: float | None) -> float | str | None:
            return x if x is None or math.isfinite(x) else str(x)

        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "max_abs": number(self.max_abs),
            "max_rel": number(self.max_rel),
            "worst_index": list(self.worst_index) if self.worst_index is not None else None,
            "expected": number(self.expected),
            "actual": number(self.actual),
            "atol": self.atol,
            "rtol": self.rtol,
            "passed": self.passed,
            "note": self.note or None,
        }


def _for_dtype(
    dtype: np.dtype, expected: np.ndarray, atol: float, rtol: float
) -> tuple[float, float]:
    """The tolerance widened for outputs narrower than float32 (float16: one fused rounding
    step moves a value by an ulp of the intermediate sums, not of the value itself)."""
    try:
        eps = float(np.finfo(dtype).eps)
    except (TypeError, ValueError):
        return atol, rtol
    if eps <= float(np.finfo(np.float32).eps):
        return atol, rtol
    step = NARROW_FLOAT_ULPS * eps
    finite = np.abs(expected.astype(np.float64))
    scale = float(finite[np.isfinite(finite)].max(initial=0.0))
    return max(atol, step * max(scale, 1.0)), max(rtol, step)


def compare(name: str, expected: Any, actual: Any, tolerance: Tolerance) -> OutputCheck:
    """allclose per element; the worst element is the one furthest past (or closest to) its
    allowance atol + rtol*|expected|. Relative error skips elements whose expected value is 0.

    Outputs that are not one tensor (a sequence, a map: what onnxruntime gives as lists and
    dicts, a classifier's ZipMap output) must have the same structure and keys; their values
    are compared as one flat tensor. Strings must be equal."""
    if not (isinstance(expected, np.ndarray) and isinstance(actual, np.ndarray)):
        return _compare_structures(name, expected, actual, tolerance)
    if not _numeric(expected) or not _numeric(actual):
        return _compare_exact(name, expected, actual, str(actual.dtype))
    floating = np.issubdtype(expected.dtype, np.inexact) or np.issubdtype(actual.dtype, np.inexact)
    atol, rtol = tolerance.atol, tolerance.rtol
    if not floating and not tolerance.overridden:
        atol = rtol = 0.0
    elif not tolerance.overridden:
        atol, rtol = _for_dtype(actual.dtype, expected, atol, rtol)
    check = OutputCheck(name, tuple(actual.shape), str(actual.dtype), atol, rtol)
    if expected.shape != actual.shape:
        return check.failed(f"shape {list(actual.shape)}, expected {list(expected.shape)}")
    if expected.size == 0:
        return check
    want = expected.astype(np.float64)
    got = actual.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.asarray(np.abs(got - want))  # a 0-d difference is a NumPy scalar otherwise
        diff[(want == got) | (np.isnan(want) & np.isnan(got))] = 0.0
        diff[np.isnan(diff)] = np.inf  # NaN on one side only
        allowance = atol + rtol * np.abs(want)
        ratio = np.where(allowance > 0, diff / allowance, np.where(diff > 0, np.inf, 0.0))
        nonzero = np.abs(want) > 0
        rel = diff[nonzero] / np.abs(want[nonzero])
    check.max_abs = float(diff.max())
    check.max_rel = float(rel.max()) if rel.size else 0.0
    # NaN in the same place on both sides agrees; its allowance is NaN, which nothing is below.
    check.passed = bool(((diff <= allowance) | (diff == 0)).all())
    if check.max_abs > 0:
        worst = np.unravel_index(int(np.argmax(ratio)), diff.shape)
        check.worst_index = tuple(int(i) for i in worst)
        check.expected = float(want[worst])
        check.actual = float(got[worst])
    return check


def _numeric(array: np.ndarray) -> bool:
    return array.dtype.kind in "biufc"


def _compare_exact(name: str, expected: np.ndarray, actual: np.ndarray, kind: str) -> OutputCheck:
    """Values that have no distance (strings, map keys): equal or not."""
    check = OutputCheck(name, tuple(actual.shape), kind, 0.0, 0.0)
    if expected.shape != actual.shape:
        return check.failed(f"shape {list(actual.shape)}, expected {list(expected.shape)}")
    differ = np.argwhere(expected != actual)
    if differ.size:
        first = tuple(int(i) for i in differ[0])
        check.worst_index = first
        check.failed(
            f"{len(differ)} of {expected.size} differ; first {actual[first]!r}, "
            f"expected {expected[first]!r}"
        )
    return check


def _compare_structures(name: str, expected: Any, actual: Any, tolerance: Tolerance) -> OutputCheck:
    kind = _structure(actual)
    want, got = list(_leaves(expected)), list(_leaves(actual))
    paths = [path for path, _ in want]
    if paths != [path for path, _ in got] or _structure(expected) != kind:
        note = f"{_structure(expected)} with {len(want)} value(s) expected"
        pairs = zip(paths, [path for path, _ in got], strict=False)
        first = next((path for path, other in pairs if path != other), None)
        if first is not None:
            note += f"; first difference at {_path_text(first)}"
        return OutputCheck(name, (len(got),), kind, 0.0, 0.0).failed(note)
    flat_want = [leaf.reshape(-1) for _, leaf in want]
    flat_got = [leaf.reshape(-1) for _, leaf in got]
    if not flat_want:
        return OutputCheck(name, (0,), kind, 0.0, 0.0)
    check = compare(name, np.concatenate(flat_want), np.concatenate(flat_got), tolerance)
    check.dtype = kind
    if check.worst_index is not None:
        ends = np.cumsum([leaf.size for leaf in flat_want])
        leaf = int(np.searchsorted(ends, check.worst_index[0], side="right"))
        check.note = " ".join(filter(None, [check.note, f"worst at {_path_text(paths[leaf])}"]))
    return check


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, np.ndarray) else (len(list(_leaves(value))),)


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Any:
    """(path, tensor) for every tensor in a sequence or map output, a map's keys in order."""
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            yield from _leaves(value[key], (*path, key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    elif value is not None:
        yield path, np.asarray(value)


def _structure(value: Any) -> str:
    """What onnxruntime gave, a sequence's and a map's in ONNX's words, a tensor's as numpy's
    dtype: ``seq(map(int64, float64))``."""
    if isinstance(value, dict):
        first = next(iter(value.items()), None)
        if first is None:
            return "map()"
        return f"map({np.asarray(first[0]).dtype}, {_structure(first[1])})"
    if isinstance(value, list | tuple):
        return f"seq({_structure(value[0]) if value else ''})"
    if value is None:
        return "none"
    return str(np.asarray(value).dtype)


def _path_text(path: tuple[Any, ...]) -> str:
    return "".join(f"[{key!r}]" for key in path) or "the top"


@dataclass
class VerifyResult:
    """Everything one verification found, for the table, the JSON and the exit code."""

    reference: str  # "original" or "golden"
    reference_path: Path
    optimized: Path
    providers: list[str]
    tolerance: Tolerance
    feeds: dict[str, np.ndarray]
    plans: dict[str, FeedPlan]
    checks: list[OutputCheck] = field(default_factory=list)
    # Why onnx's reference evaluator computed the reference outputs ("": onnxruntime did).
    fallback: str = ""

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failures(self) -> int:
        return sum(not check.passed for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        tol = self.tolerance
        return {
            "passed": self.passed,
            "reference": self.reference,
            self.reference: str(self.reference_path),
            "optimized": str(self.optimized),
            "reference_evaluator": "onnx reference" if self.fallback else "onnxruntime",
            "reference_fallback": self.fallback or None,
            "providers": self.providers,
            "tolerance": {
                "atol": tol.atol,
                "rtol": tol.rtol,
                "numerics": tol.numerics,
                "passes": list(tol.passes),
            },
            "inputs": {
                name: {
                    "dtype": str(array.dtype),
                    "shape": list(array.shape),
                    "kind": self.plans[name].kind if name in self.plans else "file",
                    "high": self.plans[name].high if name in self.plans else None,
                }
                for name, array in self.feeds.items()
            },
            "outputs": [check.to_json() for check in self.checks],
        }

    def summary(self) -> str:
        return (
            f"{self.failures} of {len(self.checks)} output(s) beyond tolerance "
            f"(atol {self.tolerance.atol:g}, rtol {self.tolerance.rtol:g})"
        )


def pair_outputs(
    expected: dict[str, Any], actual: dict[str, Any], tolerance: Tolerance
) -> list[OutputCheck]:
    """Compare by name when both models name the same outputs, else by position."""
    if set(expected) == set(actual):
        return [compare(name, expected[name], actual[name], tolerance) for name in expected]
    checks = []
    pairs = list(zip(expected.items(), actual.items(), strict=False))
    for (want_name, want), (got_name, got) in pairs:
        label = want_name if want_name == got_name else f"{want_name} / {got_name}"
        checks.append(compare(label, want, got, tolerance))
    for name, value in list(expected.items())[len(pairs) :]:
        missing = OutputCheck(name, _shape(value), _structure(value), 0.0, 0.0)
        missing.passed, missing.note = False, "missing from the optimized model"
        checks.append(missing)
    for name, value in list(actual.items())[len(pairs) :]:
        extra = OutputCheck(name, _shape(value), _structure(value), 0.0, 0.0)
        extra.passed, extra.note = False, "not an output of the reference"
        checks.append(extra)
    return checks


def verify_models(
    original: Path | None,
    optimized: Path,
    *,
    input_shape: str = "",
    inputs: Path | None = None,
    golden: Path | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    providers: str | None = None,
    seed: int = 0,
) -> VerifyResult:
    """Run the reference (ORIGINAL, or the --golden outputs) and OPTIMIZED on the same feeds.

    Bad arguments and an ORIGINAL that does not run raise FusectlError (exit 2); an OPTIMIZED
    that does not run raises VerifyFailed (exit 1). Outputs beyond tolerance are in the result.
    """
    if (original is None) == (golden is None):
        raise FusectlError(
            "give ORIGINAL and OPTIMIZED, or --golden FILE.npz and one model"
            if original is None
            else "--golden replaces running ORIGINAL: give only the model to check"
        )
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise FusectlError(f"{name} must be a finite number >= 0, not {value}")
    chosen = parse_providers(providers)
    shapes = parse_input_shape(input_shape)
    golden_outputs = read_npz(golden, "reference outputs") if golden else None
    source = original if original is not None else optimized
    source_model = load_model(source).model
    checked_model = load_model(optimized).model if original is not None else source_model
    tolerance = default_tolerance(checked_model, atol, rtol)

    if golden_outputs is not None:
        assert golden is not None
        feeds, plans = model_feeds(source_model, shapes, inputs, seed)
        names = [value.name or "" for value in checked_model.graph.outputs]
        missing = [n for n in names if n not in golden_outputs]
        extra = [n for n in golden_outputs if n not in names]
        if missing or extra:
            problem = (
                f"no array for output(s) {', '.join(map(repr, missing))}"
                if missing
                else f"array(s) {', '.join(map(repr, extra))} name no model output"
            )
            raise FusectlError(f"{problem} (outputs: {', '.join(names)})", path=golden)
        expected = {name: golden_outputs[name] for name in names}
        reference, reference_path, fallback = "golden", golden, ""
    else:
        assert original is not None
        feeds, plans, expected, fallback = reference_run(
            original, source_model, shapes, inputs, seed, chosen, definition=True
        )
        reference, reference_path = "original", original
    actual = run_model(optimized, feeds, chosen, failure=VerifyFailed)
    result = VerifyResult(
        reference, reference_path, optimized, chosen, tolerance, feeds, plans, fallback=fallback
    )
    result.checks = pair_outputs(expected, actual, tolerance)
    return result


class Reference(NamedTuple):
    """The feeds, their plans, the original's outputs on them, and what computed those: an
    empty ``fallback``, onnxruntime; else why onnx's reference evaluator did instead."""

    feeds: dict[str, np.ndarray]
    plans: dict[str, FeedPlan]
    outputs: dict[str, Any]
    fallback: str = ""


def reference_run(
    original: Path,
    model: ir.Model,
    shapes: dict[str, list[int]],
    inputs: Path | None,
    seed: int,
    providers: list[str],
    *,
    definition: bool = False,
) -> Reference:
    """The feeds every command runs models on, and ``original``'s outputs on them (onnxruntime's
    optimizer off). Generated sizes for dimensions nothing sizes are guesses: where the model
    does not run at one, the next of FREE_SIZES is tried, and the error, if every one fails,
    names the inputs of the first try. With ``definition``, a model onnxruntime runs at none of
    them is run by onnx's reference evaluator on the first try's feeds, the ops as onnx defines
    them (the dynamo exporter's opset-23 RotaryEmbedding, whose batch-1 caches onnxruntime's
    kernel rejects above batch 1), where that evaluator can run it."""
    sizes = free_sizes(model, shapes) if inputs is None else [DEFAULT_DIM]
    first: tuple[_Failed, str] | None = None
    tried: list[int] = []
    first_feeds: tuple[dict[str, np.ndarray], dict[str, FeedPlan]] | None = None
    for free in sizes:
        feeds, plans = model_feeds(model, shapes, inputs, seed, free)
        outcome = _run(original, feeds, providers)
        if not isinstance(outcome, _Failed):
            return Reference(feeds, plans, outcome)
        tried.append(free)
        first = first or (outcome, describe_feeds(feeds, plans).removeprefix("inputs: "))
        first_feeds = first_feeds or (feeds, plans)
        if outcome.at_load:
            break  # no size makes a model onnxruntime cannot load run
    assert first is not None and first_feeds is not None
    failed, described = first
    if definition:
        outputs = _by_definition(original, first_feeds[0])
        if outputs is not None:
            return Reference(*first_feeds, outputs, f"onnxruntime cannot run it: {failed.message}")
    hint = ""
    # Generated sizes are guesses for symbolic dimensions (a 2-D mask, 8 channels): say so.
    if inputs is None and any(
        not isinstance(d, int) for spec in graph_inputs(model) for d in spec.dims or ()
    ):
        later = " and ".join(map(str, tried[1:]))
        if later:
            described += f"; free size{'s' if len(tried) > 2 else ''} {later} "
            described += "fail too" if len(tried) > 2 else "fails too"
        hint = (
            f" (on generated {described}; --input_shape sets the symbolic sizes, --inputs the data)"
        )
    raise FusectlError(f"onnxruntime cannot run it: {failed.message}{hint}", path=original)


def _by_definition(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """The model's outputs by onnx's reference evaluator; None where it cannot run it either
    (onnxruntime's contrib ops, say)."""
    from onnx.reference import ReferenceEvaluator

    try:
        evaluator = ReferenceEvaluator(str(path))
        values = evaluator.run(None, {k: v for k, v in feeds.items() if k in evaluator.input_names})
    except Exception:  # any failure of the evaluator: the caller reports onnxruntime's error
        return None
    return dict(zip(evaluator.output_names, values, strict=True))


def _number(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def print_result(console: Console, result: VerifyResult) -> None:
    """The per-output table, the inputs used and the tolerance with its reason."""
    table = Table(title=f"fusectl verify ({result.reference} vs optimized)", title_justify="left")
    for column, justify in (
        ("output", "left"),
        ("shape", "left"),
        ("max abs", "right"),
        ("max rel", "right"),
        ("worst index", "left"),
        ("verdict", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for check in result.checks:
        verdict = "[green]ok[/]" if check.passed else "[bold red]FAIL[/]"
        if check.note:
            verdict += f" [dim]{check.note}[/]"
        index = "-" if check.worst_index is None else str(list(check.worst_index))
        table.add_row(
            check.name,
            "x".join(map(str, check.shape)) or "scalar",
            _number(check.max_abs),
            _number(check.max_rel),
            index,
            verdict,
        )
    console.print(table)
    if result.fallback:
        console.print(
            f"{result.reference} computed by onnx's reference evaluator ({result.fallback})",
            markup=False,
            soft_wrap=True,
        )
    console.print(describe_feeds(result.feeds, result.plans), markup=False, soft_wrap=True)
    tol = result.tolerance
    why = "given" if tol.numerics == "given" else f"{tol.numerics} passes fired"
    if tol.numerics == Numerics.EXACT.value and not tol.passes:
        why = "no fused nodes"
    console.print(
        f"tolerance: atol {tol.atol:g}, rtol {tol.rtol:g} ({why}); providers "
        f"{', '.join(result.providers)}",
        markup=False,
        soft_wrap=True,
    )
    state = "all outputs within tolerance" if result.passed else result.summary()
    console.print(f"{len(result.checks)} output(s): {state}", markup=False)
