"""MatMulBiasAddFusionPass: exporter fixtures, near misses built with onnx.helper."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import assert_same_outputs, optimize
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

THREE_D = "MatMul input A is 3-D; Gemm needs 2-D"


MLP_EXPECTED = {
    # The TorchScript exporter writes no value_info: fusectl infers the missing ranks.
    "mlp_torchscript": (5, 4, {THREE_D: 1}, {"MatMul": 1, "Add": 1, "Gemm": 3, "FusedGemm": 2}),
    "mlp_dynamo": (5, 4, {THREE_D: 1}, {"MatMul": 1, "Add": 1, "Gemm": 3, "FusedGemm": 2}),
}


@pytest.mark.parametrize("name", sorted(MLP_EXPECTED))
def test_exported_mlp(name: str, tmp_path: Path) -> None:
    matched, effected, near_misses, ops = MLP_EXPECTED[name]
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(MM) == (matched, effected)
    assert reasons(run, MM) == near_misses
    assert run.op_counts() == Counter(ops)


def test_exported_mlp_torchscript_after_shape_inference(tmp_path: Path) -> None:
    """Shapes recorded in the file or inferred by fusectl give the same fusions."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(fixture_path("mlp_torchscript"))))
    inferred = tmp_path / "mlp_torchscript_inferred.onnx"
    onnx.save(model, str(inferred))
    run = optimize_checked(inferred, tmp_path)
    assert run.counts(MM) == (5, 4)
    assert reasons(run, MM) == {THREE_D: 1}
    assert run.op_counts() == Counter({"MatMul": 1, "Add": 1, "Gemm": 3, "FusedGemm": 2})


def test_exported_mlp_fusion_result_and_alias(tmp_path: Path) -> None:
    run = optimize(fixture_path("mlp_dynamo"), tmp_path)
    assert run.fusion_result == {
        "session_and_graph_id_0_0": {
            "graph_fusion": {MM: {"effect_times": "4", "match_times": "5"}},
            # Two of the new Gemms feed a Relu: the UB pass fuses them into FusedGemm.
            "ub_fusion": {
                "GemmActivationFusionPass": {
                    "effect_times": "2",
                    "match_times": "2",
                    "repository_hit_times": "0",
                }
            },
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
}


@pytest.mark.parametrize("case", sorted(MM_FIRES))
def test_matmul_bias_add_fires(case: str, tmp_path: Path) -> None:
    model = _matmul_add_model(tmp_path / f"mm_{case}.onnx", **MM_FIRES[case])
    run = optimize_checked(model, tmp_path)
    assert run.counts(MM) == (1, 1)
    assert reasons(run, MM) == {}
    assert run.op_counts() == Counter({"Gemm": 1})
    gemm = onnx.load(str(run.output)).graph.node[0]
    assert list(gemm.input) == ["a", "w", "bias"]


@pytest.mark.parametrize(
    "elem", [onnx.TensorProto.INT32, onnx.TensorProto.INT64], ids=["int32", "int64"]
)
def test_matmul_bias_add_without_an_onnxruntime_kernel_stays_runnable(
    elem: int, tmp_path: Path
) -> None:
    """onnxruntime's CPU Gemm takes float and double only (float16 in float32, below); integer
    types keep MatMul + Add."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem).type
    model = _matmul_add_model(
        tmp_path / "mm_int.onnx",
        np.arange(N, dtype=dtype),
        w=np.arange(12, dtype=dtype).reshape(3, N),
        elem=elem,
    )
    run = optimize(model, tmp_path)  # --target ort is the default
    assert run.counts(MM) == (1, 0)
    assert reasons(run, MM) == {
        f"onnxruntime has no Gemm kernel for {onnx.TensorProto.DataType.Name(elem)}": 1
    }
    assert_same_outputs(model, run.output)
    # Standard ONNX allows an integer Gemm, so a model for other runtimes still fuses.
    portable = optimize(model, tmp_path, "--target", "onnx")
    assert portable.counts(MM) == (1, 1)
    onnx.checker.check_model(str(portable.output), full_check=True)


def test_matmul_bias_add_in_float16_runs_as_a_float32_gemm(tmp_path: Path) -> None:
    """onnxruntime's CPU provider has no float16 Gemm and runs one in float32, casting around
    it (its InsertCastTransformer), as it runs the float16 MatMul it replaces: fused."""
    half = np.float16
    w = (np.arange(12, dtype=half).reshape(3, N) / 8).astype(half)
    model = _matmul_add_model(
        tmp_path / "mm_fp16.onnx", np.arange(N, dtype=half), w=w, elem=onnx.TensorProto.FLOAT16
    )
    run = optimize(model, tmp_path)
    assert run.counts(MM) == (1, 1)
    assert run.op_counts() == Counter({"Gemm": 1})
    onnx.checker.check_model(str(run.output), full_check=True)
    assert_same_outputs(model, run.output, atol=1e-2)


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
        "MatMul input A is 3-D; Gemm needs 2-D",
    ),
    "b_3d": (
        {
            "bias": np.arange(N, dtype=np.float32),
            "w": RNG.normal(size=(5, 3, N)).astype(np.float32),
            "y_shape": (5, 2, N),
        },
        "MatMul input B is 3-D; Gemm needs 2-D",
    ),
    "a_1d": (
        {"bias": np.arange(N, dtype=np.float32), "a_shape": (3,)},
        "MatMul input A is 1-D; Gemm needs 2-D",
    ),
    "bias_mn": (
        {"bias": np.ones((2, N), np.float32)},
        "bias does not broadcast along the output's last axis only",
    ),
    "bias_3d": (
        {"bias": np.ones((1, 1, N), np.float32), "y_shape": (1, 2, N)},
        "bias has more than 2 axes",
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
        "an intermediate value (MatMul output) is also used by Relu outside the match",
    ),
    "matmul_output_is_graph_output": (
        {"bias": np.arange(N, dtype=np.float32), "extra_outputs": (value("mm", [2, N]),)},
        "an intermediate value (MatMul output) is a graph output",
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


def test_matmul_bias_add_declines_when_the_rank_cannot_be_known(tmp_path: Path) -> None:
    """A reshaped by a runtime shape of unknown length: not even inference can tell its rank."""
    model = save_model(
        tmp_path / "mm_rank_unknown.onnx",
        [
            helper.make_node("Reshape", ["a", "s"], ["h"], name="reshape"),
            helper.make_node("MatMul", ["h", "w"], ["mm"], name="matmul"),
            helper.make_node("Add", ["mm", "bias"], ["y"], name="add"),
        ],
        [value("a", [6]), value("s", ["k"], onnx.TensorProto.INT64)],
        [value("y", [2, N])],
        [const("w", W), const("bias", np.arange(N, dtype=np.float32))],
    )
    run = optimize(model, tmp_path)
    onnx.checker.check_model(str(run.output), full_check=True)
    assert_declined(run, MM, "rank of MatMul input A is unknown", "add")
