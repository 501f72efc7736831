"""ChannelAffineConvFusionPass: a per-channel affine map (inference BatchNormalization, Mul / Div /
Add / Sub by per-channel constants) folded into the Convs that read it
(tests/fixtures/make_fixtures.py's channel_affine_conv: an input normalization before a stem,
MaxViT's pre-norm BatchNorm before a 1x1 Conv and a grouped one, a layer scale before a padded
Conv, a GELU before a 1x1 Conv, a BatchNorm before a padded Conv and one the residual reads)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import FIXTURES
from tests.pass_helpers import (
    assert_declined,
    const,
    conv_batchnorm_params,
    optimize_checked,
    reasons,
    save_model,
    value,
)

PASS = "ChannelAffineConvFusionPass"
PADDED = (
    "the map shifts and the Conv pads its input: the padded border is zeros after the map, "
    "and would be the shift folded into the bias"
)


@pytest.mark.parametrize(
    ("exporter", "residual", "folded_sites"),
    [
        (
            "ts17",
            "/Add_2",
            [
                ["/stem/Conv", "/Div", "/Sub"],
                ["/expand/Conv", "/pre_norm/BatchNormalization"],
                ["/grouped/Conv", "/Relu_2", "/grouped_norm/BatchNormalization"],
                ["/spatial/Conv", "/Relu_3", "/Mul_2"],
            ],
        ),
        (
            "dynamo",
            "node_add_106",
            [
                ["node_conv2d", "node_div", "node_sub"],
                ["node_conv2d_1", "node__native_batch_norm_legit_no_training__0"],
                [
                    "node_conv2d_3",
                    "node_relu_2",
                    "node__native_batch_norm_legit_no_training_1__0",
                ],
                ["node_conv2d_4", "node_relu_3", "node_mul_32"],
            ],
        ),
    ],
)
def test_folds_on_both_exporters(
    tmp_path: Path, exporter: str, residual: str, folded_sites: list[list[str]]
) -> None:
    run = optimize_checked(FIXTURES / f"channel_affine_conv_{exporter}.onnx", tmp_path)
    assert run.counts(PASS) == (6, 4)
    sites = [site["original_nodes"] for site in run.passed(PASS)["sites"]]
    assert sites == folded_sites  # the grouped and spatial Convs carry their FusedConv's Relu
    assert reasons(run, PASS) == {
        f"the mapped input is also read by Add {residual!r}": 1,
        PADDED: 1,
    }
    ops = run.op_counts()
    # Normalization, pre-norms and layer scale gone; the two near misses' norms stay; the
    # GELU keeps its own `* 0.5` (the pass runs after the GELU fusion).
    assert ops["BatchNormalization"] == 2
    assert ops["Sub"] == ops["Div"] == ops["Mul"] == 0
    assert ops["Gelu"] == 1
    assert ops["Conv"] + ops["FusedConv"] == 7


def _affine_conv(
    path: Path,
    steps: list[tuple[str, np.ndarray | None, bool]],
    *,
    pads: tuple[int, ...] = (0, 0, 0, 0),
    kernel: int = 1,
    groups: int = 1,
    auto_pad: str | None = None,
    weight_fed: bool = False,
    readers: int = 1,
    dtype: type = np.float32,
) -> Path:
    """x [2, 4, 6, 6] -> steps (op, constant or None for BatchNormalization, constant first)
    -> ``readers`` Convs of 6 output channels."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits, current = [], [], "x"
    for index, (op, constant, constant_first) in enumerate(steps):
        out = f"s{index}"
        if op == "BatchNormalization":
            params = conv_batchnorm_params(4, prefix=f"bn{index}", seed=index)
            inits += [const(p.name, onnx.numpy_helper.to_array(p), dtype) for p in params]
            inputs = [current, *(p.name for p in params)]
        else:
            inits.append(const(f"c{index}", constant, dtype))
            inputs = [f"c{index}", current] if constant_first else [current, f"c{index}"]
        nodes.append(helper.make_node(op, inputs, [out], name=f"{op.lower()}{index}"))
        current = out
    weight = rng.normal(size=(6, 4 // groups, kernel, kernel))
    inputs = [value("x", [2, 4, 6, 6], elem)]
    if weight_fed:
        inputs.append(value("w", list(weight.shape), elem))
    else:
        inits.append(const("w", weight, dtype))
    inits.append(const("b", rng.normal(size=6), dtype))
    attributes: dict = {"kernel_shape": [kernel, kernel], "group": groups}
    attributes.update({"auto_pad": auto_pad} if auto_pad else {"pads": list(pads)})
    outputs = []
    for index in range(readers):
        name = f"conv{index}"
        nodes.append(helper.make_node("Conv", [current, "w", "b"], [name], name=name, **attributes))
        outputs.append(value(name, [2, 6, "h", "w"], elem))
    return save_model(path, nodes, inputs, outputs, inits)


BATCHNORM = ("BatchNormalization", None, False)
SCALE = np.array([0.5, 2.0, -1.5, 3.0]).reshape(4, 1, 1)
SHIFT = np.array([0.1, -0.2, 0.3, 0.4]).reshape(1, 4, 1, 1)


@pytest.mark.parametrize(
    ("steps", "options", "left"),
    [
        # A chain of every step kind into a grouped Conv read by two Convs.
        (
            [BATCHNORM, ("Mul", SCALE, True), ("Sub", SHIFT, True), ("Div", SCALE, False)],
            {"groups": 2, "readers": 2},
            {"Conv": 2},
        ),
        # The shift cannot cross the padding: the Div nearest the Conv folds, the Sub stays.
        (
            [("Sub", SHIFT, False), ("Div", SCALE, False)],
            {"pads": (1, 1, 1, 1), "kernel": 3},
            {"Sub": 1, "Conv": 1},
        ),
        # A scalar scale (x / 255) before a padded 3x3 Conv.
        ([("Div", np.array(255.0), False)], {"pads": (1, 1, 1, 1), "kernel": 3}, {"Conv": 1}),
        # float16 weights and map.
        ([BATCHNORM], {"dtype": np.float16}, {"Conv": 1}),
    ],
)
def test_folds(tmp_path: Path, steps: list, options: dict, left: dict[str, int]) -> None:
    model = _affine_conv(tmp_path / "affine.onnx", steps, **options)
    atol = 2e-2 if options.get("dtype") is np.float16 else 1e-4
    run = optimize_checked(model, tmp_path, atol=atol)
    assert run.counts(PASS) == (1, 1)
    assert run.op_counts() == Counter(left)


@pytest.mark.parametrize(
    ("steps", "options", "reason"),
    [
        ([BATCHNORM], {"pads": (0, 1, 0, 1), "kernel": 3}, PADDED),
        ([("Add", SHIFT, False)], {"auto_pad": "SAME_UPPER", "kernel": 3}, PADDED),
        (
            [BATCHNORM],
            {"weight_fed": True},
            "the Conv's weight is not a floating-point constant",
        ),
    ],
)
def test_near_misses(tmp_path: Path, steps: list, options: dict, reason: str) -> None:
    run = optimize_checked(_affine_conv(tmp_path / "near.onnx", steps, **options), tmp_path)
    assert_declined(run, PASS, reason, "conv0")


@pytest.mark.parametrize(
    "step",
    [
        ("Mul", np.linspace(0.5, 1.5, 144).reshape(4, 6, 6), False),  # one value per pixel
        ("Div", SCALE, True),  # c / x
        ("Div", np.array([1.0, 0.0, 2.0, 1.0]).reshape(4, 1, 1), False),  # x / 0
    ],
)
def test_what_is_no_per_channel_affine_map_is_no_candidate(tmp_path: Path, step: tuple) -> None:
    run = optimize_checked(_affine_conv(tmp_path / "other.onnx", [step]), tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert run.op_counts()[step[0]] == 1


def test_a_constant_that_broadcasts_the_activation_up_is_no_candidate(tmp_path: Path) -> None:
    """x [2, 1, 6, 6] * c [1, 4, 1, 1] has 4 channels where x has one: the Conv cannot read x."""
    rng = np.random.default_rng(0)
    model = save_model(
        tmp_path / "broadcast.onnx",
        [
            helper.make_node("Mul", ["x", "c"], ["scaled"], name="mul"),
            helper.make_node(
                "Conv", ["scaled", "w", "b"], ["y"], name="conv0", kernel_shape=[1, 1]
            ),
        ],
        [value("x", [2, 1, 6, 6])],
        [value("y", [2, 6, 6, 6])],
        [
            const("c", SCALE.reshape(1, 4, 1, 1)),
            const("w", rng.normal(size=(6, 4, 1, 1))),
            const("b", rng.normal(size=6)),
        ],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (0, 0)
    assert run.op_counts() == Counter({"Mul": 1, "Conv": 1})
