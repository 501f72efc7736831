"""A square root and its reciprocal spelled as powers, written as the ops the norms read.

Gemma-3n's RMS norm is ``x * torch.pow(mean(x^2) + eps, -0.5)``, where LLaMA's writes
``x * torch.rsqrt(...)`` (exported as ``Reciprocal(Sqrt(...))`` or ``1 / Sqrt``). The two
compute the same thing; rather than one more norm pattern per spelling, ``Pow(s, -0.5)``
becomes ``Reciprocal(Sqrt(s))`` and ``Pow(s, 0.5)`` becomes ``Sqrt(s)``, the form the
normalization passes match, before they run. Likewise the square a norm averages: written
``x * x`` (ImageGPT's RMS norm, a layer norm's ``d * d``) it becomes ``Pow(x, 2)``, which
onnxruntime computes as that product, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_scalar, new_constant, replace_subgraph, typed
from fusectl.rewrite.registry import (
    Category,
    FusionPass,
    Numerics,
    PassSpec,
    register_pass,
)

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16})


@register_pass
class PowerCanonicalizationPass(FusionPass):
    """Not a pattern: each Pow by a constant half, and each product of a value with itself,
    is judged alone."""

    spec = PassSpec(
        name="PowerCanonicalizationPass",
        category=Category.GRAPH,
        description="Pow(s, -0.5) -> Reciprocal(Sqrt(s)), Pow(s, 0.5) -> Sqrt(s), and x * x "
        "read only by means -> Pow(x, 2): the spelling the norm passes read (Gemma-3n's, "
        "ImageGPT's RMS norms)",
        aliases=("power_canonicalization",),
        numerics=Numerics.REASSOCIATING,  # powf and 1 / sqrtf may round differently
        priority=3042,
        emits=("Sqrt", "Reciprocal", "Pow"),
        canonical=True,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        for power in ctx.op_index.of_type(model.graph, "Pow"):
            if power.graph is not model.graph or power.inputs[0] is None:
                continue
            exponent = constant_scalar(power.inputs[1]) if len(power.inputs) == 2 else None
            if exponent not in (0.5, -0.5):
                continue  # most Pows square (a norm's variance, GELU's cube): asked first
            dtype = ctx.dtype(power.outputs[0])
            if dtype not in _FLOATS:
                continue
            root = ir.node("Sqrt", [power.inputs[0]])
            nodes = [root]
            if exponent < 0:
                nodes.append(ir.node("Reciprocal", root.outputs))
            for node in nodes:
                typed(node.outputs[0], dtype, ctx.shape(power.outputs[0]))
            pattern = "RsqrtPower" if exponent < 0 else "SqrtPower"
            replace_subgraph(ctx, pattern, power, [power], nodes, power.outputs, nodes[-1].outputs)
        twos: dict[ir.DataType, ir.Value] = {}
        for product in ctx.op_index.of_type(model.graph, "Mul"):
            x = product.inputs[0]
            if product.graph is not model.graph or x is None or product.inputs[1] is not x:
                continue
            dtype = ctx.dtype(product.outputs[0])
            readers = [user for user, _ in product.outputs[0].uses()]
            if dtype not in _FLOATS or not readers or product.outputs[0].is_graph_output():
                continue
            if any(r.op_type != "ReduceMean" or r.domain not in ("", "ai.onnx") for r in readers):
                continue  # GELU's cube x * x * x, a gate: only the square a mean averages
            if dtype not in twos:
                name = f"{self.spec.name}/two_{dtype.name.lower()}"
                twos[dtype] = new_constant(model.graph, name, np.array(2, dtype.numpy()))
            square = ir.node("Pow", [x, twos[dtype]])
            typed(square.outputs[0], dtype, ctx.shape(product.outputs[0]))
            replace_subgraph(
                ctx, "SquareProduct", product, [product], [square], product.outputs, square.outputs
            )
