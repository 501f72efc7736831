"""A layer norm in TensorFlow's moments form, written as the norm passes read it.

Keras's LayerNormalization computes ``mean, variance = tf.nn.moments(x)`` and then
``x * m + (beta - mean * m)`` with ``m = gamma * rsqrt(variance + eps)``: the scale is
distributed over ``x`` and the mean. tf2onnx writes the means as ``GlobalAveragePool`` (on a
rank-3 ``[batch, sequence, hidden]`` value it averages the last axis) and the reciprocal square
root as ``Reciprocal(Sqrt)``, and folds nothing of the tail. Every layer norm of a Keras
transformer (KerasHub's BERT, GPT-2, Gemma exported through tf2onnx) was left in 13 nodes.

Rather than one more norm pattern, the moments form is recognized by what its tail computes,
a sum whose terms are ``x * m``, ``mean * m`` (with its sign, through Neg and Sub) and one
constant, and rewritten to the written-out norm ``(x - mean) / sqrt(variance + eps) * gamma +
beta`` on the nodes it already has; its means become ``ReduceMean`` over the last axis. The
layer norm passes (LayerNormalization, SkipLayerNormalization with the residual Add) take it
from there.
"""

from __future__ import annotations

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_scalar,
    constant_value,
    new_reduce_mean,
    node_axes,
    node_label,
    replace_subgraph,
    squared,
    typed,
)
from fusectl.rewrite.registry import (
    Category,
    FusionPass,
    Numerics,
    PassSpec,
    register_pass,
)

_ONNX = ("", "ai.onnx")


class _Declined(Exception):
    """A moments-form candidate that is not one, with the reason the report gives."""


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in _ONNX:
        return None
    return node


def _only_reader(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and all(user is reader for user, _ in value.uses())


def _trailing_mean_axes(ctx: PassContext, node: ir.Node) -> list[int] | None:
    """The axes, as negative indices, a mean over the trailing axes averages: a ReduceMean that
    keeps them, or a GlobalAveragePool of a rank-3 value (its one spatial axis is the last)."""
    x = node.inputs[0]
    shape = ctx.shape(x) if x is not None else None
    rank = None if shape is None else len(shape)
    if node.op_type == "GlobalAveragePool" and node.domain in _ONNX:
        return [-1] if rank == 3 else None
    if node.op_type != "ReduceMean" or node.domain not in _ONNX:
        return None
    if node.attributes.get_int("keepdims", 1) != 1:
        return None
    axes = node_axes(node)
    if not axes or (any(a >= 0 for a in axes) and rank is None):
        return None
    axes = sorted(a - rank if a >= 0 and rank is not None else a for a in axes)
    return axes if axes == list(range(-len(axes), 0)) else None


def _terms(
    value: ir.Value, sign: int, reader: ir.Node | None, tree: list[ir.Node]
) -> list[tuple[int, ir.Value]]:
    """The signed summands of the Add / Sub / Neg tree that computes ``value``, each node of it
    read only inside the tree; ``tree`` collects its nodes."""
    node = value.producer()
    inner = reader is None or _only_reader(value, reader)
    if node is not None and node.domain in _ONNX and inner:
        if node.op_type in ("Add", "Sub") and None not in node.inputs:
            tree.append(node)
            second = sign if node.op_type == "Add" else -sign
            return _terms(node.inputs[0], sign, node, tree) + _terms(
                node.inputs[1], second, node, tree
            )
        if node.op_type == "Neg" and node.inputs[0] is not None:
            tree.append(node)
            return _terms(node.inputs[0], -sign, node, tree)
    return [(sign, value)]


def _ancestors(product: ir.Node) -> list[ir.Node]:
    """The chain of Adds, Subs and Negs above ``product``, each read only by the next."""
    chain: list[ir.Node] = []
    value = product.outputs[0]
    while True:
        readers = [user for user, _ in value.uses()]
        if value.is_graph_output() or len(readers) != 1:
            return chain
        (reader,) = readers
        if reader.op_type not in ("Add", "Sub", "Neg") or reader.domain not in _ONNX:
            return chain
        chain.append(reader)
        value = reader.outputs[0]


class _Norm:
    """A recognized moments-form layer norm: its parts and the nodes its tail replaces."""

    def __init__(self, ctx: PassContext, reciprocal: ir.Node) -> None:
        sqrt = _producer(reciprocal.inputs[0], "Sqrt")
        add = _producer(sqrt.inputs[0], "Add") if sqrt is not None else None
        if sqrt is None or add is None:
            raise _Declined("not the reciprocal of Sqrt(variance + epsilon)")
        variance, eps = add.inputs
        if constant_scalar(eps) is None:
            variance, eps = eps, variance
        if constant_scalar(eps) is None or variance is None:
            raise _Declined("epsilon is not a constant scalar")
        variance_mean = variance.producer()
        if variance_mean is None or _trailing_mean_axes(ctx, variance_mean) is None:
            raise _Declined("the variance is not a mean over the trailing axes")
        square = variance_mean.inputs[0].producer() if variance_mean.inputs[0] else None
        centred = squared(square)
        difference = _producer(centred, "Sub")
        if difference is None:
            raise _Declined("the variance is not the mean of (x - mean) squared")
        x, mean = difference.inputs
        mean_node = mean.producer() if mean is not None else None
        if x is None or mean_node is None or mean_node.inputs[0] is not x:
            raise _Declined("the centring does not subtract the mean of x")
        if _trailing_mean_axes(ctx, mean_node) != _trailing_mean_axes(ctx, variance_mean):
            raise _Declined("the mean and the variance average different axes")
        self.x, self.mean, self.centred, self.std = x, mean, centred, sqrt.outputs[0]
        self.means = [mean_node, variance_mean]
        self.gamma, self.beta, self.root, self.tail = self._tail(reciprocal)

    def _tail(
        self, reciprocal: ir.Node
    ) -> tuple[ir.Value, ir.Value | None, ir.Node, list[ir.Node]]:
        """m = gamma * rsqrt(...) is read by x * m and mean * m (or -mean * m); the sum above
        x's product that holds both, and the one constant (beta) added next if any, is the
        output."""
        readers = [user for user, _ in reciprocal.outputs[0].uses()]
        scale = readers[0] if len(readers) == 1 else None
        if scale is None or scale.op_type != "Mul" or reciprocal.outputs[0].is_graph_output():
            raise _Declined("the reciprocal square root is not scaled by gamma alone")
        gamma = [v for v in scale.inputs if v is not reciprocal.outputs[0]]
        if len(gamma) != 1 or constant_value(gamma[0]) is None:
            raise _Declined("gamma is not a constant")
        m = scale.outputs[0]
        products = [user for user, _ in m.uses()]
        if (
            m.is_graph_output()
            or len(products) != 2
            or any(p.op_type != "Mul" or p.domain not in _ONNX for p in products)
        ):
            raise _Declined("the scale is not read by two products, x's and the mean's")
        of_x = next((p for p in products if self.x in p.inputs), None)
        if of_x is None:
            raise _Declined("no product of x and the scale")
        (of_mean,) = [p for p in products if p is not of_x]
        factor = next((v for v in of_mean.inputs if v is not m), None)
        mean_sign, negations = 1, []
        negation = _producer(factor, "Neg")
        if negation is not None and _only_reader(factor, of_mean):
            mean_sign, factor, negations = -1, negation.inputs[0], [negation]
        if factor is not self.mean:
            raise _Declined("the second product is not of the mean")
        found = None
        for root in _ancestors(of_x):
            tree: list[ir.Node] = []
            terms = _terms(root.outputs[0], 1, None, tree)
            summands = [value for _, value in terms]
            signs = dict(zip(summands, (sign for sign, _ in terms), strict=True))
            rest = [v for v in summands if v not in (of_x.outputs[0], of_mean.outputs[0])]
            if of_mean.outputs[0] not in signs:
                continue
            if len(signs) != len(summands):
                raise _Declined("a summand is added twice")
            if signs[of_x.outputs[0]] != 1 or signs[of_mean.outputs[0]] * mean_sign != -1:
                raise _Declined("the output is not x * m - mean * m: a sign differs")
            if len(rest) > 1 or any(constant_value(v) is None or signs[v] != 1 for v in rest):
                break  # a sum that goes on past the norm: the norm is the one found before
            found = (rest[0] if rest else None, root, tree)
            if rest:
                break
        if found is None:
            raise _Declined("x * m and mean * m are not summed")
        beta, root, tree = found
        return gamma[0], beta, root, [*tree, of_x, of_mean, *negations, scale, reciprocal]


@register_pass
class MomentsNormCanonicalizationPass(FusionPass):
    """Not a pattern: each Reciprocal is asked whether it is the heart of a moments-form norm,
    and the whole norm is checked before anything is rewritten."""

    spec = PassSpec(
        name="MomentsNormCanonicalizationPass",
        category=Category.GRAPH,
        description="canonical: a layer norm in TensorFlow's moments form (Keras through "
        "tf2onnx: GlobalAveragePool means, x * m + (beta - mean * m) with m = gamma * "
        "rsqrt(variance + eps)) -> the written-out norm the layer norm passes read",
        aliases=("moments_norm_canonicalization",),
        numerics=Numerics.REASSOCIATING,
        priority=3039,  # before PowerCanonicalization squares the variance's product
        emits=("ReduceMean", "Div", "Mul", "Add"),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for reciprocal in ctx.op_index.of_type(model.graph, "Reciprocal"):
            if reciprocal.graph is not model.graph or reciprocal.inputs[0] is None:
                continue
            if _producer(reciprocal.inputs[0], "Sqrt") is None:
                continue  # a reciprocal of anything else is no norm's: not a near miss
            try:
                norm = _Norm(ctx, reciprocal)
            except _Declined as declined:
                ctx.pattern("MomentsLayerNorm").decline(str(declined), node_label(reciprocal))
                continue
            self._rewrite(model, ctx, norm)

    @staticmethod
    def _rewrite(model: ir.Model, ctx: PassContext, norm: _Norm) -> None:
        dtype = ctx.dtype(norm.root.outputs[0])
        shape = ctx.shape(norm.root.outputs[0])
        divided = ir.node("Div", [norm.centred, norm.std])
        nodes = [divided, ir.node("Mul", [divided.outputs[0], norm.gamma])]
        if norm.beta is not None:
            nodes.append(ir.node("Add", [nodes[-1].outputs[0], norm.beta]))
        for node in nodes:
            typed(node.outputs[0], dtype, shape if node is nodes[-1] else None)
        replaced = replace_subgraph(
            ctx,
            "MomentsLayerNorm",
            norm.root,
            norm.tail,
            nodes,
            norm.root.outputs,
            nodes[-1].outputs,
        )
        if replaced is not None:
            return
        for mean in norm.means:
            if mean.op_type == "GlobalAveragePool":
                _as_reduce_mean(model, ctx, mean)


def _as_reduce_mean(model: ir.Model, ctx: PassContext, pool: ir.Node) -> None:
    """GlobalAveragePool of a rank-3 value -> ReduceMean over its last axis, kept."""
    x = pool.inputs[0]
    assert x is not None
    name = f"{MomentsNormCanonicalizationPass.spec.name}/last_axis"
    mean = new_reduce_mean(ctx, model.graph, x, [-1], name)
    typed(mean.outputs[0], ctx.dtype(pool.outputs[0]), ctx.shape(pool.outputs[0]))
    replace_subgraph(ctx, "MomentsMean", pool, [pool], [mean], pool.outputs, mean.outputs)
