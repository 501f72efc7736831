"""Shape inference through onnxruntime's contrib ops, which onnx has no schema for.

onnx's shape inference skips a node it has no schema for, and every value computed from that
node's outputs is left without a shape. A model quantized with ``MatMulNBits`` (onnxruntime's
4-bit quantizer), or one that onnxruntime's optimizer fused before, then loses the ranks and
sizes the passes prove their rewrites with: nothing downstream of the first such node fuses.

For the inference call only, every contrib op below that onnx has no schema for gets one,
whose inference function says what its outputs are: onnx's own function where the op computes
the shape of a standard op (FusedConv is a Conv, FusedGemm a Gemm, the GELUs and norms keep
their input's shape), else a rule from the op's specification (MatMulNBits's ``N``, the
attention ops' output width). Outputs no rule covers stay unknown, as before.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import onnx
import onnx.defs
from onnx.shape_inference import InferenceContext

MS = "com.microsoft"
_Rule = Callable[[InferenceContext], None]


def _standard(op_type: str) -> _Rule:
    """The inference function of the standard op ``op_type`` (its latest version)."""

    def rule(ctx: InferenceContext) -> None:
        _standard_function(op_type)(ctx)

    return rule


@functools.cache
def _standard_function(op_type: str) -> _Rule:
    return onnx.defs.get_schema(op_type).get_type_and_shape_inference_function()


def _tensor(ctx: InferenceContext, index: int) -> onnx.TypeProto | None:
    """Input ``index``'s type where it is a tensor type, else None."""
    if index >= ctx.get_num_inputs() or not ctx.has_input(index):
        return None
    found = ctx.get_input_type(index)
    return found if found is not None and found.HasField("tensor_type") else None


def _dims(found: onnx.TypeProto | None) -> list[onnx.TensorShapeProto.Dimension] | None:
    if found is None or not found.tensor_type.HasField("shape"):
        return None
    return list(found.tensor_type.shape.dim)


def _set(
    ctx: InferenceContext,
    index: int,
    elem_type: int,
    dims: list[onnx.TensorShapeProto.Dimension | int | None] | None,
) -> None:
    """Output ``index`` of ``elem_type`` and ``dims`` (None: unknown rank; a None dim: an
    unknown size)."""
    if index >= ctx.get_num_outputs() or not ctx.has_output(index) or not elem_type:
        return
    result = onnx.TypeProto()
    result.tensor_type.elem_type = elem_type
    if dims is not None:
        shape = result.tensor_type.shape
        shape.SetInParent()
        for dim in dims:
            added = shape.dim.add()
            if isinstance(dim, int):
                added.dim_value = dim
            elif dim is not None:
                added.CopyFrom(dim)
    ctx.set_output_type(index, result)


def _size(dim: onnx.TensorShapeProto.Dimension) -> int | None:
    return dim.dim_value if dim.HasField("dim_value") else None


def _int(ctx: InferenceContext, name: str, default: int) -> int:
    attribute = ctx.get_attribute(name)
    return attribute.i if attribute is not None else default


def _like_input(*outputs: int) -> _Rule:
    """The listed outputs have input 0's type and shape (norms with their residual sum)."""

    def rule(ctx: InferenceContext) -> None:
        source = _tensor(ctx, 0)
        if source is not None:
            for index in outputs:
                _set(ctx, index, source.tensor_type.elem_type, _dims(source))

    return rule


def _matmul_nbits(ctx: InferenceContext) -> None:
    """Y [..., N] of A [..., K], the type of A."""
    source = _tensor(ctx, 0)
    dims = _dims(source)
    if source is not None:
        _set(
            ctx,
            0,
            source.tensor_type.elem_type,
            None if not dims else [*dims[:-1], _int(ctx, "N", 0) or None],
        )


def _retyped(rule: _Rule, type_input: int) -> _Rule:
    """``rule``'s output 0 with the element type of input ``type_input`` (a dequantizing op:
    the shape of the integer op, the type of its scale)."""

    def retyped(ctx: InferenceContext) -> None:
        rule(ctx)
        scale = _tensor(ctx, type_input)
        if scale is None or ctx.get_num_outputs() == 0 or not ctx.has_output(0):
            return
        found = ctx.get_output_type(0)
        if found is not None and found.HasField("tensor_type"):
            _set(ctx, 0, scale.tensor_type.elem_type, _dims(found))

    return retyped


def _fused_matmul(ctx: InferenceContext) -> None:
    """MatMul's shape where neither operand is transposed by the op (else unknown)."""
    if any(_int(ctx, name, 0) for name in ("transA", "transB", "transBatchA", "transBatchB")):
        source = _tensor(ctx, 0)
        if source is not None:
            _set(ctx, 0, source.tensor_type.elem_type, None)
        return
    _standard("MatMul")(ctx)


def _attention_output(ctx: InferenceContext, width: int | None) -> None:
    """Output 0 [batch, sequence, width] of a query [batch, sequence, ...]."""
    query = _tensor(ctx, 0)
    dims = _dims(query)
    if query is not None and dims is not None and len(dims) >= 2:
        _set(ctx, 0, query.tensor_type.elem_type, [dims[0], dims[1], width])


def _multi_head_attention(ctx: InferenceContext) -> None:
    """[B, S, value width]: the value's [B, L, Dv] or [B, N, L, H], else the packed key's or
    query's heads times head size."""
    value, key, query = (_dims(_tensor(ctx, index)) for index in (2, 1, 0))
    width = None
    if value is not None and len(value) == 3:
        width = _size(value[2])
    elif value is not None and len(value) == 4:
        width = _product(value[1], value[3])
    elif key is not None and len(key) == 5:  # packed key and value [B, L, N, 2, H]
        width = _product(key[2], key[4])
    elif query is not None and len(query) == 5:  # packed QKV [B, S, N, 3, H]
        width = _product(query[2], query[4])
    _attention_output(ctx, width)


def _product(*dims: onnx.TensorShapeProto.Dimension) -> int | None:
    sizes = [_size(dim) for dim in dims]
    return None if None in sizes else math.prod(sizes)  # type: ignore[arg-type]


def _group_query_attention(ctx: InferenceContext) -> None:
    """[B, S, num_heads * head size]; from a packed QKV [B, S, (N + 2 KV) * H] where no key."""
    query = _dims(_tensor(ctx, 0))
    width = _size(query[2]) if query is not None and len(query) == 3 else None
    if width is not None and _tensor(ctx, 1) is None:
        heads, kv_heads = _int(ctx, "num_heads", 0), _int(ctx, "kv_num_heads", 0)
        total = heads + 2 * kv_heads
        width = heads * (width // total) if heads and total and width % total == 0 else None
    _attention_output(ctx, width)


def _packed_attention(ctx: InferenceContext) -> None:
    """com.microsoft Attention: [B, S, value hidden], from qkv_hidden_sizes or the weights'
    [D, 3 * hidden]."""
    sizes = ctx.get_attribute("qkv_hidden_sizes")
    weights = _dims(_tensor(ctx, 1))
    width = None
    if sizes is not None and len(sizes.ints) == 3:
        width = sizes.ints[2]
    elif weights is not None and len(weights) == 2 and (total := _size(weights[1])) is not None:
        width = total // 3 if total % 3 == 0 else None
    _attention_output(ctx, width)


def _embed_layer_norm(ctx: InferenceContext) -> None:
    """[B, S, H] from input_ids [B, S] and the word table [V, H]; mask_index [B] int32."""
    ids, table = _dims(_tensor(ctx, 0)), _tensor(ctx, 2)
    rows = _dims(table)
    if ids is None or len(ids) != 2 or table is None or rows is None or len(rows) != 2:
        return
    output = [ids[0], ids[1], rows[1]]
    _set(ctx, 0, table.tensor_type.elem_type, output)
    _set(ctx, 1, onnx.TensorProto.INT32, [ids[0]])
    _set(ctx, 2, table.tensor_type.elem_type, output)


_FIRST = _like_input(0)
# (domain, op type) -> the inference rule of its outputs.
_RULES: dict[tuple[str, str], _Rule] = {
    (MS, "MatMulNBits"): _matmul_nbits,
    (MS, "FusedMatMul"): _fused_matmul,
    (MS, "MatMulIntegerToFloat"): _retyped(_standard("MatMul"), 2),
    (MS, "DynamicQuantizeMatMul"): _retyped(_standard("MatMul"), 2),
    (MS, "FusedConv"): _standard("Conv"),
    (MS, "FusedGemm"): _standard("Gemm"),
    (MS, "Gelu"): _FIRST,
    (MS, "FastGelu"): _FIRST,
    (MS, "BiasGelu"): _FIRST,
    (MS, "QuickGelu"): _FIRST,
    (MS, "BiasAdd"): _FIRST,
    (MS, "RotaryEmbedding"): _FIRST,
    (MS, "SkipLayerNormalization"): _like_input(0, 3),
    (MS, "SkipSimplifiedLayerNormalization"): _like_input(0, 3),
    ("", "SimplifiedLayerNormalization"): _FIRST,
    (MS, "MultiHeadAttention"): _multi_head_attention,
    (MS, "GroupQueryAttention"): _group_query_attention,
    (MS, "Attention"): _packed_attention,
    (MS, "EmbedLayerNormalization"): _embed_layer_norm,
}
_ALL_TENSORS = [
    f"tensor({name})"
    for name in (
        *("float", "float16", "bfloat16", "double", "int8", "uint8", "int16", "uint16"),
        *("int32", "uint32", "int64", "uint64", "bool", "string"),
    )
]
_ANY = onnx.defs.OpSchema.FormalParameter(
    "values",
    "T",
    param_option=onnx.defs.OpSchema.FormalParameterOption.Variadic,
    is_homogeneous=False,
    min_arity=0,
)


@contextlib.contextmanager
def contrib_schemas() -> Iterator[None]:
    """While open, onnx's inference knows the outputs of the contrib ops it has no schema for
    (all of them: registering is cheaper than finding which a large graph holds); the schemas
    are removed again on exit."""
    added: list[tuple[str, str]] = []
    try:
        for domain, op_type in _RULES:
            if onnx.defs.has(op_type, domain):
                continue
            schema = onnx.defs.OpSchema(
                op_type,
                domain,
                1,
                inputs=[_ANY],
                outputs=[_ANY],
                type_constraints=[("T", _ALL_TENSORS, "")],
            )
            schema.set_type_and_shape_inference_function(_RULES[domain, op_type])
            onnx.defs.register_schema(schema)
            added.append((domain, op_type))
        yield
    finally:
        for domain, op_type in added:
            onnx.defs.deregister_schema(op_type, 1, domain)
