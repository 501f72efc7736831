"""What the installed onnxruntime can run, read from its kernel registry once per process."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx
import onnx_ir as ir
from onnxruntime.capi import _pybind_state


@dataclass(frozen=True)
class Kernel:
    provider: str
    first: int
    last: int
    types: frozenset[str]


@functools.cache
def _registry() -> dict[tuple[str, str], tuple[Kernel, ...]]:
    found: dict[tuple[str, str], list[Kernel]] = {}
    for kernel in _pybind_state.get_all_opkernel_def():
        first, last = kernel.version_range
        types = frozenset(t for ts in kernel.type_constraints.values() for t in ts)
        key = (kernel.domain, kernel.op_name)
        found.setdefault(key, []).append(Kernel(kernel.provider, first, last, types))
    return {key: tuple(kernels) for key, kernels in found.items()}


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def kernels(op_type: str, domain: str = "") -> tuple[Kernel, ...]:
    return _registry().get((_domain(domain), op_type), ())


def providers(op_type: str, domain: str = "") -> tuple[str, ...]:
    """Execution providers of the installed onnxruntime with a kernel for the op, or for every
    op of its function body when it has none of its own (HardSwish: HardSigmoid and Mul)."""
    found = {k.provider for k in kernels(op_type, domain)}
    body = _function_body(op_type, domain, None) if not found else None
    if body:
        sets = [set(providers(inner, inner_domain)) for inner, inner_domain in body]
        found = set.intersection(*sets)
    return tuple(sorted(found))


def has_kernel(op_type: str, domain: str, opset: int, dtype: ir.DataType | None) -> bool:
    """Whether some provider runs ``op_type`` at this opset for this element type: with a
    kernel, or by expanding the op's ONNX function body into ops it has kernels for."""
    wanted = None if dtype is None else f"tensor({dtype.name.lower()})"
    domain = _domain(domain)
    for kernel in kernels(op_type, domain):
        in_range = kernel.first <= opset <= kernel.last if domain == "" else True
        if in_range and (wanted is None or not kernel.types or wanted in kernel.types):
            return True
    body = _function_body(op_type, domain, opset)
    return bool(body) and all(has_kernel(op, d, opset, dtype) for op, d in body)


@functools.cache
def _function_body(op_type: str, domain: str, opset: int | None) -> tuple[tuple[str, str], ...]:
    """(op, domain) of the nodes of a standard op's function body, if onnx defines one; the
    body's own Constant nodes need no kernel of the element type."""
    if _domain(domain) != "":
        return ()
    try:
        schema = onnx.defs.get_schema(op_type, opset or onnx.defs.onnx_opset_version(), "")
    except onnx.defs.SchemaError:
        return ()
    if not schema.has_function:
        return ()
    return tuple(
        (node.op_type, node.domain)
        for node in schema.function_body.node
        if node.op_type != "Constant"
    )
