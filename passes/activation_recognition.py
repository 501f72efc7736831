"""Activations recognized by what they compute, whatever the spelling, and written canonically.

Exporters and model authors spell GELU, SiLU and QuickGELU in more ways than any list of
patterns holds: Bloom writes ``x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))``,
GPT-2 ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3))))``, Flax (through
jax2tf) ``x * (0.5 * (1 + tanh(0.7978846 * (x + x * (x * 0.044715)))))``. Hard-swish is
``x * relu6(x + 3) / 6`` in PaddleOCR's and YOLOv5's exports, ``x * clip(x / 6 + 0.5, 0, 1)``
elsewhere. Instead of one more pattern per spelling, this pass finds each cluster of
element-wise ops around an Erf, Tanh, Sigmoid, Exp, Clip or HardSigmoid that computes a function
of one value ``x`` (its other inputs scalar constants, its intermediate values read nowhere
else), evaluates the cluster at probe points, and when it is a known activation there rewrites
it canonically: GELU and QuickGELU into the one spelling their fusion passes fuse, hard-sigmoid
into ``HardSigmoid`` and hard-swish into ``HardSwish`` (``x * HardSigmoid(x)`` before opset 14),
where that takes fewer nodes. A cluster already in canonical form is left alone, so the pass is
idempotent.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fusectl.rewrite import runtime
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_value, node_label, replace_subgraph
from fusectl.rewrite.patterns import PatternPass
from fusectl.rewrite.registry import (
    REGISTRY,
    Category,
    FusionPass,
    Numerics,
    PassSpec,
    register_pass,
)

_ERF = np.vectorize(math.erf)
# Element-wise ops a cluster may hold, evaluated on float64 arrays (constants are scalars).
_EVALUATE: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Pow": np.power,
    "Neg": np.negative,
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Abs": np.abs,
    "Exp": np.exp,
    "Erf": _ERF,
    "Tanh": np.tanh,
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "Relu": lambda x: np.maximum(x, 0),
    "Max": lambda *operands: functools.reduce(np.maximum, operands),
    "Min": lambda *operands: functools.reduce(np.minimum, operands),
}
# Element-wise ops whose value depends on attributes (_apply evaluates them): Clip's bounds
# before opset 11, HardSigmoid's alpha and beta.
_WITH_ATTRIBUTES = frozenset({"Clip", "HardSigmoid"})
_SEEDS = frozenset({"Erf", "Tanh", "Sigmoid", "Exp", *_WITH_ATTRIBUTES})
_MAX_NODES = 16
_PROBES = np.concatenate([np.linspace(-6.0, 6.0, 97), [-0.3, -0.01, 0.01, 0.3]])
_OUTER = 96  # the probe at 6, whose negative is the first
_FLOATS = {ir.DataType.FLOAT: 1e-5, ir.DataType.DOUBLE: 1e-9, ir.DataType.FLOAT16: 2e-3}
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + _ERF(x / math.sqrt(2)))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


@dataclass(frozen=True)
class _Canonical:
    """A known activation (its name is the pattern the report counts) and the spelling the
    fusion passes match."""

    name: str
    build: Callable[[_Builder, ir.Value], ir.Value]
    # No fusion pass takes it further: written only where it has fewer nodes than the cluster.
    final: bool = False
    # A constant multiple of the activation (onnx-simplifier folds GELU's ``* 0.5`` into the
    # Conv after it): written as the activation times the constant, which a Conv then folds.
    scaled: bool = False


class _Builder:
    """New nodes and scalar constants for one rewrite, named after the site."""

    def __init__(self, graph: ir.Graph, base: str, dtype: ir.DataType, opset: int) -> None:
        self.graph, self.base, self.dtype, self.opset = graph, base, dtype, opset
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []

    def constant(self, value: float) -> ir.Value:
        name = f"{self.base}/c{len(self.initializers)}"
        while name in self.graph.initializers:
            name += "_"
        tensor = ir.tensor(np.array(value, dtype=self.dtype.numpy()), name=name)
        constant = ir.Value(
            name=name, type=ir.TensorType(self.dtype), shape=ir.Shape([]), const_value=tensor
        )
        self.initializers.append(constant)
        return constant

    def op(self, op_type: str, *inputs: ir.Value, **attributes: float) -> ir.Value:
        node = ir.Node("", op_type, inputs, [ir.AttrFloat32(k, v) for k, v in attributes.items()])
        node.outputs[0].type = ir.TensorType(self.dtype)
        self.nodes.append(node)
        return node.outputs[0]

    def discard(self) -> None:
        """Unhook the nodes built from the values they read (a node is its inputs' user from
        its creation, inserted in the graph or not)."""
        for node in self.nodes:
            for index in range(len(node.inputs)):
                node.replace_input_with(index, None)


def _half_x_times(b: _Builder, x: ir.Value, bracket: ir.Value) -> ir.Value:
    return b.op("Mul", b.op("Mul", x, bracket), b.constant(0.5))


def _build_erf(b: _Builder, x: ir.Value) -> ir.Value:
    erf = b.op("Erf", b.op("Div", x, b.constant(math.sqrt(2))))
    return _half_x_times(b, x, b.op("Add", erf, b.constant(1.0)))


def _build_tanh(b: _Builder, x: ir.Value) -> ir.Value:
    cube = b.op("Mul", b.op("Pow", x, b.constant(3.0)), b.constant(0.044715))
    inner = b.op("Mul", b.op("Add", x, cube), b.constant(_SQRT_2_OVER_PI))
    return _half_x_times(b, x, b.op("Add", b.op("Tanh", inner), b.constant(1.0)))


def _build_quick(alpha: float) -> Callable[[_Builder, ir.Value], ir.Value]:
    def build(b: _Builder, x: ir.Value) -> ir.Value:
        scaled = x if alpha == 1.0 else b.op("Mul", x, b.constant(alpha))
        return b.op("Mul", x, b.op("Sigmoid", scaled))

    return build


def _hard_sigmoid(x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    return np.clip(alpha * x + beta, 0.0, 1.0)


def _build_hard_sigmoid(alpha: float, beta: float) -> Callable[[_Builder, ir.Value], ir.Value]:
    def build(b: _Builder, x: ir.Value) -> ir.Value:
        return b.op("HardSigmoid", x, alpha=alpha, beta=beta)

    return build


def _build_hard_swish(alpha: float, beta: float) -> Callable[[_Builder, ir.Value], ir.Value]:
    """``HardSwish`` from opset 14 where it is hard-swish's (alpha 1/6, beta 1/2), else
    ``x * HardSigmoid(x)``."""

    def build(b: _Builder, x: ir.Value) -> ir.Value:
        if b.opset >= 14 and (alpha, beta) == _HARD_SWISH:
            return b.op("HardSwish", x)
        return b.op("Mul", x, b.op("HardSigmoid", x, alpha=alpha, beta=beta))

    return build


# HardSwish's own HardSigmoid, as float32 attributes hold it.
_HARD_SWISH = (float(np.float32(1 / 6)), 0.5)


def _hard_sigmoid_fit(x: np.ndarray, g: np.ndarray, tolerance: float) -> tuple[float, float] | None:
    """alpha and beta of ``clip(alpha * x + beta, 0, 1)`` through the probes where ``g`` is
    strictly between its bounds (the line's first and last), or None."""
    inside = np.flatnonzero((g > tolerance) & (g < 1 - tolerance) & np.isfinite(g))
    # Both bounds reached within the probes: a gate that never saturates there is no hard
    # sigmoid (Gemma-2's soft cap of scaled scores, 50 tanh(x / 16 / 50), is near x / 16).
    if len(inside) < 2 or not (np.any(g <= tolerance) and np.any(g >= 1 - tolerance)):
        return None
    first, last = inside[0], inside[-1]
    alpha = (g[last] - g[first]) / (x[last] - x[first])
    if not alpha > 0:
        return None
    fitted = (float(np.float32(alpha)), float(np.float32(g[first] - alpha * x[first])))
    # Snapped to hard-swish's where they are its (1/6 and 1/2 read back from float32 constants).
    if np.allclose(fitted, _HARD_SWISH, rtol=1e-6, atol=1e-7):
        return _HARD_SWISH
    return fitted


def _recognize(x: np.ndarray, y: np.ndarray, tolerance: float) -> _Canonical | None:
    """The known activation that ``y`` is of ``x`` within ``tolerance``, if any."""

    def close(want: np.ndarray) -> bool:
        return bool(np.all(np.abs(y - want) <= tolerance * (1 + np.abs(want))))

    fit = _hard_sigmoid_fit(x, y, tolerance)
    if fit is not None and close(_hard_sigmoid(x, *fit)):
        return _Canonical(
            "HardSigmoid (alpha {:g}, beta {:g})".format(*fit),
            _build_hard_sigmoid(*fit),
            final=True,
        )
    with np.errstate(all="ignore"):
        gate = np.where(x != 0, y / x, np.nan)
    fit = _hard_sigmoid_fit(x, gate, tolerance)
    if fit is not None and close(x * _hard_sigmoid(x, *fit)):
        name = (
            "HardSwish"
            if fit == _HARD_SWISH
            else "x * HardSigmoid (alpha {:g}, beta {:g})".format(*fit)
        )
        return _Canonical(name, _build_hard_swish(*fit), final=True)

    if close(_gelu_erf(x)):
        return _Canonical("GELU (erf)", _build_erf)
    if close(_gelu_tanh(x)):
        return _Canonical("GELU (tanh)", _build_tanh)
    # x * sigmoid(alpha * x): alpha from one probe, then checked at all of them.
    ratio = y[-1] / x[-1]
    if 0 < ratio < 1:
        alpha = float(np.round(math.log(ratio / (1 - ratio)) / x[-1], 4))
        if alpha > 0 and close(x * _sigmoid(alpha * x)):
            name = "SiLU" if alpha == 1.0 else f"QuickGELU (alpha {alpha:g})"
            return _Canonical(name, _build_quick(alpha))
    return None


def _build_scaled(
    build: Callable[[_Builder, ir.Value], ir.Value], scale: float
) -> Callable[[_Builder, ir.Value], ir.Value]:
    def scaled(b: _Builder, x: ir.Value) -> ir.Value:
        return b.op("Mul", build(b, x), b.constant(scale))

    return scaled


def _recognize_scaled(x: np.ndarray, y: np.ndarray, tolerance: float) -> _Canonical | None:
    """The known activation ``y`` is, or is a constant multiple ``s`` of. GELU, SiLU and
    QuickGELU are ``x * gate(x)`` with ``gate(t) + gate(-t) = 1``, so ``y(t) - y(-t) = s * t``
    reads ``s`` off the outermost probes (``_PROBES`` starts symmetric about 0)."""
    known = _recognize(x, y, tolerance)
    if known is not None:
        return known
    scale = float((y[_OUTER] - y[0]) / x[_OUTER])
    if not math.isfinite(scale) or abs(scale) < tolerance or math.isclose(scale, 1.0):
        return None
    inner = _recognize(x, y / scale, tolerance)
    if inner is None or inner.final:
        return None
    name = f"{inner.name} times {scale:g}"
    return _Canonical(name, _build_scaled(inner.build, scale), scaled=True)


def _scalar(value: ir.Value | None) -> float | None:
    if value is None:
        return None
    array = constant_value(value)
    if array is None or array.size != 1 or not np.issubdtype(array.dtype, np.floating):
        return None
    return float(array.reshape(-1)[0])


def _tensor_constant(value: ir.Value) -> bool:
    """A constant with more than one element (a bias, a weight): not part of an activation."""
    array = constant_value(value)
    return array is not None and array.size != 1


def _elementwise(node: ir.Node) -> bool:
    return (
        node.domain in ("", "ai.onnx")
        and (node.op_type in _EVALUATE or node.op_type in _WITH_ATTRIBUTES)
        and len(node.outputs) == 1
    )


def _operands(node: ir.Node) -> list[ir.Value]:
    """The node's inputs, less the optional ones left out (a Clip without a lower bound)."""
    return [value for value in node.inputs if value is not None]


def _apply(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray:
    """The node's function of its (float64) arguments, None for an operand left out."""
    attributes = node.attributes
    if node.op_type == "HardSigmoid":
        alpha, beta = attributes.get_float("alpha", 0.2), attributes.get_float("beta", 0.5)
        return _hard_sigmoid(args[0], alpha, beta)  # type: ignore[arg-type]
    if node.op_type == "Clip":
        low = args[1] if len(args) > 1 else None
        high = args[2] if len(args) > 2 else None
        low = attributes.get_float("min", -np.inf) if low is None else low
        high = attributes.get_float("max", np.inf) if high is None else high
        return np.minimum(np.maximum(args[0], low), high)  # type: ignore[arg-type]
    return _EVALUATE[node.op_type](*args)


class _Cluster:
    """Element-wise nodes computing values of one source ``x`` (and scalar constants)."""

    def __init__(self, x: ir.Value, nodes: Iterable[ir.Node]) -> None:
        self.x = x
        self.nodes: list[ir.Node] = list(nodes)

    @property
    def values(self) -> set[ir.Value]:
        return {node.outputs[0] for node in self.nodes}

    def escaping(self) -> list[ir.Value]:
        """Values read outside the cluster (or graph outputs)."""
        members = set(self.nodes)
        found = []
        for node in self.nodes:
            value = node.outputs[0]
            if value.is_graph_output() or any(u not in members for u, _ in value.uses()):
                found.append(value)
        return found

    def signature(self, output: ir.Value) -> tuple:
        """The cluster's structure and constants: clusters repeat layer after layer, and one
        evaluation serves every cluster with the same signature."""
        index = {node.outputs[0]: i for i, node in enumerate(self.nodes)}
        parts: list[tuple] = [(index.get(output),)]
        for node in self.nodes:
            operands = tuple(
                "x" if v is self.x else index[v] if v in index else _scalar(v) for v in node.inputs
            )
            attributes = ()
            if node.op_type in _WITH_ATTRIBUTES:
                attributes = tuple(sorted((k, a.value) for k, a in node.attributes.items()))
            parts.append((node.op_type, operands, attributes))
        return tuple(parts)

    def evaluate(self, probes: np.ndarray, output: ir.Value) -> np.ndarray | None:
        computed: dict[ir.Value, np.ndarray] = {self.x: probes}
        pending = list(self.nodes)
        while pending:
            progressed = False
            for node in list(pending):
                args: list[np.ndarray | None] = []
                for value in node.inputs:
                    if value is None:
                        args.append(None)
                    elif value in computed:
                        args.append(computed[value])
                    elif (scalar := _scalar(value)) is not None:
                        args.append(np.float64(scalar))
                    else:
                        break
                else:
                    with np.errstate(all="ignore"):
                        computed[node.outputs[0]] = np.asarray(_apply(node, args), np.float64)
                    pending.remove(node)
                    progressed = True
            if not progressed:
                return None
        result = computed.get(output)
        return result if result is not None and np.all(np.isfinite(result)) else None


def _neighbourhood(seed: ir.Node) -> tuple:
    """The seed's ops and scalar constants two steps up and three down a single-reader chain."""

    def describe(node: ir.Node) -> tuple:
        scalars = tuple(_scalar(v) if v is not None else None for v in node.inputs)
        return (node.op_type, scalars, len(node.outputs[0].uses()) if node.outputs else 0)

    parts: list[tuple] = [describe(seed)]
    producer = seed.inputs[0].producer() if seed.inputs and seed.inputs[0] is not None else None
    for _ in range(2):
        if producer is None:
            break
        parts.append(("up", *describe(producer)))
        first = producer.inputs[0] if producer.inputs else None
        producer = first.producer() if first is not None else None
    node = seed
    for _ in range(3):
        readers = node.outputs[0].uses() if node.outputs else []
        if len(readers) != 1:
            break
        node = readers[0][0]
        parts.append(("down", *describe(node)))
    return tuple(parts)


def _from_x(value: ir.Value, x: ir.Value, depth: int = 4) -> list[ir.Node] | None:
    """The element-wise nodes computing ``value`` from ``x`` and scalar constants only."""
    if value is x:
        return []
    if _scalar(value) is not None:
        return []
    producer = value.producer()
    if depth == 0 or producer is None or not _elementwise(producer):
        return None
    nodes = [producer]
    for operand in _operands(producer):
        found = _from_x(operand, x, depth - 1)
        if found is None:
            return None
        nodes += [n for n in found if n not in nodes]
    return nodes


def _source(seed: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """The one non-constant value the seed's argument is computed from, with the nodes."""
    leaves: set[ir.Value] = set()
    nodes: list[ir.Node] = []

    def walk(value: ir.Value, depth: int) -> None:
        if _scalar(value) is not None:
            return
        producer = value.producer()
        if (
            depth == 0
            or producer is None
            or not _elementwise(producer)
            or producer.op_type in _SEEDS
            or any(_tensor_constant(v) for v in _operands(producer))
        ):
            leaves.add(value)
            return
        if producer not in nodes:
            nodes.append(producer)
        for operand in _operands(producer):
            walk(operand, depth - 1)

    for operand in _operands(seed):
        walk(operand, 6)
    if len(leaves) != 1:
        return None
    return leaves.pop(), nodes


def _grow(
    seed: ir.Node, recognize: Callable[[_Cluster, ir.Value], _Canonical | None]
) -> tuple[_Cluster, ir.Value, _Canonical] | None:
    """Grow the cluster down from the seed; the largest state recognized as an activation."""
    found = _source(seed)
    if found is None:
        return None
    x, upward = found
    cluster = _Cluster(x, [*upward, seed])
    best = None
    while len(cluster.nodes) <= _MAX_NODES:
        escaping = cluster.escaping()
        if len(escaping) == 1:
            known = recognize(cluster, escaping[0])
            # The activation itself over a multiple of it: growing past GELU's canonical
            # ``* 0.5`` into a ``* 2`` after it must not rewrite a spelling fused as it is.
            if known is not None and (best is None or best[2].scaled or not known.scaled):
                best = (_Cluster(x, cluster.nodes), escaping[0], known)
        grown = False
        values = cluster.values
        for value in list(values):
            for user, _ in value.uses():
                if user in cluster.nodes or not _elementwise(user):
                    continue
                extra: list[ir.Node] = []
                for operand in _operands(user):
                    if operand in values or operand is x:
                        continue
                    more = _from_x(operand, x)
                    if more is None:
                        break
                    extra += [n for n in more if n not in cluster.nodes and n not in extra]
                else:
                    cluster.nodes += [*extra, user]
                    grown = True
                    break
            if grown:
                break
        if not grown:
            break
    return best


# The passes that fuse activations by their spelling: a cluster one of them can match is left
# as it is (no churn of names and lineage), the others are rewritten into a spelling they match.
_SPELLED = ("GeluFusionPass", "BiasGeluFusionPass", "FastGeluFusionPass", "QuickGeluFusionPass")


def _spelled() -> list[PatternPass]:
    found = (REGISTRY.canonical(name) for name in _SPELLED)
    return [fusion for name in found if name and isinstance(fusion := REGISTRY[name], PatternPass)]


@register_pass
class ActivationRecognitionPass(FusionPass):
    spec = PassSpec(
        name="ActivationRecognitionPass",
        category=Category.GRAPH,
        description="element-wise clusters around Erf / Tanh / Sigmoid / Clip / HardSigmoid "
        "recognized by the function they compute (GELU erf and tanh forms, SiLU, QuickGELU, "
        "hard-sigmoid, hard-swish), in any spelling -> the spelling the GELU and QuickGELU "
        "passes fuse, HardSigmoid, HardSwish",
        aliases=("activation_recognition",),
        numerics=Numerics.REASSOCIATING,
        priority=4300,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        seeds = [node for node in graph if node.op_type in _SEEDS and _elementwise(node)]
        recognized: dict[tuple, _Canonical | None] = {}
        # Neighbourhoods of seeds whose cluster was already in canonical spelling: a model
        # repeats its activation in every layer, and growing each again costs more than all
        # the rest of the pass.
        canonical: set[tuple] = set()
        spelled = _spelled()
        for seed in seeds:
            if seed.graph is not graph:
                continue  # part of a cluster rewritten already
            around = _neighbourhood(seed)
            if around in canonical:
                continue
            dtype = ctx.dtype(seed.outputs[0])
            if dtype not in _FLOATS:
                continue
            grown = _grow(seed, _Recognizer(dtype, recognized))  # type: ignore[arg-type]
            if grown is None:
                continue
            cluster, output, known = grown
            root = output.producer()
            assert root is not None
            if not known.final and any(fusion.matches(root) for fusion in spelled):
                canonical.add(around)
                continue  # a spelling the GELU and QuickGELU passes match as it is
            if not _keeps_shape(ctx, cluster):
                continue
            assert dtype is not None
            builder = _Builder(graph, f"{self.spec.name}/{node_label(root)}", dtype, ctx.opset)
            result = known.build(builder, cluster.x)
            if known.final and not _better(builder, cluster, ctx.opset):
                builder.discard()
                canonical.add(around)
                continue  # HardSigmoid as it is, or no fewer nodes, or no kernel for them
            for node in builder.nodes:  # scalar constants: every value has x's shape
                node.outputs[0].shape = output.shape
            replace_subgraph(
                ctx,
                known.name,  # the pattern, as the report counts it: "GELU (tanh)", "SiLU", ...
                root,
                cluster.nodes,
                builder.nodes,
                [output],
                [result],
                builder.initializers,
            )


def _keeps_shape(ctx: PassContext, cluster: _Cluster) -> bool:
    """Whether the canonical form, whose constants are scalars, computes the cluster's shape:
    a one-element constant of rank r (Flax's ``[1, 1, 1]``) broadcasts ``x`` up to rank r."""
    rank = max(
        (
            array.ndim
            for node in cluster.nodes
            for value in _operands(node)
            if value is not cluster.x and (array := constant_value(value)) is not None
        ),
        default=0,
    )
    if rank == 0:
        return True
    shape = ctx.shape(cluster.x)
    return shape is not None and len(shape) >= rank


def _better(builder: _Builder, cluster: _Cluster, opset: int) -> bool:
    """Whether the canonical form takes fewer nodes than the cluster, with kernels for them."""
    return len(builder.nodes) < len(cluster.nodes) and all(
        runtime.has_kernel(node.op_type, "", opset, builder.dtype) for node in builder.nodes
    )


@dataclass
class _Recognizer:
    """Evaluates a cluster state and names the activation it computes, once per signature."""

    dtype: ir.DataType
    recognized: dict[tuple, _Canonical | None]

    def __call__(self, cluster: _Cluster, output: ir.Value) -> _Canonical | None:
        key = (self.dtype, cluster.signature(output))
        if key not in self.recognized:
            y = cluster.evaluate(_PROBES, output)
            tolerance = _FLOATS[self.dtype]
            self.recognized[key] = None if y is None else _recognize_scaled(_PROBES, y, tolerance)
        return self.recognized[key]
