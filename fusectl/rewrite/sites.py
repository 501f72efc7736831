"""A rewrite's site class: what decides whether the fused kernel pays, independent of the model.

Two sites belong to one class when the same pass and pattern rewrite the same kind of input into
the same fused ops with the same attributes: element types, and shapes with each dimension the
model leaves symbolic written ``?`` (batch and sequence are chosen at run time; a hidden size is
not). A measurement made on one site (``fusectl tune``) then decides every site of its class, in
this model or another, which is how the knowledge repository is keyed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

if TYPE_CHECKING:
    from fusectl.rewrite.context import PassContext


@dataclass(frozen=True)
class SiteClass:
    """One class of rewrite; ``key`` is its repository key, readable on its own."""

    pass_name: str
    pattern: str
    fused: tuple[str, ...]
    inputs: tuple[str, ...]
    attributes: str
    # The floating-point types the fused kernels compute on: what a provider registers a
    # kernel for (not part of the key: the inputs' types already set the class apart).
    kernel_types: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        attributes = f" {self.attributes}" if self.attributes != "{}" else ""
        return (
            f"{self.pass_name}/{self.pattern}: {' + '.join(self.fused)}"
            f"({', '.join(self.inputs)}){attributes}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": self.pass_name,
            "pattern": self.pattern,
            "fused": list(self.fused),
            "inputs": list(self.inputs),
            "attributes": json.loads(self.attributes),
            "kernel_types": list(self.kernel_types),
        }


def op_name(domain: str, op_type: str) -> str:
    """An op as site classes name it: its domain first, unless it is onnx's."""
    return op_type if domain in ("", "ai.onnx") else f"{domain}.{op_type}"


def is_kernel(name: str) -> bool:
    """Whether an op named as site classes name it is a fused kernel (outside onnx's domain)."""
    return "." in name


def _signature(ctx: PassContext, value: ir.Value) -> str | None:
    dtype, shape = ctx.dtype(value), ctx.shape(value)
    if dtype is None or shape is None:
        return None
    dims = ",".join(str(d) if isinstance(d, int) else "?" for d in shape)
    constant = value.const_value is not None and not value.is_graph_input()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant":
        constant = True
    return f"{'const ' if constant else ''}{dtype.name.lower()}[{dims}]"


def _attribute(attr: ir.Attr) -> Any:
    if attr.is_ref() or attr.type in (
        ir.AttributeType.TENSOR,
        ir.AttributeType.TENSORS,
        ir.AttributeType.GRAPH,
        ir.AttributeType.GRAPHS,
        ir.AttributeType.SPARSE_TENSOR,
        ir.AttributeType.SPARSE_TENSORS,
        ir.AttributeType.TYPE_PROTO,
        ir.AttributeType.TYPE_PROTOS,
    ):
        return attr.type.name.lower()
    value = attr.value
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


# Ops that hand their first input's element type on unchanged.
_TYPE_KEEPING = frozenset(
    {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Expand", "Slice", "Concat"}
)
_FLOATING = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)
# The same, as input signatures and kernel_types write them.
FLOATING_NAMES = frozenset(dtype.name.lower() for dtype in _FLOATING)


def kernel_types(ctx: PassContext, new_nodes: Sequence[ir.Node]) -> tuple[str, ...]:
    """The floating-point types the fused kernels (the new ops outside onnx's domain) compute
    on: those of their inputs that are not constants, through the Casts and reshapes the
    rewrite put before them (a float16 model may run its attention in float32)."""
    made = {value: node for node in new_nodes for value in node.outputs}

    def element_type(value: ir.Value) -> ir.DataType | None:
        node = made.get(value)
        if node is None:
            return value.dtype or ctx.dtype(value)
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            return ir.DataType(node.attributes.get_int("to", 0))
        if node.op_type in _TYPE_KEEPING and node.inputs and node.inputs[0] is not None:
            return element_type(node.inputs[0])
        return value.dtype

    types = set()
    for node in new_nodes:
        if not is_kernel(op_name(node.domain, node.op_type)):
            continue
        for value in node.inputs:
            if value is None or (value.const_value is not None and not value.is_graph_input()):
                continue
            dtype = element_type(value)
            if dtype in _FLOATING:
                types.add(dtype.name.lower())
    return tuple(sorted(types))


def site_inputs(nodes: Sequence[ir.Node]) -> list[ir.Value]:
    """The values ``nodes`` read that none of them computes, in first-read order."""
    produced = {value for node in nodes for value in node.outputs}
    seen: dict[ir.Value, None] = {}
    for node in nodes:
        for value in node.inputs:
            if value is not None and value not in produced:
                seen[value] = None
    return list(seen)


def site_class(
    ctx: PassContext, pattern: str, old_nodes: Sequence[ir.Node], new_nodes: Sequence[ir.Node]
) -> SiteClass | None:
    """The class of a rewrite about to land; None when an input's type or shape is unknown."""
    signatures = []
    for value in site_inputs(old_nodes):
        signature = _signature(ctx, value)
        if signature is None:
            return None
        signatures.append(signature)
    # Sorted: passes list matched nodes in their own order, which may differ site to site.
    signatures.sort()
    attributes = [
        {name: _attribute(attr) for name, attr in sorted(node.attributes.items())}
        for node in new_nodes
        if node.attributes
    ]
    return SiteClass(
        ctx.spec.name,
        pattern,
        tuple(op_name(node.domain, node.op_type) for node in new_nodes),
        tuple(signatures),
        json.dumps(attributes[0] if len(attributes) == 1 else attributes, sort_keys=True)
        if attributes
        else "{}",
        kernel_types(ctx, new_nodes),
    )
