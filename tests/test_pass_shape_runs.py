"""ShapeRunCanonicalizationPass: x's sizes taken apart and joined in order are Shape(x),
TorchScript's expand test of sizes against -1 is the sizes (also when a Reshape to [-1] flattens
them first: repeat_kv on a KV cache), an Expand to the data's own shape is the data. Real
exports (RoBERTa's token types, DeepSeek-V3's expands, cached Qwen2 and LLaMA), the Concats it must
leave (sizes out of order, of two tensors, a part of the shape before opset 15) and numerics
on onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import named_dim_feeds
from tests.pass_helpers import (
    ARCH_FIXTURES,
    compare_on_feeds,
    const,
    optimize_checked,
    pattern_counts,
    save_model,
    value,
)

SHAPES = "ShapeRunCanonicalizationPass"


@pytest.mark.parametrize(
    ("model", "effects"),
    [
        # torch.zeros(input_ids.size()) token types; the expand of the buffered token types,
        # whose sizes a Reshape to [-1] flattens before the -1 test
        ("roberta_ts17", {"ShapeRun": (1, 1), "ExpandSizes": (1, 1)}),
        ("deepseek_v3_ts17", {"ShapeRun": (3, 3), "ExpandSizes": (16, 16)}),  # expand(sizes)
        # repeat_kv on a KV cache, its sizes flattened likewise
        ("qwen2_past_ts17", {"ExpandSizes": (4, 4)}),
        ("llama_past_positions_ts17", {"ExpandSizes": (4, 4)}),
    ],
)
def test_fires_on_torchscript_exports(tmp_path: Path, model: str, effects: dict) -> None:
    source = ARCH_FIXTURES / f"{model}.onnx"
    run = optimize_checked(source, tmp_path, compare=False)
    assert pattern_counts(run, SHAPES) == effects
    dims = json.loads((ARCH_FIXTURES / "manifest.json").read_text())["dims"]
    compare_on_feeds(source, run.output, named_dim_feeds(source, dims))


def _sizes_model(path: Path, order: list[tuple[str, int]], opset: int = 17) -> Path:
    """target = Where(Equal(s, -1), 1, s), s = Concat of Unsqueeze(Gather(Shape(v), i)) for
    (v, i) in ``order`` (x and w [B, S, 4]); for x's sizes in order also y = Expand(x,
    target) * w (the Expand of x to its own shape)."""
    nodes = [helper.make_node("Shape", [name], [f"{name}_shape"]) for name in ("x", "w")]
    parts = []
    for k, (source, axis) in enumerate(order):
        nodes += [
            helper.make_node("Gather", [f"{source}_shape", f"i{axis}"], [f"g{k}"], axis=0),
            helper.make_node("Unsqueeze", [f"g{k}", "zero_axis"], [f"u{k}"]),
        ]
        parts.append(f"u{k}")
    nodes += [
        helper.make_node("Concat", parts, ["sizes"], axis=0),
        helper.make_node("Equal", ["sizes", "minus_one"], ["keep"]),
        helper.make_node("Where", ["keep", "one", "sizes"], ["target"]),
    ]
    outputs = [value("target", [len(order)], TensorProto.INT64)]
    if order == [("x", 0), ("x", 1), ("x", 2)]:
        nodes += [
            helper.make_node("Expand", ["x", "target"], ["expanded"]),
            helper.make_node("Mul", ["expanded", "w"], ["y"]),
        ]
        outputs.append(value("y", ["B", "S", 4]))
    initializers = [const(f"i{axis}", axis, np.int64) for axis in range(3)]
    initializers += [const("zero_axis", [0], np.int64), const("minus_one", -1, np.int64)]
    initializers.append(const("one", 1, np.int64))
    inputs = [value("x", ["B", "S", 4]), value("w", ["B", "S", 4])]
    return save_model(path, nodes, inputs, outputs, initializers, opset=opset)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.normal(size=(2, 3, 4)).astype(np.float32) for name in ("x", "w")}


def test_sizes_in_order_become_the_shape_and_the_expand_goes(tmp_path: Path) -> None:
    model = _sizes_model(tmp_path / "ordered.onnx", [("x", 0), ("x", 1), ("x", 2)])
    run = optimize_checked(model, tmp_path, compare=False)
    effects = pattern_counts(run, SHAPES)
    assert effects == {"ShapeRun": (1, 1), "ExpandSizes": (1, 1), "ExpandToOwnShape": (1, 1)}
    ops = run.op_counts()
    assert ops["Expand"] == ops["Where"] == ops["Gather"] == ops["Concat"] == 0
    assert ops["Shape"] == 1  # the target, a graph output
    compare_on_feeds(model, run.output, _feeds())


@pytest.mark.parametrize(
    ("order", "opset"),
    [
        ([("x", 1), ("x", 0), ("x", 2)], 17),  # out of order
        ([("x", 0), ("w", 1), ("x", 2)], 17),  # sizes of two tensors
        ([("x", 0), ("x", 1)], 14),  # a part of the shape: Shape's start/end are opset 15's
    ],
)
def test_other_concats_of_sizes_stay(tmp_path: Path, order: list, opset: int) -> None:
    """No Shape reads them, but the -1 test of sizes still goes: sizes are never -1."""
    model = _sizes_model(tmp_path / "other.onnx", order, opset)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, SHAPES) == {"ExpandSizes": (1, 1)}
    assert run.op_counts()["Concat"] == 1 and run.op_counts()["Where"] == 0
    compare_on_feeds(model, run.output, _feeds())


def test_a_test_against_another_value_stays(tmp_path: Path) -> None:
    """Where(Equal(s, 2), 1, s): a size may be 2, so the test is kept."""
    model = _sizes_model(tmp_path / "two.onnx", [("x", 0), ("x", 1), ("x", 2)])
    proto = onnx.load(str(model))
    (minus_one,) = [t for t in proto.graph.initializer if t.name == "minus_one"]
    minus_one.CopyFrom(helper.make_tensor("minus_one", TensorProto.INT64, [], [2]))
    onnx.save(proto, str(model))
    run = optimize_checked(model, tmp_path, compare=False)
    assert "ExpandSizes" not in pattern_counts(run, SHAPES)
    assert run.op_counts()["Where"] == 1
    compare_on_feeds(model, run.output, _feeds())
