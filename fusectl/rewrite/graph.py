"""Graph helpers every pass is written with: constants read through the data-movement ops
exporters put around them, whether a set of nodes can be removed, swapping a matched subgraph
for its replacement (names, counts, lineage, the bisection and --check_custom gates), dead-node
removal, new constants and Transposes, and bypassing pass-through nodes.

They are separate from the pattern driver (patterns.py) because passes that walk nodes rather
than match patterns (constant folding, concatenation, attention) use them as well.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

if TYPE_CHECKING:
    from fusectl.rewrite.context import PassContext

_FOLD_DEPTH = 4
# The ops a constant is seen through (see constant_value).
SEEN_THROUGH = frozenset({"Identity", "Cast", "Unsqueeze", "Squeeze", "Reshape"})


# The ONNX standard domain, as models name it (onnx-ir keeps an empty domain as "").
DEFAULT_DOMAINS = ("", "ai.onnx")


def constant_value(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents, else None.

    A constant is an initializer or a Constant node, possibly reshaped on the way by the
    data-movement ops exporters put there (Identity, Unsqueeze, Squeeze, Reshape, Cast), which
    are evaluated here without touching the graph. An initializer that is also a graph input is
    a default the caller may override, so it is not a constant (onnxruntime draws the same line).
    """
    return _fold_constant(value, depth=0)


# A Constant node's attribute, as the numpy type its value_* spelling stands for.
_CONSTANT_DTYPES = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def constant_scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant (an exponent, an epsilon), else None."""
    array = constant_value(value)
    return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None


# Ops whose output elements are some of their first input's (copied, repeated, rearranged) or,
# for Cast, each of them converted.
_TAKES_ELEMENTS = frozenset(
    {"Expand", "GatherElements", "Gather", "Slice", "Reshape", "Unsqueeze", "Squeeze", "Cast"}
    | {"Identity", "Transpose", "Flatten"}
)


def drawn_from(value: ir.Value | None, *, depth: int = 8) -> np.ndarray | None:
    """The constant whose elements are all ``value`` has, each possibly converted by a Cast:
    ``value`` taken from it by ops that only move elements (a Slice of a constant sized at run
    time, an Expand of one), or filled by ConstantOfShape (its fill). Whatever the sizes are,
    a property every element of the constant has that a conversion keeps (zero; zero or one)
    holds for ``value``."""
    for _ in range(depth):
        if value is None:
            return None
        array = constant_value(value)
        if array is not None:
            return array
        producer = value.producer()
        if producer is None or producer.domain not in DEFAULT_DOMAINS:
            return None
        if producer.op_type == "ConstantOfShape":
            fill = producer.attributes.get("value")
            return np.zeros(1, np.float32) if fill is None else fill.as_tensor().numpy()
        if producer.op_type not in _TAKES_ELEMENTS:
            return None
        value = producer.inputs[0]
    return None


def element_count(tensor: ir.TensorProtocol) -> int:
    """How many elements a tensor holds, from the stored dimensions where it is still a
    protobuf (onnx-ir's ``size`` builds the shape first: 8 µs a tensor, 0.2 s over the 23k
    initializers of a 100k-node graph)."""
    if isinstance(tensor, ir.serde.TensorProtoTensor):
        return math.prod(tensor.raw.dims)
    return tensor.size


def constant_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """An initializer's or a Constant node output's tensor. Not onnx-ir's get_const_tensor,
    which renames a Constant's tensor after its output: reading must not change the model."""
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if (
        producer is None
        or producer.op_type != "Constant"
        or producer.domain not in ("", "ai.onnx")
        or len(producer.attributes) != 1
    ):
        return None
    attr = next(iter(producer.attributes.values()))
    if attr.is_ref():
        return None
    if attr.name == "value":
        return attr.as_tensor()
    dtype = _CONSTANT_DTYPES.get(attr.name)
    return None if dtype is None else ir.tensor(np.array(attr.value, dtype=dtype))


# The arrays of the file's small tensors read during a run (see reading_constants), by
# tensor: scalars and vectors; a weight is converted each time it is read, not kept.
_CACHED_BYTES = 256
_ARRAYS: dict[int, tuple[ir.TensorProtocol, np.ndarray]] | None = None


@contextlib.contextmanager
def reading_constants() -> Iterator[None]:
    """Within the block, a tensor of the file is converted to an array once: checks read the
    same small constants (eps, 0.5, a bias) again and again, and each conversion copies the
    tensor out of its protobuf message. Only read-only arrays are kept, so no caller sees a
    change another made; they go when the block ends."""
    global _ARRAYS
    outer, _ARRAYS = _ARRAYS, {} if _ARRAYS is None else _ARRAYS
    try:
        yield
    finally:
        _ARRAYS = outer


def _array(tensor: ir.TensorProtocol) -> np.ndarray:
    if _ARRAYS is None or not isinstance(tensor, ir.serde.TensorProtoTensor):
        return tensor.numpy()
    found = _ARRAYS.get(id(tensor))
    if found is not None:
        return found[1]
    array = tensor.numpy()
    if not array.flags.writeable and array.nbytes <= _CACHED_BYTES:
        _ARRAYS[id(tensor)] = (tensor, array)  # the tensor is held: its id stays its own
    return array


def _fold_constant(value: ir.Value | None, depth: int) -> np.ndarray | None:
    if value is None or value.is_graph_input():
        return None
    producer = value.producer()
    if producer is None or producer.op_type == "Constant":
        tensor = constant_tensor(value)
        return None if tensor is None else _array(tensor)
    if depth >= _FOLD_DEPTH or producer.domain not in ("", "ai.onnx"):
        return None
    if producer.op_type not in SEEN_THROUGH:
        return None
    inputs = producer.inputs
    data = _fold_constant(inputs[0], depth + 1) if inputs else None
    if data is None:
        return None
    operand = _fold_constant(inputs[1], depth + 1) if len(inputs) > 1 and inputs[1] else None
    attrs = producer.attributes
    op_type = producer.op_type
    if op_type == "Identity":
        return data
    if op_type == "Cast":
        return data.astype(ir.DataType(attrs.get_int("to")).numpy())
    if op_type in ("Unsqueeze", "Squeeze"):
        axes = operand if operand is not None else attrs.get_ints("axes", None)
        if axes is None:
            return np.squeeze(data) if op_type == "Squeeze" else None
        axes = [int(a) for a in np.asarray(axes).reshape(-1)]
        if op_type == "Squeeze":
            return np.squeeze(data, axis=tuple(a % data.ndim for a in axes))
        rank = data.ndim + len(axes)
        for axis in sorted(a % rank for a in axes):
            data = np.expand_dims(data, axis)
        return data
    if op_type == "Reshape" and operand is not None:
        shape = [int(d) for d in operand.reshape(-1)]
        if not attrs.get_int("allowzero", 0):
            shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return data.reshape(shape)
    return None


def within(
    value: ir.Value | None,
    op_types: frozenset[str],
    *,
    upward: bool,
    depth: int = 5,
    stop: frozenset[str] = frozenset(),
) -> bool:
    """Whether a node of one of ``op_types`` is within ``depth`` ops of ``value``, following
    producers or readers, not through nodes of ``stop``."""
    if value is None or depth == 0:
        return False
    if upward:
        producer = value.producer()
        nodes = [producer] if producer is not None else []
    else:
        nodes = [user for user, _ in value.uses()]
    for node in nodes:
        if node.op_type in op_types:
            return True
        if node.op_type in stop:
            continue
        following = node.inputs if upward else node.outputs
        if any(within(v, op_types, upward=upward, depth=depth - 1, stop=stop) for v in following):
            return True
    return False


def attribute_graphs(attribute: ir.Attr) -> list[ir.Graph]:
    """The graphs an attribute holds: an If branch or Loop/Scan body, or a list of them."""
    if attribute.is_ref():
        return []
    if attribute.type == ir.AttributeType.GRAPH:
        return [attribute.as_graph()]
    if attribute.type == ir.AttributeType.GRAPHS:
        return list(attribute.as_graphs())
    return []


def node_axes(node: ir.Node) -> list[int] | None:
    """The axes of a Reduce*, Squeeze or Unsqueeze node: its constant second input (the
    newer opsets), else its attribute; None where neither is known."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_value(node.inputs[1])
        return None if array is None else [int(a) for a in array.reshape(-1)]
    axes = node.attributes.get_ints("axes", None)
    return None if axes is None else list(axes)


def squared(node: ir.Node | None) -> ir.Value | None:
    """d where the node is d * d or Pow(d, 2) (a variance's square, a norm's)."""
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    if node.op_type == "Pow" and len(node.inputs) == 2 and constant_scalar(node.inputs[1]) == 2.0:
        return node.inputs[0]
    return None


def transpose_perm(node: ir.Node, rank: int | None) -> list[int] | None:
    """A Transpose's perm: its attribute, else the reversal of ``rank`` axes (ONNX's default);
    None where neither is known."""
    perm = node.attributes.get_ints("perm", None)
    if perm is not None:
        return list(perm)
    return None if rank is None else list(reversed(range(rank)))


def inverse_perm(perm: list[int]) -> list[int]:
    """The perm that undoes ``perm``: Transpose(Transpose(x, perm), inverse_perm(perm)) is x."""
    result = [0] * len(perm)
    for position, axis in enumerate(perm):
        result[axis] = position
    return result


def producer_of(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The standard-domain ``op_type`` node that computes ``value``, else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def shape_of(value: ir.Value | None) -> ir.Node | None:
    """The Shape node that computes ``value``, through Casts between integer types on the way
    (tf2onnx reads a shape as int32 and casts it back)."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type == "Cast" and node.inputs[0] is not None:
        node = node.inputs[0].producer()
    return node if node is not None and node.op_type == "Shape" else None


def node_label(node: ir.Node) -> str:
    return node.name or (node.outputs[0].name if node.outputs else "") or node.op_type


def uses_outside(nodes: Sequence[ir.Node], kept: Sequence[ir.Value]) -> str | None:
    """Why ``nodes`` cannot be removed, if a value they compute (other than ``kept``) is
    needed elsewhere: a graph output, or an input of a node outside the set."""
    members = set(nodes)
    keep = set(kept)
    for node in nodes:
        for value in node.outputs:
            if value in keep:
                continue
            if value.is_graph_output():
                return f"an intermediate value ({node.op_type} output) is a graph output"
            for consumer, _ in value.uses():
                if consumer not in members:
                    where = "outside the match"
                    if consumer.graph is not node.graph:  # an If/Loop/Scan body reads it
                        body = consumer.graph.name if consumer.graph is not None else None
                        where = f"in the subgraph '{body}'" if body else "in a subgraph"
                    return (
                        f"an intermediate value ({node.op_type} output) is also used by "
                        f"{consumer.op_type} {where}"
                    )
    return None


def feedback(
    root: ir.Node,
    old_nodes: Sequence[ir.Node],
    new_nodes: Sequence[ir.Node],
    old_outputs: Sequence[ir.Value],
    new_outputs: Sequence[ir.Value],
) -> str | None:
    """Why the new nodes cannot replace the old, if that would close a cycle: a new node reading,
    through nodes outside the match, a value that a new node depending on it computes. Only a
    value the match computes before its root can lead back into it (a KV-cache Concat whose
    length a mask reads), as a pattern's inputs come before its root; so the walks start at
    those values' readers outside the match, and most rewrites walk nothing."""
    new = set(new_nodes)
    members = set(old_nodes)
    # The new nodes reading each node outside, and each new node's new producers.
    readers: dict[ir.Node, set[ir.Node]] = {}
    needs: dict[ir.Node, set[ir.Node]] = {node: set() for node in new_nodes}
    maker = {
        old: new_value.producer() for old, new_value in zip(old_outputs, new_outputs, strict=True)
    }
    for node in new_nodes:
        for value in node.inputs:
            if value is None:
                continue
            producer = value.producer()
            if value in maker:
                needs[node].add(maker[value])  # type: ignore[arg-type]
            elif producer in members:  # a pass reusing a size read it also removes
                return (
                    f"the new {node.op_type} would read {value.name}, which a removed node computes"
                )
            elif producer in new:
                needs[node].add(producer)  # type: ignore[arg-type]
            elif producer is not None:
                readers.setdefault(producer, set()).add(node)
    for value, made_by in maker.items():
        if value.producer() is root or not readers:
            continue
        pending = [user for user, _ in value.uses() if user not in members]
        seen: set[ir.Node] = set()
        while pending:
            node = pending.pop()
            if node in seen or node in members or node in new:
                continue
            seen.add(node)
            for reader in readers.get(node, ()):
                needs[reader].add(made_by)  # type: ignore[arg-type]
            pending += [user for output in node.outputs for user, _ in output.uses()]
    state: dict[ir.Node, bool] = {}  # False: on the walk's path, True: done

    def closes(node: ir.Node) -> bool:
        if node in state:
            return not state[node]
        state[node] = False
        if any(closes(need) for need in needs[node]):
            return True
        state[node] = True
        return False

    looped = next((node for node in new_nodes if closes(node)), None)
    if looped is None:
        return None
    return (
        f"the new {looped.op_type} would read a value computed from its own output (a size "
        "or mask read from a value it computes)"
    )


def attribute_reference(nodes: Sequence[ir.Node]) -> str | None:
    """Why ``nodes`` cannot be rewritten, if one of them takes an attribute from the function
    it is in (``pads = @pads``): the value is known only per call, so no pass can read it."""
    for node in nodes:
        attributes = node.attributes
        if not attributes:  # most nodes: spares iterating an empty UserDict (runs per site)
            continue
        for attribute in attributes.values():
            if attribute.is_ref():
                return (
                    f"{node.op_type} '{node_label(node)}' takes its attribute "
                    f"'{attribute.name}' from the function's '{attribute.ref_attr_name}'"
                )
    return None


def replace_subgraph(
    ctx: PassContext,
    pattern: str,
    root: ir.Node,
    old_nodes: Sequence[ir.Node],
    new_nodes: Sequence[ir.Node],
    old_outputs: Sequence[ir.Value],
    new_outputs: Sequence[ir.Value],
    new_initializers: Sequence[ir.Value] = (),
) -> str | None:
    """Swap matched nodes for new ones, as every pass does it: deterministic names
    (``<Pass>/<root>``), new outputs taking the old outputs' names and uses, new nodes placed
    at the root (which keeps the graph sorted), the effect counted and lineage stamped.

    The graph is left as it is when a site gate declines it (--check_custom finds the
    replacement computes something else, the knowledge repository measured it slower) or a
    bisection leaves this rewrite out (ctx.may_rewrite): the answer is then the reason,
    recorded as a decline; None means replaced."""
    graph = root.graph
    assert graph is not None
    # A matched value read past the match (a graph output, another node) cannot go: decline,
    # whatever the pass checked itself (after feedback, which names a new node's such reads).
    referenced = (
        attribute_reference(old_nodes)
        or feedback(root, old_nodes, new_nodes, old_outputs, new_outputs)
        or uses_outside(old_nodes, old_outputs)
    )
    if referenced is not None:
        ctx.pattern(pattern).decline(referenced, node_label(root))
        return _discarded(new_nodes, referenced)
    for gate in ctx.site_gates:
        declined = gate.review(
            ctx, pattern, node_label(root), old_nodes, new_nodes, old_outputs, new_outputs
        )
        if declined is not None:
            ctx.pattern(pattern).decline(declined, node_label(root))
            return _discarded(new_nodes, declined)
    refused = ctx.refusal(pattern, node_label(root))
    if refused is not None:
        return _discarded(new_nodes, refused)
    produced = {value for node in new_nodes for value in node.outputs}
    if any(value not in produced for value in new_outputs):
        raise ValueError(f"{ctx.spec.name}: a replacement output must come from a new node")
    if len(set(new_outputs)) != len(new_outputs):
        raise ValueError(f"{ctx.spec.name}: two matched values replaced by the same new value")
    base = f"{ctx.spec.name}/{node_label(root)}"
    replaced = set(new_outputs)
    for index, node in enumerate(new_nodes):
        node.name = ctx.names.claim(graph, base if index == 0 else f"{base}_{index}")
        for position, value in enumerate(node.outputs):
            if value not in replaced and not value.name:
                value.name = f"{node.name}:{position}"
    for initializer in new_initializers:
        graph.initializers[initializer.name] = initializer
    ir.convenience.replace_nodes_and_values(
        graph, root, old_nodes, new_nodes, old_outputs, new_outputs
    )
    ctx.removed.extend(old_nodes)
    ctx.record_fusion(pattern, old_nodes, new_nodes)
    for node in new_nodes:
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
            bypass(node)  # when it cannot go, the Identity stays: correct, just not minimal
    return None


def _discarded(new_nodes: Sequence[ir.Node], reason: str) -> str:
    """Drops a declined replacement's reads of the constants only it reads (those the pass
    added for it), which the dead-node pass then removes. Its reads of other values stay as
    they were: other passes' matches see them as before."""
    own = set(new_nodes)
    for node in new_nodes:
        for index, value in enumerate(node.inputs):
            if value is None or not value.is_initializer():
                continue
            if all(use.node in own for use in value.uses()):
                node.replace_input_with(index, None)
    return reason


def producers(node: ir.Node, graph: ir.Graph) -> list[ir.Node]:
    """The nodes of ``graph`` that ``node`` reads from, values its subgraphs capture included."""
    found: dict[ir.Node, None] = {}
    pending = [node]
    while pending:
        current = pending.pop()
        for value in current.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer.graph is graph:
                found[producer] = None
        for attr in current.attributes.values() if current.attributes else ():
            if attr.type == ir.AttributeType.GRAPH:
                pending.extend(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                for subgraph in attr.as_graphs():
                    pending.extend(subgraph)
    return list(found)


def live_nodes(graph: ir.Graph) -> set[ir.Node]:
    """The nodes of ``graph`` some graph output depends on (what DeadNodeEliminationPass keeps)."""
    live: set[ir.Node] = set()
    pending = [producer for value in graph.outputs if (producer := value.producer()) is not None]
    while pending:
        node = pending.pop()
        if node not in live:
            live.add(node)
            pending.extend(producers(node, graph))
    return live


def disconnect(nodes: list[ir.Node]) -> None:
    """Drop the inputs of nodes built for a rewrite that did not happen (never inserted), so
    that they do not stay readers of the graph's values."""
    for node in nodes:
        if node.graph is None:
            for index in range(len(node.inputs)):
                node.replace_input_with(index, None)


def remove_dead(graph: ir.Graph, nodes: list[ir.Node | None]) -> None:
    """Remove the nodes left without readers by a rewrite (the Shape a folded Gather read), and
    what only they read: later passes then see the graph as it will be saved."""
    while nodes:
        node = nodes.pop()
        if node is None or node.graph is not graph:
            continue
        if any(value.uses() or value.is_graph_output() for value in node.outputs):
            continue
        nodes += [value.producer() for value in node.inputs if value is not None]
        graph.remove(node, safe=True)


def new_constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer holding ``array``, named ``name`` or ``name_<n>`` if that is taken
    (nodes without a name give their sites one label)."""
    return _initializer(
        graph, name, array.dtype, array.shape, lambda name: ir.tensor(array, name=name)
    )


def concatenated_constant(
    graph: ir.Graph, name: str, parts: Sequence[np.ndarray], axis: int, dtype: np.dtype
) -> ir.Value:
    """A new initializer holding ``parts`` joined along ``axis``, computed whenever it is read
    (in practice once, when the model is saved): packed weights (QKV) would otherwise be a
    second copy of their parts in memory for the whole run."""
    shape = list(parts[0].shape)
    shape[axis] = sum(part.shape[axis] for part in parts)

    def join() -> np.ndarray:
        return np.concatenate(parts, axis=axis).astype(dtype)

    return _lazy_initializer(graph, name, np.dtype(dtype), shape, join)


def taken_constant(
    graph: ir.Graph, name: str, source: ir.Value, indices: np.ndarray, axis: int
) -> ir.Value:
    """A new initializer holding ``source``'s constant at ``indices`` along ``axis``, taken
    whenever it is read (as concatenated_constant): a weight's columns would otherwise be a
    second copy of the weight in memory for the whole run."""
    tensor = constant_tensor(source)
    folded = constant_value(source) if tensor is None else None
    sample = folded if folded is not None else tensor
    assert sample is not None, "taken_constant reads a constant"
    shape = list(sample.shape)
    shape[axis] = len(indices)
    dtype = folded.dtype if folded is not None else tensor.dtype.numpy()  # type: ignore[union-attr]

    def take() -> np.ndarray:
        array = folded if folded is not None else tensor.numpy()  # type: ignore[union-attr]
        return np.take(array, indices, axis=axis)

    return _lazy_initializer(graph, name, np.dtype(dtype), shape, take)


def _lazy_initializer(
    graph: ir.Graph, name: str, dtype: np.dtype, shape: list[int], compute: Callable[[], np.ndarray]
) -> ir.Value:
    """A new initializer whose contents ``compute`` gives when they are first read."""

    def tensor(name: str) -> ir.TensorProtocol:
        return ir.LazyTensor(
            lambda: ir.tensor(compute(), name=name),
            dtype=ir.DataType.from_numpy(dtype),
            shape=ir.Shape(shape),
            name=name,
        )

    return _initializer(graph, name, dtype, tuple(shape), tensor)


def _initializer(
    graph: ir.Graph,
    name: str,
    dtype: np.dtype,
    shape: Sequence[int],
    tensor: Callable[[str], ir.TensorProtocol],
) -> ir.Value:
    candidate, suffix = name, 0
    while candidate in graph.initializers:
        suffix += 1
        candidate = f"{name}_{suffix}"
    value = ir.Value(
        name=candidate,
        type=ir.TensorType(ir.DataType.from_numpy(dtype)),
        shape=ir.Shape(shape),
        const_value=tensor(candidate),
    )
    graph.initializers[candidate] = value
    return value


_D = ir.DataType
# What holds every uint8 exactly; bool (0 and 1) fits in int8 and uint8 too.
_WIDER_THAN_UINT8 = frozenset(
    {_D.INT16, _D.UINT16, _D.INT32, _D.UINT32, _D.INT64, _D.UINT64}
    | {_D.FLOAT16, _D.BFLOAT16, _D.FLOAT, _D.DOUBLE}
)
# For each type, the types that hold every one of its values exactly.
_LOSSLESS: dict[ir.DataType, frozenset[ir.DataType]] = {
    _D.BOOL: _WIDER_THAN_UINT8 | {_D.INT8, _D.UINT8},
    _D.UINT8: _WIDER_THAN_UINT8,
    _D.INT8: frozenset(
        {_D.INT16, _D.INT32, _D.INT64, _D.FLOAT16, _D.BFLOAT16, _D.FLOAT, _D.DOUBLE}
    ),
    _D.UINT16: frozenset({_D.INT32, _D.UINT32, _D.INT64, _D.UINT64, _D.FLOAT, _D.DOUBLE}),
    _D.INT16: frozenset({_D.INT32, _D.INT64, _D.FLOAT, _D.DOUBLE}),
    _D.UINT32: frozenset({_D.INT64, _D.UINT64, _D.DOUBLE}),
    _D.INT32: frozenset({_D.INT64, _D.DOUBLE}),
    _D.FLOAT16: frozenset({_D.FLOAT, _D.DOUBLE}),
    _D.BFLOAT16: frozenset({_D.FLOAT, _D.DOUBLE}),
    _D.FLOAT: frozenset({_D.DOUBLE}),
}


def lossless(source: ir.DataType, target: ir.DataType) -> bool:
    """Whether ``target`` holds every value of ``source`` exactly (a Cast there loses nothing)."""
    return target in _LOSSLESS.get(source, frozenset())


def typed(value: ir.Value, dtype: ir.DataType | None, shape: ir.Shape | None) -> ir.Value:
    """Record what a pass knows of a new value: onnx shape inference cannot see through the
    contrib ops, and a later run would otherwise infer (and write) what this one did not."""
    value.type = ir.TensorType(dtype) if dtype is not None else None
    value.shape = shape
    return value


# From this opset Unsqueeze takes its axes as an input; before, as an attribute.
_AXES_INPUT_OPSET = 13


def new_unsqueeze(
    ctx: PassContext, graph: ir.Graph, value: ir.Value, axes: list[int], name: str
) -> ir.Node:
    """A new Unsqueeze(value, axes) in the form of the model's opset: the axes a constant
    named ``name`` from opset 13, an attribute before (a model exported at opset 11)."""
    if ctx.opset < _AXES_INPUT_OPSET:
        return ir.node("Unsqueeze", [value], attributes={"axes": axes})
    return ir.node("Unsqueeze", [value, new_constant(graph, name, np.array(axes, np.int64))])


# From this opset ReduceMean takes its axes as an input; before, as an attribute.
_REDUCE_AXES_INPUT_OPSET = 18


def new_reduce_mean(
    ctx: PassContext, graph: ir.Graph, value: ir.Value, axes: list[int], name: str
) -> ir.Node:
    """A new ReduceMean(value, axes) keeping its axes, in the form of the model's opset: the
    axes a constant named ``name`` (shared, where one holds them already) from opset 18, an
    attribute before."""
    if ctx.opset < _REDUCE_AXES_INPUT_OPSET:
        return ir.node("ReduceMean", [value], attributes={"axes": axes, "keepdims": 1})
    constant = graph.initializers.get(name)
    held = constant_value(constant) if constant is not None else None
    if held is None or held.tolist() != axes:
        constant = new_constant(graph, name, np.array(axes, np.int64))
    return ir.node("ReduceMean", [value, constant], attributes={"keepdims": 1})


def new_transpose(ctx: PassContext, value: ir.Value, perm: list[int]) -> tuple[ir.Value, ir.Node]:
    """A new Transpose(value, perm), its output typed with the permuted shape where known."""
    swap = ir.node("Transpose", [value], attributes={"perm": perm})
    shape = ctx.shape(value)
    permuted = ir.Shape([shape[axis] for axis in perm]) if shape is not None else None
    typed(swap.outputs[0], ctx.dtype(value), permuted)
    return swap.outputs[0], swap


def bypass(node: ir.Node, index: int = 0) -> str | None:
    """Remove a pass-through node (Identity, inference Dropout, ``x * 1``) by wiring its input
    ``index`` to its consumers; None when done, else why it stays. A graph output keeps its
    name, type and shape: the producer of the input takes them over, unless the input is
    itself a graph input, initializer or another graph output."""
    reason = bypass_refusal(node, index)
    if reason is not None:
        return reason
    graph = node.graph
    assert graph is not None
    source, result = node.inputs[index], node.outputs[0]
    assert source is not None
    if result.is_graph_output():
        ir.convenience.replace_all_uses_with(result, source, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        source.name = result.name
        source.type = result.type or source.type
        source.shape = result.shape or source.shape
        return None
    ir.convenience.replace_all_uses_with(result, source)
    graph.remove(node, safe=True)
    return None


def bypass_refusal(node: ir.Node, index: int = 0) -> str | None:
    """Why bypass(node, index) would leave the node in place, without touching the graph."""
    source, result = node.inputs[index], node.outputs[0]
    if source is None:
        return "it has no input"
    if result.is_graph_output():
        if source.graph is not node.graph:  # a subgraph output must be made in the subgraph
            return "it copies a value of an enclosing graph to a subgraph output"
        if source.is_graph_input() or source.is_initializer():
            return "it links a graph input or initializer straight to a graph output"
        if source.is_graph_output():
            return "it copies one graph output to another"
    return None


# Shape arithmetic: sizes, and the Equal(-1) tests of the Where(Equal(s, -1), 1, s) idiom.
INDEX_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL})


def absorb_shape_arithmetic(ctx: PassContext, nodes: list[ir.Node], keep: set[ir.Value]) -> None:
    """Add the integer side computations (Shape -> Gather -> Concat ... -> a Reshape's target)
    that exist only for the matched nodes: they die with them. Values in ``keep`` (what the
    fused op reads) are never absorbed."""
    members = set(nodes)
    changed = True
    while changed:
        changed = False
        for node in list(nodes):  # the list, not the set: lineage follows a stable order
            for value in node.inputs:
                producer = value.producer() if value is not None else None
                if producer is None or producer in members or value in keep:
                    continue
                outputs = producer.outputs
                if any(ctx.dtype(v) not in INDEX_TYPES or v.is_graph_output() for v in outputs):
                    continue
                if all(user in members for v in outputs for user, _ in v.uses()):
                    members.add(producer)
                    nodes.append(producer)
                    changed = True


# Constants up to this many elements are compared by value.
_COMPARED_CONSTANT_LIMIT = 16

# Ops that compute something else at each run: never one computation with another node.
RANDOM_OPS = frozenset(
    {
        "RandomUniform",
        "RandomNormal",
        "RandomUniformLike",
        "RandomNormalLike",
        "Multinomial",
        "Bernoulli",
    }
)


def computation_key(node: ir.Node, merged: dict[ir.Value, ir.Value] | None = None) -> tuple | None:
    """What the node computes: op, attributes and inputs (each as ``merged`` maps it); two nodes
    with one key compute one value. None for what is not compared (large constants, subgraphs,
    random ops)."""
    if node.op_type in RANDOM_OPS:
        return None
    merged = merged or {}
    attributes = []
    for name, attribute in sorted(node.attributes.items()):
        content = attribute.value
        if attribute.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return None
        if isinstance(content, ir.TensorProtocol):
            if content.size > _COMPARED_CONSTANT_LIMIT:
                return None
            content = (content.dtype, tuple(content.shape), content.tobytes())
        attributes.append((name, repr(content)))
    inputs = tuple(_input_key(merged.get(v, v)) if v is not None else None for v in node.inputs)
    return (node.domain, node.op_type, node.overload, inputs, tuple(attributes))


def _input_key(value: ir.Value) -> object:
    """A small initializer by its contents (equal constants lifted from separate Constant
    nodes are one input), any other value by identity."""
    tensor = value.const_value
    if tensor is None or value.is_graph_input() or tensor.size > _COMPARED_CONSTANT_LIMIT:
        return id(value)
    return tensor.dtype, tuple(tensor.shape), tensor.tobytes()
