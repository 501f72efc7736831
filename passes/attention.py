"""UB fusion: scaled dot-product attention written out by exporters -> onnxruntime's
MultiHeadAttention, or GroupQueryAttention where key/value heads are shared by groups of
query heads (LLaMA-style repeat_kv).

Exporters spell the core the same way (transformers' sdpa and eager paths, TorchScript and
dynamo), but the head split and the key transpose differ, so these passes are hand-written and
anchored at the Softmax instead of being a pattern per spelling:

    q = Transpose(Reshape(Q, [B,S,N,H]), [0,2,1,3])          Q, K, V: [B,S,N*H] projections
    kT = Transpose(Reshape(K), [0,2,3,1])                     or [0,2,1,3] then [0,1,3,2], or
         Reshape(Transpose(Reshape(k, 3-D), [0,2,1]), 4-D)    (dynamo), single-input Concats
    k, v = Reshape(Expand(Unsqueeze(kv, 2), ..), [B,N,L,H])  optional repeat_kv of KV heads
    p = Softmax(MatMul(q * s1, kT * s2) [+ bias ...])        scale s1*s2, or a Div of the product
    (scores = c * Tanh(scores / c) before the biases)         optional logit soft-capping (Gemma-2)
    p = Where(IsNaN(p), 0, p)                                 optional guard
    out = Reshape(Transpose(MatMul(p, v), [0,2,1,3]), [B,S,N*H])

The additive mask / position bias becomes attention_bias ([B or 1, N or 1, S, L]). A KV
cache that key and value append a plain head split to, Concat(past, split(K)), is
MultiHeadAttention's own (past_key / past_value in, present_key / present_value out); other keys
and values that are not a plain head split of a projection (repeated KV heads, of a cache too)
are read as they are, [B, N, L, H], by MultiHeadAttention. One key/value head for all the query
heads (multi-query attention), however spelled, is GroupQueryAttention's kv_num_heads=1.

Scores computed with the heads folded into the batch (Bloom: q, k, v Reshaped to [B*N, S, H],
Add(alibi [B*N, 1, L], s * q @ k^T) Reshaped to [B, N, S, L] for the mask and Softmax, then
folded again for the context) are read through those Reshapes, each proven to keep the sizes
it does not fold (_unfolded); a bias added in the folded layout is unfolded to 4-D once.

Eager code spells the scores in more ways, read by what they compute (_scores): masked_fill
Where(c, s, m) is s + Where(c, 0, m); Max(s, -FLT_MAX) a floor that only keeps -inf out; a
constant [N, 1, 1] factor a per-head scale the query heads can carry; a fold to [B*N, S, L]
before the Softmax the fold after it (the Softmax is over the last axis, which it keeps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from fusectl.rewrite import runtime
from fusectl.rewrite.axes import (
    HEADS_PERM,
    axis_size,
    last_axis_slice,
    repeat_kv,
    same_dimension,
    shape_element,
    symbolic_size,
    target_parts,
)
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.coverage import attention_shaped
from fusectl.rewrite.graph import (
    INDEX_TYPES,
    absorb_shape_arithmetic,
    concatenated_constant,
    constant_value,
    disconnect,
    new_constant,
    new_transpose,
    new_unsqueeze,
    node_axes,
    producer_of,
    replace_subgraph,
    transpose_perm,
    typed,
    uses_outside,
)
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass
from fusectl.rewrite.shapes import named
from fusectl.rewrite.size_reads import move_before_readers, read_again, size_reads

MS = "com.microsoft"


def _perm(node: ir.Node) -> list[int] | None:
    """The perm a Transpose states (the rank of its input is not asked for)."""
    return transpose_perm(node, None)


def _through_concat(value: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """Skip the single-input Concat TorchScript writes for an empty KV cache."""
    concat = producer_of(value, "Concat")
    if concat is not None and len(concat.inputs) == 1:
        nodes.append(concat)
        return concat.inputs[0]
    return value


def _split_heads(ctx: PassContext, value: ir.Value, nodes: list[ir.Node]) -> ir.Value | None:
    """[B,N,S,H] from Transpose(Reshape(X[B,S,N*H]), [0,2,1,3]): returns X. A source of
    another rank (a [B*S, N*H] Linear output, LeViT) is no projection the fused op can read:
    the heads are read, or merged back, as they are."""
    value = _through_concat(value, nodes)
    transpose = producer_of(value, "Transpose")
    if transpose is None or _perm(transpose) != HEADS_PERM:
        return None
    reshape = producer_of(transpose.inputs[0], "Reshape")
    source = ctx.shape(reshape.inputs[0]) if reshape is not None else None  # type: ignore[arg-type]
    if reshape is None or (source is not None and len(source) != 3):
        return None
    nodes += [transpose, reshape]
    return reshape.inputs[0]


def _repeat_kv(value: ir.Value, nodes: list[ir.Node]) -> ir.Value | None:
    """kv [B,KV,L,H] from repeat_kv's Reshape(Expand(Unsqueeze(kv, 2), [B,KV,r,L,H]), [B,KV*r,
    L,H]): each KV head serves r consecutive query heads, as in GroupQueryAttention."""
    found = repeat_kv(value)
    if found is None:
        return None
    nodes += reversed(found[1])
    return found[0]


@dataclass
class _Cache:
    """New key or value heads appended to a KV cache: Concat(past [B, N, P, H], heads) on the
    sequence axis, the heads a plain split of a [B, L, N*H] projection. MultiHeadAttention
    takes the past and the projection and computes that Concat itself (its present output)."""

    past: ir.Value
    # The [B, L, N*H] projection the new heads are a plain split of; None for heads
    # transformed after the split (Qwen3's per-head key norm), which a fused op may read
    # merged instead.
    projection: ir.Value | None
    nodes: list[ir.Node]  # the Concat and the head split
    heads: ir.Value  # the new heads [B, N, L, H]


@dataclass
class _Heads:
    """A key or value operand of the attention: the [B, n, L, H] tensor it reads, and the
    [B, L, n*H] projection that tensor was split from when it is a plain head split."""

    tensor: ir.Value | None  # None where only the projection exists (K^T straight from K)
    projection: ir.Value | None
    repeated: bool  # the heads went through repeat_kv
    nodes: list[ir.Node]  # the split and repeat: gone when the fused op reads the projection
    # K^T read straight from [B, L, N, H] heads that are no plain split (rotary applied after
    # the split, GPT-J): the fused op reads them merged to [B, L, N*H] (_merged_heads).
    unsplit: ir.Value | None = None
    # K^T [X, H, L] or [B, N, H, L] read as K: (the tensor, the perm that gives K from it).
    swapped: tuple[ir.Value, list[int]] | None = None
    # ``tensor`` is a KV cache with new heads appended, Concat(past, split(projection)).
    cache: _Cache | None = None
    # The [B, KV, L, H] heads repeat_kv repeated into ``tensor``, with the repeat's nodes.
    kv: tuple[ir.Value, list[ir.Node]] | None = None


def _heads(ctx: PassContext, value: ir.Value) -> _Heads:
    nodes: list[ir.Node] = []
    inner = _through_concat(value, nodes)
    repeated = _repeat_kv(inner, nodes)
    kv = None if repeated is None else (repeated, list(nodes))
    if repeated is not None:
        inner = _through_concat(repeated, nodes)
    projection = _split_heads(ctx, inner, nodes)
    # A cache is appended to before repeat_kv repeats it (GroupQueryAttention's past).
    cache = _appended(ctx, value if repeated is None else inner) if projection is None else None
    split = nodes if projection else []
    return _Heads(value, projection, repeated is not None, split, cache=cache, kv=kv)


def _appended(ctx: PassContext, value: ir.Value) -> _Cache | None:
    """The cache behind ``value`` = Concat(past, split(projection)) on axis 2 of 4-D heads."""
    concat = producer_of(value, "Concat")
    shape = ctx.shape(value)
    if concat is None or len(concat.inputs) != 2 or shape is None or len(shape) != 4:
        return None
    past, new = concat.inputs
    if past is None or new is None or concat.attributes.get_int("axis", 0) not in (2, -2):
        return None
    nodes = [concat]
    projection = _split_heads(ctx, new, nodes)
    return _Cache(past, projection, nodes, new)


def _key_source(
    ctx: PassContext, value: ir.Value, nodes: list[ir.Node], *, any_4d: bool = False
) -> _Heads | None:
    """The key behind K^T [B,N,H,L] in the three spellings exporters use; the transposing
    nodes go to ``nodes``. With ``any_4d``, K^T computed any other way (SqueezeBERT's
    channel-first convolution reshaped straight to [B, N, H, L]) is read as its transpose, the
    key heads [B, N, L, H] (MatMul(q, K^T) fixes its axes' meaning)."""
    transpose = producer_of(value, "Transpose")
    if transpose is not None and _perm(transpose) == [0, 2, 3, 1]:
        nodes.append(transpose)
        reshape = producer_of(transpose.inputs[0], "Reshape")
        if reshape is None:
            return _Heads(None, None, False, [], unsplit=transpose.inputs[0])
        return _Heads(None, reshape.inputs[0], False, [reshape])
    if transpose is not None and _perm(transpose) == [0, 1, 3, 2]:
        nodes.append(transpose)
        return _heads(ctx, transpose.inputs[0])
    back = producer_of(value, "Reshape")  # dynamo: 4-D -> 3-D, swap the last two, -> 4-D
    swap = producer_of(back.inputs[0], "Transpose") if back is not None else None
    flat = producer_of(swap.inputs[0], "Reshape") if swap is not None else None
    if flat is None or _perm(swap) != [0, 2, 1]:
        shape = ctx.shape(value) if any_4d else None
        four = shape is not None and len(shape) == 4
        return _Heads(None, None, False, [], swapped=(value, [0, 1, 3, 2])) if four else None
    if not _swapped_through_fold(ctx, flat, back):
        return None
    nodes += [back, swap, flat]
    return _heads(ctx, flat.inputs[0])


def _swapped_through_fold(ctx: PassContext, flat: ir.Node, back: ir.Node) -> bool:
    """Whether K [B, N, L, H] folded to [B*N, L, H], swapped and unfolded is K^T [B, N, H, L]:
    the fold keeps L and H, the unfold gives B and N back and keeps the swapped H and L."""
    heads, swapped = flat.inputs[0], back.inputs[0]
    assert heads is not None and swapped is not None
    return (
        _ranks(ctx, flat) == (4, 3)
        and _ranks(ctx, back) == (3, 4)
        and _proven(ctx, flat, 1, heads, 2)
        and _proven(ctx, flat, 2, heads, 3)
        and _proven(ctx, back, 0, heads, 0)
        and _proven(ctx, back, 1, heads, 1)
        and _proven(ctx, back, 2, swapped, 1)
        and _proven(ctx, back, 3, swapped, 2)
    )


def _scalar(value: ir.Value | None) -> float | None:
    array = constant_value(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


def _unscale(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float]:
    """x, x * c (either order) or x / c (DeBERTa's K^T / sqrt(H * 3)) -> (x, c or 1 / c)."""
    mul = producer_of(value, "Mul")
    if mul is not None:
        for data, factor in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            scale = _scalar(factor)
            if scale is not None:
                nodes.append(mul)
                return data, scale
    div = producer_of(value, "Div")
    divisor = _scalar(div.inputs[1]) if div is not None else None
    if div is not None and div.inputs[0] is not None and divisor:
        nodes.append(div)
        return div.inputs[0], 1.0 / divisor
    return value, 1.0


@dataclass
class _Attention:
    heads: ir.Value  # the query split into heads, [B, N, S, H]
    guarded: bool  # the Softmax output went through Where(IsNaN(p), 0, p)
    query: ir.Value | None  # the [B, S, N*H] projection the heads were split from, if they were
    key: _Heads
    value: _Heads
    scale: float
    biases: list[ir.Value]
    output: ir.Value
    root: ir.Node
    nodes: list[ir.Node] = field(default_factory=list)
    softcap: float = 0.0  # the scaled scores are capped: softcap * tanh(scores / softcap)
    # Heads folded into the batch ([B*N, S, H], Bloom): the Reshapes into and out of that layout
    # (checked by _unfolded), and the biases added there ([B*N or 1, S or 1, L]).
    folds: list[ir.Node] = field(default_factory=list)
    folded: list[ir.Value] = field(default_factory=list)
    # The context [B, N, S, H] is read in another layout than [B, S, N*H] (torch's
    # nn.MultiheadAttention: [S, B, N*H]): the fused op's output is split back into heads and
    # transposed by this perm (that of the reader's Transpose, composed, where it was taken).
    split_back: tuple[list[int], int] | None = None  # (that perm, the value's head size)
    # 3-D attention [X, S, H] (heads folded into the batch and never unfolded, torch's
    # nn.MultiheadAttention with need_weights): one head over a batch of X.
    single_head: bool = False
    # Biases the scores are combined with otherwise than by Add, each read as the additive
    # bias it is (_derived_bias): masked_fill Where(c, scores, m) or Where(c, m, scores) as
    # Where(c, 0, m) or Where(c, m, 0), Sub(scores, b) as Neg(b).
    derived: list[ir.Node] = field(default_factory=list)
    # The scores went through Max(x, c) with c <= -1e30 (-FLT_MAX), which keeps -inf out.
    floored: bool = False
    # The scores scaled per head by this constant [N, 1, 1] / [1, N, 1, 1]: the query heads
    # are, instead (_fuse), and the fused op reads them merged back.
    head_scale: ir.Value | None = None
    # A logit per head joined to every row's scores before the Softmax and dropped after it
    # (GPT-OSS's attention sinks): its values, one per head or one for all.
    sink: np.ndarray | None = None
    # Biases added to the product before its scale (XLNet, scale * (q @ k^T + b)): the fused
    # op gets bias_scale * b, bias_scale the scale of the product alone.
    scaled: list[ir.Value] = field(default_factory=list)
    bias_scale: float = 1.0
    # The scores' product and the value promoted from float16 / bfloat16 to this type before
    # the Softmax and the context: the fused op computes in it from promoted operands.
    promoted: ir.DataType | None = None
    # The probabilities cast back to this (the operands') type for the value product: the
    # fused op's output is cast to it.
    narrowed: ir.DataType | None = None


def _unswapped_key(value: ir.Value, nodes: list[ir.Node]) -> _Heads:
    """K [X, L, H] behind a 3-D K^T [X, H, L]: a Transpose's input and the perm that gives K
    from it (none where it is that input), else K^T with its last two axes swapped back."""
    transpose = producer_of(value, "Transpose")
    perm = _perm(transpose) if transpose is not None else None
    if transpose is None or perm is None or len(perm) != 3 or transpose.inputs[0] is None:
        return _Heads(None, None, False, [], swapped=(value, [0, 2, 1]))
    nodes.append(transpose)
    source, composed = transpose.inputs[0], [perm[0], perm[2], perm[1]]
    if composed == [0, 1, 2]:
        return _Heads(None, source, False, [])
    return _Heads(None, None, False, [], swapped=(source, composed))


def _softcapped(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float] | None:
    """(x, c) when ``value`` is c * Tanh(x / c) (or x * (1 / c)), logit soft-capping."""
    mul = producer_of(value, "Mul")
    if mul is None:
        return None
    for capped, factor in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        cap, tanh = _scalar(factor), producer_of(capped, "Tanh")
        if not cap or cap <= 0 or tanh is None:
            continue
        inner: list[ir.Node] = []
        divide = producer_of(tanh.inputs[0], "Div")
        if divide is not None and _scalar(divide.inputs[1]) == cap:
            inner.append(divide)
            scores = divide.inputs[0]
        else:
            scores, inverse = _unscale(tanh.inputs[0], inner)
            if not inner or not np.isclose(inverse * cap, 1.0, rtol=1e-6, atol=0.0):
                continue
        nodes += [mul, tanh, *inner]
        return scores, cap
    return None


def _ranks(ctx: PassContext, node: ir.Node) -> tuple[int, int] | None:
    """(input rank, output rank) of a Reshape, where inferred."""
    source, result = ctx.shape(node.inputs[0]), ctx.shape(node.outputs[0])  # type: ignore[arg-type]
    return None if source is None or result is None else (len(source), len(result))


# A masked_fill value: a score set to it gets no weight (exp(-1e4 - max) is 0 in fp32).
_FILL_LIMIT = -1e4
# Max(scores, c) with c at most this (-FLT_MAX, as eager attention writes it; float16 scores:
# its lowest, -65504) only turns -inf into a finite value.
_FLOOR_LIMIT = -1e30
_FLOOR_LIMITS = {ir.DataType.FLOAT16: float(np.finfo(np.float16).min)}


def _masked_fill(value: ir.Value) -> tuple[ir.Node, int] | None:
    """(the Where, the input index of the scores) when ``value`` is Where(c, scores, m) or
    Where(c, m, scores) with m a scalar constant of at most -1e4: masked_fill, which is
    scores + Where(c, 0, m) or scores + Where(c, m, 0)."""
    where = producer_of(value, "Where")
    if where is None:
        return None
    for index in (1, 2):
        fill = _scalar(where.inputs[3 - index])
        if fill is not None and fill <= _FILL_LIMIT and _leads_to_matmul(where.inputs[index]):
            return where, index
    return None


def _derived(value: ir.Value) -> tuple[ir.Node, int] | None:
    """(the node, the input index of the scores) when ``value`` is the scores combined with a
    bias otherwise than by Add: Sub(scores, b), or a masked_fill (_masked_fill)."""
    subtract = producer_of(value, "Sub")
    if subtract is not None and _leads_to_matmul(subtract.inputs[0]):
        return subtract, 0
    return _masked_fill(value)


def _floored(ctx: PassContext, value: ir.Value) -> tuple[ir.Node, ir.Value] | None:
    """(the Max, x) when ``value`` is Max(x, c) with c a scalar constant of at most -1e30 (the
    lowest float16 for float16 scores)."""
    floor = producer_of(value, "Max")
    if floor is None or len(floor.inputs) != 2:
        return None
    limit = _FLOOR_LIMITS.get(ctx.dtype(value), _FLOOR_LIMIT)  # type: ignore[arg-type]
    for index in (0, 1):
        bound = _scalar(floor.inputs[1 - index])
        if bound is not None and bound <= limit and _leads_to_matmul(floor.inputs[index]):
            return floor, floor.inputs[index]  # type: ignore[return-value]
    return None


@dataclass
class _Walk:
    """What the walk from the Softmax up to the scores' MatMul collected besides its nodes."""

    biases: list[ir.Value] = field(default_factory=list)
    folds: list[ir.Node] = field(default_factory=list)
    derived: list[ir.Node] = field(default_factory=list)
    scaled: list[ir.Value] = field(default_factory=list)  # added before the scale
    floored: bool = False
    head_scale: ir.Value | None = None  # a constant [N, 1, 1] or [1, N, 1, 1]
    promoted: ir.DataType | None = None  # the product cast to this wider float type
    narrow: ir.DataType | None = None  # the type the promotion is from


def _scores(
    ctx: PassContext, value: ir.Value, nodes: list[ir.Node], walk: _Walk
) -> tuple[ir.Node | None, float, ir.Value, float]:
    """Walk Add(bias), Sub(bias), masked_fill (_masked_fill), a floor (_floored), a
    soft-capping and a scaling of the product (Div or Mul by a constant, as eager attention
    writes it) back to the MatMul of the scores: the MatMul, that scale, the value the walk
    stopped at and the soft cap (0: none). A Reshape from 3-D to 4-D on the way unfolds scores
    computed with the heads folded into the batch: it goes to ``folds`` (the biases after it in
    ``nodes`` are added in that layout, where a Sub, a masked_fill or a floor is not read)."""
    biases, folds = walk.biases, walk.folds
    for _ in range(7):
        if walk.promoted is None and _promotion(ctx, value) is not None:
            value = _unpromoted(ctx, value, nodes, walk)  # masked in float16, then promoted
            continue
        add = producer_of(value, "Add")
        unfold = producer_of(value, "Reshape")
        if add is None and unfold is not None and not folds and _ranks(ctx, unfold) == (3, 4):
            folds.append(unfold)
            nodes.append(unfold)
            value = unfold.inputs[0]
            continue
        derived = _derived(value) if not folds else None
        floor = _floored(ctx, value) if not folds else None
        if derived is not None:
            nodes.append(derived[0])
            walk.derived.append(derived[0])
            value = derived[0].inputs[derived[1]]  # type: ignore[assignment]
            continue
        if floor is not None:
            nodes.append(floor[0])
            walk.floored = True
            value = floor[1]
            continue
        if add is None:
            break
        for scores, bias in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            if _leads_to_matmul(scores):
                nodes.append(add)
                biases.append(bias)
                value = scores
                break
        else:
            return None, 1.0, value, 0.0
    softcap = 0.0
    capped = _softcapped(value, nodes)
    if capped is not None:
        value, softcap = capped
    value = _unpromoted(ctx, value, nodes, walk)
    scale = 1.0
    divide = producer_of(value, "Div")
    if divide is not None and _scalar(divide.inputs[1]):
        nodes.append(divide)
        scale = 1.0 / _scalar(divide.inputs[1])
        value = divide.inputs[0]
    elif producer_of(value, "Mul") is not None:
        product, factor = _unscale(value, nodes)
        if product is not value:
            scale, value = factor, product
        elif (per_head := _per_head_scale(value)) is not None:
            nodes.append(per_head[0])
            walk.head_scale, value = per_head[1], per_head[0].inputs[0]  # type: ignore[assignment]
    if scale != 1.0 and not folds and not softcap:
        value = _scaled_biases(value, nodes, walk.scaled)
    value = _unpromoted(ctx, value, nodes, walk)
    return producer_of(value, "MatMul"), scale, value, softcap


# Float types an exporter promotes to float32 for the Softmax (TorchScript's sdpa in half
# precision: a float32 mask added to the float16 product makes the whole attention float32).
_PROMOTED = {ir.DataType.FLOAT16: ir.DataType.FLOAT, ir.DataType.BFLOAT16: ir.DataType.FLOAT}


def _promotion(ctx: PassContext, value: ir.Value | None) -> ir.Node | None:
    """The Cast making ``value`` from a float16 / bfloat16 tensor, if it promotes to float32."""
    cast = producer_of(value, "Cast") if value is not None else None
    if cast is None or cast.inputs[0] is None:
        return None
    to = ir.DataType(cast.attributes.get_int("to", 0))
    return cast if _PROMOTED.get(ctx.dtype(cast.inputs[0])) == to else None  # type: ignore[arg-type]


def _promoted(
    ctx: PassContext,
    value: ir.Value,
    to: ir.DataType,
    shared: dict[object, tuple[ir.Value, ...]],
    new_nodes: list[ir.Node],
) -> ir.Value:
    """``value`` cast to ``to`` where it is of a type promoted to it (not the sequence
    lengths GroupQueryAttention takes), once for the sites sharing it."""
    if _PROMOTED.get(ctx.dtype(value)) != to:  # type: ignore[arg-type]
        return value
    key = ("promoted", value, to)
    if key not in shared:
        cast = ir.node("Cast", [value], attributes={"to": to})
        typed(cast.outputs[0], to, ctx.shape(value))
        new_nodes.append(cast)
        shared[key] = (cast.outputs[0],)
    return shared[key][0]


def _unpromoted(ctx: PassContext, value: ir.Value, nodes: list[ir.Node], walk: _Walk) -> ir.Value:
    """The product behind a Cast promoting it to float32 (once per walk), recorded in ``walk``:
    the fused op then computes in float32 from promoted query, key and value."""
    cast = _promotion(ctx, value) if walk.promoted is None else None
    if cast is None:
        return value
    nodes.append(cast)
    walk.promoted = ir.DataType(cast.attributes.get_int("to", 0))
    walk.narrow = ctx.dtype(cast.inputs[0])
    return cast.inputs[0]  # type: ignore[return-value]


def _operand(
    ctx: PassContext, value: ir.Value, nodes: list[ir.Node], walk: _Walk
) -> tuple[ir.Value, float]:
    """A scores operand behind its constant scale (_unscale) and a Cast promoting it to the
    type the product computes in (GPT-J casts the query and key heads to float32): (the
    operand, the scale). Recorded in ``walk`` as a promoted product."""
    value, scale = _unscale(value, nodes)
    cast = _promotion(ctx, value)
    if cast is None:
        return value, scale
    to = ir.DataType(cast.attributes.get_int("to", 0))
    narrow = ctx.dtype(cast.inputs[0])
    if walk.promoted is not None and (walk.promoted, walk.narrow) != (to, narrow):
        return value, scale
    nodes.append(cast)
    walk.promoted, walk.narrow = to, narrow
    inner, factor = _unscale(cast.inputs[0], nodes)  # type: ignore[arg-type]
    return inner, scale * factor


def _scaled_biases(value: ir.Value, nodes: list[ir.Node], scaled: list[ir.Value]) -> ir.Value:
    """Walk the Adds of biases summed with the product before it is scaled (XLNet's position
    and segment terms: scale * (q @ k^T + b)) back to the product, each b into ``scaled``:
    the fused op adds scale * b to its own scale * q @ k^T."""
    for _ in range(6):
        add = producer_of(value, "Add")
        if add is None or None in add.inputs:
            break
        for scores, bias in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            if _leads_to_matmul(scores):
                nodes.append(add)
                scaled.append(bias)  # type: ignore[arg-type]
                value = scores  # type: ignore[assignment]
                break
        else:
            break
    return value


def _per_head_scale(value: ir.Value) -> tuple[ir.Node, ir.Value] | None:
    """(the Mul, the factor) when ``value`` is Mul(scores, c) with c a constant [N, 1, 1] or
    [1, N, 1, 1]: one scale per head (Swin-v2's learned logit scale), which the query heads
    can carry instead (scores are linear in the query)."""
    mul = producer_of(value, "Mul")
    factor = constant_value(mul.inputs[1]) if mul is not None else None
    if factor is None or factor.ndim not in (3, 4) or factor.shape[-2:] != (1, 1):
        return None
    if (factor.ndim == 4 and factor.shape[0] != 1) or not _leads_to_matmul(mul.inputs[0]):
        return None
    return mul, mul.inputs[1]  # type: ignore[return-value]


def _leads_to_matmul(value: ir.Value | None, depth: int = 6) -> bool:
    """Whether a few Adds / Muls / Divs (a Tanh: soft-capping; a Where: masked_fill; a Max:
    a floor) up from ``value`` there is the scores' MatMul."""
    node = value.producer() if value is not None else None
    if node is None or depth == 0:
        return False
    if node.op_type == "MatMul":
        return True
    if node.op_type in ("Reshape", "Cast"):  # scores unfolded from [B*N, S, L]; promoted
        return _leads_to_matmul(node.inputs[0], depth - 1)
    if node.op_type not in ("Add", "Div", "Mul", "Tanh", "Where", "Max"):
        return False
    return any(_leads_to_matmul(v, depth - 1) for v in node.inputs)


def _folded(
    ctx: PassContext, value: ir.Value, nodes: list[ir.Node], folds: list[ir.Node]
) -> ir.Value | None:
    """x [B, N, S, H] when ``value`` is Reshape(x) to 3-D (heads folded into the batch, as
    _unfolded checks); the Reshape goes to ``nodes`` and ``folds``."""
    fold = producer_of(value, "Reshape")
    if fold is None or _ranks(ctx, fold) != (4, 3):
        return None
    nodes.append(fold)
    folds.append(fold)
    return fold.inputs[0]


def _folded_key(
    ctx: PassContext, value: ir.Value, nodes: list[ir.Node], folds: list[ir.Node]
) -> _Heads | None:
    """The key behind folded K^T [B*N, H, L]: Transpose(fold(k [B, N, L, H]), [0, 2, 1]), or
    the fold of a 4-D K^T in one of the spellings _key_source reads."""
    swap = producer_of(value, "Transpose")
    if swap is not None and _perm(swap) == [0, 2, 1]:
        heads = _folded(ctx, swap.inputs[0], nodes, folds)
        if heads is None:
            return None
        nodes.append(swap)
        return _heads(ctx, heads)
    transposed = _folded(ctx, value, nodes, folds)
    return _key_source(ctx, transposed, nodes) if transposed is not None else None


def _match(ctx: PassContext, softmax: ir.Node) -> _Attention | str:
    """The attention around this Softmax, or why what is around it is not one (the caller
    reports the reason only where the Softmax sits between two MatMuls: attention_shaped)."""
    nodes: list[ir.Node] = [softmax]
    walk = _Walk()
    axis = softmax.attributes.get_int("axis", -1 if ctx.opset >= 13 else 1)
    shape = ctx.shape(softmax.inputs[0])
    if axis != -1 and (shape is None or axis != len(shape) - 1):
        return "the Softmax is not provably over the last axis (the key positions)"
    # Folded to [B*N, S, L] before the Softmax (fairseq-style eager attention): the Softmax
    # over the last axis is the same on either side of that fold (_unfolded proves it keeps L).
    prefold = producer_of(softmax.inputs[0], "Reshape")
    if prefold is None or _ranks(ctx, prefold) != (4, 3) or prefold.inputs[0] is None:
        prefold = None
    scored = softmax.inputs[0] if prefold is None else prefold.inputs[0]
    scored = _max_shifted(ctx, scored, nodes)
    sink = None
    if prefold is None:
        sunk = _sunk(ctx, scored, nodes)
        if sunk is not None:
            scored, sink = sunk
    matmul, product_scale, reached, softcap = _scores(ctx, scored, nodes, walk)
    biases, folds = walk.biases, walk.folds
    if prefold is not None and not folds:
        return "the scores are folded to [batch*heads, ...] before the Softmax but not unfolded"
    if matmul is None:
        found = reached.producer()
        return (
            "the scores are not MatMul(query, key^T) with additive biases and a constant "
            f"scale (they come from {found.op_type if found else 'a graph input'})"
        )
    nodes.append(matmul)
    q_scaled, q_scale = _operand(ctx, matmul.inputs[0], nodes, walk)  # type: ignore[arg-type]
    k_scaled, k_scale = _operand(ctx, matmul.inputs[1], nodes, walk)  # type: ignore[arg-type]
    scale = q_scale * k_scale * product_scale
    folded: list[ir.Value] = []
    scores = ctx.shape(matmul.outputs[0])
    single_head = not folds and scores is not None and len(scores) == 3
    if folds:  # [B*N, S, L] scores: the query and key are folded heads
        unfolding = sum(node.op_type == "Add" for node in nodes[: nodes.index(folds[0])])
        biases, folded = biases[:unfolding], biases[unfolding:]
        unfolded = _folded(ctx, q_scaled, nodes, folds)
        key = _folded_key(ctx, k_scaled, nodes, folds)
        if unfolded is None or key is None:
            return "the scores are unfolded from [batch*heads, ...] but the query or key is not"
        q_scaled = unfolded
    elif single_head:
        key = _unswapped_key(k_scaled, nodes)
    else:
        key = _key_source(ctx, k_scaled, nodes, any_4d=True)
    heads = q_scaled
    # None: the heads are merged back (_merged_heads); 3-D, the query is read as it is.
    query = q_scaled if single_head else _split_heads(ctx, q_scaled, nodes)
    if key is None:
        return "the key is not transposed heads [batch, heads, head size, length] of a tensor"
    probabilities = softmax.outputs[0]
    uses = [user for user, _ in probabilities.uses()]
    guard = next((u for u in uses if u.op_type == "IsNaN"), None)
    if guard is not None:
        where = next((u for u in uses if u.op_type == "Where"), None)
        if where is None or _scalar(where.inputs[1]) != 0.0:
            return "the NaN guard after Softmax is not Where(IsNaN(p), 0, p)"
        nodes += [guard, where]
        probabilities = where.outputs[0]
        uses = [user for user, _ in probabilities.uses()]
    if sink is not None:
        kept = _sink_dropped(ctx, probabilities)
        if kept is None:
            return "a column is joined to the scores (a sink) but not dropped after the Softmax"
        nodes.append(kept)
        probabilities = kept.outputs[0]
    probabilities = _reshaped_back(ctx, probabilities, nodes)
    # A Shape of the probabilities (TorchScript's run-time fold target) is shape arithmetic
    # that dies with the match (absorb_shape_arithmetic), or keeps the match from landing.
    uses = [user for user, _ in probabilities.uses() if user.op_type not in _SHAPE_READERS]
    narrowed = _narrowing(walk, uses)
    if narrowed is not None:  # cast back to the operands' type for the value product
        nodes.append(uses[0])
        probabilities = uses[0].outputs[0]
        uses = [user for user, _ in probabilities.uses() if user.op_type not in _SHAPE_READERS]
    # Whether the probabilities meet the value folded [B*N, S, L]; scores folded only for
    # their product and unfolded before the Softmax meet it as [B, N, L, H] heads (GPT-NeoX-
    # Japanese's baddbmm).
    refolded = False
    if prefold is not None:  # the fold before the Softmax is the one after it, moved up
        nodes.append(prefold)
        folds.append(prefold)
        refolded = True
    elif folds and len(uses) == 1 and uses[0].op_type == "Reshape":  # folded again [B*N, S, L]
        nodes.append(uses[0])
        folds.append(uses[0])
        probabilities = uses[0].outputs[0]
        uses = [user for user, _ in probabilities.uses() if user.op_type not in _SHAPE_READERS]
        refolded = True
    if len(uses) != 1 or uses[0].op_type != "MatMul" or uses[0].inputs[0] is not probabilities:
        return "the probabilities are not read by exactly one MatMul with the value"
    context = uses[0]
    nodes.append(context)
    values = context.inputs[1]
    if narrowed is not None and ctx.dtype(values) != narrowed:
        return f"the probabilities are cast back to {narrowed}, the value is not of that type"
    if walk.promoted is not None and narrowed is None:
        cast = _promotion(ctx, values)
        narrow = None if cast is None else ctx.dtype(cast.inputs[0])  # type: ignore[arg-type]
        if narrow is None or narrow != walk.narrow:
            return "the scores are promoted to float32, the value not from their type"
        nodes.append(cast)
        values = cast.inputs[0]
    values = _folded(ctx, values, nodes, folds) if refolded else values
    if values is None:
        return "the scores are unfolded from [batch*heads, ...] but the value is not"
    result = context.outputs[0]
    if sink is None and not folds and not single_head:
        scaled_by_sink = _lse_sink(ctx, softmax.inputs[0], result, nodes)
        if scaled_by_sink is not None:
            result, sink = scaled_by_sink
    if single_head:
        value3 = _Heads(None, values, False, [])
        return _Attention(
            heads, guard is not None, query, key, value3, scale, biases, result, context,
            nodes, softcap, single_head=True, derived=walk.derived, floored=walk.floored,
            head_scale=walk.head_scale, sink=sink, scaled=walk.scaled, bias_scale=product_scale,
            promoted=walk.promoted, narrowed=narrowed,
        )  # fmt: skip
    value = _heads(ctx, values)
    extra = _producer_user(result, "Reshape")  # TorchScript: a no-op 4-D Reshape first
    if extra is not None and _producer_user(extra.outputs[0], "Transpose") is not None:
        split = ctx.shape(extra.outputs[0])
        if not refolded and not (
            _same_sizes(ctx, result, extra.outputs[0]) or _keeps(ctx, extra, heads)
        ):
            if folds or split is None or len(split) == 4:
                return (
                    "the context [batch, heads, sequence, head size] is not provably kept by "
                    "the Reshape before its Transpose"
                )
            extra = None  # the sequence split further (SAM's [B, N, H, W, D]): another layout
    if extra is not None and _producer_user(extra.outputs[0], "Transpose") is not None:
        nodes.append(extra)
        result = extra.outputs[0]
        if refolded:  # the context unfolded from [B*N, S, H]
            folds.append(extra)
    if refolded and folds[-1] is not extra:
        return "the scores are unfolded from [batch*heads, ...] but the context is not"
    merge = _producer_user(result, "Transpose")
    perm = _perm(merge) if merge is not None else None
    final = _producer_user(merge.outputs[0], "Reshape") if perm == HEADS_PERM else None  # type: ignore[union-attr]
    if final is None:
        if folds:  # the split-back reading below carries no folds to prove or biases to unfold
            return "the scores are unfolded from [batch*heads, ...] but the context is not"
        # Read in another layout: the fused op's [B, S, N*H] output goes back to the heads,
        # through the reader's Transpose where there is one (the two perms composed).
        split_back = list(HEADS_PERM)
        if merge is not None and perm is not None and len(perm) == 4:
            nodes.append(merge)
            result, split_back = merge.outputs[0], [HEADS_PERM[axis] for axis in perm]
        root, value_size = result.producer(), axis_size(ctx, context.outputs[0], 3)
        assert root is not None
        if value_size is None:
            return "the context's head size is unknown"
        return _Attention(
            heads, guard is not None, query, key, value, scale, biases, result, root, nodes,
            softcap, split_back=(split_back, value_size), derived=walk.derived,
            floored=walk.floored, head_scale=walk.head_scale, sink=sink, scaled=walk.scaled,
            bias_scale=product_scale, promoted=walk.promoted, narrowed=narrowed,
        )  # fmt: skip
    nodes += [merge, final]  # type: ignore[list-item]
    return _Attention(
        heads,
        guard is not None,
        query,
        key,
        value,
        scale,
        biases,
        final.outputs[0],
        final,
        nodes,
        softcap,
        folds,
        folded,
        derived=walk.derived,
        floored=walk.floored,
        head_scale=walk.head_scale,
        sink=sink,
        scaled=walk.scaled,
        bias_scale=product_scale,
        promoted=walk.promoted,
        narrowed=narrowed,
    )


def _narrowing(walk: _Walk, uses: list[ir.Node]) -> ir.DataType | None:
    """The operands' type where the probabilities of a promoted attention are only cast back
    to it (for a value product in that type: GPT-J, MPT), else None."""
    if walk.promoted is None or len(uses) != 1 or uses[0].op_type != "Cast":
        return None
    to = ir.DataType(uses[0].attributes.get_int("to", 0))
    return to if to == walk.narrow else None


def _max_shifted(ctx: PassContext, value: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """x behind x - ReduceMax(x, last axis, keepdims): the Softmax over the last axis is the
    same (it subtracts the row's maximum itself, so even the rounding is), and the nodes go
    to ``nodes``."""
    sub = producer_of(value, "Sub")
    if sub is None or sub.inputs[0] is None or len(value.uses()) != 1:
        return value
    peak = producer_of(sub.inputs[1], "ReduceMax")
    if peak is None or peak.inputs[0] is not sub.inputs[0]:
        return value
    axes, shape = node_axes(peak), ctx.shape(sub.inputs[0])
    if not peak.attributes.get_int("keepdims", 1) or axes is None or shape is None:
        return value
    if len(axes) != 1 or axes[0] % len(shape) != len(shape) - 1:
        return value
    nodes += [sub, peak]
    return sub.inputs[0]


def _sunk(
    ctx: PassContext, value: ir.Value, nodes: list[ir.Node]
) -> tuple[ir.Value, np.ndarray] | None:
    """(scores, sink values) of Concat(scores, column) on the last axis whose column is a
    constant logit per head broadcast to every row (Expand of [1, N, 1, 1], or the constant
    itself), possibly cast with the scores (a float16 sink joined to scores promoted to
    float32: the values as cast), the nodes going to ``nodes``."""
    concat = producer_of(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or None in concat.inputs:
        return None
    scores, column = concat.inputs
    assert scores is not None and column is not None
    shape = ctx.shape(scores)
    if shape is None or concat.attributes.get_int("axis", 0) % len(shape) != len(shape) - 1:
        return None
    joined: list[ir.Node] = [concat]
    casts: list[ir.DataType] = []  # outermost first
    for op_type in ("Cast", "Expand", "Cast"):
        node = producer_of(column, op_type)
        if node is None or node.inputs[0] is None:
            continue
        if op_type == "Cast":
            casts.append(ir.DataType(node.attributes.get_int("to", 0)))
        joined.append(node)
        column = node.inputs[0]
    values = constant_value(column)
    if values is None or values.ndim != len(shape) or values.shape[-1] != 1:
        return None
    for to in reversed(casts):
        values = values.astype(to.numpy())
    if any(size != 1 for axis, size in enumerate(values.shape) if axis != 1):
        return None  # one logit per head (axis 1), the same for every batch row and query
    nodes += joined
    return scores, values.reshape(-1)


def _lse_sink(
    ctx: PassContext, scores: ir.Value, context: ir.Value, nodes: list[ir.Node]
) -> tuple[ir.Value, np.ndarray] | None:
    """(scaled context, sink values) where the context [B, N, S, H] is scaled by
    sigmoid(logsumexp(scores) - sink), a constant logit per head (Granite-SWA): that is
    e^s @ v / (sum(e^s) + e^sink), a sink joined to the scores and dropped after the
    Softmax. Casts between float types may sit on the way (the float16 export computes the
    sigmoid in float32), which the fused op computes in its own; the nodes go to ``nodes``."""
    found: list[ir.Node] = []

    def through_casts(value: ir.Value | None) -> ir.Node | None:
        node = value.producer() if value is not None else None
        while node is not None and node.op_type == "Cast" and node.inputs[0] is not None:
            types = (ctx.dtype(node.inputs[0]), ctx.dtype(node.outputs[0]))
            if not all(dtype is not None and dtype.is_floating_point() for dtype in types):
                return None
            found.append(node)
            node = node.inputs[0].producer()
        return node

    users = [user for user, _ in context.uses() if user.op_type not in _SHAPE_READERS]
    if len(users) != 1 or users[0].op_type != "Mul" or context.is_graph_output():
        return None
    mul = users[0]
    other = mul.inputs[1] if mul.inputs[0] is context else mul.inputs[0]
    unsqueeze = through_casts(other)
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or node_axes(unsqueeze) != [-1]:
        return None
    sigmoid = through_casts(unsqueeze.inputs[0])
    sub = through_casts(sigmoid.inputs[0]) if sigmoid is not None else None
    if sigmoid is None or sigmoid.op_type != "Sigmoid" or sub is None or sub.op_type != "Sub":
        return None
    lse = sub.inputs[0].producer() if sub.inputs[0] is not None else None
    sink = constant_value(sub.inputs[1])
    shape = ctx.shape(scores)
    if lse is None or lse.op_type != "ReduceLogSumExp" or lse.inputs[0] is not scores:
        return None
    last = None if shape is None else [len(shape) - 1]
    if lse.attributes.get_int("keepdims", 1) != 0 or node_axes(lse) not in ([-1], last):
        return None
    if sink is None or sink.ndim != 3 or any(sink.shape[axis] != 1 for axis in (0, 2)):
        return None  # one logit per head, [1, N, 1] against the [B, N, S] log-sum-exp
    nodes += [lse, sub, sigmoid, unsqueeze, *found, mul]
    return mul.outputs[0], sink.reshape(-1)


def _sink_dropped(ctx: PassContext, probabilities: ir.Value) -> ir.Node | None:
    """The one Slice that drops the sink's column (the last) from the probabilities."""
    users = [user for user, _ in probabilities.uses()]
    if len(users) != 1 or users[0].op_type != "Slice" or probabilities.is_graph_output():
        return None
    shape = ctx.shape(probabilities)
    kept = last_axis_slice(users[0], len(shape)) if shape is not None else None
    return users[0] if kept == (0, -1) else None


def _reshaped_back(ctx: PassContext, value: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """``value`` again at the end of up to three Reshapes that provably give its shape back
    (eager attention views the probabilities as [B, N, S, L] and back for
    output_attentions); the Reshapes go to ``nodes``. Otherwise ``value`` itself."""
    current, chain = value, []
    for _ in range(3):
        reshape = _producer_user(current, "Reshape")
        if reshape is None:
            break
        chain.append(reshape)
        current = reshape.outputs[0]
        if _same_sizes(ctx, value, current):
            nodes += chain
            return current
    return value


def _keeps(ctx: PassContext, reshape: ir.Node, query: ir.Value) -> bool:
    """Whether a Reshape of the context [B, N, S, H] provably gives its shape back: same rank,
    every target size provably the context's on that axis but one, which may be -1 (the count
    then fixes it). The query heads' axis 2 is the context's: rows of the scores, of the
    probabilities, of the context (TorchScript reads S there)."""
    data = reshape.inputs[0]
    ranks = _ranks(ctx, reshape)
    if data is None or ranks is None or ranks[0] != ranks[1]:
        return False
    parts = target_parts(ctx, reshape.inputs[1])
    if parts is None or len(parts) != ranks[0]:
        return False
    free = [axis for axis, part in enumerate(parts) if isinstance(part, int) and part == -1]
    rows = (query, 2)
    return len(free) <= 1 and all(
        _proven(ctx, reshape, axis, data, axis) or (axis == 2 and parts[axis] == rows)
        for axis in range(ranks[0])
        if axis not in free
    )


def _same_sizes(ctx: PassContext, first: ir.Value, second: ir.Value) -> bool:
    """Whether two values provably have one shape: per axis one static size, one product of
    named dimensions (symbolic_size), or one onnxruntime symbolic expression."""
    shapes = ctx.shape(first), ctx.shape(second)
    if shapes[0] is None or shapes[1] is None or len(shapes[0]) != len(shapes[1]):
        return False
    return all(
        (isinstance(size, int) and size == other)
        or _equal_sizes(ctx, (first, axis), (second, axis))
        for axis, (size, other) in enumerate(zip(*shapes, strict=True))
    )


def _producer_user(value: ir.Value, op_type: str) -> ir.Node | None:
    """The value's only consumer apart from Shape readers, if it has that op type."""
    users = [user for user, _ in value.uses() if user.op_type not in _SHAPE_READERS]
    if len(users) != 1 or value.is_graph_output():
        return None
    user = users[0]
    return user if user.op_type == op_type and user.domain in ("", "ai.onnx") else None


_SHAPE_READERS = frozenset({"Shape", "Size"})


def _bias(ctx: PassContext, match: _Attention) -> tuple[list[ir.Value], str | None]:
    """The attention_bias inputs: the additive mask / position bias, dropped when zero."""
    kept = []
    for bias in match.biases + match.scaled:
        array = constant_value(bias)
        if array is not None and not np.any(array):
            continue  # an all-true mask folded to zeros adds nothing
        shape = ctx.shape(bias)
        if shape is None or len(shape) > 4:
            return [], "the additive mask or bias is not [batch, heads, query, key] or less"
        if bias in match.biases:
            kept.append(bias)
    return kept, None


def _rank(ctx: PassContext, value: ir.Value | None) -> int | None:
    """The value's rank where inferred and at most 4 (what attention_bias can broadcast)."""
    rank = ctx.rank(value)
    return rank if rank is not None and rank <= 4 else None


def _bias_source(node: ir.Node) -> ir.Value:
    """What a derived bias is computed from: a masked_fill's condition, a subtracted mask."""
    source = node.inputs[1] if node.op_type == "Sub" else node.inputs[0]
    assert source is not None
    return source


def _derived_bias(
    ctx: PassContext, node: ir.Node, shared: dict[object, tuple[ir.Value, ...]]
) -> tuple[ir.Value, list[ir.Node]]:
    """The additive bias of Sub(scores, b), Neg(b), or of a masked_fill Where(c, scores, m) /
    Where(c, m, scores), Where(c, 0, m) / Where(c, m, 0); once for every layer that shares it."""
    dtype = ctx.dtype(node.outputs[0]) or ir.DataType.FLOAT
    source = _bias_source(node)
    if node.op_type == "Sub":
        key: tuple = ("negated", source)
        if key not in shared:
            negate = ir.node("Neg", [source])
            typed(negate.outputs[0], dtype, ctx.shape(source))
            shared[key] = (negate.outputs[0],)
            return negate.outputs[0], [negate]
        return shared[key][0], []
    found = _masked_fill(node.outputs[0])
    assert found is not None
    fill_value = node.inputs[3 - found[1]]  # the constant m
    key = ("mask fill", source, _scalar(fill_value), found[1])
    if key in shared:
        return shared[key][0], []
    graph = node.graph
    assert graph is not None and fill_value is not None
    if ("fill zero", dtype) not in shared:
        zero = np.zeros((), dtype.numpy())
        shared["fill zero", dtype] = (new_constant(graph, f"{ctx.spec.name}/fill_zero", zero),)
    zero_value = shared["fill zero", dtype][0]
    inputs = [source, zero_value, fill_value]
    if found[1] == 2:
        inputs = [source, fill_value, zero_value]
    where = ir.node("Where", inputs)
    typed(where.outputs[0], dtype, ctx.shape(source))
    shared[key] = (where.outputs[0],)
    return where.outputs[0], [where]


def _scaled_bias(
    ctx: PassContext, match: _Attention, dtype: ir.DataType | None
) -> tuple[ir.Value, list[ir.Node]]:
    """bias_scale * (the sum of the biases added before the scale), the product's own scale
    carried over to the terms added to it."""
    graph = match.root.graph
    assert graph is not None
    built: list[ir.Node] = []
    total = match.scaled[0]
    for bias in match.scaled[1:]:
        built.append(ir.node("Add", [total, bias]))
        total = built[-1].outputs[0]
    numpy_type = (dtype or ir.DataType.FLOAT).numpy()
    name = f"{ctx.spec.name}/{match.root.name}/bias_scale"
    factor = new_constant(graph, name, np.array(match.bias_scale, numpy_type))
    built.append(ir.node("Mul", [total, factor]))
    shapes = [ctx.shape(bias) for bias in match.scaled]  # known: _bias checked them
    rank = max(len(shape) for shape in shapes)  # type: ignore[arg-type]
    aligned = [[1] * (rank - len(shape)) + list(shape) for shape in shapes]  # type: ignore[arg-type]
    dims = [next((d for d in column if d != 1), 1) for column in zip(*aligned, strict=True)]
    for node in built:
        typed(node.outputs[0], dtype, ir.Shape(dims))
    return built[-1].outputs[0], built


def _widened(
    ctx: PassContext,
    graph: ir.Graph,
    bias: ir.Value,
    shared: dict[object, tuple[ir.Value, ...]],
    single_head: bool,
) -> tuple[ir.Value, list[ir.Node]]:
    """A bias of rank < 4 ([query, key], a causal mask) broadcasts as [1, ..., query, key]:
    the fused op takes it 4-D, Unsqueezed once for every layer that adds it (in ``graph``, the
    fused op's: the bias may be one the rewrite builds). Added to 3-D scores [X, S, L] read as
    one head over a batch of X, a 3-D bias is [X or 1, 1, S, L]."""
    shape = ctx.shape(bias)
    assert shape is not None
    missing = 4 - len(shape)
    if missing == 0:
        return bias, []
    leading = [1] if single_head and len(shape) == 3 else list(range(missing))
    key = ("4-D bias", bias, tuple(leading))
    if key in shared:
        return shared[key][0], []
    name = f"{ctx.spec.name}/unsqueeze_axes_{'_'.join(map(str, leading))}"
    unsqueeze = new_unsqueeze(ctx, graph, bias, leading, name)
    widened = list(shape)
    for axis in leading:
        widened.insert(axis, 1)
    typed(unsqueeze.outputs[0], bias.dtype, ir.Shape(widened))
    shared[key] = (unsqueeze.outputs[0],)
    return unsqueeze.outputs[0], [unsqueeze]


def _one_row(ctx: PassContext, value: ir.Value | None, axis: int = 2) -> bool:
    """Whether a 4-D bias holds one row for every query position ([.., 1, key]); with
    ``axis`` 1, whether a [B, S, D] query has one position."""
    shape = ctx.shape(value) if value is not None else None
    return shape is not None and len(shape) > axis and shape[axis] == 1


def _one_column(ctx: PassContext, match: _Attention, biases: list[ir.Value]) -> bool:
    """Whether some bias broadcasts one column over keys the scores have more of (its last
    axis 1, theirs not provably 1): the contrib ops refuse it when they run."""
    softmax = next(node for node in match.nodes if node.op_type == "Softmax")
    scores = ctx.shape(softmax.inputs[0])
    if scores is not None and len(scores) > 0 and scores[-1] == 1:
        return False
    added = [*biases, *match.scaled, *(_bias_source(node) for node in match.derived)]
    shapes = [ctx.shape(bias) for bias in added]
    return any(shape is not None and (len(shape) == 0 or shape[-1] == 1) for shape in shapes)


def _expanded_rows(
    ctx: PassContext,
    root: ir.Node,
    bias: ir.Value,
    query: ir.Value,
    shared: dict[object, tuple[ir.Value, ...]],
) -> tuple[ir.Value, list[ir.Node]]:
    """A [.., 1, key] bias broadcast over the query's rows (its axis 1): onnxruntime's
    MultiHeadAttention and GroupQueryAttention take an attention_bias with every row (a key
    padding mask nn.MultiheadAttention merges in is [B, N, 1, L]). Once per bias and query."""
    key = ("bias rows", bias, query)
    if key in shared:
        return shared[key][0], []
    graph = root.graph
    assert graph is not None
    name = f"{ctx.spec.name}/bias_rows"
    if ctx.opset >= 15:
        length = ir.node("Shape", [query], attributes={"start": 1, "end": 2})
        nodes = [length]
    else:
        whole = ir.node("Shape", [query])
        index = new_constant(graph, f"{name}/axis", np.array([1], np.int64))
        length = ir.node("Gather", [whole.outputs[0], index])
        nodes = [whole, length]
    ones = new_constant(graph, f"{name}/ones", np.array([1, 1], np.int64))
    one = new_constant(graph, f"{name}/one", np.array([1], np.int64))
    target = ir.node("Concat", [ones, length.outputs[0], one], attributes={"axis": 0})
    expand = ir.node("Expand", [bias, target.outputs[0]])
    rows = ctx.shape(query)
    for node in nodes:  # the sequence length, [1]; the whole shape, [rank]
        whole = node.op_type == "Shape" and "start" not in node.attributes
        length = len(rows) if whole and rows is not None else None if whole else 1
        typed(node.outputs[0], ir.DataType.INT64, ir.Shape([length]))
    typed(target.outputs[0], ir.DataType.INT64, ir.Shape([4]))
    shape = ctx.shape(bias)
    known = None if shape is None or rows is None else ir.Shape([*shape[:2], rows[1], shape[3]])
    typed(expand.outputs[0], ctx.dtype(bias), known)
    shared[key] = (expand.outputs[0],)
    return expand.outputs[0], [*nodes, target, expand]


def _uncast(bias: ir.Value) -> tuple[ir.Value, ir.DataType | None]:
    """The value behind a Cast of the bias (its promotion to the type the op computes in) and
    the type cast to; the bias itself and None where it is no Cast."""
    cast = producer_of(bias, "Cast")
    if cast is None or cast.inputs[0] is None:
        return bias, None
    return cast.inputs[0], ir.DataType(cast.attributes.get_int("to", 0))


def _bias_values(bias: ir.Value) -> list[np.ndarray] | None:
    """Every value the additive bias can hold, when known: a constant, or the constant
    branches of Where(c, a, b) (how exporters build padding masks), either possibly cast to
    another float type (a float16 mask promoted with the scores)."""
    source, to = _uncast(bias)
    if to is not None:
        values = _bias_values(source)
        return None if values is None else [v.astype(to.numpy()) for v in values]
    array = constant_value(bias)
    if array is not None:
        return [array]
    where = producer_of(bias, "Where")
    if where is None:
        return None
    branches = [constant_value(v) for v in where.inputs[1:]]
    return None if any(b is None for b in branches) else branches  # type: ignore[return-value]


def _finite(bias: ir.Value) -> bool:
    """Whether the additive bias is known to hold no -inf (then no row can become NaN)."""
    values = _bias_values(bias)
    return values is not None and all(bool(np.all(np.isfinite(v))) for v in values)


# A mask value that still zeroes a masked score's weight (exp(-1e30 - max) is 0 in fp32) and,
# in a fully masked row, still drowns every score (fp32 spacing at 1e30 is ~7.6e22).
_MASKED = np.float32(-1e30)


def _clamped(
    bias: ir.Value, root: ir.Node, shared: dict[object, tuple[ir.Value, ...]]
) -> tuple[ir.Value, list[ir.Node]]:
    """The bias (its values known: see _bias_values) with values below -1e30 (exporters write
    -FLT_MAX) raised to -1e30, computed once per bias."""
    values = _bias_values(bias)
    assert values is not None
    if all(bool(np.all(v > _MASKED)) for v in values):
        return bias, []
    if bias in shared:
        return shared[bias][0], []
    graph = root.graph
    assert graph is not None
    label = f"AttentionFusionPass/{bias.name or root.name}/masked"
    branches = [new_constant(graph, label, np.maximum(v, _MASKED)) for v in values]
    if len(branches) == 1:
        shared[bias] = (branches[0],)
        return branches[0], []
    where = producer_of(_uncast(bias)[0], "Where")  # the branches are the cast's type already
    assert where is not None
    select = ir.node("Where", [where.inputs[0], *branches])
    typed(select.outputs[0], bias.dtype, bias.shape)
    shared[bias] = (select.outputs[0],)
    return select.outputs[0], [select]


def _merged_heads(
    ctx: PassContext,
    heads: ir.Value,
    shared: dict[object, tuple[ir.Value, ...]],
    *,
    transposed: bool,
    graph: ir.Graph,
) -> tuple[ir.Value, list[ir.Node]] | str:
    """The [B, S, N*H] operand the fused op reads, computed from heads that are not a plain
    head split of a projection (heads transformed after the split, or split from a fused QKV
    projection): [B, N, S, H] heads (``transposed``) go through Transpose([0, 2, 1, 3]) first,
    [B, S, N, H] ones straight to Reshape(., [0, 0, N*H]), the target shared by the layers.
    One head [B, 1, S, H] (multi-query attention's key and value) needs no Transpose: it is
    Reshape(., [0, -1, H])."""
    shape = ctx.shape(heads)
    if shape is None or len(shape) != 4:
        return "the query or key heads are not provably 4-D"
    heads_axis, sequence_axis = (1, 2) if transposed else (2, 1)
    count, size = axis_size(ctx, heads, heads_axis), axis_size(ctx, heads, 3)
    if count is None or size is None:
        return "the number of heads or the head size of the query or key is unknown"
    one_head = transposed and count == 1
    target = [0, -1, size] if one_head else [0, 0, count * size]
    key = ("merged heads", *target)
    if key not in shared:
        name = f"{ctx.spec.name}/merged_heads_{'_'.join(map(str, target))}"
        shared[key] = (new_constant(graph, name, np.array(target, np.int64)),)
    nodes: list[ir.Node] = []
    source = heads
    permuted = producer_of(heads, "Transpose") if transposed and not one_head else None
    undone = permuted is not None and _perm(permuted) == HEADS_PERM  # [B, S, N, H] permuted
    if undone and permuted is not None and permuted.inputs[0] is not None:
        source = permuted.inputs[0]  # read before the permute, which the merge would undo
    elif transposed and not one_head:  # typed with the sizes proven above, not inferred ones
        swap = ir.node("Transpose", [heads], attributes={"perm": HEADS_PERM})
        typed(swap.outputs[0], heads.dtype, ir.Shape([shape[0], shape[2], count, size]))
        nodes.append(swap)
        source = swap.outputs[0]
    merge = ir.node("Reshape", [source, shared[key][0]])
    typed(merge.outputs[0], heads.dtype, ir.Shape([shape[0], shape[sequence_axis], count * size]))
    return merge.outputs[0], [*nodes, merge]


def _graph(match: _Attention) -> ir.Graph:
    """The graph the site is in (heads built for it, not inserted yet, have none)."""
    graph = match.root.graph
    assert graph is not None
    return graph


def _split_back(
    ctx: PassContext,
    root: ir.Node,
    output: ir.Value,
    perm: list[int],
    layout: tuple[int, int],
    shared: dict[object, tuple[ir.Value, ...]],
) -> list[ir.Node]:
    """The fused op's [B, S, N*H] output as the context the graph read: split into [B, S, N,
    H] heads (the target shared by the layers), then transposed by ``perm``."""
    heads, head_size = layout
    key = ("split heads", heads, head_size)
    if key not in shared:
        graph = root.graph
        assert graph is not None
        name = f"{ctx.spec.name}/split_heads_{heads}x{head_size}"
        target = np.array([0, 0, heads, head_size], np.int64)
        shared[key] = (new_constant(graph, name, target),)
    split = ir.node("Reshape", [output, shared[key][0]])
    shape = ctx.shape(output)
    assert shape is not None
    typed(split.outputs[0], ctx.dtype(output), ir.Shape([shape[0], shape[1], heads, head_size]))
    if perm == [0, 1, 2, 3]:
        return [split]
    _, swap = new_transpose(ctx, split.outputs[0], perm)
    return [split, swap]


def _proven(ctx: PassContext, reshape: ir.Node, index: int, value: ir.Value, axis: int) -> bool:
    """Whether the Reshape's output size at ``index`` is provably ``value``'s at ``axis``:
    equal static sizes or names, or a target element read from that size."""
    result, shape = ctx.shape(reshape.outputs[0]), ctx.shape(value)
    if result is None or shape is None:
        return False
    mine, theirs = result[index], shape[axis]
    if isinstance(mine, int) or isinstance(theirs, int):
        return mine == theirs
    if named(mine) and mine.value == theirs.value:
        return True
    parts = target_parts(ctx, reshape.inputs[1])
    part = parts[index] if parts is not None and index < len(parts) else None
    if isinstance(part, tuple):
        copied = ctx.shape(part[0])
        size = (
            copied[part[1]] if copied is not None and -len(copied) < part[1] < len(copied) else None
        )
        if same_dimension(part, size, value, axis, shape):
            return True
    return _equal_sizes(ctx, (reshape.outputs[0], index), (value, axis))


def _equal_sizes(ctx: PassContext, *sizes: tuple[ir.Value, int]) -> bool:
    """Whether these (value, axis) sizes are provably one: one product of static sizes and
    named dimensions (symbolic_size), else one expression of onnxruntime's symbolic shape
    inference on the graph as loaded (TorchScript computes sizes at run time from other
    tensors' shapes, through broadcasts, where onnx's inference names each anew)."""
    traced = {symbolic_size(ctx, value, axis) for value, axis in sizes}
    if len(traced) == 1 and None not in traced:
        return True
    if ctx.shapes is None:
        return False
    dims = ctx.shapes.symbolic_dims([value for value, _ in sizes])
    found = {
        str(shape[axis]) if shape is not None and -len(shape) <= axis < len(shape) else None
        for shape, (_, axis) in zip(dims, sizes, strict=True)
    }
    return len(found) == 1 and None not in found and "None" not in found


def _unfolded(ctx: PassContext, match: _Attention, heads: int) -> str | None:
    """Why the Reshapes into and out of the [B*N, ...] layout are not provably heads folded
    into the batch: a fold [B, N, X, Y] -> [B*N, X, Y] keeps the last two sizes, an unfold
    [B*N, X, Y] -> [B, N, X, Y] has N = heads and keeps X and Y (or the batch: the count
    then fixes Y)."""
    for reshape in match.folds:
        data = reshape.inputs[0]
        assert data is not None
        if _ranks(ctx, reshape) == (4, 3):
            kept = _proven(ctx, reshape, 1, data, 2) and _proven(ctx, reshape, 2, data, 3)
        else:
            kept = (
                axis_size(ctx, reshape.outputs[0], 1) == heads
                and _proven(ctx, reshape, 2, data, 1)
                and (_proven(ctx, reshape, 3, data, 2) or _proven(ctx, reshape, 0, match.heads, 0))
            )
        if not kept:
            layouts = "[batch, heads, X, Y] and [batch*heads, X, Y]"
            return f"a Reshape between {layouts} does not provably keep X and Y (sizes unknown)"
    return None


def _unfolded_biases(
    ctx: PassContext, match: _Attention, heads: int, shared: dict[object, tuple[ir.Value, ...]]
) -> tuple[list[ir.Value], list[ir.Node]] | str:
    """Biases added to the folded scores as 4-D [B, N, S, L] biases: one of rank < 3 or led
    by 1 broadcasts the same way in 4-D; one led by B*N is Reshape(Unsqueeze(b, 1), [-1, N,
    0, 0]), once for every layer that adds it (Bloom's ALiBi)."""
    fold = match.folds[1]  # the query's: [B*N, S, H]
    values: list[ir.Value] = []
    nodes: list[ir.Node] = []
    for bias in match.folded:
        shape = ctx.shape(bias)
        if shape is None or len(shape) > 3:
            return "a bias added to the [batch*heads, ...] scores is not 3-D or less"
        leading = symbolic_size(ctx, bias, 0) if len(shape) == 3 else (1, ())
        if leading == (1, ()):
            values.append(bias)
            continue
        if leading is None or leading != symbolic_size(ctx, fold.outputs[0], 0):
            return (
                "a bias added to the [batch*heads, ...] scores is not provably led by 1 or "
                f"batch*heads (its leading size is {shape[0]})"
            )
        key = ("unfolded bias", bias, heads)
        if key not in shared:
            graph = match.root.graph
            assert graph is not None
            name = f"{ctx.spec.name}/unfold_{heads}"
            widen = new_unsqueeze(ctx, graph, bias, [1], f"{name}/axis")
            target = new_constant(graph, f"{name}/target", np.array([-1, heads, 0, 0], np.int64))
            unfold = ir.node("Reshape", [widen.outputs[0], target])
            typed(widen.outputs[0], bias.dtype, ir.Shape([shape[0], 1, shape[1], shape[2]]))
            typed(unfold.outputs[0], bias.dtype, ir.Shape([None, heads, shape[1], shape[2]]))
            nodes += [widen, unfold]
            shared[key] = (unfold.outputs[0],)
        values.append(shared[key][0])
    return values, nodes


def _forget_unplaced(shared: dict[object, tuple[ir.Value, ...]], graph: ir.Graph) -> None:
    """Drop the values a site built for the layers to share where the site did not land
    (declined after building them, or left out by a bisection): a later site reading one would
    read a node that is in no graph."""
    for key, values in list(shared.items()):
        if any(v.producer() is not None and v.producer().graph is not graph for v in values):
            del shared[key]


def _one_head(ctx: PassContext, operand: _Heads) -> tuple[ir.Value, list[ir.Node]] | None:
    """The one [B, 1, L, H] key or value head that every query head reads (multi-query
    attention), whatever spells it out: repeated by repeat_kv (GPT-BigCode's sdpa) or
    broadcast by the MatMul (Falcon); with the nodes of the repeat."""
    heads, nodes = operand.kv if operand.kv is not None else (operand.tensor, [])
    if heads is None or axis_size(ctx, heads, 1) != 1:
        return None
    return heads, nodes


def _shared_head(ctx: PassContext, match: _Attention) -> bool:
    """Multi-query attention: key and value hold one head, shared by all the query heads."""
    return all(_one_head(ctx, operand) is not None for operand in (match.key, match.value))


def _is_heads(ctx: PassContext, value: ir.Value, heads: int, head_size: int | None) -> bool:
    """Whether ``value`` is provably [batch, heads, length, head size] (None: any known
    head size, as a value's may differ from the query's)."""
    shape = ctx.shape(value)
    if shape is None or len(shape) != 4:
        return False
    size = axis_size(ctx, value, 3)
    return axis_size(ctx, value, 1) == heads and size is not None and head_size in (None, size)


def _head_layout(ctx: PassContext, heads: ir.Value, query: ir.Shape) -> tuple[int, int] | None:
    """(N, H) of the split query [B, N, S, H], derived through the layout ops where shape
    inference does not know them (LeViT's Split of a fused projection); N is hidden / H when
    only the head size is known."""
    shape = ctx.shape(heads)
    if shape is None or len(shape) != 4:
        return None
    count, size = axis_size(ctx, heads, 1), axis_size(ctx, heads, 3)
    if size is None:
        return None
    if count is None and isinstance(query[2], int) and query[2] % size == 0:
        count = int(query[2]) // size
    return None if count is None else (count, size)


def _fused_shape(query: ir.Shape, replaced: ir.Shape) -> ir.Shape:
    """The fused op's output: [batch, sequence] of the query by the replaced output's hidden
    size (unknown when the replaced output was flattened to 2-D).

    onnx cannot infer the contrib ops, and the replaced output's batch may be a fresh symbol
    (the scores broadcast against the mask's batch), where proving that a later residual Add
    broadcasts nothing needs the query's. The rest of a replaced shape stays as inferred: a
    hidden size made static here would let a second run fold what the first could not.
    """
    if len(replaced) != 3:
        return ir.Shape([query[0], query[1], None])
    old = list(replaced)
    leading = [o if isinstance(o, int) else q for o, q in zip(old[:2], query[:2], strict=True)]
    return ir.Shape([*leading, old[2]])


_VIEWS = frozenset({"Reshape", "Transpose", "Concat"})


def _still_read(
    ctx: PassContext, nodes: list[ir.Node], outputs: list[ir.Value]
) -> set[ir.Node] | None:
    """The matched nodes that must stay because a value they compute (other than the
    ``outputs`` the fused op replaces) is read outside the match, with the matched nodes they
    read; None if any of them is more than data movement
    or integer shape arithmetic (keeping it would duplicate real work).

    TorchScript's T5 takes the key length for its position bias from a transposed copy of the
    key's head split: that Reshape stays beside the fused op, computing what it did.
    """
    members = set(nodes)

    def read_outside(node: ir.Node) -> bool:
        return any(
            value not in outputs
            and (value.is_graph_output() or any(user not in members for user, _ in value.uses()))
            for value in node.outputs
        )

    pending = [node for node in nodes if read_outside(node)]
    staying: set[ir.Node] = set()
    while pending:
        node = pending.pop()
        if node in staying:
            continue
        integer = all(ctx.dtype(value) in INDEX_TYPES for value in node.outputs)
        if not integer and (node.op_type not in _VIEWS or node.domain not in ("", "ai.onnx")):
            return None
        staying.add(node)
        pending += [v.producer() for v in node.inputs if v is not None and v.producer() in members]
    return staying


@dataclass
class _Plan:
    """What an attention pass makes of a match (or a reason it declines, or None when the
    site is another pass's to take)."""

    inputs: list[ir.Value | None]  # the fused op's leading inputs, before attention_bias
    attributes: dict[str, int | float]  # besides scale
    absorbed: list[ir.Node]  # matched nodes the op also replaces
    # A KV cache the op appends to: (past_key, past_value), the inputs after attention_bias,
    # and (present_key, present_value), the matched Concats' outputs its second and third
    # outputs replace.
    pasts: list[ir.Value] = field(default_factory=list)
    presents: list[ir.Value] = field(default_factory=list)


# Inputs computed for the fused op, with the nodes computing them (see _prelude).
_Prelude = tuple[list[ir.Value], list[ir.Node]]


class _AttentionFusion(FusionPass):
    """Match at every Softmax, let the subclass map the operands, replace and count."""

    counts_changes = True

    op_type: ClassVar[str]
    bias_input: ClassVar[int]  # position of attention_bias among the op's inputs
    # The kernel takes -FLT_MAX in the mask for -inf: a fully masked row then gets zero
    # weights instead of the uniform ones the written-out softmax gives it (see _clamped).
    clamps_mask: ClassVar[bool] = False
    # The op has a softcap attribute, applied to the scaled scores before the bias is added.
    softcaps: ClassVar[bool] = False
    # The op's input taking a sink logit per head (head_sink), if it has one.
    sink_input: ClassVar[int | None] = None

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern(self.op_type)
        shared: dict[object, tuple[ir.Value, ...]] = {}
        for softmax in ctx.op_index.of_type(model.graph, "Softmax"):
            if softmax.graph is not model.graph:
                continue
            found = _match(ctx, softmax)
            if isinstance(found, str) and not attention_shaped(softmax):
                continue  # a Softmax of something else (a classifier head, a gate)
            label = softmax.name or softmax.op_type
            reason = found if isinstance(found, str) else self._fuse(ctx, found, shared)
            _forget_unplaced(shared, model.graph)
            if reason is not None:
                stats.decline(reason, label)

    def _plan(
        self,
        ctx: PassContext,
        match: _Attention,
        heads: int,
        head_size: int,
        shared: dict[object, tuple[ir.Value, ...]],
    ) -> _Plan | str | None:
        raise NotImplementedError

    def _prelude(
        self, ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
    ) -> _Prelude:
        """Inputs to compute once the site is sure to fuse, placed after the planned ones."""
        return [], []

    def _merge_operands(
        self, ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
    ) -> list[ir.Node] | str:
        """Key/value heads this op reads merged back to [B, L, N*H] (their projections set on
        the match), with the nodes computing them; or why they cannot be."""
        return []

    def _fuse(
        self, ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
    ) -> str | None:
        merged: list[ir.Node] = []
        if match.head_scale is not None:  # scale the query heads instead of the scores
            if match.single_head or match.folds:
                return "the scores are scaled per head, but the heads are folded into the batch"
            scaled = ir.node("Mul", [match.heads, match.head_scale])
            typed(scaled.outputs[0], ctx.dtype(match.heads), ctx.shape(match.heads))
            merged.append(scaled)
            match.heads, match.query = scaled.outputs[0], None
        if match.query is None:
            found = _merged_heads(ctx, match.heads, shared, transposed=True, graph=_graph(match))
            if isinstance(found, str):
                return found
            match.query, query_nodes = found
            merged += query_nodes
        if match.key.swapped is not None:  # K from K^T: the projection (3-D) or the heads
            swapped, swap = new_transpose(ctx, *match.key.swapped)
            merged.append(swap)
            if len(match.key.swapped[1]) == 4:
                match.key.tensor = swapped
            else:
                match.key.projection = swapped
        if match.key.unsplit is not None and match.key.projection is None:
            found = _merged_heads(
                ctx, match.key.unsplit, shared, transposed=False, graph=_graph(match)
            )
            if isinstance(found, str):
                return found
            match.key.projection, nodes = found
            merged += nodes
        operands = self._merge_operands(ctx, match, shared)
        if isinstance(operands, str):
            disconnect(merged)
            return operands
        merged += operands
        try:
            return self._fuse_with(ctx, match, merged, shared)
        finally:  # a declined site's merge nodes must not stay readers of the heads
            disconnect(merged)

    def _fuse_with(
        self,
        ctx: PassContext,
        match: _Attention,
        merged: list[ir.Node],
        shared: dict[object, tuple[ir.Value, ...]],
    ) -> str | None:
        assert match.query is not None
        if match.scale == 0:  # onnxruntime's attention ops read a scale of 0 as unset
            return "the scores are scaled by 0, which the fused ops read as 1/sqrt(head size)"
        query, replaced = ctx.shape(match.query), ctx.shape(match.output)
        if query is None or replaced is None:
            return "the query projection or the output has an unknown rank"
        if len(query) != 3:
            return "the query projection is not 3-D [batch, sequence, hidden]"
        if match.single_head:
            size = axis_size(ctx, match.heads, 2)
            layout = (1, size) if size is not None else None
        else:
            layout = _head_layout(ctx, match.heads, query)
        if layout is None:
            return "the number of heads or the head size is unknown"
        heads, head_size = layout
        if match.folds:
            reason = _unfolded(ctx, match, heads)
            unfolded = _unfolded_biases(ctx, match, heads, shared) if reason is None else reason
            if isinstance(unfolded, str):
                return unfolded
            match.biases += unfolded[0]
            merged += unfolded[1]
        plan = self._plan(ctx, match, heads, head_size, shared)
        if plan is None or isinstance(plan, str):
            return plan
        inputs, attributes = plan.inputs, plan.attributes
        if match.softcap and not self.softcaps:
            return (
                f"the scores are soft-capped (tanh), which {self.op_type} cannot express "
                "(GroupQueryAttention and the opset-23 Attention have a softcap attribute)"
            )
        if match.softcap:
            attributes = {**attributes, "softcap": match.softcap}
        if match.sink is not None and self.sink_input is None:
            return (
                f"the Softmax has a sink per head (a logit joined to the scores and dropped "
                f"after it), which {self.op_type} cannot take (GroupQueryAttention's head_sink)"
            )
        if match.sink is not None and match.sink.size not in (1, heads):
            return "the sink logits are not one per head"
        nodes = match.nodes + plan.absorbed
        keep = {value for value in inputs if value is not None}
        keep |= set(match.biases) | set(match.folded) | set(match.scaled) | set(plan.pasts)
        keep |= {_bias_source(node) for node in match.derived}
        # Flattened to 2-D for the next Linear (a later Reshape folded into this one): the
        # fused op's [B, S, hidden] output gets that Reshape back.
        flatten = match.split_back is None and len(replaced) != 3
        if flatten:
            keep.add(match.root.inputs[1])
        absorb_shape_arithmetic(ctx, nodes, keep)
        replaced_outputs = [match.output, *plan.presents]
        # Shapes read from the scores (XLNet's key length) or ahead of the op from the presents
        # (GPT-2's mask its length): read from what stays instead.
        reads = size_reads(ctx, nodes, replaced_outputs, keep, plan.presents) or {}
        read_outputs = [reader.outputs[0] for reader in reads]
        staying = _still_read(ctx, [*nodes, *reads], [*replaced_outputs, *read_outputs])
        if staying is None:
            return uses_outside(nodes, replaced_outputs)
        dtype = match.promoted or ctx.dtype(match.query)
        if match.promoted is not None and plan.presents:
            return (
                f"the attention computes in {match.promoted} from promoted operands, but the "
                "cache it appends to keeps their type"
            )
        domain = self.spec.emits_domain
        opset = ctx.opset if domain == "" else 1
        if ctx.target == "ort" and not runtime.has_kernel(self.op_type, domain, opset, dtype):
            name = f"{domain}.{self.op_type}" if domain else self.op_type
            return f"onnxruntime has no {name} kernel for {dtype}"
        biases, reason = _bias(ctx, match)
        if reason is not None:
            return reason
        if self.clamps_mask and any(_bias_values(b) is None for b in biases):
            return (
                "the additive mask is not a constant or a Where of constants, so it may "
                "hold -FLT_MAX, which the standard Attention kernel takes for -inf"
            )
        if match.floored and not all(_finite(b) for b in biases):
            return "the scores are floored by Max(., -FLT_MAX) and the additive mask may hold -inf"
        if any(_rank(ctx, _bias_source(node)) is None for node in match.derived):
            return "a masked_fill's condition or a subtracted mask has an unknown rank or > 4 axes"
        if self.clamps_mask and any(node.op_type == "Sub" for node in match.derived):
            return (
                "a mask is subtracted from the scores, its values unknown, so it may hold "
                "FLT_MAX, which the standard Attention kernel takes for inf"
            )
        if self.clamps_mask and match.scaled:
            return (
                "a bias is added before the scale, its values unknown, so it may hold "
                "-FLT_MAX, which the standard Attention kernel takes for -inf"
            )
        if domain == MS and _one_column(ctx, match, biases):
            return (
                "the additive mask has one column for every key ([.., 1]): onnxruntime's "
                "attention ops take attention_bias with a column per key"
            )
        new_nodes: list[ir.Node] = list(merged)
        for node in match.derived:  # last: no site declines past this point
            bias, built = _derived_bias(ctx, node, shared)
            biases.append(bias)
            new_nodes += built
        if match.scaled:
            bias, built = _scaled_bias(ctx, match, ctx.dtype(match.scaled[0]) or dtype)
            biases.append(bias)
            new_nodes += built
        if match.promoted is not None:  # biases added before the promotion, in its source type
            biases = [_promoted(ctx, bias, match.promoted, shared, new_nodes) for bias in biases]
        if self.clamps_mask:
            clamped = [_clamped(b, match.root, shared) for b in biases]
            biases = [value for value, _ in clamped]
            new_nodes += [node for _, nodes in clamped for node in nodes]
        graph = match.root.graph
        assert graph is not None
        widened = [_widened(ctx, graph, bias, shared, match.single_head) for bias in biases]
        biases = widened_biases = [value for value, _ in widened]
        new_nodes += [node for _, nodes in widened for node in nodes]
        computed, prelude = self._prelude(ctx, match, shared)
        new_nodes += prelude
        inputs = inputs + computed
        if match.promoted is not None:  # the operands as the original computes with them
            inputs = [
                None if value is None else _promoted(ctx, value, match.promoted, shared, new_nodes)
                for value in inputs
            ]
        while len(biases) > 1:  # mask + position bias: summed once for the layers sharing both
            key = ("bias sum", *biases[:2])
            if key not in shared:
                total = ir.node("Add", biases[:2])
                new_nodes.append(total)
                shared[key] = (total.outputs[0],)
            biases = [shared[key][0], *biases[2:]]
        if (
            biases
            and domain == MS
            and all(_one_row(ctx, bias) for bias in widened_biases)
            and not _one_row(ctx, inputs[0], axis=1)  # one query row: every row there is
        ):
            query_input = inputs[0]
            assert query_input is not None
            rows, expanding = _expanded_rows(ctx, match.root, biases[0], query_input, shared)
            biases, new_nodes = [rows], new_nodes + expanding
        inputs = inputs + [None] * (self.bias_input - len(inputs)) + (biases or [None])
        inputs += plan.pasts
        if match.sink is not None and self.sink_input is not None:
            graph = match.root.graph
            assert graph is not None and dtype is not None
            sink = np.broadcast_to(match.sink, (heads,)).astype(dtype.numpy())
            name = f"{ctx.spec.name}/{match.root.name}/head_sink"
            inputs += [None] * (self.sink_input - len(inputs)) + [new_constant(graph, name, sink)]
        while inputs[-1] is None:
            inputs.pop()
        attention = ir.node(
            self.op_type,
            inputs,
            attributes={"scale": float(match.scale), **attributes},
            domain=domain,
            num_outputs=1 + len(plan.presents),
        )
        new_nodes.append(attention)
        result = attention.outputs[0]
        guarded: list[ir.Value] = []  # the guard's test: typed with the output's shape below
        if match.guarded and not all(_finite(b) for b in biases):
            # A query row masked everywhere with -inf makes the kernel's softmax NaN, where
            # the original's guard gave it zero weights: zero those context rows the same way.
            graph = match.root.graph
            assert graph is not None
            zero = new_constant(
                graph, f"{ctx.spec.name}/{match.root.name}/zero", np.zeros(1, np.float32)
            )
            nan = ir.node("IsNaN", [result])
            guard = ir.node("Where", [nan.outputs[0], zero, result])
            new_nodes += [nan, guard]
            guarded.append(nan.outputs[0])
            result = guard.outputs[0]
        if match.narrowed is not None:  # the context as the original's value product types it
            narrow = ir.node("Cast", [result], attributes={"to": match.narrowed})
            new_nodes.append(narrow)
            result = narrow.outputs[0]
        fused = ir.Shape([query[0], query[1], None]) if flatten else _fused_shape(query, replaced)
        if match.split_back is not None:
            perm, value_size = match.split_back
            fused = ir.Shape([query[0], query[1], heads * value_size])
            typed(result, match.narrowed or dtype, fused)
            back = _split_back(ctx, match.root, result, perm, (heads, value_size), shared)
            new_nodes += back
            result = back[-1].outputs[0]
        if flatten:
            reshape = ir.node("Reshape", [result, match.root.inputs[1]])
            new_nodes.append(reshape)
            result = reshape.outputs[0]
        graph = match.root.graph
        assert graph is not None
        removed = {*nodes, *reads}
        rereads = [
            read_again(ctx, graph, f"{ctx.spec.name}/{reader.name}", reader, parts, removed)
            for reader, parts in reads.items()
        ]
        sizes = [node for reread in rereads for node in reread.nodes]
        refused = replace_subgraph(
            ctx,
            self.op_type,
            match.root,
            [node for node in [*nodes, *reads] if node not in staying]
            + [node for reread in rereads for node in reread.replaced_nodes],
            new_nodes + sizes,
            [*replaced_outputs, *(value for reread in rereads for value in reread.replaced)],
            [
                result,
                *attention.outputs[1:],
                *(value for reread in rereads for value in reread.values),
            ],
        )
        if refused is not None:  # left out by a bisection (and counted): so are its new values
            disconnect(sizes)
            return None
        for reread in rereads:  # new ones placed at the fused op; their readers come before it
            move_before_readers(graph, reread.reading)
        # After the replacement, which gives ``result`` the replaced value's shape and type.
        output = attention.outputs[0]
        output.shape = fused
        for test in guarded:  # known now, so a second run infers nothing new for it
            typed(test, ir.DataType.BOOL, fused)
        if output.type is None and dtype is not None:
            output.type = ir.TensorType(dtype)
        if not flatten and match.split_back is None:
            result.shape = output.shape  # the NaN guard keeps the shape
        return None


def _plain(operand: _Heads) -> bool:
    return operand.projection is not None and not operand.repeated


@register_pass
class MultiHeadAttentionFusionPass(_AttentionFusion):
    spec = PassSpec(
        name="MultiHeadAttentionFusionPass",
        category=Category.UB,
        description="written-out scaled dot-product attention (BERT/ViT bidirectional, GPT-2 "
        "causal, T5 position bias, KV cache, repeated KV heads) -> com.microsoft "
        "MultiHeadAttention",
        aliases=("FlashAttentionFusionV1", "multi_head_attention_fusion", "AttentionFusion"),
        numerics=Numerics.REASSOCIATING,
        priority=4500,
        targets=("ort",),
        emits=("MultiHeadAttention",),
        emits_domain=MS,
    )
    op_type = "MultiHeadAttention"
    bias_input = 5

    def _plan(
        self,
        ctx: PassContext,
        match: _Attention,
        heads: int,
        head_size: int,
        shared: dict[object, tuple[ir.Value, ...]],
    ) -> _Plan | str | None:
        key, value = match.key, match.value
        if _plain(key) and _plain(value):
            projections = [match.query, key.projection, value.projection]
            shapes = [ctx.shape(v) for v in projections]
            if any(shape is None or len(shape) != 3 for shape in shapes):
                return "a Q/K/V projection is not 3-D [batch, sequence, hidden]"
            return _Plan(projections, {"num_heads": heads}, key.nodes + value.nodes)
        # A KV cache (Concat(past, new)) or repeated KV heads: read [B, N, L, H] as it is.
        for operand, size in ((key, head_size), (value, None)):
            tensor = operand.tensor
            if tensor is None or not _is_heads(ctx, tensor, heads, size):
                return "the key or value is not provably [batch, heads, length, head size]"
        if axis_size(ctx, key.tensor, 3) != axis_size(ctx, value.tensor, 3):
            return "the key and value heads differ in size: the op reads 4-D ones of one shape"
        appended = _appended_plan(ctx, match, heads, head_size)
        if appended is not None:
            return appended
        return _Plan([match.query, key.tensor, value.tensor], {"num_heads": heads}, [])

    def _merge_operands(
        self, ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
    ) -> list[ir.Node] | str:
        """The op reads key and value both 3-D or both 4-D: where one is a projection and the
        other only heads (split from a fused projection, LeViT), those heads are merged."""
        key, value = match.key, match.value
        if key.repeated or value.repeated or (key.projection is None and value.projection is None):
            return self._merge_unequal_heads(ctx, match, shared)
        if key.projection is not None and value.projection is not None:
            return []
        operand = value if value.projection is None else key
        if operand.tensor is None:
            return []
        found = _merged_heads(ctx, operand.tensor, shared, transposed=True, graph=_graph(match))
        if isinstance(found, str):
            return found
        operand.projection, nodes = found
        return nodes

    def _merge_unequal_heads(
        self, ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
    ) -> list[ir.Node] | str:
        """The op reads 4-D key and value of one shape only: key and value heads whose head
        sizes are not provably equal (DeepSeek's multi-head latent attention: keys of the
        rotary and plain parts joined, values smaller; MiMo-V2's repeated key/value heads of
        16 and 8) are both merged to [B, L, N*H], the repeat in them."""
        key, value = match.key, match.value
        if key.cache is not None or value.cache is not None:
            return []
        if key.tensor is None or value.tensor is None:
            return []
        key_size, value_size = axis_size(ctx, key.tensor, 3), axis_size(ctx, value.tensor, 3)
        if key_size is not None and key_size == value_size:
            return []
        if (key.repeated or value.repeated) and None in (key_size, value_size):
            return []  # repeated heads of unknown sizes: _plan says what is not provable
        nodes: list[ir.Node] = []
        for operand in (key, value):
            assert operand.tensor is not None
            found = _merged_heads(ctx, operand.tensor, shared, transposed=True, graph=_graph(match))
            if isinstance(found, str):
                return found
            operand.projection, built = found
            operand.repeated = False
            nodes += built
        return nodes


def _appended_plan(ctx: PassContext, match: _Attention, heads: int, head_size: int) -> _Plan | None:
    """MultiHeadAttention on a KV cache that both key and value append new heads to: the op
    reads the new projections, takes the pasts as past_key / past_value, and its present_key /
    present_value replace the Concats (the graph's presents), so neither the head splits nor
    the Concats stay. None where the cache is not that, as the 4-D key and value are read."""
    key, value = match.key, match.value
    if key.cache is None or value.cache is None or match.promoted is not None:
        return None  # promoted: the op would append in float32 to the presents' narrower type
    for cache, size in ((key.cache, head_size), (value.cache, None)):
        if cache.projection is None:
            return None
        shape = ctx.shape(cache.projection)
        if shape is None or len(shape) != 3 or not _is_heads(ctx, cache.past, heads, size):
            return None
    inputs = [match.query, key.cache.projection, value.cache.projection]
    plan = _Plan(inputs, {"num_heads": heads}, key.cache.nodes + value.cache.nodes)
    plan.pasts = [key.cache.past, value.cache.past]
    plan.presents = [key.tensor, value.tensor]  # type: ignore[list-item]
    return plan


def _grouped_cache(match: _Attention) -> bool:
    """Whether key and value are KV caches appended to, then repeated by repeat_kv."""
    key, value = match.key, match.value
    return bool(key.repeated and value.repeated and key.cache and value.cache)


def _decode_shaped(ctx: PassContext, match: _Attention) -> bool:
    """Whether the query's batch or sequence is fixed to 1: onnxruntime's GroupQueryAttention
    takes a past only then."""
    query = ctx.shape(match.query)
    return query is not None and (query[0] == 1 or query[1] == 1)


def _merged_grouped_heads(
    ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
) -> list[ir.Node] | str:
    """Grouped key/value heads that are no plain head split (transformed after the split:
    Qwen3's, Gemma-3's per-head key norms), merged to the [B, L, KV*H] projection
    GroupQueryAttention reads and repeats itself: the heads repeat_kv repeats, or with a KV
    cache the new heads appended to it (where the op will take the cache)."""
    cached = _grouped_cache(match)
    if cached and not _decode_shaped(ctx, match):
        return []  # the plan says why
    nodes: list[ir.Node] = []
    for operand in (match.key, match.value):
        cache = operand.cache
        if cached and cache is not None and cache.projection is None:
            heads = cache.heads
        elif not cached and operand.projection is None and cache is None and operand.kv:
            heads = operand.kv[0]
        else:
            continue
        found = _merged_heads(ctx, heads, shared, transposed=True, graph=_graph(match))
        if isinstance(found, str):
            return found
        projection, merged = found
        if cache is not None:
            cache.projection = projection
        else:  # the repeat goes with the match
            operand.projection, operand.nodes = projection, operand.kv[1]  # type: ignore[index]
        nodes += merged
    return nodes


def _grouped_cache_plan(
    ctx: PassContext, match: _Attention, heads: int, head_size: int
) -> _Plan | str:
    """GroupQueryAttention on a KV cache that key and value append new heads to before
    repeat_kv: the op reads the new projections, takes the pasts as past_key / past_value
    ([B, KV, P, H]), repeats the heads itself, and its present_key / present_value replace the
    Concats (the graph's presents)."""
    key, value = match.key, match.value
    assert key.cache is not None and value.cache is not None
    assert key.kv is not None and value.kv is not None
    if not _decode_shaped(ctx, match):
        return (
            "onnxruntime's GroupQueryAttention takes a past only for one sequence or one new "
            "token at a time, and the batch and sequence are not fixed to 1 (--input_shape "
            "can fix them)"
        )
    if (reason := _gqa_head_size(head_size)) is not None:
        return reason
    projections = [key.cache.projection, value.cache.projection]
    repeats = [
        dataclasses.replace(key, nodes=key.kv[1]),
        dataclasses.replace(value, nodes=value.kv[1]),
    ]
    kv_heads = _kv_heads(ctx, projections, repeats, heads, head_size)
    if isinstance(kv_heads, str):
        return kv_heads
    for past, size in ((key.cache.past, head_size), (value.cache.past, None)):
        if not _is_heads(ctx, past, kv_heads, size):
            return "the past key or value is not provably [batch, KV heads, length, head size]"
    inputs = [
        match.query,
        key.cache.projection,
        value.cache.projection,
        key.cache.past,
        value.cache.past,
    ]
    attributes = {"num_heads": heads, "kv_num_heads": kv_heads, "causal": 0}
    absorbed = key.kv[1] + value.kv[1] + key.cache.nodes + value.cache.nodes
    plan = _Plan(inputs, attributes, absorbed)  # type: ignore[arg-type]
    plan.presents = [key.kv[0], value.kv[0]]
    return plan


def _projection(
    value: ir.Value,
) -> tuple[ir.Value, np.ndarray, np.ndarray | None, list[ir.Node]] | None:
    """(x, W, b, nodes) when ``value`` is MatMul(x, W) + b or MatMul(x, W), with W a constant
    [in, out] matrix and b a constant [out] vector; the MatMul and Add in ``nodes``."""
    nodes: list[ir.Node] = []
    bias = None
    add = producer_of(value, "Add")
    if add is not None:
        for product, vector in (add.inputs, reversed(add.inputs)):
            array = constant_value(vector)
            if producer_of(product, "MatMul") is not None and array is not None:
                nodes.append(add)
                value, bias = product, array
                break
        else:
            return None
    matmul = producer_of(value, "MatMul")
    weight = constant_value(matmul.inputs[1]) if matmul is not None else None
    if matmul is None or weight is None or weight.ndim != 2:
        return None
    if bias is not None and bias.shape != (weight.shape[1],):
        return None
    return matmul.inputs[0], weight, bias, [*nodes, matmul]


def _sizes_for(node: ir.Node, members: set[ir.Node], depth: int = 6) -> bool:
    """Whether ``node`` is shape arithmetic (a Shape, then integer ops) that only the matched
    nodes read, so that it dies with them (absorb_shape_arithmetic); not one that also feeds
    a mask."""
    if depth == 0 or (depth == 6 and node.op_type not in _SHAPE_READERS):
        return False
    for value in node.outputs:
        if value.is_graph_output() or value.dtype not in INDEX_TYPES:
            return False
        for user, _ in value.uses():
            if user not in members and not _sizes_for(user, members, depth - 1):
                return False
    return True


@register_pass
class QkvAttentionFusionPass(_AttentionFusion):
    spec = PassSpec(
        name="QkvAttentionFusionPass",
        category=Category.UB,
        description="written-out self-attention whose query, key and value are projections of "
        "one input by constant weights (BERT, ViT, Whisper's self-attention) -> com.microsoft "
        "Attention, the three projections packed into one [in, 3*hidden] weight",
        aliases=("packed_qkv_attention_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=4480,  # after GroupQueryAttention, before MultiHeadAttention takes the rest
        targets=("ort",),
        emits=("Attention",),
        emits_domain=MS,
    )
    op_type = "Attention"
    bias_input = 5

    def _plan(
        self,
        ctx: PassContext,
        match: _Attention,
        heads: int,
        head_size: int,
        shared: dict[object, tuple[ir.Value, ...]],
    ) -> _Plan | str | None:
        """None (MultiHeadAttention's) unless all three are plain projections of one input,
        read by nothing else, with weights of one shape; and for an attention promoted to
        float32 (its packed weights would be cast at every run: MultiHeadAttention casts the
        projections, as the original casts the heads)."""
        key, value = match.key, match.value
        if not (_plain(key) and _plain(value)) or match.softcap or match.query is None:
            return None
        if match.promoted is not None:
            return None
        # OPT, BART, Whisper scale the query projection before the split: into the op's scale.
        scaled: list[ir.Node] = []
        query, factor = _unscale(match.query, scaled)
        operands = [query, key.projection, value.projection]
        found = [_projection(v) for v in operands if v is not None]
        if len(found) != 3 or any(f is None for f in found):
            return None
        projections = [f for f in found if f is not None]
        source = projections[0][0]
        if any(p[0] is not source for p in projections):
            return None  # cross-attention: the key and value read another input
        shapes = {p[1].shape for p in projections}
        if len(shapes) != 1 or shapes.pop()[1] != heads * head_size:
            return None
        # Read elsewhere (T5's key split, whose shape its position bias takes), a projection
        # or its split would stay beside the op: MultiHeadAttention reads them instead.
        members = set(match.nodes + key.nodes + value.nodes + scaled)
        split = [v for node in key.nodes + value.nodes + scaled for v in node.outputs]
        for read in [*operands, *split]:
            assert read is not None
            if read.is_graph_output() or any(
                user not in members and not _sizes_for(user, members) for user, _ in read.uses()
            ):
                return None
        graph = match.root.graph
        assert graph is not None
        dtype = projections[0][1].dtype
        zeros = np.zeros(heads * head_size, dtype)
        bias = np.concatenate([p[2] if p[2] is not None else zeros for p in projections])
        base = f"{ctx.spec.name}/{match.root.name}"
        weights = [p[1] for p in projections]
        packed = [concatenated_constant(graph, f"{base}/qkv_weight", weights, 1, dtype)]
        packed.append(new_constant(graph, f"{base}/qkv_bias", bias.astype(dtype)))
        absorbed = key.nodes + value.nodes + scaled + [n for p in projections for n in p[3]]
        match.scale *= factor
        return _Plan([source, *packed], {"num_heads": heads}, absorbed)


def _query_length(ctx: PassContext, match: _Attention, operand: _Heads) -> bool:
    """Whether the key or value is provably as long as the query (self-attention, no cache):
    the sizes as products of static and named dimensions (symbolic_size)."""
    assert match.query is not None
    heads = operand.kv[0] if operand.kv is not None else operand.tensor
    length = (
        symbolic_size(ctx, heads, 2)
        if heads is not None
        else symbolic_size(ctx, operand.projection, 1)  # type: ignore[arg-type]
    )
    return length is not None and length == symbolic_size(ctx, match.query, 1)


def _kv_heads(
    ctx: PassContext,
    projections: list[ir.Value | None],
    repeats: list[_Heads],
    heads: int,
    head_size: int,
) -> int | str:
    """How many key/value heads the key and value ``projections`` hold (their width over the
    head size), with each of ``repeats`` (operands whose nodes hold a repeat_kv) provably
    repeating every one of them alike; else why not."""
    widths = [ctx.shape(v) for v in projections if v is not None]
    if len(widths) != 2 or any(w is None or len(w) != 3 for w in widths):
        return "the key/value projections are not 3-D [batch, length, hidden]"
    hidden = {w[2] for w in widths}  # type: ignore[index]
    width = hidden.pop() if len(hidden) == 1 else None
    if not isinstance(width, int) or width % head_size:
        return "the key/value projections' hidden size is unknown or differs"
    kv_heads = width // head_size
    if heads % kv_heads:
        return "the key/value heads do not divide the query heads"
    times = heads // kv_heads
    for operand in repeats:
        if not _repeats_each_head(ctx, operand, heads, head_size, times):
            return (
                f"the repeat_kv is not provably {times} copies of each of the {kv_heads} "
                "key/value heads"
            )
    return kv_heads


def _repeats_each_head(
    ctx: PassContext, operand: _Heads, heads: int, head_size: int, times: int
) -> bool:
    """Whether repeat_kv's Expand makes ``times`` copies of each key/value head (its axis 2) and
    nothing known of the result contradicts [batch, heads, length, head size]: a fused op that
    reads the projections repeats each head heads / kv_heads times, whatever the graph did."""
    expand = next((node for node in operand.nodes if node.op_type == "Expand"), None)
    if expand is None:
        return False
    shape = ctx.shape(operand.tensor) if operand.tensor is not None else None
    if shape is not None and len(shape) != 4:
        return False
    for axis, size in ((1, heads), (3, head_size)):
        if shape is not None and isinstance(shape[axis], int) and shape[axis] != size:
            return False
    copies = ctx.shape(expand.outputs[0])
    if copies is not None and len(copies) == 5 and isinstance(copies[2], int):
        return copies[2] == times
    target = ctx.shape(expand.inputs[1])
    if target is None or len(target) != 1 or not isinstance(target[0], int) or target[0] < 3:
        return False
    return shape_element(ctx, expand.inputs[1], target[0] - 3) == times


@register_pass
class AttentionFusionPass(_AttentionFusion):
    spec = PassSpec(
        name="AttentionFusionPass",
        category=Category.GRAPH,
        description="written-out attention on plain projections (one KV head per query head, "
        "or repeated KV heads) -> the standard Attention op (opset 23)",
        aliases=("AttentionONNXFusionPass", "attention_onnx_fusion"),
        numerics=Numerics.REASSOCIATING,
        min_opset=23,
        priority=8000,
        emits=("Attention",),
    )
    op_type = "Attention"
    bias_input = 3
    clamps_mask = True
    softcaps = True

    def _plan(
        self,
        ctx: PassContext,
        match: _Attention,
        heads: int,
        head_size: int,
        shared: dict[object, tuple[ir.Value, ...]],
    ) -> _Plan | str | None:
        key, value = match.key, match.value
        if ctx.opset < self.spec.min_opset:
            return f"Attention needs opset >= {self.spec.min_opset}, model has {ctx.opset}"
        if key.projection is None or value.projection is None:
            return (
                "the key/value are not plain head splits of projections (a KV cache, heads "
                "transformed after the split): MultiHeadAttention's"
            )
        if key.repeated != value.repeated:
            return "only one of key and value has repeated heads"
        repeats = [operand for operand in (key, value) if operand.repeated]
        kv_heads = _kv_heads(ctx, [key.projection, value.projection], repeats, heads, head_size)
        if isinstance(kv_heads, str):
            return kv_heads
        attributes = {"q_num_heads": heads, "kv_num_heads": kv_heads}
        inputs = [match.query, key.projection, value.projection]
        return _Plan(inputs, attributes, key.nodes + value.nodes)


# onnxruntime's CPU GroupQueryAttention kernel rejects other head sizes at run time.
_GQA_HEAD_SIZE_MULTIPLE = 16


def _gqa_head_size(head_size: int) -> str | None:
    """Why GroupQueryAttention cannot take this head size, or None."""
    if head_size % _GQA_HEAD_SIZE_MULTIPLE == 0:
        return None
    return (
        f"head size {head_size}: onnxruntime's GroupQueryAttention takes multiples of "
        f"{_GQA_HEAD_SIZE_MULTIPLE}"
    )


@register_pass
class GroupQueryAttentionFusionPass(_AttentionFusion):
    spec = PassSpec(
        name="GroupQueryAttentionFusionPass",
        category=Category.UB,
        description="written-out attention with repeated key/value heads (LLaMA-style "
        "grouped-query attention; a KV cache where batch or new tokens are fixed to 1), one "
        "key/value head for all query heads (multi-query: Falcon, GPT-BigCode), or "
        "soft-capped scores (Gemma-2) -> com.microsoft GroupQueryAttention",
        aliases=("group_query_attention_fusion", "GroupQueryAttentionFusion", "GQAFusion"),
        numerics=Numerics.REASSOCIATING,
        priority=4450,
        targets=("ort",),
        emits=("GroupQueryAttention",),
        emits_domain=MS,
    )
    op_type = "GroupQueryAttention"
    bias_input = 10
    softcaps = True
    sink_input = 11

    def _plan(
        self,
        ctx: PassContext,
        match: _Attention,
        heads: int,
        head_size: int,
        shared: dict[object, tuple[ir.Value, ...]],
    ) -> _Plan | str | None:
        key, value = match.key, match.value
        grouped = (key.repeated and value.repeated) or _shared_head(ctx, match)
        if not grouped and not match.softcap:
            return None  # one KV head per query head: MultiHeadAttention's (no softcap)
        if _grouped_cache(match):
            return _grouped_cache_plan(ctx, match, heads, head_size)
        if key.projection is None or value.projection is None:
            return (
                "the grouped key/value are not plain head splits of projections (a KV cache, "
                "or heads transformed after the split)"
            )
        if not all(_query_length(ctx, match, operand) for operand in (key, value)):
            return (
                "the key/value length is not provably the query's (a KV cache, or "
                "cross-attention), which GroupQueryAttention without a past assumes"
            )
        if (reason := _gqa_head_size(head_size)) is not None:
            return reason
        repeats = [operand for operand in (key, value) if operand.repeated]
        kv_heads = _kv_heads(ctx, [key.projection, value.projection], repeats, heads, head_size)
        if isinstance(kv_heads, str):
            return kv_heads
        # causal=0: the model's own additive mask (attention_bias) masks everything it masked.
        attributes = {"num_heads": heads, "kv_num_heads": kv_heads, "causal": 0}
        inputs = [match.query, key.projection, value.projection, None, None]
        return _Plan(inputs, attributes, key.nodes + value.nodes)

    def _merge_operands(
        self, ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
    ) -> list[ir.Node] | str:
        """One key/value head shared by every query head (multi-query attention) that is no
        plain head split (transformed after the split: rotary; sliced from a fused QKV
        projection: GPT-BigCode): read merged, [B, L, H]; its repeat goes with the match.
        Likewise grouped heads that are no plain head split, cached or not (a per-head key
        norm)."""
        if match.key.repeated and match.value.repeated:
            return _merged_grouped_heads(ctx, match, shared)
        if not _shared_head(ctx, match):
            return []
        nodes: list[ir.Node] = []
        for operand in (match.key, match.value):
            one = _one_head(ctx, operand)
            if operand.projection is None and one is not None:
                found = _merged_heads(ctx, one[0], shared, transposed=True, graph=_graph(match))
                if isinstance(found, str):
                    return found
                (operand.projection, merged), operand.nodes = found, one[1]
                nodes += merged
        return nodes

    def _prelude(
        self, ctx: PassContext, match: _Attention, shared: dict[object, tuple[ir.Value, ...]]
    ) -> _Prelude:
        """seqlens_k ([B] int32, T - 1: every key is there; padding is in the mask) and
        total_sequence_length (T: the query's length S, plus the past's P with a KV cache),
        from the shapes; shared by the layers whose queries (and pasts) have the same sizes:
        traced to one product of named dimensions (per-head query norms leave each layer's
        query with sizes inference named for it alone: Qwen3, Gemma 3), else the same
        dimensions as inferred."""
        shape = ctx.shape(match.query)
        assert shape is not None
        past = match.key.cache.past if _grouped_cache(match) else None  # type: ignore[union-attr]
        past_shape = ctx.shape(past) if past is not None else None
        dims = (shape[0], shape[1], *(() if past_shape is None else (past_shape[2],)))
        axes = [(match.query, 0), (match.query, 1), *(() if past is None else [(past, 2)])]
        traced = tuple(symbolic_size(ctx, value, axis) for value, axis in axes)
        key: object = ("traced", traced) if None not in traced else dims
        shareable = None not in traced or all(
            isinstance(d, int) or d.value is not None for d in dims
        )
        if shareable and key in shared:
            return list(shared[key]), []
        graph = match.root.graph
        assert graph is not None
        base = f"{ctx.spec.name}/{match.root.name}"
        one = new_constant(graph, f"{base}/one", np.array(1, np.int32))
        second = new_constant(graph, f"{base}/sequence_axis", np.array(1, np.int64))
        first = new_constant(graph, f"{base}/batch_axis", np.array([0], np.int64))
        int32, int64 = ir.DataType.INT32, ir.DataType.INT64
        query_shape = ir.node("Shape", [match.query])
        sequence = ir.node("Gather", [query_shape.outputs[0], second])
        computed = [(query_shape, int64, [3]), (sequence, int64, [])]
        length = sequence
        if past is not None:  # T = P + S
            third = new_constant(graph, f"{base}/past_axis", np.array(2, np.int64))
            past_shape = ir.node("Shape", [past])
            past_length = ir.node("Gather", [past_shape.outputs[0], third])
            summed = ir.node("Add", [past_length.outputs[0], sequence.outputs[0]])
            computed += [(past_shape, int64, [4]), (past_length, int64, []), (summed, int64, [])]
            length = summed
        total = ir.node("Cast", [length.outputs[0]], attributes={"to": int32})
        last = ir.node("Sub", [total.outputs[0], one])
        batch = ir.node("Gather", [query_shape.outputs[0], first])
        seqlens = ir.node("Expand", [last.outputs[0], batch.outputs[0]])
        computed += [(total, int32, []), (last, int32, []), (batch, int64, [1])]
        computed.append((seqlens, int32, [dims[0]]))
        for node, dtype, known in computed:
            typed(node.outputs[0], dtype, ir.Shape(known))
        lengths = (seqlens.outputs[0], total.outputs[0])
        if shareable:
            shared[key] = lengths
        return list(lengths), [node for node, _, _ in computed]
