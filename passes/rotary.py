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

GPT-J, RoFormer and Cohere rotate every two elements instead (``interleaved``):

    rotated = Reshape(Concat(Unsqueeze(-x[..., 1::2], -1), Unsqueeze(x[..., 0::2], -1), -1), x)
    out = x * cos + rotated * sin

with each angle twice in a row in cos / sin (repeat_interleave, or torch.stack([t, t], -1)
flattened), so every second element, flattened, is the cache, and RotaryEmbedding(interleaved=1)
computes it. The same rotation written pair by pair, as code that rotates complex numbers spells
it in real arithmetic (the OpenAI privacy filter):

    first, second = x[..., 0::2], x[..., 1::2]
    out = Reshape(Concat(Unsqueeze(first * cos - second * sin, -1),
                         Unsqueeze(second * cos + first * sin, -1), -1), x)

reads each angle once in cos / sin, whose last axis is the cache as it is.

What is checked is what cos / sin hold, whatever spells it: each angle twice along the last axis
(its two halves equal, or pairs), proven by propagation from a Concat(f, f), a merge of equal
copies or a constant's values through element-wise and layout ops (``_repeats``), or, where no
proof goes through (repeat_interleave lowered to NonZero + GatherND), read from the table
evaluated on random positions at two probe sizes (``_repeats_on_samples``); and which axis
of x their rows run along, from how they broadcast against it. Either rotation goes with either
layout: heads transposed to [B, N, S, H] (RotaryEmbedding on the projection before their head
split, or on the 4-D heads) or not, [B, S, N, H] (GPT-J: merged to [B, S, N*H] around it), and
rotate_half also on heads with no batch axis, [S, N, H] (a VLM vision tower's patches of all
images as one sequence: merged to [1, S, N*H] around it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite import runtime
from fusectl.rewrite.axes import (
    HEADS_PERM,
    axis_size,
    head_split,
    keeps_leading,
    last_axis_positions,
    last_axis_slice,
    same_dim,
    slice_operands,
    symbolic_size,
)
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.evaluate import sampled, sampled_dims
from fusectl.rewrite.graph import (
    absorb_shape_arithmetic,
    constant_value,
    new_constant,
    node_axes,
    producer_of,
    replace_subgraph,
    typed,
    uses_outside,
)
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass
from fusectl.rewrite.shapes import named
from fusectl.rewrite.sizes import Size

MS = "com.microsoft"
# How the last axis of cos / sin holds each angle twice: its two halves equal (rotate_half's
# cos(Concat(f, f))), or each element twice in a row (the interleaved form's repeat_interleave).
HALVES, PAIRS = "halves", "pairs"
# Element-wise ops of one operand: equal inputs give equal outputs.
_UNARY = frozenset(
    {"Cos", "Sin", "Cast", "Identity", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Tanh"}
)
_ARITHMETIC = frozenset({"Mul", "Div", "Add", "Sub"})


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
    # The rotated part negated (NanoChat's Concat(x2, -x1)): a rotation by -angle, which is
    # RotaryEmbedding with the sin cache negated.
    flipped: bool = False
    # Rotated pair by pair (_pair_rotation): cos / sin hold each angle once, not twice.
    once: bool = False


def _last_axis_unsqueeze(value: ir.Value, rank: int) -> ir.Value | None:
    """x from Unsqueeze(x, [axis]) whose rank-``rank`` output's last axis is the new one."""
    node = producer_of(value, "Unsqueeze")
    axes = node_axes(node) if node is not None else None  # an input, or an attribute < 13
    if axes is None or len(axes) != 1:
        return None
    return node.inputs[0] if rank - 1 in [a % rank for a in axes] else None


def _one_negated(
    first: ir.Value | None, second: ir.Value | None
) -> tuple[ir.Value, ir.Value, ir.Node, bool] | None:
    """A rotation's two parts, the first of which is negated (-x2, x1), or the second (x2,
    -x1: the rotation's negation, ``flipped``): (the first part, negation undone; the second
    part, likewise; the Neg; flipped)."""
    for flipped, negated, plain in ((False, first, second), (True, second, first)):
        negate = producer_of(negated, "Neg")
        if negate is not None and plain is not None and negate.inputs[0] is not None:
            parts = (plain, negate.inputs[0]) if flipped else (negate.inputs[0], plain)
            return parts[0], parts[1], negate, flipped
    return None


def _rotate_every_two_of(ctx: PassContext, value: ir.Value) -> tuple[ir.Value, list, bool] | None:
    """x [..., R] from Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1), Unsqueeze(x[..., 0::2],
    -1), axis=-1), [..., R]) (GPT-J's rotate_every_two) or its negation (the Neg on the even
    part), the nodes doing it and whether it is negated."""
    reshape = producer_of(value, "Reshape")
    concat = producer_of(reshape.inputs[0], "Concat") if reshape is not None else None
    if concat is None or len(concat.inputs) != 2:
        return None
    if concat.attributes.get_int("axis") not in (-1, 4):
        return None
    signed = _one_negated(*(_last_axis_unsqueeze(v, 5) for v in concat.inputs))
    if signed is None:
        return None
    odd_value, even_value, negate, flipped = signed
    odd, even = producer_of(odd_value, "Slice"), producer_of(even_value, "Slice")
    if odd is None or even is None or odd.inputs[0] is not even.inputs[0]:
        return None
    x = even.inputs[0]
    size = _stacked_back(ctx, x, concat, reshape)
    if size is None:
        return None
    odd_range, even_range = last_axis_slice(odd, 4, 2), last_axis_slice(even, 4, 2)
    if odd_range is None or even_range is None:
        return None
    if odd_range[0] != 1 or even_range[0] != 0 or min(odd_range[1], even_range[1]) < size:
        return None
    nodes = [reshape, concat, negate, odd, even]
    return x, nodes + [v.producer() for v in concat.inputs], flipped


def _stacked_back(ctx: PassContext, x: ir.Value, concat: ir.Node, reshape: ir.Node) -> int | None:
    """x's last axis size R (static, even) where the Concat stacks [..., R/2, 2] pairs of x
    and the Reshape merges them back to x's shape; else None. The Reshape keeps the leading
    axes, so (the element count being kept) the last one is R whatever its inferred size."""
    shape, pairs = ctx.shape(x), ctx.shape(concat.outputs[0])
    rotated = ctx.shape(reshape.outputs[0])
    if shape is None or len(shape) != 4 or not isinstance(shape[3], int) or shape[3] % 2:
        return None
    if pairs is None or rotated is None or len(pairs) != 5 or len(rotated) != 4:
        return None
    if list(pairs[3:]) != [shape[3] // 2, 2]:
        return None
    return shape[3] if keeps_leading(ctx, reshape, pairs, rotated, 3) else None


def _rotate_half_of(
    ctx: PassContext, value: ir.Value, head_size: int
) -> tuple[ir.Value, list, bool] | None:
    """x from Concat(Neg(x[..., H/2:]), x[..., :H/2], axis=-1) or its negation Concat(x[...,
    H/2:], Neg(x[..., :H/2])), the nodes doing it and whether it is negated. The halves are
    read by which elements they hold (two Slices, a Split, Gathers), not by the op."""
    concat = producer_of(value, "Concat")
    if concat is None or len(concat.inputs) != 2:
        return None
    joined, rank = concat.attributes.get_int("axis"), len(ctx.shape(value) or ())
    if joined not in (-1, 3) and not (rank == 3 and joined == 2):
        return None
    signed = _one_negated(*concat.inputs)
    if signed is None:
        return None
    high_value, low_value, negate, flipped = signed
    high, low = last_axis_positions(ctx, high_value), last_axis_positions(ctx, low_value)
    if high is None or low is None or high[0] is not low[0]:
        return None
    half = head_size // 2
    if high[1] != list(range(half, head_size)) or low[1] != list(range(half)):
        return None
    halves = list(dict.fromkeys(v.producer() for v in (high_value, low_value)))
    return low[0], [concat, negate, *halves], flipped


def _match(add: ir.Node, ctx: PassContext) -> _Rotary | None:
    """The rotary embedding ending at this Add, if it is one."""
    products = [producer_of(v, "Mul") for v in add.inputs]
    if any(p is None for p in products):
        return None
    for direct, rotated in (products, products[::-1]):
        for x, cos in (direct.inputs, direct.inputs[::-1]):
            shape = ctx.shape(x)
            if shape is None or len(shape) not in (3, 4) or not isinstance(shape[-1], int):
                continue
            four_d = len(shape) == 4  # rotate_every_two reads 4-D heads; rotate_half 3-D too
            for half_turn, sin in (rotated.inputs, rotated.inputs[::-1]):
                halves = _rotate_half_of(ctx, half_turn, int(shape[-1]))
                pairs = None
                if halves is None and four_d:
                    pairs = _rotate_every_two_of(ctx, half_turn)
                for found, interleaved in ((halves, False), (pairs, True)):
                    if found is not None and found[0] is x:
                        nodes = [add, direct, rotated, *found[1]]
                        return _Rotary(x, cos, sin, nodes, add, interleaved, found[2])
    return None


def _pair_rotation(reshape: ir.Node, ctx: PassContext) -> _Rotary | None:
    """The pair-by-pair rotation ending at this Reshape (see the module docstring), if it is
    one: its first and second parts the even and odd elements of one 4-D x, rotated by the
    same cos and sin (the products in either order)."""
    concat = producer_of(reshape.inputs[0], "Concat")
    if concat is None or len(concat.inputs) != 2:
        return None
    if concat.attributes.get_int("axis") not in (-1, 4):
        return None
    parts = [_last_axis_unsqueeze(v, 5) for v in concat.inputs]  # type: ignore[arg-type]
    sub, add = producer_of(parts[0], "Sub"), producer_of(parts[1], "Add")
    if sub is None or add is None:
        return None
    terms = [_sliced_term(v) for v in (*sub.inputs, *add.inputs)]
    if any(term is None for term in terms):
        return None
    (even, cos, *_), (odd, sin, *_) = terms[:2]  # type: ignore[misc]
    if {(t[0], t[1]) for t in terms[2:]} != {(odd, cos), (even, sin)}:  # type: ignore[index]
        return None
    x = even[0]
    if even[1] != 0 or odd[1] != 1 or odd[0] is not x:
        return None
    size = _stacked_back(ctx, x, concat, reshape)
    if size is None or any(term[4] < size for term in terms):  # type: ignore[index]
        return None
    nodes = [reshape, concat, *(v.producer() for v in concat.inputs), sub, add]
    for term in terms:  # the products, then the Slices (one each, or shared)
        nodes += [n for n in term[2:4] if n not in nodes]  # type: ignore[index]
    return _Rotary(x, cos, sin, nodes, reshape, interleaved=True, once=True)


def _sliced_term(
    value: ir.Value,
) -> tuple[tuple[ir.Value, int], ir.Value, ir.Node, ir.Node, int] | None:
    """(x and the start of its every-second-element Slice, the other factor, the Mul, the
    Slice, the Slice's end) for Mul(x[..., start::2], factor) in either order."""
    product = producer_of(value, "Mul")
    if product is None:
        return None
    for part, factor in (product.inputs, product.inputs[::-1]):
        node = producer_of(part, "Slice")
        if node is None or node.inputs[0] is None or factor is None:
            continue
        bounds = last_axis_slice(node, 4, 2)
        if bounds is not None:
            return (node.inputs[0], bounds[0]), factor, product, node, bounds[1]
    return None


def _repeats(ctx: PassContext, value: ir.Value, kind: str, depth: int = 16) -> bool:
    """Whether the last axis of ``value`` holds each element twice: its two halves are equal
    (HALVES) or each element is there twice in a row (PAIRS). Proven from what computes it, not
    from one exporter's spelling: a constant is compared by value; Concat(f, f) on the last
    axis gives halves, a Reshape merging [..., R/2, 2] whose last axis holds equal copies gives
    pairs; element-wise ops of such values (or of values broadcast along the last axis) keep
    the property, and so do the layout ops that leave the last axis as it is."""
    table = constant_value(value)
    if table is not None:
        return _repeated_in(table, kind)
    node = value.producer()
    shape = ctx.shape(value)
    if node is None or depth == 0 or node.domain not in ("", "ai.onnx") or not shape:
        return False
    op, inputs, last = node.op_type, node.inputs, len(shape) - 1
    data = inputs[0] if inputs else None
    if data is None:
        return False
    if op in _UNARY:
        return _repeats(ctx, data, kind, depth - 1)
    if op in _ARITHMETIC:  # each operand repeats, or is the same along the last axis
        return all(
            v is not None and (_flat(ctx, v) or _repeats(ctx, v, kind, depth - 1)) for v in inputs
        )
    if op == "Concat":
        if node.attributes.get_int("axis", 0) % len(shape) == last:
            return kind == HALVES and len(inputs) == 2 and _same_tensor(inputs[1], data)
        parts = [v is not None and _repeats(ctx, v, kind, depth - 1) for v in inputs]
        return all(parts)  # joined along another axis: each part's rows repeat
    if op == "Reshape":
        size, kept = symbolic_size(ctx, value, last), symbolic_size(ctx, data, -1)
        if size is not None and size == kept:  # the rows are kept whole
            return _repeats(ctx, data, kind, depth - 1)
        return kind == PAIRS and _merged_pairs(ctx, data, size)
    if op == "Expand":
        return _flat(ctx, data) or _repeats(ctx, data, kind, depth - 1)
    return _keeps_last_axis(ctx, node, len(shape)) and _repeats(ctx, data, kind, depth - 1)


def _repeated_in(table: np.ndarray, kind: str) -> bool:
    """Whether a constant's last axis holds each element twice, as ``kind`` says."""
    if table.ndim == 0 or table.shape[-1] < 2 or table.shape[-1] % 2:
        return False
    half = table.shape[-1] // 2
    first, second = (
        (table[..., :half], table[..., half:])
        if kind == HALVES
        else (table[..., 0::2], table[..., 1::2])
    )
    return bool(np.array_equal(first, second))


# A table's values at the probe sizes (evaluate.sampled), or why there are none, per table.
_Samples = dict[ir.Value, "list[tuple[dict[str, int], np.ndarray]] | str"]


def _sampled(ctx: PassContext, table: ir.Value, samples: _Samples) -> list | str:
    """evaluate.sampled of ``table``, once per pass run."""
    if table not in samples:
        samples[table] = sampled(ctx, table)
    return samples[table]


def _repeats_on_samples(ctx: PassContext, value: ir.Value, kind: str, samples: _Samples) -> bool:
    """Whether ``value``, computed from random inputs at two probe sizes, holds each element
    twice as ``kind`` says, and holds more than one angle: for the spellings _repeats has no
    proof through (repeat_interleave lowered to NonZero + GatherND), the layout read from what
    the computation gives. A table of angles is laid out the same whatever the positions."""
    found = _sampled(ctx, value, samples)
    if isinstance(found, str):
        return False
    return all(
        table.dtype.kind == "f" and _repeated_in(table, kind) and np.unique(table).size > 1
        for _, table in found
    )


def _merged_pairs(ctx: PassContext, data: ir.Value, size: Size | None) -> bool:
    """Whether a Reshape of ``data`` [..., R/2, 2] to a last axis of ``size`` R merges its last
    two axes, and the last axis of ``data`` holds two equal copies."""
    shape = ctx.shape(data)
    if size is None or shape is None or len(shape) < 2:
        return False
    pair, half = symbolic_size(ctx, data, -1), symbolic_size(ctx, data, -2)
    if pair != (2, ()) or half is None or size != (2 * half[0], half[1]):
        return False
    return _equal_copies(ctx, data)


def _equal_copies(ctx: PassContext, value: ir.Value) -> bool:
    """Whether all elements along the last axis of ``value`` are equal: a Concat on that axis
    of one tensor with a last axis of size 1 (the same value, or the same Unsqueeze of one),
    a Tile or Expand of a last axis of size 1 (torch.stack([t, t], -1), repeat_interleave)."""
    node = value.producer()
    table = constant_value(value)
    if table is not None:
        return table.ndim > 0 and bool(np.all(table == table[..., :1]))
    shape = ctx.shape(value)
    if node is None or node.domain not in ("", "ai.onnx") or not shape:
        return False
    if node.op_type in ("Tile", "Expand"):
        return node.inputs[0] is not None and _flat(ctx, node.inputs[0])
    if (
        node.op_type != "Concat"
        or node.attributes.get_int("axis", 0) % len(shape) != len(shape) - 1
    ):
        return False
    first = node.inputs[0]
    return (
        first is not None
        and _flat(ctx, first)
        and all(v is not None and _same_tensor(v, first) for v in node.inputs)
    )


def _same_tensor(a: ir.Value, b: ir.Value) -> bool:
    """Whether two values are the same tensor: one value, or the same Unsqueeze of one value
    (TorchScript writes torch.stack([t, t]) with an Unsqueeze per operand)."""
    if a is b:
        return True
    left, right = producer_of(a, "Unsqueeze"), producer_of(b, "Unsqueeze")
    if left is None or right is None or left.inputs[0] is not right.inputs[0]:
        return False
    axes = node_axes(left)
    return axes is not None and node_axes(right) == axes


def _flat(ctx: PassContext, value: ir.Value) -> bool:
    """Whether ``value`` is broadcast along the last axis: a scalar, or a last axis of 1."""
    shape = ctx.shape(value)
    return shape is not None and (len(shape) == 0 or symbolic_size(ctx, value, -1) == (1, ()))


def _keeps_last_axis(ctx: PassContext, node: ir.Node, rank: int) -> bool:
    """Whether a layout op leaves its data's last axis as it is, and last (``rank``: its
    output's rank): Unsqueeze and Squeeze of other axes, Slice and Gather on other axes,
    Transpose keeping it in place."""
    op, data = node.op_type, node.inputs[0]
    data_shape = ctx.shape(data) if data is not None else None
    if not data_shape:
        return False
    if op in ("Unsqueeze", "Squeeze"):  # their axes count in the larger rank
        axes = node_axes(node)
        larger = max(rank, len(data_shape))
        return axes is not None and larger - 1 not in [a % larger for a in axes]
    if op == "Slice":
        operands = slice_operands(node, rank)
        return operands is not None and all(axis != rank - 1 for axis, *_ in operands)
    if op == "Gather":
        return node.attributes.get_int("axis", 0) % len(data_shape) != len(data_shape) - 1
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", None)
        return perm is not None and perm[-1] == rank - 1
    return False


_NOT_REPEATED = {
    HALVES: "cos / sin are not the same angles repeated in both halves (Concat(f, f))",
    PAIRS: "cos / sin are not each angle repeated twice in a row (repeat_interleave)",
}


def _dims(ctx: PassContext, value: ir.Value) -> list[int | ir.SymbolicDim] | None:
    """The value's sizes, those onnx left unknown or made up traced through the ops that
    computed them (a Reshape target's -1, a shape read at run time) where that finds a static
    size or one named dimension."""
    shape = ctx.shape(value)
    if shape is None:
        return None
    dims: list[int | ir.SymbolicDim] = []
    for axis, dim in enumerate(shape):
        size = symbolic_size(ctx, value, axis)
        if size is not None and not size[1]:
            dim = size[0]
        elif size is not None and size[0] == 1 and len(size[1]) == 1:
            dim = ir.SymbolicDim(size[1][0])
        dims.append(dim)
    return dims


def _table_dims(
    ctx: PassContext, table: ir.Value, samples: _Samples
) -> list[int | ir.SymbolicDim] | None:
    """A cos / sin table's sizes: traced (_dims), and where that leaves an axis unnamed (a
    repeat_interleave's GatherND, whose output onnx cannot size), as evaluating the table at
    the probe sizes shows them."""
    dims = _dims(ctx, table)
    if dims is None or all(isinstance(d, int) or named(d) for d in dims):
        return dims
    found = _sampled(ctx, table, samples)
    shown = sampled_dims(found) if not isinstance(found, str) else None
    if shown is None or len(shown) != len(dims):
        return dims
    return [
        dim if isinstance(dim, int) or named(dim) or seen is None else seen
        for dim, seen in zip(dims, shown, strict=True)
    ]


@dataclass(frozen=True)
class _Rows:
    """Where the rows of a cos / sin table run in x [B, ., ., R]: x's position ``axis``, the
    table's size there, and whether the table holds such rows for each batch row (positions
    per row: a [B, S] position_ids input, multimodal rotary) rather than one set for all."""

    axis: int
    rows: int | ir.SymbolicDim
    per_batch: bool


def _position_axis(
    table: list[int | ir.SymbolicDim],
    x: list[int | ir.SymbolicDim],
    candidates: tuple[int, ...],
) -> _Rows | str:
    """The rows of the cos / sin table in x [B, ., ., R], along the first of ``candidates``
    (2 for heads transposed to [B, N, S, R], 1 for [B, S, N, R]) along which alone, besides
    the batch, the table may vary (broadcast along its other axes but the last); else why
    there is none. A table varying along the batch must have x's batch."""
    padded = [1] * (4 - len(table)) + list(table)
    per_batch = padded[0] != 1
    if per_batch and not same_dim(padded[0], x[0]):
        return "cos / sin have a batch axis that is not provably the input's batch"
    fitting = [
        axis
        for axis in candidates
        if all(d == 1 for i, d in enumerate(padded[1:3], 1) if i != axis)
    ]
    if not fitting:
        return "cos / sin differ per head"
    for axis in fitting:
        rows, positions = padded[axis], x[axis]
        if rows == positions or (rows != 1 and not isinstance(positions, int)):
            return _Rows(axis, rows, per_batch)
    return "cos / sin do not have one row per query position"


@register_pass
class RotaryEmbeddingFusionPass(FusionPass):
    spec = PassSpec(
        name="RotaryEmbeddingFusionPass",
        category=Category.UB,
        description="rotate_half rotary position embedding (LLaMA-style q/k) -> com.microsoft "
        "RotaryEmbedding on the projection, before the head split; rotate_every_two (GPT-J, "
        "RoFormer, Cohere) and the pair-by-pair rotation (OpenAI privacy filter) -> "
        "RotaryEmbedding(interleaved=1)",
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
        caches: dict[tuple[ir.Value, ir.Value, bool], tuple[ir.Value, ir.Value, ir.Value]] = {}
        samples: _Samples = {}  # one evaluation per table: q and k, every layer, read the same
        anchors = [
            *((add, _match) for add in ctx.op_index.of_type(model.graph, "Add")),
            *(
                (reshape, _pair_rotation)
                for reshape in ctx.op_index.of_type(model.graph, "Reshape")
            ),
        ]
        for root, matcher in anchors:
            if root.graph is not model.graph:
                continue
            found = matcher(root, ctx)
            if found is not None:
                reason = self._fuse(ctx, found, caches, samples)
                if reason is not None:
                    stats.decline(reason, root.name or root.op_type)

    @staticmethod
    def _cache(
        ctx: PassContext,
        angles: ir.Value,
        kind: str,
        shape: tuple[int | ir.SymbolicDim, int],
        label: str,
        negated: bool = False,
    ) -> tuple[list[ir.Node], ir.Value]:
        """``shape`` [S, R/2] rows of cos or sin: one copy of each angle of the last axis (its
        first half, or every second element), flattened, ``negated`` or not; a constant table
        gives a constant."""
        graph = angles.graph
        assert graph is not None
        half, step = shape[1], (1 if kind == HALVES else 2)
        ends = half if kind == HALVES else 2 * half
        table = constant_value(angles)
        if table is not None:  # a constant table: its cache is a constant too
            copy = np.ascontiguousarray(table[..., 0:ends:step].reshape(-1, half))
            return [], new_constant(graph, f"{label}/cache", -copy if negated else copy)
        table_shape, dtype = ctx.shape(angles), ctx.dtype(angles)
        # Each angle once already (a pair-by-pair rotation's table): nothing to slice.
        whole = step == 1 and table_shape is not None and table_shape[-1] == half
        bounds = {"starts": [0], "ends": [ends], "axes": [-1], "steps": [step], "rows": [-1, half]}
        if whole:
            bounds = {"rows": bounds["rows"]}
        constants = {
            suffix: new_constant(graph, f"{label}/{suffix}", np.array(numbers, np.int64))
            for suffix, numbers in bounds.items()
        }
        nodes = []
        if not whole:
            names = ("starts", "ends", "axes", "steps")
            first = ir.node("Slice", [angles, *(constants[name] for name in names)])
            if table_shape is not None:
                typed(first.outputs[0], dtype, ir.Shape([*table_shape[:-1], half]))
            nodes.append(first)
        flat = ir.node("Reshape", [nodes[0].outputs[0] if nodes else angles, constants["rows"]])
        nodes.append(flat)
        typed(flat.outputs[0], dtype, ir.Shape(list(shape)))
        if not negated:
            return nodes, flat.outputs[0]
        negate = ir.node("Neg", [flat.outputs[0]])
        nodes.append(negate)
        return nodes, typed(negate.outputs[0], dtype, ir.Shape(list(shape)))

    @classmethod
    def _fuse(
        cls,
        ctx: PassContext,
        match: _Rotary,
        caches: dict[tuple[ir.Value, ir.Value, bool], tuple[ir.Value, ir.Value, ir.Value]],
        samples: _Samples,
    ) -> str | None:
        shape = ctx.shape(match.x)
        assert shape is not None
        head_size = int(shape[-1])
        # [S, N, H] with no batch axis (a VLM vision tower's tokens of all images, one
        # sequence): read as [1, S, N, H], heads not transposed.
        packed = len(shape) == 3
        kind = PAIRS if match.interleaved else HALVES
        width = head_size
        if match.once:  # each angle once: the whole last axis is the cache, as a first half is
            kind, width = HALVES, head_size // 2
        # x [B, N, S, H] split into heads by Reshape + Transpose: the positions are its axis 2.
        split = None if packed else head_split(ctx, match.x)
        x_dims = _dims(ctx, match.x)  # traced as the tables' are: the batch by its name
        assert x_dims is not None
        if packed:
            x_dims = [1, *x_dims]
        placements = set()
        for angles in (match.cos, match.sin):
            if not match.once and not (
                _repeats(ctx, angles, kind) or _repeats_on_samples(ctx, angles, kind, samples)
            ):
                return _NOT_REPEATED[kind]
            dims = _table_dims(ctx, angles, samples)
            if dims is None or not 2 <= len(dims) <= 4 or dims[-1] != width:
                half = "half " if match.once else ""
                return f"cos / sin do not have {half}the head size as their last axis"
            found = _position_axis(dims, x_dims, (2,) if split is not None else (2, 1))
            if isinstance(found, str):
                return found
            placements.add((found.axis, found.per_batch))
            placement = found
        if len(placements) != 1:
            return "cos and sin run along different axes of the input"
        # [B, S, N, H] heads not transposed: merged to [B, S, N*H] around the rotary.
        merging = placement.axis == 1
        head_count = axis_size(ctx, match.x, 1 if packed else 2) if merging else None
        if merging and head_count is None:
            return "the number of heads of the rotary's [B, S, N, H] input is unknown"
        dtype = ctx.dtype(match.x)
        if ctx.target == "ort" and not runtime.has_kernel("RotaryEmbedding", MS, 1, dtype):
            return f"onnxruntime has no com.microsoft.RotaryEmbedding kernel for {dtype}"
        old_nodes = list(match.nodes)
        # A Reshape back of the rotated pairs to x's shape reads Shape(x): dies with it.
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
        key = (match.cos, match.sin, match.flipped)
        new_cache = key not in caches
        if new_cache:
            label = f"{ctx.spec.name}/{match.root.name or 'rotary'}"
            gathered = _gathered(ctx, match) if placement.per_batch else None
            id_nodes: list[ir.Node] = []
            if gathered is not None:  # cos_cached[position_ids]: its tables, the model's ids
                cos_table, sin_table, positions = gathered
                rows_shape = (ctx.shape(cos_table)[0], head_size // 2)  # type: ignore[index]
            else:
                cos_table, sin_table = match.cos, match.sin
                batch = 1 if packed else shape[0]
                rows_shape = (_cache_rows(placement, batch), head_size // 2)
                if placement.per_batch:
                    id_nodes, positions = _batch_row_positions(ctx, match.cos, placement, label)
                else:
                    positions = _position_offset(match.root.graph)
            cos_nodes, cos_cache = cls._cache(ctx, cos_table, kind, rows_shape, f"{label}/cos")
            sin_nodes, sin_cache = cls._cache(
                ctx, sin_table, kind, rows_shape, f"{label}/sin", negated=match.flipped
            )
            new_nodes += cos_nodes + sin_nodes + id_nodes
            caches[key] = (cos_cache, sin_cache, positions)
        cos_cache, sin_cache, positions = caches[key]
        source = split[0].inputs[0] if split is not None else match.x
        attributes = {"interleaved": int(match.interleaved)}
        if merging:  # [B, S, N, H] -> [B, S, N*H], as the kernel's 3-D input
            graph = match.root.graph
            assert graph is not None
            assert head_count is not None
            width = head_count * head_size
            targets = {  # [S, N, H] <-> [1, S, N*H] where packed
                "merged": [1, -1, width] if packed else [0, 0, width],
                "split": [-1, head_count, head_size] if packed else [0, 0, head_count, head_size],
            }
            layout = "packed_" if packed else ""
            merge, back = (
                _shared_constant(
                    graph, f"{ctx.spec.name}/{name}_{layout}{head_count}x{head_size}", target
                )
                for name, target in targets.items()
            )
            merged = ir.node("Reshape", [match.x, merge])
            new_nodes.append(merged)
            leading = [1, shape[0]] if packed else [shape[0], shape[1]]
            merged_shape = ir.Shape([*leading, width])
            source = typed(merged.outputs[0], ctx.dtype(match.x), merged_shape)
            attributes["num_heads"] = head_count
        rotary = ir.node(
            "RotaryEmbedding",
            [source, positions, cos_cache, sin_cache],
            attributes=attributes,
            domain=MS,
        )
        new_nodes.append(rotary)
        result = typed(rotary.outputs[0], ctx.dtype(source), ctx.shape(source))
        if merging:
            unmerged = ir.node("Reshape", [result, back])
            new_nodes.append(unmerged)
            result = typed(unmerged.outputs[0], ctx.dtype(match.x), shape)
        if split is not None:
            reshape = split[0]
            allowzero = reshape.attributes.get_int("allowzero", 0)
            heads = ir.node(
                "Reshape",
                [result, reshape.inputs[1]],
                # allowzero is Reshape's from opset 14 (LLaMA exported at opset 11 or 13)
                attributes={"allowzero": allowzero} if ctx.opset >= 14 else {},
            )
            merge = ir.node("Transpose", [heads.outputs[0]], attributes={"perm": HEADS_PERM})
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


def _gathered(ctx: PassContext, match: _Rotary) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """(cos table, sin table, position ids) when cos / sin are rows of constant tables [P, R]
    looked up by one int64 position_ids [B, S] (``cos_cached[position_ids]``, unsqueezed at
    the heads axis): RotaryEmbedding reads the tables' first halves (or pairs) through those
    very ids, which nothing needs to flatten or compute."""
    found = []
    for value in (match.cos, match.sin):
        node = value.producer()
        while node is not None and node.op_type == "Unsqueeze" and node.inputs[0] is not None:
            node = node.inputs[0].producer()
        if node is None or node.op_type != "Gather" or node.attributes.get_int("axis", 0) != 0:
            return None
        table, ids = node.inputs
        array = constant_value(table)
        ids_shape = ctx.shape(ids) if ids is not None else None
        if array is None or array.ndim != 2 or ids_shape is None or len(ids_shape) != 2:
            return None
        found.append((table, ids))
    (cos_table, ids), (sin_table, other) = found
    if ids is not other or ctx.dtype(ids) != ir.DataType.INT64:
        return None
    return cos_table, sin_table, ids


def _cache_rows(placement: _Rows, batch: int | ir.SymbolicDim) -> int | ir.SymbolicDim:
    """How many rows the flattened cache has: the table's, times the batch for a table with
    rows per batch row (unknown unless both are static)."""
    if not placement.per_batch:
        return placement.rows
    if isinstance(placement.rows, int) and isinstance(batch, int):
        return batch * placement.rows
    return ir.SymbolicDim(None)


def _batch_row_positions(
    ctx: PassContext, table: ir.Value, placement: _Rows, label: str
) -> tuple[list[ir.Node], ir.Value]:
    """position_ids [B, S] reading a per-batch-row table [B, ., S, R] flattened to [B*S, R/2]:
    b * S + s for batch row b and query row s. A constant when B and S are static; else
    Range(0, B*S) shaped [B, S], B and S read from the table at run time."""
    graph = table.graph
    assert graph is not None
    batch, rows = ctx.shape(table)[0], placement.rows  # type: ignore[index]
    if isinstance(batch, int) and isinstance(rows, int):
        ids = np.arange(batch * rows, dtype=np.int64).reshape(batch, rows)
        return [], new_constant(graph, f"{label}/position_ids", ids)
    numbers = {"axes": ([0, placement.axis], [2]), "zero": (0, []), "one": (1, [])}
    constants = {
        name: new_constant(graph, f"{label}/{name}", np.array(value, np.int64).reshape(dims))
        for name, (value, dims) in numbers.items()
    }
    shape = ir.node("Shape", [table])
    sizes = ir.node("Gather", [shape.outputs[0], constants["axes"]], attributes={"axis": 0})
    count = ir.node("ReduceProd", [sizes.outputs[0]], attributes={"keepdims": 0})
    ids = ir.node("Range", [constants["zero"], count.outputs[0], constants["one"]])
    grid = ir.node("Reshape", [ids.outputs[0], sizes.outputs[0]])
    int64 = ir.DataType.INT64
    typed(shape.outputs[0], int64, ir.Shape([len(ctx.shape(table))]))  # type: ignore[arg-type]
    typed(sizes.outputs[0], int64, ir.Shape([2]))
    typed(count.outputs[0], int64, ir.Shape([]))
    typed(ids.outputs[0], int64, ir.Shape([_cache_rows(placement, batch)]))
    positions = typed(grid.outputs[0], int64, ir.Shape([batch, rows]))
    return [shape, sizes, count, ids, grid], positions


def _position_offset(graph: ir.Graph | None) -> ir.Value:
    """The shared position_ids input [0]: row s of the per-row cache for query row s."""
    assert graph is not None
    return _shared_constant(graph, _OFFSET_NAME, [0])


def _shared_constant(graph: ir.Graph, name: str, numbers: list[int]) -> ir.Value:
    """An int64 initializer this pass names and every site reading those numbers shares."""
    if name not in graph.initializers:
        new_constant(graph, name, np.array(numbers, np.int64))
    return graph.initializers[name]
