"""Runs the resolved plan: each enabled pass in order, timed and counted."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx_ir as ir

from fusectl.core import logs
from fusectl.core.graphs import (
    GraphScope,
    defined_values,
    graph_scopes,
    initializers_to_constants,
    unshadow,
)
from fusectl.core.switches import Decision, Plan
from fusectl.errors import FusectlError
from fusectl.rewrite import coverage
from fusectl.rewrite.context import NodeNames, OpIndex, PassContext, Rewrites, SiteGate, release
from fusectl.rewrite.graph import reading_constants
from fusectl.rewrite.shapes import dimension_names, own_guesses

if TYPE_CHECKING:
    from fusectl.diagnostics.sitecheck import SiteChecker
    from fusectl.rewrite.shapes import ShapeOracle


@dataclass
class PassRun:
    """One entry of the plan after the run: its decision, and what it did if it ran (on one
    graph, or summed over all of them)."""

    decision: Decision
    ctx: PassContext | None = None
    seconds: float = 0.0
    # The graph's nodes before the pass first ran, and that count moved by what its own runs
    # added or removed (other passes run between the rounds of a canonical pass).
    nodes_before: int = 0
    nodes_after: int = 0


@dataclass
class GraphRun:
    """The plan's run on one graph of the model: one PassRun per decision."""

    scope: GraphScope
    runs: list[PassRun]
    nodes_before: int
    nodes_after: int = 0
    # Whether a pass removed the graph (the node holding it, or the function, went away).
    removed: bool = False
    op_index: OpIndex = field(default_factory=OpIndex)


@dataclass
class RunResult:
    # Per decision, summed over every graph; node counts are over every graph too.
    runs: list[PassRun]
    nodes_before: int
    nodes_after: int
    seconds: float
    # Fused and written-out computations per op class in the optimized graph.
    coverage: dict[str, coverage.ClassCoverage] = field(default_factory=dict)
    # Per graph (fusectl.core.graphs), the main graph first.
    graphs: list[GraphRun] = field(default_factory=list)


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


class PassFailure(Exception):
    """A built-in pass raised on this model: a fusectl bug, not the input's fault. The model it
    ran on is left part-rewritten; ``fusectl.optimize`` runs again from the input without the
    pass, or raises this where asked to (``--pass_errors raise``)."""

    def __init__(self, decision: Decision, error: Exception) -> None:
        self.decision, self.error = decision, error
        super().__init__(f"{decision.name} raised {type(error).__name__}: {error}")


def _run_pass(decision: Decision, model: ir.Model, ctx: PassContext) -> None:
    """Run one pass; a custom pass that raises is the plugin's fault, reported as bad input,
    and a built-in one that raises is a PassFailure."""
    spec = decision.fusion_pass.spec
    try:
        decision.fusion_pass.run(model, ctx)
    except FusectlError:
        raise
    except Exception as error:
        if not spec.custom:
            raise PassFailure(decision, error) from error
        raise FusectlError(
            f"custom pass {spec.name} ({spec.origin}) raised {type(error).__name__}: {error}"
        ) from error


def _total(decision: Decision, parts: list[PassRun]) -> PassRun:
    """A decision's run summed over the graphs it ran on."""
    ran = [part for part in parts if part.ctx is not None]
    if not ran:
        return PassRun(decision)
    return PassRun(
        decision,
        PassContext.total([part.ctx for part in ran if part.ctx is not None]),
        sum(part.seconds for part in ran),
        sum(part.nodes_before for part in ran),
        sum(part.nodes_after for part in ran),
    )


def _keep_declared_shapes(graph: ir.Graph, declared: dict[str | None, ir.Shape | None]) -> None:
    """The graph outputs keep the dimension names the model declares, where inference has
    only renamed them (``batch`` -> ``unk__20``): a name ties an output to the inputs, and
    callers size buffers by it. A size inference proves static stays (an exporter's made-up
    name for it said nothing), as does a name the graph inputs use."""
    inputs = dimension_names(graph.inputs)
    for value in graph.outputs:
        shape, now = declared.get(value.name), value.shape
        if shape is None or now is None or len(now) != len(shape):
            if shape is not None:
                value.shape = shape
            continue
        value.shape = ir.Shape(
            [_kept(old, new, inputs) for old, new in zip(shape, now, strict=True)]
        )


def _kept(
    old: int | ir.SymbolicDim, new: int | ir.SymbolicDim, inputs: set[str]
) -> int | ir.SymbolicDim:
    """One output dimension: a static size, else an input's name, else the declared one."""
    if isinstance(new, int) or isinstance(old, int):
        return new if isinstance(new, int) else old
    return new if new.value in inputs or old.value is None else old


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

    Each pass runs on every graph of the model (fusectl.core.graphs: the main graph, then
    If/Loop/Scan bodies and model-local functions) before the next pass runs, so that a pass
    sees the constants an earlier pass folded in an enclosing graph; each graph keeps its own
    counts. ``before_pass`` and ``after_pass`` are called once per pass run (over all graphs).

    ``rewrites`` numbers the rewrites across all passes and graphs and may leave some out
    (fusectl bisect); by default every rewrite happens. ``site_checker`` checks every rewrite
    of the custom passes before it lands (--check_custom); ``site_gates`` review every pass's
    rewrites (the knowledge repository, tune's recorder)."""
    start = time.perf_counter()
    decisions = plan.decisions
    graphs = [
        GraphRun(scope, [PassRun(decision) for decision in decisions], len(scope.graph))
        for scope in graph_scopes(model)
    ]
    names = NodeNames([graph.scope.graph for graph in graphs])
    # The values the model came with, when it has subgraphs (see unshadow).
    original = (
        {v for g in graphs for v in defined_values(g.scope.graph)} if len(graphs) > 1 else set()
    )
    rewrites = rewrites if rewrites is not None else Rewrites()
    declared = {value.name: value.shape for value in model.graph.outputs}

    def run_on(graph: GraphRun, index: int, decision: Decision) -> bool:
        """Run one pass on one graph; a canonical pass run again keeps counting on its first
        context. Leaves ``ctx.changed`` saying whether this run changed the graph."""
        scope, run = graph.scope, graph.runs[index]
        ctx = run.ctx
        if ctx is None:
            custom = decision.fusion_pass.spec.custom and site_checker is not None
            ctx = run.ctx = PassContext(
                decision.fusion_pass.spec,
                target,
                model_opset(scope.model),
                shapes,
                names=names,
                rewrites=rewrites,
                options=plan.options,
                site_gates=(*((site_checker,) if custom else ()), *site_gates),
                keep_unfused=decision.fusion_pass.keep_unfused,
                op_index=graph.op_index,
                graph_id=scope.graph_id,
            )
            run.nodes_before = run.nodes_after = len(scope.graph)
        ctx.changed = False
        nodes = len(scope.graph)
        began = time.perf_counter()
        _run_pass(decision, scope.model, ctx)
        if scope.kind == "function":
            initializers_to_constants(scope.graph)
        run.seconds += time.perf_counter() - began
        # A pass that runs in rounds (canonical, again after the fusions) counts what its own
        # runs added or removed, not what other passes did between them.
        now = len(scope.graph)
        run.nodes_after += now - nodes
        # Only a pass that counts its changes and changed nothing leaves the index as it
        # found it; others may reorder or retype nodes without counting a rewrite.
        changed = ctx.changed or now != nodes
        if changed or not decision.fusion_pass.counts_changes:
            graph.op_index.invalidate()
        release(ctx.removed)
        logs.pass_finished(ctx, run.seconds, nodes, now)
        return changed

    def run_one(index: int, decision: Decision) -> bool:
        """Run one pass on every graph still in the model."""
        if before_pass is not None:
            before_pass(decision)
        ran: list[tuple[GraphRun, bool]] = []
        changed = False
        for graph in graphs:
            if not graph.scope.alive(model):  # checked as late as possible: the pass itself
                continue  # may have just removed it from the main graph
            ctx = graph.runs[index].ctx
            ran.append((graph, ctx is not None and ctx.changed))
            changed = run_on(graph, index, decision) or changed
        if after_pass is not None:  # sees whether this round changed a graph
            after_pass(_total(decision, [graph.runs[index] for graph, _ in ran]), model)
        for graph, earlier in ran:
            ctx = graph.runs[index].ctx
            assert ctx is not None
            ctx.changed = ctx.changed or earlier
        return changed

    # Enabled graph passes that take what the fusions make adjacent run again once every
    # pass has run (see PassSpec.again_after_fusions), on shapes re-derived through the fused
    # ops; the required passes that tidy the graph run again after them where they changed
    # it, round after round until nothing changes (as a second run would find it).
    again = [
        index
        for index, decision in enumerate(decisions)
        if decision.enabled and decision.fusion_pass.spec.again_after_fusions
    ]
    tidy = [
        index
        for index, decision in enumerate(decisions)
        if decision.enabled and decision.fusion_pass.spec.required
    ]

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
        if shapes is not None and again:
            # Re-derived on the graph the fusions made, their contrib ops included
            # (fusectl.rewrite.contrib_inference), as a second run would see it.
            shapes.invalidate()
        for _ in range(_CANONICAL_ROUNDS):  # to a fixpoint: a folded Shape frees a pair
            if not any([run_one(index, decisions[index]) for index in again]):
                break
            for index in tidy:
                run_one(index, decisions[index])
            if shapes is not None:
                # What a later pass of the round made (a layout chain's constant target) is
                # what the next round's earlier passes read, as a second run would.
                shapes.invalidate()
    for graph in graphs:
        graph.removed = not graph.scope.alive(model)
        graph.nodes_after = 0 if graph.removed else len(graph.scope.graph)
    live = [graph for graph in graphs if not graph.removed]
    unshadow([graph.scope for graph in live], original)
    _keep_declared_shapes(model.graph, declared)
    if shapes is not None:
        shapes.own_guesses()
    else:
        own_guesses(model.graph)
    totals = [
        _total(decision, [graph.runs[index] for graph in graphs])
        for index, decision in enumerate(decisions)
    ]
    return RunResult(
        totals,
        sum(graph.nodes_before for graph in graphs),
        sum(graph.nodes_after for graph in live),
        time.perf_counter() - start,
        coverage.measure([graph.scope.graph for graph in live], totals),
        graphs,
    )
