"""Shape clean-up: chains of layout ops that collapse into one."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from fusectl.patterns import PatternPass, Rule, Site
from fusectl.registry import Category, PassSpec, register_pass


def _reshape_reshape(op, x, inner_shape, shape):
    return op.Reshape(op.Reshape(x, inner_shape, _allow_other_attributes=True), shape)


def _check_outer_shape(site: Site, shape: ir.Value, **_: Any) -> str | None:
    """Only the outer shape survives; a 0 in it copies a dimension of the inner result."""
    target = site.constant(shape)
    if target is None:
        return "outer target shape is not a constant"
    allow_zero = site.root.attributes.get_int("allowzero", 0)
    if not allow_zero and (target == 0).any():
        return "outer target shape copies a dimension (0) of the inner result"
    return None


def _single_reshape(op: Any, site: Site, x: ir.Value, shape: ir.Value, **_: Any) -> ir.Value:
    return op.Reshape(x, shape, **dict(site.root.attributes))


@register_pass
class ReshapeReshapeFusionPass(PatternPass):
    spec = PassSpec(
        name="ReshapeReshapeFusionPass",
        category=Category.GRAPH,
        description="Reshape of a Reshape -> one Reshape to the final shape",
        aliases=("shape_reshape", "ReshapeFusion"),
        min_opset=5,
        emits=("Reshape",),
    )
    rules = (Rule("ReshapeReshape", _reshape_reshape, _single_reshape, _check_outer_shape),)
