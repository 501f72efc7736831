"""Pieces of a projection, taken along an axis its columns are viewed in: projections of their own.

A fused QKV projection viewed as grouped heads, ``[B, L, KV, r + 2, H]`` (litgpt, Falcon's new
decoder architecture), is cut into the query, key and value along the ``r + 2`` axis, directly
or after moving the heads first. Each element of a piece is the dot product of the input with
one column of the weight, so a piece is

    Reshape(MatMul(x, W[:, cols]) (+ b[cols]), the view's sizes with the piece's)

with ``cols`` the columns whose coordinate on the cut axis falls in the piece (the view is
row-major, so they are read off an index grid). The same dot products: exact.

A piece is then a plain projection viewed as heads, as the attention fusions read q, k and v.
A piece of one position keeps its axis as an Unsqueeze of the piece without it, after the move
where there is one: the key and value of one group each, spread to the group's query heads
next, are then transformers' ``repeat_kv`` of ``[B, KV, L, H]`` heads, which the grouped-query
fusion reads. Pieces are read by Split, Slice (any step) or Gather of constant indices
(``axis_positions``), of the view or of one Transpose of it.

The cut axis is one the view splits the columns into, not its last: parts of the last axis
are each head's own elements, treated apart and joined again (a rotary's halves, a partial
rotary's rest, DeepSeek's rope and nope parts), which a cut would hide from the rotary fusion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import axis_positions, keeps_leading
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    constant_tensor,
    constant_value,
    new_constant,
    new_unsqueeze,
    node_label,
    producer_of,
    remove_dead,
    replace_subgraph,
    taken_constant,
    transpose_perm,
    typed,
)
from fusectl.rewrite.registry import Category, NodeByNodePass, PassSpec, register_pass


@dataclass
class _Projection:
    """x @ W (+ b): the MatMul, the bias Add if any, and their constant operands."""

    x: ir.Value
    weight: ir.Value  # [K, C]
    width: int  # C
    nodes: list[ir.Node]  # the MatMul, then the Add
    bias: ir.Value | None = None  # [C]
    bias_first: bool = False  # Add(b, x @ W)


def _constant_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of a constant, read without converting its data (a weight is large)."""
    if value is None or value.is_graph_input():
        return None
    tensor = constant_tensor(value)
    if tensor is not None:
        return tuple(int(size) for size in tensor.shape)
    array = constant_value(value)
    return None if array is None else array.shape


def _projection(value: ir.Value | None) -> _Projection | None:
    """The projection computing ``value``, where its weight (and bias) are constants."""
    add = producer_of(value, "Add")
    bias, first, product = None, False, value
    if add is not None:
        for index in (0, 1):
            if len(_constant_shape(add.inputs[index]) or ()) == 1:
                bias, first, product = add.inputs[index], index == 0, add.inputs[1 - index]
                break
        else:
            return None
    matmul = producer_of(product, "MatMul")
    if matmul is None or matmul.domain not in DEFAULT_DOMAINS or matmul.inputs[0] is None:
        return None
    weight = _constant_shape(matmul.inputs[1])
    if weight is None or len(weight) != 2:
        return None
    if add is not None and (
        _constant_shape(bias) != (weight[1],)
        or len(product.uses()) != 1  # type: ignore[union-attr]
        or product.is_graph_output()  # type: ignore[union-attr]
    ):
        return None
    nodes = [matmul] if add is None else [matmul, add]
    x, source = matmul.inputs[0], matmul.inputs[1]
    return _Projection(x, source, weight[1], nodes, bias, first)  # type: ignore[arg-type]


@dataclass
class _Piece:
    value: ir.Value  # what the selection returned
    positions: list[int]
    kept: bool  # the cut axis stays (Split, Slice, Gather of 1-D indices)


def _pieces(
    ctx: PassContext, read: ir.Value, lead: int, rank: int, perm: list[int] | None
) -> tuple[int, list[_Piece], list[ir.Node]] | str | None:
    """(the view's axis cut, the pieces, their selection nodes) where every reader of ``read``
    (the view, or its Transpose by ``perm``) selects along one axis of the projection's
    columns; why not where one does and another reads otherwise; else None."""
    nodes: list[ir.Node] = []
    for use in read.uses():
        if use.node not in nodes:
            nodes.append(use.node)
    if not nodes:
        return None
    pieces: list[_Piece] = []
    cut: set[int] = set()
    other: ir.Node | None = None  # a reader that is no selection
    for node in nodes:
        for output in node.outputs:
            selection = axis_positions(ctx, output) if node.inputs[0] is read else None
            if selection is None:
                other = node
                break
            axis = perm[selection.axis] if perm is not None else selection.axis
            cut.add(axis)
            pieces.append(_Piece(output, selection.positions, selection.kept))
    if not pieces or other is not None:
        return None  # read whole too (a rotary's halves and its product): no pieces alone
    if any(axis < lead or axis == rank - 1 for axis in cut):
        # Rows are no piece of the weight. Parts of the last axis, each head's own elements,
        # are treated apart and joined again (a rotary's halves, a partial rotary's rest):
        # cut, the rotary would no longer see one head.
        return None
    if len(cut) != 1:
        return "the view is cut along two of its axes"
    if read.is_graph_output():
        return "the projection's view is a graph output"
    return cut.pop(), pieces, nodes


def _columns(sizes: list[int], axis: int, positions: list[int]) -> np.ndarray:
    """The weight's columns a piece reads: the positions of ``axis`` in the row-major grid of
    the view's column sizes, flattened in the order the piece's own view reads them."""
    grid = np.arange(math.prod(sizes)).reshape(sizes)
    return np.take(grid, positions, axis=axis).reshape(-1)


@register_pass
class ProjectionPieceCanonicalizationPass(NodeByNodePass):
    """Not a pattern: each view of a projection is judged on the readers it has."""

    spec = PassSpec(
        name="ProjectionPieceCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: pieces of a projection x @ W (+ b) cut along an axis its "
        "columns are viewed in (litgpt's and Falcon's grouped QKV, [B, L, KV, r+2, H], split "
        "into query, key and value) -> one projection per piece with the weight's columns, "
        "viewed alike; a piece of one position as an Unsqueeze (repeat_kv's form)",
        aliases=("projection_piece_canonicalization", "QkvSplitCanonicalization"),
        priority=3037,  # before LayoutChainCanonicalizationPass merges the pieces' views
        emits=("MatMul", "Add", "Reshape", "Transpose", "Unsqueeze"),
        canonical=True,
    )
    counts_changes = True
    anchor, pattern = "Reshape", "ProjectionPiece"

    def judge(self, ctx: PassContext, reshape: ir.Node) -> str | None:
        """Cut the projection under ``reshape`` where its view is read in pieces; why not where
        it nearly is; None where it is no candidate."""
        projection = _projection(reshape.inputs[0])
        viewed = reshape.outputs[0]
        source, shape = ctx.shape(reshape.inputs[0]), ctx.shape(viewed)
        if projection is None or source is None or shape is None:
            return None
        lead = len(source) - 1
        sizes = list(shape[lead:])
        if len(sizes) < 2 or not all(isinstance(size, int) for size in sizes):
            return None
        if math.prod(sizes) != projection.width or not keeps_leading(
            ctx, reshape, source, shape, lead
        ):
            return None
        transpose, perm, read = None, None, viewed
        uses = viewed.uses()
        if len(uses) == 1 and uses[0].node.op_type == "Transpose" and not viewed.is_graph_output():
            transpose = uses[0].node
            perm = transpose_perm(transpose, len(shape))
            if perm is None:
                return None
            read = transpose.outputs[0]
        found = _pieces(ctx, read, lead, len(shape), perm)
        if not isinstance(found, tuple):
            return found
        axis, pieces, selections = found
        product = projection.nodes[-1].outputs[0]
        if len(product.uses()) != 1 or product.is_graph_output():
            return "the projection is also read elsewhere than its view"
        live = [piece for piece in pieces if piece.value.uses() or piece.value.is_graph_output()]
        view = _View(reshape, source, sizes, axis, perm)
        built = [_cut(ctx, view, projection, piece, index) for index, piece in enumerate(live)]
        old = [*projection.nodes, reshape, *([transpose] if transpose else []), *selections]
        target = reshape.inputs[1]
        graph = reshape.graph
        assert graph is not None
        replaced = replace_subgraph(
            ctx,
            "ProjectionPiece",
            reshape,
            old,
            [node for nodes in built for node in nodes],
            [piece.value for piece in live],
            [nodes[-1].outputs[0] for nodes in built],
        )
        if replaced is None:
            remove_dead(graph, [target.producer() if target is not None else None])
        return None


@dataclass
class _View:
    """The projection's view: its Reshape, the projection's shape, the view's column sizes,
    the view axis cut, and the Transpose's perm the pieces are read after (if any)."""

    reshape: ir.Node
    source: ir.Shape
    sizes: list[int]
    axis: int
    perm: list[int] | None


def _cut(
    ctx: PassContext, view: _View, projection: _Projection, piece: _Piece, index: int
) -> list[ir.Node]:
    """One piece as its own projection, viewed (and moved) as the piece was; the last node's
    output is the piece."""
    graph = view.reshape.graph
    assert graph is not None
    lead = len(view.source) - 1
    column = view.axis - lead
    columns = _columns(view.sizes, column, piece.positions)
    name = f"{ctx.spec.name}/{node_label(view.reshape)}/piece{index}"
    dtype = ctx.dtype(projection.nodes[-1].outputs[0])
    weight = taken_constant(graph, f"{name}/weight", projection.weight, columns, 1)
    matmul = ir.node("MatMul", [projection.x, weight])
    nodes = [matmul]
    merged = ir.Shape([*view.source[:lead], len(columns)])
    typed(matmul.outputs[0], dtype, merged)
    if projection.bias is not None:
        bias = taken_constant(graph, f"{name}/bias", projection.bias, columns, 0)
        pair = [bias, matmul.outputs[0]] if projection.bias_first else [matmul.outputs[0], bias]
        nodes.append(ir.node("Add", pair))
        typed(nodes[-1].outputs[0], dtype, merged)
    unit = len(piece.positions) == 1
    sizes = list(view.sizes)
    sizes[column] = len(piece.positions)
    if unit:
        del sizes[column]
    if len(sizes) > 1:
        target = new_constant(graph, f"{name}/shape", np.array([0] * lead + sizes, np.int64))
        nodes.append(ir.node("Reshape", [nodes[-1].outputs[0], target]))
        typed(nodes[-1].outputs[0], dtype, ir.Shape([*view.source[:lead], *sizes]))
    position = view.axis
    if view.perm is not None:
        perm = view.perm
        position = perm.index(view.axis)
        if unit:
            perm = [axis - (axis > view.axis) for axis in perm if axis != view.axis]
        moved = ctx.shape(nodes[-1].outputs[0])
        assert moved is not None
        nodes.append(ir.node("Transpose", [nodes[-1].outputs[0]], attributes={"perm": perm}))
        typed(nodes[-1].outputs[0], dtype, ir.Shape([moved[axis] for axis in perm]))
    if unit and piece.kept:
        nodes.append(
            new_unsqueeze(ctx, graph, nodes[-1].outputs[0], [position], f"{name}/unit_axis")
        )
    typed(nodes[-1].outputs[0], dtype, ctx.shape(piece.value))
    return nodes
