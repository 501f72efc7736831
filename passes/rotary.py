"""UB fusion: rotary position embedding written out as rotate_half -> onnxruntime's
RotaryEmbedding.

LLaMA-style models (transformers, both exporters) rotate q and k, split into heads, as

    x = Transpose(Reshape(X, [B, S, N, H]), [0, 2, 1, 3])
    out = x * cos + Concat(-x[..., H/2:], x[..., :H/2], axis=-1) * sin

with cos / sin of shape [1, 1, S, H] computed once from the positions: cos(Concat(f, f)) for
the per-position angles f [1, S, H/2]. Because both halves of cos are equal, its first half,
flattened to [S, H/2], is a per-row cache: RotaryEmbedding with position offset 0 reads row s
for query row s, whatever positions the model computed the angles from (a KV-cache offset
included). The rotation is applied to the [B, S, N*H] projection, before the head split, so
the attention fusions still find their Transpose(Reshape(X)) head split above it.

GPT-J rotates every two elements instead (``interleaved``), on heads [B, S, N, R] not yet
transposed, with cos / sin [1, S, 1, R] repeated element-wise (repeat_interleave):

    rotated = Reshape(Concat(Unsqueeze(-x[..., 1::2], -1), Unsqueeze(x[..., 0::2], -1), -1), x)
    out = x * repeat_interleave(cos_t, 2) + rotated * repeat_interleave(sin_t, 2)

which is RotaryEmbedding(interleaved=1) on x merged to [B, S, N*R], with cos_t / sin_t
[1, S, 1, R/2] as the per-row caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite import runtime
from fusectl.rewrite.axes import shape_element
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    absorb_shape_arithmetic,
    constant_value,
    new_constant,
    producer_of,
    replace_subgraph,
    typed,
    uses_outside,
)
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass

MS = "com.microsoft"
_HEADS = [0, 2, 1, 3]
# Element-wise steps between the duplicated angles and cos / sin that keep the two halves equal.
_HALF_PRESERVING = frozenset({"Cos", "Sin", "Cast", "Identity"})


def _ints(value: ir.Value | None) -> list[int] | None:
    array = constant_value(value)
    return None if array is None else [int(v) for v in array.reshape(-1)]


@dataclass
class _Rotary:
    """One rotate_half site: out = x * cos + rotate_half(x) * sin."""

    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    nodes: list[ir.Node]
    root: ir.Node
    interleaved: bool = False  # rotate every two (GPT-J), not rotate_half


def _last_axis_slice(node: ir.Node, rank: int, step: int = 1) -> tuple[int, int] | None:
    """(start, end) of a Slice with this step along the last axis."""
    starts, ends = _ints(node.inputs[1]), _ints(node.inputs[2])
    axes = _ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    steps = _ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    if starts is None or ends is None or axes is None or steps != [step] or len(starts) != 1:
        return None
    if axes[0] % rank != rank - 1:
        return None
    return starts[0], ends[0]


def _last_axis_unsqueeze(value: ir.Value, rank: int, alone: bool = True) -> ir.Value | None:
    """x from Unsqueeze(x, axes) whose rank-``rank`` output's last axis is a new one (the only
    new one unless not ``alone``)."""
    node = producer_of(value, "Unsqueeze")
    axes = _ints(node.inputs[1]) if node is not None and len(node.inputs) > 1 else None
    if axes is None or (alone and len(axes) != 1):
        return None
    return node.inputs[0] if rank - 1 in [a % rank for a in axes] else None


def _rotate_every_two_of(ctx: PassContext, value: ir.Value) -> tuple[ir.Value, list] | None:
    """x [..., R] from Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1), Unsqueeze(x[..., 0::2],
    -1), axis=-1), [..., R]) (GPT-J's rotate_every_two), and the nodes doing it."""
    reshape = producer_of(value, "Reshape")
    concat = producer_of(reshape.inputs[0], "Concat") if reshape is not None else None
    if concat is None or len(concat.inputs) != 2:
        return None
    if concat.attributes.get_int("axis") not in (-1, 4):
        return None
    negated, even_value = (_last_axis_unsqueeze(v, 5) for v in concat.inputs)
    negate = producer_of(negated, "Neg")
    odd = producer_of(negate.inputs[0], "Slice") if negate is not None else None
    even = producer_of(even_value, "Slice")
    if odd is None or even is None or odd.inputs[0] is not even.inputs[0]:
        return None
    x = even.inputs[0]
    shape, pairs, rotated = ctx.shape(x), ctx.shape(concat.outputs[0]), ctx.shape(value)
    if shape is None or len(shape) != 4 or not isinstance(shape[3], int) or shape[3] % 2:
        return None
    # The Reshape merges the pairs back: it keeps the leading axes, so (the element count
    # being kept) the last one is R whatever its inferred size.
    if pairs is None or rotated is None or len(pairs) != 5 or len(rotated) != 4:
        return None
    if list(pairs[3:]) != [shape[3] // 2, 2]:
        return None
    if not all(_same_dim(a, b) for a, b in zip(pairs[:3], rotated[:3], strict=True)):
        return None
    odd_range, even_range = _last_axis_slice(odd, 4, 2), _last_axis_slice(even, 4, 2)
    if odd_range is None or even_range is None:
        return None
    if odd_range[0] != 1 or even_range[0] != 0 or min(odd_range[1], even_range[1]) < shape[3]:
        return None
    nodes = [reshape, concat, negate, odd, even]
    return x, nodes + [v.producer() for v in concat.inputs]


def _repeated_pairs(ctx: PassContext, value: ir.Value) -> tuple[ir.Value, ir.Shape] | None:
    """(t, the shape of ``value``) when ``value`` [..., R] repeats each element of t [..., R/2]
    twice along the last axis (repeat_interleave: Reshape(Tile(Unsqueeze(t, -1), [1, .., 2]))
    or Expand to [.., 2])."""
    reshape = producer_of(value, "Reshape")
    if reshape is None:
        return None
    copies = reshape.inputs[0].producer()
    if copies is None or copies.op_type not in ("Tile", "Expand") or copies.domain != "":
        return None
    table_shape = ctx.shape(copies.inputs[0])
    pairs, merged = ctx.shape(copies.outputs[0]), ctx.shape(value)
    if table_shape is None or pairs is None or merged is None or len(pairs) != len(merged) + 1:
        return None
    if pairs[-1] != 2 or table_shape[-1] != 1 or not isinstance(pairs[-2], int):
        return None
    # Leading axes kept (and the element count), so the last one is the pairs merged: equal,
    # or copied by the Reshape (a 0 in its target, which shape inference names afresh).
    copying = not reshape.attributes.get_int("allowzero", 0)
    target = reshape.inputs[1]
    for index, (a, b) in enumerate(zip(pairs[:-2], merged[:-1], strict=True)):
        copied = copying and target is not None and shape_element(ctx, target, index) == 0
        if not (_same_dim(a, b) or copied):
            return None
    # The table's other new axes (heads, of size 1) leave its S x R/2 elements in row order.
    table = _last_axis_unsqueeze(copies.inputs[0], len(pairs), alone=False)
    return None if table is None else (table, ir.Shape([*pairs[:-2], 2 * pairs[-2]]))


def _rotate_half_of(value: ir.Value, head_size: int) -> ir.Value | None:
    """x from Concat(Neg(x[..., H/2:]), x[..., :H/2], axis=-1), and the nodes doing it."""
    concat = producer_of(value, "Concat")
    if (
        concat is None
        or len(concat.inputs) != 2
        or concat.attributes.get_int("axis") not in (-1, 3)
    ):
        return None
    negate = producer_of(concat.inputs[0], "Neg")
    high = producer_of(negate.inputs[0], "Slice") if negate is not None else None
    low = producer_of(concat.inputs[1], "Slice")
    if high is None or low is None or high.inputs[0] is not low.inputs[0]:
        return None
    half = head_size // 2
    high_range, low_range = _last_axis_slice(high, 4), _last_axis_slice(low, 4)
    if high_range is None or low_range is None:
        return None
    if high_range[0] != half or high_range[1] < head_size or low_range != (0, half):
        return None
    return low.inputs[0]


def _match(add: ir.Node, ctx: PassContext) -> _Rotary | None:
    """The rotary embedding ending at this Add, if it is one."""
    products = [producer_of(v, "Mul") for v in add.inputs]
    if any(p is None for p in products):
        return None
    for direct, rotated in (products, products[::-1]):
        for x, cos in (direct.inputs, direct.inputs[::-1]):
            shape = ctx.shape(x)
            if shape is None or len(shape) != 4 or not isinstance(shape[3], int):
                continue
            for half_turn, sin in (rotated.inputs, rotated.inputs[::-1]):
                if _rotate_half_of(half_turn, int(shape[3])) is x:
                    concat = half_turn.producer()
                    negate = concat.inputs[0].producer()
                    slices = [negate.inputs[0].producer(), concat.inputs[1].producer()]
                    nodes = [add, direct, rotated, concat, negate, *slices]
                    return _Rotary(x, cos, sin, nodes, add)
                pairs = _rotate_every_two_of(ctx, half_turn)
                if pairs is not None and pairs[0] is x:
                    return _Rotary(x, cos, sin, [add, direct, rotated, *pairs[1]], add, True)
    return None


def _duplicated_halves(ctx: PassContext, value: ir.Value, depth: int = 8) -> bool:
    """Whether the last axis of ``value`` is Concat(f, f) passed through element-wise steps
    (cos, sin, casts, scaling by a scalar) and Unsqueezes that keep that axis last; or a
    constant whose two halves are equal (the table folded from a static-shape export)."""
    table = constant_value(value)
    if table is not None:
        half = table.shape[-1] // 2 if table.ndim else 0
        return (
            half > 0
            and table.shape[-1] == 2 * half
            and bool(np.array_equal(table[..., :half], table[..., half:]))
        )
    node = value.producer()
    if node is None or depth == 0 or node.domain not in ("", "ai.onnx"):
        return False
    inner = node.inputs[0]
    if node.op_type == "Concat":
        rank = len(shape) if (shape := ctx.shape(inner)) is not None else 0
        last = node.attributes.get_int("axis") in (-1, rank - 1)
        return len(node.inputs) == 2 and node.inputs[1] is inner and last
    if node.op_type == "Unsqueeze":
        axes = _ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None or -1 in axes:
            return False
    elif node.op_type in ("Mul", "Div"):
        factor = constant_value(node.inputs[1])
        if factor is None or factor.size != 1:
            return False
    elif node.op_type not in _HALF_PRESERVING:
        return False
    return inner is not None and _duplicated_halves(ctx, inner, depth - 1)


def _same_dim(a: int | ir.SymbolicDim, b: int | ir.SymbolicDim) -> bool:
    """Whether two dimensions are known to be equal (the same size, or the same named symbol)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a.value is not None and a.value == b.value


def _head_split(ctx: PassContext, x: ir.Value) -> tuple[ir.Node, ir.Node] | None:
    """(Reshape, Transpose) when x = Transpose(Reshape(X [B,S,N*H], [B,S,N,H]), [0,2,1,3]).

    The Reshape must keep X's batch and sequence axes and only split the last one: a Reshape
    of [B, S*N, H] to [B, S, N, H] has the same ranks, but X's rows are not the positions."""
    transpose = producer_of(x, "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != _HEADS:
        return None
    reshape = producer_of(transpose.inputs[0], "Reshape")
    if reshape is None or reshape.inputs[0] is None:
        return None
    before, after = ctx.shape(reshape.inputs[0]), ctx.shape(reshape.outputs[0])
    if before is None or after is None or len(before) != 3 or len(after) != 4:
        return None
    if not (_same_dim(before[0], after[0]) and _same_dim(before[1], after[1])):
        return None
    return reshape, transpose


@register_pass
class RotaryEmbeddingFusionPass(FusionPass):
    spec = PassSpec(
        name="RotaryEmbeddingFusionPass",
        category=Category.UB,
        description="rotate_half rotary position embedding (LLaMA-style q/k) -> com.microsoft "
        "RotaryEmbedding on the projection, before the head split; GPT-J's rotate_every_two "
        "-> RotaryEmbedding(interleaved=1)",
        aliases=("rotary_embedding_fusion", "RotaryEmbeddingFusion"),
        numerics=Numerics.REASSOCIATING,
        priority=4400,
        targets=("ort",),
        emits=("RotaryEmbedding",),
        emits_domain=MS,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("RotaryEmbedding")
        caches: dict[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value]] = {}
        for add in ctx.op_index.of_type(model.graph, "Add"):
            if add.graph is not model.graph:
                continue
            found = _match(add, ctx)
            if found is not None:
                reason = self._fuse(ctx, found, caches)
                if reason is not None:
                    stats.decline(reason, add.name or add.op_type)

    @staticmethod
    def _cache(
        ctx: PassContext, angles: ir.Value, half: int, label: str, interleaved: bool
    ) -> tuple[list[ir.Node], ir.Value]:
        """[S, H/2] rows of cos or sin: the first half of the last axis, flattened; for the
        interleaved form the table before repeat_interleave, flattened."""
        graph = angles.graph
        assert graph is not None
        if interleaved:
            repeated = _repeated_pairs(ctx, angles)
            assert repeated is not None
            angles = repeated[0]
        table = constant_value(angles)
        if table is not None:  # a constant table: its cache is a constant too
            rows = table if interleaved else table[..., :half]
            rows = np.ascontiguousarray(rows.reshape(-1, half))
            return [], new_constant(graph, f"{label}/cache", rows)
        bounds = (
            {"rows": [-1, half]}
            if interleaved
            else {
                "starts": [0],
                "ends": [half],
                "axes": [-1],
                "rows": [-1, half],
            }
        )
        constants = {
            suffix: new_constant(graph, f"{label}/{suffix}", np.array(numbers, np.int64))
            for suffix, numbers in bounds.items()
        }
        if interleaved:  # the table's rank varies; shape inference gives the rows
            flat = ir.node("Reshape", [angles, constants["rows"]])
            return [flat], flat.outputs[0]
        first_half = ir.node(
            "Slice", [angles, constants["starts"], constants["ends"], constants["axes"]]
        )
        flat = ir.node("Reshape", [first_half.outputs[0], constants["rows"]])
        shape, dtype = ctx.shape(angles), ctx.dtype(angles)
        if shape is not None:
            typed(first_half.outputs[0], dtype, ir.Shape([*shape[:-1], half]))
            typed(flat.outputs[0], dtype, ir.Shape([shape[-2], half]))
        return [first_half, flat], flat.outputs[0]

    @classmethod
    def _fuse(
        cls,
        ctx: PassContext,
        match: _Rotary,
        caches: dict[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value]],
    ) -> str | None:
        shape = ctx.shape(match.x)
        assert shape is not None
        head_size = int(shape[3])
        # The position axis: x [B, N, S, H] after the head transpose; GPT-J's [B, S, N, R].
        sequence = 1 if match.interleaved else 2
        for angles in (match.cos, match.sin):
            angle_shape = ctx.shape(angles)
            if match.interleaved:
                repeated = _repeated_pairs(ctx, angles)
                if repeated is None:
                    return (
                        "cos / sin are not each angle repeated twice in a row (repeat_interleave)"
                    )
                angle_shape = repeated[1]
            elif not _duplicated_halves(ctx, angles):
                return "cos / sin are not the same angles repeated in both halves (Concat(f, f))"
            if angle_shape is None or len(angle_shape) < 2 or angle_shape[-1] != head_size:
                return "cos / sin do not have the head size as their last axis"
            rows_axis = len(angle_shape) - 4 + sequence
            others = [d for i, d in enumerate(angle_shape[:-1]) if i != rows_axis]
            if rows_axis < 0 or any(d != 1 for d in others):
                return "cos / sin differ per batch row or head (position ids per row)"
            rows, positions = angle_shape[rows_axis], shape[sequence]
            if rows != positions and (rows == 1 or isinstance(positions, int)):
                return "cos / sin do not have one row per query position"
        if match.interleaved and not isinstance(shape[2], int):
            return "the number of heads of the interleaved rotary's input is unknown"
        dtype = ctx.dtype(match.x)
        if ctx.target == "ort" and not runtime.has_kernel("RotaryEmbedding", MS, 1, dtype):
            return f"onnxruntime has no com.microsoft.RotaryEmbedding kernel for {dtype}"
        split = None if match.interleaved else _head_split(ctx, match.x)
        old_nodes = list(match.nodes)
        if match.interleaved:  # TorchScript's Reshape back reads Shape(Concat): dies with it
            absorb_shape_arithmetic(ctx, old_nodes, {match.x, match.cos, match.sin})
        if (
            split is not None
            and uses_outside([*old_nodes, *split], [match.root.outputs[0]]) is None
        ):
            old_nodes += split
        reason = uses_outside(old_nodes, [match.root.outputs[0]])
        if reason is not None:
            return reason
        new_nodes: list[ir.Node] = []
        key = (match.cos, match.sin)
        new_cache = key not in caches
        if new_cache:
            label = f"{ctx.spec.name}/{match.root.name or 'rotary'}"
            half = head_size // 2
            pairs = match.interleaved
            cos_nodes, cos_cache = cls._cache(ctx, match.cos, half, f"{label}/cos", pairs)
            sin_nodes, sin_cache = cls._cache(ctx, match.sin, half, f"{label}/sin", pairs)
            new_nodes += cos_nodes + sin_nodes
            caches[key] = (cos_cache, sin_cache)
        cos_cache, sin_cache = caches[key]
        offset = _position_offset(match.root.graph)
        source = split[0].inputs[0] if split is not None else match.x
        attributes = {"interleaved": 0}
        if match.interleaved:  # [B, S, N, R] -> [B, S, N*R], as the kernel's 3-D input
            graph = match.root.graph
            assert graph is not None
            heads = int(shape[2])
            targets = {
                "merged": [0, 0, heads * head_size],
                "split": [0, 0, heads, head_size],
            }
            merge, back = (
                _shared_constant(graph, f"{ctx.spec.name}/{name}_{heads}x{head_size}", t)
                for name, t in targets.items()
            )
            merged = ir.node("Reshape", [match.x, merge])
            new_nodes.append(merged)
            merged_shape = ir.Shape([shape[0], shape[1], heads * head_size])
            source = typed(merged.outputs[0], ctx.dtype(match.x), merged_shape)
            attributes = {"interleaved": 1, "num_heads": heads}
        rotary = ir.node(
            "RotaryEmbedding",
            [source, offset, cos_cache, sin_cache],
            attributes=attributes,
            domain=MS,
        )
        new_nodes.append(rotary)
        result = typed(rotary.outputs[0], ctx.dtype(source), ctx.shape(source))
        if match.interleaved:
            unmerged = ir.node("Reshape", [result, back])
            new_nodes.append(unmerged)
            result = typed(unmerged.outputs[0], ctx.dtype(match.x), shape)
        if split is not None:
            reshape = split[0]
            heads = ir.node(
                "Reshape",
                [result, reshape.inputs[1]],
                attributes={"allowzero": reshape.attributes.get_int("allowzero", 0)},
            )
            merge = ir.node("Transpose", [heads.outputs[0]], attributes={"perm": _HEADS})
            new_nodes += [heads, merge]
            typed(heads.outputs[0], ctx.dtype(source), ctx.shape(reshape.outputs[0]))
            result = typed(merge.outputs[0], ctx.dtype(source), ctx.shape(match.x))
        refused = replace_subgraph(
            ctx,
            "RotaryEmbedding",
            match.root,
            old_nodes,
            new_nodes,
            [match.root.outputs[0]],
            [result],
        )
        if refused is not None and new_cache:  # left out by a bisection: so is the cache
            del caches[key]
        return None


_OFFSET_NAME = "RotaryEmbeddingFusionPass/position_offset"


def _position_offset(graph: ir.Graph | None) -> ir.Value:
    """The shared position_ids input [0]: row s of the per-row cache for query row s."""
    assert graph is not None
    return _shared_constant(graph, _OFFSET_NAME, [0])


def _shared_constant(graph: ir.Graph, name: str, numbers: list[int]) -> ir.Value:
    """An int64 initializer this pass names and every site reading those numbers shares."""
    if name not in graph.initializers:
        new_constant(graph, name, np.array(numbers, np.int64))
    return graph.initializers[name]
