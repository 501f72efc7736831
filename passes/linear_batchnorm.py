"""Inference BatchNormalization folded into the linear map in front of it.

A BatchNormalization over the output columns of a MatMul by a constant matrix (with or without
its constant bias Add) or of a Gemm is the map itself with each column scaled and shifted:
``W' = W * f``, ``b' = b * f + o`` for ``f = scale / sqrt(var + eps)``, ``o = B - mean * f``.
The columns are the normalized channels when the map's output is 2-D ``[rows, columns]`` (an
embedding head's ``Linear -> BatchNorm1d``), or when it is reshaped to such (timm LeViT's
LinearNorm, ``bn(linear(x).flatten(0, 1)).reshape_as(x)``): a reshape to ``[M, C]`` of a
tensor whose last axis is ``C`` keeps each of its rows a row of that axis. The reshapes stay,
reading the folded map; a Shape of the map's output (``reshape_as``) reads the new one, which
has its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.batchnorm import inference_affine
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_value,
    new_constant,
    node_label,
    producer_of,
    replace_subgraph,
    typed,
)
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass
from fusectl.rewrite.size_reads import move_before_readers

_VIEWS = frozenset({"Reshape", "Flatten"})
_SIZE_READERS = frozenset({"Shape", "Size"})


@dataclass
class _Fold:
    """A BatchNormalization after a linear map: the map (MatMul or Gemm), its bias Add and the
    bias per column, the reshapes between, and the per-column factor and offset."""

    linear: ir.Node
    add: ir.Node | None
    bias: np.ndarray
    views: list[ir.Node]
    factor: np.ndarray
    offset: np.ndarray


def _only_reader(value: ir.Value, reader: ir.Node, sizes: bool = False) -> bool:
    """Whether ``reader`` is the value's one reader (with ``sizes``: but for Shape / Size)."""
    if value.is_graph_output():
        return False
    return all(
        user is reader or (sizes and user.op_type in _SIZE_READERS) for user, _ in value.uses()
    )


def _per_column(array: np.ndarray | None, columns: int) -> np.ndarray | None:
    """A constant added to [rows, columns] as one value per column, if it is one."""
    if array is None or array.ndim > 2 or any(d != 1 for d in array.shape[:-1]):
        return None
    if array.size not in (1, columns):
        return None
    return np.broadcast_to(array.reshape(-1).astype(np.float64), (columns,))


def _views(batchnorm: ir.Node) -> tuple[list[ir.Node], ir.Value | None, ir.Node]:
    """The reshapes (Reshape, Flatten) the normalization reads the map through, each read by
    the next alone; the value they start from; and its reader among them."""
    views: list[ir.Node] = []
    value, reader = batchnorm.inputs[0], batchnorm
    while (node := value.producer() if value is not None else None) is not None and (
        node.op_type in _VIEWS and node.domain in ("", "ai.onnx") and _only_reader(value, reader)
    ):
        views.insert(0, node)
        value, reader = node.inputs[0], node
    return views, value, reader


def _plan(ctx: PassContext, batchnorm: ir.Node) -> _Fold | str | None:
    """The fold of ``batchnorm`` into the map before it, why not, or None where no linear map
    computes its input (a Conv's is ConvBatchnormFusionPass's)."""
    views, top, reader = _views(batchnorm)
    add = producer_of(top, "Add")
    terms = [t for t in add.inputs if t is not None] if add is not None else []
    constants = [constant_value(t) for t in terms]
    mapped = top
    if add is not None and len(terms) == 2 and sum(c is None for c in constants) == 1:
        mapped = next(t for t, c in zip(terms, constants, strict=True) if c is None)
    else:
        add = None
    linear = producer_of(mapped, "MatMul") or producer_of(mapped, "Gemm")
    if linear is None or top is None or mapped is None:
        return None
    weight = constant_value(linear.inputs[1])
    if weight is None or weight.ndim != 2 or not np.issubdtype(weight.dtype, np.floating):
        return None  # a product of two activations (attention), not a linear map
    transposed = linear.op_type == "Gemm" and linear.attributes.get_int("transB", 0)
    columns = int(weight.shape[0] if transposed else weight.shape[1])
    if not _only_reader(top, reader, sizes=True) or (add and not _only_reader(mapped, add)):
        return "the map's output is also read by another node"
    shape = ctx.shape(batchnorm.inputs[0])  # type: ignore[arg-type]
    if shape is None or len(shape) != 2 or shape[1] != columns:
        return "the BatchNormalization's channels are not the map's columns ([rows, columns])"
    bias = np.zeros(columns)
    if add is not None:
        found = _per_column(next(c for c in constants if c is not None), columns)
        if found is None:
            return "the bias Add is not one value per column"
        bias = found
    affine = inference_affine(batchnorm, columns)
    if isinstance(affine, str):
        return affine
    return _Fold(linear, add, bias, views, *affine)


def _folded_map(graph: ir.Graph, fold: _Fold, name: str) -> list[ir.Node] | str:
    """The map with its columns scaled by ``factor`` and its bias ``b * factor + offset``."""
    linear, factor, offset = fold.linear, fold.factor, fold.offset
    weight = constant_value(linear.inputs[1])
    assert weight is not None
    dtype = weight.dtype
    if linear.op_type == "MatMul":
        scaled = new_constant(graph, f"{name}/weight", (weight * factor).astype(dtype))
        shifted = new_constant(graph, f"{name}/bias", (fold.bias * factor + offset).astype(dtype))
        product = ir.node("MatMul", [linear.inputs[0], scaled])
        return [product, ir.node("Add", [product.outputs[0], shifted])]
    attributes = linear.attributes
    alpha, beta = attributes.get_float("alpha", 1.0), attributes.get_float("beta", 1.0)
    addend = np.zeros_like(factor)
    if len(linear.inputs) > 2 and linear.inputs[2] is not None:
        per_column = _per_column(constant_value(linear.inputs[2]), len(factor))
        if per_column is None:
            return "the Gemm's C is not a constant with one value per column"
        addend = beta * per_column
    columns = factor[:, None] if attributes.get_int("transB", 0) else factor[None, :]
    scaled = new_constant(graph, f"{name}/weight", (alpha * weight * columns).astype(dtype))
    shifted = new_constant(graph, f"{name}/bias", (addend * factor + offset).astype(dtype))
    kept = {k: v for k, v in attributes.items() if k not in ("alpha", "beta")}
    return [ir.node("Gemm", [linear.inputs[0], scaled, shifted], attributes=kept)]


def _fold_before(
    ctx: PassContext, graph: ir.Graph, batchnorm: ir.Node, name: str
) -> tuple[ir.Node, list[ir.Node]] | str | None:
    """The map that reads the normalization's [rows, C] output as its first operand, and its
    replacement reading the normalization's input: ``(x * f + o) @ W = x @ (f W) + o @ W``
    (timm LeViT's and RepViT's BatchNorm1d before the classifier's Linear); why not; or None
    where no linear map reads it."""
    output = batchnorm.outputs[0]
    readers = [user for user, _ in output.uses()]
    if len(readers) != 1 or output.is_graph_output():
        return None
    linear = readers[0]
    if linear.op_type not in ("MatMul", "Gemm") or linear.domain not in ("", "ai.onnx"):
        return None
    if linear.inputs[0] is not output or linear.inputs[1] is output:
        return None
    weight = constant_value(linear.inputs[1])
    if weight is None or weight.ndim != 2 or not np.issubdtype(weight.dtype, np.floating):
        return None
    attributes = linear.attributes
    if linear.op_type == "Gemm" and attributes.get_int("transA", 0):
        return "the Gemm reads the normalized [rows, channels] transposed"
    shape = ctx.shape(batchnorm.inputs[0])  # type: ignore[arg-type]
    transposed = linear.op_type == "Gemm" and attributes.get_int("transB", 0)
    channels = int(weight.shape[1] if transposed else weight.shape[0])
    if shape is None or len(shape) != 2 or shape[1] != channels:
        return "the BatchNormalization's channels are not the map's input columns ([rows, columns])"
    affine = inference_affine(batchnorm, channels)
    if isinstance(affine, str):
        return affine
    factor, offset = affine
    matrix = weight.T.astype(np.float64) if transposed else weight.astype(np.float64)  # [C, K]
    alpha = attributes.get_float("alpha", 1.0) if linear.op_type == "Gemm" else 1.0
    shift = alpha * (offset @ matrix)  # what o adds to every row of the product
    beta = attributes.get_float("beta", 1.0)
    addend = shift  # the Gemm's C, scaled by its beta, joins the shift
    if linear.op_type == "Gemm" and len(linear.inputs) > 2 and linear.inputs[2] and beta != 0:
        per_column = _per_column(constant_value(linear.inputs[2]), len(shift))
        if per_column is None:
            return "the Gemm's C is not a constant with one value per column"
        addend = beta * per_column + shift
    rows = factor[None, :] if transposed else factor[:, None]
    scaled = new_constant(graph, f"{name}/weight", (weight * rows).astype(weight.dtype))
    shifted = new_constant(graph, f"{name}/bias", addend.astype(weight.dtype))
    x = batchnorm.inputs[0]
    if linear.op_type == "MatMul":
        product = ir.node("MatMul", [x, scaled])
        return linear, [product, ir.node("Add", [product.outputs[0], shifted])]
    kept = {k: v for k, v in attributes.items() if k != "beta"}
    return linear, [ir.node("Gemm", [x, scaled, shifted], attributes=kept)]


@register_pass
class LinearBatchnormFusionPass(FusionPass):
    spec = PassSpec(
        name="LinearBatchnormFusionPass",
        category=Category.GRAPH,
        description="inference BatchNormalization over the output columns of a MatMul by a "
        "constant (with its bias Add) or a Gemm, directly or through a reshape to [rows, "
        "columns] (BN1d embedding heads, timm LeViT's LinearNorm), or over the [rows, "
        "columns] such a map reads (a classifier's BatchNorm1d) -> the map with folded "
        "weights and bias",
        aliases=("linear_bn_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=4065,
        emits=("MatMul", "Add", "Gemm"),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("LinearBatchnorm")
        graph = model.graph
        for batchnorm in ctx.op_index.of_type(graph, "BatchNormalization"):
            if batchnorm.graph is not graph:
                continue  # removed by an earlier fold
            name = f"{ctx.spec.name}/{node_label(batchnorm)}"
            fold = _plan(ctx, batchnorm)
            if isinstance(fold, _Fold):
                made = _folded_map(graph, fold, name)
                if isinstance(made, str):
                    stats.decline(made, node_label(batchnorm))
                else:
                    self._replace(ctx, batchnorm, fold, made)
                continue
            # Not into the map before it: into the one that reads it, if one does.
            into = self._fold_into_reader(ctx, graph, batchnorm, name)
            reason = fold if isinstance(fold, str) else into
            if into is not True and isinstance(reason, str):
                stats.decline(reason, node_label(batchnorm))

    @staticmethod
    def _fold_into_reader(
        ctx: PassContext, graph: ir.Graph, batchnorm: ir.Node, name: str
    ) -> bool | str | None:
        """The normalization folded into the map that reads it (_fold_before): True where it
        was, why not, or None where no linear map reads it."""
        found = _fold_before(ctx, graph, batchnorm, name)
        if found is None or isinstance(found, str):
            return found
        linear, made = found
        output = linear.outputs[0]
        typed(made[0].outputs[0], ctx.dtype(output), ctx.shape(output))
        typed(made[-1].outputs[0], ctx.dtype(output), ctx.shape(output))
        refused = replace_subgraph(
            ctx,
            "LinearBatchnorm",
            linear,
            [batchnorm, linear],
            made,
            [output],
            [made[-1].outputs[0]],
        )
        return refused is None or refused

    @staticmethod
    def _replace(ctx: PassContext, batchnorm: ir.Node, fold: _Fold, made: list[ir.Node]) -> None:
        """Swap map, bias, reshapes and normalization for the folded map and the reshapes
        reading it; the map's old output (read by Shape at most) becomes the new map's."""
        batchnorm_graph = batchnorm.graph
        assert batchnorm_graph is not None
        mapped = made[-1].outputs[0]
        old_map = (fold.add or fold.linear).outputs[0]
        for new, old_value in ((made[0], fold.linear.outputs[0]), (made[-1], old_map)):
            typed(new.outputs[0], ctx.dtype(old_value), ctx.shape(old_value))
        current, views = mapped, []
        for view in fold.views:
            copy = ir.node(
                view.op_type,
                [current, *view.inputs[1:]],
                attributes=dict(view.attributes),
                domain=view.domain,
            )
            typed(copy.outputs[0], ctx.dtype(view.outputs[0]), ctx.shape(view.outputs[0]))
            views.append(copy)
            current = copy.outputs[0]
        old = [fold.linear, *([fold.add] if fold.add else []), *fold.views, batchnorm]
        old_outputs = [batchnorm.outputs[0]]
        new_outputs = [current]
        if old_map.uses() and any(user not in old for user, _ in old_map.uses()):
            old_outputs.append(old_map)  # read by a Shape outside: the new map has its shape
            new_outputs.append(mapped)
        refused = replace_subgraph(
            ctx, "LinearBatchnorm", batchnorm, old, [*made, *views], old_outputs, new_outputs
        )
        if refused is None and len(old_outputs) > 1:  # placed at the normalization: the map
            move_before_readers(batchnorm_graph, made)  # goes before the Shape reading it
