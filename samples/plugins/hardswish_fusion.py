"""A sample fusectl plugin: written-out hard-swish -> the standard ONNX ``HardSwish`` op.

YOLOv5's export script swaps every ``nn.Hardswish`` for an "export-friendly" module, so that
opsets without a HardSwish op can take it::

    x * F.hardtanh(x + 3, 0.0, 6.0) / 6.0

Both torch exporters write it as four nodes, ``Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)``.
``nn.Hardswish`` itself exported at opset 13, and ``x * F.hardsigmoid(x)`` at any opset, come
out as ``Mul(x, HardSigmoid(x, alpha=1/6))``. This plugin turns both spellings into one
``HardSwish`` node (ONNX opset >= 14; onnxruntime's CPU provider runs it as its function body,
HardSigmoid + Mul, in float and float16). No built-in pass does this.

    fusectl optimize model.onnx -o model_opt.onnx --plugin samples/plugins/hardswish_fusion.py

See samples/plugins/README.md for the walkthrough.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from fusectl import Category, Numerics, Site, register_replacement

# onnxruntime has no HardSwish kernel: it runs the op's function body, HardSigmoid + Mul, and
# its HardSigmoid kernel takes float only (float16 gets Casts around it; double fails to load).
RUNNABLE_TYPES = (ir.DataType.FLOAT16, ir.DataType.FLOAT)


# Search functions: each parameter after `op` is a pattern variable that binds to a value of
# the match; a variable used twice (x) must bind to the same value both times.
def yolov5_hardswish(op: Any, x: Any, three: Any, low: Any, high: Any, six: Any) -> Any:
    """x * hardtanh(x + 3, 0, 6) / 6, as YOLOv5's export-friendly Hardswish is exported."""
    return op.Div(op.Mul(x, op.Clip(op.Add(x, three), low, high)), six)


def x_times_hardsigmoid(op: Any, x: Any) -> Any:
    """x * HardSigmoid(x), as nn.Hardswish is exported at opset < 14."""
    return op.Mul(x, op.HardSigmoid(x))


def to_hardswish(op: Any, x: ir.Value) -> ir.Value:
    """What takes the match's place: one HardSwish node computing the same."""
    return op.HardSwish(x)


def exact_constants(
    site: Site,
    x: ir.Value,
    three: ir.Value | None = None,
    low: ir.Value | None = None,
    high: ir.Value | None = None,
    six: ir.Value | None = None,
) -> str | None:
    """Accept (None) only what computes hard-swish; else say why (shown in --report)."""
    if site.dtype(x) not in RUNNABLE_TYPES:
        return f"onnxruntime runs HardSwish in float16 and float only, not {site.dtype(x)}"
    if three is None:  # the HardSigmoid spelling: its attributes must be HardSwish's
        attributes = site.node("HardSigmoid").attributes
        alpha, beta = attributes.get_float("alpha", 0.2), attributes.get_float("beta", 0.5)
        if np.float32(alpha) != np.float32(1 / 6) or beta != 0.5:
            return f"HardSigmoid has alpha {alpha:g}, beta {beta:g}; HardSwish needs 1/6, 0.5"
        return None
    for value, wanted, what in (
        (three, 3, "the constant added to x"),
        (low, 0, "the Clip's min"),
        (high, 6, "the Clip's max"),
        (six, 6, "the divisor"),
    ):
        array = site.constant(value)
        if array is None:
            return f"{what} is not a constant"
        if array.shape != ():  # a [1] or [1,C,1,1] constant could broadcast x to a new shape
            return f"{what} has shape {list(array.shape)}, not a scalar"
        if array.item() != wanted:
            return f"{what} is {array.item():g}, not {wanted}"
    return None


register_replacement(
    "HardSwishFusionPass",
    [yolov5_hardswish, x_times_hardsigmoid],
    to_hardswish,
    extra_check=exact_constants,
    category=Category.GRAPH,
    description="written-out hard-swish (YOLOv5's x * hardtanh(x + 3, 0, 6) / 6, or "
    "x * HardSigmoid(x)) -> HardSwish (opset 14)",
    aliases=("hardswish_fusion", "HardSwishFusion"),
    # Not bit for bit: (x * clip(x + 3, 0, 6)) / 6 rounds differently from x * clip(x/6 + 1/2).
    numerics=Numerics.REASSOCIATING,
    min_opset=14,
    emits=("HardSwish",),
)
