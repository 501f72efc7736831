"""Reshape / Transpose chains that only move whole axes: one Transpose, one Reshape, or none;
a head split (a Reshape, then a Transpose) where that is fewer ops.

A chain like Reshape([B, C, S] -> [B, N, H, S]) -> Transpose([0, 3, 1, 2]) -> Reshape(->
[B, S, C]) is Transpose(x, [0, 2, 1]): the split heads travel together and are merged back.
What a chain computes is read off where the source's elements end up
(``fusectl.rewrite.layout``), not off how its ops are spelled.

Such chains are left where a fused op meets the graph's own layout (the heads a fused attention
reads or returns, merged or split back by the lowering next to the exporter's split), so the
fusion pass runs after the fusions. Chains of three ops or more are canonicalized before the
fusions too (LayoutChainCanonicalizationPass): dynamo writes a matmul of repeated KV heads as
a fold to [B*N, L, H], a 3-D transpose and an unfold, which is the head layout the attention
passes read, K^T, once written as a Reshape and a Transpose. Chains of Reshapes alone or
Transposes alone are ReshapeReshapeFusionPass's and TransposeTransposeFusionPass's, each with
its own switch; those graph passes run before the fusions, so the late pass takes such a chain
where a pass wrote one of its ops (XLNet's key, transposed for the scores and again for the
fused attention).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import LINEAGE_PASSES, PassContext
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    new_constant,
    node_label,
    remove_dead,
    replace_subgraph,
    typed,
)
from fusectl.rewrite.layout import Layout, follow
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

_LAYOUT_OPS = ("Reshape", "Transpose")


def _inner(node: ir.Node) -> bool:
    """Whether the node's result is read by one Reshape or Transpose and nothing else."""
    result = node.outputs[0]
    uses = result.uses()
    if result.is_graph_output() or len(uses) != 1:
        return False
    consumer, index = uses[0]
    return index == 0 and consumer.op_type in _LAYOUT_OPS and consumer.domain in DEFAULT_DOMAINS


def _chain(end: ir.Node) -> list[ir.Node]:
    chain = [end]
    while True:
        source = chain[0].inputs[0]
        producer = source.producer() if source is not None else None
        if (
            producer is None
            or producer.op_type not in _LAYOUT_OPS
            or producer.domain not in DEFAULT_DOMAINS
            or producer.graph is not end.graph
            or not _inner(producer)
        ):
            return chain
        chain.insert(0, producer)


def _layout_ops(
    ctx: PassContext, name: str, end: ir.Node, source: ir.Value, layout: Layout, steps: int
) -> list[ir.Node] | None:
    """The fewest ops computing ``layout`` of ``source``: an Identity, one Transpose, one
    Reshape, or (for a chain of ``steps`` >= 3 ops) a Reshape then a Transpose; None when
    that is not fewer than the chain."""
    graph = end.graph
    assert graph is not None
    if (perm := layout.as_transpose()) is not None:
        if perm == sorted(perm):
            return [ir.node("Identity", [source])]
        return [ir.node("Transpose", [source], attributes={"perm": perm})]
    if (target := layout.as_reshape()) is not None:
        shape = new_constant(graph, f"{name}/{node_label(end)}/shape", np.array(target, np.int64))
        return [ir.node("Reshape", [source, shape])]
    split = layout.as_reshape_transpose() if steps >= 3 else None
    if split is None:
        return None  # pieces of axes interleaved: more than a head split
    target, perm = split
    shape = new_constant(graph, f"{name}/{node_label(end)}/shape", np.array(target, np.int64))
    grouped = ir.node("Reshape", [source, shape])
    typed(grouped.outputs[0], ctx.dtype(end.outputs[0]), None)
    return [grouped, ir.node("Transpose", grouped.outputs, attributes={"perm": perm})]


def _collapse(
    ctx: PassContext, name: str, pattern: str, end: ir.Node, shortest: int, late: bool
) -> None:
    """Rewrite the Reshape/Transpose chain ending at ``end`` (``shortest`` ops or more) into
    the fewest ops computing it. A chain of one op type is ReshapeReshape's or
    TransposeTranspose's, graph passes that run before the fusions: ``late``, after them, it
    is taken here where a pass wrote one of its ops (a fused op's layout next to the graph's
    own), and a chain it cannot read is a near miss."""
    chain = _chain(end)
    written = late and any(LINEAGE_PASSES in node.metadata_props for node in chain)
    if len(chain) < shortest or (len({node.op_type for node in chain}) < 2 and not written):
        return
    source = chain[0].inputs[0]
    assert source is not None
    layout = follow(ctx, source, chain)
    if isinstance(layout, str):
        if late:
            ctx.pattern(pattern).decline(layout, node_label(end))
        return
    built = None if layout is None else _layout_ops(ctx, name, end, source, layout, len(chain))
    if built is None:
        return  # a step not proven to move whole pieces, or no fewer ops
    typed(built[-1].outputs[0], ctx.dtype(end.outputs[0]), ctx.shape(end.outputs[0]))
    graph = end.graph
    assert graph is not None
    targets = [node.inputs[1] for node in chain if node.op_type == "Reshape"]
    if replace_subgraph(ctx, pattern, end, chain, built, end.outputs, built[-1].outputs) is None:
        # the targets' shape arithmetic goes too: a Shape left reading a value the chain read
        # would keep a later fusion from taking it
        remove_dead(graph, [target.producer() for target in targets if target is not None])


def _ends(ctx: PassContext, graph: ir.Graph) -> list[ir.Node]:
    return [
        node
        for op_type in _LAYOUT_OPS
        for node in ctx.op_index.of_type(graph, op_type, DEFAULT_DOMAINS)
        if node.graph is graph and not _inner(node)
    ]


@register_pass
class LayoutChainCanonicalizationPass(FusionPass):
    spec = PassSpec(
        name="LayoutChainCanonicalizationPass",
        category=Category.GRAPH,
        description="a chain of three or more Reshapes and Transposes that only moves whole "
        "axes -> the head split it is (a Reshape, then a Transpose) or one op, before the "
        "fusions read it (dynamo's batched matmul of repeated KV heads: fold, transpose, "
        "unfold)",
        aliases=("layout_chain_canonicalization",),
        priority=3038,
        emits=("Reshape", "Transpose"),
        canonical=True,
        every_layer=False,  # where a chain is, not a computation every layer has
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for end in _ends(ctx, model.graph):
            if end.graph is model.graph:
                # the late pass reports what it cannot read, once
                _collapse(ctx, self.spec.name, "LayoutChain", end, shortest=3, late=False)
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()


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
        again_after_fusions=True,  # and on the layout the passes that run again leave
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for end in _ends(ctx, model.graph):
            if end.graph is model.graph:
                _collapse(ctx, self.spec.name, "LayoutChain", end, shortest=2, late=True)
