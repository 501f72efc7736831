"""Shapes: --input_shape in ATC syntax, and shapes inferred on demand for the passes."""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import math
import operator
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import onnx
import onnx.version_converter
import onnx_ir as ir
from onnx_ir.passes.common import _c_api_utils

from fusectl.errors import FusectlError
from fusectl.rewrite.contrib_inference import contrib_schemas
from fusectl.rewrite.graph import attribute_graphs, constant_value
from fusectl.rewrite.sizes import of_dim, product, quotient

logger = logging.getLogger("fusectl")


# A dimension named by arithmetic over other dimensions' names: Optimum declares a KV-cache
# model's mask and presents "past_sequence_length + sequence_length".
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_OPERATOR = re.compile(r"[-+*]")


def is_arithmetic(symbol: str) -> bool:
    """Whether a dimension's name may be arithmetic over other names (arithmetic_dim)."""
    return bool(_OPERATOR.search(symbol))


def arithmetic_dim(symbol: str, size: Callable[[str], int]) -> int | None:
    """The value of a dimension named ``a + b`` (``-``, ``*``, integer literals, parentheses),
    ``size`` giving each name's; None where the name is no such expression or comes to under 1."""
    if not is_arithmetic(symbol):
        return None
    try:
        tree = ast.parse(symbol, mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Name):
            return size(node.id)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(symbol)

    try:
        result = value(tree)
    except ValueError:
        return None
    return result if result >= 1 else None


def arithmetic_names(symbol: str) -> list[str]:
    """The names an arithmetic dimension's name is computed from (none for a plain name)."""
    if not is_arithmetic(symbol):
        return []
    try:
        tree = ast.parse(symbol, mode="eval")
    except SyntaxError:
        return []
    return [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]


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


_R = TypeVar("_R")


def _in_order(func: Callable[[onnx.ModelProto], _R], model: ir.Model) -> _R:
    """onnx-ir's call_onnx_api, the initializers kept in their order: it puts the large ones
    back last, and an output's bytes would then depend on when a pass asked for shapes (a
    second run would move the initializers added after the first run's last inference)."""
    initializers = model.graph.initializers
    order = list(initializers)
    try:
        return _c_api_utils.call_onnx_api(func, model)
    finally:
        if list(initializers) != order:
            values = [initializers.pop(name) for name in order]
            for value in values:
                initializers.add(value)


class ShapeOracle:
    """Fills in unknown value shapes with onnx shape inference, run once and only if asked.

    Exporters do not always record intermediate shapes (the TorchScript exporter writes no
    value_info), yet some rewrites depend on a rank. Inference runs on the graph as loaded,
    stripped of weights; a fusion keeps the names and meaning of the values it preserves, so
    shapes inferred for the original graph stay true for every value still carrying the name.
    """

    def __init__(
        self,
        model: ir.Model,
        proto: onnx.ModelProto | Callable[[], onnx.ModelProto] | None,
    ) -> None:
        """``proto``: the model as loaded, or a function that parses it (called only if
        inference runs); None to infer on the IR as it is."""
        self._model = model
        self._proto = proto
        self._original = proto  # the graph as loaded, for symbolic_dims
        self._symbolic: dict[str, list[int | str | None]] = {}
        self._symbolic_runs = 0  # on one value's inputs, then on the whole graph
        self.ran = False
        self.stale = False
        self._runs = 0
        self._filled: dict[ir.Value, None] = {}  # insertion-ordered: deterministic
        self._loop_state: bool | None = None  # whether a Loop or Scan carries state
        self._guessed: dict[ir.Value, None] = {}  # declared with a made-up name: re-derived
        self._had_guesses: bool | None = None  # whether the first read found any

    def invalidate(self) -> None:
        """The graph changed in a way that may make more shapes inferable (a constant was
        folded, a Slice went away): the next unknown or partly symbolic shape asked for
        infers again, on the graph as it is now, so that shapes are re-derived, not stale."""
        self.ran = False
        self.stale = True
        self._proto = None

    def _read_first(self) -> None:
        """On the first question, what of the declared shapes is not taken on trust: a Loop's
        or Scan's carried state (see _relax_loop_state), and names another tool's inference
        made up (see _guessed_values); inference runs at once where there are any."""
        if self._loop_state is not None:
            return
        graph = self._model.graph
        self._loop_state = _has_loop_state(graph)
        self._guessed = dict.fromkeys(_guessed_values(graph, dimension_names(graph.inputs)))
        self._had_guesses = bool(self._guessed)
        if (self._loop_state or self._guessed) and not self.ran:
            self._infer()

    def shape(self, value: ir.Value) -> ir.Shape | None:
        self._read_first()
        if not self.ran and (value.shape is None or (self.stale and not _is_static(value.shape))):
            self._infer()
        return value.shape

    def own_guesses(self) -> None:
        """own_guesses on the model, unless the first read found none: fusectl makes up no
        name of that form, so none can have come since (a walk of the graph spared)."""
        if self._had_guesses is not False:
            own_guesses(self._model.graph)

    def dtype(self, value: ir.Value) -> ir.DataType | None:
        self._read_first()
        if value.dtype is None and not self.ran:
            self._infer()
        return value.dtype

    def symbolic_dims(self, values: list[ir.Value]) -> list[list[int | str | None] | None]:
        """The values' dims as onnxruntime's symbolic shape inference derives them on the
        graph as loaded: sizes as expressions of the input dims (``floor(samples/5) - 1``),
        through Range, Slice, Conv and Expand arithmetic that onnx gives fresh names. Equal
        expressions are equal sizes. A fusion keeps the names and meaning of the values it
        keeps, so what it says of an original value stays true; values made by passes, and
        subgraph values, get None.

        It is slow (sympy), so it runs only when a pass asks, for a proof the ordinary shapes
        cannot make: first on the ops the values asked for depend on (an embedding's are
        few), then, if values outside those are asked for, once on the whole graph."""
        self._read_first()  # another tool's made-up names are not read: see _guessed_values
        names = [value.name or "" for value in values]
        missing = [name for name in names if name and name not in self._symbolic]
        if missing and self._symbolic_runs < 2:
            whole = self._symbolic_runs == 1
            found = self._infer_symbolic(None if whole else missing)
            if found is not None:
                self._symbolic.update(found)
                self._symbolic_runs += 1
        return [self._symbolic.get(name) if name else None for name in names]

    def same_shape(self, a: ir.Value, b: ir.Value) -> bool:
        """Whether two values provably have one shape: their inferred shapes are equal and
        fully known (sizes, or dimensions inference gave one symbol), or onnxruntime's symbolic
        inference derives the same expression for every size (a strided Conv's output size
        beside a 1x1 downsample's, where onnx gives each a fresh name)."""
        shapes = [self.shape(a), self.shape(b)]
        if equal_shapes(*shapes):
            return True
        if any(s is not None and len(s) != len(shapes[0] or s) for s in shapes):
            return False
        first, second = self.symbolic_dims([a, b])
        return first is not None and first == second and None not in first

    def _infer_symbolic(
        self, targets: list[str] | None
    ) -> dict[str, list[int | str | None]] | None:
        """Dims of every value the targets depend on (every value, for None); None when no
        target is a value of the graph as loaded."""
        quiet = logging.getLogger(_symbolic_inference().__module__)
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # it warns of every broadcast it cannot resolve
        graphs: list[Callable[[], onnx.ModelProto]] = []
        original = self._original
        if original is not None:

            def as_loaded() -> onnx.ModelProto:
                loaded = original() if callable(original) else original
                return _without_weights(loaded, self._model, {v.name for v in self._guessed})

            graphs.append(as_loaded)
        # onnxruntime's inference stops at an op it cannot read as loaded (an Unsqueeze whose
        # axes an Identity passes on); the graph as it is now has such constants folded.
        graphs.append(lambda: _in_order(lambda p: p, self._model))
        try:
            for graph in graphs:
                try:
                    proto: onnx.ModelProto | None = _past_identities(graph())
                    if targets is not None:
                        proto = _cone(proto, targets)
                    if proto is not None and len(proto.graph.node) > SYMBOLIC_NODE_LIMIT:
                        nodes = len(proto.graph.node)
                        logger.debug("symbolic shape inference skipped: %d nodes", nodes)
                        return {}
                    return _symbolic_dims(proto) if proto is not None else None
                except Exception as error:  # a best effort: without it, the proof is not made
                    logger.debug("symbolic shape inference failed: %s", error)
            return {}
        finally:
            quiet.setLevel(level)

    def _infer(self) -> None:
        self.ran = True
        self._runs += 1

        def infer(proto: onnx.ModelProto) -> onnx.ModelProto:
            with contrib_schemas():  # onnxruntime's ops, for this call
                return onnx.shape_inference.infer_shapes(
                    _inferable(proto), strict_mode=False, data_prop=not _names_repeat(proto.graph)
                )

        # Shapes this oracle filled in earlier, and declared shapes with a name another tool's
        # inference made up, are left out of what inference reads: onnx keeps a recorded
        # symbol over the one it would infer, so they would stay stale.
        earlier = [
            (value, value.shape)
            for value in (*self._filled, *self._guessed)
            if value.shape is not None
        ]
        for value, _ in earlier:
            value.shape = None
        try:
            if self._proto is not None:
                loaded = self._proto() if callable(self._proto) else self._proto
                guessed = {value.name for value in self._guessed}
                inferred = infer(_without_weights(loaded, self._model, guessed))
            else:  # onnx-ir's helper serialises the current graph without its large weights
                inferred = _in_order(infer, self._model)
        except Exception as error:  # inference is a best effort; passes decline without it
            logger.debug("shape inference failed: %s", error)
            inferred = None
        finally:
            for value, shape in earlier:
                value.shape = shape
        if inferred is None:
            return
        if _relax_loop_state(self._model.graph, _inferred_types(inferred.graph)):
            self._proto = None  # the relaxed IR is what inference reads from now on
            self._runs -= 1
            self._infer()
            return
        found = _inferred_types(inferred.graph)
        # The undotted made-up names inference read are the graph inputs' and outputs': the
        # computed values carrying others (another tool's guesses) were left out.
        main = self._model.graph
        interface = dimension_names([*main.inputs, *main.outputs])
        results: list[tuple[ir.Value, onnx.TypeProto, ir.Shape | None]] = []
        for key, graph in _graphs(self._model.graph):
            types = found.get(key, {})
            for node in graph:
                for value in node.outputs:
                    proto = types.get(value.name or "")
                    if proto is None or not proto.HasField("tensor_type"):
                        continue
                    shape = ir.serde.deserialize_type_proto_for_shape(proto)
                    if shape is not None:
                        shape = _own_symbols(shape, self._runs, interface)
                    results.append((value, proto, shape))
        same = _same_dims(results, self._runs)
        same.update(_minus_ones(results, same, self._runs))
        for value, proto, shape in results:
            self._take(value, proto, _renamed(shape, same) if same else shape)

    def _take(self, value: ir.Value, found: onnx.TypeProto, shape: ir.Shape | None) -> None:
        """Fill in the value's shape (and type) from what inference found for it."""
        # Recorded shapes are upgraded only once the graph changed, or where another tool's
        # inference made a name up: a graph no pass touched keeps the shapes fusectl gave it
        # (its own made-up names are told apart, see own_guesses), so a second run changes
        # nothing.
        if value.shape is None:
            value.shape = shape
            self._filled[value] = None
        elif value in self._guessed and _says_as_much(shape, value.shape):
            value.shape = shape  # its made-up names are then the ones the other values share
            del self._guessed[value]
            self._filled[value] = None
        elif self.stale and _more_static(shape, value.shape):
            value.shape = _upgraded(shape, value.shape)  # type: ignore[arg-type]
            self._filled[value] = None
        if value.type is None and found.tensor_type.elem_type:
            value.type = ir.serde.deserialize_type_proto_for_type(found)


# From this opset Reshape's inference gives its output the rank of a computed target (before,
# only a constant target's shape): every exporter's run-time head split.
_INFERABLE_OPSET = 14


def _inferable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` for shape inference: converted to opset 14 where it is older (onnx's version
    converter keeps the values' names and meaning), so that the shapes of a model exported at
    opset 11 or 13 are inferred as far as the same model's at opset 14; as it is where it is
    newer or the converter cannot convert it."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset >= _INFERABLE_OPSET:
        return proto
    try:
        return onnx.version_converter.convert_version(proto, _INFERABLE_OPSET)
    except Exception as error:  # the converter's adapters raise their own types
        logger.debug("opset %d kept for shape inference: %s", opset, error)
        return proto


def _past_identities(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with the main graph's nodes reading past its Identity nodes, for onnxruntime's
    symbolic inference only: it stops at an Identity, so a size copied through one (a head
    split's target read from a Gather via an Identity) was a fresh symbol, not the size it
    copies. The Identity nodes stay, so their outputs are inferred too."""
    graph = proto.graph
    source = {
        node.output[0]: node.input[0]
        for node in graph.node
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.input
    }
    if not source:
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for node in copy.graph.node:
        for index, name in enumerate(node.input):
            while name in source:
                name = source[name]
            node.input[index] = name
    return copy


def _names_repeat(graph: onnx.GraphProto) -> bool:
    """Whether a value name is computed in more than one graph (Optimum's merged decoder
    computes the same names in both If branches). onnx's data propagation keys the values it
    propagates by name alone, so there it gives a value another graph's contents (a
    ConstantOfShape of a 4-element shape came out 2-D): inference then runs without it."""
    seen: set[str] = set()

    def repeats(current: onnx.GraphProto) -> bool:
        own = {name for node in current.node for name in node.output if name}
        if own & seen:
            return True
        seen.update(own)
        return any(
            repeats(body)
            for node in current.node
            for attribute in node.attribute
            for body in ([attribute.g] if attribute.HasField("g") else list(attribute.graphs))
        )

    has_bodies = any(
        attribute.HasField("g") or attribute.graphs
        for node in graph.node
        for attribute in node.attribute
    )
    return has_bodies and repeats(graph)


# A subgraph's place in the model: for each enclosing graph attribute, the first output name
# of the node holding it (unique, and kept by every rewrite), the attribute, and its index.
_GraphKey = tuple[tuple[str, str, int], ...]


def _inferred_types(
    graph: onnx.GraphProto, key: _GraphKey = ()
) -> dict[_GraphKey, dict[str, onnx.TypeProto]]:
    """The value types shape inference wrote, per graph: the main graph and, nested at any
    depth, the If/Loop/Scan bodies (sibling branches may reuse a name)."""
    types = {info.name: info.type for info in graph.value_info}
    types.update((info.name, info.type) for info in graph.output)
    found = {key: types}
    for node in graph.node:
        anchor = node.output[0] if node.output else node.name
        for attribute in node.attribute:
            bodies = [attribute.g] if attribute.HasField("g") else list(attribute.graphs)
            for index, body in enumerate(bodies):
                found.update(_inferred_types(body, (*key, (anchor, attribute.name, index))))
    return found


def _relax_loop_state(graph: ir.Graph, found: dict[_GraphKey, dict[str, onnx.TypeProto]]) -> bool:
    """Forget the sizes a Loop or Scan body declares for its carried state where the body does
    not keep them: the exporter writes the initial value's shape (TorchScript's
    ``torch.cat`` accumulation declares its state [0, H, W], the empty start), true of the
    first iteration only, and what inference derives from it inside the body is as wrong (a
    Concat with that state taken for an empty operand). A size is kept where inference gives
    the body's next state the same static size (a fixed point). The body's other recorded
    shapes go too, to be inferred again from the relaxed state. Whether any was relaxed."""
    bodies = dict(_graphs(graph))
    relaxed = False
    for key, owner in bodies.items():
        for node in owner:
            carried = _carried_state(node)
            if carried is None:
                continue
            body_key = (*key, (_anchor(node), "body", 0))
            body, types = bodies.get(body_key), found.get(body_key, {})
            if body is None:
                continue
            changed = False
            for state_in, state_out in carried(body):
                shape = state_in.shape
                next_type = types.get(state_out.name or "")
                next_shape = (
                    ir.serde.deserialize_type_proto_for_shape(next_type)
                    if next_type is not None and next_type.HasField("tensor_type")
                    else None
                )
                if shape is None:
                    continue
                kept = [
                    dim
                    if not isinstance(dim, int)
                    or (
                        next_shape is not None
                        and len(next_shape) == len(shape)
                        and next_shape[axis] == dim
                    )
                    else ir.SymbolicDim(None)
                    for axis, dim in enumerate(shape)
                ]
                if kept != list(shape):
                    state_in.shape = ir.Shape(kept)
                    if state_out.shape is not None and len(state_out.shape) == len(kept):
                        state_out.shape = ir.Shape(
                            [
                                o if isinstance(k, int) or not isinstance(o, int) else k
                                for k, o in zip(kept, state_out.shape, strict=True)
                            ]
                        )
                    changed = True
            if changed:
                for inner in body:
                    for value in inner.outputs:
                        if not value.is_graph_output():
                            value.shape = None
                relaxed = True
    return relaxed


def _has_loop_state(graph: ir.Graph) -> bool:
    """Whether a Loop or Scan anywhere in the graph carries state whose declared shape
    _relax_loop_state checks. Runs on every model: the attributes of a node are read only
    where it may hold a graph (a control-flow op, or an op of another domain)."""
    for node in graph:
        if not _may_hold_graphs(node):
            continue
        carried = _carried_state(node)
        body = node.attributes.get("body")
        if carried is not None and body is not None and carried(body.as_graph()):
            return True
        for attribute in node.attributes.values():
            if any(_has_loop_state(sub) for sub in attribute_graphs(attribute)):
                return True
    return False


def _carried_state(
    node: ir.Node,
) -> Callable[[ir.Graph], list[tuple[ir.Value, ir.Value]]] | None:
    """For a Loop or Scan, the (body input, body output) pairs of its carried state."""
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Loop":
        return lambda body: list(zip(body.inputs[2:], body.outputs[1:], strict=False))
    if node.op_type == "Scan":
        scanned = node.attributes.get_int("num_scan_inputs", 0)
        states = len(node.inputs) - scanned
        return lambda body: list(zip(body.inputs[:states], body.outputs[:states], strict=False))
    return None


def _anchor(node: ir.Node) -> str:
    """What a node's subgraphs are keyed by: its first output's name, else its own."""
    return (node.outputs[0].name or "") if node.outputs else (node.name or "")


def _may_hold_graphs(node: ir.Node) -> bool:
    """Whether a node may have a graph attribute: a control-flow op, or an op of another
    domain. The attributes of the others are not read (a walk of every node of the model)."""
    standard = node.domain in ("", "ai.onnx")
    return not standard or node.op_type in ("If", "Loop", "Scan", "SequenceMap")


def _graphs(graph: ir.Graph, key: _GraphKey = ()) -> list[tuple[_GraphKey, ir.Graph]]:
    """The IR graph and its subgraphs, keyed as _inferred_types keys them."""
    found = [(key, graph)]
    for node in graph:
        if not _may_hold_graphs(node):
            continue
        for attribute in node.attributes.values():
            for index, body in enumerate(attribute_graphs(attribute)):
                found += _graphs(body, (*key, (_anchor(node), attribute.name, index)))
    return found


_SMALL_CONSTANT = 64

# onnxruntime's symbolic inference takes about a millisecond a node (sympy): past this many
# nodes on the graph it would read, a proof that needs it is not made (a near-miss instead).
SYMBOLIC_NODE_LIMIT = 5000


def _unowned(dim: int | ir.SymbolicDim, kept: set[str]) -> bool:
    """Whether a dimension's name is one shape inference made up (onnx's ``unk__N``,
    onnxruntime's) that is no one's yet: not fusectl's (``unk__R.N``, see _own_symbols), nor
    among ``kept`` (names the graph inputs declare: tf2onnx names their unknown sizes so)."""
    name = dim.value if isinstance(dim, ir.SymbolicDim) else None
    if not name or named(dim) or name in kept:
        return False
    return not (name.startswith("unk__") and "." in name)


def dimension_names(values: Sequence[ir.Value]) -> set[str]:
    """The dimension names the values' shapes carry."""
    return {
        dim.value
        for value in values
        if value.shape is not None
        for dim in value.shape
        if isinstance(dim, ir.SymbolicDim) and dim.value
    }


def _guessed_values(graph: ir.Graph, inputs: set[str]) -> list[ir.Value]:
    """The values the graph's nodes compute, at any depth, less the graph outputs, whose
    declared shape has a name another tool's shape inference made up where it could not
    follow a size (onnx's ``infer_shapes`` or onnxruntime's symbolic inference, run by users
    and converters before fusectl): fusectl's inference, with data propagation, may know it."""
    outputs = set(graph.outputs)
    verdicts: dict[int, bool] = {}  # per shape: the loader shares one among equal entries
    found = []
    for _, body in _graphs(graph):
        for node in body:
            for value in node.outputs:
                shape = value.shape
                if shape is None or value in outputs:
                    continue
                verdict = verdicts.get(id(shape))
                if verdict is None:
                    verdict = verdicts[id(shape)] = any(_unowned(dim, inputs) for dim in shape)
                if verdict:
                    found.append(value)
    return found


def own_guesses(graph: ir.Graph) -> None:
    """Write the made-up names another tool gave sizes that fusectl could not re-derive as
    fusectl's own (``unk__N`` -> ``unk__0.N``), so that a second run, which re-derives
    another tool's, keeps them: the output is what a second run makes of it."""
    inputs = dimension_names(graph.inputs)
    for value in _guessed_values(graph, inputs):
        value.shape = _own_symbols(value.shape, 0, inputs)  # type: ignore[arg-type]


def _own_symbols(shape: ir.Shape, run: int, kept: set[str]) -> ir.Shape:
    """The names onnx made up in inference run ``run`` (``unk__N`` counts from 0 in every run,
    and a cleared value's old name may come back for another size) kept apart from earlier
    runs' and from other tools' as ``unk__R.N``; fusectl's own from before and the ``kept``
    names stay."""
    return ir.Shape(
        [
            ir.SymbolicDim(f"unk__{run}.{dim.value.removeprefix('unk__')}")  # type: ignore[union-attr]
            if _unowned(dim, kept)
            else dim
            for dim in shape
        ]
    )


def _same_dims(
    results: list[tuple[ir.Value, onnx.TypeProto, ir.Shape | None]], run: int
) -> dict[str, int | ir.SymbolicDim]:
    """What each name a later run made up is, where a value that kept its shape from before
    shows it: a size, or the earlier name. Values first inferred in a later run (their input
    became inferable once a constant was folded) then share the earlier runs' names, so that a
    dimension is the same symbol everywhere and sizes compare as equal. A made-up name seen
    against several earlier dimensions proves them one: it stands for the one that says most
    (a size, then a name the inputs use, then the first seen)."""
    prefix = f"unk__{run}."
    found: dict[str, int | ir.SymbolicDim] = {}
    for value, _, shape in results:
        old = value.shape
        if shape is None or old is None or len(old) != len(shape):
            continue
        for new, before in zip(shape, old, strict=True):
            name = new.value if isinstance(new, ir.SymbolicDim) else None
            if not (name and name.startswith(prefix)):
                continue
            if isinstance(before, ir.SymbolicDim) and not before.value:
                continue
            if name not in found or _rank_of(before) > _rank_of(found[name]):
                found[name] = before
    return found


def _minus_ones(
    results: list[tuple[ir.Value, onnx.TypeProto, ir.Shape | None]],
    same: dict[str, int | ir.SymbolicDim],
    run: int,
) -> dict[str, int]:
    """The sizes a Reshape's -1 proves for the names this run made up there. onnx leaves a
    -1 unresolved as soon as a size is symbolic; where every other size of the data and of
    the result is known, the -1 is what remains of the data's after the result's cancel
    (``[batch, length, 4, 16]`` viewed ``[batch, length, 4, -1, 2]``: 8). The name stands for
    that size in every value that carries it. An export without its value_info (another
    tool dropped it) then has the shapes the exporter had declared."""
    prefix = f"unk__{run}."
    inferred = {value: shape for value, _, shape in results}
    found: dict[str, int] = {}
    known: dict[str, int | ir.SymbolicDim] = dict(same)  # and what is found, as it is

    def current(value: ir.Value) -> list[int | ir.SymbolicDim] | None:
        shape = _renamed(inferred.get(value, value.shape), known)
        return None if shape is None else list(shape)

    for value, _, _ in results:
        node = value.producer()
        if node is None or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            continue
        result = current(value)
        data = current(node.inputs[0]) if node.inputs[0] is not None else None
        if result is None or data is None or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        unknown = [i for i, dim in enumerate(result) if not (isinstance(dim, int) or named(dim))]
        if len(unknown) != 1:
            continue
        dim = result[unknown[0]]
        name = dim.value if isinstance(dim, ir.SymbolicDim) else None
        if not (name and name.startswith(prefix)):
            continue
        if _target_element(node.inputs[1], unknown[0], current) != -1:
            continue
        size = _quotient(data, [d for i, d in enumerate(result) if i != unknown[0]])
        if size is not None:
            found[name] = known[name] = size
    return found


def _target_element(
    target: ir.Value, index: int, shape: Callable[[ir.Value], list | None]
) -> int | None:
    """Element ``index`` of a Reshape target, where it is a constant: the whole target, or
    the part of a Concat of 1-D parts that holds it (the other parts' lengths known)."""
    array = constant_value(target)
    if array is not None:
        flat = array.reshape(-1)
        return int(flat[index]) if index < flat.size else None
    concat = target.producer()
    if concat is None or concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx"):
        return None
    start = 0
    for part in concat.inputs:
        length = (shape(part) or [None])[0] if part is not None else None
        if not isinstance(length, int):
            return None
        if index < start + length:
            array = constant_value(part)  # type: ignore[arg-type]
            return None if array is None else int(array.reshape(-1)[index - start])
        start += length
    return None


def _quotient(data: list[int | ir.SymbolicDim], kept: list[int | ir.SymbolicDim]) -> int | None:
    """The static size left when the ``kept`` sizes divide the ``data`` sizes' product (names
    cancel one for one); None where a name is left over or a size does not divide."""
    sizes = [[of_dim(dim) for dim in dims] for dims in (data, kept)]
    if any(size is None for dims in sizes for size in dims):
        return None
    total, known = (functools.reduce(product, dims, (1, ())) for dims in sizes)
    left = quotient(total, known)
    return left[0] if left is not None and not left[1] else None


def _renamed(shape: ir.Shape | None, same: dict[str, int | ir.SymbolicDim]) -> ir.Shape | None:
    """``shape`` with each made-up name that ``same`` knows replaced by what it stands for."""
    if shape is None:
        return None
    dims = [
        same.get(dim.value, dim) if isinstance(dim, ir.SymbolicDim) and dim.value else dim
        for dim in shape
    ]
    return ir.Shape(dims)


def _is_static(shape: ir.Shape) -> bool:
    return all(isinstance(dim, int) for dim in shape)


def _more_static(new: ir.Shape | None, old: ir.Shape) -> bool:
    """Whether inference on the changed graph knows more of a value's shape than before: the
    same rank, every known size kept, and one more size known, or one more dimension tied to
    a named one (an input's 'batch' where inference had made up 'unk__3'): shapes are
    re-derived, not stale."""
    if new is None or len(new) != len(old):
        return False
    pairs = list(zip(new, old, strict=True))
    if any(isinstance(o, int) and n != o for n, o in pairs):
        return False
    return any(_rank_of(n) > _rank_of(o) for n, o in pairs)


def _says_as_much(new: ir.Shape | None, old: ir.Shape) -> bool:
    """Whether ``new`` says at least what ``old`` says of every dimension: the same rank, each
    size kept, each name kept or proven a size, and each made-up name given a name or size."""
    if new is None or len(new) != len(old):
        return False
    return all(_says_as_much_of(n, o) for n, o in zip(new, old, strict=True))


def _says_as_much_of(new: int | ir.SymbolicDim, old: int | ir.SymbolicDim) -> bool:
    """_says_as_much of one dimension."""
    if isinstance(old, int) or named(old):
        return new == old or (isinstance(new, int) and not isinstance(old, int))
    return isinstance(new, int) or bool(new.value) or not old.value


def _upgraded(new: ir.Shape, old: ir.Shape) -> ir.Shape:
    """``old`` with each dim that ``new`` knows more of taken from ``new``: a size, or a name
    where ``old`` had one made up. A made-up name stays the old one, which the values that
    kept their shapes share (a fused op's output keeps its query's batch and sequence)."""
    return ir.Shape([n if _rank_of(n) > _rank_of(o) else o for n, o in zip(new, old, strict=True)])


def equal_shapes(a: ir.Shape | None, b: ir.Shape | None) -> bool:
    """Whether two shapes are known and equal: sizes, or dimensions with one symbol (an
    unnamed dimension equals nothing, not even another unnamed one)."""
    if a is None or a != b:
        return False
    return all(isinstance(dim, int) or dim.value for dim in a)


def keep_proven_dims(output: ir.Value, dims: list[int | ir.SymbolicDim | None]) -> None:
    """Record on a rewritten op's output the sizes its new inputs prove (None: nothing
    proven there): a later pass can then still prove that it matches the tensor those sizes
    were read from, where a name inference made up and recorded would outlive re-inference."""
    shape = output.shape
    if shape is None or len(shape) != len(dims):
        return
    output.shape = ir.Shape(
        [
            new
            if new is not None and not (isinstance(new, ir.SymbolicDim) and new.value is None)
            else old
            for new, old in zip(dims, shape, strict=True)
        ]
    )


# The names shape inference makes up for one value's size: onnx's ``unk__N`` (fusectl's
# own, ``unk__R.N``, included), onnxruntime's symbolic inference's ``<Op>_<node>_o<k>__d<j>``
# and its arithmetic over them (``floor(Pad_3_o0__d1/4)``).
_MADE_UP = re.compile(r"^unk__|_o\d+__d\d+(?!\w)")


def named(dim: int | ir.SymbolicDim | None) -> bool:
    """Whether a symbolic dim has a name that ties it to other values: not none, and not one
    shape inference made up for one value (_MADE_UP)."""
    name = dim.value if isinstance(dim, ir.SymbolicDim) else None
    return bool(name) and not _MADE_UP.search(str(name))


def _rank_of(dim: int | ir.SymbolicDim) -> int:
    """How much a dimension says: a size, a name shared with other values, or nothing."""
    return 2 if isinstance(dim, int) else int(named(dim))


@functools.cache
def _symbolic_inference() -> Any:
    """onnxruntime's SymbolicShapeInference class, its module loaded on its own: importing
    ``onnxruntime.tools`` imports torch where it is installed (seconds)."""
    spec = importlib.util.find_spec("onnxruntime")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "tools" / "symbolic_shape_infer.py"
    loader = importlib.util.spec_from_file_location("fusectl_ort_symbolic_shape_infer", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.SymbolicShapeInference


def _cone(proto: onnx.ModelProto, targets: list[str]) -> onnx.ModelProto | None:
    """The main graph cut down to the nodes the targets depend on (the whole graph where one
    of them has a subgraph, which may read any outer value); None if no node makes one."""
    producers = {output: node for node in proto.graph.node for output in node.output}
    if not any(target in producers for target in targets):
        return None
    kept: set[int] = set()
    pending = list(targets)
    while pending:
        node = producers.get(pending.pop())
        if node is None or id(node) in kept:
            continue
        if any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in node.attribute
        ):
            return proto
        kept.add(id(node))
        pending.extend(name for name in node.input if name)
    cone = onnx.ModelProto(ir_version=proto.ir_version)
    cone.opset_import.extend(proto.opset_import)
    cone.functions.extend(proto.functions)
    cone.graph.node.extend(node for node in proto.graph.node if id(node) in kept)
    cone.graph.input.extend(proto.graph.input)
    cone.graph.initializer.extend(proto.graph.initializer)
    cone.graph.value_info.extend(proto.graph.value_info)
    # onnxruntime's inference visits the nodes that lead to the graph's outputs
    made = [target for target in targets if target in producers]
    cone.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in made)
    return cone


def _symbolic_dims(proto: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Every main-graph value's dims by onnxruntime's symbolic shape inference, without its
    auto-merge: two different symbols broadcast together stay apart (they may be 1 and n),
    so what it derives follows from each op's arithmetic alone."""
    inference = _symbolic_inference()(2**31 - 1, False, False, 0)
    inference._preprocess(proto)
    while inference.run_:
        inference._infer_impl()
    found: dict[str, list[int | str | None]] = {}
    for name, info in inference.known_vi_.items():
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            found[name] = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in info.type.tensor_type.shape.dim
            ]
    return found


def _without_weights(
    proto: onnx.ModelProto, model: ir.Model, unread: set[str | None] | None = None
) -> onnx.ModelProto:
    """The loaded graph with weights reduced to their types, for shape inference only; the
    main graph's value_info of the ``unread`` values left out.

    Small integer initializers stay: they are the shapes and axes that data propagation reads.
    """
    stripped = onnx.ModelProto(ir_version=proto.ir_version)
    stripped.opset_import.extend(proto.opset_import)
    stripped.functions.extend(proto.functions)
    graph = stripped.graph
    graph.node.extend(proto.graph.node)
    graph.output.extend(proto.graph.output)
    graph.value_info.extend(
        info for info in proto.graph.value_info if not unread or info.name not in unread
    )
    graph.input.extend(ir.serde.serialize_value(value) for value in model.graph.inputs)
    declared = {value.name for value in model.graph.inputs}
    for tensor in proto.graph.initializer:
        small = (
            tensor.data_type == onnx.TensorProto.INT64
            and tensor.data_location != onnx.TensorProto.EXTERNAL
            and math.prod(tensor.dims) <= _SMALL_CONSTANT
        )
        if small:
            graph.initializer.append(tensor)
        elif tensor.name not in declared:
            graph.input.append(
                onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
            )
    return stripped
