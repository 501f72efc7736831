"""Activations spelled out as elementary ops, recognised and replaced by the ONNX op."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from fusectl.rewrite.graph import node_axes
from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import Category, Numerics, PassSpec, register_pass


def _single_axis(site: Site, node: ir.Node, rank: int | None) -> int:
    if node.attributes.get_int("keepdims", 1) != 1:
        raise Decline(f"{node.op_type} does not keep dims")
    axes = node_axes(node)
    if axes is None or len(axes) != 1:
        raise Decline(f"{node.op_type} does not reduce exactly one constant axis")
    axis = axes[0]
    if axis < 0:
        if rank is None:
            raise Decline("negative axis and the rank is unknown")
        axis += rank
    return axis


def _softmax(op, x):
    exp = op.Exp(x)
    return op.Div(exp, op.ReduceSum(exp, _allow_other_inputs=True, _allow_other_attributes=True))


def _stable_softmax(op, x):
    peak = op.ReduceMax(x, _allow_other_inputs=True, _allow_other_attributes=True)
    return _softmax(op, op.Sub(x, peak))


def _to_softmax(op: Any, site: Site, x: ir.Value) -> ir.Value:
    shape = site.shape(x)
    rank = None if shape is None else len(shape)
    reductions = [n for n in site.nodes if n.op_type in ("ReduceSum", "ReduceMax")]
    axes = {_single_axis(site, node, rank) for node in reductions}
    if len(axes) != 1:
        raise Decline("ReduceMax and ReduceSum use different axes")
    (axis,) = axes
    # Before opset 13 Softmax normalises over all axes from `axis` on, which is the same
    # thing only for the last axis.
    if site.ctx.opset < 13 and (rank is None or axis != rank - 1):
        raise Decline("below opset 13 Softmax equals this only on the last axis")
    return op.Softmax(x, axis=axis)


@register_pass
class SoftmaxFusionPass(PatternPass):
    spec = PassSpec(
        name="SoftmaxFusionPass",
        category=Category.GRAPH,
        description="Exp / ReduceSum(Exp) softmax, with or without the max subtraction -> Softmax",
        aliases=("softmax_fusion",),
        numerics=Numerics.REASSOCIATING,
        emits=("Softmax",),
    )
    rules = (
        Rule("StableSoftmax", _stable_softmax, _to_softmax, commute=False),
        Rule("Softmax", _softmax, _to_softmax, commute=False),
    )
