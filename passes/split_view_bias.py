"""A bias added in a split view of a tensor, viewed back: a bias added to the tensor.

Swin's shifted windows add their mask per group of windows: the scores ``[B*W, H, N, N]`` are
viewed as ``[B, W, H, N, N]``, the mask ``[1, W, 1, N, N]`` is added, and the sum is viewed back
(torchvision's and timm's Swin under either exporter; ViTDet adds its decomposed relative
positions the same way, in a view that splits the query and key axes into rows and columns).
The attention fusions read the scores as ``MatMul + biases`` and stop at the Reshape.

A Reshape only renames the axes of the same elements, so

    Reshape(Reshape(s, V) + m, S) = s + Reshape(Expand(m, E), S')

where each axis of ``S`` is a run of axes of ``V`` (their product); ``m`` keeps a broadcast
(size 1) over a whole run, and is expanded to ``V``'s sizes in a run it varies along, since the
run's axes merge into one. Exact: the same additions of the same values.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import new_constant, producer_of, replace_subgraph, typed
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass


def _runs(view: list[int], shape: list[int]) -> list[list[int]] | None:
    """The axes of ``view`` that make up each axis of ``shape`` (in order, products equal),
    or None where the view is no split of the shape. A view axis of size 1 joins the run it
    comes first in (where it goes changes nothing: broadcast along it is no broadcast)."""
    runs: list[list[int]] = []
    axis = 0
    for size in shape:
        run: list[int] = []
        while axis < len(view) and (not run or math.prod(view[a] for a in run) < size):
            run.append(axis)
            axis += 1
        if math.prod(view[a] for a in run) != size:
            return None
        runs.append(run)
    if runs and any(view[a] != 1 for a in range(axis, len(view))):
        return None
    if runs:
        runs[-1] += range(axis, len(view))
    return runs


def _static(shape: ir.Shape | None) -> list[int] | None:
    if shape is None or not all(isinstance(dim, int) for dim in shape):
        return None
    return [int(dim) for dim in shape]


@register_pass
class SplitViewBiasCanonicalizationPass(FusionPass):
    """Not a pattern: each Reshape back of a sum is judged on the sizes around it."""

    spec = PassSpec(
        name="SplitViewBiasCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: Reshape(Reshape(s, V) + m, shape of s) -> s + m viewed as s "
        "(expanded only along the axes it varies on that merge): Swin's shifted-window mask "
        "added per group of windows, so the attention fusions read it as a bias",
        aliases=("split_view_bias_canonicalization",),
        priority=3046,  # before the attention fusions read the scores
        emits=(),
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        stats = ctx.pattern("SplitViewBias")
        for back in ctx.op_index.of_type(graph, "Reshape"):
            if back.graph is not graph:
                continue
            reason = self._canonicalize(ctx, back)
            if reason is not None:
                stats.decline(reason, back.name or "Reshape")

    @staticmethod
    def _canonicalize(ctx: PassContext, back: ir.Node) -> str | None:
        """Rewrite at ``back`` if it ends such a round trip; why not where it nearly does;
        None where it is no candidate."""
        add = producer_of(back.inputs[0], "Add")
        if add is None or len(add.inputs) != 2:
            return None
        for view_value, bias in (add.inputs, add.inputs[::-1]):
            split = producer_of(view_value, "Reshape")
            if split is not None and bias is not None:
                break
        else:
            return None
        source = split.inputs[0]
        assert source is not None and view_value is not None
        shape = _static(ctx.shape(source))
        if shape is None or _static(ctx.shape(back.outputs[0])) != shape:
            return None  # not a round trip, as far as the sizes tell
        view = _static(ctx.shape(view_value))
        bias_shape = _static(ctx.shape(bias))
        if view is None or bias_shape is None or _static(ctx.shape(add.outputs[0])) != view:
            return "the view's or the bias's sizes are not static, or the bias enlarges the sum"
        if len(bias_shape) > len(view):
            return "the bias has more axes than the view"
        padded = [1] * (len(view) - len(bias_shape)) + bias_shape
        if padded == view:
            return None  # a summand of the view's own shape (a residual): nothing broadcast
        if any(b not in (1, v) for b, v in zip(padded, view, strict=True)):
            return "the bias does not broadcast to the view"
        runs = _runs(view, shape)
        if runs is None:
            return "the view does not split the tensor's axes into runs"
        uses = [value.uses() for value in (view_value, add.outputs[0])]
        if any(len(u) != 1 for u in uses) or view_value.is_graph_output():
            return "the view or the sum is also read elsewhere"
        if add.outputs[0].is_graph_output():
            return "the view or the sum is also read elsewhere"
        expanded = list(padded)
        merged = []
        for run in runs:
            varies = any(padded[a] != 1 for a in run)
            for a in run:
                expanded[a] = view[a] if varies else 1
            merged.append(math.prod(expanded[a] for a in run))
        graph = back.graph
        assert graph is not None
        label = back.name or "Reshape"
        dtype = ctx.dtype(bias)
        nodes = []
        operand = bias
        if expanded != padded:
            target = new_constant(graph, f"{label}/expanded", np.array(expanded, np.int64))
            expand = ir.node("Expand", [bias, target])
            typed(expand.outputs[0], dtype, ir.Shape(expanded))
            nodes.append(expand)
            operand = expand.outputs[0]
        merged_target = new_constant(graph, f"{label}/merged", np.array(merged, np.int64))
        reshape = ir.node("Reshape", [operand, merged_target])
        typed(reshape.outputs[0], dtype, ir.Shape(merged))
        added = ir.node("Add", [source, reshape.outputs[0]])
        typed(added.outputs[0], ctx.dtype(back.outputs[0]), ir.Shape(shape))
        nodes += [reshape, added]
        replace_subgraph(
            ctx,
            "SplitViewBias",
            back,
            [back, add, split],
            nodes,
            back.outputs,
            added.outputs,
        )
        return None
