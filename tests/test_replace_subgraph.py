"""fusectl.rewrite.graph.replace_subgraph refuses, as a decline with its reason, a replacement
that would leave the graph invalid: new nodes reading a value computed from their own outputs
(a cycle: a KV-cache present whose length a mask reads, before the size was read again),
reading a value a removed node computes, or a removed node's value that another node reads.
Each was an internal error (exit 3) before."""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import replace_subgraph
from fusectl.rewrite.registry import Category, PassSpec


def _graph(reader: bool) -> tuple[ir.Graph, dict[str, ir.Node]]:
    """joined = Concat(a, b); out = Mul(joined, b) (the root); with ``reader``, also
    side = Neg(joined), read outside the match, and a graph output."""
    a = ir.Value(name="a", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    b = ir.Value(name="b", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4]))
    concat = ir.node("Concat", [a, b], attributes={"axis": 0}, name="join")
    joined = concat.outputs[0]
    joined.name = "joined"
    mul = ir.node("Mul", [joined, b], name="root")
    mul.outputs[0].name = "out"
    nodes = {"join": concat, "root": mul}
    outputs = [mul.outputs[0]]
    if reader:
        nodes["side"] = ir.node("Neg", [joined], name="side")
        nodes["side"].outputs[0].name = "side"
        outputs.append(nodes["side"].outputs[0])
    order = [concat, *([nodes["side"]] if reader else []), mul]
    return ir.Graph([a, b], outputs, nodes=order, opset_imports={"": 17}), nodes


def _replace(
    nodes: dict[str, ir.Node], fused: ir.Node, replaced: list[ir.Value]
) -> tuple[str | None, PassContext]:
    """The Concat and the Mul replaced by ``fused``, whose outputs take over ``replaced``."""
    spec = PassSpec(name="Probe", category=Category.UB, description="replaces")
    ctx = PassContext(spec=spec, target="ort", opset=17)
    old = [nodes["join"], nodes["root"]]
    reason = replace_subgraph(ctx, "Probe", nodes["root"], old, [fused], replaced, fused.outputs)
    return reason, ctx


def test_a_replacement_reading_a_value_computed_from_its_own_output_is_declined() -> None:
    graph, nodes = _graph(reader=True)
    joined = nodes["join"].outputs[0]
    # The new op computes both the product and the joined value, and reads Neg(joined).
    fused = ir.node("Fused", [graph.inputs[0], nodes["side"].outputs[0]], num_outputs=2)
    reason, ctx = _replace(nodes, fused, [nodes["root"].outputs[0], joined])
    assert reason == (
        "the new Fused would read a value computed from its own output (a size or mask read "
        "from a value it computes)"
    )
    stats = ctx.patterns["Probe"]
    assert (stats.declines, stats.decline_examples) == ({reason: 1}, {reason: ["root"]})
    assert [node.name for node in graph] == ["join", "side", "root"]  # untouched


def test_a_replacement_reading_a_removed_value_is_declined() -> None:
    graph, nodes = _graph(reader=False)
    joined = nodes["join"].outputs[0]
    fused = ir.node("Fused", [joined])  # joined goes with the Concat it is computed by
    reason, _ = _replace(nodes, fused, [nodes["root"].outputs[0]])
    assert reason == "the new Fused would read joined, which a removed node computes"
    assert [node.name for node in graph] == ["join", "root"]


def test_a_match_whose_inner_value_is_read_outside_it_is_declined() -> None:
    """The Concat's output is read by a Neg outside the match (and is a graph output through
    it): removing the Concat would leave the Neg reading nothing, whatever the pass checked."""
    graph, nodes = _graph(reader=True)
    fused = ir.node("Fused", list(graph.inputs))
    reason, ctx = _replace(nodes, fused, [nodes["root"].outputs[0]])
    assert reason == "an intermediate value (Concat output) is also used by Neg outside the match"
    assert ctx.patterns["Probe"].declines == {reason: 1}
    assert [node.name for node in graph] == ["join", "side", "root"]  # untouched


def test_a_replacement_reading_the_values_before_the_match_goes_in() -> None:
    graph, nodes = _graph(reader=False)
    fused = ir.node("Fused", list(graph.inputs))
    reason, _ = _replace(nodes, fused, [nodes["root"].outputs[0]])
    assert reason is None
    assert [node.op_type for node in graph] == ["Fused"]
    assert graph.outputs[0].producer() is fused
