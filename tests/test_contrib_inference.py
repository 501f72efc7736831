"""Shape inference through onnxruntime's contrib ops (fusectl.rewrite.contrib_inference).

Each contrib op the rules cover is inferred on a small model and compared with the output
shapes onnxruntime computes when it runs the model; a 4-bit quantized LLaMA and BERT
(``nbits_*``, tests/fixtures/make_transformer_fixtures.py) fuse as their float originals do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.defs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusectl
from fusectl.rewrite import shapes
from fusectl.rewrite.contrib_inference import contrib_schemas
from tests.conftest import assert_same_outputs, optimize
from tests.pass_helpers import check_output, fixture_path

MS = "com.microsoft"
F = TensorProto.FLOAT
Case = tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto], list[onnx.TensorProto]]


def _const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def _random(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).normal(size=shape).astype(np.float32)


def _text(name: str = "x", width: int = 16) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, F, ["batch", "sequence", width])


def _matmul_nbits() -> Case:
    # K = 16 in one block of 16 4-bit values (8 bytes) per output column, N = 8
    weights = np.random.default_rng(0).integers(0, 255, (8, 1, 8)).astype(np.uint8)
    node = helper.make_node(
        "MatMulNBits", ["x", "w", "scales"], ["y"], domain=MS, K=16, N=8, bits=4, block_size=16
    )
    return [node], [_text()], [_const("w", weights), _const("scales", _random(8) * 0.1)]


def _fused_conv() -> Case:
    image = helper.make_tensor_value_info("x", F, ["batch", 3, 9, 9])
    node = helper.make_node(
        "FusedConv", ["x", "w"], ["y"], domain=MS, activation="Relu", strides=[2, 2],
        pads=[1, 1, 1, 1],
    )  # fmt: skip
    return [node], [image], [_const("w", _random(4, 3, 3, 3))]


def _fused_matmul() -> Case:
    node = helper.make_node("FusedMatMul", ["x", "w"], ["y"], domain=MS, alpha=0.5)
    return [node], [_text()], [_const("w", _random(16, 5))]


def _matmul_integer_to_float() -> Case:
    a = helper.make_tensor_value_info("x", TensorProto.UINT8, ["rows", 4])
    node = helper.make_node(
        "MatMulIntegerToFloat", ["x", "w", "a_scale", "b_scale"], ["y"], domain=MS
    )
    weights = np.arange(12, dtype=np.uint8).reshape(4, 3)
    scales = [_const("a_scale", np.array(0.5, np.float32)), _const("b_scale", np.float32([0.25]))]
    return [node], [a], [_const("w", weights), *scales]


def _skip_layer_norm() -> Case:
    node = helper.make_node(
        "SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y", "", "", "sum"], domain=MS
    )
    params = [_const("gamma", _random(16)), _const("beta", _random(16))]
    return [node], [_text(), _text("skip")], params


def _simplified_layer_norm() -> Case:
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], axis=-1)
    return [node], [_text()], [_const("gamma", _random(16))]


def _elementwise(op_type: str) -> Callable[[], Case]:
    def case() -> Case:
        inputs = ["x", "bias"] if op_type in ("BiasGelu", "FastGelu") else ["x"]
        node = helper.make_node(op_type, inputs, ["y"], domain=MS)
        return [node], [_text()], [_const("bias", _random(16))] if inputs[1:] else []

    return case


def _multi_head_attention() -> Case:
    node = helper.make_node("MultiHeadAttention", ["x", "k", "v"], ["y"], domain=MS, num_heads=2)
    return [node], [_text(), _text("k"), _text("v", 8)], []


def _group_query_attention() -> Case:
    # 2 query heads, 1 key/value head of size 8; every sequence of the batch of 2 is 5 long
    node = helper.make_node(
        "GroupQueryAttention",
        ["x", "k", "v", "", "", "lengths", "total"],
        ["y", "present_key", "present_value"],
        domain=MS, num_heads=2, kv_num_heads=1,
    )  # fmt: skip
    lengths = [_const("lengths", np.int32([4, 4])), _const("total", np.array(5, np.int32))]
    return [node], [_text(), _text("k", 8), _text("v", 8)], lengths


def _packed_attention() -> Case:
    node = helper.make_node("Attention", ["x", "w", "b"], ["y"], domain=MS, num_heads=2)
    return [node], [_text()], [_const("w", _random(16, 48)), _const("b", _random(48))]


def _embed_layer_norm() -> Case:
    ids = helper.make_tensor_value_info("ids", TensorProto.INT32, ["batch", "sequence"])
    node = helper.make_node(
        "EmbedLayerNormalization",
        ["ids", "", "words", "positions", "", "gamma", "beta"],
        ["y", "mask_index"],
        domain=MS,
    )
    tables = [_const("words", _random(10, 16)), _const("positions", _random(32, 16))]
    return [node], [ids], [*tables, _const("gamma", _random(16)), _const("beta", _random(16))]


CASES: dict[str, Callable[[], Case]] = {
    "MatMulNBits": _matmul_nbits,
    "FusedConv": _fused_conv,
    "FusedMatMul": _fused_matmul,
    "MatMulIntegerToFloat": _matmul_integer_to_float,
    "SkipLayerNormalization": _skip_layer_norm,
    "SimplifiedLayerNormalization": _simplified_layer_norm,
    "FastGelu": _elementwise("FastGelu"),
    "BiasGelu": _elementwise("BiasGelu"),
    "QuickGelu": _elementwise("QuickGelu"),
    "MultiHeadAttention": _multi_head_attention,
    "GroupQueryAttention": _group_query_attention,
    "Attention": _packed_attention,
    "EmbedLayerNormalization": _embed_layer_norm,
}


# Outputs no rule covers (their shapes stay unknown): not compared.
UNCOVERED = {"present_key", "present_value"}


def _model(case: Case) -> onnx.ModelProto:
    """The case's node with every covered output read by a Relu (an op onnx infers from its
    input), the graph's outputs declared without shapes."""
    nodes, inputs, initializers = case
    outputs = [name for name in nodes[0].output if name and name not in UNCOVERED]
    readers = [helper.make_node("Relu", [name], [f"{name}_relu"]) for name in outputs]
    declared = [helper.make_empty_tensor_value_info(f"{name}_relu") for name in outputs]
    graph = helper.make_graph([*nodes, *readers], "g", inputs, declared, initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _feeds(model: onnx.ModelProto, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value or sizes[d.dim_param] for d in value.type.tensor_type.shape.dim]
        elem = value.type.tensor_type.elem_type
        if elem == F:
            feeds[value.name] = _random(*shape)
        else:  # token ids and quantized values: small integers
            feeds[value.name] = (
                (np.arange(np.prod(shape)) % 7)
                .reshape(shape)
                .astype(helper.tensor_dtype_to_np_dtype(elem))
            )
    return feeds


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_inferred_shapes_are_what_onnxruntime_computes(op_type: str, tmp_path: Path) -> None:
    model = _model(CASES[op_type]())
    domain = model.graph.node[0].domain
    assert not onnx.defs.has(op_type, domain)
    with contrib_schemas():
        assert onnx.defs.has(op_type, domain)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert not onnx.defs.has(op_type, domain)  # registered for the call only
    sizes = {"batch": 2, "sequence": 5, "rows": 3}
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [value.name for value in model.graph.output]
    results = session.run(names, _feeds(model, sizes))
    found = {value.name: value.type.tensor_type for value in inferred.graph.output}
    for name, result in zip(names, results, strict=True):
        tensor = found[name]
        assert tensor.elem_type == helper.np_dtype_to_tensor_dtype(result.dtype), name
        dims = [
            d.dim_value if d.HasField("dim_value") else sizes[d.dim_param] for d in tensor.shape.dim
        ]
        assert dims == list(result.shape), name


def test_a_transposing_fused_matmul_keeps_its_shape_unknown() -> None:
    """FusedMatMul with transB: no rule for the transposed operands, so only the type is said
    (a pass then declines for the rank, rather than trust a wrong one)."""
    nodes, inputs, initializers = _fused_matmul()
    nodes[0].attribute.append(helper.make_attribute("transB", 1))
    model = _model((nodes, inputs, initializers))
    with contrib_schemas():
        inferred = onnx.shape_inference.infer_shapes(model)
    (output,) = inferred.graph.output
    assert output.type.tensor_type.elem_type == F
    assert not output.type.tensor_type.HasField("shape")


def test_a_schema_already_registered_is_left_alone() -> None:
    """Another library's MatMulNBits schema stays, in the call and after it."""
    theirs = onnx.defs.OpSchema("MatMulNBits", MS, 1, doc="theirs")
    onnx.defs.register_schema(theirs)
    try:
        with contrib_schemas():
            assert onnx.defs.get_schema("MatMulNBits", 1, MS).doc == "theirs"
            assert onnx.defs.has("FusedMatMul", MS)
        assert onnx.defs.get_schema("MatMulNBits", 1, MS).doc == "theirs"
        assert not onnx.defs.has("FusedMatMul", MS)
    finally:
        onnx.defs.deregister_schema("MatMulNBits", 1, MS)


# 4-bit models: their MatMulNBits, and (pass, matched, effected, effected without the contrib
# schemas): what the float export fuses, and what fused when inference stopped at the first
# MatMulNBits (the GELUs need no shape; GPT-Neo's first norm is in front of every projection).
NBITS: dict[str, tuple[int, list[tuple[str, int, int, int]]]] = {
    "nbits_llama_tiny_ts17": (
        14,
        [
            ("RotaryEmbeddingFusionPass", 4, 4, 0),
            ("GroupQueryAttentionFusionPass", 2, 2, 0),
            ("AddRmsNormFusionPass", 4, 4, 0),
        ],
    ),
    "nbits_bert_tiny_ts17": (
        12,
        [
            ("MultiHeadAttentionFusionPass", 2, 2, 0),
            ("AddLayerNormFusionPass", 4, 4, 0),
            ("BiasGeluFusionPass", 2, 2, 2),
        ],
    ),
    # GPT-Neo's residuals: the leading sizes of a MatMulNBits output are its input's
    # (rewrite.axes), which proves that the residual Adds broadcast nothing
    "nbits_gpt_neo_ts17": (
        12,
        [
            ("MultiHeadAttentionFusionPass", 2, 2, 0),
            ("AddLayerNormFusionPass", 5, 5, 1),
            ("FastGeluFusionPass", 2, 2, 2),
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(NBITS))
def test_four_bit_quantized_models_fuse(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = optimize(fixture_path(name), tmp_path)
    check_output(run)
    assert_same_outputs(fixture_path(name), run.output, atol=1e-3)
    quantized, fusions = NBITS[name]
    for fusion, matched, effected, _ in fusions:
        assert run.counts(fusion) == (matched, effected), fusion
    assert run.op_counts()["MatMulNBits"] == quantized
    monkeypatch.setattr(shapes, "contrib_schemas", contextlib.nullcontext)
    (tmp_path / "off").mkdir()
    off = optimize(fixture_path(name), tmp_path / "off")
    for fusion, _, _, without in fusions:
        assert off.counts(fusion)[1] == without, fusion


def test_contrib_ops_validate_after_the_schemas_were_removed() -> None:
    """onnx keeps com.microsoft in its domain map once contrib_schemas has removed its
    schemas; a later optimize() in the same process (a pipeline, or --verify after a run that
    inferred through contrib ops) then rejected every contrib op of its input."""
    weight = numpy_helper.from_array(np.full((4, 3), 0.5, np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("FusedMatMul", ["x", "w"], ["m"], domain=MS, alpha=0.5),
            helper.make_node("Sigmoid", ["m"], ["s"]),
            helper.make_node("Mul", ["m", "s"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", F, ["b", 4])],
        [helper.make_tensor_value_info("y", F, ["b", 3])],
        [weight],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    )
    with contrib_schemas():
        pass
    result = fusectl.optimize(model, verify=True)
    assert [n.op_type for n in result.model.graph] == ["FusedMatMul", "QuickGelu"]
