"""Reading what the installed onnxruntime can run: the kernel registry in-process, from a child
process (where provider libraries exist, one of which may take the process down), and the
operator-schema stand-in when the child dies."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplemented_

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
    ("op", "domain", "dtype", "runs"),
    [
        ("MultiHeadAttention", "com.microsoft", ir.DataType.FLOAT, True),
        # a float32 kernel on the CPU only: onnxruntime casts around it
        ("MultiHeadAttention", "com.microsoft", ir.DataType.FLOAT16, True),
        ("Gemm", "", ir.DataType.FLOAT16, True),
        # no bfloat16 cast on the CPU, and no kernel of that type anywhere
        ("MultiHeadAttention", "com.microsoft", ir.DataType.BFLOAT16, False),
        ("Gemm", "", ir.DataType.BFLOAT16, False),
        ("Gemm", "", ir.DataType.INT64, False),
    ],
)
def test_what_the_cpu_provider_runs(op: str, domain: str, dtype: ir.DataType, runs: bool) -> None:
    assert runtime.has_kernel(op, domain, 17, dtype) is runs


def test_the_float16_cast_is_the_cpu_providers_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another provider's float32 kernel runs no float16 node: onnxruntime casts only for the
    CPU provider (a CUDA float32 kernel is not one the CPU provider could run)."""
    elsewhere = runtime.Kernel("CUDAExecutionProvider", 1, 1, frozenset({"tensor(float)"}))
    monkeypatch.setitem(runtime._registry(), ("com.microsoft", "NoSuchFusedOp"), (elsewhere,))
    assert runtime.has_kernel("NoSuchFusedOp", "com.microsoft", 17, ir.DataType.FLOAT)
    assert not runtime.has_kernel("NoSuchFusedOp", "com.microsoft", 17, ir.DataType.FLOAT16)


@pytest.mark.parametrize("elem", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_onnxruntime_runs_what_the_check_lets_through(elem: int) -> None:
    """A float16 MultiHeadAttention loads and runs on the CPU provider, a bfloat16 one does not
    load: as has_kernel says."""
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], num_heads=2)
    node.domain = "com.microsoft"
    graph = helper.make_graph(
        [node],
        "mha",
        [helper.make_tensor_value_info(n, elem, [1, 4, 8]) for n in "qkv"],
        [helper.make_tensor_value_info("y", elem, [1, 4, 8])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    text = helper.make_model(graph, opset_imports=opsets).SerializeToString()
    dtype = ir.DataType(elem)
    if not runtime.has_kernel("MultiHeadAttention", "com.microsoft", 17, dtype):
        with pytest.raises(NotImplemented_, match="Could not find an implementation"):
            ort.InferenceSession(text, providers=["CPUExecutionProvider"])
        return
    session = ort.InferenceSession(text, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {n: np.ones((1, 4, 8), np.float16) for n in "qkv"})
    assert out.dtype == np.float16 and np.allclose(out, 1)


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
