"""Reading what the installed onnxruntime can run: the kernel registry in-process, from a child
process (where provider libraries exist, one of which may take the process down), and the
operator-schema stand-in when the child dies."""

from __future__ import annotations

from fusectl.core.plugins import load_builtin_passes
from fusectl.rewrite import runtime


def _normalized(rows: list[list]) -> list[tuple]:
    return sorted((d, o, p, f, last, tuple(sorted(set(t)))) for d, o, p, f, last, t in rows)


def test_the_cpu_package_has_no_provider_library_so_it_reads_in_process() -> None:
    # CI's onnxruntime is the CPU package: nothing to load, no child process per run.
    assert runtime.provider_libraries() == []


def test_a_child_process_lists_the_same_kernels() -> None:
    in_child = runtime.kernel_rows_in_child()
    assert in_child is not None
    assert _normalized(in_child) == _normalized(runtime._kernel_rows())


def test_a_child_that_dies_gives_no_rows() -> None:
    # What onnxruntime-gpu does without TensorRT's libraries: the listing ends the process.
    assert runtime.kernel_rows_in_child("import os\nos.abort()") is None


def test_the_schema_stand_in_defines_every_fused_op_the_passes_emit() -> None:
    registry = load_builtin_passes()
    defined = {(domain, op) for domain, op, *_ in runtime.schema_rows()}
    emitted = {
        ("" if p.spec.emits_domain in ("", "ai.onnx") else p.spec.emits_domain, op)
        for p in registry
        for op in p.spec.emits
    }
    assert emitted and emitted <= defined, sorted(emitted - defined)
    float_ops = {
        (d, o) for d, o, _, _, _, types in runtime.schema_rows() if "tensor(float)" in types
    }
    assert ("com.microsoft", "SkipLayerNormalization") in float_ops
    assert ("com.microsoft", "NoSuchFusedOp") not in defined
