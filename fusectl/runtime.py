"""What the installed onnxruntime can run, read from its kernel registry once per process."""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    """Execution providers of the installed onnxruntime with a kernel for the op."""
    return tuple(sorted({k.provider for k in kernels(op_type, domain)}))


def has_kernel(op_type: str, domain: str, opset: int, dtype: ir.DataType | None) -> bool:
    """Whether some provider runs ``op_type`` at this opset for this element type."""
    wanted = None if dtype is None else f"tensor({dtype.name.lower()})"
    domain = _domain(domain)
    for kernel in kernels(op_type, domain):
        in_range = kernel.first <= opset <= kernel.last if domain == "" else True
        if in_range and (wanted is None or not kernel.types or wanted in kernel.types):
            return True
    return False
