"""Split / Concat: splits undone by a concat, nested concats flattened, and the Ascend
FusionVirtualOpSetSwitch marking of batch-axis splits."""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import DEFAULT_DOMAINS, replace_subgraph, uses_outside
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass


def _is_default_domain(node: ir.Node) -> bool:
    return node.domain in DEFAULT_DOMAINS


def _axis(ctx: PassContext, node: ir.Node, attribute: str, default: int | None) -> int | None:
    """The node's axis, made non-negative with the rank of its first input when needed."""
    axis = node.attributes.get_int(attribute, default)
    if axis is None or axis >= 0:
        return axis
    shape = ctx.shape(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None
    return None if shape is None else axis + len(shape)


def _label(node: ir.Node) -> str:
    return node.name or node.outputs[0].name or node.op_type


@register_pass
class SplitConcatFusionPass(FusionPass):
    """A Concat of every output of one Split, in order, on the split axis is its input."""

    spec = PassSpec(
        name="SplitConcatFusionPass",
        category=Category.GRAPH,
        description="Split whose outputs all feed one Concat, in order, on the same axis -> "
        "removed",
        aliases=("split_concat_fusion",),
        emits=("Identity",),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("SplitConcat")
        for concat in ctx.op_index.of_type(model.graph, "Concat", DEFAULT_DOMAINS):
            if concat.graph is not model.graph:
                continue
            split = concat.inputs[0].producer() if concat.inputs[0] is not None else None
            if split is None or split.op_type != "Split" or not _is_default_domain(split):
                continue
            if list(concat.inputs) != list(split.outputs):
                continue  # not this pattern: the Concat takes other values too, or reorders
            reason = None
            split_axis, concat_axis = _axis(ctx, split, "axis", 0), _axis(ctx, concat, "axis", None)
            if split_axis is None or concat_axis is None:
                reason = "negative axis and the rank is unknown"
            elif split_axis != concat_axis:
                reason = "Split and Concat use different axes"
            else:
                reason = uses_outside([split, concat], concat.outputs)
            if reason is not None:
                stats.decline(reason, _label(concat))
                continue
            identity = ir.node("Identity", [split.inputs[0]])
            replace_subgraph(
                ctx,
                "SplitConcat",
                concat,
                [concat, split],
                [identity],
                concat.outputs,
                identity.outputs,
            )


@register_pass
class ZConcatv2dFusionPass(FusionPass):
    """Concat inputs that are themselves Concats on the same axis are spliced in."""

    spec = PassSpec(
        name="ZConcatv2dFusionPass",
        category=Category.GRAPH,
        description="Nested Concat on the same axis -> one flat Concat",
        aliases=("concat_concat_fusion",),
        priority=5900,
        emits=("Concat",),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("ConcatConcat")
        created: set[ir.Node] = set()
        for outer in ctx.op_index.of_type(model.graph, "Concat", DEFAULT_DOMAINS):
            if outer.graph is not model.graph or outer in created:
                continue
            inner_nodes = {
                producer: None
                for value in outer.inputs
                if value is not None
                and (producer := value.producer()) is not None
                and producer.op_type == "Concat"
                and _is_default_domain(producer)
            }
            if not inner_nodes:
                continue
            axis = _axis(ctx, outer, "axis", None)
            reasons = {inner: _splice_reason(ctx, inner, axis) for inner in inner_nodes}
            spliced = [inner for inner, reason in reasons.items() if reason is None]
            if not spliced:
                stats.decline(next(iter(reasons.values())) or "", _label(outer))
                continue
            inputs: list[ir.Value | None] = []
            for value in outer.inputs:
                producer = value.producer() if value is not None else None
                inputs.extend(producer.inputs if producer in spliced else [value])
            flat = ir.node("Concat", inputs, attributes={"axis": axis})
            created.add(flat)
            replace_subgraph(
                ctx,
                "ConcatConcat",
                outer,
                [outer, *spliced],
                [flat],
                outer.outputs,
                flat.outputs,
            )


def _splice_reason(ctx: PassContext, inner: ir.Node, axis: int | None) -> str | None:
    """Why an inner Concat cannot be spliced into its consumer, if it cannot."""
    inner_axis = _axis(ctx, inner, "axis", None)
    if axis is None or inner_axis is None:
        return "negative axis and the rank is unknown"
    if inner_axis != axis:
        return "inner Concat uses another axis"
    value = inner.outputs[0]
    if value.is_graph_output():
        return "inner Concat output is a graph output"
    if len(value.uses()) != 1:
        return "inner Concat output has other consumers"
    return None


NO_TASK = "_no_task"


@register_pass
class FusionVirtualOpSetSwitch(FusionPass):
    """Ascend's split_n / split_c_to_n marking, as node metadata: a runtime that lays the
    split's outputs out in place can skip the kernel. Never in fusion_result.json."""

    spec = PassSpec(
        name="FusionVirtualOpSetSwitch",
        category=Category.UB,
        description="Splits along the batch axis (or channels with batch 1) tagged _no_task "
        "in node metadata; metadata only",
        counted=False,
        emits=(),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("SplitVirtualOp")
        for split in ctx.op_index.of_type(model.graph, "Split", DEFAULT_DOMAINS):
            if NO_TASK in split.metadata_props:
                continue
            reason = _virtual_split_reason(ctx, split)
            if reason is not None:
                stats.decline(reason, _label(split))
            elif ctx.may_rewrite("SplitVirtualOp", _label(split)):
                split.metadata_props[NO_TASK] = "1"
                ctx.record_fusion("SplitVirtualOp", [split], [])


def _virtual_split_reason(ctx: PassContext, split: ir.Node) -> str | None:
    """The seed's constraints, in ONNX terms; None when the split may be marked."""
    source = split.inputs[0]
    shape = ctx.shape(source) if source is not None else None
    if shape is None or not all(isinstance(d, int) for d in shape):
        return "dynamic shape"
    axis = _axis(ctx, split, "axis", 0)
    if not (axis == 0 or (axis == 1 and len(shape) >= 2 and shape[0] == 1)):
        return "split axis is neither the batch axis nor channels with batch 1"
    producer = source.producer()
    if source.is_initializer() or (producer is not None and producer.op_type == "Constant"):
        return "the input is a constant"
    if producer is not None and NO_TASK in producer.metadata_props:
        return "the input's producer is already _no_task"
    reshaped = (
        producer.inputs[0] if producer is not None and producer.op_type == "Reshape" else None
    )
    if reshaped is not None and reshaped.is_graph_input():
        return "graph input -> Reshape -> Split"
    for value in split.outputs:
        if value.is_graph_output():
            return "an output is a graph output"
        for consumer, _ in value.uses():
            if consumer.op_type == "Split":
                return "an output feeds another Split"
            if NO_TASK in consumer.metadata_props:
                return "an output feeds a _no_task node"
    return None
