"""Biases added in a split view of a tensor, viewed back: biases added to the tensor.

Swin's shifted windows add their mask per group of windows: the scores ``[B*W, H, N, N]`` are
viewed as ``[B, W, H, N, N]``, the mask ``[1, W, 1, N, N]`` is added, and the sum is viewed back
(torchvision's and timm's Swin under either exporter). ViTDet and SAM add their decomposed
relative positions the same way, two biases in a view that splits the query and key axes into
rows and columns: ``[B*H, qh, qw, kh, kw] + rel_h[..., None] + rel_w[..., None, :]``. The
attention fusions read the scores as ``MatMul + biases`` and stop at the Reshape.

A Reshape only renames the axes of the same elements, so

    Reshape(Reshape(s, V) + m1 + m2 ..., S) = s + Reshape(Expand(m1, E1), S1') + ...

where each axis of ``S`` is a run of axes of ``V`` (their product); a bias keeps a broadcast
(size 1) over a whole run, and is expanded to ``V``'s sizes in a run it varies along, since the
run's axes merge into one. Exact: the same additions of the same values, in the same order.

Which axes merge is read from the sizes: static ones, and a named dimension (the batch) that is
an axis of its own on both sides, or a product of such dimensions traced through the ops where
inference left a size unnamed (ViTDet's TorchScript export folds the heads into the batch with
sizes read at run time: ``[B*H, ...]``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import symbolic_size
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import new_constant, node_label, producer_of, replace_subgraph, typed
from fusectl.rewrite.registry import Category, NodeByNodePass, PassSpec, register_pass
from fusectl.rewrite.sizes import Size

_Dim = int | Size


def _runs(view: list[_Dim], shape: list[_Dim]) -> list[list[int]] | None:
    """The axes of ``view`` that make up each axis of ``shape`` (in order, products equal),
    or None where the view is no split of the shape. A symbolic size is a run of one axis of
    the same size. A view axis of size 1 joins the run it comes first in (where it goes
    changes nothing: broadcast along it is no broadcast)."""
    runs: list[list[int]] = []
    axis = 0
    for size in shape:
        if not isinstance(size, int):
            if axis >= len(view) or view[axis] != size:
                return None
            runs.append([axis])
            axis += 1
            continue
        run: list[int] = []
        while axis < len(view) and (not run or math.prod(_ints(view, run)) < size):
            if not isinstance(view[axis], int):
                return None
            run.append(axis)
            axis += 1
        if math.prod(_ints(view, run)) != size:
            return None
        runs.append(run)
    if runs and any(view[a] != 1 for a in range(axis, len(view))):
        return None
    if runs:
        runs[-1] += range(axis, len(view))
    return runs


def _ints(view: list[_Dim], run: list[int]) -> list[int]:
    return [d if isinstance(d, int) else 0 for d in (view[a] for a in run)]


def _known(ctx: PassContext, value: ir.Value) -> list[_Dim] | None:
    """The value's sizes, each static or a product of named dimensions (symbolic_size), or
    None where one is neither."""
    shape = ctx.shape(value)
    if shape is None:
        return None
    sizes: list[_Dim] = []
    for axis, dim in enumerate(shape):
        size = dim if isinstance(dim, int) else symbolic_size(ctx, value, axis)
        if size is None:
            return None
        sizes.append(size if isinstance(size, int) or size[1] else size[0])
    return sizes


def _viewed(
    bias: list[_Dim], view: list[_Dim], runs: list[list[int]]
) -> tuple[list[int], list[int]] | None:
    """The Expand target (1: as it is) and the Reshape target (-1: the one named size) that
    make ``bias`` (padded to the view's rank) a bias of the tensor; None where it is not."""
    expand, merged = [1] * len(view), []
    for run in runs:
        varies = [a for a in run if bias[a] != 1]
        if not varies:
            merged.append(1)
        elif not isinstance(view[run[0]], int):  # a symbolic size, the bias has it
            merged.append(-1)
        else:
            for a in run:
                expand[a] = 1 if bias[a] == view[a] else int(view[a])  # type: ignore[arg-type]
            merged.append(math.prod(_ints(view, run)))
    return (expand, merged) if merged.count(-1) <= 1 else None


def _chain(back: ir.Node) -> tuple[ir.Node, list[ir.Node], list[ir.Value]] | None:
    """(the split Reshape, the Adds, their biases) when ``back`` reads Reshape(s) plus biases
    added one after another; None otherwise."""
    adds, biases = [], []
    value = back.inputs[0]
    while True:
        add = producer_of(value, "Add")
        if add is None or len(add.inputs) != 2 or None in add.inputs:
            return None
        adds.append(add)
        for kept, bias in (add.inputs, add.inputs[::-1]):
            split = producer_of(kept, "Reshape")
            if split is not None:
                biases.append(bias)
                return split, adds, biases  # type: ignore[return-value]
        for kept, bias in (add.inputs, add.inputs[::-1]):
            if producer_of(kept, "Add") is not None:
                biases.append(bias)
                value = kept
                break
        else:
            return None


@register_pass
class SplitViewBiasCanonicalizationPass(NodeByNodePass):
    """Not a pattern: each Reshape back of a sum is judged on the sizes around it."""

    spec = PassSpec(
        name="SplitViewBiasCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: Reshape(Reshape(s, V) + m1 + ..., shape of s) -> s + m1 + ... "
        "each viewed as s (expanded only along the merged axes it varies on): Swin's "
        "shifted-window mask added per group of windows, ViTDet's and SAM's decomposed "
        "relative positions, so the attention fusions read them as biases",
        aliases=("split_view_bias_canonicalization",),
        priority=3046,  # before the attention fusions read the scores
        emits=(),
    )
    counts_changes = True
    anchor, pattern = "Reshape", "SplitViewBias"

    def judge(self, ctx: PassContext, back: ir.Node) -> str | None:
        """Rewrite at ``back`` if it ends such a round trip; why not where it nearly does;
        None where it is no candidate."""
        found = _chain(back)
        if found is None:
            return None
        split, adds, biases = found
        source, view_value = split.inputs[0], split.outputs[0]
        assert source is not None
        shape = _known(ctx, source)
        if shape is None or _known(ctx, back.outputs[0]) != shape:
            return None  # not a round trip, as far as the sizes tell
        view = _known(ctx, view_value)
        bias_shapes = [_known(ctx, bias) for bias in biases]
        if view is None or None in bias_shapes:
            return "the view's or a bias's sizes are not known"
        padded = [[1] * (len(view) - len(b)) + b for b in bias_shapes]  # type: ignore[operator]
        if all(p == view for p in padded):
            return None  # summands of the view's own shape (a residual): nothing broadcast
        if any(len(p) != len(view) for p in padded):
            return "a bias has more axes than the view"
        if any(b not in (1, v) for p in padded for b, v in zip(p, view, strict=True)):
            return "a bias does not broadcast to the view"
        if any(_known(ctx, add.outputs[0]) != view for add in adds):
            return "a bias enlarges the sum"
        runs = _runs(view, shape)
        viewed = [_viewed(p, view, runs) for p in padded] if runs is not None else [None]
        if runs is None or None in viewed:
            return "the view does not split the tensor's axes into runs"
        inner = [view_value, *(add.outputs[0] for add in adds)]
        if any(len(v.uses()) != 1 or v.is_graph_output() for v in inner):
            return "the view or a partial sum is also read elsewhere"
        graph = back.graph
        assert graph is not None
        label = node_label(back)
        dims = list(ctx.shape(source))  # type: ignore[arg-type]
        nodes: list[ir.Node] = []
        total = source
        # The first bias added first, as in the view: the Adds nearest the split come last.
        for index, (bias, (expand, merged)) in enumerate(
            reversed(list(zip(biases, viewed, strict=True)))  # type: ignore[arg-type]
        ):
            dtype = ctx.dtype(bias)
            operand = bias
            if any(size != 1 for size in expand):
                target = new_constant(
                    graph, f"{label}/expanded_{index}", np.array(expand, np.int64)
                )
                widened = ir.node("Expand", [bias, target])
                nodes.append(widened)
                operand = widened.outputs[0]
            flat = new_constant(graph, f"{label}/merged_{index}", np.array(merged, np.int64))
            reshape = ir.node("Reshape", [operand, flat])
            sizes = [d if m == -1 else m for d, m in zip(dims, merged, strict=True)]
            typed(reshape.outputs[0], dtype, ir.Shape(sizes))
            added = ir.node("Add", [total, reshape.outputs[0]])
            typed(added.outputs[0], ctx.dtype(back.outputs[0]), ir.Shape(dims))
            nodes += [reshape, added]
            total = added.outputs[0]
        replace_subgraph(
            ctx, "SplitViewBias", back, [back, *adds, split], nodes, back.outputs, [total]
        )
        return None
