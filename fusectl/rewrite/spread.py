"""Constants spread at run time: a value every element of which is known before run time
(an Expand or ConstantOfShape of a constant, and element-wise arithmetic of such), and the
tensors whose shapes it is spread to. Exporters write ``zeros_like`` and broadcasting this way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.graph import constant_value, element_count, shape_of

ARITHMETIC: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Mul": operator.mul,
    "Add": operator.add,
    "Sub": operator.sub,
    "Div": operator.truediv,
}
_SPLAT_DEPTH = 6


def splat(
    value: ir.Value | None, seen: dict[ir.Value, np.ndarray | None], depth: int = 0
) -> np.ndarray | None:
    """The one value every element of ``value`` has (0-d, of its element type) where that is
    known before run time, whatever the shape: a constant, an Expand or ConstantOfShape of one,
    a Cast or element-wise arithmetic of such; else None. ``seen`` holds the answers so far
    (a chain of arithmetic is walked once, not from each of its nodes)."""
    if value is None or depth > _SPLAT_DEPTH:
        return None
    if value not in seen:
        seen[value] = _splat(value, seen, depth)
    return seen[value]


def _splat(
    value: ir.Value, seen: dict[ir.Value, np.ndarray | None], depth: int
) -> np.ndarray | None:
    array = constant_value(value)
    if array is not None:
        flat = array.reshape(-1)
        if flat.size == 0 or not (flat == flat[0]).all():
            return None
        return flat[:1].reshape(())
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return None
    inputs = producer.inputs
    if producer.op_type == "Expand":
        return splat(inputs[0], seen, depth + 1)
    if producer.op_type == "ConstantOfShape":
        attribute = producer.attributes.get("value")
        if attribute is None:
            return np.zeros((), np.float32)
        return attribute.as_tensor().numpy().reshape(-1)[:1].reshape(())
    if producer.op_type == "Cast":
        inner = splat(inputs[0], seen, depth + 1)
        target = ir.DataType(producer.attributes.get_int("to", 0)).numpy()
        return None if inner is None else inner.astype(target)
    if producer.op_type in ARITHMETIC and len(inputs) == 2:
        a = splat(inputs[0], seen, depth + 1)
        b = None if a is None else splat(inputs[1], seen, depth + 1)
        if a is None or b is None or a.dtype != b.dtype or a.dtype.kind != "f":
            return None  # integer Div truncates; keep to what numpy computes alike
        with np.errstate(all="ignore"):
            return np.asarray(ARITHMETIC[producer.op_type](a, b), dtype=a.dtype)
    return None


# Element-wise ops that broadcast their inputs to one shape, and one-input element-wise ops that
# keep a shape (what may stand between a broadcast and the op that broadcasts it anyway).
BROADCASTING = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "And", "Or", "Xor", "Equal",
     "Less", "LessOrEqual", "Greater", "GreaterOrEqual"}
)  # fmt: skip
SHAPE_KEEPING = frozenset({"Cast", "Not", "Neg", "Identity"})


def spread_sources(value: ir.Value, depth: int = 0) -> list[ir.Value] | None:
    """The tensors a constant spread at run time takes its shape from: ``t`` for Expand(c,
    Shape(t)) and ConstantOfShape(Shape(t)), through Casts, Identities and element-wise
    arithmetic of such (their shape is the broadcast of those tensors'); None where a shape
    comes from anything else (a target computed otherwise, a constant of more than one
    element or of more than one axis, which could add axes; one of one axis adds none to a
    tensor of any rank but 0)."""
    array = constant_value(value)
    if array is not None:
        return [] if array.size == 1 and array.ndim <= 1 else None
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx") or depth > _SPLAT_DEPTH:
        return None
    inputs = producer.inputs
    if producer.op_type in ("Expand", "ConstantOfShape"):
        shape = shape_of(inputs[-1])
        if shape is None or shape.attributes or shape.inputs[0] is None:
            return None
        if producer.op_type == "ConstantOfShape":
            return [shape.inputs[0]]
        inner = spread_sources(inputs[0], depth + 1) if inputs[0] is not None else None
        return None if inner is None else [*inner, shape.inputs[0]]
    if producer.op_type in ("Cast", "Identity") and inputs[0] is not None:
        return spread_sources(inputs[0], depth + 1)
    if producer.op_type in ARITHMETIC and len(inputs) == 2 and None not in inputs:
        first = spread_sources(inputs[0], depth + 1)  # type: ignore[arg-type]
        second = None if first is None else spread_sources(inputs[1], depth + 1)  # type: ignore[arg-type]
        return None if first is None or second is None else [*first, *second]
    return None


def uniform(tensor: ir.TensorProtocol) -> bool:
    """Whether every element of a stored tensor is stored alike: read from its bytes where it
    is still a protobuf (no array is built for the many weights that are not)."""
    size = element_count(tensor)
    if isinstance(tensor, ir.serde.TensorProtoTensor) and tensor.raw.raw_data and size:
        raw = tensor.raw.raw_data
        width, rest = divmod(len(raw), size)
        # size non-overlapping copies of the first element's bytes tile them all exactly
        return not rest and raw.count(raw[:width]) == size
    try:
        flat = tensor.numpy().reshape(-1)
    except Exception:  # stored data that does not match its type (a fuzzed or broken input)
        return False
    return flat.size > 0 and bool((flat == flat[0]).all())
