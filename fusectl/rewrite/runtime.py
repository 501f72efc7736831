"""What the installed onnxruntime can run, read from its kernel registry once per process.

onnxruntime lists its kernels by creating every execution provider it was built with. A provider
that lives in a library of its own (onnxruntime-gpu's CUDA and TensorRT) whose library cannot
load there, as TensorRT's cannot without NVIDIA's TensorRT installed, ends the whole process in a
segmentation fault. Where such libraries exist the list is therefore read in a child process;
if the child dies, the operator schemas of the same onnxruntime stand in for its kernels (an op
and element type the build defines), with a warning.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from onnxruntime.capi import _pybind_state

logger = logging.getLogger("fusectl")

# Lists the kernel registry as rows [domain, op, provider, first, last, [types]]: run here, or
# in a child process that prints them as JSON (see _registry).
_LIST_KERNELS = """
from onnxruntime.capi import _pybind_state
rows = [
    [k.domain, k.op_name, k.provider, *k.version_range,
     sorted({t for ts in k.type_constraints.values() for t in ts})]
    for k in _pybind_state.get_all_opkernel_def()
]
"""
# Opset ranges in the registry run to this when a kernel has no upper bound.
_OPEN_END = 2**31 - 1


@dataclass(frozen=True)
class Kernel:
    provider: str
    first: int
    last: int
    types: frozenset[str]


def provider_libraries() -> list[Path]:
    """The libraries of the execution providers onnxruntime loads on demand (none in the
    CPU-only package; CUDA and TensorRT in onnxruntime-gpu's)."""
    folder = Path(_pybind_state.__file__).parent
    return sorted(p for p in folder.glob("*onnxruntime_providers_*") if "_shared" not in p.name)


def kernel_rows_in_child(program: str = _LIST_KERNELS) -> list[list] | None:
    """The rows ``program`` lists, from a child Python; None if the child fails (a provider's
    library that does not load takes the process with it)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", program + "\nimport json\nprint(json.dumps(rows))"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _kernel_rows() -> list[list]:
    """The rows listed in this process (no provider library to load: the CPU package)."""
    namespace: dict[str, list[list]] = {}
    exec(_LIST_KERNELS, namespace)  # the child's listing, one text for both
    return namespace["rows"]


def schema_rows() -> list[list]:
    """Stand-in rows from onnxruntime's operator schemas: each version of an op, with the
    element types its schema allows, counts as a kernel of that op."""
    versions: dict[tuple[str, str], list] = {}
    for schema in _pybind_state.get_all_operator_schema():
        types = [t for c in schema.type_constraints for t in c.allowed_type_strs]
        versions.setdefault((schema.domain, schema.name), []).append((schema.since_version, types))
    rows = []
    for (domain, name), found in versions.items():
        found.sort()
        for index, (since, types) in enumerate(found):
            last = found[index + 1][0] - 1 if index + 1 < len(found) else _OPEN_END
            rows.append([domain, name, "schema", since, last, types])
    return rows


@functools.cache
def _registry() -> dict[tuple[str, str], tuple[Kernel, ...]]:
    if not provider_libraries():
        rows = _kernel_rows()
    else:
        rows = kernel_rows_in_child()
        if rows is None:
            libraries = ", ".join(p.name for p in provider_libraries())
            logger.warning(
                "onnxruntime's kernel registry cannot be read here: listing it loads every "
                "provider library (%s) and one of them does not load (onnxruntime-gpu without "
                "TensorRT installed, say); fusions are checked against onnxruntime's operator "
                "schemas instead",
                libraries,
            )
            rows = schema_rows()
    found: dict[tuple[str, str], list[Kernel]] = {}
    for domain, op, provider, first, last, types in rows:
        found.setdefault((domain, op), []).append(Kernel(provider, first, last, frozenset(types)))
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


# onnxruntime runs a float16 node the CPU provider has only a float32 kernel for in float32:
# its InsertCastTransformer casts the inputs up and the outputs back (no other type, no other
# provider: a bfloat16 MultiHeadAttention does not load on the CPU).
_CAST_ON_CPU = {"tensor(float16)": "tensor(float)"}
_CPU = "CPUExecutionProvider"


def has_kernel(op_type: str, domain: str, opset: int, dtype: ir.DataType | None) -> bool:
    """Whether some provider runs ``op_type`` at this opset for this element type: with a
    kernel (on the CPU, a float32 one for float16), or by expanding the op's ONNX function
    body into ops it has kernels for."""
    wanted = None if dtype is None else type_string(dtype)
    domain = _domain(domain)
    for kernel in kernels(op_type, domain):
        in_range = kernel.first <= opset <= kernel.last if domain == "" else True
        runs = wanted is None or not kernel.types or wanted in kernel.types
        if kernel.provider == _CPU and not runs:
            runs = _CAST_ON_CPU.get(wanted or "") in kernel.types
        if in_range and runs:
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


# onnxruntime's contrib ops, which onnx.checker knows nothing of: their type constraints are
# checked against onnxruntime's own schemas (type_conflict).
_CONTRIB = "com.microsoft"


@functools.cache
def _contrib_schemas() -> dict[str, list]:
    found: dict[str, list] = {}
    for schema in _pybind_state.get_all_operator_schema():
        if schema.domain == _CONTRIB:
            found.setdefault(schema.name, []).append(schema)
    return found


def type_string(dtype: ir.DataType) -> str:
    """The element type as onnxruntime's kernel registry and schemas write it."""
    return f"tensor({dtype.name.lower()})"


def _formals(formals: list[Any], values: Sequence[ir.Value | None]) -> Iterator[tuple[Any, str]]:
    """Each present value's formal parameter and element type (a variadic last one takes
    the rest)."""
    for index, value in enumerate(values):
        formal = formals[min(index, len(formals) - 1)] if formals else None
        if formal is None or (index >= len(formals) and formal.option.name != "Variadic"):
            return
        if value is not None and value.dtype is not None:
            yield formal, type_string(value.dtype)


def type_conflict(model: ir.Model) -> str | None:
    """The first contrib-op node (any graph) whose element types break its onnxruntime schema's
    type constraints, as onnxruntime reports when it loads the model; None if none does."""
    if _CONTRIB not in model.opset_imports:  # no contrib op to check: no walk
        return None
    version = model.opset_imports[_CONTRIB]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        schemas = _contrib_schemas().get(node.op_type) if node.domain == _CONTRIB else None
        if not schemas:
            continue
        fitting = [s for s in schemas if s.since_version <= version] or schemas
        schema = max(fitting, key=lambda s: s.since_version)
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        bound: dict[str, tuple[str, str]] = {}
        where = f"{node.op_type} node '{node.name}'"
        for formal, actual in [
            *_formals(schema.inputs, node.inputs),
            *_formals(schema.outputs, node.outputs),
        ]:
            param = formal.typeStr
            if actual not in allowed.get(param, {param}):
                return f"{where}: {formal.name} is {actual}, which {param} does not allow"
            if formal.option.name == "Variadic" and not formal.isHomogeneous:
                continue
            first = bound.setdefault(param, (actual, formal.name))
            if first[0] != actual:
                return (
                    f"{where}: {param} is {first[0]} for {first[1]} and {actual} for {formal.name}"
                )
    return None
