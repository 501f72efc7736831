"""Runs the resolved plan: each enabled pass in order, timed and counted."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx_ir as ir

from fusectl.core import logs
from fusectl.core.switches import Decision, Plan
from fusectl.errors import FusectlError
from fusectl.rewrite import coverage
from fusectl.rewrite.context import NodeNames, OpIndex, PassContext, Rewrites, SiteGate, release
from fusectl.rewrite.graph import reading_constants

if TYPE_CHECKING:
    from fusectl.diagnostics.sitecheck import SiteChecker
    from fusectl.rewrite.shapes import ShapeOracle


@dataclass
class PassRun:
    """One entry of the plan after the run: its decision, and what it did if it ran."""

    decision: Decision
    ctx: PassContext | None = None
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0


@dataclass
class RunResult:
    runs: list[PassRun]
    nodes_before: int
    nodes_after: int
    seconds: float
    # Fused and written-out computations per op class in the optimized graph.
    coverage: dict[str, coverage.ClassCoverage] = field(default_factory=dict)


AfterPass = Callable[[PassRun, ir.Model], None]
BeforePass = Callable[[Decision], None]


def model_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))


# Rounds of the canonicalization group at most: each round that changes something exposes
# less; real models settle in two or three.
_CANONICAL_ROUNDS = 8


def _canonical_group(decisions: list[Decision], start: int) -> range:
    """The decisions from ``start`` run together: a maximal run of canonical passes, or one."""
    end = start
    while end < len(decisions) and decisions[end].fusion_pass.spec.canonical:
        end += 1
    return range(start, max(end, start + 1))


def _run_pass(decision: Decision, model: ir.Model, ctx: PassContext) -> None:
    """Run one pass; a custom pass that raises is the plugin's fault, reported as bad input."""
    spec = decision.fusion_pass.spec
    try:
        decision.fusion_pass.run(model, ctx)
    except FusectlError:
        raise
    except Exception as error:
        if not spec.custom:
            raise
        raise FusectlError(
            f"custom pass {spec.name} ({spec.origin}) raised {type(error).__name__}: {error}"
        ) from error


def run_plan(
    model: ir.Model,
    plan: Plan,
    *,
    target: str,
    shapes: ShapeOracle | None = None,
    before_pass: BeforePass | None = None,
    after_pass: AfterPass | None = None,
    rewrites: Rewrites | None = None,
    site_checker: SiteChecker | None = None,
    site_gates: Sequence[SiteGate] = (),
) -> RunResult:
    """Apply every enabled pass of the plan to ``model`` in place, in plan order.

    ``rewrites`` numbers the rewrites across all passes and may leave some out (fusectl
    bisect); by default every rewrite happens. ``site_checker`` checks every rewrite of the
    custom passes before it lands (--check_custom); ``site_gates`` review every pass's
    rewrites (the knowledge repository, tune's recorder)."""
    start = time.perf_counter()
    nodes_before = len(model.graph)
    runs: list[PassRun] = []
    names = NodeNames()
    op_index = OpIndex()
    rewrites = rewrites if rewrites is not None else Rewrites()
    contexts: dict[int, PassContext] = {}

    def run_one(index: int, decision: Decision) -> bool:
        """Run one pass; a canonical pass run again keeps counting on its first context."""
        run = runs[index]
        if before_pass is not None:
            before_pass(decision)
        ctx = contexts.get(index)
        if ctx is None:
            custom = decision.fusion_pass.spec.custom and site_checker is not None
            ctx = contexts[index] = PassContext(
                decision.fusion_pass.spec,
                target,
                model_opset(model),
                shapes,
                names=names,
                rewrites=rewrites,
                options=plan.options,
                site_gates=(*((site_checker,) if custom else ()), *site_gates),
                keep_unfused=decision.fusion_pass.keep_unfused,
                op_index=op_index,
            )
            run.nodes_before = len(model.graph)
        was_changed, ctx.changed = ctx.changed, False
        nodes = len(model.graph)
        began = time.perf_counter()
        _run_pass(decision, model, ctx)
        run.seconds += time.perf_counter() - began
        run.nodes_after = len(model.graph)
        run.ctx = ctx
        # Only a pass that counts its changes and changed nothing leaves the index as it
        # found it; others may reorder or retype nodes without counting a rewrite.
        changed = ctx.changed or run.nodes_after != nodes
        if changed or not decision.fusion_pass.counts_changes:
            op_index.invalidate()
        release(ctx.removed)
        logs.pass_finished(ctx, run.seconds, run.nodes_before, run.nodes_after)
        if after_pass is not None:  # sees whether this round changed the graph
            after_pass(run, model)
        ctx.changed = ctx.changed or was_changed
        return changed

    decisions = plan.decisions
    runs.extend(PassRun(decision) for decision in decisions)
    position = 0
    with reading_constants():
        while position < len(decisions):
            group = _canonical_group(decisions, position)
            for index in group:
                if not decisions[index].enabled:
                    logs.skipped(decisions[index])
            enabled = [index for index in group if decisions[index].enabled]
            for _ in range(_CANONICAL_ROUNDS if len(group) > 1 else 1):
                changed = [run_one(index, decisions[index]) for index in enabled]
                if not any(changed):
                    break
            position += len(group)
    return RunResult(
        runs,
        nodes_before,
        len(model.graph),
        time.perf_counter() - start,
        coverage.measure(model.graph, runs),
    )
