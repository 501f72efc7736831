"""Required infrastructure: what every output needs whatever the switches say.

These run after all fusions, cannot be switched off, and are never counted in
fusion_result.json (they are not fusions).
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir
from onnx_ir.passes import common as ir_passes

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import attribute_graphs
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

# Versions of the non-default domains fused ops are emitted in.
_DOMAIN_VERSIONS = {"com.microsoft": 1}


def _required(name: str, description: str) -> PassSpec:
    return PassSpec(
        name=name,
        category=Category.GRAPH,
        description=description,
        closable=False,
        required=True,
        counted=False,
    )


@register_pass
class DeadNodeEliminationPass(FusionPass):
    spec = _required(
        "DeadNodeEliminationPass", "removes nodes and initializers no graph output depends on"
    )

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        before = len(model.graph) + len(model.graph.initializers)
        ir_passes.RemoveUnusedNodesPass()(model)
        removed = before - len(model.graph) - len(model.graph.initializers)
        ctx.pattern("RemoveUnused").effected += removed
        ctx.changed = removed > 0


@register_pass
class TopologicalSortPass(FusionPass):
    spec = _required("TopologicalSortPass", "orders nodes so every input is produced before use")

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        # Rewrites insert fused nodes at their root, which keeps the order valid, so the
        # linear check usually spares the full sort.
        if not _is_sorted(model.graph):
            ir_passes.TopologicalSortPass()(model)
            ctx.pattern("Sort").effected += 1
            ctx.changed = True


def _is_sorted(graph: ir.Graph) -> bool:
    """Whether every value a node reads (its subgraphs included) that this graph computes is
    computed before it; values of enclosing graphs and of the subgraphs themselves are not
    this graph's to order."""
    produced: set[ir.Value] = set()
    for node in graph:
        reads = _reads(node) if node.attributes else node.inputs
        for value in reads:
            if value is None:
                continue
            producer = value.producer()
            if producer is not None and producer.graph is graph and value not in produced:
                return False
        produced.update(node.outputs)
    return True


def _reads(node: ir.Node) -> Iterator[ir.Value]:
    """The node's inputs, and the inputs of every node in its subgraphs (a node without
    attributes has none: _is_sorted then reads its inputs directly, it runs on every node)."""
    yield from (value for value in node.inputs if value is not None)
    for attribute in node.attributes.values():
        for body in attribute_graphs(attribute):
            for inner in ir.traversal.RecursiveGraphIterator(body):
                yield from (value for value in inner.inputs if value is not None)


@register_pass
class OpsetImportPass(FusionPass):
    spec = _required("OpsetImportPass", "imports every operator domain the graph's nodes use")

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        used = {node.domain for node in model.graph}
        for domain in sorted(used - set(model.opset_imports) - {"", "ai.onnx"}):
            model.opset_imports[domain] = _DOMAIN_VERSIONS.get(domain, 1)
            ctx.pattern("ImportDomain").effected += 1
            ctx.changed = True
