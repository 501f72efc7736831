"""Builds the sample model shipped in samples/ (run: python samples/make_samples.py).

tiny_cnn.onnx is a small image classifier in the shape exporters give it: Conv+BatchNorm+Relu
stages, a Conv with a separate per-channel bias Add, a flatten done as two Reshapes, and a
classifier written as MatMul + Add. Weights are seeded, so the file is byte-for-byte stable.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).parent


def tiny_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    initializers: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name: str, array: np.ndarray) -> str:
        initializers.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def shape(name: str, dims: list[int]) -> str:
        initializers.append(numpy_helper.from_array(np.array(dims, dtype=np.int64), name))
        return name

    x = "image"
    channels = 3
    for stage, width in enumerate((8, 16)):
        p = f"stage{stage}"
        w = const(f"{p}.conv.weight", rng.normal(0, 0.3, (width, channels, 3, 3)))
        nodes.append(
            helper.make_node("Conv", [x, w], [f"{p}.conv"], name=f"{p}/Conv", pads=[1, 1, 1, 1])
        )
        bn = [
            const(f"{p}.bn.scale", rng.uniform(0.5, 1.5, width)),
            const(f"{p}.bn.bias", rng.normal(0, 0.1, width)),
            const(f"{p}.bn.mean", rng.normal(0, 0.1, width)),
            const(f"{p}.bn.var", rng.uniform(0.5, 1.5, width)),
        ]
        nodes.append(
            helper.make_node(
                "BatchNormalization",
                [f"{p}.conv", *bn],
                [f"{p}.bn"],
                name=f"{p}/BatchNormalization",
                epsilon=1e-5,
            )
        )
        nodes.append(helper.make_node("Relu", [f"{p}.bn"], [f"{p}.relu"], name=f"{p}/Relu"))
        x, channels = f"{p}.relu", width
    w = const("head.conv.weight", rng.normal(0, 0.3, (4, channels, 1, 1)))
    b = const("head.bias", rng.normal(0, 0.1, (4, 1, 1)))
    nodes.append(helper.make_node("Conv", [x, w], ["head.conv"], name="head/Conv"))
    nodes.append(helper.make_node("Add", ["head.conv", b], ["head.biased"], name="head/Add"))
    nodes.append(
        helper.make_node(
            "Reshape", ["head.biased", shape("s1", [1, 4, 64])], ["flat1"], name="flatten/Reshape"
        )
    )
    nodes.append(
        helper.make_node(
            "Reshape", ["flat1", shape("s2", [1, 256])], ["flat2"], name="flatten/Reshape_1"
        )
    )
    fc_w = const("fc.weight", rng.normal(0, 0.1, (256, 10)))
    fc_b = const("fc.bias", rng.normal(0, 0.1, (10,)))
    nodes.append(helper.make_node("MatMul", ["flat2", fc_w], ["fc.mm"], name="fc/MatMul"))
    nodes.append(helper.make_node("Add", ["fc.mm", fc_b], ["logits"], name="fc/Add"))
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="fusectl-samples"
    )
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> None:
    models = HERE / "models"
    models.mkdir(exist_ok=True)
    onnx.save(tiny_cnn(), str(models / "tiny_cnn.onnx"))
    print(f"wrote {models / 'tiny_cnn.onnx'}")


if __name__ == "__main__":
    main()
