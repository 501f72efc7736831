"""The standard RotaryEmbedding's per-token operands spread to the batch and sequence of x.

ONNX's RotaryEmbedding (opset 23) takes, per token, either cos/sin caches
``[batch, sequence, rotary_dim / 2]`` or ``position_ids [batch, sequence]`` into 2-D caches.
Its function body multiplies x by them, so a cache of batch 1 (or position ids of batch 1)
broadcasts and the reference implementation runs it. onnxruntime's kernel does not broadcast:
it rejects any size that is not x's ("expected to have the same shape as input 'x'"). The
dynamo exporter at opset 23 writes LLaMA-style rotary exactly so: the positions are
``arange(sequence)[None]``, so its caches are ``[1, sequence, d]`` and the export fails in
onnxruntime at any batch above 1.

Spreading the operand with ``Expand`` to x's batch and sequence is what broadcasting does, and
Expand fails on exactly the sizes broadcasting fails on, so the result is the op's own at every
input, in the shape its kernel takes. Only the sizes not provably x's are spread (the target
has 1 elsewhere). Each size is read from the graph input of its name (else its farthest copy),
so every layer reads one target, and operands computing the same (the exporter computes a Cos
and a Sin per RotaryEmbedding node) share one Expand.
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.axes import same_dim, size_sources
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import DEFAULT_DOMAINS, computation_key, node_label, typed
from fusectl.rewrite.registry import Category, NodeByNodePass, PassSpec, register_pass
from fusectl.rewrite.size_reads import Part, named_input_axis, shape_nodes

# RotaryEmbedding's inputs: x, cos_cache, sin_cache, position_ids.
_COS, _SIN, _POSITIONS = 1, 2, 3
# Where x keeps its batch and sequence: [B, S, hidden] or [B, N, S, H].
_TOKEN_AXES = {3: (0, 1), 4: (0, 2)}


@register_pass
class RotaryOperandExpandCanonicalizationPass(NodeByNodePass):
    """Not a pattern: each standard RotaryEmbedding is judged on its operands' sizes."""

    spec = PassSpec(
        name="RotaryOperandExpandCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: the standard RotaryEmbedding's cos/sin caches (or position "
        "ids) of batch or sequence 1 -> an Expand to x's, as the op's definition broadcasts "
        "them; onnxruntime's kernel takes only full sizes (the dynamo exporter's opset-23 "
        "rotary, whose caches have batch 1, otherwise fails at any batch above 1)",
        aliases=("rotary_operand_expand_canonicalization",),
        priority=3049,  # after the canonicalizations that fold the caches' arithmetic
        min_opset=23,  # RotaryEmbedding
        emits=("Expand",),
        canonical=True,
    )
    counts_changes = True
    anchor, pattern = "RotaryEmbedding", "RotaryOperandExpand"

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        # Per run: each spread by what it spreads and to what, each target by its sizes.
        self._spread: dict[tuple, ir.Value] = {}
        self._targets: dict[tuple, ir.Value] = {}
        super().run(model, ctx)

    def judge(self, ctx: PassContext, rotary: ir.Node) -> str | None:
        """Spread the operands of ``rotary`` whose batch or sequence may be 1 where x's is not;
        None where they are x's already (or it is not the standard op)."""
        if (
            rotary.domain not in DEFAULT_DOMAINS
            or len(rotary.inputs) < 3
            or None in (rotary.inputs[0], rotary.inputs[_COS], rotary.inputs[_SIN])
        ):
            return None
        x = rotary.inputs[0]
        shape = ctx.shape(x)  # type: ignore[arg-type]
        if shape is None or len(shape) not in _TOKEN_AXES:
            return "x's rank is unknown or not 3 or 4: its batch and sequence axes are not known"
        positions = rotary.inputs[_POSITIONS] if len(rotary.inputs) > _POSITIONS else None
        slots = [_POSITIONS] if positions is not None else [_COS, _SIN]
        rank = 2 if positions is not None else 3
        if any(ctx.rank(rotary.inputs[slot]) not in (rank, None) for slot in slots):
            return None  # not the op's form: onnxruntime says so itself
        graph: ir.Graph = rotary.graph  # type: ignore[assignment]
        parts = self._sizes(ctx, graph, x, shape, rotary.inputs[slots[0]], rank)  # type: ignore[arg-type]
        if parts is None:
            return None  # x's batch and sequence already
        if not ctx.may_rewrite(self.pattern, node_label(rotary)):
            return None
        made: list[ir.Node] = []
        sizes = tuple(_key(part) for part in parts)
        target = self._targets.get(sizes)
        if target is None:
            built = shape_nodes(ctx, graph, f"{node_label(rotary)}/spread", parts)
            made += built
            target = self._targets[sizes] = built[-1].outputs[0]
        for slot in slots:
            operand: ir.Value = rotary.inputs[slot]  # type: ignore[assignment]
            # The exporter computes each layer's cache again (one Cos per layer): one spread
            # serves every operand computing the same, and the repeats go unread.
            producer = operand.producer()
            computes = computation_key(producer) if producer is not None else None
            key = (computes if computes is not None else id(operand), operand.index(), sizes)
            spread = self._spread.get(key)
            if spread is None:
                expand = ir.node("Expand", [operand, target])
                spread_shape = [shape[axis] for axis in _TOKEN_AXES[len(shape)]]
                if rank == 3:  # a cache keeps its last axis
                    known = ctx.shape(operand)
                    spread_shape.append(known[2] if known is not None else None)
                typed(expand.outputs[0], ctx.dtype(operand), ir.Shape(spread_shape))
                made.append(expand)
                spread = self._spread[key] = expand.outputs[0]
            rotary.replace_input_with(slot, spread)
        graph.insert_before(rotary, made)
        ctx.record_fusion(self.pattern, [rotary], [*made, rotary])
        return None

    @staticmethod
    def _sizes(
        ctx: PassContext,
        graph: ir.Graph,
        x: ir.Value,
        shape: ir.Shape,
        operand: ir.Value,
        rank: int,
    ) -> list[Part] | None:
        """The Expand target spreading ``operand``'s leading two sizes to x's batch and
        sequence (1 where they are provably x's already, and on a cache's last axis); None
        where both are."""
        known = ctx.shape(operand)
        parts: list[Part] = []
        for position, axis in enumerate(_TOKEN_AXES[len(shape)]):
            if known is not None and same_dim(known[position], shape[axis]):
                parts.append(1)
            elif isinstance(shape[axis], int):
                parts.append(shape[axis])  # type: ignore[arg-type]
            else:  # shared by every layer: the graph input of that name, else the farthest copy
                given = named_input_axis(ctx, x, axis, lambda: list(graph.inputs))
                parts.append(given or size_sources(ctx, x, axis)[-1])
        if parts == [1, 1]:
            return None
        return parts + [1] * (rank - 2)


def _key(part: Part) -> object:
    """A part as a dictionary key: values by identity."""
    return (id(part[0]), part[1]) if isinstance(part, tuple) else part
