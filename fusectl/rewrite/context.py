"""What a pass sees while it runs, and what it records: matches, effects, declines, lineage."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    import onnx_ir as ir

    from fusectl.rewrite.registry import PassSpec
    from fusectl.rewrite.shapes import ShapeOracle

LINEAGE_PASSES = "fusectl.pass_name"
LINEAGE_NAMES = "fusectl.original_op_names"
LINEAGE_TYPES = "fusectl.original_op_types"

# How many example sites a decline reason keeps for the report.
DECLINE_EXAMPLES = 3
# The main graph's id in fusion_result.json (see fusectl.core.graphs for the others).
MAIN_GRAPH = "0_0"


@dataclass
class PatternStats:
    """Counts for one pattern of a pass, as in the Ascend GraphFusionPass log line."""

    name: str
    matched: int = 0
    effected: int = 0
    declines: Counter[str] = field(default_factory=Counter)
    decline_examples: dict[str, list[str]] = field(default_factory=dict)
    _declined: set[tuple[str, str]] = field(default_factory=set, repr=False)

    def decline(self, reason: str, site: str) -> None:
        """Count a candidate declined, once however often it is met again for the same reason
        (a canonicalization pass runs again until the graph settles)."""
        if (reason, site) in self._declined:
            return
        self._declined.add((reason, site))
        self.matched += 1
        self.declines[reason] += 1
        examples = self.decline_examples.setdefault(reason, [])
        if len(examples) < DECLINE_EXAMPLES:
            examples.append(site)

    def settle(self, site: str) -> None:
        """Take back every decline of a site that a later round rewrote after all (a
        canonicalization pass runs again as the graph settles, on better shapes)."""
        for reason in list(self.declines):
            if (reason, site) in self._declined:
                self.withdraw(reason, site)

    def withdraw(self, reason: str, site: str) -> None:
        """Take a decline back: another pattern of the pass rewrote that candidate after all."""
        self._declined.discard((reason, site))
        self.matched -= 1
        self.declines[reason] -= 1
        if not self.declines[reason]:
            del self.declines[reason]
        examples = self.decline_examples.get(reason, [])
        if site in examples:
            examples.remove(site)
        if not examples:
            self.decline_examples.pop(reason, None)


@dataclass
class FusionSite:
    """One rewrite: which pattern, which original nodes, which nodes replaced them."""

    pattern: str
    original_names: list[str]
    original_types: list[str]
    new_names: list[str]
    layer: str | None = None
    index: int | None = None  # the run-wide rewrite number (see Rewrites)
    graph: str = MAIN_GRAPH  # the id of the graph it is in


# A model layer in exporters' node names and dynamo's namespace metadata: "/inner/h.0/attn/..",
# "encoder/layer.3/..", "layers.0: LlamaDecoderLayer/..". The first (outermost) one counts.
_LAYER = re.compile(r"(?<!\w)(?:layers?|h|blocks?)\.\d+(?!\d)")


def layer_of(node: ir.Node) -> str | None:
    """The layer a node belongs to, by its name or its namespace metadata, if either says."""
    for text in (node.name, node.metadata_props.get("namespace")):
        found = _LAYER.search(text) if text and "." in text else None
        if found is not None:
            return found.group(0)
    return None


def _json_strings(items: Sequence[str]) -> str:
    """``json.dumps(items)`` for a list of strings, byte for byte, at under half its cost
    (it is written three times per rewrite)."""
    return "[" + ", ".join(map(json.encoder.encode_basestring_ascii, items)) + "]"


class NodeNames:
    """The node names in use, collected on first need, so that the names passes give new
    nodes never collide (``<Pass>/Add`` + ``_1`` vs ``<Pass>/Add_1``). With ``graphs`` (every
    graph of the model) they are unique model-wide: the value names derived from them then
    never shadow a name of an enclosing graph."""

    def __init__(self, graphs: Sequence[ir.Graph] = ()) -> None:
        self._taken: set[str] | None = None
        self._graphs = graphs

    def claim(self, graph: ir.Graph, name: str) -> str:
        if self._taken is None:
            self._taken = {node.name for g in self._graphs or (graph,) for node in g if node.name}
        candidate, suffix = name, 0
        while candidate in self._taken:
            suffix += 1
            candidate = f"{name}_{suffix}"
        self._taken.add(candidate)
        return candidate


class OpIndex:
    """The graph's nodes by op identifier, in graph order. One scan of a 100k-node graph costs
    50 ms, and most passes match nothing, so consecutive passes share one index until a pass
    changes the graph or may have changed it uncounted (the engine then drops it; see
    FusionPass.counts_changes). A pass that rewrites extends the lists it is given with the
    nodes it adds."""

    def __init__(self) -> None:
        self._by_op: dict[ir.OperatorIdentifier, list[ir.Node]] | None = None

    def nodes(self, graph: ir.Graph) -> dict[ir.OperatorIdentifier, list[ir.Node]]:
        if self._by_op is None:
            self._by_op = {}
            for node in graph:
                self._by_op.setdefault(node.op_identifier(), []).append(node)
        return self._by_op

    def of_type(
        self, graph: ir.Graph, op_type: str, domains: tuple[str, ...] = ("",)
    ) -> list[ir.Node]:
        """The graph's nodes of one op type in these domains, any overload, in graph order: a
        snapshot, which a pass may walk while it rewrites (removed nodes then have no graph)."""
        by_op = self.nodes(graph)
        keys = [key for key in by_op if key[0] in domains and key[1] == op_type]
        if len(keys) > 1:  # domains or overloads: their lists cannot be merged in graph order
            return [n for n in graph if n.op_type == op_type and n.domain in domains]
        return list(by_op[keys[0]]) if keys else []

    def holds(
        self, graph: ir.Graph, op_types: Collection[str], domains: tuple[str, ...] = ("",)
    ) -> bool:
        """Whether the graph has a node of one of these op types in these domains: a pass
        whose every rewrite starts at such a node need not walk a graph without one (asked
        as a pass starts, when the index is exact)."""
        return any(key[0] in domains and key[1] in op_types for key in self.nodes(graph))

    def invalidate(self) -> None:
        self._by_op = None


@dataclass
class Rewrites:
    """Numbers every rewrite of one run in execution order, as LLVM's opt-bisect does, and
    declines those a bisection leaves out: numbers from ``limit`` on, and those in ``skip``.

    The numbering is deterministic, so two runs agree on every number below the first one
    either of them declined; that is what lets a bisection compare runs by number.
    """

    limit: int | None = None
    skip: frozenset[int] = frozenset()
    count: int = 0

    def claim(self) -> tuple[int, str | None]:
        """The next number, and why the rewrite it stands for must not happen, if it must not."""
        index = self.count
        self.count += 1
        if index in self.skip or (self.limit is not None and index >= self.limit):
            return index, f"bisect: rewrite #{index} skipped"
        return index, None


class SiteGate(Protocol):
    """Asked before a rewrite lands (``replace_subgraph``): None lets it happen, a reason
    declines it and the site stays as it was. ``--check_custom`` runs both sides of a custom
    pass's site; the knowledge repository declines fusions measured slower on the provider."""

    def review(
        self,
        ctx: PassContext,
        pattern: str,
        site: str,
        old_nodes: Sequence[ir.Node],
        new_nodes: Sequence[ir.Node],
        old_outputs: Sequence[ir.Value],
        new_outputs: Sequence[ir.Value],
    ) -> str | None: ...


def release(nodes: list[ir.Node]) -> None:
    """Detach the outputs of nodes taken out of the graph (and of every use), then forget
    them. A node and its output values point at each other: without this the cycle outlives
    the node, and a run, which turns the cyclic garbage collector off, would keep every
    replaced node of a large graph in memory to the end."""
    for node in nodes:
        if node.graph is None and not any(v.uses() or v.is_graph_output() for v in node.outputs):
            node.resize_outputs(0)
    nodes.clear()


class UnguardedRewrite(RuntimeError):
    """A pass changed the graph without asking ``ctx.may_rewrite`` while a bisection ran."""


@dataclass
class PassContext:
    """Per-run state handed to a pass: options it may consult and counters it fills."""

    spec: PassSpec
    target: str
    opset: int
    shapes: ShapeOracle | None = None
    patterns: dict[str, PatternStats] = field(default_factory=dict)
    sites: list[FusionSite] = field(default_factory=list)
    changed: bool = False
    names: NodeNames = field(default_factory=NodeNames)
    rewrites: Rewrites = field(default_factory=Rewrites)
    options: dict[str, str] = field(default_factory=dict)
    # Asked in order before every replace_subgraph lands (see SiteGate).
    site_gates: tuple[SiteGate, ...] = ()
    # Sites whose class the knowledge repository had a decision for (either way).
    repository_hits: int = 0
    # The pass's FusionPass.keep_unfused, for a site the repository keeps unfused.
    keep_unfused: Callable[[Sequence[ir.Node]], bool] | None = None
    op_index: OpIndex = field(default_factory=OpIndex)
    # The graph the pass works on (see fusectl.core.graphs): a subgraph or function body has
    # its own context, its counts reported under its id.
    graph_id: str = MAIN_GRAPH
    # Nodes replace_subgraph took out of the graph, released once the pass is over.
    removed: list[ir.Node] = field(default_factory=list)
    # Sizes axes.symbolic_size traced in this run, with the depth each was sought at: a
    # rewrite keeps what every surviving value computes, so they stay true.
    sizes: dict[tuple[ir.Value, int], tuple[tuple[int, tuple[str, ...]] | None, int]] = field(
        default_factory=dict
    )
    # What a pass found out about values whose meaning no rewrite changes (an initializer's
    # contents), kept across the rounds a canonical pass runs in.
    facts: dict[object, object] = field(default_factory=dict)
    _granted: int | None = None

    @classmethod
    def total(cls, parts: Sequence[PassContext]) -> PassContext:
        """One pass's counts over every graph it ran on: the per-graph contexts summed (the
        context itself when there is one), sites in graph order."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        total = cls(first.spec, first.target, first.opset, first.shapes, options=first.options)
        for part in parts:
            for stats in part.patterns.values():
                mine = total.pattern(stats.name)
                mine.matched += stats.matched
                mine.effected += stats.effected
                mine.declines.update(stats.declines)
                for reason, sites in stats.decline_examples.items():
                    examples = mine.decline_examples.setdefault(reason, [])
                    examples += sites[: DECLINE_EXAMPLES - len(examples)]
            total.sites += part.sites
            total.changed = total.changed or part.changed
            total.repository_hits += part.repository_hits
        return total

    def shape(self, value: ir.Value) -> ir.Shape | None:
        """The value's shape, inferring shapes for the whole graph once if it is unknown."""
        return self.shapes.shape(value) if self.shapes is not None else value.shape

    def rank(self, value: ir.Value | None) -> int | None:
        """The value's rank, where its shape is known (an absent optional input: None)."""
        shape = self.shape(value) if value is not None else None
        return len(shape) if shape is not None else None

    def dtype(self, value: ir.Value) -> ir.DataType | None:
        """The value's element type, inferred like shape() when the file does not say."""
        return self.shapes.dtype(value) if self.shapes is not None else value.dtype

    def pattern(self, name: str) -> PatternStats:
        stats = self.patterns.get(name)
        if stats is None:
            stats = self.patterns[name] = PatternStats(name)
        return stats

    @property
    def matched(self) -> int:
        return sum(p.matched for p in self.patterns.values())

    @property
    def effected(self) -> int:
        return sum(p.effected for p in self.patterns.values())

    def declines(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for stats in self.patterns.values():
            total.update(stats.declines)
        return total

    def may_rewrite(self, pattern: str, site: str) -> bool:
        """Ask, before touching the graph, whether this rewrite may happen. It numbers the
        rewrite (see Rewrites); a declined one is counted as a match without effect. Passes
        call it at the one point where a candidate has passed every check."""
        return self.refusal(pattern, site) is None

    def refusal(self, pattern: str, site: str) -> str | None:
        """may_rewrite, answering with the reason recorded for a declined rewrite."""
        index, reason = self.rewrites.claim()
        if reason is not None:
            self.pattern(pattern).decline(reason, site)
            return reason
        self._granted = index
        return None

    def record_fusion(
        self, pattern: str, old_nodes: Sequence[ir.Node], new_nodes: Sequence[ir.Node]
    ) -> None:
        """Count one effect and stamp the new nodes with the lineage of the ones they replace."""
        index, self._granted = self._granted, None
        if index is None:  # a pass that does not ask first: number it now, it cannot be declined
            index, reason = self.rewrites.claim()
            if reason is not None:
                raise UnguardedRewrite(
                    f"{self.spec.name} rewrote the graph without asking ctx.may_rewrite() "
                    f"first, so a bisection cannot leave rewrite #{index} out"
                )
        stats = self.pattern(pattern)
        stats.matched += 1
        stats.effected += 1
        self.changed = True
        passes: list[str] = []
        names: list[str] = []
        types: list[str] = []
        # The matcher lists the root first; reversed, a chain reads in execution order.
        # The nodes one earlier rewrite made share its lineage, which counts once.
        inherited: set[tuple[str, str]] = set()
        for node in reversed(old_nodes):
            props = node.metadata_props
            if LINEAGE_NAMES in props:
                key = (props[LINEAGE_NAMES], props[LINEAGE_TYPES])
                if key in inherited:
                    continue
                inherited.add(key)
                names.extend(json.loads(props[LINEAGE_NAMES]))
                types.extend(json.loads(props[LINEAGE_TYPES]))
                passes.extend(p for p in json.loads(props[LINEAGE_PASSES]) if p not in passes)
            else:
                names.append(node.name or "")
                types.append(node.op_type)
        if self.spec.name not in passes:
            passes.append(self.spec.name)
        if new_nodes:
            lineage = {
                LINEAGE_PASSES: _json_strings(passes),
                LINEAGE_NAMES: _json_strings(names),
                LINEAGE_TYPES: _json_strings(types),
            }
            for node in new_nodes:
                node.metadata_props.update(lineage)
        layer = next((found for node in old_nodes if (found := layer_of(node))), None)
        self.sites.append(
            FusionSite(
                pattern,
                names,
                types,
                [node.name or "" for node in new_nodes],
                layer,
                index,
                self.graph_id,
            )
        )
