"""Pattern passes: onnxscript rewriter patterns driven with Ascend match/effect semantics.

onnxscript's own driver counts only the rewrites it applied and drops a candidate silently when a
condition fails or an intermediate value has other users. Ascend counts such a candidate as a
match without effect, and users need the reason. So the matching and the replacement come from
onnxscript, and this module drives them: it checks removability and the pass's own conditions,
records every decline with its reason, names new nodes deterministically and stamps lineage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _basics as oxs_basics
from onnxscript.rewriter import _pattern_ir as oxs_ir
from onnxscript.rewriter import pattern as oxs_pattern
from onnxscript.rewriter._context import TapeBuilder

from fusectl.errors import FusectlError
from fusectl.rewrite import runtime
from fusectl.rewrite.graph import (
    attribute_reference,
    constant_value,
    node_label,
    replace_subgraph,
    uses_outside,
)
from fusectl.rewrite.registry import FusionPass

if TYPE_CHECKING:
    from fusectl.rewrite.context import PassContext, PatternStats


class Decline(Exception):
    """Raised by a check or rewrite to turn a structural match down, with the reason."""


CheckFn = Callable[..., str | None]


@dataclass(frozen=True)
class Rule:
    """One pattern of a pass: a target, a replacement, and an optional extra check.

    ``pattern(op, **vars)`` and ``rewrite(op, site, **bindings)`` use the onnxscript rewriter's
    op-builder style. ``check(site, **bindings)`` returns None to accept or a short reason to
    decline (it may also raise Decline). ``candidate(site, **bindings)`` narrows what the
    pattern means beyond its structure (a Conv whose kernel covers its input, an Add of a
    constant): a structural match it rejects is not counted at all. Commutative inputs (Add,
    Mul, ...) match in either order unless ``commute`` is False.
    """

    name: str
    pattern: Callable[..., Any]
    rewrite: Callable[..., Any]
    check: CheckFn | None = None
    commute: bool = True
    candidate: Callable[..., bool] | None = None
    # Pattern values (bound with ``_outputs=[name]``) that may be used outside the match; the
    # rewrite must then ``site.provide`` a replacement for each one that is.
    exposes: tuple[str, ...] = ()


class Site:
    """A structural match as a pass's check and rewrite see it."""

    def __init__(
        self,
        ctx: PassContext,
        root: ir.Node,
        nodes: Sequence[ir.Node],
        outputs: Sequence[ir.Value],
    ) -> None:
        self.ctx = ctx
        self.root = root
        self.nodes: tuple[ir.Node, ...] = tuple(nodes)
        self.outputs: tuple[ir.Value, ...] = tuple(outputs)
        self.provided: dict[ir.Value, ir.Value] = {}

    def provide(self, intermediate: ir.Value, replacement: ir.Value) -> None:
        """Let the rewrite keep an exposed intermediate available: its other consumers (and
        a graph output) read ``replacement``, an output of the new nodes, instead."""
        self.provided[intermediate] = replacement

    @property
    def label(self) -> str:
        return node_label(self.root)

    def name(self, suffix: str) -> str:
        """A deterministic name for a value or initializer this rewrite creates."""
        return f"{self.ctx.spec.name}/{self.label}/{suffix}"

    def constant(self, value: ir.Value | None) -> np.ndarray | None:
        """The value's constant contents, else None (see graph.constant_value). Reading a
        constant is what pulls external weights into memory, so checks ask for values last."""
        return constant_value(value)

    def require_constant(self, value: ir.Value | None, what: str) -> np.ndarray:
        """The value's constant contents, or a Decline naming what is not constant."""
        array = self.constant(value)
        if array is not None:
            return array
        if value is not None and value.is_graph_input():
            kind = "an overridable initializer" if value.const_value is not None else "fed"
            raise Decline(f"{what} is a graph input ({kind}), not a constant")
        raise Decline(f"{what} is not a constant")

    def shape(self, value: ir.Value) -> ir.Shape | None:
        """The value's shape, inferring shapes for the whole graph once if it is unknown."""
        return self.ctx.shape(value)

    def dtype(self, value: ir.Value) -> ir.DataType | None:
        return self.ctx.dtype(value)

    def require_rank(self, value: ir.Value, what: str) -> int:
        shape = self.shape(value)
        if shape is None:
            raise Decline(f"rank of {what} is unknown")
        return len(shape)

    def require_kernel(self, op_type: str, dtype: ir.DataType | None, domain: str = "") -> None:
        """Decline when the target runtime cannot run the op this rewrite would emit."""
        if self.ctx.target == "ort" and not runtime.has_kernel(
            op_type, domain, self.ctx.opset if domain in ("", "ai.onnx") else 1, dtype
        ):
            name = op_type if domain in ("", "ai.onnx") else f"{domain}.{op_type}"
            raise Decline(f"onnxruntime has no {name} kernel for {dtype}")

    def node(self, op_type: str) -> ir.Node:
        """The matched node of the given op type (patterns name each op type once)."""
        return next(node for node in self.nodes if node.op_type == op_type)

    def initializer(self, op: Any, array: np.ndarray, suffix: str) -> ir.Value:
        """Add a new constant for the replacement, named after this site."""
        name = self.name(suffix)
        return op.initializer(ir.tensor(array, name=name), name=name)


@dataclass
class _Outcome:
    """What the wrapped condition and replacement saw for the current candidate."""

    site: Site | None = None
    reason: str | None = None


class _CompiledRule:
    """One Rule turned into onnxscript rewrite rules (one per commuted input order)."""

    def __init__(self, rule: Rule, spec_min_opset: int, emits: tuple[str, ...]) -> None:
        self.rule = rule
        self.outcome = _Outcome()
        self.ctx: PassContext | None = None
        self.min_opset = spec_min_opset
        self._emits = emits
        base = oxs_pattern.RewriteRule(
            rule.pattern,
            self._replace,
            self._condition,
            name=rule.name,
            remove_nodes=False,  # removability is checked (and explained) in _condition
        )
        self._base = base
        if not base._target_pattern.has_single_output_node:
            raise ValueError(f"pattern {rule.name}: only single-output-node patterns are supported")
        graph_pattern = base._target_pattern
        self.root_op = graph_pattern.output_node.op_identifier()
        self.ops = {
            op
            for index in range(graph_pattern.num_nodes())
            if (op := graph_pattern.node(index).op_identifier()) is not None
        }
        self.skeleton = _skeleton(graph_pattern.output_node)
        self.direct = _directly_matchable(graph_pattern)  # so are its commuted copies
        # One input order only: the exact test of the single variant is the whole test.
        self.single_order = not rule.commute or not _commutes(self.skeleton)
        self._first_level: dict[tuple[str, tuple[str | None, ...]], bool] = {}

    @functools.cached_property
    def variants(self) -> list[_Variant]:
        """The rule in every commuted input order, built on first use: cloning the pattern
        for each order is the costly part of compiling, and most rules never meet their ops."""
        rules = self._base.commute() if self.rule.commute else [self._base]
        return [_Variant(variant) for variant in rules]

    @property
    def pretested(self) -> bool:
        """Whether a candidate takes the skeleton test before the input orders are tried:
        until they are built (which costs more than the test, and most rules never fit),
        and always for orders onnxscript matches; the direct matchers of built orders reject
        a candidate for less than the test costs."""
        return not self.direct or "variants" not in self.__dict__

    def first_level_fits(self, op_type: str, input_ops: tuple[str | None, ...]) -> bool:
        """Whether a node of ``op_type`` whose inputs nodes of ``input_ops`` compute (None:
        none does) fits the skeleton's first level: the skeleton test's most frequent
        failure, answered once per distinct key instead of once per node."""
        key = (op_type, input_ops)
        verdict = self._first_level.get(key)
        if verdict is None:
            verdict = self._first_level[key] = _first_level_fits(
                self.skeleton, op_type, input_ops, commute=not self.single_order
            )
        return verdict

    def _condition(self, context: oxs_basics.MatchContext, **bindings: Any) -> bool:
        """onnxscript's condition, for the patterns its own matcher matches."""
        assert self.ctx is not None
        site = Site(self.ctx, context.root, context.nodes, context.output_values)
        return self.accepts(site, bindings)

    def accepts(self, site: Site, bindings: dict[str, Any]) -> bool:
        """Whether the structural match at ``site`` is rewritten; the outcome says why not."""
        assert self.ctx is not None
        # Checked first: an attribute a function body takes from its caller reads as None.
        reason = attribute_reference(site.nodes)
        if reason is None:
            if self.rule.candidate is not None and not self.rule.candidate(site, **bindings):
                return False
            exposed = tuple(
                bindings[name] for name in self.rule.exposes if bindings.get(name) is not None
            )
            reason = uses_outside(site.nodes, (*site.outputs, *exposed))
        self.outcome.site = site
        if reason is None and self.ctx.opset < self.min_opset:
            what = "/".join(self._emits) or "the fused op"
            reason = f"{what} needs opset >= {self.min_opset}, model has {self.ctx.opset}"
        if reason is None and self.rule.check is not None:
            try:
                reason = self.rule.check(site, **bindings) or None
            except Decline as decline:
                reason = str(decline)
        self.outcome.reason = reason
        return reason is None

    def _replace(self, op: Any, **bindings: Any) -> Any:
        assert self.outcome.site is not None
        try:
            return self.rule.rewrite(op, self.outcome.site, **bindings)
        except Decline as decline:
            self.outcome.reason = str(decline)
            return None


@dataclass(frozen=True)
class _Delta:
    """A rewrite found at a site: the matched nodes and values, and what replaces them."""

    nodes: Sequence[ir.Node]
    outputs: Sequence[ir.Value]
    new_nodes: Sequence[ir.Node]
    new_outputs: Sequence[ir.Value]
    new_initializers: Sequence[ir.Value]


class _Variant:
    """One input order of a rule: onnxscript's rewrite rule, its op-type skeleton, and the
    direct matcher that stands in for onnxscript's where the pattern allows one."""

    def __init__(self, rule: oxs_pattern.RewriteRule) -> None:
        self.rule = rule
        pattern = rule._target_pattern
        self.skeleton = _skeleton(pattern.output_node)
        self.direct = _DirectMatcher(pattern) if _directly_matchable(pattern) else None

    def try_rewrite(self, model: ir.Model, node: ir.Node, compiled: _CompiledRule) -> _Delta | None:
        """The rewrite at ``node`` if the pattern matches there and the rule accepts it: what
        onnxscript's ``RewriteRule.try_rewrite`` does, its matcher spared where it can be."""
        if self.direct is None:
            delta = self.rule.try_rewrite(model, model.graph, node)
            if delta is None:
                return None
            match = delta.match
            return _Delta(
                match.nodes,
                match.outputs,
                delta.new_nodes,
                delta.new_outputs,
                delta.new_initializers,
            )
        found = self.direct.match(node, model.graph)
        if found is None:
            return None
        nodes, bindings = found
        outputs = (node.outputs[0],)
        builder = TapeBuilder()
        try:
            if not compiled.accepts(Site(compiled.ctx, node, nodes, outputs), bindings):
                return None
            new_outputs = compiled._replace(builder, **bindings)
        except oxs_basics.MatchFailureError:
            return None
        if new_outputs is None or new_outputs is False:
            return None
        if isinstance(new_outputs, oxs_basics.MatchResult):
            if not new_outputs:
                return None
            raise TypeError(f"pattern {compiled.rule.name}: a replacement returned a MatchResult")
        if not isinstance(new_outputs, Sequence):
            new_outputs = (new_outputs,)
        if len(new_outputs) != 1:
            raise ValueError(
                f"pattern {compiled.rule.name}: the replacement returns {len(new_outputs)} "
                "values for the pattern's one output"
            )
        _import_opsets(model.graph, builder.used_opsets)
        return _Delta(nodes, outputs, builder.nodes, new_outputs, builder.initializers)


def _import_opsets(graph: ir.Graph, used: set[tuple[str, int | None]]) -> None:
    """Import the opsets the replacement's nodes use, as onnxscript's ``try_rewrite`` does."""
    imports = graph.opset_imports
    for domain, version in used:
        if domain not in imports:
            imports[domain] = version if version is not None else 1
        elif version is not None and version != imports[domain]:
            raise ValueError(
                f"Multiple versions of opset {domain} used. "
                f"Expected version {imports[domain]}, but got {version}."
            )


def _directly_matchable(pattern: oxs_ir.GraphPattern) -> bool:
    """Whether _DirectMatcher matches ``pattern`` as onnxscript's matcher would: one output
    node, op types and domains spelled out, no attribute, constant or alternative patterns,
    no checks, and every input a named variable or another pattern node's only output."""
    if not pattern.has_single_output_node or len(pattern.outputs) != 1:
        return False
    if pattern.outputs[0] is not pattern.output_node.outputs[0]:
        return False
    for node in pattern:
        if (
            not isinstance(node.op, oxs_ir.StringConstantPattern)
            or not isinstance(node.domain, oxs_ir.StringConstantPattern)
            or node.attributes
            or node.check_method is not None
            or len(node.outputs) != 1
        ):
            return False
        for value in node.inputs:
            if type(value) is oxs_ir.NodeOutputPattern:
                if value.check_method is not None or value.output_index != 0:
                    return False
            elif not _plain_variable(value):
                return False
    return all(_plain_variable(value) for value in pattern.inputs)


def _plain_variable(value: Any) -> bool:
    return (
        type(value) is oxs_ir.Var
        and value.name is not None
        and value.check_method is None
        and not value.can_match_none
    )


# A pattern node compiled for _DirectMatcher: its slot (its index in the pattern), its op
# type and domain, whether the graph node may have more inputs than the pattern lists, and per
# listed input the name it binds (None: an unnamed node output) and the compiled producer
# (None: the input is a variable).
_Program = tuple[int, tuple[str, str], bool, tuple[tuple["str | None", "_Program | None"], ...]]


class _DirectMatcher:
    """onnxscript's SimplePatternMatcher for the patterns _directly_matchable accepts,
    without its general machinery (partial matches, failure reasons, tracing): it binds the
    same graph nodes in the same order and the same variables, several times faster per
    site."""

    def __init__(self, pattern: oxs_ir.GraphPattern) -> None:
        self._slots = {node: index for index, node in enumerate(pattern)}
        self._root = self._program(pattern.output_node)
        self._root_name = pattern.output_node.outputs[0].name
        self._inputs = tuple(value.name for value in pattern.inputs)
        self._first_level: dict[tuple[str | None, ...], bool] = {}

    def _program(self, node: oxs_ir.NodePattern) -> _Program:
        inputs = tuple(
            (
                value.name,
                self._program(value.producer())
                if type(value) is oxs_ir.NodeOutputPattern
                else None,
            )
            for value in node.inputs
        )
        op = (node.op.value(), node.domain.value())  # commuted copies have no op_identifier
        return self._slots[node], op, node.allow_other_inputs, inputs

    def first_level_fits(self, input_ops: tuple[str | None, ...]) -> bool:
        """Whether a root whose inputs nodes of ``input_ops`` compute (None: none does) has
        the inputs the pattern's root reads: most input orders of a commutative pattern fail
        here, and the answer is kept per distinct ``input_ops``."""
        verdict = self._first_level.get(input_ops)
        if verdict is None:
            _, _, more_inputs, inputs = self._root
            verdict = self._first_level[input_ops] = (
                len(inputs) <= len(input_ops)
                and (more_inputs or len(input_ops) == len(inputs))
                and all(
                    producer is None or input_ops[position] == producer[1][0]
                    for position, (_, producer) in enumerate(inputs)
                )
            )
        return verdict

    def match(self, root: ir.Node, graph: ir.Graph) -> tuple[list[ir.Node], dict[str, Any]] | None:
        """The matched nodes (root first, then depth-first by input) and the bindings (each
        name in the order it was first bound; variables the pattern never reads are None)."""
        bound: list[ir.Node | None] = [None] * len(self._slots)
        nodes: list[ir.Node] = []
        bindings: dict[str, Any] = {}
        if not root.outputs or not self._match(self._root, root, graph, bound, nodes, bindings):
            return None
        if (
            self._root_name is not None
            and bindings.setdefault(self._root_name, root.outputs[0]) is not root.outputs[0]
        ):
            return None
        for name in self._inputs:
            bindings.setdefault(name, None)
        return nodes, bindings

    def _match(
        self,
        program: _Program,
        node: ir.Node,
        graph: ir.Graph,
        bound: list[ir.Node | None],
        nodes: list[ir.Node],
        bindings: dict[str, Any],
    ) -> bool:
        slot, op, more_inputs, inputs = program
        found = bound[slot]
        if found is not None:  # a pattern node read twice is one graph node
            return found is node
        values = node.inputs
        if (node.op_type, node.domain) != op or (len(values) > len(inputs) and not more_inputs):
            return False
        bound[slot] = node
        nodes.append(node)
        for position, (name, producer_program) in enumerate(inputs):
            value = values[position] if position < len(values) else None
            if value is None:
                return False
            if producer_program is None:  # a variable: bound once, to one value
                if bindings.setdefault(name, value) is not value:  # type: ignore[arg-type]
                    return False
                continue
            if value.graph is not graph:  # the matcher does not cross into enclosing graphs
                return False
            if name is not None and bindings.setdefault(name, value) is not value:
                return False
            producer = value.producer()
            if producer is None or value.index() != 0:
                return False
            if not self._match(producer_program, producer, graph, bound, nodes, bindings):
                return False
        return True


# A pattern's op-type skeleton, for a cheap test before the full matcher: (op type and op
# identifier, or None for any op; inputs the pattern lists; whether the node takes its two
# inputs in either order (None: decided by the graph node's op type); (input index,
# skeleton) for each input that a node of the pattern produces).
_Skeleton = tuple[Any, Any, int, "bool | None", tuple[tuple[int, "_Skeleton"], ...]]

_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal"})


def _skeleton(pattern: Any) -> _Skeleton:
    children = []
    for index, value in enumerate(pattern.inputs):
        producer = value.producer() if value is not None else None
        if producer is not None:
            children.append((index, _skeleton(producer)))
    op = pattern.op_identifier()
    count = len(pattern.inputs)
    either_order = None if op is None else count == 2 and op[1] in _COMMUTATIVE
    return op[1] if op is not None else None, op, count, either_order, tuple(children)


def _first_level_fits(
    skeleton: _Skeleton, op_type: str, input_ops: tuple[str | None, ...], commute: bool
) -> bool:
    """_fits one level deep, on op types alone: a node of ``op_type`` whose inputs nodes of
    ``input_ops`` compute (None: none does)."""
    root_type, _, count, either_order, children = skeleton
    if (root_type is not None and op_type != root_type) or len(input_ops) < count:
        return False
    if commute and (
        either_order if root_type is not None else count == 2 and op_type in _COMMUTATIVE
    ):
        swaps: tuple[int, ...] = (0, 1)
    else:
        swaps = (0,)
    return any(
        all(
            input_ops[index ^ swap] is not None and child[0] in (None, input_ops[index ^ swap])
            for index, child in children
        )
        for swap in swaps
    )


def _input_ops(
    node: ir.Node, seen: dict[ir.Node, tuple[Sequence[ir.Value | None], tuple[str | None, ...]]]
) -> tuple[str | None, ...]:
    """The op types of the nodes computing ``node``'s inputs (None: none does), kept in
    ``seen`` for as long as the node reads the same inputs (a rewrite gives its readers new
    input tuples)."""
    inputs = node.inputs
    found = seen.get(node)
    if found is not None and found[0] is inputs:
        return found[1]
    producers = (value.producer() if value is not None else None for value in inputs)
    ops = tuple(None if producer is None else producer.op_type for producer in producers)
    seen[node] = (inputs, ops)
    return ops


def _commutes(skeleton: _Skeleton) -> bool:
    """Whether some node of the skeleton may take its inputs in either order."""
    _, _, _, either_order, children = skeleton
    return either_order is not False or any(_commutes(child) for _, child in children)


def _fits(skeleton: _Skeleton, node: ir.Node, commute: bool) -> bool:
    """Whether the graph above ``node`` has the skeleton's op types; with ``commute``, in
    either input order of commutative ops. A necessary test, much cheaper than the matcher:
    many patterns with many commuted variants (the GELU and layer-norm spellings) would
    otherwise run it at every Mul or Add, and most variants fail a few nodes up. It runs at
    every candidate of every rule, hence written flat."""
    op_type, op, count, either_order, children = skeleton
    if op_type is not None and (node.op_type != op_type or node.op_identifier() != op):
        return False
    inputs = node.inputs
    if len(inputs) < count:
        return False
    if not children:
        return True
    if commute and (
        either_order if op_type is not None else count == 2 and node.op_type in _COMMUTATIVE
    ):
        return _inputs_fit(children, inputs, 0) or _inputs_fit(children, inputs, 1)
    for index, child in children:
        value = inputs[index]
        producer = value.producer() if value is not None else None
        if producer is None or not _fits(child, producer, commute):
            return False
    return True


def _inputs_fit(
    children: tuple[tuple[int, _Skeleton], ...], inputs: Sequence[ir.Value | None], swap: int
) -> bool:
    """The producers of two commuted ``inputs`` fit the children (``swap`` 1: swapped)."""
    for index, child in children:
        value = inputs[index ^ swap]
        producer = value.producer() if value is not None else None
        if producer is None or not _fits(child, producer, True):
            return False
    return True


class PatternPass(FusionPass):
    """A pass made of onnxscript-style rules, each tried at every node in graph order."""

    rules: ClassVar[tuple[Rule, ...]]
    counts_changes: ClassVar[bool] = True
    _compiled: list[_CompiledRule] | None = None

    def compiled_rules(self) -> list[_CompiledRule]:
        if self._compiled is None:
            self._compiled = [
                _CompiledRule(rule, self.spec.min_opset, self.spec.emits) for rule in self.rules
            ]
        return self._compiled

    def could_match(self, node: ir.Node) -> bool:
        """Whether some rule's op-type skeleton fits the graph above ``node`` (a cheap test,
        necessary for a match but not sufficient: constants and shared values are not checked)."""
        return any(
            _fits(compiled.skeleton, node, commute=not compiled.single_order)
            for compiled in self.compiled_rules()
        )

    def matches(self, node: ir.Node) -> bool:
        """Whether some rule's pattern binds at ``node``: its structure, with a variable it
        reads twice bound to one value (its constants and checks are not tested). Where a
        pattern has no direct matcher, the skeleton test stands in."""
        for compiled in self.compiled_rules():
            if not _fits(compiled.skeleton, node, commute=not compiled.single_order):
                continue
            for variant in compiled.variants:
                if variant.direct is None:
                    if _fits(variant.skeleton, node, commute=False):
                        return True
                elif node.graph is not None and variant.direct.match(node, node.graph):
                    return True
        return False

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        # The nodes bucketed by op: a rule then visits only nodes of its root op, and is
        # skipped outright when an op it needs is absent from the graph.
        by_op = ctx.op_index.nodes(graph)
        # A candidate counts once per pass: declined by one pattern and rewritten by a later,
        # smaller one, it is an effect; declined by several, it keeps the first reason.
        declined: dict[ir.Node, tuple[PatternStats, str]] = {}
        input_ops: dict[ir.Node, tuple[Sequence[ir.Value | None], tuple[str | None, ...]]] = {}
        # Each node can be rewritten once per rule; more rewrites than that means a
        # replacement that its own search matches again (a plugin mistake), not progress.
        budget = (len(graph) + 1) * (len(self.compiled_rules()) + 1)
        for compiled in self.compiled_rules():
            stats = ctx.pattern(compiled.rule.name)
            if compiled.root_op is None:
                candidates = list(graph)
            elif compiled.ops.issubset(by_op):
                candidates = by_op[compiled.root_op]
            else:
                continue
            compiled.ctx = ctx
            position = 0
            while position < len(candidates):
                node = candidates[position]
                position += 1
                if node.graph is not graph:
                    continue  # removed by an earlier rewrite of this pass
                ops = _input_ops(node, input_ops)
                if not compiled.first_level_fits(node.op_type, ops):
                    continue
                outcome = self._try_node(model, node, ops, compiled, stats)
                if isinstance(outcome, str):
                    if node in declined:  # already counted by an earlier pattern
                        stats.withdraw(outcome, node_label(node))
                    else:
                        declined[node] = (stats, outcome)
                    continue
                if outcome and node in declined:
                    earlier, reason = declined.pop(node)
                    earlier.withdraw(reason, node_label(node))
                for new in outcome:
                    by_op.setdefault(new.op_identifier(), []).append(new)
                if outcome and ctx.effected > budget:
                    raise FusectlError(
                        f"{self.spec.name} stopped after {ctx.effected} rewrites of a "
                        f"{budget // (len(self.compiled_rules()) + 1) - 1}-node graph: pattern "
                        f"{compiled.rule.name} matches its own replacement again"
                    )
            compiled.ctx = None

    @staticmethod
    def _try_node(
        model: ir.Model,
        node: ir.Node,
        input_ops: tuple[str | None, ...],
        compiled: _CompiledRule,
        stats: PatternStats,
    ) -> Sequence[ir.Node] | str:
        """Try every input order of the rule at ``node`` (whose inputs nodes of ``input_ops``
        compute): the new nodes if one rewrote it, the reason if the rule matched and
        declined, else nothing."""
        assert compiled.ctx is not None
        if compiled.pretested and not _fits(
            compiled.skeleton, node, commute=not compiled.single_order
        ):
            return ()
        declined: str | None = None
        for variant in compiled.variants:
            if variant.direct is not None:
                if not variant.direct.first_level_fits(input_ops):
                    continue
            elif not compiled.single_order and not _fits(variant.skeleton, node, commute=False):
                continue
            compiled.outcome = _Outcome()
            delta = variant.try_rewrite(model, node, compiled)
            if delta is not None:
                site = compiled.outcome.site
                assert site is not None
                unprovided = uses_outside(delta.nodes, [*delta.outputs, *site.provided])
                if unprovided is not None:
                    declined = declined or unprovided
                    continue
                refused = replace_subgraph(
                    compiled.ctx,
                    compiled.rule.name,
                    node,
                    delta.nodes,
                    delta.new_nodes,
                    [*delta.outputs, *site.provided],
                    [*delta.new_outputs, *site.provided.values()],
                    delta.new_initializers,
                )
                # Left out by a bisection, replace_subgraph counted the decline; trying
                # another input order would only number the same site again.
                return delta.new_nodes if refused is None else refused
            if compiled.outcome.reason is not None and declined is None:
                declined = compiled.outcome.reason
            if declined is not None and compiled.ctx.opset < compiled.min_opset:
                break  # every other input order is declined too: the first reason stands
        if declined is not None:
            stats.decline(declined, node_label(node))
            return declined
        return ()
