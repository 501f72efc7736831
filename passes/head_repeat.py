"""Key / value heads repeated before their transpose or their rotary, repeated after instead.

Grouped-query attention repeats each key / value head for the query heads it serves. transformers
repeats the [B, KV, L, H] heads (``repeat_kv``); code that splits heads as [B, L, KV, H] and
transposes last (llama2.c, Meta's reference, Flax's ``jnp.repeat``) repeats them first:

    k = Transpose(Reshape(Expand(Unsqueeze(z, a + 1), [.., KV, r, ..]), [.., KV*r, ..]), perm)

Repeating along an axis commutes with moving the axes: the same k is

    Transpose(Reshape(Expand(Unsqueeze(Transpose(z, p1), b + 1), [.., r, ..]), [.., KV*r, ..]), p2)

with b where the heads axis lands. p1 moves only the heads axis (to b), keeping the others in
order; p2 does the rest of perm (K^T's last-two swap), left out where it is the identity. That
is transformers' spelling, which the attention fusions read as repeated heads. Pure data
movement: exact.

What is checked is what each op computes, read from the shapes: the Unsqueeze inserts a unit
axis after the heads, the Expand sets it to r and keeps every other size (a target element of
1, or the size itself: static, named alike, or read from z's shape), and the Reshape merges
the two (each other size kept likewise; the merged one KV*r or the Reshape's one -1).

RotaryHeadRepeatCanonicalizationPass takes the other order code writes: litgpt and Falcon's
new decoder architecture repeat each group's key to its queries *before* the rotary, so the
fused RotaryEmbedding reads repeated heads. A rotation depends on the position only, not on
the head, so it commutes with copying heads: Rotary(repeat_kv(z)) is repeat_kv(Rotary(z)),
exactly, and the grouped key is what GroupQueryAttention reads.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import (
    HEADS_PERM,
    MS,
    head_split,
    keeps_leading,
    read_size,
    repeat_kv,
    same_dim,
    same_dimension,
    target_parts,
)
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    new_constant,
    new_unsqueeze,
    node_axes,
    node_label,
    producer_of,
    replace_subgraph,
    transpose_perm,
    typed,
    uses_outside,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass


class _Repeat:
    """z's heads axis ``axis`` repeated ``times`` times (Unsqueeze, Expand, Reshape)."""

    def __init__(self, z: ir.Value, axis: int, heads: int, times: int) -> None:
        self.z, self.axis, self.heads, self.times = z, axis, heads, times


def _keeps(ctx: PassContext, part: object, z: ir.Value, axis: int) -> bool:
    """Whether a target element is z's size along ``axis`` (at run time): the same static
    size, or a size read from z there or from an axis named alike (same_dimension)."""
    source = ctx.shape(z)
    assert source is not None
    if isinstance(part, int):
        return isinstance(source[axis], int) and part == source[axis]
    size = read_size(ctx, part)  # type: ignore[arg-type]
    return same_dimension(part, size, z, axis, source)  # type: ignore[arg-type]


def _repeats(part: object) -> bool:
    """Whether a target element spreads a unit axis: a static size above 1."""
    return isinstance(part, int) and part > 1


def _unit_axes(ctx: PassContext, value: ir.Value | None) -> tuple[ir.Value, list[int]] | None:
    """(z, [i, ...]) where ``value`` is z with a unit axis inserted at i: Unsqueeze(z, [i]), or
    a Reshape to z's sizes with a 1 at i (Flax's ``jnp.repeat``), each other size kept. A
    Reshape that puts a 1 beside a 1 of z (a single key/value head) inserts it at either."""
    node = value.producer() if value is not None else None
    z = node.inputs[0] if node is not None and node.inputs else None
    shape = ctx.shape(z) if z is not None else None
    if node is None or z is None or shape is None or node.domain not in DEFAULT_DOMAINS:
        return None
    rank = len(shape)
    if node.op_type == "Unsqueeze":
        axes = node_axes(node)
        return (z, [axes[0] % (rank + 1)]) if axes is not None and len(axes) == 1 else None
    viewed = ctx.shape(value) if node.op_type == "Reshape" else None  # type: ignore[arg-type]
    if viewed is None or len(viewed) != rank + 1:
        return None
    found = []
    for inserted in range(rank + 1):
        rest = [*viewed[:inserted], *viewed[inserted + 1 :]]
        if viewed[inserted] != 1 or not keeps_leading(ctx, node, shape, rest, inserted):
            continue
        if all(same_dim(a, b) for a, b in zip(shape[inserted:], rest[inserted:], strict=True)):
            found.append(inserted)
    return (z, found) if found else None


def _repeat(ctx: PassContext, transpose: ir.Node) -> tuple[_Repeat, list[int]] | str | None:
    """The repeat the Transpose reads and its perm, the reason it is not provably one, or None
    where the ops are not Transpose(Reshape(Expand(Unsqueeze(z, a + 1)))) with the heads axis
    a moved by the Transpose (repeated after the move already: nothing to commute)."""
    value = transpose.inputs[0]
    reshape = producer_of(value, "Reshape")
    expand = producer_of(reshape.inputs[0], "Expand") if reshape is not None else None
    found = _unit_axes(ctx, expand.inputs[0]) if expand is not None else None
    if found is None:
        return None
    assert reshape is not None and expand is not None
    z, candidates = found
    spread = target_parts(ctx, expand.inputs[1]) if expand.inputs[1] is not None else None
    # Of two places for the unit axis, the one the Expand repeats along.
    inserted = next(
        (i for i in candidates if spread and i < len(spread) and _repeats(spread[i])),
        candidates[0],
    )
    shape = ctx.shape(z)
    assert shape is not None
    rank = len(shape)
    if inserted == 0 or ctx.shape(value) is None or len(ctx.shape(value)) != rank:  # type: ignore[arg-type]
        return None
    axis = inserted - 1  # the heads axis of z
    perm = transpose_perm(transpose, rank)
    if perm is None or sorted(perm) != list(range(rank)) or _first_move(perm, axis) is None:
        return None
    if spread is None or len(spread) != rank + 1 or not isinstance(spread[inserted], int):
        return "the Expand's sizes are not known"
    times = spread[inserted]
    source = [*range(inserted), None, *range(inserted, rank)]  # z's axis per expanded axis
    for part, along in zip(spread, source, strict=True):
        if along is not None and part != 1 and not _keeps(ctx, part, z, along):
            return "the Expand does not provably keep the sizes other than the repeat's"
    merged = target_parts(ctx, reshape.inputs[1]) if reshape.inputs[1] is not None else None
    heads = shape[axis]
    if not isinstance(heads, int):
        return "the number of heads is not static"
    if merged is None or len(merged) != rank or times < 1:
        return "the Reshape's target is not known"
    copies = not reshape.attributes.get_int("allowzero", 0)
    for index, part in enumerate(merged):
        if index == axis:
            if part not in (heads * times, -1):
                return "the Reshape does not provably merge the repeated heads"
            continue
        kept = _keeps(ctx, part, z, index) or (part == 0 and copies and index < axis)
        if not kept and (part != -1 or merged[axis] == -1):
            return "the Reshape does not provably keep the sizes other than the heads'"
    if merged.count(-1) > 1:
        return "the Reshape infers more than one size"
    return _Repeat(z, axis, heads, times), perm


def _first_move(perm: list[int], axis: int) -> list[int] | None:
    """The perm that moves only ``axis`` to where ``perm`` puts it, the other axes kept in
    order; None where that is no move."""
    landing = perm.index(axis)
    others = [a for a in range(len(perm)) if a != axis]
    first = [*others[:landing], axis, *others[landing:]]
    return None if first == list(range(len(perm))) else first


@register_pass
class HeadRepeatTransposeCanonicalizationPass(FusionPass):
    """Not a pattern: each Transpose of repeated heads is judged alone."""

    spec = PassSpec(
        name="HeadRepeatTransposeCanonicalizationPass",
        category=Category.GRAPH,
        description="heads repeated before a Transpose, Transpose(Reshape(Expand(Unsqueeze(z, "
        "a+1)))) (llama2.c's repeat_kv of [B, L, KV, H] heads) -> the Transpose first and the "
        "repeat after it, transformers' repeat_kv that the attention fusions read",
        aliases=("RepeatKvBeforeTranspose",),
        priority=4410,  # after the rotary fusion, before the attention fusions
        canonical=True,
        # TransposePushCanonicalizationPass runs again after the fusions and may leave a
        # repeat before a Transpose (MiMo-V2's unfused layer): a second run finds nothing.
        again_after_fusions=True,
        emits=("Transpose", "Unsqueeze", "Expand", "Reshape"),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("HeadRepeatTranspose")
        graph = model.graph
        for transpose in ctx.op_index.of_type(graph, "Transpose", DEFAULT_DOMAINS):
            if transpose.graph is not graph or transpose.inputs[0] is None:
                continue
            found = _repeat(ctx, transpose)
            if found is None:
                continue
            if isinstance(found, str):
                stats.decline(found, node_label(transpose))
                continue
            repeated = transpose.inputs[0]
            readers = {node.op_type for node, _ in repeated.uses()}
            if readers != {"Transpose"} or repeated.is_graph_output():
                stats.decline("the repeated heads are also read elsewhere", node_label(transpose))
                continue
            self._rewrite(ctx, graph, transpose, *found)

    def _rewrite(
        self, ctx: PassContext, graph: ir.Graph, transpose: ir.Node, found: _Repeat, perm: list
    ) -> None:
        name = f"{self.spec.name}/{node_label(transpose)}"
        shape = ctx.shape(found.z)
        assert shape is not None
        rank, axis = len(shape), found.axis
        landing = perm.index(axis)
        first = _first_move(perm, axis)
        assert first is not None
        second = [first.index(a) for a in perm]
        dtype = ctx.dtype(transpose.outputs[0])
        dims = [shape[a] for a in first]
        lead, trail = dims[: landing + 1], dims[landing + 1 :]
        merged = found.heads * found.times
        data: list[ir.Node] = []  # the repeated heads' own nodes, in order
        sizes: list[ir.Node] = []  # the shape arithmetic of the merge

        def add(node: ir.Node, dims: list) -> ir.Value:
            data.append(node)
            return typed(node.outputs[0], dtype, ir.Shape(dims))

        moved = add(ir.node("Transpose", [found.z], attributes={"perm": first}), dims)
        unit = add(
            new_unsqueeze(ctx, graph, moved, [landing + 1], f"{name}_axes"), [*lead, 1, *trail]
        )
        spread = [1] * (rank + 1)
        spread[landing + 1] = found.times
        repeat = new_constant(graph, f"{name}_repeat", np.array(spread, np.int64))
        spreaded = add(ir.node("Expand", [unit, repeat]), [*lead, found.times, *trail])
        target = self._target(graph, name, moved, dims, landing, merged, sizes)
        result = add(ir.node("Reshape", [spreaded, target]), [*dims[:landing], merged, *trail])
        if second != list(range(rank)):
            add(ir.node("Transpose", [result], attributes={"perm": second}), [])
        typed(data[-1].outputs[0], dtype, ctx.shape(transpose.outputs[0]))
        new = [*data[:3], *sizes, *data[3:]]  # the merge's sizes before the Reshape reads them
        replace_subgraph(
            ctx,
            "HeadRepeatTranspose",
            transpose,
            [transpose],
            new,
            transpose.outputs,
            data[-1].outputs,
        )

    @staticmethod
    def _target(
        graph: ir.Graph,
        name: str,
        moved: ir.Value,
        dims: list,
        landing: int,
        merged: int,
        nodes: list[ir.Node],
    ) -> ir.Value:
        """The merged shape: ``moved``'s sizes with the heads axis ``merged`` long, a constant
        (a leading size copied by 0, one trailing size inferred by -1) where that spells it;
        else the sizes that are not static read from ``moved`` (Gather of its Shape), shape
        nodes going into ``nodes``."""
        trailing = [d if isinstance(d, int) else -1 for d in dims[landing + 1 :]]
        if trailing.count(-1) <= 1:
            sizes = [*(d if isinstance(d, int) else 0 for d in dims[:landing]), merged, *trailing]
            return new_constant(graph, f"{name}_shape", np.array(sizes, np.int64))
        shape = ir.node("Shape", [moved])
        nodes.append(shape)
        parts: list[ir.Value] = []
        for suffix, axes in (("lead", range(landing)), ("trail", range(landing + 1, len(dims)))):
            if axes:
                picked = new_constant(graph, f"{name}_{suffix}", np.array(list(axes), np.int64))
                nodes.append(ir.node("Gather", [shape.outputs[0], picked], attributes={"axis": 0}))
                parts.append(nodes[-1].outputs[0])
            if suffix == "lead":
                parts.append(new_constant(graph, f"{name}_heads", np.array([merged], np.int64)))
        nodes.append(ir.node("Concat", parts, attributes={"axis": 0}))
        return nodes[-1].outputs[0]


def _proven_repeat(ctx: PassContext, x: ir.Value) -> tuple[ir.Value, list[ir.Node]] | str | None:
    """(z, [Unsqueeze, Expand, Reshape]) where x [B, KV*r, L, H] is z [B, KV, L, H] with each
    head repeated r times (transformers' repeat_kv), every size but the heads' proven kept;
    why not where the ops are those but a size is not proven; else None."""
    found = repeat_kv(x)
    if found is None:
        return None
    z, repeat = found
    shapes = [ctx.shape(value) for value in (z, repeat[1].outputs[0], x)]
    if any(shape is None for shape in shapes):
        return "the repeat's sizes are not known"
    source, spread, merged = shapes
    assert source is not None and spread is not None and merged is not None
    if len(source) != 4 or len(spread) != 5 or len(merged) != 4:
        return None
    kept = [(source[0], spread[0], merged[0]), (source[2], spread[3], merged[2])]
    kept.append((source[3], spread[4], merged[3]))
    heads, times = source[1], spread[2]
    if not all(same_dim(a, b) and same_dim(a, c) for a, b, c in kept) or not same_dim(
        spread[1], heads
    ):
        return "the repeat does not provably keep the batch, length and head size"
    if not isinstance(heads, int) or not isinstance(times, int) or merged[1] != heads * times:
        return "the repeat does not provably merge each head's copies"
    return found


def _copy(node: ir.Node, inputs: list[ir.Value | None], **changed: object) -> ir.Node:
    """A node like ``node`` reading ``inputs``: its op and attributes, ``changed`` set."""
    attributes = {name: attr.value for name, attr in node.attributes.items()} | changed
    return ir.node(node.op_type, inputs, attributes, domain=node.domain)


@register_pass
class RotaryHeadRepeatCanonicalizationPass(FusionPass):
    """Not a pattern: each RotaryEmbedding of repeated heads is judged alone."""

    spec = PassSpec(
        name="RotaryHeadRepeatCanonicalizationPass",
        category=Category.UB,  # after the rotary fusion, which is one
        description="RotaryEmbedding of repeated key heads, Rotary(repeat_kv(z)) (litgpt and "
        "Falcon repeat each group's key before the rotary) -> repeat_kv(Rotary(z)), the rotary "
        "on z's projection where z is a plain head split: the grouped heads the "
        "grouped-query fusion reads",
        aliases=("RotaryBeforeRepeatKv",),
        priority=4420,  # after RotaryEmbeddingFusionPass, before the attention fusions
        canonical=True,
        emits=("Unsqueeze", "Expand", "Reshape", "Transpose"),  # and the rotary, moved
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("RotaryHeadRepeat")
        graph = model.graph
        for rotary in ctx.op_index.of_type(graph, "RotaryEmbedding", (MS,)):
            if rotary.graph is not graph or rotary.inputs[0] is None:
                continue
            found = _proven_repeat(ctx, rotary.inputs[0])
            if found is None:
                continue
            if isinstance(found, str):
                stats.decline(found, node_label(rotary))
                continue
            z, repeat = found
            repeated = rotary.inputs[0]
            if (
                uses_outside(repeat, [repeated]) is not None
                or len(repeated.uses()) != 1
                or repeated.is_graph_output()
            ):
                stats.decline("the repeated heads are also read elsewhere", node_label(rotary))
                continue
            self._rewrite(ctx, graph, rotary, z, repeat)

    def _rewrite(
        self, ctx: PassContext, graph: ir.Graph, rotary: ir.Node, z: ir.Value, repeat: list
    ) -> None:
        """The rotary on z (on its projection X where z = Transpose(Reshape(X)), as the
        rotary fusion writes it, split after), then z's repeat as it was."""
        dtype = ctx.dtype(rotary.outputs[0])
        split = head_split(ctx, z)
        source = z if split is None else split[0].inputs[0]
        old = [rotary, *repeat]
        changed: dict[str, object] = {}
        if split is not None:
            changed["num_heads"] = ctx.shape(z)[1]  # type: ignore[index]
            if uses_outside([*old, *split], [rotary.outputs[0]]) is None:
                old += split
        new = [_copy(rotary, [source, *rotary.inputs[1:]], **changed)]
        typed(new[-1].outputs[0], dtype, ctx.shape(source))  # type: ignore[arg-type]
        if split is not None:  # split into heads again, as z was
            reshape = split[0]
            new.append(_copy(reshape, [new[-1].outputs[0], reshape.inputs[1]]))
            typed(new[-1].outputs[0], dtype, ctx.shape(reshape.outputs[0]))
            new.append(ir.node("Transpose", new[-1].outputs, attributes={"perm": HEADS_PERM}))
            typed(new[-1].outputs[0], dtype, ctx.shape(z))
        for node in repeat:
            new.append(_copy(node, [new[-1].outputs[0], *node.inputs[1:]]))
            typed(new[-1].outputs[0], dtype, ctx.shape(node.outputs[0]))
        typed(new[-1].outputs[0], dtype, ctx.shape(rotary.outputs[0]))
        replace_subgraph(ctx, "RotaryHeadRepeat", rotary, old, new, rotary.outputs, new[-1].outputs)
