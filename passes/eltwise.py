"""TbeEltwiseFusionPass: MindSpore's graph-kernel fusion (``enable_graph_kernel``) in ONNX terms.

Maximal convex clusters of element-wise and broadcast ops, and the ops of a user's composite
functions (model-local functions made of such ops only), become one node each, calling a
model-local ONNX function. Standard ONNX in, standard ONNX out: any runtime that runs local
functions (onnxruntime inlines them when it loads the model) gives the same numbers, and a
kernel compiler that wants fusion groups finds them ready made. Identical clusters share one
function, so a 12-layer model carries one body used 12 times.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from fusectl.errors import FusectlError
from fusectl.rewrite.context import PassContext, PatternStats
from fusectl.rewrite.graph import (
    attribute_reference,
    constant_tensor,
    live_nodes,
    producers,
    replace_subgraph,
)
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass

DOMAIN = "fusectl.eltwise"
FLAGS_OPTION = "graph_kernel_flags"
PATTERN = "EltwiseCluster"
# Constants with at most this many elements are copied into the function body; larger ones
# (weights, tables) stay in the graph and are passed in.
SMALL_CONSTANT = 16
# Model-local functions need IR version 8 (ONNX 1.10).
FUNCTIONS_IR_VERSION = 8
_NAME_OPS = 4

# The ONNX ops that cluster by default: each output element depends only on the elements at
# the same (numpy-broadcast) position of its inputs, so any grouping of them is one loop nest.
DEFAULT_CLUSTER_OPS = frozenset(
    {
        # arithmetic, variadic included
        *("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean"),
        # unary math
        *("Abs", "Neg", "Reciprocal", "Sqrt", "Exp", "Log", "Floor", "Ceil", "Round", "Sign"),
        *("Erf", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh"),
        *("Acosh", "Atanh", "IsNaN", "IsInf"),
        # activations
        *("Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid"),
        *("HardSwish", "Tanh", "Softplus", "Softsign", "ThresholdedRelu", "Mish", "Gelu"),
        "Shrink",
        # comparisons and logic
        *("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or"),
        *("Xor", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot"),
        # selection, conversion, broadcast
        *("Clip", "Where", "Cast", "CastLike", "Expand"),
    }
)

_FLAGS = (
    "enable_cluster_ops",
    "disable_cluster_ops",
    "enable_cluster_ops_only",
    "disable_expand_ops",
)
_OP_FLAGS = _FLAGS[:3]


@dataclass(frozen=True)
class ClusterConfig:
    """What --graph_kernel_flags decided: the ops that cluster, the functions kept whole."""

    ops: frozenset[str] = DEFAULT_CLUSTER_OPS
    no_expand: frozenset[str] = frozenset()


@functools.cache
def _onnx_ops() -> dict[str, bool]:
    """Every ONNX-domain op name, with whether it takes a subgraph (which cannot cluster)."""
    graph_types = {
        onnx.defs.OpSchema.AttrType.GRAPH,
        onnx.defs.OpSchema.AttrType.GRAPHS,
    }
    found: dict[str, bool] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx"):
            takes_graph = any(a.type in graph_types for a in schema.attributes.values())
            found[schema.name] = found.get(schema.name, False) or takes_graph
    return found


def _check_op(name: str, flag: str) -> None:
    known = _onnx_ops()
    if name not in known:
        folded = {op.lower(): op for op in known}
        hits = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.6)
        hint = f"; did you mean '{folded[hits[0]]}'?" if hits else ""
        raise FusectlError(f"--graph_kernel_flags: unknown op '{name}' in --{flag}{hint}")
    if known[name]:
        raise FusectlError(
            f"--graph_kernel_flags: {name} in --{flag} takes a subgraph and cannot cluster"
        )


def parse_graph_kernel_flags(text: str) -> ClusterConfig:
    """MindSpore-style ``--enable_cluster_ops=A,B --disable_cluster_ops=C`` (op names as ONNX
    spells them, case-sensitive), ``--enable_cluster_ops_only=A,B`` (exactly these, before the
    other two apply) and ``--disable_expand_ops=MyOp`` (composite functions kept whole)."""
    lists: dict[str, list[str]] = {}
    for token in text.split():
        name, equals, value = token.partition("=")
        flag = name[2:] if name.startswith("--") else ""
        if flag not in _FLAGS:
            known = ", ".join(f"--{f}" for f in _FLAGS)
            raise FusectlError(f"--graph_kernel_flags: unknown flag '{name}' (known: {known})")
        names = [item.strip() for item in value.split(",") if item.strip()]
        if not equals or not names:
            raise FusectlError(
                f"--graph_kernel_flags: {name} takes a comma-separated list, as {name}=A,B"
            )
        lists.setdefault(flag, []).extend(names)
    for flag in _OP_FLAGS:
        for op in lists.get(flag, ()):
            _check_op(op, flag)
    enable = set(lists.get("enable_cluster_ops", ()))
    disable = set(lists.get("disable_cluster_ops", ()))
    if both := sorted(enable & disable):
        raise FusectlError(
            f"--graph_kernel_flags: {', '.join(both)} both enabled and disabled for clustering"
        )
    only = lists.get("enable_cluster_ops_only")
    ops = (set(only) if only is not None else set(DEFAULT_CLUSTER_OPS)) | enable
    return ClusterConfig(frozenset(ops - disable), frozenset(lists.get("disable_expand_ops", ())))


def _is_onnx(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _is_constant_node(node: ir.Node) -> bool:
    return node.op_type == "Constant" and _is_onnx(node)


def _label(node: ir.Node) -> str:
    return node.name or (node.outputs[0].name if node.outputs else "") or node.op_type


def _has_subgraph(node: ir.Node) -> bool:
    return any(
        attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for attr in node.attributes.values()
    )


class _Composites:
    """Which model-local functions are composites: bodies of clusterable ops and Constants
    only (nested composites included), same default opset as the model, no attribute
    parameters, and not kept whole by --disable_expand_ops."""

    def __init__(self, model: ir.Model, config: ClusterConfig, opset: int) -> None:
        self.functions = model.functions
        self.config = config
        self.opset = opset
        self._known: dict[ir.OperatorIdentifier, bool] = {}

    def function(self, node: ir.Node) -> ir.Function | None:
        """The composite that ``node`` calls, if it calls one in a form that expands."""
        function = self.functions.get(node.op_identifier())
        if function is None or not _fits(node, function):
            return None
        return function if self._expands(function, ()) else None

    def _expands(self, function: ir.Function, calling: tuple[ir.OperatorIdentifier, ...]) -> bool:
        key = function.identifier()
        if key in calling:
            return False  # recursion: not a composite
        if key not in self._known:
            self._known[key] = self._body_expands(function, (*calling, key))
        return self._known[key]

    def _body_expands(
        self, function: ir.Function, calling: tuple[ir.OperatorIdentifier, ...]
    ) -> bool:
        imports = function.opset_imports
        if function.name in self.config.no_expand or function.attributes:
            return False
        if imports.get("", imports.get("ai.onnx")) not in (None, self.opset):
            return False
        produced = {value for node in function for value in node.outputs}
        outputs = list(function.outputs)
        if len(set(outputs)) != len(outputs) or not all(v in produced for v in outputs):
            return False
        for node in function:
            if any(attr.is_ref() for attr in node.attributes.values()):
                return False
            if _is_constant_node(node):
                if constant_tensor(node.outputs[0]) is None:
                    return False
                continue
            if _is_onnx(node):
                if node.op_type not in self.config.ops or _has_subgraph(node):
                    return False
                continue
            inner = self.functions.get(node.op_identifier())
            if inner is None or not _fits(node, inner) or not self._expands(inner, calling):
                return False
        return True

    def compute_ops(self, function: ir.Function) -> list[str]:
        """The op types the composite computes, in body order, nested ones expanded."""
        ops: list[str] = []
        for node in function:
            if _is_onnx(node):
                if not _is_constant_node(node):
                    ops.append(node.op_type)
            else:
                ops.extend(self.compute_ops(self.functions[node.op_identifier()]))
        return ops


def _fits(node: ir.Node, function: ir.Function) -> bool:
    """A call that passes no attributes and no more inputs or outputs than the function has."""
    return (
        not node.attributes
        and len(node.inputs) <= len(function.inputs)
        and len(node.outputs) <= len(function.outputs)
    )


def _clusterable(node: ir.Node, config: ClusterConfig, composites: _Composites) -> bool:
    if _is_constant_node(node):
        return False  # absorbed into a body when small, else passed in
    if attribute_reference([node]) is not None:
        return False  # in a function body, an attribute known only per call
    if _is_onnx(node):
        return node.op_type in config.ops and not _has_subgraph(node)
    return composites.function(node) is not None


class _Clusters:
    """Grows convex clusters in one topological sweep.

    Every node carries a bitmask of the clusters it depends on; a cluster's mask holds one bit
    per cluster merged into it, so old bits stay meaningful after merges. A node joins the
    clusters of its clusterable producers unless a path leaves one of them and comes back:
    through another producer outside the join, or into another cluster of the join. The
    blocked clusters are dropped until the join is valid, so one sweep stays near linear.
    """

    def __init__(self, stats: PatternStats) -> None:
        self.stats = stats
        self.depends: dict[ir.Node, int] = {}
        self.cluster: dict[ir.Node, int] = {}
        self.parent: list[int] = []
        self.mask: list[int] = []
        self.outside: list[int] = []  # what the cluster's outside producers depend on
        self.feeders: list[list[ir.Node]] = []  # those producers
        self.members: list[list[ir.Node]] = []

    def find(self, index: int) -> int:
        while self.parent[index] != index:
            self.parent[index] = self.parent[self.parent[index]]
            index = self.parent[index]
        return index

    def add(self, node: ir.Node, producers: list[ir.Node], clusterable: bool) -> None:
        depends = 0
        for producer in producers:
            depends |= self.depends[producer]
        if not clusterable:
            self.depends[node] = depends
            return
        joined = {self.find(self.cluster[p]) for p in producers if p in self.cluster}
        while blocked := self._blocked(producers, joined):
            for index, through in blocked.items():
                joined.discard(index)
                self.stats.decline(
                    f"joining would create a cycle through {through.op_type}", _label(node)
                )
        root = self._merge(sorted(joined))
        for producer in producers:
            if producer not in self.cluster or self.find(self.cluster[producer]) != root:
                self.outside[root] |= self.depends[producer]
                self.feeders[root].append(producer)
        self.members[root].append(node)
        self.cluster[node] = root
        self.depends[node] = depends | self.mask[root]

    def _blocked(self, producers: list[ir.Node], joined: set[int]) -> dict[int, ir.Node]:
        """The clusters of ``joined`` a path leaves and re-enters, each with a node on it."""
        every = 0
        for index in joined:
            every |= self.mask[index]
        blocked: dict[int, ir.Node] = {}
        for producer in producers:
            if producer in self.cluster and self.find(self.cluster[producer]) in joined:
                continue
            self._note(blocked, joined, self.depends[producer] & every, producer)
        for index in joined:
            hit = self.outside[index] & every & ~self.mask[index]
            if hit:
                for feeder in self.feeders[index]:
                    self._note(blocked, joined, self.depends[feeder] & hit, feeder)
        return blocked

    def _note(self, blocked: dict[int, ir.Node], joined: set[int], hit: int, via: ir.Node) -> None:
        if hit:
            for index in joined:
                if self.mask[index] & hit and index not in blocked:
                    blocked[index] = via

    def _merge(self, indices: list[int]) -> int:
        if not indices:
            index = len(self.parent)
            self.parent.append(index)
            self.mask.append(1 << index)
            self.outside.append(0)
            self.feeders.append([])
            self.members.append([])
            return index
        root, *others = indices
        for other in others:
            self.parent[other] = root
            self.mask[root] |= self.mask[other]
            self.outside[root] |= self.outside[other]
            self.feeders[root].extend(self.feeders[other])
            self.members[root].extend(self.members[other])
            self.feeders[other], self.members[other] = [], []
        return root

    def groups(self) -> list[list[ir.Node]]:
        return [group for index, group in enumerate(self.members) if self.parent[index] == index]


def _small_constant(value: ir.Value) -> ir.TensorProtocol | None:
    """The tensor of an initializer or Constant output small enough to copy into a body."""
    if value.is_graph_input():
        return None
    producer = value.producer()
    if producer is not None and not _is_constant_node(producer):
        return None
    tensor = constant_tensor(value)
    if tensor is None or tensor.size > SMALL_CONSTANT:
        return None
    return tensor


def _copy_attr(attr: ir.Attr) -> ir.Attr:
    return ir.Attr(attr.name, attr.type, attr.value)


def _constant(tensor: ir.TensorProtocol) -> ir.Node:
    """A body Constant holding an unnamed copy, so identical bodies compare equal."""
    return ir.node("Constant", [], {"value": ir.tensor(tensor.numpy())})


class _Body:
    """One cluster's function body, canonically named so equal bodies share a function."""

    def __init__(self, members: Sequence[ir.Node], composites: _Composites) -> None:
        self.members = set(members)
        self.composites = composites
        self.values: dict[ir.Value, ir.Value] = {}
        self.inputs: list[ir.Value] = []
        self.arguments: list[ir.Value] = []
        self.nodes: list[ir.Node] = []
        self.absorbed: list[ir.Node] = []
        self.ops: list[str] = []
        for member in members:
            inputs = [self._read(value) for value in member.inputs]
            function = None if _is_onnx(member) else composites.function(member)
            if function is None:
                self.ops.append(member.op_type)
                outputs = self._emit(member, inputs)
            else:
                self.ops.extend(composites.compute_ops(function))
                outputs = self._expand(function, inputs)
            self.values.update(zip(member.outputs, outputs, strict=False))
        self.results = [
            value
            for member in members
            for value in member.outputs
            if value.is_graph_output() or any(use.node not in self.members for use in value.uses())
        ]
        for index, node in enumerate(self.nodes):
            node.name = f"{node.op_type}_{index}"
            for position, value in enumerate(node.outputs):
                value.name = f"v{index}_{position}"

    def _read(self, value: ir.Value | None) -> ir.Value | None:
        if value is None or value in self.values:
            return None if value is None else self.values[value]
        tensor = _small_constant(value)
        if tensor is not None:
            constant = _constant(tensor)
            self.nodes.append(constant)
            producer = value.producer()
            if (
                producer is not None
                and not value.is_graph_output()
                and all(use.node in self.members for use in value.uses())
            ):
                self.absorbed.append(producer)
            local = constant.outputs[0]
        else:
            local = ir.Value(name=f"x{len(self.inputs)}")
            self.inputs.append(local)
            self.arguments.append(value)
        self.values[value] = local
        return local

    def _emit(self, node: ir.Node, inputs: list[ir.Value | None]) -> Sequence[ir.Value]:
        clone = ir.Node(
            "",
            node.op_type,
            inputs,
            [_copy_attr(attr) for attr in node.attributes.values()],
            num_outputs=len(node.outputs),
        )
        self.nodes.append(clone)
        return clone.outputs

    def _expand(self, function: ir.Function, inputs: list[ir.Value | None]) -> list[ir.Value]:
        local: dict[ir.Value, ir.Value | None] = dict(
            zip(function.inputs, [*inputs, *[None] * len(function.inputs)], strict=False)
        )
        for node in function:
            args = [None if v is None else local[v] for v in node.inputs]
            if _is_constant_node(node):
                tensor = constant_tensor(node.outputs[0])
                assert tensor is not None  # a composite's Constants are all readable
                outputs: Sequence[ir.Value] = self._emit_constant(tensor)
            elif _is_onnx(node):
                outputs = self._emit(node, args)
            else:
                inner = self.composites.functions[node.op_identifier()]
                outputs = self._expand(inner, args)
            local.update(zip(node.outputs, outputs, strict=False))
        return [local[value] for value in function.outputs]  # type: ignore[misc]

    def _emit_constant(self, tensor: ir.TensorProtocol) -> Sequence[ir.Value]:
        constant = _constant(tensor)
        self.nodes.append(constant)
        return constant.outputs

    def signature(self) -> tuple:
        """Equal for bodies that compute the same thing with the same constants."""
        index = {value: f"x{i}" for i, value in enumerate(self.inputs)}
        for node in self.nodes:
            index.update((value, value.name) for value in node.outputs)
        return (
            len(self.inputs),
            tuple(
                (
                    node.op_type,
                    tuple(None if v is None else index[v] for v in node.inputs),
                    len(node.outputs),
                    tuple(
                        ir.serde.serialize_attribute(attr).SerializeToString(deterministic=True)
                        for attr in node.attributes.values()
                    ),
                )
                for node in self.nodes
            ),
            tuple(index[self.values[value]] for value in self.results),
        )

    def name(self) -> str:
        shown = "_".join(self.ops[:_NAME_OPS])
        return f"Fused_{shown}" + (f"_{len(self.ops)}ops" if len(self.ops) > _NAME_OPS else "")


def _topological(graph: ir.Graph) -> list[ir.Node]:
    """The graph's nodes in topological order, sorting it first if an earlier pass left it
    unsorted (nodes are only reordered; TopologicalSortPass would do the same at the end)."""
    seen: set[ir.Node] = set()
    for node in graph:
        if any(p not in seen for p in producers(node, graph)):
            graph.sort()
            break
        seen.add(node)
    return list(graph)


def _called(model: ir.Model) -> set[ir.OperatorIdentifier]:
    """Every op a node of the model calls: main graph, subgraphs and function bodies."""
    graphs: list[Iterable[ir.Node]] = [ir.traversal.RecursiveGraphIterator(model.graph)]
    graphs += [ir.traversal.RecursiveGraphIterator(f) for f in model.functions.values()]
    return {node.op_identifier() for nodes in graphs for node in nodes}


@register_pass
class TbeEltwiseFusionPass(FusionPass):
    """Element-wise clusters (composite functions expanded into them) -> one function call."""

    spec = PassSpec(
        name="TbeEltwiseFusionPass",
        category=Category.UB,
        description="off by default (MindSpore enable_graph_kernel): maximal convex clusters "
        "of element-wise/broadcast ops, and the ops of composite model-local functions, -> one "
        "call of a model-local function each (identical clusters share it); tuned by "
        "--graph_kernel_flags",
        aliases=("enable_graph_kernel", "graph_kernel_fusion"),
        default_on=False,
        numerics=Numerics.EXACT,
        priority=5990,
        options=(FLAGS_OPTION,),
    )

    def check_options(self, options: Mapping[str, str]) -> None:
        parse_graph_kernel_flags(options.get(FLAGS_OPTION, ""))

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        config = parse_graph_kernel_flags(ctx.options.get(FLAGS_OPTION, ""))
        composites = _Composites(model, config, ctx.opset)
        graph = model.graph
        order = _topological(graph)
        position = {node: index for index, node in enumerate(order)}
        live = live_nodes(graph)
        clusters = _Clusters(ctx.pattern(PATTERN))
        for node in order:
            clusterable = node in live and _clusterable(node, config, composites)
            clusters.add(node, producers(node, graph), clusterable)
        groups = sorted(
            (sorted(members, key=position.__getitem__) for members in clusters.groups()),
            key=lambda members: position[members[-1]],
        )
        shared: dict[tuple, ir.Function] = {}
        expanded: set[ir.OperatorIdentifier] = set()
        # Run on a model-local function's body (fusectl.core.graphs), a cluster of the whole
        # body would only wrap the function in another: it is one op already.
        function_body = any(f.graph is graph for f in model.functions.values())
        for members in groups:
            if len(members) < 2:
                continue  # one op, or a lone composite call: already one op
            body = _Body(members, composites)
            if len(body.ops) < 2:
                continue  # an op and a composite of Constants only
            if function_body and len(members) + len(body.absorbed) == len(graph):
                continue
            if self._fuse(model, ctx, members, body, shared, position):
                expanded.update(m.op_identifier() for m in members if not _is_onnx(m))
        if ctx.changed:
            _drop_unused(model, expanded)
            graph.sort()
            model.ir_version = max(model.ir_version, FUNCTIONS_IR_VERSION)

    def _fuse(
        self,
        model: ir.Model,
        ctx: PassContext,
        members: list[ir.Node],
        body: _Body,
        shared: dict[tuple, ir.Function],
        position: dict[ir.Node, int],
    ) -> bool:
        """Replace the cluster by one call; False when a bisection left it out."""
        signature = body.signature()
        function = shared.get(signature)
        if function is None:
            name, suffix = body.name(), 0
            while (DOMAIN, name if not suffix else f"{name}_{suffix}", "") in model.functions:
                suffix += 1
            function = ir.Function(
                DOMAIN,
                name if not suffix else f"{name}_{suffix}",
                graph=ir.Graph(
                    body.inputs,
                    [body.values[value] for value in body.results],
                    nodes=body.nodes,
                    opset_imports={"": ctx.opset},
                ),
                attributes=[],
            )
        call = ir.Node(DOMAIN, function.name, body.arguments, num_outputs=len(body.results))
        # The root first: the lineage then reads in execution order.
        old_nodes = sorted([*members, *body.absorbed], key=position.__getitem__, reverse=True)
        refused = replace_subgraph(
            ctx, PATTERN, members[-1], old_nodes, [call], body.results, call.outputs
        )
        if refused is not None:
            return False
        if signature not in shared:
            shared[signature] = function
            model.functions[function.identifier()] = function
            model.opset_imports[DOMAIN] = 1
        return True


def _drop_unused(model: ir.Model, expanded: set[ir.OperatorIdentifier]) -> None:
    """Remove the composites no node calls any more (nested ones once their callers go), and
    the import of a domain nothing uses after that."""
    removed: set[str] = set()
    while unused := (expanded & set(model.functions)) - _called(model):
        for key in unused:
            del model.functions[key]
            removed.add(key[0])
    in_use = {key[0] for key in _called(model)} | {key[0] for key in model.functions}
    for domain in removed - in_use:
        model.opset_imports.pop(domain, None)
