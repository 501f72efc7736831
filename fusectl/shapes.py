"""--input_shape in ATC syntax: fix the symbolic dimensions of the model's inputs."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from fusectl.errors import FusectlError


def parse_input_shape(text: str) -> dict[str, list[int]]:
    """``"ids:1,128;mask:1,128"`` -> {"ids": [1, 128], ...}; -1 keeps a dimension as it is.

    The name is split at its last colon, so TensorFlow-style names such as ``x:0`` work.
    """
    shapes: dict[str, list[int]] = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        name, colon, dims = item.strip().rpartition(":")
        if not colon or not name:
            raise FusectlError(f"--input_shape entry '{item.strip()}' is not 'name:d1,d2,...'")
        try:
            values = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise FusectlError(
                f"--input_shape entry '{item.strip()}' has a dimension that is not an integer"
            ) from None
        if any(v < -1 for v in values):
            raise FusectlError(f"--input_shape entry '{item.strip()}' has a negative dimension")
        if name in shapes:
            raise FusectlError(f"--input_shape names input '{name}' twice")
        shapes[name] = values
    return shapes


def apply_input_shapes(model: ir.Model, shapes: dict[str, list[int]], path: Path) -> None:
    """Replace symbolic input dimensions by the given sizes; a fixed size may not change."""
    inputs = {value.name: value for value in model.graph.inputs}
    for name, dims in shapes.items():
        value = inputs.get(name)
        if value is None:
            known = ", ".join(n for n in inputs if n) or "none"
            raise FusectlError(
                f"--input_shape names '{name}', not an input (inputs: {known})", path=path
            )
        current = value.shape
        if current is not None and len(current) != len(dims):
            raise FusectlError(
                f"--input_shape gives input '{name}' {len(dims)} dimensions, it has {len(current)}",
                path=path,
            )
        new_dims: list[int | ir.SymbolicDim] = []
        for axis, size in enumerate(dims):
            old = current[axis] if current is not None else None
            if size == -1:
                new_dims.append(old if old is not None else ir.SymbolicDim(None))
                continue
            if isinstance(old, int) and old != size:
                raise FusectlError(
                    f"--input_shape sets dimension {axis} of input '{name}' to {size}, "
                    f"the model fixes it at {old}",
                    path=path,
                )
            new_dims.append(size)
        value.shape = ir.Shape(new_dims)
