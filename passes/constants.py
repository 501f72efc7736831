"""Constant folding: nodes computable before run time become initializers.

Exporters compute many constants in the graph (pad amounts from ConstantOfShape/Concat/Slice,
zero biases from Expand(CastLike(0, x), Shape(W)), Clip bounds from CastLike, Unsqueezed
scales). Left in place they hide constants from every later pattern, and give the values they
read extra consumers. Each node is evaluated with the ONNX reference implementation of its op
at the model's opset.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import onnx.defs
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.evaluate import run_node
from fusectl.rewrite.graph import (
    SEEN_THROUGH,
    constant_tensor,
    constant_value,
    remove_dead,
)
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass

logger = logging.getLogger("fusectl")

# Ops whose result is not a function of their inputs, or that run subgraphs.
_NEVER = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "If",
        "Loop",
        "Scan",
        "SequenceMap",
        "Constant",
    }
)
# Computable, but kept: a DequantizeLinear of a constant is how a quantized model stores its
# weights; onnxruntime runs it with the MatMul or Conv reading it as one quantized kernel
# (MatMulNBits, QLinearMatMul), and folding it would store the weights in float, up to eight
# times larger, and compute in float what the model computes in integers.
_KEEPS_QUANTIZED = "DequantizeLinear"
# From this IR version on, an initializer need not be a graph input (a constant, not a default).
_INITIALIZERS_NOT_INPUTS_IR = 4
# A folded value bigger than this is only kept when it frees its inputs (no net growth).
_GROWTH_LIMIT_BYTES = 1 << 20
# The ops _evaluate folds without every input constant: they read shapes or element types.
_READS_SHAPES = frozenset({"Gather", "Slice", "Shape", "Size", "CastLike"})
# What produces a value constant_value may see as constant.
_CONSTANT_SOURCES = SEEN_THROUGH | {"Constant"}


def _may_be_constant(node: ir.Node) -> bool:
    """False when an input is surely not a constant (a graph input, or computed by an op
    constant_value does not look through): most nodes of a graph, turned down before the
    full evaluation is set up."""
    for value in node.inputs:
        if value is None:
            continue
        if value.is_graph_input():
            return False
        producer = value.producer()
        if producer is not None and producer.op_type not in _CONSTANT_SOURCES:
            return False
    return True


def _static_shape(ctx: PassContext, value: ir.Value | None) -> list[int] | None:
    shape = ctx.shape(value) if value is not None else None
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return [int(d) for d in shape]


def _shape_dims(ctx: PassContext, node: ir.Node) -> list[int | None] | None:
    """What a Shape node returns, with None for the dimensions that are only known at run time."""
    shape = ctx.shape(node.inputs[0])
    if shape is None:
        return None
    dims = [int(d) if isinstance(d, int) else None for d in shape]
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", None)
    return dims[start:end]


def _static_part_of_shape(ctx: PassContext, node: ir.Node) -> list[np.ndarray] | None:
    """Gather / Slice of a Shape that select only static dimensions (the head size read back
    from a [B, N, S, H] tensor, say): known before run time even though the shape is not."""
    found = _shape_positions(ctx, node.outputs[0])
    if found is None:
        return None
    dims, selected = found
    values = [dims[int(i)] for i in np.ravel(selected)]
    if any(v is None for v in values):
        return None
    return [np.array(values, dtype=np.int64).reshape(np.shape(selected))]


def _shape_positions(
    ctx: PassContext, value: ir.Value | None, depth: int = 4
) -> tuple[list[int | None], np.ndarray] | None:
    """The dims a Shape read and which of them ``value`` holds: the Shape itself, or Gathers
    and Slices of it (onnxruntime's transpose optimizer writes Shape(Transpose(x)) as
    Gather(Shape(x), perm), which a Gather then reads a size of)."""
    node = value.producer() if value is not None else None
    if node is None:
        return None
    if node.op_type == "Shape":
        dims = _shape_dims(ctx, node)
        return None if dims is None else (dims, np.arange(len(dims), dtype=np.int64))
    if node.op_type not in ("Gather", "Slice") or depth == 0:
        return None
    inner = _shape_positions(ctx, node.inputs[0], depth - 1)
    if inner is None or inner[1].ndim != 1:
        return None
    dims, positions = inner
    if node.op_type == "Gather":
        indices = constant_value(node.inputs[1])
        if indices is None or node.attributes.get_int("axis", 0) != 0:
            return None
        return dims, positions[indices]
    operands = [*node.inputs[1:], None, None][:4]
    defaults = [None, None, np.array([0]), np.array([1])]
    starts, ends, axes, steps = (
        constant_value(v) if v is not None else default
        for v, default in zip(operands, defaults, strict=True)
    )
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if np.size(starts) != 1 or int(np.ravel(axes)[0]) not in (0, -1):
        return None
    return dims, positions[slice(*(int(np.ravel(b)[0]) for b in (starts, ends, steps)))]


@functools.cache
def _yields_tensors(op_type: str, opset: int) -> bool:
    """Whether every output of the op can be a tensor: sequences, maps and optionals (the
    outputs of SequenceEmpty, Optional, ...) are never folded into initializers."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    return all(
        any(kind.startswith("tensor(") for kind in allowed.get(out.type_str, [out.type_str]))
        for out in schema.outputs
    )


def _evaluate(ctx: PassContext, node: ir.Node, opset: int) -> list[np.ndarray] | None:
    """The node's outputs, if every input is known before run time."""
    if node.op_type in ("Gather", "Slice") and constant_value(node.inputs[0]) is None:
        return _static_part_of_shape(ctx, node)
    if node.op_type == "Shape" or node.op_type == "Size":
        shape = _static_shape(ctx, node.inputs[0])
        if shape is None:
            return None
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", None)
        return [np.array(shape[start:end], dtype=np.int64)]
    if node.op_type == "CastLike":  # reads only the element type of its second input
        data, like = constant_value(node.inputs[0]), ctx.dtype(node.inputs[1])
        if data is None or like is None:
            return None
        return [data.astype(like.numpy())]
    arrays = []
    for value in node.inputs:
        if value is None:
            arrays.append(None)
            continue
        array = constant_value(value)
        if array is None:
            return None
        arrays.append(array)
    return run_node(node, arrays, opset)


def _duplicates_inputs(node: ir.Node, size: int, cone: set[ir.Node]) -> bool:
    """Whether folding the node into ``size`` bytes would keep data alive beside its result:
    a constant input something outside the constant ``cone`` reads too (readers inside it fold
    as well, and the input goes with the last: onnx-asr's resampler computes its sinc, window
    and zero test from one [640, 455] grid). The node may read one twice itself (NF-ResNet's
    weight standardization squares the centered weight as Mul(d, d)). A shared scalar (a
    scale, a frequency) duplicates nothing where the result is no larger than the inputs it
    frees; an Expand of a shared scalar to a large shape stays a duplicate."""
    freed, shared_scalars = 0, False
    for value in node.inputs:
        if value is None:
            continue
        if not value.is_graph_output() and all(
            user is node or user in cone for user, _ in value.uses()
        ):
            tensor = value.const_value
            freed += tensor.nbytes if tensor is not None else 0
        elif _is_scalar(value):
            shared_scalars = True
        else:
            return True
    return shared_scalars and size > freed + _GROWTH_LIMIT_BYTES


def _constant_cone(graph: ir.Graph) -> set[ir.Node]:
    """The nodes whose every input is a constant or computed by such a node: what folding
    the graph in order may fold (a subset: a fold may still be declined)."""
    cone: set[ir.Node] = set()
    for node in graph:
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER:
            continue
        if node.op_type == _KEEPS_QUANTIZED:
            continue
        if all(
            value is None or value.const_value is not None or value.producer() in cone
            for value in node.inputs
        ):
            cone.add(node)
    return cone


def _is_scalar(value: ir.Value) -> bool:
    tensor = value.const_value
    return tensor is not None and math.prod(tensor.shape.numpy()) == 1


def _lift_constants(ctx: PassContext, graph: ir.Graph) -> None:
    """Constant nodes of the graph become initializers, as onnxruntime loads them anyway: one
    spelling of a constant for every pass, and no node for it. Not counted as folds (nothing
    is computed); a Constant that is a graph output stays, as an initializer cannot be one."""
    for node in ctx.op_index.of_type(graph, "Constant", ("", "ai.onnx")):
        if node.graph is not graph:
            continue
        result = node.outputs[0]
        tensor = constant_tensor(result)
        if tensor is None or result.is_graph_output() or result.name in graph.initializers:
            continue
        lifted = ir.Value(
            name=result.name,
            type=ir.TensorType(tensor.dtype),
            shape=ir.Shape(tensor.shape),
            const_value=tensor,
        )
        ir.convenience.replace_all_uses_with(result, lifted)
        graph.remove(node, safe=True)
        graph.initializers[lifted.name] = lifted


@register_pass
class ConstantFoldingPass(FusionPass):
    spec = PassSpec(
        name="ConstantFoldingPass",
        category=Category.GRAPH,
        description="Nodes whose inputs are all known before run time (constants, static "
        "shapes) -> initializers",
        aliases=("ConstantFolding", "constant_folding"),
        priority=3000,
        canonical=True,
        again_after_fusions=True,  # sizes a fused op's output has statically
    )
    counts_changes = True  # folds are counted; lifting Constants only removes nodes

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        if model.ir_version < _INITIALIZERS_NOT_INPUTS_IR:
            return  # every initializer must also be a graph input, one a caller may override
        graph = model.graph
        _lift_constants(ctx, graph)
        cone = _constant_cone(graph)
        for node in graph:
            if node.op_type not in _READS_SHAPES and not _may_be_constant(node):
                continue
            if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER:
                continue
            if not _yields_tensors(node.op_type, ctx.opset):
                continue
            if node.op_type == _KEEPS_QUANTIZED:
                ctx.pattern(node.op_type).decline(
                    "a DequantizeLinear keeps the weights it reads quantized",
                    node.name or node.op_type,
                )
                continue
            if any(value.is_graph_output() for value in node.outputs):
                continue
            try:
                results = _evaluate(ctx, node, ctx.opset)
            except Exception as error:  # an op the reference cannot run here stays as it is
                logger.debug("cannot fold %s: %s", node.name, error)
                continue
            if results is None:
                continue
            if any(result.dtype.kind in "OSU" for result in results):
                continue  # strings: onnx-ir keeps them as StringTensor, not numpy's str arrays
            stats = ctx.pattern(node.op_type)
            size = sum(r.nbytes for r in results)
            if size > _GROWTH_LIMIT_BYTES and _duplicates_inputs(node, size, cone):
                stats.decline(
                    "the folded value would be large and duplicate its inputs",
                    node.name or node.op_type,
                )
                continue
            if not ctx.may_rewrite(node.op_type, node.name or node.op_type):
                continue
            constants = []
            for old, array in zip(node.outputs, results, strict=True):
                tensor = ir.tensor(array, name=old.name)
                constants.append(
                    ir.Value(
                        name=old.name,
                        type=ir.TensorType(tensor.dtype),
                        shape=ir.Shape(array.shape),
                        const_value=tensor,
                    )
                )
            for old, new in zip(node.outputs, constants, strict=True):
                ir.convenience.replace_all_uses_with(old, new)
            sources = [value.producer() for value in node.inputs if value is not None]
            graph.remove(node, safe=True)
            remove_dead(graph, sources)
            for new in constants:
                graph.initializers[new.name] = new
            ctx.record_fusion(node.op_type, [node], [])
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()
