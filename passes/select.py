"""Canonical form: a choice written as arithmetic, Cast(m) * a + Cast(Not(m)) * b -> Where(m, a, b).

tf2onnx writes TensorFlow's ``SelectV2`` this way: Keras's attention masks its scores with
``where(mask, scores, -large)``, its embedding maps negative ids with another. The attention
passes read a mask as Where's condition (masked_fill) and never as two products, so the causal
Keras attention stays written out. The sum of two products gated by a boolean and its negation,
each cast to the products' type, is a choice between the two other factors: exactly, for finite
values (1 * a + 0 * b is a), and Where is what the model meant for the others (where 0 * inf
would give NaN).
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import node_label, producer_of, replace_subgraph, typed
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_PATTERN = "ArithmeticSelect"


def _gates(product: ir.Node) -> list[tuple[ir.Node, ir.Value]]:
    """(the Cast of a boolean, the other factor) for each way a Mul reads as a gated value."""
    if product.op_type != "Mul" or len(product.inputs) != 2 or None in product.inputs:
        return []
    found = []
    for index, value in enumerate(product.inputs):
        cast = producer_of(value, "Cast")
        source = cast.inputs[0] if cast is not None else None
        if source is not None and source.dtype == ir.DataType.BOOL:
            found.append((cast, product.inputs[1 - index]))
    return found  # type: ignore[return-value]


def _choice(total: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value, list[ir.Node]] | str | None:
    """(condition, chosen where true, chosen where false, the nodes) when ``total`` adds a
    value gated by a boolean to one gated by its negation (Not); why not where it adds two
    gated values whose gates are not that; None where it is no sum of gated values."""
    products = [value.producer() for value in total.inputs]
    if len(products) != 2 or None in products:
        return None
    gated = [_gates(product) for product in products]  # type: ignore[arg-type]
    if not gated[0] or not gated[1]:
        return None
    for (first, second), (mine, theirs) in ((products, gated), (products[::-1], gated[::-1])):
        for cast, chosen in mine:
            for other_cast, other in theirs:
                negation = producer_of(other_cast.inputs[0], "Not")
                if negation is not None and negation.inputs[0] is cast.inputs[0]:
                    nodes = [first, second, cast, other_cast, negation]
                    return cast.inputs[0], chosen, other, nodes  # type: ignore[return-value]
    return "the two gates are not one boolean and its negation"


@register_pass
class SelectArithmeticCanonicalizationPass(FusionPass):
    """Not a pattern: each Add is judged by the products it sums."""

    spec = PassSpec(
        name="SelectArithmeticCanonicalizationPass",
        category=Category.GRAPH,
        description="Cast(m) * a + Cast(Not(m)) * b -> Where(m, a, b): tf2onnx's SelectV2 "
        "(Keras's attention mask), which the attention passes read as a masked_fill",
        aliases=("select_arithmetic_canonicalization",),
        priority=3033,
        emits=("Where",),
        canonical=True,
        every_layer=False,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        for total in list(ctx.op_index.of_type(graph, "Add", ("", "ai.onnx"))):
            if total.graph is not graph or len(total.inputs) != 2 or None in total.inputs:
                continue
            found = _choice(total)
            if found is None:
                continue
            if isinstance(found, str):
                ctx.pattern(_PATTERN).decline(found, node_label(total))
                continue
            condition, chosen, other, nodes = found
            site = [total, *_only_here(nodes, total)]
            where = ir.node("Where", [condition, chosen, other])
            typed(where.outputs[0], ctx.dtype(total.outputs[0]), ctx.shape(total.outputs[0]))
            replace_subgraph(ctx, _PATTERN, total, site, [where], total.outputs, where.outputs)
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()


def _only_here(nodes: list[ir.Node], total: ir.Node) -> list[ir.Node]:
    """The nodes read only within the choice (a Cast of the mask read elsewhere too stays)."""
    kept = [total]
    for node in nodes:  # products first, then what they read: readers before what they read
        readers = {user for value in node.outputs for user, _ in value.uses()}
        if readers <= set(kept) and not any(v.is_graph_output() for v in node.outputs):
            kept.append(node)
    return kept[1:]
