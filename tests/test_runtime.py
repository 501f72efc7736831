"""Reading what the installed onnxruntime can run: the kernel registry in-process, from a child
process (where provider libraries exist, one of which may take the process down), and the
operator-schema stand-in when the child dies."""

from __future__ import annotations

import onnx_ir as ir
import pytest

import fusectl
from fusectl.core.plugins import load_builtin_passes
from fusectl.rewrite import runtime
from tests.pass_helpers import fixture_path


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


@pytest.mark.parametrize(
    "name", ["bert_tiny_ts17", "gpt2_tiny_past_dynamo", "llama_tiny_dynamo", "fp16_llama_tiny_ts17"]
)
def test_fused_contrib_ops_keep_their_schemas_type_constraints(name: str) -> None:
    """What the passes emit (Attention, SkipLayerNormalization, GroupQueryAttention in float32
    on promoted float16 operands, ...) binds each type parameter once, to a type it allows."""
    result = fusectl.optimize(fixture_path(name))
    assert any(node.domain == "com.microsoft" for node in result.model.graph)
    assert runtime.type_conflict(result.model) is None


def test_a_type_parameter_bound_twice_is_a_conflict() -> None:
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([2, 4]))
    half = ir.val("half", ir.DataType.FLOAT16, ir.Shape([2, 4]))
    gelu = ir.node("BiasGelu", [x, half], domain="com.microsoft", name="gelu")
    gelu.outputs[0].dtype = ir.DataType.FLOAT
    graph = ir.Graph(
        [x, half], gelu.outputs, nodes=[gelu], opset_imports={"": 17, "com.microsoft": 1}
    )
    found = runtime.type_conflict(ir.Model(graph, ir_version=8))
    assert found == "BiasGelu node 'gelu': T is tensor(float) for A and tensor(float16) for B"
    half.dtype = ir.DataType.INT64
    found = runtime.type_conflict(ir.Model(graph, ir_version=8))
    assert found == "BiasGelu node 'gelu': B is tensor(int64), which T does not allow"
