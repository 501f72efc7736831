"""A shape taken apart and put back together is the shape.

TorchScript writes ``x.size()`` used whole as one Gather per dimension, each Unsqueezed, then
a Concat (the token types of ``torch.zeros(input_ids.size())``), and ``t.expand(sizes)`` as
``Expand(t, Where(Equal(sizes, -1), 1, sizes))`` (-1 keeps a size). Once the sizes are read
as what they are, a Concat of x's sizes in axis order is ``Shape(x)`` (or ``Shape(x, start,
end)``), the -1 test of sizes, which are never negative, is the sizes, and an Expand of x to
x's own shape is x: shape arithmetic that no fusion needs, gone before the fusions look.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import copied_dimensions
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_value, producer_of, replace_subgraph
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

# Shape's start and end attributes came with opset 15.
_SHAPE_RANGE_OPSET = 15


def _size_parts(concat: ir.Node) -> list[tuple[ir.Value, int] | int] | None:
    """The Concat's elements, each a copied size (x, i) or a constant; None otherwise."""
    if concat.attributes.get_int("axis", 0) not in (0, -1) or None in concat.inputs:
        return None
    parts: list[tuple[ir.Value, int] | int] = []
    for part in concat.inputs:
        array = constant_value(part)
        run = copied_dimensions(part) if array is None else None
        if array is None and run is None:
            return None
        parts += [int(v) for v in array.reshape(-1)] if array is not None else run  # type: ignore[operator]
    return parts


def _shape_run(ctx: PassContext, concat: ir.Node) -> tuple[ir.Value, int, int] | None:
    """(x, i, j) when the Concat joins x's sizes i..j-1 in order, each copied or a constant
    equal to x's static size there (constant folding reads those), and nothing else."""
    parts = _size_parts(concat)
    copies = [part for part in parts or [] if isinstance(part, tuple)]
    if not copies:
        return None
    data, axis = copies[0]
    shape = ctx.shape(data)
    if shape is None:
        return None
    rank = len(shape)
    start = axis % rank - parts.index(copies[0])  # type: ignore[union-attr]
    end = start + len(parts)  # type: ignore[arg-type]
    if start < 0 or end > rank:
        return None
    for position, part in enumerate(parts, start):  # type: ignore[arg-type]
        if isinstance(part, int) and part != shape[position]:
            return None
        if isinstance(part, tuple) and (part[0] is not data or part[1] % rank != position):
            return None
    if (start, end) != (0, rank) and ctx.opset < _SHAPE_RANGE_OPSET:
        return None
    return data, start, end


# Ops whose output elements are elements of their first input: views and picks.
_ELEMENTS_OF_FIRST = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather"})


def _sizes(value: ir.Value | None, depth: int = 8) -> bool:
    """Whether every element of ``value`` is a size (never negative): a Shape or Size, a view
    or pick of sizes (TorchScript flattens a Concat of sizes with a Reshape to [-1], and
    writes one size as Unsqueeze(Squeeze(Slice(Shape)))), a Concat of sizes, a constant that
    is not negative."""
    if value is None or depth == 0:
        return False
    array = constant_value(value)
    if array is not None:
        return bool(np.issubdtype(array.dtype, np.integer) and np.all(array >= 0))
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in ("Shape", "Size"):
        return True
    if node.op_type in _ELEMENTS_OF_FIRST:
        return _sizes(node.inputs[0], depth - 1)
    return node.op_type == "Concat" and all(_sizes(part, depth - 1) for part in node.inputs)


def _kept_sizes(where: ir.Node) -> ir.Value | None:
    """s for Where(Equal(s, c), a, s) with c negative and s sizes: the test is never true."""
    if len(where.inputs) != 3:
        return None
    equal = producer_of(where.inputs[0], "Equal")
    sizes = where.inputs[2]
    if equal is None or sizes is None or sizes not in equal.inputs or not _sizes(sizes):
        return None
    others = [v for v in equal.inputs if v is not sizes]
    flag = constant_value(others[0]) if len(others) == 1 and others[0] is not None else None
    return sizes if flag is not None and bool(np.all(flag < 0)) else None


@register_pass
class ShapeRunCanonicalizationPass(FusionPass):
    """Not a pattern: each Concat, Where and Expand of sizes is judged alone."""

    spec = PassSpec(
        name="ShapeRunCanonicalizationPass",
        category=Category.GRAPH,
        description="a Concat of x's sizes in axis order -> Shape(x) (start/end from opset "
        "15); Where(Equal(sizes, -1), 1, sizes) (TorchScript's expand) -> sizes; "
        "Expand(x, Shape(x)) -> x",
        aliases=("shape_run_canonicalization",),
        priority=3032,
        emits=("Shape",),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        for concat in ctx.op_index.of_type(graph, "Concat"):
            if concat.graph is graph:
                self._concat(ctx, concat)
        for where in ctx.op_index.of_type(graph, "Where"):
            sizes = _kept_sizes(where) if where.graph is graph else None
            if sizes is not None:
                self._forward(ctx, "ExpandSizes", where, sizes)
        for expand in ctx.op_index.of_type(graph, "Expand"):
            shape = producer_of(expand.inputs[1], "Shape") if expand.graph is graph else None
            if shape is None or shape.attributes or shape.inputs[0] is not expand.inputs[0]:
                continue
            self._forward(ctx, "ExpandToOwnShape", expand, expand.inputs[0])  # type: ignore[arg-type]
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()

    @staticmethod
    def _concat(ctx: PassContext, concat: ir.Node) -> None:
        run = _shape_run(ctx, concat)
        if run is None:
            return
        data, start, end = run
        rank = len(ctx.shape(data))  # type: ignore[arg-type]
        attributes = {} if (start, end) == (0, rank) else {"start": start, "end": end}
        shape = ir.node("Shape", [data], attributes=attributes)
        result = shape.outputs[0]
        result.dtype = ir.DataType.INT64
        result.shape = ir.Shape([end - start])
        replace_subgraph(ctx, "ShapeRun", concat, [concat], [shape], concat.outputs, [result])

    @staticmethod
    def _forward(ctx: PassContext, pattern: str, node: ir.Node, value: ir.Value) -> None:
        """The node's output is ``value``: readers take it (an Identity, bypassed)."""
        identity = ir.node("Identity", [value])
        identity.outputs[0].dtype = node.outputs[0].dtype
        identity.outputs[0].shape = node.outputs[0].shape
        replace_subgraph(ctx, pattern, node, [node], [identity], node.outputs, identity.outputs)
