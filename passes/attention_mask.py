"""A padding mask built into an attention bias, given to the fused attention as the 2-D mask.

Encoders turn ``attention_mask`` [batch, length] (1 keeps a token, 0 drops it) into an additive
bias [batch, 1, 1 or length, length] of 0 and a large negative value, in as many spellings as
there are releases of transformers: ``(1 - mask) * finfo.min``, ``Where(mask, 0, min)``, or
(transformers 5) a bidirectional mask function indexed over Range grids, And-ed with a
bounds check, Expanded and turned into a bias by Where. The fused attention the lowering
emitted reads that bias as ``attention_bias``, and the forty-odd nodes that build it stay.

The attention ops take the mask itself (Attention's ``mask_index``, MultiHeadAttention's
``key_padding_mask``, int32 [batch, length]) and add ``mask_filter_value`` where it is 0. So
this pass asks what the bias computes instead of matching its spelling: where the bias depends
on one 2-D graph input and shapes only, it evaluates the bias at probe sizes on probe masks
(fusectl.rewrite.evaluate), and where every element is 0 for a kept key and one constant c for
a dropped one, whatever the query and head, the attention reads the mask with
``mask_filter_value`` c: the same additions as before, so the same results.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.evaluate import (
    Unevaluable,
    dependencies,
    dimension_names,
    evaluate,
    probe_shape,
    probes,
)
from fusectl.rewrite.graph import constant_value, node_label, replace_subgraph
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass
from fusectl.rewrite.shapes import is_arithmetic, named

MS = "com.microsoft"
# Per op: the index of its 2-D mask input and of its additive bias.
_INPUTS = {"Attention": (3, 5), "MultiHeadAttention": (4, 5)}
_PAST = {"Attention": 4, "MultiHeadAttention": 6}  # the index of the past (key) input
_MASK_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL})


@dataclass(frozen=True)
class _Mask:
    """What a bias was found to be: the 2-D mask it is built from and the value it adds for a
    dropped key."""

    mask: ir.Value
    fill: float


def _mask_input(ctx: PassContext, bias: ir.Value) -> ir.Value | str | None:
    """The one graph input the bias is computed from (shapes aside), or why it is not a mask
    of one 2-D input; None where the bias reads no graph input (a position bias)."""
    inputs = {
        operand
        for node in dependencies(bias, set())
        if node.op_type not in ("Shape", "Size")
        for operand in node.inputs
        if operand is not None and operand.is_graph_input()
    }
    if not inputs:
        return None
    if len(inputs) > 1:
        return "the attention bias reads more than one graph input"
    mask = inputs.pop()
    shape = ctx.shape(mask)
    if shape is None or len(shape) != 2 or ctx.dtype(mask) not in _MASK_TYPES:
        return "the attention bias reads a graph input that is not a 2-D integer or bool mask"
    return mask


def _probe_masks(shape: tuple[int, int], dtype: ir.DataType) -> np.ndarray:
    """0/1 masks with every row keeping its first key, dropping its last, and random between."""
    rows, length = shape
    generator = np.random.default_rng(length)
    mask = generator.integers(0, 2, size=(rows, length))
    mask[:, 0], mask[:, -1] = 1, 0
    return mask.astype(dtype.numpy())


def _fill(bias: np.ndarray, mask: np.ndarray) -> float | str:
    """The value the bias adds for a dropped key, or why it is not a key padding mask."""
    rows, length = mask.shape
    if bias.ndim != 4 or bias.shape[0] != rows or bias.shape[3] != length:
        return "the attention bias is not [batch, heads, queries, keys] over the mask's keys"
    if np.any(bias != bias[:, :, :1, :]):
        return "the attention bias varies with the query (a causal or windowed mask)"
    kept = np.broadcast_to(mask.astype(bool)[:, None, None, :], bias.shape)
    if np.any(bias[kept] != 0):
        return "the attention bias adds more than the mask (a position bias)"
    dropped = np.unique(bias[~kept])
    if dropped.size != 1:
        return "the attention bias is not one value for every dropped key"
    fill = float(dropped[0])
    if not fill < 0:
        return "the attention bias does not add a negative value for a dropped key"
    return fill


def _key_length(ctx: PassContext, attention: ir.Node, probe: dict[str, int]) -> int | None:
    """How many keys the fused op attends over at the probe sizes: its new keys plus the past it
    appends them to; None where a shape is unknown."""
    inputs = list(attention.inputs)
    if attention.op_type == "MultiHeadAttention":
        key = inputs[1] if len(inputs) > 1 else None
        rank = len(ctx.shape(key) or ()) if key is not None else 0
        # [B, L, hidden] or packed [B, L, N, 2, H]; [B, N, L, H]; no key: packed QKV [B, S, ...]
        source, axis = (inputs[0], 1) if key is None else (key, 2 if rank == 4 else 1)
        past, past_axis = (inputs[6] if len(inputs) > 6 else None), 2  # [B, N, P, H]
    else:  # Attention: input [B, S, hidden], past [2, B, N, P, H]
        source, axis = inputs[0], 1
        past, past_axis = (inputs[4] if len(inputs) > 4 else None), 3
    try:
        length = probe_shape(ctx, source, probe)[axis]  # type: ignore[arg-type]
        if past is not None:
            length += probe_shape(ctx, past, probe)[past_axis]
    except (Unevaluable, IndexError):
        return None
    return length


def _aligned(
    ctx: PassContext, attention: ir.Node, mask: ir.Value, probe: dict[str, int]
) -> tuple[int, int] | str:
    """The mask's [rows, length] at the probe sizes, its length made the attention's key
    length: a length named apart from the past and new lengths ("total_sequence") is probed
    at their sum, as the model runs it. Why not, where the two cannot agree."""
    shape = ctx.shape(mask)
    assert shape is not None
    keys = _key_length(ctx, attention, probe)
    length = shape[1]
    if keys is not None and named(length) and not is_arithmetic(length.value):  # type: ignore[union-attr]
        probe[length.value] = keys  # type: ignore[union-attr]
    dims = [d if isinstance(d, int) else probe.get(d.value) for d in shape]  # type: ignore[union-attr]
    if None in dims:
        return "the mask's dimensions are not named"
    if keys is not None and dims[1] != keys:
        return "the mask's length is not the attention's key length (past and new keys)"
    return dims[0], dims[1]  # type: ignore[return-value]


def _recognize(ctx: PassContext, attention: ir.Node, bias: ir.Value) -> _Mask | str | None:
    """The mask the bias is built from, why it is not a key padding mask, or None where the
    bias is no mask at all."""
    try:
        mask = _mask_input(ctx, bias)
    except Unevaluable as why:
        return f"the attention bias cannot be evaluated: {why}"
    if not isinstance(mask, ir.Value):
        return mask
    dtype = ctx.dtype(mask)
    assert dtype is not None
    sized = probes(dimension_names(ctx, bias, [mask]))
    if isinstance(sized, str):
        return f"the mask's sizes cannot be probed: {sized}"
    fills = set()
    for probe in sized:
        dims = _aligned(ctx, attention, mask, probe)
        if isinstance(dims, str):
            return dims
        masks = _probe_masks(dims, dtype)
        try:
            computed = evaluate(ctx, bias, {mask: masks}, probe)
        except Unevaluable as why:
            return f"the attention bias cannot be evaluated: {why}"
        fill = _fill(computed, masks)
        if isinstance(fill, str):
            return fill
        if dtype != ir.DataType.BOOL:  # the op keeps a key for any positive value
            larger = np.where(masks != 0, np.arange(masks.size).reshape(masks.shape) % 3 + 1, 0)
            try:
                again = evaluate(ctx, bias, {mask: larger.astype(masks.dtype)}, probe)
            except Unevaluable as why:
                return f"the attention bias cannot be evaluated: {why}"
            if not np.array_equal(again, computed):
                return (
                    "the attention bias reads the mask's values, not only whether they are 0 "
                    "((1 - mask) * c): the op's mask would differ for values above 1"
                )
        fills.add(fill)
    if len(fills) != 1:
        return "the attention bias adds a value for a dropped key that depends on the sizes"
    return _Mask(mask, fills.pop())


@register_pass
class KeyPaddingMaskFusionPass(FusionPass):
    spec = PassSpec(
        name="KeyPaddingMaskFusionPass",
        category=Category.UB,
        description="an attention bias that is a padding mask [batch, length] turned into "
        "0 / a negative value (any spelling, recognized by evaluating it) -> the fused "
        "attention's own 2-D mask input (mask_index / key_padding_mask), the bias's "
        "construction removed",
        aliases=("key_padding_mask_fusion",),
        numerics=Numerics.EXACT,
        priority=4520,  # after the attention lowering and the projection biases
        targets=("ort",),
        emits=("Attention", "MultiHeadAttention"),
        emits_domain=MS,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("KeyPaddingMask")
        found: dict[tuple[ir.Value, bool], _Mask | str | None] = {}
        masks: dict[ir.Value, ir.Value] = {}
        for op_type, (mask_index, bias_index) in _INPUTS.items():
            for attention in ctx.op_index.of_type(model.graph, op_type, (MS,)):
                inputs = list(attention.inputs)
                bias = inputs[bias_index] if len(inputs) > bias_index else None
                if bias is None or constant_value(bias) is not None:
                    continue
                if len(inputs) > mask_index and inputs[mask_index] is not None:
                    continue  # a mask already
                # Per bias and key length: layers share a bias, a past changes the keys.
                past = _PAST[op_type]
                key = (bias, len(inputs) > past and inputs[past] is not None)
                if key not in found:
                    found[key] = _recognize(ctx, attention, bias)
                recognized = found[key]
                if recognized is None:
                    continue
                if isinstance(recognized, str):
                    stats.decline(recognized, node_label(attention))
                    continue
                self._rewrite(ctx, attention, recognized, masks, mask_index, bias_index)

    def _rewrite(
        self,
        ctx: PassContext,
        attention: ir.Node,
        recognized: _Mask,
        masks: dict[ir.Value, ir.Value],
        mask_index: int,
        bias_index: int,
    ) -> None:
        new_nodes = []
        mask = masks.get(recognized.mask)
        if mask is None:  # one int32 copy of the mask for every layer
            cast = ir.node("Cast", [recognized.mask], attributes={"to": ir.DataType.INT32})
            cast.outputs[0].name = f"{recognized.mask.name}_int32"
            cast.outputs[0].dtype = ir.DataType.INT32
            cast.outputs[0].shape = ctx.shape(recognized.mask)
            mask = cast.outputs[0]
            new_nodes.append(cast)
        inputs: list[ir.Value | None] = list(attention.inputs)
        inputs += [None] * (bias_index + 1 - len(inputs))
        inputs[mask_index], inputs[bias_index] = mask, None
        while inputs[-1] is None:
            inputs.pop()
        attributes = dict(attention.attributes)
        attributes["mask_filter_value"] = ir.AttrFloat32("mask_filter_value", recognized.fill)
        fused = ir.node(
            attention.op_type,
            inputs,
            attributes=attributes,
            domain=MS,
            num_outputs=len(attention.outputs),
        )
        declined = replace_subgraph(
            ctx,
            "KeyPaddingMask",
            attention,
            [attention],
            [*new_nodes, fused],
            attention.outputs,
            fused.outputs,
        )
        # Later layers share the copy only once it is in the graph: a site the repository or a
        # bisection leaves out takes its Cast with it.
        if declined is None:
            masks[recognized.mask] = mask
