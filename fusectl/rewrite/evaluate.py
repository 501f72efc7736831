"""Values computed before run time with onnx's reference implementation of each op.

Constant folding computes one node whose inputs are all constants. A recognizer that asks what
a subgraph computes (is this bias a key padding mask?) evaluates the subgraph at probe sizes
and inputs of its choosing: ``evaluate`` walks the nodes a value depends on, feeding the graph
inputs it is given and reading a Shape or Size of anything else from the inferred shape, with
each named dimension set to a probe size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir
from onnx.reference.ops import load_op

from fusectl.rewrite.axes import size_sources, symbolic_size
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_value
from fusectl.rewrite.shapes import arithmetic_dim, arithmetic_names
from fusectl.rewrite.sizes import Size

# Nodes a probe evaluation walks at most: a mask or a shape computation, not a network.
_MAX_NODES = 256
# Sizes the named dimensions take in two probes: distinct, so that a computation that mixes two
# of them up (the batch for the length) does not pass.
PROBE_SIZES = ((3, 5, 7, 11, 13, 17), (4, 6, 9, 10, 14, 15))


def probes(names: Sequence[str]) -> list[dict[str, int]] | str:
    """One size per named dimension for each row of PROBE_SIZES. A name that is arithmetic
    over other names (Optimum's "past_sequence_length + sequence_length") is computed from
    theirs: sizes probed apart would describe a model that cannot run (a mask shorter than the
    past it covers). Why not, where there are more names than probe sizes or a computed size
    is not positive."""
    plain: list[str] = []
    for name in names:
        for part in arithmetic_names(name) or [name]:
            if part not in plain:
                plain.append(part)
    if len(plain) > len(PROBE_SIZES[0]):
        return f"{len(plain)} named dimensions, more than the {len(PROBE_SIZES[0])} probe sizes"
    found = []
    for sizes in PROBE_SIZES:
        probe = dict(zip(plain, sizes, strict=False))
        for name in names:
            if name not in probe:
                computed = arithmetic_dim(name, probe.__getitem__)
                if computed is None:
                    return f"the dimension '{name}' comes to no positive size at the probe sizes"
                probe[name] = computed
        found.append(probe)
    return found


def run_node(node: ir.Node, arrays: list[np.ndarray | None], opset: int) -> list[np.ndarray] | None:
    """The outputs of a standard-domain ``node`` on ``arrays``, or None where an output is not a
    tensor (a sequence, map or optional)."""
    implementation = load_op("", node.op_type, opset)
    proto = ir.serde.serialize_node(node)
    params = {"log": lambda *_: None, "opsets": {"": opset}, "verbose": 0, "new_ops": None}
    results = implementation(proto, params).run(*arrays)
    if len(results) < len(node.outputs):
        return None
    if not all(isinstance(r, np.ndarray | np.generic) for r in results):
        return None
    # The reference computes every optional output (LayerNormalization's Mean and InvStdDev);
    # keep those the node declares, a prefix of them.
    return [np.asarray(r) for r in results[: len(node.outputs)]]


class Unevaluable(Exception):
    """The value depends on something a probe cannot set: an input not fed, a dimension with
    no probe size, an op outside the standard domain, or too many nodes."""


def traced_sizes(ctx: PassContext, value: ir.Value) -> list[Size | None] | None:
    """Each axis's size as a product of static sizes and named dimensions, read at the far
    end of the axis's copies (size_sources) first: a graph output's exporter-made names
    ("..._dim_0") are the input's batch and sequence further up."""
    shape = ctx.shape(value)
    if shape is None:
        return None
    sizes = []
    for axis, dim in enumerate(shape):
        if isinstance(dim, int):
            sizes.append((dim, ()))
            continue
        source = size_sources(ctx, value, axis)[-1]
        sizes.append(symbolic_size(ctx, *source) or symbolic_size(ctx, value, axis))
    return sizes


def dimension_names(ctx: PassContext, value: ir.Value, feeds: Sequence[ir.Value]) -> list[str]:
    """The named dimensions ``value`` depends on, in order: those of the ``feeds``, then of
    every tensor whose shape its computation reads (a decoder's length beside the encoder's,
    in cross-attention)."""
    found: list[str] = []
    read = [*feeds]
    read += [n.inputs[0] for n in dependencies(value, set(feeds)) if n.op_type in ("Shape", "Size")]
    for operand in read:
        sizes = traced_sizes(ctx, operand) if operand is not None else None
        found += [name for size in sizes or () if size is not None for name in size[1]]
    return list(dict.fromkeys(found))


def probe_shape(ctx: PassContext, value: ir.Value, sizes: Mapping[str, int]) -> list[int]:
    """``value``'s shape with each named dimension set by ``sizes``."""
    traced = traced_sizes(ctx, value)
    if traced is None:
        raise Unevaluable(f"the shape of {value.name} is unknown")
    dims = []
    for axis, size in enumerate(traced):
        if size is None or any(name not in sizes for name in size[1]):
            dim = ctx.shape(value)[axis]  # type: ignore[index]
            raise Unevaluable(f"{value.name} has a dimension no probe size sets ({dim})")
        dims.append(size[0] * math.prod(sizes[name] for name in size[1]))
    return dims


def dependencies(value: ir.Value, feeds: set[ir.Value]) -> list[ir.Node]:
    """The nodes ``value`` is computed by, in an order that computes each after what it reads,
    stopping at constants, graph inputs, ``feeds`` and at Shape and Size (which read only a
    shape)."""
    start = value.producer()
    if start is None or value in feeds or constant_value(value) is not None:
        return []
    # In the order found (a dict, not a set): a set of nodes iterates in the order of their
    # addresses, which would make the first node a probe fails on, and so the near-miss
    # reason reported, depend on memory layout.
    cone: dict[ir.Node, None] = {}
    stack = [start]
    while stack:
        node = stack.pop()
        if node in cone:
            continue
        cone[node] = None
        if len(cone) > _MAX_NODES:
            raise Unevaluable(f"it depends on more than {_MAX_NODES} nodes")
        if node.domain not in ("", "ai.onnx") or any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in node.attributes.values()
        ):
            raise Unevaluable(f"it depends on {node.op_type} ({node.domain or 'ai.onnx'})")
        if node.op_type in ("Shape", "Size"):
            continue
        for operand in node.inputs:
            if operand is None or operand in feeds or constant_value(operand) is not None:
                continue
            producer = operand.producer()  # None: a graph input, which evaluate must be fed
            if producer is not None:
                stack.append(producer)
    return _in_order(cone)


def _in_order(cone: dict[ir.Node, None]) -> list[ir.Node]:
    """The cone's nodes, each after every cone node it reads (a Shape after the node whose
    output it reads the shape of): ordered within the cone, not by a walk of the graph."""
    order: list[ir.Node] = []
    placed: set[ir.Node] = set()
    for root in cone:
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if node in placed:
                continue
            if ready:
                placed.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            for operand in node.inputs:
                producer = operand.producer() if operand is not None else None
                if producer in cone and producer not in placed:
                    stack.append((producer, False))
    return order


def evaluate(
    ctx: PassContext,
    value: ir.Value,
    feeds: Mapping[ir.Value, np.ndarray],
    sizes: Mapping[str, int],
) -> np.ndarray:
    """``value`` computed from ``feeds``, with every named dimension a Shape reads set by
    ``sizes``; raises Unevaluable where that does not determine it."""
    known: dict[ir.Value, np.ndarray] = dict(feeds)

    def read(operand: ir.Value | None) -> np.ndarray | None:
        if operand is None:
            return None
        if operand in known:
            return known[operand]
        array = constant_value(operand)
        if array is None:
            raise Unevaluable(f"{operand.name} is not computed before it is read")
        return array

    for node in dependencies(value, set(feeds)):
        if node.op_type in ("Shape", "Size"):
            data = node.inputs[0]
            assert data is not None
            if data not in known:
                try:
                    dims = probe_shape(ctx, data, sizes)
                except Unevaluable as unsized:  # the sizes alone do not give it: the data may
                    try:
                        known[data] = evaluate(ctx, data, known, sizes)
                    except Unevaluable:
                        raise unsized from None
            if data in known:
                dims = known[data].shape
            if node.op_type == "Size":
                outputs = [np.array(int(np.prod(dims)), dtype=np.int64)]
            else:
                start = node.attributes.get_int("start", 0)
                end = node.attributes.get_int("end", None)
                outputs = [np.array(list(dims)[start:end], dtype=np.int64)]
        else:
            arrays = [read(v) for v in node.inputs]
            try:
                with np.errstate(all="ignore"):
                    computed = run_node(node, arrays, ctx.opset)
            except Exception as error:  # the reference raises its own types for bad operands
                raise Unevaluable(f"{node.op_type} fails on the probe: {error}") from None
            if computed is None:
                raise Unevaluable(f"{node.op_type} yields no tensor")
            outputs = computed
        known.update(zip(node.outputs, outputs, strict=False))
    return read(value)  # type: ignore[return-value]


def sampled(
    ctx: PassContext, value: ir.Value, *, seed: int = 0
) -> list[tuple[dict[str, int], np.ndarray]] | str:
    """``value`` computed at each probe size (with the probe) from random values of the graph
    inputs it reads, or why it cannot be. A recognizer asks this of a subgraph whose structure
    it cannot prove but whose answer does not depend on the input values (how a table of angles
    is laid out, whatever positions it is computed from): random inputs make a coincidence
    unlikely where a fixed one (all zeros) would not. Integer inputs take values in [0, 16), as
    positions and small indices do; floating ones standard normal values."""
    try:
        cone = dependencies(value, set())
    except Unevaluable as why:
        return str(why)
    inputs = list(
        dict.fromkeys(
            operand
            for node in cone
            if node.op_type not in ("Shape", "Size")
            for operand in node.inputs
            if operand is not None and operand.is_graph_input()
        )
    )
    sized = probes(dimension_names(ctx, value, inputs))
    if isinstance(sized, str):
        return sized
    rng = np.random.default_rng(seed)
    found = []
    for probe in sized:
        feeds: dict[ir.Value, np.ndarray] = {}
        try:
            for operand in inputs:
                dtype = ctx.dtype(operand)
                if dtype is None or not (dtype.is_integer() or dtype.is_floating_point()):
                    return f"{operand.name} is not a number tensor"
                shape = probe_shape(ctx, operand, probe)
                numbers = (
                    rng.integers(0, 16, shape) if dtype.is_integer() else rng.standard_normal(shape)
                )
                feeds[operand] = numbers.astype(dtype.numpy())
            found.append((probe, evaluate(ctx, value, feeds, probe)))
        except Unevaluable as why:
            return str(why)
    return found


def sampled_dims(
    samples: Sequence[tuple[Mapping[str, int], np.ndarray]],
) -> list[int | ir.SymbolicDim | None] | None:
    """Each axis's size as the samples show it: a size where it is the same in every probe, a
    named dimension where it is that name's probe size in every probe (no two names share a
    probe size), None otherwise; None where the samples differ in rank."""
    ranks = {array.ndim for _, array in samples}
    if len(ranks) != 1:
        return None
    dims: list[int | ir.SymbolicDim | None] = []
    for axis in range(ranks.pop()):
        sizes = [array.shape[axis] for _, array in samples]
        names = [
            name
            for name in samples[0][0]
            if all(probe.get(name) == size for (probe, _), size in zip(samples, sizes, strict=True))
        ]
        if len(set(sizes)) == 1:
            dims.append(sizes[0])
        elif len(names) == 1:
            dims.append(ir.SymbolicDim(names[0]))
        else:
            dims.append(None)
    return dims
