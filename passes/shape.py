"""Layout clean-up: chains of Reshape, Transpose, Squeeze/Unsqueeze and Cast that collapse,
and pass-through nodes (Identity, inference Dropout) that go away."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    bypass,
    bypass_refusal,
    constant_value,
    lossless,
    node_axes,
    transpose_perm,
)
from fusectl.rewrite.layout import Layout, follow
from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass
from fusectl.rewrite.replacement import register_replacement


def _reshape_reshape(op, x, inner_shape, shape):
    return op.Reshape(op.Reshape(x, inner_shape, _allow_other_attributes=True), shape)


def _outer_target_holds(site: Site, shape: ir.Value) -> bool:
    """Whether the outer target, read from x, gives what it gave from the inner result: a
    constant that copies no dimension (0) of the inner result."""
    target = site.constant(shape)
    allow_zero = site.root.attributes.get_int("allowzero", 0)
    return target is not None and bool(allow_zero or not (target == 0).any())


def _proven_target(site: Site, x: ir.Value, shape: ir.Value) -> np.ndarray | str:
    """Where the outer target does not hold alone: the target the pair's layout proves (its
    sizes traced through a target computed at run time), else why there is none."""
    inner = site.root.inputs[0].producer()
    layout = follow(site.ctx, x, [inner, site.root])
    proven = layout.as_reshape() if isinstance(layout, Layout) else None
    if proven is not None:
        return np.array(proven, np.int64)
    if site.constant(shape) is None:
        return "outer target shape is not a constant"
    return "outer target shape copies a dimension (0) of the inner result"


def _check_outer_shape(site: Site, x: ir.Value, shape: ir.Value, **_: Any) -> str | None:
    """Only the outer shape survives: it must hold on x, or one proven to."""
    if _outer_target_holds(site, shape):
        return None
    proven = _proven_target(site, x, shape)
    return proven if isinstance(proven, str) else None


def _single_reshape(op: Any, site: Site, x: ir.Value, shape: ir.Value, **_: Any) -> ir.Value:
    if _outer_target_holds(site, shape):
        return op.Reshape(x, shape, **dict(site.root.attributes))
    proven = _proven_target(site, x, shape)
    assert not isinstance(proven, str)  # the check accepted it
    # The proven target's 0 copies x's size: never under allowzero, which reads it as empty.
    return op.Reshape(x, site.initializer(op, proven, "shape"))


register_replacement(
    "ReshapeReshapeFusionPass",
    _reshape_reshape,
    _single_reshape,
    extra_check=_check_outer_shape,
    category=Category.GRAPH,
    description="Reshape of a Reshape -> one Reshape to the final shape",
    aliases=("shape_reshape", "ReshapeFusion"),
    min_opset=5,
    emits=("Reshape",),
    pattern_name="ReshapeReshape",
    again_after_fusions=True,
)


def _transpose_transpose(op, x):
    return op.Transpose(op.Transpose(x, _allow_other_attributes=True), _allow_other_attributes=True)


def _compose_transposes(op: Any, site: Site, x: ir.Value) -> ir.Value:
    inner = site.root.inputs[0].producer()
    shape = site.shape(x)
    rank = None if shape is None else len(shape)
    first, second = transpose_perm(inner, rank), transpose_perm(site.root, rank)
    if first is None or second is None:
        raise Decline("a Transpose has no perm and the input rank is unknown")
    combined = [first[axis] for axis in second]
    if combined == sorted(combined):
        return op.Identity(x)
    return op.Transpose(x, perm=combined)


register_replacement(
    "TransposeTransposeFusionPass",
    _transpose_transpose,
    _compose_transposes,
    category=Category.GRAPH,
    description="Transpose of a Transpose -> one Transpose, or nothing when they cancel",
    aliases=("transpose_transpose_fusion", "TransposeOptimizer"),
    emits=("Transpose",),
    pattern_name="TransposeTranspose",
    again_after_fusions=True,
)


def _normalized(axes: list[int], rank: int | None) -> list[int] | None:
    if all(a >= 0 for a in axes):
        return sorted(axes)
    return None if rank is None else sorted(a % rank for a in axes)


def _squeeze_unsqueeze(op, x):
    inner = op.Squeeze(x, _allow_other_inputs=True, _allow_other_attributes=True)
    return op.Unsqueeze(inner, _allow_other_inputs=True, _allow_other_attributes=True)


def _unsqueeze_squeeze(op, x):
    inner = op.Unsqueeze(x, _allow_other_inputs=True, _allow_other_attributes=True)
    return op.Squeeze(inner, _allow_other_inputs=True, _allow_other_attributes=True)


def _cancel_axes(op: Any, site: Site, x: ir.Value) -> ir.Value:
    """Squeeze and Unsqueeze over the same axes undo each other (both index the wider rank)."""
    inner = site.root.inputs[0].producer()
    squeeze = inner if inner.op_type == "Squeeze" else site.root
    inner_axes, outer_axes = node_axes(inner), node_axes(site.root)
    if inner_axes is None or outer_axes is None:
        raise Decline("axes are not constant (or Squeeze has none)")
    wide = site.shape(squeeze.inputs[0])
    rank = None if wide is None else len(wide)
    first, second = _normalized(inner_axes, rank), _normalized(outer_axes, rank)
    if first is None or second is None:
        raise Decline("negative axes and the rank is unknown")
    if first != second:
        raise Decline("Squeeze and Unsqueeze use different axes")
    return op.Identity(x)


@register_pass
class SqueezeUnsqueezeFusionPass(PatternPass):
    spec = PassSpec(
        name="SqueezeUnsqueezeFusionPass",
        category=Category.GRAPH,
        description="Squeeze then Unsqueeze (or the reverse) over the same axes -> removed",
        aliases=("squeeze_unsqueeze_fusion",),
        emits=("Identity",),
    )
    rules = (
        Rule("SqueezeUnsqueeze", _squeeze_unsqueeze, _cancel_axes),
        Rule("UnsqueezeSqueeze", _unsqueeze_squeeze, _cancel_axes),
    )


def _cast_cast(op, x):
    return op.Cast(op.Cast(x, _allow_other_attributes=True), _allow_other_attributes=True)


def _merge_casts(op: Any, site: Site, x: ir.Value) -> ir.Value:
    """Cast(Cast(x, T1), T2) is Cast(x, T2) exactly when T1 loses nothing of x's type."""
    inner = site.root.inputs[0].producer()
    source = site.dtype(x)
    if source is None:
        raise Decline("the element type of the first Cast's input is unknown")
    middle = ir.DataType(inner.attributes.get_int("to"))
    final = ir.DataType(site.root.attributes.get_int("to"))
    if middle != source and not lossless(source, middle):
        raise Decline(f"casting {source.name} to {middle.name} loses values")
    if final == source:
        return op.Identity(x)
    # The outer Cast's other attributes (saturate, for float8) apply unchanged.
    return op.Cast(x, **dict(site.root.attributes))


register_replacement(
    "CastCastFusionPass",
    _cast_cast,
    _merge_casts,
    category=Category.GRAPH,
    description="Cast of a Cast -> one Cast (or none) when the middle type loses nothing",
    aliases=("cast_cast_fusion", "CastChainElimination"),
    emits=("Cast",),
    pattern_name="CastCast",
)


@register_pass
class IdentityEliminationPass(FusionPass):
    """Not a pattern: every Identity, inference Dropout and no-op Cast is a candidate alone."""

    spec = PassSpec(
        name="IdentityEliminationPass",
        category=Category.GRAPH,
        description="Identity, inference-mode Dropout and Casts to the type a value already has "
        "removed",
        aliases=("EliminateIdentity", "EliminateDropout", "dropout_identity_removal"),
        priority=3010,
        canonical=True,
        emits=(),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        if not ctx.op_index.holds(model.graph, _PASS_THROUGH, ("", "ai.onnx")):
            return
        for node in model.graph:
            if node.domain not in ("", "ai.onnx") or node.op_type not in _PASS_THROUGH:
                continue
            if node.op_type == "Cast" and not _is_noop_cast(ctx, node):
                continue
            stats = ctx.pattern(node.op_type)
            site = node.name or node.op_type
            reason = _dropout_is_active(node) if node.op_type == "Dropout" else None
            reason = reason or bypass_refusal(node)
            if reason is not None:
                stats.decline(reason, site)
            elif ctx.may_rewrite(node.op_type, site):
                bypass(node)
                ctx.record_fusion(node.op_type, [node], [])


_PASS_THROUGH = frozenset({"Identity", "Dropout", "Cast"})


def _is_noop_cast(ctx: PassContext, node: ir.Node) -> bool:
    """A Cast to the element type its input already has (exporters' .to(float32) on float32)."""
    source = node.inputs[0]
    dtype = ctx.dtype(source) if source is not None else None
    return dtype is not None and node.attributes.get_int("to", 0) == dtype.value


def _dropout_is_active(node: ir.Node) -> str | None:
    if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
        return "the Dropout mask is used"
    if node.attributes.get_int("is_test", 1) == 0:
        return "Dropout is in training mode (is_test=0)"
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        mode = constant_value(node.inputs[2])
        if mode is None or bool(mode):
            return "Dropout training_mode is not a constant false"
    return None
