"""Linear layers in their canonical form: MatMul on the activation's own rank, bias Added.

GPT-2's Conv1D, and any linear layer written for a 2-D GEMM, flattens the activation to
``[tokens, in]``, runs Gemm and reshapes the result back to ``[..., out]`` with the leading
sizes read from the input at run time (Shape -> Gather -> Unsqueeze -> Concat, which cannot
become a constant target: two of its sizes exist only at run time). MatMul broadcasts over the
leading axes, so ``MatMul(x, W) + b`` computes the same on ``x`` itself. In that form the layer
reads like every other exporter's (BERT's, LLaMA's), the bias is there for the passes that
absorb it (SkipLayerNormalization, BiasGelu, the attention biases), and the Reshapes with their
shape arithmetic go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import axis_size, same_dim, same_dimension, target_parts
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import (
    constant_value,
    new_constant,
    producer_of,
    remove_dead,
    replace_subgraph,
    typed,
    uses_outside,
)
from fusectl.rewrite.registry import Category, FusionPass, Numerics, PassSpec, register_pass

PATTERN = "FlattenedGemm"


class _Layer:
    """A Reshape -> Gemm -> Reshape site read apart: the activation, weights and bias."""

    def __init__(self, unflatten: ir.Node, gemm: ir.Node, flatten: ir.Node) -> None:
        self.unflatten, self.gemm, self.flatten = unflatten, gemm, flatten
        self.x = flatten.inputs[0]
        self.weight = gemm.inputs[1]
        self.bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None


def _site(node: ir.Node) -> _Layer | None:
    """The Reshape -> Gemm -> Reshape chain ending at ``node``; None when ``node`` is no such
    end (nothing to report: most Reshapes are not)."""
    if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    gemm = producer_of(node.inputs[0], "Gemm")
    if gemm is None or len(gemm.inputs) < 2:
        return None
    flatten = producer_of(gemm.inputs[0], "Reshape")
    if flatten is None or flatten.inputs[0] is None:
        return None
    return _Layer(node, gemm, flatten)


def _parts_by_shape(ctx: PassContext, layer: _Layer) -> list | None:
    """The second Reshape's target read off the shapes, where its sizes are computed past
    reading (wav2vec2's sequence length, from its feature extractor's arithmetic): the
    output's leading sizes the activation's (same_dim), the sizes after them known."""
    shape, restored = ctx.shape(layer.x), ctx.shape(layer.unflatten.outputs[0])
    if shape is None or restored is None or not 2 <= len(shape) <= len(restored):
        return None
    leading = len(shape) - 1
    trailing = list(restored[leading:])
    if not all(same_dim(shape[axis], restored[axis]) for axis in range(leading)):
        return None
    if not all(isinstance(size, int) for size in trailing):
        return None
    return [(layer.x, axis) for axis in range(leading)] + trailing


@dataclass(frozen=True)
class _Form:
    """How a layer is written as MatMul + Add: its [in, out] weights, the rank of its output,
    the sizes its outputs are split into after (heads split at once; none where they are not)
    and the constant target the activation is regrouped to first (none where the first
    Reshape flattened only its leading axes, or those and its trailing ones)."""

    weight: np.ndarray
    rank: int
    split: list[int]
    regroup: list[int] | None = None


def _refusal(ctx: PassContext, layer: _Layer) -> str | _Form:
    """Why the layer cannot be written as MatMul + Add on the activation; else its form."""
    gemm = layer.gemm
    # The flatten may be shared (MindSpore flattens once for the query, key and value): it
    # stays for its other readers, each rewritten in turn. The 2-D product may be read past
    # the second Reshape too (onnx-simplifier takes away the view back and the flatten again
    # between ALBERT's embedding projection and its query, key and value): those readers read
    # the layer's result flattened again, a flatten they then share.
    if gemm.outputs[0].is_graph_output():
        return "an intermediate value (Gemm output) is a graph output"
    shared = uses_outside([gemm, layer.unflatten], [layer.unflatten.outputs[0], gemm.outputs[0]])
    if shared is not None:
        return shared
    if gemm.attributes.get_int("transA", 0):
        return "Gemm transposes its activation input (transA=1)"
    if gemm.attributes.get_float("alpha", 1.0) != 1.0:
        return "Gemm scales the product (alpha != 1)"
    if layer.bias is not None and gemm.attributes.get_float("beta", 1.0) != 1.0:
        return "Gemm scales the bias (beta != 1)"
    weight = constant_value(layer.weight)
    if weight is None or weight.ndim != 2:
        return "the Gemm weights are not a 2-D constant"
    if gemm.attributes.get_int("transB", 0):
        weight = weight.T
    if layer.bias is not None:
        bias = constant_value(layer.bias)
        if bias is None:
            return "the Gemm bias is not a constant"
        if bias.ndim > 2 or (bias.ndim == 2 and bias.shape[0] != 1):
            return "the Gemm bias does not broadcast along the output's last axis only"
    parts = target_parts(ctx, layer.unflatten.inputs[1]) or _parts_by_shape(ctx, layer)
    found = _restored(ctx, layer, parts, weight)
    if isinstance(found, str):
        regroup = _regrouped(ctx, layer, parts, weight)
        return found if regroup is None else _Form(weight, len(regroup), [], regroup)
    return found


def _restored(
    ctx: PassContext, layer: _Layer, parts: list | None, weight: np.ndarray
) -> str | _Form:
    """The form where the second Reshape restores the activation's leading axes (and splits
    the outputs after them); else why it does not."""
    x = layer.x
    k, n = weight.shape
    shape = ctx.shape(x)
    split: list[int] = []
    if shape is not None and parts is not None and len(parts) > len(shape) >= 2:
        # The outputs split as they are restored ([..., heads, head_size]: a projection that
        # reshapes to heads at once, jax2onnx's): the split is its own Reshape after.
        split = parts[len(shape) - 1 :]
        known = [p for p in split if p != -1]
        if not all(isinstance(p, int) and p > 0 for p in known) or len(split) - len(known) > 1:
            return "the second Reshape splits the outputs into sizes not known before run time"
        if n % int(np.prod(known)) or (len(known) == len(split) and np.prod(known) != n):
            return f"the second Reshape splits the outputs into sizes that are not the Gemm's {n}"
        split = [n // int(np.prod(known)) if p == -1 else p for p in split]
        parts = [*parts[: len(shape) - 1], n]
    if shape is None or parts is None or not 3 <= len(parts) <= len(shape):
        return "the second Reshape does not restore the activation's leading axes"
    # Gemm takes 2-D input only, so the first Reshape made [rows, k]. The second restoring the
    # activation's leading sizes with the last one given proves the rest: rows is then their
    # product, so the first flattened exactly the leading axes and the axes after them hold
    # the Gemm's inputs (a model where that fails does not run). A -1 there leaves that to
    # prove.
    if parts[-1] not in (n, -1):
        return f"the second Reshape's last size is not the Gemm's {n} outputs"
    # A -1 (the last size, or a leading one: onnx-simplifier's constant [-1, 17, 32]) is the
    # activation's size there when every other size is and its last axis holds the Gemm's k
    # inputs: the first Reshape then flattened exactly the leading axes.
    if -1 in parts and (len(parts) != len(shape) or axis_size(ctx, x, len(shape) - 1) != k):
        return f"the activation's last axis is not known to be the Gemm's {k} inputs"
    for position, part in enumerate(parts[:-1]):
        if isinstance(part, int):
            restored = part == -1 or (part > 0 and part == axis_size(ctx, x, position))
        else:
            value, axis = part
            copied = ctx.shape(value)
            known = copied is not None and -len(copied) <= axis < len(copied)
            size = copied[axis] if known else None  # type: ignore[index]
            restored = same_dimension(part, size, x, position, shape)
        if not restored:
            return f"the second Reshape's size {position} is not the activation's"
    return _Form(weight, len(parts), split)


def _regrouped(
    ctx: PassContext, layer: _Layer, parts: list | None, weight: np.ndarray
) -> list[int] | None:
    """The activation's own target where the second Reshape regroups its rows otherwise, a
    constant [..., n]: onnx-simplifier merges Swin's window partition (a 6-D activation viewed
    as [windows, tokens, C]) into the flatten. With the activation's last axis the Gemm's k
    inputs, the rows the first Reshape made are its leading elements in order, so viewing it
    as [..., k] regroups the same rows alike. A 0 (a size copied from the Gemm's output)
    would copy another size from the activation."""
    k, n = weight.shape
    shape = ctx.shape(layer.x)
    if shape is None or parts is None or len(parts) < 3 or parts[-1] != n:
        return None
    if not all(isinstance(p, int) and (p > 0 or p == -1) for p in parts):
        return None
    if parts.count(-1) > 1 or axis_size(ctx, layer.x, len(shape) - 1) != k:
        return None
    return [*parts[:-1], k]


@register_pass
class FlattenedGemmCanonicalizationPass(FusionPass):
    """Not a pattern: each Reshape that ends a flatten -> Gemm -> unflatten chain is judged
    alone, by the shapes around it."""

    spec = PassSpec(
        name="FlattenedGemmCanonicalizationPass",
        category=Category.GRAPH,
        description="Reshape to 2-D -> Gemm -> Reshape back to the input's leading axes (a "
        "linear layer written for 2-D GEMM, GPT-2's Conv1D) -> MatMul + bias Add on the "
        "input itself (the shape arithmetic goes with the Reshapes)",
        aliases=("GemmUnflatten",),
        numerics=Numerics.REASSOCIATING,
        priority=3025,
        emits=("MatMul", "Add"),
        canonical=True,
        # An attention fusion proves its context's last axis (the Gemm's inputs), which a
        # leading -1 in the second Reshape needs (onnx-simplifier's output projections).
        again_after_fusions=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        if not ctx.op_index.holds(graph, ("Gemm",), ("", "ai.onnx")):
            return  # every site's middle is a Gemm
        for node in graph:
            layer = _site(node)
            if layer is None:
                continue
            site = node.name or "Reshape"
            found = _refusal(ctx, layer)
            if isinstance(found, str):
                ctx.pattern(PATTERN).decline(found, site)
                continue
            self._rewrite(ctx, graph, layer, found, site)
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()

    @staticmethod
    def _rewrite(ctx: PassContext, graph: ir.Graph, layer: _Layer, form: _Form, site: str) -> None:
        gemm, weight, rank, split = layer.gemm, form.weight, form.rank, form.split
        transposed = bool(gemm.attributes.get_int("transB", 0))
        # Constants made here and left unread by a declined rewrite go with the dead-node pass.
        weights = layer.weight
        if transposed:
            array = np.ascontiguousarray(weight)
            weights = new_constant(graph, f"{ctx.spec.name}/{site}/weight", array)
        activation, new_nodes = layer.x, []
        output = layer.unflatten.outputs[0]
        x_shape = ctx.shape(layer.x)
        assert x_shape is not None
        if form.regroup is not None:  # the rows regrouped as the second Reshape has them
            target = new_constant(graph, f"{ctx.spec.name}/{site}/rows", np.array(form.regroup))
            new_nodes.append(ir.node("Reshape", [activation, target]))
            rows = output.shape and ir.Shape([*output.shape[:-1], weight.shape[0]])
            activation = typed(new_nodes[-1].outputs[0], output.dtype, rows)
        elif len(x_shape) > rank:  # merge the trailing axes the first Reshape flattened too
            merge = new_constant(
                graph, f"{ctx.spec.name}/{site}/merged", np.array([0] * (rank - 1) + [-1])
            )
            new_nodes.append(ir.node("Reshape", [activation, merge]))
            activation = new_nodes[-1].outputs[0]
        # The layer's own output shape; the split's Reshape gives the site's.
        unsplit = None if split else output.shape
        result = ir.node("MatMul", [activation, weights]).outputs[0]
        layer_nodes = [result.producer()]
        if layer.bias is not None:
            typed(result, output.dtype, unsplit)
            result = ir.node("Add", [result, layer.bias]).outputs[0]
            layer_nodes.append(result.producer())
        typed(result, output.dtype, unsplit)
        product = gemm.outputs[0]
        replaced, replacing = [output], []
        if any(user is not layer.unflatten for user, _ in product.uses()):
            flat = new_constant(
                graph, f"{ctx.spec.name}/{site}/flat", np.array([-1, weight.shape[1]])
            )
            layer_nodes.append(ir.node("Reshape", [result, flat]))
            replaced.append(product)
            replacing.append(typed(layer_nodes[-1].outputs[0], output.dtype, product.shape))
        if split:
            target = new_constant(
                graph, f"{ctx.spec.name}/{site}/split", np.array([0] * (rank - 1) + split)
            )
            layer_nodes.append(ir.node("Reshape", [result, target]))
            result = typed(layer_nodes[-1].outputs[0], output.dtype, output.shape)
        new_nodes += layer_nodes
        # The targets' shape arithmetic, read before the Reshapes go: removed once unread.
        targets = [layer.unflatten.inputs[1], layer.flatten.inputs[1]]
        shape_code = [target.producer() for target in targets if target is not None]
        flattened = layer.flatten.outputs[0]
        alone = not flattened.is_graph_output() and all(
            user is gemm for user, _ in flattened.uses()
        )
        old = [layer.flatten, gemm, layer.unflatten] if alone else [gemm, layer.unflatten]
        declined = replace_subgraph(
            ctx, PATTERN, layer.unflatten, old, new_nodes, replaced, [result, *replacing]
        )
        if declined is None:
            remove_dead(graph, [*shape_code, layer.flatten])
