"""Every m-th element of the last axis, read through a view that splits it, written as the
strided Slice it is.

Code that treats pairs of a head as complex numbers (llama2.c, torchtune, gpt-fast, Meta's
reference rotary in real arithmetic) views the last axis as [..., L/m, m] and takes one
position of the new axis:

    x_r, x_i = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)     # or x_pairs[..., 0], [..., 1]

Exporters spell the selection three ways: Split + Squeeze (TorchScript's unbind), Slice of
one + Squeeze (dynamo's), Gather of one scalar index (``[..., 0]``). Each is x[..., k::m]:
element j of the selection is element j*m + k of x's last axis. Written as that Slice of x,
the view goes, and the passes that read strided elements (the rotary fusion's pair-by-pair
rotation) see one form. Pure data movement: exact.

onnx-simplifier also merges the view of the heads and the view of their pairs into one, [..., H
* L] -> [..., H, L/m, m]. Such a view is first written as the two it merged, a Reshape to
[..., H, L] then the pair view (split only where a selection of it is then rewritten, so
the merged view goes): the selection is then the same strided Slice of the heads.

A position may also be read with its axis of one kept (a Split part, a Slice of one):
onnx-simplifier takes away the Squeeze -> Unsqueeze that unbind and stack leave between a part
and the Concat of the rotated pair. That part is Unsqueeze(x[..., k::m], -1), and is written so
once it is the last selection of the view still read: the view (and a Split) then go, for as
many nodes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import keeps_leading, last_axis_positions
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    constant_value,
    new_constant,
    new_unsqueeze,
    node_axes,
    node_label,
    producer_of,
    replace_subgraph,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

# Slice takes its steps as an input from this opset.
_STEPS_OPSET = 10


def _dropped_position(ctx: PassContext, node: ir.Node) -> tuple[ir.Value, int] | None:
    """(view, k) where ``node`` takes position k of the view's last axis and drops that axis:
    Gather of one scalar index, or Squeeze of that axis after any selection of one position
    of it (a Slice, a Split part, a Gather of [k]: the toolkit's last_axis_positions). k is
    not negative."""
    data = node.inputs[0]
    shape = ctx.shape(data) if data is not None else None
    if data is None or shape is None or not shape:
        return None
    rank, last = len(shape), len(shape) - 1
    if node.op_type == "Gather":
        index = constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
        size = shape[-1]
        if index is None or index.ndim != 0 or index.dtype.kind not in "iu":
            return None
        if node.attributes.get_int("axis", 0) % rank != last or not isinstance(size, int):
            return None
        return (data, int(index) % size) if -size <= int(index) < size else None
    axes = node_axes(node)
    if axes is None or [a % rank for a in axes] != [last]:
        return None
    # Squeezing the last axis, of one element: the one position a Slice or Split kept.
    kept = last_axis_positions(ctx, data)
    if kept is None or len(kept[1]) != 1 or len(ctx.shape(kept[0]) or ()) != rank:
        return None
    return kept[0], kept[1][0]


def _is_read(value: ir.Value) -> bool:
    return bool(value.uses()) or value.is_graph_output()


def _read(node: ir.Node) -> bool:
    """Whether anything reads the node's outputs (a selection rewritten is left unread)."""
    return any(map(_is_read, node.outputs))


@register_pass
class StridedSelectionCanonicalizationPass(FusionPass):
    """Not a pattern: each selection is judged alone, its view read by what it keeps."""

    spec = PassSpec(
        name="StridedSelectionCanonicalizationPass",
        category=Category.GRAPH,
        description="position k of the last axis of Reshape(x, [..., L/m, m]) (Gather of a "
        "scalar index, Squeeze of a Slice of one or of a Split into ones: unbind, [..., k]) -> "
        "Slice(x, k::m) on x's last axis (complex-pair rotary as llama2.c and torchtune write "
        "it)",
        aliases=("PairSelectionToSlice",),
        priority=3044,  # before RotaryHalvesCanonicalization and the rotary fusion
        canonical=True,
        emits=("Slice",),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        ctx.pattern("StridedSelection")  # reported where nothing matches too
        graph = model.graph
        gathers = ctx.op_index.of_type(graph, "Gather", DEFAULT_DOMAINS)
        # The positions kept with their axis of one (a Split part, a Slice of one) come second,
        # each once it is the last of its view still read: the view then goes with it. Listed
        # now, before the Slices this pass writes.
        kept_axis = [
            *ctx.op_index.of_type(graph, "Split", DEFAULT_DOMAINS),
            *ctx.op_index.of_type(graph, "Slice", DEFAULT_DOMAINS),
            *gathers,
        ]
        for node in [*gathers, *ctx.op_index.of_type(graph, "Squeeze", DEFAULT_DOMAINS)]:
            if node.graph is not graph:
                continue
            found = _dropped_position(ctx, node)
            self._select(ctx, graph, node, found, node.outputs[0], drops=True)
        for node in kept_axis:
            read = [part for part in node.outputs if _is_read(part)]
            view = node.inputs[0] if node.inputs else None
            if node.graph is not graph or len(read) != 1 or view is None:
                continue
            others = (user for user, _ in view.uses() if user is not node)
            if view.is_graph_output() or any(map(_read, others)):
                continue
            kept = last_axis_positions(ctx, read[0])
            if kept is not None and kept[0] is view and len(kept[1]) == 1:
                self._select(ctx, graph, node, (view, kept[1][0]), read[0], drops=False)

    def _select(
        self,
        ctx: PassContext,
        graph: ir.Graph,
        node: ir.Node,
        found: tuple[ir.Value, int] | None,
        selected: ir.Value,
        *,
        drops: bool,
    ) -> None:
        """Rewrite ``selected``, position k of ``found``'s view made by ``node``, where the
        view splits its data's last axis; decline with the reason where it does not."""
        reshape = producer_of(found[0], "Reshape") if found is not None else None
        if found is None or reshape is None or reshape.inputs[0] is None:
            return
        view, position = found
        x = reshape.inputs[0]
        if ctx.opset >= _STEPS_OPSET and (inner := self._split_view(ctx, reshape, x, view)):
            reshape, x = inner
        reason = self._unsplit(ctx, reshape, x, view)
        if reason is None and ctx.opset < _STEPS_OPSET:
            reason = f"a strided Slice needs opset >= {_STEPS_OPSET}, model has {ctx.opset}"
        if reason is not None:
            ctx.pattern("StridedSelection").decline(reason, node_label(node))
            return
        group = ctx.shape(view)[-1]  # type: ignore[index]
        self._rewrite(ctx, graph, node, x, position, group, selected, drops)

    def _split_view(
        self, ctx: PassContext, reshape: ir.Node, x: ir.Value, view: ir.Value
    ) -> tuple[ir.Node, ir.Value] | None:
        """Where the view splits x's last axis into more than two, [..., H, L/m, m], the
        Reshape written as x -> [..., H, L] -> the view: (the pair view, its data)."""
        shape, viewed = ctx.shape(x), ctx.shape(view)
        if shape is None or viewed is None or not shape or len(viewed) <= len(shape) + 1:
            return None
        leading = len(shape) - 1
        tail = list(viewed[leading:])
        if not all(isinstance(n, int) for n in (*tail, shape[-1])):
            return None
        if int(np.prod(tail)) != shape[-1] or not keeps_leading(
            ctx, reshape, shape, viewed, leading
        ):
            return None
        name = f"{self.spec.name}/{node_label(reshape)}"
        heads = [*tail[:-2], tail[-2] * tail[-1]]
        target = new_constant(reshape.graph, f"{name}_heads", np.array([0] * leading + heads))  # type: ignore[arg-type]
        inner = ir.node("Reshape", [x, target])
        typed(inner.outputs[0], ctx.dtype(view), ir.Shape([*shape[:leading], *heads]))
        pairs = ir.node("Reshape", [inner.outputs[0], *reshape.inputs[1:]], reshape.attributes)
        typed(pairs.outputs[0], ctx.dtype(view), view.shape)
        replaced = replace_subgraph(
            ctx, "MergedViewSplit", reshape, [reshape], [inner, pairs], [view], pairs.outputs
        )
        return None if replaced is not None else (pairs, inner.outputs[0])

    @staticmethod
    def _unsplit(ctx: PassContext, reshape: ir.Node, x: ir.Value, view: ir.Value) -> str | None:
        """Why the view is not x with its last axis split into [L/m, m], if it is not."""
        shape, viewed = ctx.shape(x), ctx.shape(view)
        if shape is None or viewed is None or len(viewed) != len(shape) + 1:
            return "the view does not add one axis to its data"
        if not shape:
            return "the data is a scalar: it has no last axis to split"
        size, groups, group = shape[-1], viewed[-2], viewed[-1]
        if not all(isinstance(n, int) for n in (size, groups, group)) or groups * group != size:  # type: ignore[operator]
            return "the view does not split the data's last axis (sizes unknown or other)"
        if not keeps_leading(ctx, reshape, shape, viewed, len(shape) - 1):
            return "the view does not provably keep the data's leading axes"
        return None

    def _rewrite(
        self,
        ctx: PassContext,
        graph: ir.Graph,
        node: ir.Node,
        x: ir.Value,
        position: int,
        group: int,
        selected: ir.Value,
        drops: bool,
    ) -> None:
        rank = len(ctx.shape(x))  # type: ignore[arg-type]
        size = ctx.shape(x)[-1]  # type: ignore[index]
        name = f"{self.spec.name}/{node_label(node)}"
        operands = [
            new_constant(graph, f"{name}_{part}", np.array([value], dtype=np.int64))
            for part, value in (
                ("starts", position),
                ("ends", size),
                ("axes", rank - 1),
                ("steps", group),
            )
        ]
        sliced = ir.node("Slice", [x, *operands])
        if drops:  # the selection drops the view's last axis
            typed(sliced.outputs[0], ctx.dtype(selected), ctx.shape(selected))
            replace_subgraph(
                ctx, "StridedSelection", node, [node], [sliced], node.outputs, sliced.outputs
            )
            return
        shape = ctx.shape(selected)  # a Split part or a Slice keeps it, of one
        typed(sliced.outputs[0], ctx.dtype(selected), ir.Shape(shape[:-1]) if shape else None)
        restored = new_unsqueeze(ctx, graph, sliced.outputs[0], [rank], f"{name}_axis")
        typed(restored.outputs[0], ctx.dtype(selected), shape)
        replace_subgraph(
            ctx, "StridedSelection", node, [node], [sliced, restored], [selected], restored.outputs
        )
