"""Reshape / Transpose chains that only move whole axes: one Transpose, one Reshape, or none.

A chain like Reshape([B, C, S] -> [B, N, H, S]) -> Transpose([0, 3, 1, 2]) -> Reshape(->
[B, S, C]) is Transpose(x, [0, 2, 1]): the split heads travel together and are merged back.
What a chain computes is read off where the source's elements end up
(``fusectl.rewrite.layout``), not off how its ops are spelled.

Such chains are left where a fused op meets the graph's own layout (the heads a fused attention
reads or returns, merged or split back by the lowering next to the exporter's split), so the
pass runs after the fusions. Chains of Reshapes alone or Transposes alone are
ReshapeReshapeFusionPass's and TransposeTransposeFusionPass's, each with its own switch.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import new_constant, node_label, replace_subgraph, typed
from fusectl.rewrite.layout import follow
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_LAYOUT_OPS = ("Reshape", "Transpose")
_DEFAULT_DOMAINS = ("", "ai.onnx")


def _inner(node: ir.Node) -> bool:
    """Whether the node's result is read by one Reshape or Transpose and nothing else."""
    result = node.outputs[0]
    uses = result.uses()
    if result.is_graph_output() or len(uses) != 1:
        return False
    consumer, index = uses[0]
    return index == 0 and consumer.op_type in _LAYOUT_OPS and consumer.domain in _DEFAULT_DOMAINS


def _chain(end: ir.Node) -> list[ir.Node]:
    chain = [end]
    while True:
        source = chain[0].inputs[0]
        producer = source.producer() if source is not None else None
        if (
            producer is None
            or producer.op_type not in _LAYOUT_OPS
            or producer.domain not in _DEFAULT_DOMAINS
            or producer.graph is not end.graph
            or not _inner(producer)
        ):
            return chain
        chain.insert(0, producer)


@register_pass
class LayoutChainFusionPass(FusionPass):
    spec = PassSpec(
        name="LayoutChainFusionPass",
        category=Category.UB,
        description="Reshape/Transpose chain that only moves whole axes (split heads merged "
        "back, a fused op's layout next to the graph's own) -> one Transpose, one Reshape or "
        "nothing",
        aliases=("layout_chain_fusion", "ReshapeTransposeChainFusion"),
        priority=5950,  # the down band: after every fusion, on the layout they leave
        emits=("Transpose", "Reshape"),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("LayoutChain")
        graph = model.graph
        ends = [
            node
            for op_type in _LAYOUT_OPS
            for node in ctx.op_index.of_type(graph, op_type, _DEFAULT_DOMAINS)
            if node.graph is graph and not _inner(node)
        ]
        for end in ends:
            if end.graph is not graph:
                continue
            chain = _chain(end)
            if len({node.op_type for node in chain}) < 2:
                continue  # one op type: ReshapeReshape's or TransposeTranspose's
            source = chain[0].inputs[0]
            assert source is not None
            layout = follow(ctx, source, chain)
            if isinstance(layout, str):
                stats.decline(layout, node_label(end))
                continue
            if layout is None:
                continue  # a step not proven to move whole pieces
            if (perm := layout.as_transpose()) is not None:
                if perm == sorted(perm):
                    built = ir.node("Identity", [source])
                else:
                    built = ir.node("Transpose", [source], attributes={"perm": perm})
            elif (target := layout.as_reshape()) is not None:
                name = f"{self.spec.name}/{node_label(end)}/shape"
                shape = new_constant(graph, name, np.array(target, np.int64))
                built = ir.node("Reshape", [source, shape])
            else:
                continue  # pieces of axes interleaved (a head split): no single op
            typed(built.outputs[0], ctx.dtype(end.outputs[0]), ctx.shape(end.outputs[0]))
            replace_subgraph(ctx, "LayoutChain", end, chain, [built], end.outputs, built.outputs)
