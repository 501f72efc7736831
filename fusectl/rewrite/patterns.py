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
from onnxscript.rewriter import pattern as oxs_pattern

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
    from onnxscript.rewriter._basics import MatchContext

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

    def __init__(self, ctx: PassContext, match: MatchContext) -> None:
        self.ctx = ctx
        self.root: ir.Node = match.root
        self.nodes: tuple[ir.Node, ...] = tuple(match.nodes)
        self.outputs: tuple[ir.Value, ...] = tuple(match.output_values)
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
        # One input order only: the exact test of the single variant is the whole test.
        self.single_order = not rule.commute or not _commutes(self.skeleton)

    @functools.cached_property
    def variants(self) -> list[tuple[oxs_pattern.RewriteRule, _Skeleton]]:
        """The rule in every commuted input order, built on first use: cloning the pattern
        for each order is the costly part of compiling, and most rules never meet their ops."""
        rules = self._base.commute() if self.rule.commute else [self._base]
        return [(variant, _skeleton(variant._target_pattern.output_node)) for variant in rules]

    def _condition(self, context: MatchContext, **bindings: Any) -> bool:
        assert self.ctx is not None
        site = Site(self.ctx, context)
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

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        # The nodes bucketed by op: a rule then visits only nodes of its root op, and is
        # skipped outright when an op it needs is absent from the graph.
        by_op = ctx.op_index.nodes(graph)
        # A candidate counts once per pass: declined by one pattern and rewritten by a later,
        # smaller one, it is an effect; declined by several, it keeps the first reason.
        declined: dict[ir.Node, tuple[PatternStats, str]] = {}
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
                outcome = self._try_node(model, node, compiled, stats)
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
        model: ir.Model, node: ir.Node, compiled: _CompiledRule, stats: PatternStats
    ) -> Sequence[ir.Node] | str:
        """Try every input order of the rule at ``node``: the new nodes if one rewrote it,
        the reason if the rule matched and declined, else nothing."""
        assert compiled.ctx is not None
        if not _fits(compiled.skeleton, node, commute=not compiled.single_order):
            return ()
        declined: str | None = None
        for variant, skeleton in compiled.variants:
            if not compiled.single_order and not _fits(skeleton, node, commute=False):
                continue
            compiled.outcome = _Outcome()
            delta = variant.try_rewrite(model, model.graph, node)
            if delta is not None:
                site = compiled.outcome.site
                assert site is not None
                unprovided = uses_outside(delta.match.nodes, [*delta.match.outputs, *site.provided])
                if unprovided is not None:
                    declined = declined or unprovided
                    continue
                refused = replace_subgraph(
                    compiled.ctx,
                    compiled.rule.name,
                    node,
                    delta.match.nodes,
                    delta.new_nodes,
                    [*delta.match.outputs, *site.provided],
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
