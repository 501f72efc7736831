"""Projection biases taken into the fused attention.

MultiHeadAttention adds the Q/K/V projection biases itself (its ``bias`` input, [Dq + Dk +
Dv]), so ``Add(x @ W, b)`` in front of its query, key or value is one node the graph need
not keep. The attention lowering reads the projections as the graph wrote them; this stage
runs after it, on every MultiHeadAttention (cross-attention's separate projections above all:
self-attention with one input takes the packed-QKV Attention, bias included).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_value, new_constant, node_label, replace_subgraph
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass

MS = "com.microsoft"
_BIAS_INPUT = 3  # query, key, value, bias, ...


def _hidden(ctx: PassContext, value: ir.Value) -> int | str:
    """The last axis of a 3-D [batch, sequence, hidden] operand, or why it is not one."""
    shape = ctx.shape(value)
    if shape is None or len(shape) != 3:
        return "the key and value are not 3-D (heads or a cache): the op adds no bias to them"
    if not isinstance(shape[2], int):
        return "an operand's hidden size is not static"
    return shape[2]


def _biased(
    ctx: PassContext, value: ir.Value, hidden: int
) -> tuple[ir.Node, ir.Value, np.ndarray] | None:
    """``value`` = Add(x, b) (either order) with a constant b of [hidden] read by nothing but
    the attention: the Add, x and b."""
    add = value.producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return None
    if value.is_graph_output() or len(value.uses()) != 1:
        return None
    for data, bias in (add.inputs, reversed(add.inputs)):
        array = constant_value(bias)
        if data is None or array is None or array.shape != (hidden,):
            continue
        shape = ctx.shape(data)
        if shape is not None and len(shape) == 3 and shape[2] == hidden:
            return add, data, array
    return None


@register_pass
class MultiHeadAttentionBiasFusionPass(FusionPass):
    spec = PassSpec(
        name="MultiHeadAttentionBiasFusionPass",
        category=Category.UB,
        description="Add(x @ W, b) in front of a MultiHeadAttention's query, key or value -> "
        "the op's bias input (cross-attention projections)",
        aliases=("mha_bias_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=4510,  # after MultiHeadAttentionFusionPass has lowered the attention
        targets=("ort",),
        emits=("MultiHeadAttention",),
        emits_domain=MS,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("MultiHeadAttentionBias")
        for attention in ctx.op_index.of_type(model.graph, "MultiHeadAttention", (MS,)):
            inputs = list(attention.inputs)
            if len(inputs) < 3 or any(v is None for v in inputs[:3]):
                continue  # packed QKV in the query: its bias is the projection's
            if len(inputs) > _BIAS_INPUT and inputs[_BIAS_INPUT] is not None:
                continue
            operands = [v for v in inputs[:3] if v is not None]
            hidden = [_hidden(ctx, v) for v in operands]
            biased = [
                _biased(ctx, v, size) if isinstance(size, int) else None
                for v, size in zip(operands, hidden, strict=True)
            ]
            if not any(biased):
                continue
            reason = next((size for size in hidden if isinstance(size, str)), None)
            if reason is not None:
                stats.decline(reason, node_label(attention))
                continue
            # Add reads one element type: every bias found is the attention's.
            dtype = next(found[2].dtype for found in biased if found)
            parts = [
                found[2] if found else np.zeros(size, dtype)
                for found, size in zip(biased, hidden, strict=True)
                if isinstance(size, int)
            ]
            graph = attention.graph
            assert graph is not None
            bias = new_constant(
                graph, f"{self.spec.name}/{node_label(attention)}/bias", np.concatenate(parts)
            )
            operands = [found[1] if found else v for found, v in zip(biased, operands, strict=True)]
            rest = inputs[_BIAS_INPUT + 1 :]
            fused = ir.node(
                "MultiHeadAttention",
                [*operands, bias, *rest],
                attributes=dict(attention.attributes),
                domain=MS,
                num_outputs=len(attention.outputs),
            )
            adds = [found[0] for found in biased if found]
            replace_subgraph(
                ctx,
                "MultiHeadAttentionBias",
                attention,
                [attention, *adds],
                [fused],
                attention.outputs,
                fused.outputs,
            )
