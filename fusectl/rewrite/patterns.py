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
        return _node_label(self.root)

    def name(self, suffix: str) -> str:
        """A deterministic name for a value or initializer this rewrite creates."""
        return f"{self.ctx.spec.name}/{self.label}/{suffix}"

    def constant(self, value: ir.Value | None) -> np.ndarray | None:
        """The value's constant contents, else None.

        A constant is an initializer or a Constant node, possibly reshaped on the way by the
        data-movement ops exporters put there (Identity, Unsqueeze, Squeeze, Reshape, Cast),
        which are evaluated here without touching the graph. Reading a constant is what pulls
        external weights into memory, so checks ask for values last. An initializer that is
        also a graph input is a default the caller may override, so it is not a constant
        (onnxruntime draws the same line).
        """
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


_FOLD_DEPTH = 4
# The ops a constant is seen through (see Site.constant).
_SEEN_THROUGH = frozenset({"Identity", "Cast", "Unsqueeze", "Squeeze", "Reshape"})


def constant_value(value: ir.Value | None) -> np.ndarray | None:
    """See Site.constant; for passes that work on nodes rather than pattern sites."""
    return _fold_constant(value, depth=0)


# A Constant node's attribute, as the numpy type its value_* spelling stands for.
_CONSTANT_DTYPES = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def constant_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """An initializer's or a Constant node output's tensor. Not onnx-ir's get_const_tensor,
    which renames a Constant's tensor after its output: reading must not change the model."""
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if (
        producer is None
        or producer.op_type != "Constant"
        or producer.domain not in ("", "ai.onnx")
        or len(producer.attributes) != 1
    ):
        return None
    attr = next(iter(producer.attributes.values()))
    if attr.is_ref():
        return None
    if attr.name == "value":
        return attr.as_tensor()
    dtype = _CONSTANT_DTYPES.get(attr.name)
    return None if dtype is None else ir.tensor(np.array(attr.value, dtype=dtype))


def _fold_constant(value: ir.Value | None, depth: int) -> np.ndarray | None:
    if value is None or value.is_graph_input():
        return None
    producer = value.producer()
    if producer is None or producer.op_type == "Constant":
        tensor = constant_tensor(value)
        return None if tensor is None else tensor.numpy()
    if depth >= _FOLD_DEPTH or producer.domain not in ("", "ai.onnx"):
        return None
    if producer.op_type not in _SEEN_THROUGH:
        return None
    inputs = producer.inputs
    data = _fold_constant(inputs[0], depth + 1) if inputs else None
    if data is None:
        return None
    operand = _fold_constant(inputs[1], depth + 1) if len(inputs) > 1 and inputs[1] else None
    attrs = producer.attributes
    op_type = producer.op_type
    if op_type == "Identity":
        return data
    if op_type == "Cast":
        return data.astype(ir.DataType(attrs.get_int("to")).numpy())
    if op_type in ("Unsqueeze", "Squeeze"):
        axes = operand if operand is not None else attrs.get_ints("axes", None)
        if axes is None:
            return np.squeeze(data) if op_type == "Squeeze" else None
        axes = [int(a) for a in np.asarray(axes).reshape(-1)]
        if op_type == "Squeeze":
            return np.squeeze(data, axis=tuple(a % data.ndim for a in axes))
        rank = data.ndim + len(axes)
        for axis in sorted(a % rank for a in axes):
            data = np.expand_dims(data, axis)
        return data
    if op_type == "Reshape" and operand is not None:
        shape = [int(d) for d in operand.reshape(-1)]
        if not attrs.get_int("allowzero", 0):
            shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return data.reshape(shape)
    return None


def within(
    value: ir.Value | None, op_types: frozenset[str], *, upward: bool, depth: int = 5
) -> bool:
    """Whether a node of one of ``op_types`` is within ``depth`` ops of ``value``, following
    producers or readers."""
    if value is None or depth == 0:
        return False
    if upward:
        producer = value.producer()
        nodes = [producer] if producer is not None else []
    else:
        nodes = [user for user, _ in value.uses()]
    for node in nodes:
        if node.op_type in op_types:
            return True
        following = node.inputs if upward else node.outputs
        if any(within(v, op_types, upward=upward, depth=depth - 1) for v in following):
            return True
    return False


def _node_label(node: ir.Node) -> str:
    return node.name or (node.outputs[0].name if node.outputs else "") or node.op_type


def uses_outside(nodes: Sequence[ir.Node], kept: Sequence[ir.Value]) -> str | None:
    """Why ``nodes`` cannot be removed, if a value they compute (other than ``kept``) is
    needed elsewhere: a graph output, or an input of a node outside the set."""
    members = set(nodes)
    keep = set(kept)
    for node in nodes:
        for value in node.outputs:
            if value in keep:
                continue
            if value.is_graph_output():
                return f"an intermediate value ({node.op_type} output) is a graph output"
            for consumer, _ in value.uses():
                if consumer not in members:
                    return (
                        f"an intermediate value ({node.op_type} output) is also used by "
                        f"{consumer.op_type} outside the match"
                    )
    return None


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
        self._min_opset = spec_min_opset
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
        self.tree = graph_pattern.output_node

    @functools.cached_property
    def variants(self) -> list[tuple[oxs_pattern.RewriteRule, tuple[tuple[int, Any], ...]]]:
        """The rule in every commuted input order, built on first use: cloning the pattern
        for each order is the costly part of compiling, and most rules never meet their ops."""
        rules = self._base.commute() if self.rule.commute else [self._base]
        return [(variant, _producer_ops(variant)) for variant in rules]

    def _condition(self, context: MatchContext, **bindings: Any) -> bool:
        assert self.ctx is not None
        site = Site(self.ctx, context)
        if self.rule.candidate is not None and not self.rule.candidate(site, **bindings):
            return False
        self.outcome.site = site
        exposed = tuple(
            bindings[name] for name in self.rule.exposes if bindings.get(name) is not None
        )
        reason = uses_outside(site.nodes, (*site.outputs, *exposed))
        if reason is None and self.ctx.opset < self._min_opset:
            what = "/".join(self._emits) or "the fused op"
            reason = f"{what} needs opset >= {self._min_opset}, model has {self.ctx.opset}"
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


def _producer_ops(rule: oxs_pattern.RewriteRule) -> tuple[tuple[int, Any], ...]:
    """(input index, op) for each root input the pattern requires a specific node to produce."""
    root = rule._target_pattern.output_node
    required = []
    for index, value in enumerate(root.inputs):
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_identifier() is not None:
            required.append((index, producer.op_identifier()))
    return tuple(required)


_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal"})


def _tree_fits(pattern: Any, node: ir.Node | None) -> bool:
    """Whether the graph above ``node`` has the pattern's op types, in either input order of
    commutative ops. A cheap necessary test: many patterns with many commuted variants (the
    GELU and layer-norm spellings) would otherwise run the full matcher at every Mul or Add.
    """
    if node is None:
        return False
    wanted = pattern.op_identifier()
    if wanted is not None and node.op_identifier() != wanted:
        return False
    expected = pattern.inputs
    inputs = list(node.inputs)
    if len(inputs) < len(expected):
        return False

    def fits(value_pattern: Any, value: ir.Value | None) -> bool:
        producer = value_pattern.producer() if value_pattern is not None else None
        if producer is None:
            return True
        return value is not None and _tree_fits(producer, value.producer())

    if node.op_type in _COMMUTATIVE and len(expected) == 2:
        first, second = expected
        return (fits(first, inputs[0]) and fits(second, inputs[1])) or (
            fits(first, inputs[1]) and fits(second, inputs[0])
        )
    return all(fits(p, v) for p, v in zip(expected, inputs, strict=False))


def _producers_fit(node: ir.Node, producers: tuple[tuple[int, Any], ...]) -> bool:
    """A cheap test that rules out most nodes before the full matcher runs."""
    inputs = node.inputs
    for index, op in producers:
        if index >= len(inputs) or inputs[index] is None:
            return False
        producer = inputs[index].producer()
        if producer is None or producer.op_identifier() != op:
            return False
    return True


class PatternPass(FusionPass):
    """A pass made of onnxscript-style rules, each tried at every node in graph order."""

    rules: ClassVar[tuple[Rule, ...]]
    _compiled: list[_CompiledRule] | None = None

    def compiled_rules(self) -> list[_CompiledRule]:
        if self._compiled is None:
            self._compiled = [
                _CompiledRule(rule, self.spec.min_opset, self.spec.emits) for rule in self.rules
            ]
        return self._compiled

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
                        stats.withdraw(outcome, _node_label(node))
                    else:
                        declined[node] = (stats, outcome)
                    continue
                if outcome and node in declined:
                    earlier, reason = declined.pop(node)
                    earlier.withdraw(reason, _node_label(node))
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
        if not _tree_fits(compiled.tree, node):
            return ()
        declined: str | None = None
        for variant, producers in compiled.variants:
            if not _producers_fit(node, producers):
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
        if declined is not None:
            stats.decline(declined, _node_label(node))
            return declined
        return ()


def replace_subgraph(
    ctx: PassContext,
    pattern: str,
    root: ir.Node,
    old_nodes: Sequence[ir.Node],
    new_nodes: Sequence[ir.Node],
    old_outputs: Sequence[ir.Value],
    new_outputs: Sequence[ir.Value],
    new_initializers: Sequence[ir.Value] = (),
) -> str | None:
    """Swap matched nodes for new ones, as every pass does it: deterministic names
    (``<Pass>/<root>``), new outputs taking the old outputs' names and uses, new nodes placed
    at the root (which keeps the graph sorted), the effect counted and lineage stamped.

    The graph is left as it is when a bisection leaves this rewrite out (ctx.may_rewrite) or
    --check_custom finds the replacement computes something else: the answer is then the
    reason, recorded as a decline; None means replaced."""
    graph = root.graph
    assert graph is not None
    if ctx.site_checker is not None:
        mismatch = ctx.site_checker.check(
            ctx, pattern, _node_label(root), old_nodes, new_nodes, old_outputs, new_outputs
        )
        if mismatch is not None:
            ctx.pattern(pattern).decline(mismatch, _node_label(root))
            return mismatch
    refused = ctx.refusal(pattern, _node_label(root))
    if refused is not None:
        return refused
    produced = {value for node in new_nodes for value in node.outputs}
    if any(value not in produced for value in new_outputs):
        raise ValueError(f"{ctx.spec.name}: a replacement output must come from a new node")
    if len(set(new_outputs)) != len(new_outputs):
        raise ValueError(f"{ctx.spec.name}: two matched values replaced by the same new value")
    base = f"{ctx.spec.name}/{_node_label(root)}"
    replaced = set(new_outputs)
    for index, node in enumerate(new_nodes):
        node.name = ctx.names.claim(graph, base if index == 0 else f"{base}_{index}")
        for position, value in enumerate(node.outputs):
            if value not in replaced and not value.name:
                value.name = f"{node.name}:{position}"
    for initializer in new_initializers:
        graph.initializers[initializer.name] = initializer
    ir.convenience.replace_nodes_and_values(
        graph, root, old_nodes, new_nodes, old_outputs, new_outputs
    )
    ctx.record_fusion(pattern, old_nodes, new_nodes)
    for node in new_nodes:
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
            bypass(node)  # when it cannot go, the Identity stays: correct, just not minimal
    return None


def remove_dead(graph: ir.Graph, nodes: list[ir.Node | None]) -> None:
    """Remove the nodes left without readers by a rewrite (the Shape a folded Gather read), and
    what only they read: later passes then see the graph as it will be saved."""
    while nodes:
        node = nodes.pop()
        if node is None or node.graph is not graph:
            continue
        if any(value.uses() or value.is_graph_output() for value in node.outputs):
            continue
        nodes += [value.producer() for value in node.inputs if value is not None]
        graph.remove(node, safe=True)


def new_constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer holding ``array``, named ``name`` or ``name_<n>`` if that is taken
    (nodes without a name give their sites one label)."""
    candidate, suffix = name, 0
    while candidate in graph.initializers:
        suffix += 1
        candidate = f"{name}_{suffix}"
    value = ir.Value(
        name=candidate,
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        shape=ir.Shape(array.shape),
        const_value=ir.tensor(array, name=candidate),
    )
    graph.initializers[candidate] = value
    return value


def typed(value: ir.Value, dtype: ir.DataType | None, shape: ir.Shape | None) -> ir.Value:
    """Record what a pass knows of a new value: onnx shape inference cannot see through the
    contrib ops, and a later run would otherwise infer (and write) what this one did not."""
    value.type = ir.TensorType(dtype) if dtype is not None else None
    value.shape = shape
    return value


def bypass(node: ir.Node) -> str | None:
    """Remove a pass-through node (Identity, inference Dropout) by wiring its input to its
    consumers; None when done, else why it stays. A graph output keeps its name, type and
    shape: the producer of the input takes them over, unless the input is itself a graph
    input, initializer or another graph output."""
    reason = bypass_refusal(node)
    if reason is not None:
        return reason
    graph = node.graph
    assert graph is not None
    source, result = node.inputs[0], node.outputs[0]
    assert source is not None
    if result.is_graph_output():
        ir.convenience.replace_all_uses_with(result, source, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        source.name = result.name
        source.type = result.type or source.type
        source.shape = result.shape or source.shape
        return None
    ir.convenience.replace_all_uses_with(result, source)
    graph.remove(node, safe=True)
    return None


def bypass_refusal(node: ir.Node) -> str | None:
    """Why bypass(node) would leave the node in place, without touching the graph."""
    source, result = node.inputs[0], node.outputs[0]
    if source is None:
        return "it has no input"
    if result.is_graph_output():
        if source.is_graph_input() or source.is_initializer():
            return "it links a graph input or initializer straight to a graph output"
        if source.is_graph_output():
            return "it copies one graph output to another"
    return None
