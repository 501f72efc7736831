"""Canonical form: a choice written as arithmetic, g * a + (1 - g) * b -> Where(g, a, b), where
every element of the gate g is 0 or 1.

Exporters write such a choice two ways:
- tf2onnx writes TensorFlow's ``SelectV2`` as ``Cast(m) * a + Cast(Not(m)) * b`` (m boolean):
  Keras's attention masks its scores with ``where(mask, scores, -large)``, its embedding maps
  negative ids with another;
- eager PyTorch code that predates ``masked_fill`` keeps a causal mask as a 0/1 float buffer
  and writes ``w * b + -1e4 * (1 - b)`` with b a slice of it sized at run time (transformers'
  OpenAI GPT).
The attention passes read a mask as Where's condition (masked_fill) and never as two products,
so those attentions stayed written out. A gate is a Cast of a boolean, or a value whose elements
are taken from a constant of zeros and ones (graph.drawn_from); its complement is the Cast of the
boolean's Not, or 1 minus the gate. The sum is then a choice between the two other factors:
exactly, for finite values (1 * a + 0 * b is a), and Where is what the model meant for the
others (where 0 * inf would give NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_value,
    drawn_from,
    node_label,
    producer_of,
    replace_subgraph,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_PATTERN = "ArithmeticSelect"
# A 0/1 constant larger than this is not read element by element to prove it one.
_GATE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class _Gate:
    """A factor whose every element is 0 or 1: ``value`` as the product reads it, and the
    boolean it is a Cast of (None: its elements are taken from a constant of zeros and ones)."""

    value: ir.Value
    boolean: ir.Value | None

    def complement(self, value: ir.Value) -> list[ir.Node] | None:
        """The nodes computing ``value`` as 1 - gate: Cast(Not(boolean)), or Sub(1, gate)
        with a one-element 1 (which broadcasts to nothing wider)."""
        cast = producer_of(value, "Cast")
        negation = producer_of(cast.inputs[0], "Not") if cast is not None else None
        if negation is not None and self.boolean is not None:
            return [cast, negation] if negation.inputs[0] is self.boolean else None  # type: ignore[list-item]
        subtract = producer_of(value, "Sub")
        if subtract is None or subtract.inputs[1] is not self.value:
            return None
        one = constant_value(subtract.inputs[0])
        if one is None or one.size != 1 or one.reshape(-1)[0] != 1:
            return None
        rank = self.value.shape.rank() if self.value.shape is not None else None
        return [subtract] if rank is not None and one.ndim <= rank else None


def _gate(value: ir.Value) -> _Gate | None:
    cast = producer_of(value, "Cast")
    source = cast.inputs[0] if cast is not None else None
    if source is not None and source.dtype == ir.DataType.BOOL:
        return _Gate(value, source)
    # Of a constant with zeros and ones both: one of ones alone (or zeros) selects nothing, it
    # is a neutral (or absorbing) operand.
    constant = drawn_from(value)
    if constant is None or constant.size > _GATE_ELEMENTS:
        return None
    ones = constant == 1
    if not np.any(ones) or np.all(ones) or not np.all(ones | (constant == 0)):
        return None
    return _Gate(value, None)


def _factors(product: ir.Node) -> list[tuple[ir.Value, ir.Value]]:
    """(a factor, the other) for each order of a Mul's two operands."""
    if product.op_type != "Mul" or len(product.inputs) != 2 or None in product.inputs:
        return []
    first, second = product.inputs
    return [(first, second), (second, first)]  # type: ignore[list-item]


def _gates(product: ir.Node) -> list[tuple[_Gate, ir.Value]]:
    """(the gate, the other factor) for each way a Mul reads as a gated value."""
    found = []
    for factor, other in _factors(product):
        gate = _gate(factor)
        if gate is not None:
            found.append((gate, other))
    return found


def _choice(total: ir.Node) -> tuple[_Gate, ir.Value, ir.Value, list[ir.Node]] | str | None:
    """(the gate, chosen where it is 1, chosen where it is 0, the nodes) when ``total`` adds a
    gated value to one gated by the complement; why not where it adds two gated values whose
    gates are not that; None where it is no sum of gated values."""
    products = [value.producer() for value in total.inputs]
    if len(products) != 2 or None in products:
        return None
    gated = [_gates(product) for product in products]  # type: ignore[arg-type]
    for first, second, mine in ((*products, gated[0]), (*products[::-1], gated[1])):
        for gate, chosen in mine:
            for factor, other in _factors(second):  # type: ignore[arg-type]
                complement = gate.complement(factor)
                if complement is not None:
                    # the gate's Cast goes too where only this reads it
                    cast = [gate.value.producer()] if gate.boolean is not None else []
                    own = [first, second, *cast, *complement]
                    return gate, chosen, other, own  # type: ignore[return-value]
    if gated[0] and gated[1]:
        return "the two gates are not one gate and its complement"
    return None


@register_pass
class SelectArithmeticCanonicalizationPass(FusionPass):
    """Not a pattern: each Add is judged by the products it sums."""

    spec = PassSpec(
        name="SelectArithmeticCanonicalizationPass",
        category=Category.GRAPH,
        description="g * a + (1 - g) * b -> Where(g, a, b) for a gate g of zeros and ones: "
        "tf2onnx's SelectV2 (Keras's attention mask), a causal mask kept as a 0/1 buffer "
        "(OpenAI GPT), which the attention passes read as a masked_fill",
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
            gate, chosen, other, nodes = found
            new_nodes = []
            condition = gate.boolean
            if condition is None:
                test = ir.node("Cast", [gate.value], attributes={"to": ir.DataType.BOOL})
                condition = typed(test.outputs[0], ir.DataType.BOOL, ctx.shape(gate.value))
                new_nodes.append(test)
            where = ir.node("Where", [condition, chosen, other])
            typed(where.outputs[0], ctx.dtype(total.outputs[0]), ctx.shape(total.outputs[0]))
            new_nodes.append(where)
            site = [total, *_only_here(nodes, total)]
            replace_subgraph(ctx, _PATTERN, total, site, new_nodes, total.outputs, where.outputs)
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
