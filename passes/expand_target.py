"""An Expand target read at run time from sizes its input already has is a constant.

Expand broadcasts: where the target's size equals the input's size on the aligned axis, a 1
there gives the same output. Exporters that build the target from another tensor's shape
(jax2onnx's ``jnp.repeat`` of key/value heads reads the batch from the key for the value's
repeat: ``Expand(v, Concat(Gather(Shape(k_repeated), 0), consts))``) leave a Shape reader on a
value a fusion must own alone. Written as a constant, the read goes, and with it the reason a
fusion declines; an Expand whose constant target changes nothing is the input itself.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import read_size, same_dimension, same_traced_size, target_parts
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    bypass,
    bypass_refusal,
    constant_value,
    new_constant,
    node_label,
    remove_dead,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass
from fusectl.rewrite.shapes import keep_proven_dims, named


def _constant_target(ctx: PassContext, expand: ir.Node) -> np.ndarray | str | None:
    """The run-time target of this Expand as a constant: a static size its value, a size the
    input has on the aligned axis (read from that axis, or named alike) 1; why not when such
    a size is not proven the input's; None when the target is not built from constants and
    sizes read with Shape, or the Expand spreads the input along a read size (an axis the
    input lacks or has as 1: a mask spread to the scores' shape)."""
    data, target = expand.inputs[0], expand.inputs[1]
    source = ctx.shape(data) if data is not None else None
    parts = target_parts(ctx, target) if target is not None else None
    if data is None or source is None or parts is None:
        return None
    offset = len(source) - len(parts)  # the target aligns with the input's trailing axes
    resolved: list[int] = []
    for position, part in enumerate(parts):
        if isinstance(part, int):
            resolved.append(part)
            continue
        size = read_size(ctx, part)
        aligned = position + offset
        if isinstance(size, int):
            resolved.append(size)
        elif aligned < 0 or source[aligned] == 1:
            return None
        elif same_dimension(part, size, data, aligned, source) or same_traced_size(
            ctx, part, data, aligned
        ):
            resolved.append(1)
        else:
            return "a size of the target is read from another tensor, not proven the input's"
    return np.array(resolved, dtype=np.int64)


def _proven_dims(source: ir.Shape, target: np.ndarray) -> list[int | ir.SymbolicDim | None]:
    """The Expand's output sizes the constant target proves: the input's where the target is
    1, the target's elsewhere; None where that is a name inference made up."""
    rank = max(len(source), len(target))
    dims: list[int | ir.SymbolicDim | None] = []
    for axis in range(rank):
        mine = source[axis - rank + len(source)] if axis >= rank - len(source) else 1
        spread = int(target[axis - rank + len(target)]) if axis >= rank - len(target) else 1
        new = mine if spread == 1 else spread
        dims.append(new if isinstance(new, int) or named(new) else None)
    return dims


def _keeps_shape(source: ir.Shape, target: np.ndarray) -> bool:
    """Whether expanding to ``target`` leaves a tensor of shape ``source`` as it is: no new
    axis, each size 1 or the one it has."""
    offset = len(source) - len(target)
    return offset >= 0 and all(
        size == 1 or size == source[position + offset] for position, size in enumerate(target)
    )


@register_pass
class ExpandTargetCanonicalizationPass(FusionPass):
    """Not a pattern: each Expand whose target is computed at run time is judged alone."""

    spec = PassSpec(
        name="ExpandTargetCanonicalizationPass",
        category=Category.GRAPH,
        description="Expand targets computed from Shape -> Gather -> Concat at run time -> "
        "constant targets, with 1 for a size the input has on that axis (jax2onnx's repeat of "
        "the value heads, sized by the key's); an Expand that then changes nothing is removed",
        aliases=("ExpandShapeFolding",),
        priority=3034,  # after ShapeRunCanonicalizationPass's Expand(x, Shape(x)) -> x
        emits=("Expand",),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        for expand in ctx.op_index.of_type(graph, "Expand"):
            if expand.graph is not graph or expand.domain not in DEFAULT_DOMAINS:
                continue
            if len(expand.inputs) < 2 or constant_value(expand.inputs[1]) is not None:
                continue
            found = _constant_target(ctx, expand)
            if found is None:
                continue
            site = node_label(expand)
            if isinstance(found, str):
                ctx.pattern("ExpandTarget").decline(found, site)
                continue
            unit = _keeps_shape(ctx.shape(expand.inputs[0]), found)  # type: ignore[arg-type]
            if unit and bypass_refusal(expand) is not None:
                unit = False
            if not ctx.may_rewrite("ExpandTarget", site):
                continue
            ctx.pattern("ExpandTarget").settle(site)
            computed = expand.inputs[1]
            if unit:
                bypass(expand)
                ctx.record_fusion("ExpandTarget", [expand], [])
            else:
                constant = new_constant(graph, f"{ctx.spec.name}/{site}/shape", found)
                expand.replace_input_with(1, constant)
                source = ctx.shape(expand.inputs[0])
                keep_proven_dims(expand.outputs[0], _proven_dims(source, found))  # type: ignore[arg-type]
                ctx.record_fusion("ExpandTarget", [expand], [expand])
            remove_dead(graph, [computed.producer() if computed is not None else None])
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()
