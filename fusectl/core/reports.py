"""What a run tells its users: fusion_result.json, the --report document, the summary table."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir
from rich.console import Console
from rich.table import Table

from fusectl.core.engine import GraphRun, PassRun, RunResult
from fusectl.core.repository import (
    KEPT_UNFUSED,
    UNFUSED,
    UNSUPPORTED,
    Repository,
    RepositoryGate,
    ms,
)
from fusectl.core.switches import Plan, Source
from fusectl.rewrite import coverage, runtime
from fusectl.rewrite.context import MAIN_GRAPH, PassContext, layer_of
from fusectl.rewrite.registry import Category, PassSpec
from fusectl.version import __version__

FUSION_RESULT_FORMATS = ("v3", "list", "object")


def _counted_runs(runs: list[PassRun]) -> list[PassRun]:
    return [run for run in runs if run.ctx is not None and run.ctx.spec.counted and run.ctx.matched]


def _sections(runs: list[PassRun], fmt: str) -> dict[str, dict[str, dict[str, str]]]:
    """One graph's graph_fusion / ub_fusion maps: counts as strings, matched passes only."""
    sections: dict[str, dict[str, dict[str, str]]] = {}
    for run in _counted_runs(runs):
        assert run.ctx is not None
        spec = run.ctx.spec
        entry = {"effect_times": str(run.ctx.effected), "match_times": str(run.ctx.matched)}
        if spec.category is Category.UB and fmt != "object":
            entry["repository_hit_times"] = str(run.ctx.repository_hits)
        key = "ub_fusion" if spec.category is Category.UB else "graph_fusion"
        sections.setdefault(key, {})[spec.name] = entry
    return sections


def fusion_result_document(result: RunResult, fmt: str = "v3") -> Any:
    """The Ascend fusion_result.json content: one member per graph with a match, as ATC writes
    one per graph (ids: fusectl.core.graphs). The CANN 5 ``object`` layout holds one graph:
    there the counts are summed over all graphs, under the main graph's id."""
    if fmt == "object":
        sections = _sections(result.runs, fmt)
        return {**sections, "session_and_graph_id": MAIN_GRAPH} if sections else {}
    graphs = [(graph.scope.graph_id, _sections(graph.runs, fmt)) for graph in result.graphs]
    if fmt == "v3":
        return {f"session_and_graph_id_{key}": found for key, found in graphs if found}
    return [{**found, "session_and_graph_id": key} for key, found in graphs if found]


def render_fusion_result(result: RunResult, fmt: str = "v3") -> str:
    # Sorted keys and a 4-space indent, without a trailing newline, as Ascend FE writes it.
    return json.dumps(fusion_result_document(result, fmt), indent=4, sort_keys=True)


def report_json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2) + "\n"


def write_report(path: Path, document: dict[str, Any]) -> None:
    """report_json's text, streamed to ``path``: a 100k-node graph's report is 9 MB of text,
    which as one string would raise the run's peak memory."""
    with path.open("w", encoding="utf-8") as handle:
        _IndentedJson(handle).write(document)
        handle.write("\n")


_ENCODE_STRING = json.encoder.encode_basestring_ascii
_CONSTANTS = {None: "null", True: "true", False: "false"}


class _IndentedJson:
    """The text ``json.dump(value, indent=2)`` writes, three times faster: json's own writer
    turns to a chain of Python generators whenever it indents, and a report lists every site
    of every pass. Values are what reports hold (dicts with string keys, lists, tuples,
    strings, numbers, booleans, None); anything else is left to json (TypeError)."""

    _CHUNK = 8192  # pieces gathered before a write

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._pieces: list[str] = []

    def write(self, value: Any) -> None:
        self._value(value, "\n")
        self._handle.write("".join(self._pieces))
        self._pieces.clear()

    def _value(self, value: Any, newline: str) -> None:
        pieces = self._pieces
        if isinstance(value, str):
            pieces.append(_ENCODE_STRING(value))
        elif value is None or value is True or value is False:
            pieces.append(_CONSTANTS[value])
        elif isinstance(value, int):
            pieces.append(int.__repr__(value))
        elif isinstance(value, float):
            pieces.append(json.dumps(value))
        elif isinstance(value, list | tuple):
            self._list(value, newline)
        elif isinstance(value, dict):
            self._dict(value, newline)
        else:
            pieces.append(json.dumps(value))  # raises as json would
        if len(pieces) > self._CHUNK:
            self._handle.write("".join(pieces))
            pieces.clear()

    def _list(self, items: list[Any] | tuple[Any, ...], newline: str) -> None:
        self._entries("[]", items, (("", item) for item in items), newline)

    def _dict(self, items: dict[Any, Any], newline: str) -> None:
        entries = (
            (_ENCODE_STRING(key if isinstance(key, str) else _key(key)) + ": ", item)
            for key, item in items.items()
        )
        self._entries("{}", items, entries, newline)

    def _entries(
        self, brackets: str, container: Any, entries: Iterator[tuple[str, Any]], newline: str
    ) -> None:
        """A list's items or a dict's (each after its key), one per line, indented."""
        pieces = self._pieces
        if not container:
            pieces.append(brackets)
            return
        inner = newline + "  "
        separator = "," + inner
        pieces.append(brackets[0] + inner)
        for index, (prefix, item) in enumerate(entries):
            pieces.append(separator + prefix if index else prefix)
            if type(item) is str:  # most items: spared a call
                pieces.append(_ENCODE_STRING(item))
            else:
                self._value(item, inner)
        pieces.append(newline + brackets[1])


def _key(key: Any) -> str:
    """A dict key that is not a string, as json writes it."""
    if key is None or key is True or key is False:
        return _CONSTANTS[key]
    if isinstance(key, int | float):
        return json.dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def default_fusion_result_path() -> Path:
    """./fusion_result.json, or $ASCEND_WORK_PATH/FE/<pid>/fusion_result.json as ATC does."""
    work = os.environ.get("ASCEND_WORK_PATH")
    if work:
        directory = Path(work) / "FE" / str(os.getpid())
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return directory / "fusion_result.json"
        except OSError:
            pass
    return Path("fusion_result.json")


def _providers(spec: PassSpec) -> list[str]:
    """The installed onnxruntime's providers with a kernel for every op the pass emits."""
    found: set[str] | None = None
    for op_type in spec.emits:
        have = set(runtime.providers(op_type, spec.emits_domain))
        found = have if found is None else found & have
    return sorted(found or ())


def _spec_document(spec: PassSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "aliases": list(spec.aliases),
        "category": spec.category.value,
        "default": "on" if spec.default_on else "off",
        "closable": spec.closable,
        "numerics": spec.numerics.value,
        "priority": spec.effective_priority,
        "again_after_fusions": spec.again_after_fusions,
        "targets": list(spec.targets),
        "min_opset": spec.min_opset,
        "emits": list(spec.emits),
        "emits_domain": spec.emits_domain,
        "providers": _providers(spec),
        "origin": spec.origin,
        "description": spec.description,
    }


def catalogue_document(
    specs: list[PassSpec], repository: Repository | None = None
) -> list[dict[str, Any]]:
    """Every pass as `fusectl passes --json` lists it; with a repository, each pass's entry
    carries its verdicts per measured provider (``repository``: provenance and the classes
    kept unfused)."""
    documents = [_spec_document(spec) for spec in specs]
    for document in documents:
        verdicts = []
        for section in repository.sections if repository is not None else ():
            mine = {k: v for k, v in section.sites.items() if v.get("pass") == document["name"]}
            if mine:
                verdicts.append(
                    {
                        "provenance": section.provenance,
                        "measured": len(mine),
                        "unfused": sorted(
                            k for k, v in mine.items() if v["decision"] in KEPT_UNFUSED
                        ),
                    }
                )
        if repository is not None:
            document["repository"] = verdicts
    return documents


def repository_lines(repository: Repository) -> list[str]:
    """The repository as `fusectl passes` ends with it: where and how it was measured, and
    which fused ops it keeps unfused."""
    if not repository.sections:
        return [f"Knowledge repository {repository.label}: empty"]
    lines = [f"Knowledge repository {repository.label}"]
    # Of several sections for a provider (one per CPU or GPU measured), the one this machine
    # takes (Repository.section) is marked.
    taken = {
        p: repository.section(p)[0] for p in dict.fromkeys(s.provider for s in repository.sections)
    }
    for section in repository.sections:
        unfused = [v for v in section.sites.values() if v["decision"] in KEPT_UNFUSED]
        here = "; the one this machine takes" if taken[section.provider] is section else ""
        lines.append(
            f"  {section.provenance}: {len(section.sites)} site class(es) measured, "
            f"{len(unfused)} kept unfused as slower (or not run there){here}"
        )
        if section.models:
            lines.append(f"  measured on: {', '.join(section.models)}")
        for entry in sorted(unfused, key=lambda v: (v.get("pass", ""), v.get("fused", []))):
            fused = " + ".join(entry.get("fused", [])) or "?"
            verdict = (
                f"does not run: {entry['error']}"
                if entry["decision"] == UNSUPPORTED
                else f"{ms(entry['fused_ms'])} ms vs {ms(entry['unfused_ms'])} ms unfused"
            )
            lines.append(
                f"    {entry.get('pass', '?')}: {fused} {verdict} "
                f"({', '.join(entry.get('inputs', []))})"
            )
    return lines


def model_layers(result: RunResult, model: ir.Model) -> set[str]:
    """The model's layers (see ``layer_of``), if any fusion site was in one: the layers the
    optimized graph's nodes still name, and those whose nodes were all fused away."""
    fused = {site.layer for run in result.runs if run.ctx for site in run.ctx.sites}
    fused.discard(None)
    if not fused:
        return set()
    layers = {layer for node in model.graph if (layer := layer_of(node))}
    return layers | fused  # type: ignore[arg-type]


def layer_coverage(
    run: PassRun, layers: set[str], runs: Sequence[PassRun] = ()
) -> dict[str, Any] | None:
    """For a pass that fuses into new ops in some layers of the model but not in all of them:
    how many, and which layers it missed. A layer where another of ``runs`` fused the same op
    class (the packed-QKV Attention in one layer, MultiHeadAttention in the next) is not
    missed."""
    ctx = run.ctx
    spec = run.decision.fusion_pass.spec
    if ctx is None or not spec.emits or not spec.every_layer or not layers:
        return None
    fused = {site.layer for site in ctx.sites if site.layer is not None}
    if not fused or fused >= layers:
        return None
    covered = set(fused)
    for other in runs:
        emits = other.decision.fusion_pass.spec.emits
        if other.ctx is not None and coverage.same_class(spec.emits, emits):
            covered |= {site.layer for site in other.ctx.sites if site.layer is not None}
    missing = sorted(layers - covered, key=_natural)
    if not missing:
        return None
    return {"fused": len(fused), "total": len(layers), "missing": missing}


def _natural(label: str) -> tuple[str, int]:
    name, _, index = label.rpartition(".")
    return name, int(index)


def _run_document(
    run: PassRun, order: int, layers: set[str] = frozenset(), runs: Sequence[PassRun] = ()
) -> dict[str, Any]:
    decision = run.decision
    entry: dict[str, Any] = {
        "name": decision.name,
        "category": decision.fusion_pass.spec.category.value,
        "state": "on" if decision.enabled else "off",
        "reason": decision.source.value,
        "reason_detail": decision.detail,
        "order": order,
        "priority": decision.priority,
        "numerics": decision.fusion_pass.spec.numerics.value,
    }
    ctx = run.ctx
    if ctx is None:
        return entry
    entry.update(
        _counts(ctx),
        patterns={
            stats.name: {"matched": stats.matched, "effected": stats.effected}
            for stats in ctx.patterns.values()
        },
        repository_hits=ctx.repository_hits,
        layers=layer_coverage(run, layers, runs),
        time_ms=round(run.seconds * 1e3, 3),
        nodes_before=run.nodes_before,
        nodes_after=run.nodes_after,
        sites=[
            {
                "pattern": site.pattern,
                "original_nodes": site.original_names,
                "original_types": site.original_types,
                "new_nodes": site.new_names,
                "graph": site.graph,
            }
            for site in ctx.sites
        ],
    )
    return entry


def _counts(ctx: PassContext) -> dict[str, Any]:
    """matched / effected / declined and the near-miss reasons with example sites."""
    declines = ctx.declines()
    return {
        "matched": ctx.matched,
        "effected": ctx.effected,
        "declined": sum(declines.values()),
        "near_misses": [
            {
                "reason": reason,
                "count": count,
                "examples": [
                    site
                    for stats in ctx.patterns.values()
                    for site in stats.decline_examples.get(reason, [])
                ][:3],
            }
            for reason, count in declines.most_common()
        ],
    }


def _graph_document(graph: GraphRun) -> dict[str, Any]:
    """One graph's part of the run: where it is, its size, and the passes that matched in it."""
    return {
        **graph.scope.to_json(),
        "nodes_before": graph.nodes_before,
        "nodes_after": None if graph.removed else graph.nodes_after,
        "passes": {
            run.decision.name: _counts(run.ctx)
            for run in graph.runs
            if run.ctx is not None and (run.ctx.matched or run.ctx.effected)
        },
    }


def model_stats(model: ir.Model) -> dict[str, Any]:
    ops = Counter(
        f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        for node in model.graph
    )
    return {
        "nodes": len(model.graph),
        "initializers": len(model.graph.initializers),
        "op_types": dict(sorted(ops.items())),
    }


def report_document(
    *,
    plan: Plan,
    result: RunResult,
    model_before: dict[str, Any],
    model_after: ir.Model,
    paths: dict[str, str | None],
    options: dict[str, Any],
    layers: set[str] = frozenset(),
) -> dict[str, Any]:
    """The --report / --json document: every pass with state, reason and effect."""
    return {
        "fusectl_version": __version__,
        "paths": paths,
        "options": options,
        "model": {"before": model_before, "after": model_stats(model_after)},
        "time_s": round(result.seconds, 4),
        "warnings": plan.warnings,
        "notes": plan.notes,
        "passes": [
            _run_document(run, order, layers, result.runs) for order, run in enumerate(result.runs)
        ],
        "graphs": [_graph_document(graph) for graph in result.graphs],
        "coverage": coverage.to_json(result.coverage),
        "fusion_result": fusion_result_document(result),
    }


def repository_document(gate: RepositoryGate) -> dict[str, Any]:
    """The knowledge repository's part in a run: where its measurements come from, and each
    site it decided (declined ones with the measured times)."""
    section = gate.section
    declined = [d for d in gate.decisions if d["decision"] in KEPT_UNFUSED]
    return {
        "provider": section.provider,
        "provenance": section.provenance,
        "hits": len(gate.decisions),
        "declined": len(declined),
        "decisions": gate.decisions,
    }


def repository_line(gate: RepositoryGate) -> str:
    """The summary's line on the repository (printed only when it decided something)."""
    slower = sum(1 for d in gate.decisions if d["decision"] == UNFUSED)
    unrun = sum(1 for d in gate.decisions if d["decision"] == UNSUPPORTED)
    return (
        f"knowledge repository ({gate.section.provenance}): {len(gate.decisions)} site(s) "
        f"decided, {slower} left unfused as slower on {gate.section.provider}"
        + (f", {unrun} as fused ops it does not run" if unrun else "")
    )


def graph_lines(result: RunResult) -> list[str]:
    """For a model with subgraphs or functions, one line per graph where a pass matched."""
    if len(result.graphs) < 2:
        return []
    lines = []
    for graph in result.graphs:
        runs = _counted_runs(graph.runs)
        if not runs:
            continue
        matched = sum(run.ctx.matched for run in runs if run.ctx)
        effected = sum(run.ctx.effected for run in runs if run.ctx)
        lines.append(
            f"graph {graph.scope.graph_id} ({graph.scope.label}): {matched} matched, "
            f"{effected} effected, nodes {graph.nodes_before} -> {graph.nodes_after}"
        )
    return lines


def print_summary(console: Console, result: RunResult, layers: set[str] = frozenset()) -> None:
    """A table of the passes that matched something or were switched explicitly, and the
    passes that fused in only some of the model's layers."""
    table = Table(title="fusectl passes", title_justify="left")
    table.add_column("pass", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for column in ("matched", "effected", "ms", "nodes"):
        table.add_column(column, justify="right", no_wrap=True)
    quiet = 0
    for run in result.runs:
        decision, ctx = run.decision, run.ctx
        spec = decision.fusion_pass.spec
        if spec.required:
            continue
        if (ctx is None or ctx.matched == 0) and decision.source is Source.DEFAULT:
            quiet += 1
            continue
        state = "on" if decision.enabled else f"off ({decision.source.value})"
        delta = run.nodes_after - run.nodes_before
        table.add_row(
            spec.name,
            state,
            str(ctx.matched) if ctx else "-",
            str(ctx.effected) if ctx else "-",
            f"{run.seconds * 1e3:.1f}" if ctx else "-",
            f"{delta:+d}" if ctx else "-",
        )
    console.print(table)
    for line in graph_lines(result):
        console.print(line, soft_wrap=True, markup=False)
    line = coverage.summary_line(result.coverage)
    if line:
        console.print(line)
    console.print(
        f"nodes {result.nodes_before} -> {result.nodes_after} in {result.seconds:.3f} s; "
        f"{quiet} other pass(es) matched nothing or are off by default"
    )
    for run in result.runs:
        missed = layer_coverage(run, layers, result.runs)
        if missed is not None:
            console.print(  # one line however many layers are missing: it is grepped for
                f"{run.decision.name} fused in {missed['fused']} of {missed['total']} "
                f"layers; none in {', '.join(missed['missing'])}",
                soft_wrap=True,
            )
