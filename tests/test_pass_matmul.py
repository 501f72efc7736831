"""MatMulBiasAddFusionPass: exporter fixtures, near misses built with onnx.helper."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented

from tests.conftest import assert_same_outputs, optimize, run_model
from tests.pass_helpers import (
    assert_declined,
    const,
    fixture_path,
    optimize_checked,
    plain_input_not_constant,
    reasons,
    save_model,
    value,
)

MM = "MatMulBiasAddFusionPass"

# ---------------------------------------------------------------------------------------------
# Real exporter output (tests/fixtures/make_fixtures.py): mlp = four 2-D matmul + bias (one
# written bias-first), a 2-D Linear (both exporters emit Gemm for it) and one 3-D matmul + bias.
# ---------------------------------------------------------------------------------------------

THREE_D = "MatMul input A 't' is 3-D; Gemm needs 2-D"


def _rank_unknown(name: str) -> str:
    return f"rank of MatMul input A '{name}' is unknown"


MLP_EXPECTED = {
    # The TorchScript exporter writes no value_info and fusectl runs no shape inference, so
    # only the MatMul fed straight by the graph input x has a known rank.
    "mlp_torchscript": (
        5,
        1,
        {
            _rank_unknown("/Relu_output_0"): 1,
            _rank_unknown("/Relu_1_output_0"): 1,
            _rank_unknown("/Add_2_output_0"): 1,
            THREE_D: 1,
        },
        {"MatMul": 4, "Add": 4, "Gemm": 2, "Relu": 2},
    ),
    "mlp_dynamo": (5, 4, {THREE_D: 1}, {"MatMul": 1, "Add": 1, "Gemm": 5, "Relu": 2}),
}


@pytest.mark.parametrize("name", sorted(MLP_EXPECTED))
def test_exported_mlp(name: str, tmp_path: Path) -> None:
    matched, effected, near_misses, ops = MLP_EXPECTED[name]
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(MM) == (matched, effected)
    assert reasons(run, MM) == near_misses
    assert run.op_counts() == Counter(ops)


def test_exported_mlp_torchscript_after_shape_inference(tmp_path: Path) -> None:
    """With shapes inferred beforehand, the TorchScript export fuses like the dynamo one."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(fixture_path("mlp_torchscript"))))
    inferred = tmp_path / "mlp_torchscript_inferred.onnx"
    onnx.save(model, str(inferred))
    run = optimize_checked(inferred, tmp_path)
    assert run.counts(MM) == (5, 4)
    assert reasons(run, MM) == {THREE_D: 1}
    assert run.op_counts() == Counter({"MatMul": 1, "Add": 1, "Gemm": 5, "Relu": 2})


def test_exported_mlp_fusion_result_and_alias(tmp_path: Path) -> None:
    run = optimize(fixture_path("mlp_dynamo"), tmp_path)
    assert run.fusion_result == {
        "session_and_graph_id_0_0": {
            "graph_fusion": {MM: {"effect_times": "4", "match_times": "5"}}
        }
    }
    off = optimize(
        fixture_path("mlp_dynamo"), tmp_path, "--disable_pass", "matmul_elem_biasadd_fusion"
    )
    assert off.counts(MM) == (0, 0)
    assert off.op_counts()["MatMul"] == 5


# ---------------------------------------------------------------------------------------------
# MatMul + Add built with onnx.helper: a [2,3] x [3,4] MatMul, then Add with a bias.
# ---------------------------------------------------------------------------------------------

RNG = np.random.default_rng(3)
W = RNG.normal(size=(3, 4)).astype(np.float32)
N = 4


def _matmul_add_model(
    path: Path,
    bias: np.ndarray | None = None,
    *,
    a_shape: tuple[int, ...] = (2, 3),
    w: np.ndarray = W,
    bias_first: bool = False,
    y_shape: tuple[int, ...] | None = None,
    extra_nodes: tuple = (),
    extra_inputs: tuple = (),
    extra_outputs: tuple = (),
    a_producer: bool = False,
    opset: int = 17,
    elem: int = onnx.TensorProto.FLOAT,
) -> Path:
    """a [-> Relu, no value_info] -> MatMul(w) -> mm -> Add(bias) -> y."""
    nodes = []
    a = "a"
    if a_producer:
        nodes.append(helper.make_node("Relu", ["a"], ["h"], name="relu_in"))
        a = "h"
    nodes.append(helper.make_node("MatMul", [a, "w"], ["mm"], name="matmul"))
    add_inputs = ["bias", "mm"] if bias_first else ["mm", "bias"]
    nodes.append(helper.make_node("Add", add_inputs, ["y"], name="add"))
    nodes.extend(extra_nodes)
    dtype = w.dtype.type
    initializers = [const("w", w, dtype)]
    if bias is not None:
        initializers.append(const("bias", bias, dtype))
    out_shape = y_shape or (*a_shape[:-1], w.shape[-1])
    return save_model(
        path,
        nodes,
        [value("a", list(a_shape), elem), *extra_inputs],
        [value("y", list(out_shape), elem), *extra_outputs],
        initializers,
        opset=opset,
    )


MM_FIRES = {
    "bias_n": {"bias": np.arange(N, dtype=np.float32)},
    "bias_first": {"bias": np.arange(N, dtype=np.float32), "bias_first": True},
    "bias_1n": {"bias": np.arange(N, dtype=np.float32).reshape(1, N)},
    "bias_scalar": {"bias": np.array(0.5, np.float32)},
    "bias_one": {"bias": np.array([0.5], np.float32)},
    "double": {"bias": np.arange(N, dtype=np.float64), "w": W.astype(np.float64), "elem": 11},
    "float16": {"bias": np.arange(N, dtype=np.float16), "w": W.astype(np.float16), "elem": 10},
}


@pytest.mark.parametrize("case", sorted(MM_FIRES))
def test_matmul_bias_add_fires(case: str, tmp_path: Path) -> None:
    model = _matmul_add_model(tmp_path / f"mm_{case}.onnx", **MM_FIRES[case])
    # conftest.random_feeds feeds float32 to double inputs, so that case brings its own feeds.
    run = optimize_checked(
        model, tmp_path, compare=case != "double", atol=1e-2 if case == "float16" else 1e-4
    )
    if case == "double":
        feeds = {"a": np.random.default_rng(0).normal(size=(2, 3))}
        np.testing.assert_allclose(
            run_model(run.output, feeds)[0], run_model(model, feeds)[0], rtol=1e-12
        )
    assert run.counts(MM) == (1, 1)
    assert reasons(run, MM) == {}
    assert run.op_counts() == Counter({"Gemm": 1})
    gemm = onnx.load(str(run.output)).graph.node[0]
    assert list(gemm.input) == ["a", "w", "bias"]


@pytest.mark.xfail(
    strict=True,
    raises=OrtNotImplemented,
    reason="fusectl bug: integer MatMul+Add becomes a Gemm onnxruntime has no kernel for",
)
@pytest.mark.parametrize(
    "elem", [onnx.TensorProto.INT32, onnx.TensorProto.INT64], ids=["int32", "int64"]
)
def test_matmul_bias_add_integer_stays_runnable(elem: int, tmp_path: Path) -> None:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem).type
    model = _matmul_add_model(
        tmp_path / "mm_int.onnx",
        np.arange(N, dtype=dtype),
        w=np.arange(12, dtype=dtype).reshape(3, N),
        elem=elem,
    )
    run = optimize(model, tmp_path)  # --target ort is the default
    assert_same_outputs(model, run.output)


MM_DECLINES = {
    "bias_graph_input": (
        {"extra_inputs": (value("bias", [N]),)},
        plain_input_not_constant("bias"),
    ),
    "bias_overridable": (
        {"bias": np.arange(N, dtype=np.float32), "extra_inputs": (value("bias", [N]),)},
        "bias is a graph input (an overridable initializer), not a constant",
    ),
    "a_3d": (
        {"bias": np.arange(N, dtype=np.float32), "a_shape": (5, 2, 3)},
        "MatMul input A 'a' is 3-D; Gemm needs 2-D",
    ),
    "b_3d": (
        {
            "bias": np.arange(N, dtype=np.float32),
            "w": RNG.normal(size=(5, 3, N)).astype(np.float32),
            "y_shape": (5, 2, N),
        },
        "MatMul input B 'w' is 3-D; Gemm needs 2-D",
    ),
    "a_1d": (
        {"bias": np.arange(N, dtype=np.float32), "a_shape": (3,)},
        "MatMul input A 'a' is 1-D; Gemm needs 2-D",
    ),
    "a_rank_unknown": (
        {"bias": np.arange(N, dtype=np.float32), "a_producer": True},
        "rank of MatMul input A 'h' is unknown",
    ),
    "bias_mn": (
        {"bias": np.ones((2, N), np.float32)},
        "bias of shape [2, 4] does not broadcast along N=4",
    ),
    "bias_3d": (
        {"bias": np.ones((1, 1, N), np.float32), "y_shape": (1, 2, N)},
        "bias of shape [1, 1, 4] has more than 2 axes",
    ),
    # Add-6 does not broadcast without broadcast=1, so the bias has the full output shape.
    # onnxruntime has no Add-6 kernel, so this one is only checked, not run.
    "opset_6": (
        {"bias": np.ones((2, N), np.float32), "opset": 6, "ort": False},
        "Gemm needs opset >= 7, model has 6",
    ),
    "matmul_output_shared": (
        {
            "bias": np.arange(N, dtype=np.float32),
            "extra_nodes": (helper.make_node("Relu", ["mm"], ["r"], name="relu"),),
            "extra_outputs": (value("r", [2, N]),),
        },
        "intermediate 'mm' is also used by Relu 'relu'",
    ),
    "matmul_output_is_graph_output": (
        {"bias": np.arange(N, dtype=np.float32), "extra_outputs": (value("mm", [2, N]),)},
        "intermediate 'mm' is a graph output",
    ),
}


@pytest.mark.parametrize("case", sorted(MM_DECLINES))
def test_matmul_bias_add_declines(case: str, tmp_path: Path) -> None:
    kwargs, reason = MM_DECLINES[case]
    runnable = kwargs.pop("ort", True)
    model = _matmul_add_model(tmp_path / f"mm_{case}.onnx", **kwargs)
    run = optimize_checked(model, tmp_path, compare=runnable)
    assert_declined(run, MM, reason, "add")
    ops = run.op_counts()
    assert (ops["MatMul"], ops["Add"], ops["Gemm"]) == (1, 1, 0)
    assert run.fusion_result == {
        "session_and_graph_id_0_0": {
            "graph_fusion": {MM: {"effect_times": "0", "match_times": "1"}}
        }
    }
