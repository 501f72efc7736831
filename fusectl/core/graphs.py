"""The graphs a run optimizes: the main graph, the bodies of If/Loop/Scan nodes (any graph
attribute, nested at any depth) and the model-local functions, each under the id
fusion_result.json gives it, as ATC's ``session_and_graph_id_<session>_<graph>`` does.

Numbering (session 0): the main graph is ``0_0``; then, depth first in node order, every
graph attribute of the main graph's nodes (attributes in the order the node lists them, an
attribute holding several graphs in its order), each followed by its own subgraphs; then each
model-local function in the model's order, its body followed by the subgraphs in it. Ids are
given once, to the model as loaded, so they do not depend on what the passes do. Functions in
fusectl's own domains (``fusectl.*``, the element-wise clusters of TbeEltwiseFusionPass) are
fusion results, not the user's code: they are kept as made, so a second run changes nothing.

A pass sees one graph as ``model.graph`` of a :class:`GraphView`: the model with that body in
place of the main graph, so that every pass runs in subgraphs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from fusectl.rewrite.graph import attribute_graphs

_SESSION = 0
# The domains of the functions fusectl itself makes.
FUSECTL_DOMAIN_PREFIX = "fusectl."


class GraphView(ir.Model):
    """The model as a pass sees it while working on one subgraph or function body.

    ``graph`` is the body. Functions, the IR version and the metadata are the model's, so that
    a pass adding a function (the element-wise clustering) or raising the IR version changes
    the model itself. Opset imports are the model's for a subgraph (a subgraph has none of its
    own) and the function's own for a function body (a function declares its imports)."""

    def __init__(self, owner: ir.Model, graph: ir.Graph, opset_imports: dict[str, int]) -> None:
        self._owner = owner
        self._imports = opset_imports
        super().__init__(
            graph,
            ir_version=owner.ir_version,
            producer_name=owner.producer_name,
            producer_version=owner.producer_version,
            domain=owner.domain,
            model_version=owner.model_version,
            doc_string=owner.doc_string,
        )

    @property  # type: ignore[override]
    def ir_version(self) -> int:
        return self._owner.ir_version

    @ir_version.setter
    def ir_version(self, value: int) -> None:
        self._owner.ir_version = value

    @property
    def functions(self) -> dict[ir.OperatorIdentifier, ir.Function]:
        return self._owner.functions

    @property
    def opset_imports(self) -> dict[str, int]:
        return self._imports

    @property
    def metadata_props(self) -> dict[str, str]:
        return self._owner.metadata_props


@dataclass(eq=False)
class GraphScope:
    """One graph the plan runs on: its id, where it is, and the model its passes see."""

    graph_id: str
    label: str
    kind: str  # "main", "subgraph" or "function"
    graph: ir.Graph
    model: ir.Model
    # Where the graph hangs: the node and attribute holding a subgraph, the key of a function.
    owner: ir.Node | None = None
    attribute: str = ""
    function: ir.OperatorIdentifier | None = None
    parent: GraphScope | None = None

    def alive(self, model: ir.Model) -> bool:
        """Whether the graph is still part of the model: a pass may have removed the node
        holding it (dead code) or the function (a composite expanded by its callers)."""
        if self.kind == "main":
            return True
        if self.kind == "function":
            found = model.functions.get(self.function) if self.function else None
            return found is not None and found.graph is self.graph
        node, parent = self.owner, self.parent
        assert node is not None and parent is not None
        if node.graph is not parent.graph or not parent.alive(model):
            return False
        attribute = node.attributes.get(self.attribute)
        return attribute is not None and any(g is self.graph for g in attribute_graphs(attribute))

    def to_json(self) -> dict[str, Any]:
        return {"graph_id": self.graph_id, "graph": self.label, "kind": self.kind}


def _node_label(node: ir.Node) -> str:
    name = node.name or (node.outputs[0].name if node.outputs else "") or ""
    return f"{node.op_type} '{name}'" if name else node.op_type


def _subgraphs(model: ir.Model, scope: GraphScope, next_id: Iterator[str]) -> Iterator[GraphScope]:
    """The subgraphs held by the nodes of ``scope``'s graph, depth first, each viewed with
    the opset imports of the scope that holds it."""
    for node in scope.graph:
        if not node.attributes:  # most nodes: spares iterating an empty UserDict
            continue
        for name, attribute in node.attributes.items():
            graphs = attribute_graphs(attribute)
            for index, graph in enumerate(graphs):
                where = f"{name}[{index}]" if attribute.type == ir.AttributeType.GRAPHS else name
                label = f"{_node_label(node)}.{where}"
                if scope.kind != "main":
                    label = f"{scope.label} > {label}"
                child = GraphScope(
                    next(next_id),
                    label,
                    "subgraph",
                    graph,
                    GraphView(model, graph, scope.model.opset_imports),
                    owner=node,
                    attribute=name,
                    parent=scope,
                )
                yield child
                yield from _subgraphs(model, child, next_id)


def graph_scopes(model: ir.Model) -> list[GraphScope]:
    """Every graph of the model, numbered as the module docstring says. The main graph's
    scope passes the model itself to the passes."""
    ids = (f"{_SESSION}_{number}" for number in range(1 << 62))
    main = GraphScope(next(ids), "main", "main", model.graph, model)
    scopes = [main, *_subgraphs(model, main, ids)]
    for key, function in list(model.functions.items()):
        domain, name, overload = key
        if domain.startswith(FUSECTL_DOMAIN_PREFIX):
            continue
        label = f"function {domain}::{name}" + (f"#{overload}" if overload else "")
        scope = GraphScope(
            next(ids),
            label,
            "function",
            function.graph,
            GraphView(model, function.graph, function.opset_imports),
            function=key,
        )
        scopes += [scope, *_subgraphs(model, scope, ids)]
    return scopes


def initializers_to_constants(graph: ir.Graph) -> None:
    """A function body has no initializers: those a pass added there (folded constants, new
    weights) become Constant nodes at the top of the body, under the same names."""
    previous: ir.Node | None = None
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        assert tensor is not None
        graph.initializers.pop(name)
        node = ir.node("Constant", [], attributes={"value": tensor}, name=f"{name}/Constant")
        constant = node.outputs[0]
        constant.type, constant.shape = value.type, value.shape
        ir.convenience.replace_all_uses_with(value, constant, replace_graph_outputs=True)
        constant.name = name
        if previous is not None:
            graph.insert_after(previous, node)
        elif len(graph):
            graph.insert_before(graph[0], node)
        else:
            graph.append(node)
        previous = node


def defined_values(graph: ir.Graph) -> list[ir.Value]:
    """The values a graph defines: its inputs, initializers and node outputs."""
    return [*graph.inputs, *graph.initializers.values(), *(v for n in graph for v in n.outputs)]


def unshadow(scopes: list[GraphScope], original: set[ir.Value]) -> int:
    """Rename the subgraph values that shadow a name of an enclosing graph, where the run made
    one of the two (passes name what they make after the site, and two graphs may hold sites
    of one name): ONNX wants a name defined once across a graph and its subgraphs. Values
    are referred to by object, so a new name changes nothing else. Returns how many."""
    if len(scopes) < 2:
        return 0
    taken = {value.name for scope in scopes for value in defined_values(scope.graph)}
    outer: dict[int, dict[str, ir.Value]] = {}  # per scope: the names its enclosing graphs define
    renamed = 0
    for scope in scopes:  # enclosing graphs come first
        visible: dict[str, ir.Value] = {}
        if scope.parent is not None and scope.kind == "subgraph":
            parent = scope.parent
            visible = {**outer[id(parent)], **_names(parent.graph)}
        outer[id(scope)] = visible
        for value in defined_values(scope.graph):
            shadowed = visible.get(value.name or "")
            if shadowed is None or (value in original and shadowed in original):
                continue
            number = 1
            while f"{value.name}_{number}" in taken:
                number += 1
            value.name = f"{value.name}_{number}"
            taken.add(value.name)
            renamed += 1
    return renamed


def _names(graph: ir.Graph) -> dict[str, ir.Value]:
    return {value.name: value for value in defined_values(graph) if value.name}
