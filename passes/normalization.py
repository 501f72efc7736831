"""Layer and RMS normalisation written out by exporters, and the residual Add in front of
them fused with them into onnxruntime's SkipLayerNormalization / SkipSimplifiedLayerNorm.

    mean = ReduceMean(x, trailing axes); d = x - mean
    y = d / Sqrt(ReduceMean(d^2) + eps) * gamma + beta     (d^2 as Pow(d, 2) or Mul(d, d))

    RMS (LLaMA, T5): y = x * 1/Sqrt(ReduceMean(x^2) + eps) * weight
    (1/s as Reciprocal(s) or Div(1, s), or x / s directly)
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import same_dim, size_sources, symbolic_size
from fusectl.rewrite.graph import constant_value, drawn_from, node_axes
from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import Category, Numerics, PassSpec, register_pass

MS = "com.microsoft"


def _reduce_mean(op: Any, x: Any) -> Any:
    return op.ReduceMean(x, _allow_other_inputs=True, _allow_other_attributes=True)


def _normalised(op: Any, x: Any, eps: Any, two: Any) -> Any:
    """The written-out layer norm over the pattern variable ``x`` without scale or shift (a
    square written x * x is Pow(x, 2) by now: PowerCanonicalizationPass)."""
    centred = op.Sub(x, _reduce_mean(op, x))
    std = op.Sqrt(op.Add(_reduce_mean(op, op.Pow(centred, two)), eps))
    return op.Div(centred, std)


def _scaled(op: Any, x: Any, eps: Any, gamma: Any, two: Any) -> Any:
    return op.Mul(_normalised(op, x, eps, two), gamma)


def _decomposed(op: Any, x: Any, eps: Any, gamma: Any, beta: Any, two: Any) -> Any:
    return op.Add(_scaled(op, x, eps, gamma, two), beta)


def _pattern(residual: bool) -> Callable[..., Any]:
    if residual:
        return lambda op, a, b, eps, gamma, beta, two: _decomposed(
            op, op.Add(a, b, _outputs=["total"]), eps, gamma, beta, two
        )
    return _decomposed


def normalised_axis(site: Site, x: ir.Value, **bindings: Any) -> int:
    """The decomposition's checks; returns the first normalised axis, as a negative index.

    The means must run over the same trailing axes and keep them, squaring must be by 2,
    eps a scalar, gamma (and beta) constants over the normalised dimensions.
    """
    means = [node for node in site.nodes if node.op_type == "ReduceMean"]
    shape = site.shape(x)
    rank = None if shape is None else len(shape)
    axes_sets = []
    for node in means:
        if node.attributes.get_int("keepdims", 1) != 1:
            raise Decline("a ReduceMean does not keep its axes")
        axes = node_axes(node)
        if not axes:
            raise Decline("a ReduceMean has no constant axes")
        if any(a >= 0 for a in axes):
            if rank is None:
                raise Decline("the rank of the normalised input is unknown")
            axes = [a - rank if a >= 0 else a for a in axes]
        axes_sets.append(sorted(axes))
    if any(axes != axes_sets[0] for axes in axes_sets):
        raise Decline("the two ReduceMeans use different axes")
    axes = axes_sets[0]
    if axes != list(range(-len(axes), 0)):
        raise Decline("the normalised axes are not the trailing ones")
    if "two" in bindings:
        exponent = site.require_constant(bindings["two"], "the exponent")
        if exponent.size != 1 or float(exponent.reshape(-1)[0]) != 2.0:
            raise Decline("the square is not Pow(d, 2)")
    if "eps" in bindings:  # an RMS norm may have none (_rms)
        eps = site.require_constant(bindings["eps"], "epsilon")
        if eps.size != 1:
            raise Decline("epsilon is not a scalar")
    normalised = None if shape is None else list(shape)[len(shape) + axes[0] :]
    for name in ("gamma", "beta"):
        if name not in bindings:
            continue
        array = site.require_constant(bindings[name], name)
        if normalised is not None and all(isinstance(d, int) for d in normalised):
            # Leading 1s up to x's rank broadcast nothing (Keras reshapes gamma to
            # [1, 1, hidden]); more axes than x has would broadcast the output up.
            dims = array.shape
            while len(dims) > len(normalised) and dims[0] == 1 and len(dims) <= rank:
                dims = dims[1:]
            padded = (1,) * (len(normalised) - len(dims)) + dims
            if len(dims) > len(normalised) or list(padded) != normalised:
                raise Decline(f"{name} does not span the normalised dimensions exactly")
    return axes[0]


def _epsilon(site: Site, eps: ir.Value | None) -> float:
    """The norm's epsilon as the fused kernels take it; 0 for an RMS norm without one."""
    if eps is None:
        return 0.0
    return _kernel_epsilon(float(site.require_constant(eps, "epsilon").reshape(-1)[0]))


def _native_epsilon(norm: ir.Node) -> float:
    """A LayerNormalization node's epsilon, as a fused kernel would take it."""
    return _kernel_epsilon(norm.attributes.get_float("epsilon", 1e-5))


def _kernel_epsilon(epsilon: float) -> float:
    """onnxruntime's fused norm kernels refuse a negative epsilon when the session is created,
    where the written-out norm computes with it (until a variance falls below it)."""
    if not epsilon >= 0:
        raise Decline(f"epsilon is {epsilon:g}: the fused kernels take only epsilon >= 0")
    return epsilon


def _param(
    site: Site, op: Any, value: ir.Value, name: str, size: int | None, as_float32: bool = False
) -> ir.Value:
    """gamma/beta as the 1-D (or normalised-shape) initializer the fused ops take; converted
    to float32 (a new initializer) where the fused op computes in float32 (the Cast form)."""
    array = site.require_constant(value, name)
    flat = size is not None and array.size == size and array.ndim != 1
    if as_float32:
        return site.initializer(
            op, (array.reshape(-1) if flat else array).astype(np.float32), f"{name}_float32"
        )
    if flat:
        return site.initializer(op, array.reshape(-1), name)
    return value


def _to_layer_norm(op: Any, site: Site, x: ir.Value, **bindings: Any) -> ir.Value:
    """LayerNormalization, without its shift where the norm has none (a zero beta removed
    by NeutralOperandEliminationPass, Keras's ``center=False``)."""
    axis = normalised_axis(site, x, **bindings)
    params = [_trimmed(site, op, bindings[n], n, -axis) for n in ("gamma", "beta") if n in bindings]
    return op.LayerNormalization(x, *params, axis=axis, epsilon=_epsilon(site, bindings.get("eps")))


def _constant_follows(site: Site, op_type: str) -> bool:
    """Whether an ``op_type`` (Add, Mul) reads the site's output and a constant."""
    output = site.outputs[0]
    return any(
        reader.op_type == op_type
        and any(v is not output and constant_value(v) is not None for v in reader.inputs)
        for reader, _ in output.uses()
    )


def _has_no_shift(site: Site, **bindings: Any) -> bool:
    """A norm whose scaled value a constant is added to has a shift: LayerNormPow's."""
    return not _constant_follows(site, "Add")


def _has_no_scale(site: Site, **bindings: Any) -> bool:
    """A norm a constant multiplies has a scale: LayerNormPow's or LayerNormPowNoShift's."""
    return not _constant_follows(site, "Mul")


def _to_unscaled_layer_norm(op: Any, site: Site, x: ir.Value, **bindings: Any) -> ir.Value:
    """LayerNormalization with a scale of ones, which it requires: a norm whose scale of ones
    NeutralOperandEliminationPass removed (Keras's default), or one without (DiT's, modulated
    by values computed at run time)."""
    axis = normalised_axis(site, x, **bindings)
    shape = site.shape(x)
    normalised = None if shape is None else list(shape)[len(shape) + axis :]
    if normalised is None or not all(isinstance(d, int) for d in normalised):
        raise Decline("the normalised dimensions are not static (the scale of ones needs them)")
    dtype = site.dtype(x)
    if dtype is None or not dtype.is_floating_point():
        raise Decline("the normalised input's type is unknown")
    ones = site.initializer(op, np.ones(normalised, dtype.numpy()), "ones")
    return op.LayerNormalization(x, ones, axis=axis, epsilon=_epsilon(site, bindings.get("eps")))


def _trimmed(site: Site, op: Any, value: ir.Value, name: str, rank: int) -> ir.Value:
    """A scale or shift without the leading 1s beyond the normalised rank (Keras's
    [1, 1, hidden]): LayerNormalization takes the normalised shape."""
    array = site.require_constant(value, name)
    if array.ndim <= rank:
        return value
    return site.initializer(op, array.reshape(array.shape[array.ndim - rank :]), name)


@register_pass
class LayerNormFusionPass(PatternPass):
    spec = PassSpec(
        name="LayerNormFusionPass",
        category=Category.GRAPH,
        description="Written-out layer norm (ReduceMean/Sub/Pow/Sqrt/Div/Mul/Add) -> "
        "LayerNormalization (opset 17)",
        aliases=("LayerNormONNXFusionPass", "layer_norm_fusion"),
        numerics=Numerics.REASSOCIATING,
        min_opset=17,
        emits=("LayerNormalization",),
    )
    rules = (
        Rule("LayerNormPow", _pattern(False), _to_layer_norm),
        Rule("LayerNormPowNoShift", _scaled, _to_layer_norm, candidate=_has_no_shift),
        Rule("LayerNormPowNoScale", _normalised, _to_unscaled_layer_norm, candidate=_has_no_scale),
    )


_Dim = int | ir.SymbolicDim | None  # None: unknown


_SHAPE_DEPTH = 8
_INDEX_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})


def _shape_elements(site: Site, value: ir.Value | None, depth: int = 0) -> list[_Dim] | None:
    """The elements of a small integer tensor that spells a shape, as dims: constants, and
    Shape(x) of a tensor whose dims are known, through the Gather / Slice / Unsqueeze /
    Squeeze / Concat / Cast that TorchScript writes to build a Reshape's target."""
    if value is None or depth > _SHAPE_DEPTH:
        return None
    array = site.constant(value)
    if array is not None:
        return [int(x) for x in array.reshape(-1)] if array.dtype.kind in "iu" else None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        shape = site.shape(node.inputs[0])
        if shape is None:
            return None
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", len(shape))
        return [d if isinstance(d, int) or d.value is not None else None for d in shape][start:end]
    cast = node.op_type == "Cast" and node.attributes.get_int("to", 0) in _INDEX_TYPES
    if cast or node.op_type in ("Unsqueeze", "Squeeze", "Identity"):
        return _shape_elements(site, node.inputs[0], depth + 1)
    if node.op_type == "Concat":
        parts = [_shape_elements(site, v, depth + 1) for v in node.inputs]
        return None if any(p is None for p in parts) else [d for p in parts for d in p]
    data = _shape_elements(site, node.inputs[0], depth + 1) if node.inputs else None
    if data is None or len(node.inputs) < 2:
        return None
    if node.op_type == "Gather" and node.attributes.get_int("axis", 0) == 0:
        indices = site.constant(node.inputs[1])
        if indices is None or any(not -len(data) <= i < len(data) for i in indices.reshape(-1)):
            return None
        return [data[int(i)] for i in indices.reshape(-1)]
    if node.op_type == "Slice" and len(node.inputs) >= 3:
        bounds = [site.constant(v) for v in node.inputs[1:]]
        if any(b is None or b.size != 1 for b in bounds):
            return None
        start, end, *rest = (int(b.reshape(-1)[0]) for b in bounds)
        if rest[:1] not in ([], [0], [-1]) or rest[1:] not in ([], [1]):
            return None  # not along the one axis, or not with step 1
        return data[start:end]
    return None


def _linear_input(site: Site, node: ir.Node) -> tuple[ir.Value, int | None] | None:
    """For a MatMul by 2-D constant weights, its input and output width; for a bias Add (a
    constant of at most one axis), its other input and None (the width is kept)."""
    if node.op_type == "MatMul" and len(node.inputs) == 2 and node.inputs[0] is not None:
        weights = site.constant(node.inputs[1]) if node.inputs[1] is not None else None
        if weights is not None and weights.ndim == 2:
            return node.inputs[0], int(weights.shape[1])
    if node.op_type == "Add" and len(node.inputs) == 2 and None not in node.inputs:
        for data, bias in (node.inputs, reversed(node.inputs)):
            array = site.constant(bias)
            if array is not None and array.ndim <= 1 and site.constant(data) is None:
                return data, None
    return None


def _proven_dims(site: Site, value: ir.Value) -> list[list[_Dim]] | None:
    """Per axis, every size known for the value: the inferred one, and for a Reshape output
    the one its computed target spells out.

    onnx gives a dim a fresh symbol whenever it cannot prove two dims equal, e.g. a batch
    broadcast against a mask's: TorchScript GPT-2 reshapes a projection back to
    Shape(attention output)[0:2], and that attention output, once fused, has the query's
    batch symbol.
    """
    shape = site.shape(value)
    dims = None if shape is None else [[d] for d in shape]
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return dims
    through = _linear_input(site, node)
    if through is not None:  # a linear layer keeps its input's leading sizes
        data, outputs = through
        inner = _proven_dims(site, data)
        if inner is None or (dims is not None and len(dims) != len(inner)):
            return dims
        inner = [*inner[:-1], [outputs]] if outputs is not None else inner
        return inner if dims is None else [a + b for a, b in zip(dims, inner, strict=True)]
    if node.op_type != "Reshape":
        return dims
    target = _shape_elements(site, node.inputs[1])
    if target is None or (dims is not None and len(dims) != len(target)):
        return dims
    dims = dims or [[] for _ in target]
    source = site.shape(node.inputs[0])
    copies = not node.attributes.get_int("allowzero", 0)
    for axis, dim in enumerate(target):
        if dim == 0 and copies:  # 0 copies the input's dim
            dim = source[axis] if source is not None and axis < len(source) else None
        if dim is not None and not (isinstance(dim, int) and dim < 0):  # -1: the rest
            dims[axis].append(dim)
    return dims


def _same_shape(a: list[list[_Dim]], b: list[list[_Dim]]) -> bool:
    """Whether both are provably one shape, so that adding them broadcasts nothing."""
    if len(a) != len(b):
        return False
    axes = zip(a, b, strict=True)
    return all(any(same_dim(x, y) for x in sizes_a for y in sizes_b) for sizes_a, sizes_b in axes)


def _fits(a: list[list[_Dim]], b: list[list[_Dim]]) -> bool:
    """Whether the kernel takes the two summands: one 3-D shape, or a [1, S, H] / [S, H]
    skip broadcast over the batch of the other."""
    same = len(a) == 3 and _same_shape(a, b)
    return same or _batch_broadcast(a, b) or _batch_broadcast(b, a)


def _worth_deriving(a: list[list[_Dim]], b: list[list[_Dim]]) -> bool:
    """Whether a deeper proof could make the summands fit: 3-D and 2- or 3-D, hidden sizes
    not known to differ (a 2-D residual never fits, whatever its sizes)."""
    if sorted((len(a), len(b))) not in ([2, 3], [3, 3]):
        return False
    return len({d for d in a[-1] + b[-1] if isinstance(d, int)}) <= 1


# Per axis, the sizes a deeper proof derives are added to those known; each kind of name
# compares only with its own kind, sizes with sizes.


def _source_dims(
    site: Site, values: list[ir.Value], dims: list[list[list[_Dim]]]
) -> list[list[list[_Dim]]]:
    """With each axis's size as every (value, axis) it is copied from unchanged: the residual
    and the branch that adds to it meet where the branch reads the residual stream (the
    attention's query, a projection's input), however many layers lie behind it."""
    derived = [[list(sizes) for sizes in known] for known in dims]
    for value, known in zip(values, derived, strict=True):
        for axis, sizes in enumerate(known):
            sizes += [
                ir.SymbolicDim(f"copy:{id(source)}:{index}")
                for source, index in size_sources(site.ctx, value, axis)
            ]
    return derived


def _product_dims(
    site: Site, values: list[ir.Value], dims: list[list[list[_Dim]]]
) -> list[list[list[_Dim]]]:
    """With each axis's size as a product of static sizes and named dimensions, traced through
    the ops where inference made up a name (TorchScript's run-time Reshape targets)."""
    derived = [[list(sizes) for sizes in known] for known in dims]
    for value, known in zip(values, derived, strict=True):
        for axis, sizes in enumerate(known):
            product = symbolic_size(site.ctx, value, axis)
            if product is not None:
                coefficient, names = product
                named = ir.SymbolicDim(f"product:{coefficient}*{'*'.join(names)}")
                sizes.append(named if names else coefficient)
    return derived


def _onnxruntime_dims(
    site: Site, values: list[ir.Value], dims: list[list[list[_Dim]]]
) -> list[list[list[_Dim]]]:
    """With each axis's size as onnxruntime's symbolic shape inference derives it on the graph
    as loaded (Range, Slice, Conv and Expand arithmetic: positions and convolutions).

    A position table sliced to the sequence has ``Min(c, S)`` rows: read as S, since the
    residual Add runs only where it is S (for S > c > 1 the rows neither match nor broadcast),
    and the kernel then refuses the skip as the Add would."""
    oracle = site.ctx.shapes
    if oracle is None:
        return dims
    derived = [[list(sizes) for sizes in known] for known in dims]
    for known, symbolic in zip(derived, oracle.symbolic_dims(values), strict=True):
        if symbolic is None or len(symbolic) != len(known):
            continue
        for sizes, size in zip(known, symbolic, strict=True):
            if isinstance(size, str):
                clipped = _CLIPPED.fullmatch(size)
                rest = clipped and (clipped["rest"] or clipped["first"])
                if clipped and int(clipped["bound"] or clipped["last"]) > 1 and rest:
                    size = rest
                sizes.append(ir.SymbolicDim(f"onnxruntime:{size}"))
            elif size is not None:
                sizes.append(size)
    return derived


# sympy's Min of a bound and a size, either order: Min(32, sequence), Min(sequence, 32).
_CLIPPED = re.compile(r"Min\((?:(?P<bound>\d+), (?P<rest>[^,]+)|(?P<first>[^,]+), (?P<last>\d+))\)")


def _batch_broadcast(full: list[list[_Dim]], skip: list[list[_Dim]]) -> bool:
    """Whether ``full`` is [B, S, H] and ``skip`` [1, S, H] or [S, H] of the same S and H."""
    if len(full) != 3 or len(skip) not in (2, 3):
        return False
    if len(skip) == 3 and 1 not in skip[0]:
        return False
    return _same_shape(full[1:], skip[-2:])


def _skip(
    op: Any,
    site: Site,
    a: ir.Value,
    b: ir.Value,
    total: ir.Value,
    gamma: ir.Value,
    beta: ir.Value | None,
    epsilon: float,
    rounded_to: ir.DataType | None = None,
    centred: bool | None = None,
) -> ir.Value:
    """onnxruntime's SkipLayerNormalization (SkipSimplifiedLayerNormalization for the RMS
    form, not ``centred``; by default, the form without beta): norm(a + b) over the last axis
    of a 3-D input. A layer norm without beta (MPT's, OLMo's) is SkipLayerNormalization
    without its optional beta input.

    With ``rounded_to`` (the Cast form of an RMS norm, see ``_rounded_to``) the kernel runs
    in float32 on a and b cast to float32, with gamma as float32, and its output (and the sum
    where other nodes read it) is cast back to ``rounded_to``.
    """
    dims_a, dims_b = _proven_dims(site, a), _proven_dims(site, b)
    if dims_a is None or dims_b is None:
        raise Decline("the shapes of the residual Add's inputs are unknown")
    # The kernel also broadcasts a skip of [1, S, H] or [S, H] (a position table) over the
    # batch of a [B, S, H] input.
    if not _fits(dims_a, dims_b) and _worth_deriving(dims_a, dims_b):
        for derived in (_source_dims, _product_dims, _onnxruntime_dims):  # cheap first
            dims_a, dims_b = derived(site, [a, b], [dims_a, dims_b])
            if _fits(dims_a, dims_b):
                break
    broadcast = len(dims_a) != 3 or not _same_shape(dims_a, dims_b)
    if broadcast and _batch_broadcast(dims_b, dims_a):
        a, b, dims_a, dims_b = b, a, dims_b, dims_a
    if broadcast and not _batch_broadcast(dims_a, dims_b):
        raise Decline("the residual Add's inputs are not two 3-D tensors of one shape")
    centred = beta is not None if centred is None else centred
    op_type = "SkipLayerNormalization" if centred else "SkipSimplifiedLayerNormalization"
    site.require_kernel(op_type, site.dtype(a) if rounded_to is None else _FLOAT, MS)
    hidden = next((d for d in dims_a[-1] + dims_b[-1] if isinstance(d, int)), None)
    widen = rounded_to is not None
    params = [_param(site, op, gamma, "gamma", hidden, widen)]
    if centred:  # beta, or the empty input that stands for none
        params.append(None if beta is None else _param(site, op, beta, "beta", hidden, widen))
    # The bias variant: a projection's bias Add in front of the residual goes into the kernel.
    projected = None if widen else _projection_bias(site, a, hidden)
    if projected is None and not widen and not broadcast:
        projected = _projection_bias(site, b, hidden)
        if projected is not None:
            a, b = b, a
    if projected is not None:
        a, bias = projected
        params.append(bias)
    while params[-1] is None:  # no trailing empty input
        params.pop()
    if widen:
        a, b = (op.Cast(v, to=_FLOAT) if site.dtype(v) != _FLOAT else v for v in (a, b))
    # The sum a + b often feeds the next residual too: the kernel's fourth output keeps it.
    keep_sum = total.is_graph_output() or any(user not in site.nodes for user, _ in total.uses())
    outputs = getattr(op, op_type)(
        a, b, *params, _domain=MS, _outputs=4 if keep_sum else 1, epsilon=epsilon
    )
    output, total_out = (outputs[0], outputs[3]) if keep_sum else (outputs, None)
    if widen:
        output = op.Cast(output, to=rounded_to)
        if total_out is not None and site.dtype(total) != _FLOAT:
            total_out = op.Cast(total_out, to=site.dtype(total))
    if total_out is not None:
        site.provide(total, total_out)
    return output


def _projection_bias(
    site: Site, value: ir.Value, hidden: int | None
) -> tuple[ir.Value, ir.Value] | None:
    """(MatMul output, bias) when ``value`` is MatMul(x, w) + bias, a constant [hidden] vector,
    read only by the residual Add: SkipLayerNormalization's bias input adds it in the kernel."""
    add = value.producer()
    if (
        hidden is None
        or add is None
        or add.op_type != "Add"
        or add.domain not in ("", "ai.onnx")
        or value.is_graph_output()
        or any(user not in site.nodes for user, _ in value.uses())
    ):
        return None
    for product, bias in (add.inputs, reversed(add.inputs)):
        producer = product.producer() if product is not None else None
        if (
            producer is None
            or producer.op_type != "MatMul"
            or producer.domain not in ("", "ai.onnx")
        ):
            continue
        shape = site.shape(product)
        array = site.constant(bias)
        if shape is None or len(shape) != 3 or shape[-1] != hidden:
            continue
        if array is not None and array.shape == (hidden,) and site.dtype(bias) == site.dtype(value):
            return product, bias
    return None


def _skip_written_out(
    op: Any, site: Site, a: ir.Value, b: ir.Value, total: ir.Value, **bindings: Any
) -> ir.Value:
    """Residual Add + a written-out layer norm (with beta) or RMS norm (without)."""
    if normalised_axis(site, total, **bindings) != -1:
        raise Decline("the fused kernel normalises the last axis only")
    _check_one(site, bindings)
    rounded_to = _rounded_to(site, total, bindings)
    epsilon = _epsilon(site, bindings.get("eps"))
    return _skip(
        op, site, a, b, total, bindings["gamma"], bindings.get("beta"), epsilon, rounded_to
    )


def _add_layer_normalization(op: Any, a: Any, b: Any, gamma: Any, beta: Any) -> Any:
    total = op.Add(a, b, _outputs=["total"])
    return op.LayerNormalization(total, gamma, beta, _allow_other_attributes=True)


def _add_layer_normalization_without_beta(op: Any, a: Any, b: Any, gamma: Any) -> Any:
    total = op.Add(a, b, _outputs=["total"])
    return op.LayerNormalization(total, gamma, _allow_other_attributes=True)


def _add_native_rms(op_type: str) -> Callable[..., Any]:
    """Residual Add + the RMS norm op ``op_type`` (weighted, as both ops take gamma)."""

    def pattern(op: Any, a: Any, b: Any, gamma: Any) -> Any:
        total = op.Add(a, b, _outputs=["total"])
        return getattr(op, op_type)(total, gamma, _allow_other_attributes=True)

    return pattern


# The norm ops a residual Add may feed, and whether each centres (a layer norm) or not (RMS:
# opset 23's RMSNormalization, onnxruntime's SimplifiedLayerNormalization, which its optimizer
# and onnxscript's write in the ONNX domain).
_NATIVE_NORMS = {
    "LayerNormalization": True,
    "RMSNormalization": False,
    "SimplifiedLayerNormalization": False,
}


def _skip_native(
    op: Any,
    site: Site,
    a: ir.Value,
    b: ir.Value,
    total: ir.Value,
    gamma: ir.Value,
    beta: ir.Value | None = None,
) -> ir.Value:
    norm = next(node for node in site.nodes if node.op_type in _NATIVE_NORMS)
    centred = _NATIVE_NORMS[norm.op_type]
    shape = site.shape(total)
    axis = norm.attributes.get_int("axis", -1)
    if not (axis == -1 or (shape is not None and axis == len(shape) - 1)):
        kernel = "SkipLayerNormalization" if centred else "SkipSimplifiedLayerNormalization"
        raise Decline(f"{kernel} normalises the last axis only")
    if norm.attributes.get_int("stash_type", 1) != 1:
        raise Decline(f"{norm.op_type} computes in another precision (stash_type)")
    site.require_constant(gamma, "gamma")
    if beta is not None:
        site.require_constant(beta, "beta")
    epsilon = _native_epsilon(norm)
    return _skip(op, site, a, b, total, gamma, beta, epsilon, centred=centred)


@register_pass
class AddLayerNormFusionPass(PatternPass):
    spec = PassSpec(
        name="AddLayerNormFusionPass",
        category=Category.UB,
        description="residual Add + layer norm (LayerNormalization or written out) -> "
        "com.microsoft SkipLayerNormalization (the sum stays available to its other readers; "
        "a projection's bias Add in front goes into the kernel's bias input)",
        aliases=("add_layer_norm_fusion", "SkipLayerNormFusion"),
        numerics=Numerics.REASSOCIATING,
        targets=("ort",),
        emits=("SkipLayerNormalization",),
        emits_domain=MS,
    )
    rules = (
        Rule("AddLayerNormPow", _pattern(True), _skip_written_out, exposes=("total",)),
        Rule("AddLayerNormalization", _add_layer_normalization, _skip_native, exposes=("total",)),
        Rule(
            "AddLayerNormalizationNoBeta",
            _add_layer_normalization_without_beta,
            _skip_native,
            exposes=("total",),
        ),
    )

    def keep_unfused(self, nodes: Sequence[ir.Node]) -> bool:
        """onnxruntime's online optimizer (ORT_ENABLE_ALL) fuses a residual Add into the
        LayerNormalization it feeds whenever the summands' shapes agree, into the kernel the
        repository measured slower: the residual Add becomes the two-input Sum it equals,
        which that fusion does not match (and which runs as fast)."""
        members = set(nodes)
        changed = False
        for node in nodes:
            if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or node.graph is None:
                continue
            if not any(
                user in members and user.op_type != "Add" for user, _ in node.outputs[0].uses()
            ):
                continue  # a bias Add in front of the residual one
            summed = ir.Node("", "Sum", list(node.inputs), name=node.name)
            summed.metadata_props.update(node.metadata_props)
            summed.outputs[0].type, summed.outputs[0].shape = (
                node.outputs[0].type,
                node.outputs[0].shape,
            )
            ir.convenience.replace_nodes_and_values(
                node.graph, node, [node], [summed], [node.outputs[0]], [summed.outputs[0]]
            )
            changed = True
        return changed


def _rms(
    inverse: str, cast: bool = False, weighted: bool = True, epsilon: bool = True
) -> Callable[..., Any]:
    """x * rsqrt(mean(x^2) + eps) * gamma, the reciprocal square root spelled three ways;
    without the weight unless ``weighted``; without eps unless ``epsilon`` (an eps too small
    to keep, 1e-8: Moshi's dynamo export has none).

    ``cast``: the fp16/bf16 export's form, computed in float32 and rounded to gamma's type
    before the weight: Mul(gamma, Cast(x * rsqrt(...))) (the rounded value bound as
    ``rounded``).
    """

    def normalise(op: Any, x: Any, two: Any, eps: Any, gamma: Any, one: Any = None) -> Any:
        mean = _reduce_mean(op, op.Pow(x, two))
        std = op.Sqrt(op.Add(mean, eps) if epsilon else mean)
        if inverse == "Reciprocal":
            scaled = op.Mul(x, op.Reciprocal(std))
        elif inverse == "DivOne":
            scaled = op.Mul(x, op.Div(one, std))
        else:
            scaled = op.Div(x, std)
        if cast:
            scaled = op.Cast(scaled, _allow_other_attributes=True, _outputs=["rounded"])
        return op.Mul(scaled, gamma) if weighted else scaled

    return normalise


def _rms_pattern(
    inverse: str, residual: bool, cast: bool = False, weighted: bool = True, epsilon: bool = True
) -> Callable[..., Any]:
    """The RMS norm over x, or over a residual sum ``total`` = Add(a, b). The pattern's
    variables are its parameters' names, so the function declares exactly those it binds."""
    norm = _rms(inverse, cast, weighted, epsilon)
    names = [
        *(("a", "b") if residual else ("x",)),
        "two",
        *(("eps",) if epsilon else ()),
        *(("gamma",) if weighted else ()),
        *(("one",) if inverse == "DivOne" else ()),
    ]

    def pattern(op: Any, *args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(names, args, strict=False)) | kwargs
        x = op.Add(bound["a"], bound["b"], _outputs=["total"]) if residual else bound["x"]
        return norm(op, x, bound["two"], bound.get("eps"), bound.get("gamma"), bound.get("one"))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter(name, kind) for name in ("op", *names)]
    pattern.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return pattern


def _spanning_weight(rewrite: Callable[..., Any]) -> Callable[..., Any]:
    """``rewrite`` with the norm's weight spelled over the normalised axes, as the fused ops
    take it: ones for a norm without a weight (Gemma-3n's value norm), a constant weight that
    broadcasts over them expanded (DiffLlama's scalar ``1 - lambda_init``). Either needs the
    normalised axes static; a weight that spans them already is kept as it is."""

    def spanning(op: Any, site: Site, **bindings: Any) -> Any:
        x = bindings["total"] if "total" in bindings else bindings["x"]
        gamma = bindings.get("gamma")
        array = None if gamma is None else site.constant(gamma)
        if gamma is not None and array is None:
            return rewrite(op, site, **bindings)  # normalised_axis names what is wrong
        unweighted = {k: v for k, v in bindings.items() if k != "gamma"} | {"x": x}
        shape = site.shape(x)
        normalised = None if shape is None else list(shape)[normalised_axis(site, **unweighted) :]
        static = normalised is not None and all(isinstance(d, int) for d in normalised)
        if array is not None and (not static or list(array.shape) == normalised):
            return rewrite(op, site, **bindings)
        if not static:
            raise Decline("the norm has no weight and its normalised axes are not static")
        assert normalised is not None
        if array is None:
            dtype = site.dtype(x)
            if dtype is None:
                raise Decline("the normalised input's type is unknown")
            array = np.ones(normalised, dtype=dtype.numpy())
        elif array.ndim > len(normalised) or any(
            d not in (1, n) for d, n in zip(array.shape[::-1], normalised[::-1], strict=False)
        ):
            return rewrite(op, site, **bindings)  # normalised_axis names what is wrong
        spanned = np.ascontiguousarray(np.broadcast_to(array, normalised))
        bindings["gamma"] = site.initializer(op, spanned, "weight")
        return rewrite(op, site, **bindings)

    return spanning


def _scaled_next(site: Site, **bindings: Any) -> bool:
    """Whether a norm without a weight is one: not the inside of a weighted norm, whose output
    a Mul by a weight reads, perhaps after a Cast (that norm is the weighted rules' match,
    taken or declined with their reason). A Mul whose other operand is computed from the
    norm's output is no weight: the next norm's x * rsqrt(mean(x^2)) (NanoChat's norm before
    the first layer, read by that layer's norm)."""
    del bindings
    output = site.root.outputs[0]
    values = [output]
    readers = [use.node for use in output.uses()]
    while readers and all(node.op_type == "Cast" for node in readers):  # the fp16 form's rounding
        values = [node.outputs[0] for node in readers]
        readers = [use.node for value in values for use in value.uses()]
    return not any(
        node.op_type == "Mul"
        and not all(_computed_from(v, output) for v in node.inputs if v not in values)
        for node in readers
    )


def _computed_from(value: ir.Value | None, source: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` is computed from ``source`` within ``depth`` ops."""
    if value is source:
        return True
    node = value.producer() if value is not None else None
    if node is None or depth == 0:
        return False
    return any(_computed_from(v, source, depth - 1) for v in node.inputs)


_RMS_FORMS = ("Reciprocal", "DivOne", "Div")
_FLOAT = ir.DataType.FLOAT


def _rounded_to(site: Site, x32: ir.Value, bindings: dict[str, Any]) -> ir.DataType | None:
    """In the Cast form (``rounded`` bound), the type the norm is rounded to before the
    weight, after checking that the norm runs on float32 and that the Cast rounds to the
    type of gamma, a constant; None for the other forms."""
    rounded = bindings.get("rounded")
    if rounded is None:
        return None
    if site.dtype(x32) != _FLOAT:
        raise Decline("the Cast form's normalised input is not float32")
    gamma = bindings["gamma"]
    site.require_constant(gamma, "gamma")
    node = rounded.producer()
    to = ir.DataType(node.attributes.get_int("to", 0)) if node is not None else None
    if to is None or to != site.dtype(gamma):
        raise Decline(f"the norm is cast to {to}, not to gamma's type {site.dtype(gamma)}")
    return to


def _rounded_norm(
    op: Any, site: Site, x: ir.Value, op_type: str, axis: int, bindings: dict[str, Any]
) -> ir.Value:
    """``op_type``(x, gamma) over ``axis``: in the Cast form in float32 with a float32 copy of
    gamma, then cast to gamma's type."""
    _check_one(site, bindings)
    rounded_to = _rounded_to(site, x, bindings)
    epsilon = _epsilon(site, bindings.get("eps"))
    if rounded_to is None:
        if op_type == "SimplifiedLayerNormalization":
            site.require_kernel(op_type, site.dtype(x))
        return getattr(op, op_type)(x, bindings["gamma"], axis=axis, epsilon=epsilon)
    if op_type == "SimplifiedLayerNormalization":
        site.require_kernel(op_type, _FLOAT)
    gamma = _param(site, op, bindings["gamma"], "gamma", None, as_float32=True)
    return op.Cast(getattr(op, op_type)(x, gamma, axis=axis, epsilon=epsilon), to=rounded_to)


def _check_one(site: Site, bindings: dict[str, Any]) -> None:
    if "one" in bindings:
        one = site.require_constant(bindings["one"], "the numerator")
        if one.size != 1 or float(one.reshape(-1)[0]) != 1.0:
            raise Decline("the reciprocal is not 1 / sqrt(...)")


def _to_rms_normalization(op: Any, site: Site, x: ir.Value, **bindings: Any) -> ir.Value:
    axis = normalised_axis(site, x, **bindings)
    return _rounded_norm(op, site, x, "RMSNormalization", axis, bindings)


def _rms_rules(prefix: str, rewrite: Callable[..., Any], *, residual: bool) -> tuple[Rule, ...]:
    """The RMS-norm rule family one pass runs: every spelling of the reciprocal square root,
    each also in the fp16/bf16 export's Cast round trip (TorchScript writes torch.rsqrt as
    Div(1, Sqrt), the dynamo exporter as Reciprocal(Sqrt)), then each spelling without a
    weight; with ``residual``, behind a residual Add whose sum the fused op keeps available."""
    exposes = ("total",) if residual else ()
    spanning = _spanning_weight(rewrite)
    rules = [
        Rule(
            f"{prefix}{'Cast' if cast else ''}{form}{'' if epsilon else 'NoEpsilon'}",
            _rms_pattern(form, residual, cast, epsilon=epsilon),
            spanning,
            exposes=exposes,
        )
        for epsilon in (True, False)
        for cast in (False, True)
        for form in _RMS_FORMS
    ]
    # After the weighted forms, which take a norm with its weight whole.
    unweighted = [
        Rule(
            f"{prefix}{form}Unweighted{'' if epsilon else 'NoEpsilon'}",
            _rms_pattern(form, residual, weighted=False, epsilon=epsilon),
            spanning,
            exposes=exposes,
            candidate=_scaled_next,
        )
        for epsilon in (True, False)
        for form in _RMS_FORMS
    ]
    return (*rules, *unweighted)


@register_pass
class RmsNormFusionPass(PatternPass):
    spec = PassSpec(
        name="RmsNormFusionPass",
        category=Category.GRAPH,
        description="Written-out RMS norm (LLaMA, T5) -> RMSNormalization (opset 23)",
        aliases=("rms_norm_fusion", "RMSNormFusion"),
        numerics=Numerics.REASSOCIATING,
        min_opset=23,
        emits=("RMSNormalization",),
    )
    rules = _rms_rules("RmsNorm", _to_rms_normalization, residual=False)


def _to_simplified_layer_norm(op: Any, site: Site, x: ir.Value, **bindings: Any) -> ir.Value:
    axis = normalised_axis(site, x, **bindings)
    return _rounded_norm(op, site, x, "SimplifiedLayerNormalization", axis, bindings)


@register_pass
class SimplifiedLayerNormFusionPass(PatternPass):
    """Off by default: onnxruntime registers SimplifiedLayerNormalization in the ONNX domain,
    where the ONNX checker knows no such op, so the output would no longer pass the checker.
    Below opset 23 it is the only fused form of an RMS norm without a residual Add."""

    spec = PassSpec(
        name="SimplifiedLayerNormFusionPass",
        category=Category.UB,
        description="Written-out RMS norm without a residual Add -> onnxruntime's "
        "SimplifiedLayerNormalization (an ONNX-domain contrib op the ONNX checker rejects; "
        "off by default)",
        aliases=("simplified_layer_norm_fusion", "SimplifiedLayerNormFusion"),
        numerics=Numerics.REASSOCIATING,
        default_on=False,
        priority=8100,  # after AddRmsNormFusionPass, which takes the norms after a residual Add
        targets=("ort",),
        emits=("SimplifiedLayerNormalization",),
    )
    rules = _rms_rules("SimplifiedLayerNorm", _to_simplified_layer_norm, residual=False)


def _to_doubled_skip(op: Any, site: Site, x: ir.Value, **bindings: Any) -> ir.Value:
    """RMSNorm(x, eps) = SkipSimplifiedLayerNormalization(x, x, epsilon=4 * eps), exactly:
    the kernel normalises x + x = 2x, and 2x / sqrt(mean((2x)^2) + 4 eps) = x / sqrt(mean(x^2)
    + eps) with every step scaled by a power of two, which rounds nowhere. Below opset 23 this
    is the one fused form of an RMS norm without a residual Add that passes the checker."""
    if normalised_axis(site, x, **bindings) != -1:
        raise Decline("the fused kernel normalises the last axis only")
    shape = site.shape(x)
    if shape is None or len(shape) < 2:
        raise Decline("the rank of the normalised input is unknown or below 2")
    # The kernel takes 2-D or 3-D input: a 4-D one (per-head q/k norms: Qwen3's [B, S, N, H],
    # Gemma-3's [B, N, S, H]) is normalised as [B, -1, H] and reshaped back: to its static
    # axes, the one size that is not inferred (-1), else to its own shape read at run time.
    inner = list(shape[2:])
    if len(shape) > 3 and not isinstance(shape[-1], int):
        raise Decline("the input is above 3-D with a last axis of unknown size")
    _check_one(site, bindings)
    rounded_to = _rounded_to(site, x, bindings)
    widen = rounded_to is not None
    site.require_kernel("SkipSimplifiedLayerNormalization", _FLOAT if widen else site.dtype(x), MS)
    hidden = shape[-1] if isinstance(shape[-1], int) else None
    gamma = _param(site, op, bindings["gamma"], "gamma", hidden, widen)
    epsilon = 4 * _epsilon(site, bindings.get("eps"))
    source = x
    if len(shape) > 3:
        source = op.Reshape(x, site.initializer(op, np.array([0, -1, hidden]), "as_3d"))
    output = op.SkipSimplifiedLayerNormalization(source, source, gamma, _domain=MS, epsilon=epsilon)
    back = [0, -1, *inner]
    if not all(isinstance(d, int) for d in inner):  # the one size not static inferred
        back = [0, *(d if isinstance(d, int) else -1 for d in shape[1:])]
    if len(shape) > 3 and back.count(-1) <= 1:
        output = op.Reshape(output, site.initializer(op, np.array(back), "back"))
    elif len(shape) > 3:
        output = op.Reshape(output, op.Shape(x))
    return op.Cast(output, to=rounded_to) if widen else output


@register_pass
class DoubledRmsNormFusionPass(PatternPass):
    spec = PassSpec(
        name="DoubledRmsNormFusionPass",
        category=Category.UB,
        description="written-out RMS norm without a residual Add (below opset 23: no "
        "standard op) -> com.microsoft SkipSimplifiedLayerNormalization(x, x) with 4x the "
        "epsilon, which normalises 2x to exactly what x normalises to",
        aliases=("doubled_rms_norm_fusion",),
        numerics=Numerics.REASSOCIATING,
        priority=8200,  # after AddRmsNormFusionPass (residual sums) and the opt-in ONNX-domain op
        targets=("ort",),
        emits=("SkipSimplifiedLayerNormalization",),
        emits_domain=MS,
        every_layer=False,  # LLaMA's first norm is in layer 0 only
    )
    rules = _rms_rules("DoubledRmsNorm", _to_doubled_skip, residual=False)


@register_pass
class AddRmsNormFusionPass(PatternPass):
    spec = PassSpec(
        name="AddRmsNormFusionPass",
        category=Category.UB,
        description="residual Add + RMS norm (written out, RMSNormalization or onnxruntime's "
        "SimplifiedLayerNormalization) -> com.microsoft SkipSimplifiedLayerNormalization (the "
        "sum stays available to its other readers)",
        aliases=("add_rms_norm_fusion", "SkipSimplifiedLayerNormFusion"),
        numerics=Numerics.REASSOCIATING,
        targets=("ort",),
        emits=("SkipSimplifiedLayerNormalization",),
        emits_domain=MS,
    )
    rules = (
        *_rms_rules("AddRmsNorm", _skip_written_out, residual=True),
        *(
            Rule(f"Add{op_type}", _add_native_rms(op_type), _skip_native, exposes=("total",))
            for op_type in ("RMSNormalization", "SimplifiedLayerNormalization")
        ),
    )


def _embedding_sum(
    op: Any, ids: Any, word: Any, segment: Any, segment_ids: Any, positions: Any
) -> Any:
    words = op.Gather(word, ids, _allow_other_attributes=True)
    segments = op.Gather(segment, segment_ids, _allow_other_attributes=True)
    return op.Add(op.Add(words, segments), positions)


def _embed_native(op, ids, word, segment, segment_ids, position, position_ids, gamma, beta):
    positions = op.Gather(position, position_ids, _allow_other_attributes=True)
    total = _embedding_sum(op, ids, word, segment, segment_ids, positions)
    return op.LayerNormalization(total, gamma, beta, _allow_other_attributes=True)


def _embed_written(
    op, ids, word, segment, segment_ids, position, position_ids, eps, gamma, beta, two
):
    positions = op.Gather(position, position_ids, _allow_other_attributes=True)
    total = _embedding_sum(op, ids, word, segment, segment_ids, positions)
    return _decomposed(op, total, eps, gamma, beta, two)


# At a fixed sequence length (--input_shape) the position Gather is folded: its rows 0..S-1
# are a constant summand.
def _embed_native_fixed(op, ids, word, segment, segment_ids, positions, gamma, beta):
    total = _embedding_sum(op, ids, word, segment, segment_ids, positions)
    return op.LayerNormalization(total, gamma, beta, _allow_other_attributes=True)


def _embed_written_fixed(op, ids, word, segment, segment_ids, positions, eps, gamma, beta, two):
    total = _embedding_sum(op, ids, word, segment, segment_ids, positions)
    return _decomposed(op, total, eps, gamma, beta, two)


def _all_zeros(value: ir.Value | None) -> bool:
    """Whether every element is a zero taken from an all-zero constant by data movement, or
    filled in by ConstantOfShape with zero (transformers' default token types, TorchScript)."""
    source = drawn_from(value)
    return source is not None and not np.any(source)


def _is_arange(site: Site, value: ir.Value) -> bool:
    """position ids 0..S-1: a Slice from 0 (step 1) of an arange row, or Range(0, S, 1)."""
    producer = value.producer()
    if producer is None:
        return False
    if producer.op_type == "Unsqueeze":
        producer = producer.inputs[0].producer()
        if producer is None:
            return False
    if producer.op_type == "Range":
        start, step = (site.constant(v) for v in (producer.inputs[0], producer.inputs[2]))
        return start is not None and step is not None and start.item() == 0 and step.item() == 1
    if producer.op_type != "Slice" or len(producer.inputs) < 3:
        return False
    table = site.constant(producer.inputs[0])
    start = site.constant(producer.inputs[1])
    steps = site.constant(producer.inputs[4]) if len(producer.inputs) > 4 else None
    if table is None or start is None or np.any(start != 0):
        return False
    if steps is not None and np.any(steps != 1):
        return False
    rows = table.reshape(-1, table.shape[-1])
    return rows.shape[0] == 1 and bool(np.array_equal(rows[0], np.arange(rows.shape[1])))


def _position_rows(site: Site, ids: ir.Value, positions: ir.Value) -> np.ndarray:
    """The position table a constant summand is: rows 0..S-1 of one, [S, H] or [1, S, H], for
    ids of the fixed length S (EmbedLayerNormalization reads row i at position i)."""
    rows = site.require_constant(positions, "the position term (no Gather of a table)")
    shape = site.shape(ids)
    length = shape[-1] if shape is not None and len(shape) == 2 else None
    if not isinstance(length, int):
        raise Decline("the position term is a constant but the sequence length is not fixed")
    if rows.ndim not in (2, 3) or rows.shape[-2] != length or rows.shape[:-2] not in ((), (1,)):
        raise Decline(f"the constant position term {list(rows.shape)} is not [{length}, hidden]")
    return rows.reshape(length, rows.shape[-1])


def _constant_positions(site: Site, positions: ir.Value, **_: Any) -> bool:
    """Only a constant third summand is a folded position table (not a residual branch that
    joins the embeddings, as GPT-2's attention output does)."""
    return site.constant(positions) is not None


def _embed(op: Any, site: Site, **bindings: Any) -> Any:
    ids, segment_ids = bindings["ids"], bindings["segment_ids"]
    if not ids.is_graph_input():
        raise Decline("the word ids are not a graph input")
    fixed = "positions" in bindings
    if fixed:
        position = _position_rows(site, ids, bindings["positions"])
    elif not _is_arange(site, bindings["position_ids"]):
        raise Decline("the position ids are not 0..S-1")
    else:
        position = site.require_constant(bindings["position"], "position embeddings")
    word = site.require_constant(bindings["word"], "word embeddings")
    segment = site.require_constant(bindings["segment"], "segment embeddings")
    if not (word.ndim == position.ndim == segment.ndim == 2):
        raise Decline("an embedding table is not 2-D")
    if "eps" in bindings:
        if normalised_axis(site, site.root.inputs[0], **bindings) != -1:
            raise Decline("the layer norm is not over the last axis")
        epsilon = _epsilon(site, bindings.get("eps"))
    else:
        norm = site.node("LayerNormalization")
        if norm.attributes.get_int("axis", -1) not in (-1, 2):
            raise Decline("the layer norm is not over the last axis")
        epsilon = _native_epsilon(norm)
    site.require_kernel("EmbedLayerNormalization", site.dtype(bindings["word"]), MS)
    ids32 = op.Cast(ids, to=ir.DataType.INT32)
    if _all_zeros(segment_ids):
        # Every token has segment 0: its embedding row joins the position table.
        table = site.initializer(op, (position + segment[0]).astype(position.dtype), "position")
        inputs = [ids32, None, bindings["word"], table, None]
    elif segment_ids.is_graph_input():
        inputs = [
            ids32,
            op.Cast(segment_ids, to=ir.DataType.INT32),
            bindings["word"],
            site.initializer(op, position, "position_rows") if fixed else bindings["position"],
            bindings["segment"],
        ]
    else:
        raise Decline("the segment ids are neither a graph input nor all zero")
    # The kernel always produces mask_index as its second output; nothing reads it here.
    output, _ = op.EmbedLayerNormalization(
        *inputs, bindings["gamma"], bindings["beta"], _domain=MS, _outputs=2, epsilon=epsilon
    )
    return output


@register_pass
class EmbedLayerNormFusionPass(PatternPass):
    spec = PassSpec(
        name="EmbedLayerNormFusionPass",
        category=Category.UB,
        description="BERT embeddings (word + segment + position Gathers, summed, layer norm) -> "
        "com.microsoft EmbedLayerNormalization",
        aliases=("embed_layer_norm_fusion", "EmbedLayerNormFusion"),
        numerics=Numerics.REASSOCIATING,
        priority=7900,  # before AddLayerNormFusionPass, which would take the position Add
        targets=("ort",),
        emits=("EmbedLayerNormalization",),
        emits_domain=MS,
    )
    rules = (
        Rule("EmbedLayerNormalization", _embed_native, _embed),
        Rule("EmbedLayerNorm", _embed_written, _embed),
        Rule(
            "EmbedLayerNormalizationFixedLength",
            _embed_native_fixed,
            _embed,
            candidate=_constant_positions,
        ),
        Rule(
            "EmbedLayerNormFixedLength", _embed_written_fixed, _embed, candidate=_constant_positions
        ),
    )
