"""`fusectl bisect`: which pass, and which of its fusion sites, pushed outputs past tolerance.

Every rewrite of a run has a number in execution order (fusectl.rewrite.context.Rewrites, as LLVM's
opt-bisect numbers its transformations), and a run may stop at a limit or leave numbers out.
The search binary-searches the limit for the first rewrite whose run fails; that rewrite is a
culprit site and its pass a culprit pass. It is then left out and the search goes on above it
until the full run, culprits left out, is within tolerance: m culprit sites among n rewrites cost
about m * (log2 n + 1) rounds, one round being an optimizer run plus an onnxruntime run.

A culprit's error is measured on the two runs the search ended on: every rewrite before it
(earlier culprits left out) without it, and with it. Those earlier rewrites are within
tolerance, so the difference is the site's own contribution; no extra round is spent on it.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fusectl.core.engine import run_plan
from fusectl.core.model_io import load_model, save_model
from fusectl.core.paths import check_outputs, write_text_atomic
from fusectl.core.repository import repository_gate
from fusectl.core.switches import Plan
from fusectl.diagnostics.verify import (
    Tolerance,
    VerifyFailed,
    default_tolerance,
    pair_outputs,
    parse_providers,
    reference_run,
    run_model,
)
from fusectl.errors import FusectlError
from fusectl.rewrite.context import MAIN_GRAPH, FusionSite, Rewrites, UnguardedRewrite
from fusectl.rewrite.registry import Category
from fusectl.rewrite.shapes import ShapeOracle, apply_input_shapes, parse_input_shape

# A run failing beyond this many culprit sites is not one bad pass: stop and say so.
MAX_CULPRITS = 64


@dataclass
class Trial:
    """One round: the optimizer run with some rewrites left out, then onnxruntime."""

    limit: int | None
    skip: frozenset[int]
    rewrites: int  # rewrites numbered in the run, performed or not
    max_abs: float
    max_rel: float
    passed: bool
    sites: dict[int, tuple[str, FusionSite]]  # number -> (pass, site), performed ones
    note: str = ""


@dataclass
class Culprit:
    """A rewrite that takes the outputs past tolerance on its own."""

    index: int
    pass_name: str
    site: FusionSite
    error_before: float  # max abs error of every earlier rewrite, without this one
    error_with: float  # ... and with it

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pass": self.pass_name,
            "pattern": self.site.pattern,
            "new_nodes": self.site.new_names,
            "original_nodes": self.site.original_names,
            "original_types": self.site.original_types,
            "layer": self.site.layer,
            "graph": self.site.graph,
            "max_abs_before": _finite(self.error_before),
            "max_abs_with": _finite(self.error_with),
        }


@dataclass
class PassError:
    """Per-pass attribution: the error once the passes up to this one have run."""

    pass_name: str
    rewrites: int
    max_abs: float
    max_rel: float
    passed: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": self.pass_name,
            "rewrites": self.rewrites,
            "max_abs": _finite(self.max_abs),
            "max_rel": _finite(self.max_rel),
            "passed": self.passed,
        }


@dataclass
class BisectResult:
    tolerance: Tolerance
    full: Trial
    culprits: list[Culprit] = field(default_factory=list)
    attribution: list[PassError] = field(default_factory=list)
    rounds: int = 0
    resolved: bool = True  # the full run with the culprits left out is within tolerance
    switch_file: Path | None = None
    switch_check: Trial | None = None  # the run with the culprit passes off

    @property
    def culprit_passes(self) -> list[str]:
        return list(dict.fromkeys(c.pass_name for c in self.culprits))

    def to_json(self) -> dict[str, Any]:
        tol = self.tolerance
        check = self.switch_check
        return {
            "passed": self.full.passed,
            "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "numerics": tol.numerics},
            "rewrites": self.full.rewrites,
            "max_abs": _finite(self.full.max_abs),
            "max_rel": _finite(self.full.max_rel),
            "culprit_passes": self.culprit_passes,
            "culprits": [c.to_json() for c in self.culprits],
            "resolved": self.resolved,
            "rounds": self.rounds,
            "switch_file": str(self.switch_file) if self.switch_file else None,
            "with_switch_file": None
            if check is None
            else {"passed": check.passed, "max_abs": _finite(check.max_abs)},
            "per_pass": [row.to_json() for row in self.attribution],
        }


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


class Bisector:
    """Runs rounds on one model with fixed feeds, reference outputs and tolerance."""

    def __init__(
        self,
        model_path: Path,
        plan: Plan,
        *,
        target: str,
        input_shape: str,
        inputs: Path | None,
        seed: int,
        providers: str | None,
        atol: float | None,
        rtol: float | None,
        workdir: Path,
        repository: str | None = None,
    ) -> None:
        self.model_path = model_path
        self.repository = repository
        self.plan = plan
        self.target = target
        self.shapes = parse_input_shape(input_shape)
        self.providers = parse_providers(providers)
        self.workdir = workdir
        self.rounds = 0
        source = load_model(model_path)
        self.feeds, _, self.expected, _ = reference_run(
            model_path, source.model, self.shapes, inputs, seed, self.providers, definition=True
        )
        self.atol, self.rtol = atol, rtol
        # Set by the first (full) run: every round is judged by the tolerance it earns, as a
        # prefix that fired fewer approximate passes must not be held to a tighter one.
        self.tolerance: Tolerance | None = None

    def trial(self, limit: int | None = None, skip: frozenset[int] = frozenset()) -> Trial:
        """Optimize with rewrites from ``limit`` on and those in ``skip`` left out, and compare."""
        self.rounds += 1
        loaded = load_model(self.model_path)
        model = loaded.model
        apply_input_shapes(model, self.shapes, self.model_path)
        rewrites = Rewrites(limit=limit, skip=skip)
        # The repository declines before a rewrite is numbered: every round agrees on numbers.
        gate = repository_gate(self.providers, self.repository)
        try:
            result = run_plan(
                model,
                self.plan,
                target=self.target,
                shapes=ShapeOracle(model, lambda: loaded.proto),
                rewrites=rewrites,
                site_gates=(gate,) if gate is not None else (),
            )
        except UnguardedRewrite as error:
            raise FusectlError(f"cannot bisect: {error}") from None
        sites = {
            site.index: (run.decision.name, site)
            for run in result.runs
            if run.ctx is not None
            for site in run.ctx.sites
            if site.index is not None
        }
        if self.tolerance is None:
            self.tolerance = default_tolerance(model, self.atol, self.rtol)
        path = self.workdir / f"round{self.rounds}.onnx"
        save_model(model, path, external=loaded.uses_external_data, outside_ir=loaded.outside_ir)
        try:
            actual = run_model(path, self.feeds, self.providers, failure=VerifyFailed)
        except VerifyFailed as error:
            return Trial(limit, skip, rewrites.count, math.inf, math.inf, False, sites, str(error))
        checks = pair_outputs(self.expected, actual, self.tolerance)
        return Trial(
            limit,
            skip,
            rewrites.count,
            max((c.max_abs for c in checks), default=0.0),
            max((c.max_rel for c in checks), default=0.0),
            all(c.passed for c in checks),
            sites,
        )


@contextlib.contextmanager
def _bisector(model_path: Path, plan: Plan, target: str, **options: Any) -> Iterator[Bisector]:
    """A Bisector whose rounds write their models to a temporary folder, removed after."""
    with tempfile.TemporaryDirectory(prefix="fusectl-bisect-") as tmp:
        yield Bisector(model_path, plan, target=target, workdir=Path(tmp), **options)


def attribute(bisector: Bisector, full: Trial) -> list[PassError]:
    """The error after each pass that rewrote something: one round per such pass, each run
    stopping after that pass's last rewrite."""
    last: dict[str, int] = {}
    for index, (name, _) in sorted(full.sites.items()):
        last[name] = index
    rows = []
    for name, index in sorted(last.items(), key=lambda item: item[1]):
        trial = full if index == full.rewrites - 1 else bisector.trial(limit=index + 1)
        count = sum(1 for i, (owner, _) in full.sites.items() if owner == name)
        rows.append(PassError(name, count, trial.max_abs, trial.max_rel, trial.passed))
    return rows


def find_culprits(bisector: Bisector, full: Trial) -> tuple[list[Culprit], bool]:
    """The culprit sites in execution order, and whether leaving them out passes."""
    culprits: list[Culprit] = []
    skip: frozenset[int] = frozenset()
    # Invariants: the run stopping at ``low`` passes (no rewrites at all for 0), the run
    # stopping at ``high`` fails; both leave ``skip`` out.
    low, low_error = 0, 0.0
    failing = full
    high = full.rewrites
    for _ in range(MAX_CULPRITS):
        while high - low > 1:
            middle = (low + high) // 2
            trial = bisector.trial(limit=middle, skip=skip)
            if trial.passed:
                low, low_error = middle, trial.max_abs
            else:
                high, failing = middle, trial
        index = high - 1
        if low != index or index not in failing.sites:
            return culprits, False  # the error does not enter at one rewrite
        name, site = failing.sites[index]
        culprits.append(Culprit(index, name, site, low_error, failing.max_abs))
        skip |= {index}
        rest = bisector.trial(skip=skip)
        if rest.passed:
            return culprits, True
        # Leaving ``index`` out renumbers nothing below it: stopping just above it passes.
        low, failing, high = index + 1, rest, rest.rewrites
        if high <= low:
            return culprits, False
    return culprits, False


def switch_document(passes: list[tuple[str, Category]]) -> str:
    """An Ascend JSON switch file that turns the given passes off."""
    switch: dict[str, dict[str, str]] = {}
    for name, category in passes:
        switch.setdefault(category.value, {})[name] = "off"
    return json.dumps({"Switch": switch}, indent=4) + "\n"


def bisect_model(
    model_path: Path,
    plan: Plan,
    *,
    target: str = "ort",
    input_shape: str = "",
    inputs: Path | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    providers: str | None = None,
    output_switch: Path | None = None,
    force: bool = False,
    protected: Path | None = None,
    per_pass: bool = False,
    repository: str | None = None,
) -> BisectResult:
    """Verify the full optimization; when it fails, find the culprit pass(es) and sites and
    write a switch file turning them off at ``output_switch`` (checked with one more round).

    An existing ``output_switch`` is replaced only with ``force``, and never when it is the
    model or the ``protected`` switch file the plan came from.
    """
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise FusectlError(f"{name} must be a finite number >= 0, not {value}")
    if output_switch is not None:
        keep = {model_path: "the input model"}
        if protected is not None:
            keep[protected] = "the --fusion_switch_file given"
        check_outputs({"--output_switch": output_switch}, protected=keep)
        if output_switch.exists() and not force:
            raise FusectlError(
                "--output_switch exists; fusectl bisect replaces it only with --force",
                path=output_switch,
            )
    options = {"input_shape": input_shape, "inputs": inputs, "seed": seed}
    options |= {"providers": providers, "atol": atol, "rtol": rtol, "repository": repository}
    with _bisector(model_path, plan, target, **options) as bisector:
        full = bisector.trial()
        assert bisector.tolerance is not None
        result = BisectResult(bisector.tolerance, full)
        if per_pass:
            result.attribution = attribute(bisector, full)
        if not full.passed:
            result.culprits, result.resolved = find_culprits(bisector, full)
        if result.culprits:
            bisector.plan = Plan(
                [
                    replace(d, enabled=False) if d.name in result.culprit_passes else d
                    for d in plan.decisions
                ],
                plan.warnings,
                plan.notes,
                plan.options,
            )
            result.switch_check = bisector.trial()
            if output_switch is not None:
                specs = {d.name: d.fusion_pass.spec for d in plan.decisions}
                off = [(name, specs[name].category) for name in result.culprit_passes]
                write_text_atomic(output_switch, switch_document(off))
                result.switch_file = output_switch
        result.rounds = bisector.rounds
    return result


def error_table_rows(rows: list[PassError]) -> Iterator[tuple[str, ...]]:
    """Rows (pass, rewrites, max abs, max rel, verdict) of the per-pass attribution."""
    for row in rows:
        yield (
            row.pass_name,
            str(row.rewrites),
            _number(row.max_abs),
            _number(row.max_rel),
            "ok" if row.passed else "FAIL",
        )


def _number(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def print_attribution(console: Console, rows: list[PassError]) -> None:
    """The table of the error after each pass that rewrote something."""
    table = Table(title="error after each pass (vs the original)", title_justify="left")
    for column in ("pass", "rewrites", "max abs", "max rel", "verdict"):
        table.add_column(column, justify="left" if column in ("pass", "verdict") else "right")
    for row in error_table_rows(rows):
        table.add_row(*row)
    console.print(table)


def per_pass_errors(
    model_path: Path, plan: Plan, *, target: str = "ort", **options: Any
) -> list[PassError]:
    """Per-pass attribution on its own (``verify --per_pass``): optimize MODEL again, stopping
    after each pass that rewrote something, and measure the error there. ``options`` are the
    inputs and tolerances ``verify`` takes (input_shape, inputs, seed, providers, atol, rtol)."""
    with _bisector(model_path, plan, target, **options) as bisector:
        return attribute(bisector, bisector.trial())


def print_result(console: Console, result: BisectResult) -> None:
    """What the search found, in the order a user acts on it."""
    tol = result.tolerance
    full = result.full
    if result.attribution:
        print_attribution(console, result.attribution)
    state = "within" if full.passed else "beyond"
    console.print(
        f"full run: {full.rewrites} rewrite(s), max abs {_number(full.max_abs)}, max rel "
        f"{_number(full.max_rel)}: {state} tolerance (atol {tol.atol:g}, rtol {tol.rtol:g})"
        + (f"; {full.note}" if full.note else ""),
        markup=False,
        soft_wrap=True,
    )
    if full.passed:
        console.print(f"nothing to find ({result.rounds} round(s))", markup=False)
        return
    for culprit in result.culprits:
        site = culprit.site
        console.print(
            f"culprit rewrite #{culprit.index}: {culprit.pass_name} ({site.pattern}) -> "
            f"{', '.join(site.new_names) or '(removed)'}; max abs "
            f"{_number(culprit.error_before)} -> {_number(culprit.error_with)}",
            markup=False,
            soft_wrap=True,
        )
        where = "" if site.graph == MAIN_GRAPH else f" (graph {site.graph})"
        console.print(
            f"    from: {', '.join(site.original_names)}{where}", markup=False, soft_wrap=True
        )
    if not result.resolved:
        console.print(
            "the remaining error does not enter at a single rewrite: rewrites interact",
            markup=False,
        )
    passes = ", ".join(result.culprit_passes) or "none"
    console.print(f"culprit pass(es): {passes}; {result.rounds} round(s)", markup=False)
    if result.switch_file is not None and result.switch_check is not None:
        check = result.switch_check
        verdict = "within" if check.passed else "still beyond"
        console.print(
            f"wrote {result.switch_file} (turns them off); with it: max abs "
            f"{_number(check.max_abs)}, {verdict} tolerance",
            markup=False,
            soft_wrap=True,
        )
