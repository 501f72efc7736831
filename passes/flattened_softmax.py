"""A softmax over the last axis, written around a Flatten to 2-D, is the softmax of that axis.

Before opset 13 Softmax, LogSoftmax and Hardmax coerced their input to 2-D at ``axis``; from 13
they work on the one axis. onnx's version converter keeps the old meaning when it upgrades a
model past 12: ``Reshape(Softmax(Flatten(x, axis=a), axis=-1), Shape(x))``. Where ``a`` is x's
last axis, the Flatten makes ``[rows, last]`` and the softmax runs along the last axis of each
row, which is ``Softmax(x, axis=-1)``; the Reshape gives x's shape back. Exact: the same sums
over the same elements. The attention passes read the scores' softmax then (an eager BERT,
GPT-J, Bloom or LLaMA exported at opset 11 and upgraded: attention 0/2 -> 2/2).

A Flatten that keeps more than the last axis in its rows' second part is a softmax over
several axes, which no single op of opset 13 computes: left, with the reason.
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import DEFAULT_DOMAINS, node_label, producer_of, replace_subgraph, typed
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

# The ops whose axis meaning changed at opset 13 (the version converter's adapter for each).
_COERCING = ("Softmax", "LogSoftmax", "Hardmax")
# From this opset they work on one axis.
_ONE_AXIS_OPSET = 13


@register_pass
class FlattenedSoftmaxCanonicalizationPass(FusionPass):
    """Not a pattern: each softmax that reads a Flatten is judged alone."""

    spec = PassSpec(
        name="FlattenedSoftmaxCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: Reshape(Softmax(Flatten(x, last axis), -1), Shape(x)) -> "
        "Softmax(x, -1), LogSoftmax and Hardmax alike (onnx's version converter writes every "
        "softmax of a model upgraded from below opset 13 so)",
        aliases=("flattened_softmax_canonicalization",),
        priority=3014,  # with the eliminations, before any fusion reads a softmax
        min_opset=_ONE_AXIS_OPSET,
        emits=_COERCING,
        canonical=True,
    )
    counts_changes = True
    pattern = "FlattenedSoftmax"

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        if ctx.opset < _ONE_AXIS_OPSET:
            return  # the ops coerce to 2-D themselves: nothing was written around them
        graph = model.graph
        stats = ctx.pattern(self.pattern)
        for op in _COERCING:
            for node in ctx.op_index.of_type(graph, op):
                if node.graph is graph and node.domain in DEFAULT_DOMAINS:
                    reason = self._judge(ctx, node)
                    if reason is not None:
                        stats.decline(reason, node_label(node))

    def _judge(self, ctx: PassContext, softmax: ir.Node) -> str | None:
        """Rewrite a softmax written around a Flatten of x's last axis; why not where it
        nearly is (a Flatten feeds it); None where no Flatten does."""
        flatten = producer_of(softmax.inputs[0], "Flatten")
        if flatten is None or flatten.domain not in DEFAULT_DOMAINS or flatten.inputs[0] is None:
            return None
        x = flatten.inputs[0]
        shape = ctx.shape(x)
        if shape is None:
            return "the flattened tensor's rank is unknown"
        rank = len(shape)
        axis = flatten.attributes.get_int("axis", 1)
        if rank < 2 or (axis + rank if axis < 0 else axis) != rank - 1:
            return "the Flatten keeps more than the last axis in a row: a softmax over several axes"
        if softmax.attributes.get_int("axis", -1) not in (1, -1):
            return "the softmax is not along the flattened rows"
        readers = [reader for reader, _ in softmax.outputs[0].uses()]
        back = readers[0] if len(readers) == 1 else None
        target = producer_of(back.inputs[1], "Shape") if back is not None else None
        if (
            back is None
            or back.op_type != "Reshape"
            or back.domain not in DEFAULT_DOMAINS
            or softmax.outputs[0].is_graph_output()
            or target is None
            or target.inputs[0] is not x
            or not _whole_shape(target, rank)
        ):
            return "the softmax's result is not viewed back to the flattened tensor's shape"
        direct = ir.node(softmax.op_type, [x], attributes={"axis": -1})
        typed(direct.outputs[0], ctx.dtype(x), shape)
        # The Flatten and the Shape go with the softmax where nothing else reads them.
        old = [node for node in (flatten, target) if len(list(node.outputs[0].uses())) == 1]
        old += [softmax, back]
        outputs = [back.outputs[0]]
        replace_subgraph(ctx, self.pattern, softmax, old, [direct], outputs, direct.outputs)
        return None


def _whole_shape(shape: ir.Node, rank: int) -> bool:
    """Whether Shape(x, start, end) reads every one of x's ``rank`` sizes (negative bounds
    count from the end, bounds past it are clamped)."""

    def bound(name: str, default: int) -> int:
        value = shape.attributes.get_int(name, default)
        return min(max(value + rank if value < 0 else value, 0), rank)

    return bound("start", 0) == 0 and bound("end", rank) == rank
