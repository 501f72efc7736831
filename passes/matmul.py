"""MatMul + bias: a 2-D MatMul followed by a constant bias Add becomes one Gemm."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from fusectl.rewrite.patterns import Decline, Site
from fusectl.rewrite.registry import Category, Numerics
from fusectl.rewrite.replacement import register_replacement

# The element types ONNX's Gemm accepts; with --target ort the installed kernels decide.
_GEMM_TYPES = frozenset(
    {
        ir.DataType.FLOAT,
        ir.DataType.FLOAT16,
        ir.DataType.DOUBLE,
        ir.DataType.BFLOAT16,
        ir.DataType.INT32,
        ir.DataType.INT64,
        ir.DataType.UINT32,
        ir.DataType.UINT64,
    }
)


def _matmul_add(op, a, b, bias):
    return op.Add(op.MatMul(a, b), bias)


def _to_gemm(op: Any, site: Site, a: ir.Value, b: ir.Value, bias: ir.Value) -> ir.Value:
    for value, what in ((a, "MatMul input A"), (b, "MatMul input B")):
        rank = site.require_rank(value, what)
        if rank != 2:
            raise Decline(f"{what} is {rank}-D; Gemm needs 2-D")
    if a.dtype not in _GEMM_TYPES:
        raise Decline(f"Gemm does not support element type {a.dtype}")
    site.require_kernel("Gemm", a.dtype)
    bias_array = site.require_constant(bias, "bias")
    # Gemm broadcasts C to [M, N] one way only; the Add must not have grown the MatMul output.
    n = site.shape(b)[1]
    if bias_array.ndim > 2:
        raise Decline("bias has more than 2 axes")
    padded = (1,) * (2 - bias_array.ndim) + bias_array.shape
    if padded[0] != 1 or padded[1] not in (1, n):
        raise Decline("bias does not broadcast along the output's last axis only")
    return op.Gemm(a, b, bias)


register_replacement(
    "MatMulBiasAddFusionPass",
    _matmul_add,
    _to_gemm,
    category=Category.GRAPH,
    description="2-D MatMul followed by a constant bias Add -> Gemm",
    aliases=("matmul_elem_biasadd_fusion", "MatMulAddFusion"),
    numerics=Numerics.REASSOCIATING,
    priority=5120,
    min_opset=7,
    emits=("Gemm",),
    pattern_name="MatMulBiasAdd",
)
