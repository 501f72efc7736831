"""A widening Cast moved above the Concat, Neg and Slice it follows: one tensor rotated.

Half-precision exports promote where a float16 value meets a float32 one: OLMo-2 applies its
float32 rotary tables to float16 heads, and the exporter casts both the query and its
``rotate_half`` to float32 at the multiplication:

    Cast(q) * cos + Cast(Concat(Neg(q[..., H/2:]), q[..., :H/2])) * sin

The rotary pass reads one tensor rotated in both terms. Widening a float exactly commutes with
moving its elements and with negating them, so ``Cast(Concat(Neg(Slice(q)), Slice(q)))`` is
``Concat(Neg(Slice(Cast(q))), Slice(Cast(q)))`` bit for bit, and both terms then read the one
``Cast(q)``. A node is moved over only when every reader of it is that one Cast (casts of one
value to one type are merged first), so nothing is computed twice, and a Slice only where its
whole input is cast anyway (the direct term), so no more elements are converted than before.
The Casts stay below the head split and the key/value repeats, where the attention passes read
a promoted attention's operands.

rotate_every_two writes its pairs as a stack, an Unsqueeze of each part and a Concat, viewed
back by a Reshape: the Cast moves over that stack's views too (ERNIE 4.5 in float16), and over
no other view (a head split's, a partial rotary's join).

The other way round, a round trip through a wider type around an op that only moves elements
is that op alone: the OpenAI privacy filter casts its float16 probabilities to float32, slices
the attention sink's column off and casts back.

And a Transpose is moved above a widening Cast it alone reads: GPT-J, CodeGen and GPT-Neo in
half precision cast the query and the key to float32 for the scores, the key before its
transpose to K^T. With the Cast last, the scores' MatMul reads two promoted operands, as the
attention passes read them, and the Transpose moves half the bytes.
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import DEFAULT_DOMAINS, lossless, replace_subgraph, typed
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

# Floats only: a wider integer does not wrap where the narrow one does (Neg of int8's -128).
_FLOATS = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT})
# Ops that move (input 0; Concat: every input) or negate elements, between a rotation's halves
# and its Cast (rotate_half: a Concat of a Neg and Slices).
_MOVING = frozenset({"Slice", "Neg", "Concat"})

# Ops that only move elements: a round trip through a wider type around one is the op alone.
_BACK = frozenset({"Slice", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity"})
# Ops a widening Cast that they alone read moves below (the op's input is cast instead).
_UNDER = frozenset({"Transpose"})


def _widening(cast: ir.Node, ctx: PassContext) -> ir.DataType | None:
    """The type an exactly widening Cast casts to, else None."""
    if cast.domain not in DEFAULT_DOMAINS or cast.inputs[0] is None:
        return None
    to = ir.DataType(cast.attributes.get_int("to", 0))
    source = ctx.dtype(cast.inputs[0])
    return to if source in _FLOATS and lossless(source, to) else None  # type: ignore[arg-type]


def _stacking(view: ir.Node) -> bool:
    """Whether a view is part of rotate_every_two's stack of the rotated parts: an Unsqueeze
    of a Neg or Slice, or the Reshape of a Concat of Unsqueezes back to the heads. Any other
    view keeps its Cast after it (a head split's, where the attention passes read the
    promoted operands; a partial rotary's join, which a fused op's output feeds)."""
    source = view.inputs[0].producer() if view.inputs[0] is not None else None
    if source is None or source.domain not in DEFAULT_DOMAINS:
        return False
    if view.op_type == "Unsqueeze":
        return source.op_type in ("Neg", "Slice")
    if view.op_type == "Reshape" and source.op_type == "Concat":
        parts = [part.producer() if part is not None else None for part in source.inputs]
        return all(part is not None and part.op_type == "Unsqueeze" for part in parts)
    return False


def _read_only_by(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and [user for user, _ in value.uses()] == [reader]


def _merge_twins(graph: ir.Graph, casts: list[ir.Node]) -> bool:
    """Casts of one value to one type become the first of them (in graph order): CSE compares
    only shape arithmetic, and TorchScript's half-precision exports cast one mask per layer."""
    merged = False
    first: dict[tuple[ir.Value, int], ir.Node] = {}
    for cast in casts:
        if cast.graph is not graph or cast.inputs[0] is None or cast.outputs[0].is_graph_output():
            continue
        key = (cast.inputs[0], cast.attributes.get_int("to", 0))
        kept = first.setdefault(key, cast)
        if kept is not cast:
            cast.outputs[0].replace_all_uses_with(kept.outputs[0])
            graph.remove(cast, safe=True)
            merged = True
    return merged


@register_pass
class WideningCastHoistPass(FusionPass):
    """Not a pattern: each widening Cast is judged alone, repeatedly, until none moves."""

    spec = PassSpec(
        name="WideningCastHoistPass",
        category=Category.GRAPH,
        description="Cast(Concat/Neg/Slice(x)) widening a float -> the op of Cast(x) (also "
        "over a view of those: rotate_every_two's stack), "
        "Cast back(Slice(Cast wider(x))) -> Slice(x) and Transpose(Cast wider(x)) -> "
        "Cast(Transpose(x)): exact; a promoted float16 rotary reads one tensor (OLMo-2), a sink "
        "sliced off in float32 is sliced in float16, the scores read promoted heads (GPT-J)",
        aliases=("widening_cast_hoist",),
        priority=3041,  # after CSE, before the rotary pass reads the rotation
        emits=(),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        casts = ctx.op_index.of_type(graph, "Cast")  # most graphs: none widening, one look
        moved = True
        while moved:
            moved = _merge_twins(graph, casts)
            ctx.changed = ctx.changed or moved  # the shared op index drops the merged Casts
            for cast in casts:
                if cast.graph is graph and (
                    self._round_trip(cast, ctx) or self._hoist(cast, ctx) or self._sink(cast, ctx)
                ):
                    moved = True
            if moved:  # the Casts this round made, in graph order, for the next round
                casts = [node for node in graph if node.op_type == "Cast"]
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()

    def _round_trip(self, cast: ir.Node, ctx: PassContext) -> bool:
        """Cast(Move(Cast(x) to a wider type) back to x's type) -> Move(x): widening is exact,
        so the values come back as they were (the privacy filter's sink, sliced off in float32)."""
        mover = cast.inputs[0].producer() if cast.inputs[0] is not None else None
        if mover is None or mover.op_type not in _BACK or mover.domain not in DEFAULT_DOMAINS:
            return False
        widen = mover.inputs[0].producer() if mover.inputs[0] is not None else None
        if widen is None or widen.op_type != "Cast" or _widening(widen, ctx) is None:
            return False
        source = widen.inputs[0]
        dtype = ctx.dtype(source)
        if dtype != ir.DataType(cast.attributes.get_int("to", 0)):
            return False
        if not (_read_only_by(widen.outputs[0], mover) and _read_only_by(mover.outputs[0], cast)):
            return False
        inputs = [source, *mover.inputs[1:]]
        return _rebuilt(ctx, "CastRoundTripAround", cast, [widen, mover], inputs, dtype, [])

    def _hoist(self, cast: ir.Node, ctx: PassContext) -> bool:
        to = _widening(cast, ctx)
        mover = cast.inputs[0].producer() if to is not None else None
        if mover is None or mover.domain not in DEFAULT_DOMAINS:
            return False
        if mover.op_type not in _MOVING and not _stacking(mover):
            return False
        if not _read_only_by(mover.outputs[0], cast):
            return False
        if mover.op_type == "Slice" and not any(
            user is not cast and user.op_type == "Cast" and _widening(user, ctx) == to
            for user, _ in mover.inputs[0].uses()  # type: ignore[union-attr]
        ):
            return False  # casting the whole tensor for a part of it: only where it is anyway
        data = range(len(mover.inputs)) if mover.op_type == "Concat" else range(1)
        widened = []
        inputs = list(mover.inputs)
        for index in data:
            if inputs[index] is None:
                return False
            up = ir.node("Cast", [inputs[index]], attributes={"to": to})
            typed(up.outputs[0], to, ctx.shape(inputs[index]))
            widened.append(up)
            inputs[index] = up.outputs[0]
        return _rebuilt(ctx, "CastAbove", cast, [mover], inputs, to, widened)

    def _sink(self, cast: ir.Node, ctx: PassContext) -> bool:
        """Mover(Cast(x) wider) -> Cast(Mover(x)) where the mover alone reads the Cast."""
        to = _widening(cast, ctx)
        users = [user for user, _ in cast.outputs[0].uses()]
        mover = users[0] if to is not None and len(users) == 1 else None
        if mover is None or mover.op_type not in _UNDER or mover.domain not in DEFAULT_DOMAINS:
            return False
        if not _read_only_by(cast.outputs[0], mover):
            return False  # the cast tensor is a graph output too
        narrow = ir.Node(mover.domain, mover.op_type, cast.inputs, mover.attributes.values())
        typed(narrow.outputs[0], ctx.dtype(cast.inputs[0]), ctx.shape(mover.outputs[0]))  # type: ignore[arg-type]
        up = ir.node("Cast", narrow.outputs, attributes={"to": to})
        typed(up.outputs[0], to, ctx.shape(mover.outputs[0]))
        declined = replace_subgraph(
            ctx,
            "CastBelow" + mover.op_type,
            mover,
            [cast, mover],
            [narrow, up],
            mover.outputs,
            up.outputs,
        )
        return declined is None


def _rebuilt(
    ctx: PassContext,
    pattern: str,
    cast: ir.Node,
    old: list[ir.Node],
    inputs: list[ir.Value | None],
    dtype: ir.DataType | None,
    new: list[ir.Node],
) -> bool:
    """The last of ``old`` (the mover) again over ``inputs``, of ``dtype``, in place of it and
    ``cast``; whether it replaced them."""
    mover = old[-1]
    moved = ir.Node(mover.domain, mover.op_type, inputs, mover.attributes.values())
    typed(moved.outputs[0], dtype, ctx.shape(cast.outputs[0]))
    declined = replace_subgraph(
        ctx,
        pattern + mover.op_type,
        cast,
        [*old, cast],
        [*new, moved],
        cast.outputs,
        moved.outputs,
    )
    return declined is None
