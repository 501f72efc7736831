"""Input validation right after load, before any pass, and the output check before saving.

A model that onnxruntime could not load (a cycle, a value nothing defines, two producers of one
value, an IR version or opset outside what the installed onnx/onnxruntime support, broken types
or initializer sizes) is refused with one line (exit 2). What only onnx.checker objects to while
onnxruntime runs the model (nodes out of topological order, graph outputs without a type) is
passed through with a warning. docs/input-validation.md lists every check and its class.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx.defs
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, TypeProto

from fusectl.errors import FusectlError
from fusectl.rewrite import runtime
from fusectl.rewrite.graph import attribute_graphs, element_count, live_nodes

logger = logging.getLogger("fusectl")

# IR version 3 introduced opset imports; onnx (and onnxruntime with it) reads up to its own.
MIN_IR_VERSION = 3
MAX_IR_VERSION = onnx.IR_VERSION
_ATTRIBUTE_TYPES = frozenset(onnx.AttributeProto.AttributeType.values()) - {
    onnx.AttributeProto.UNDEFINED
}
_VALID_DTYPES = frozenset(TensorProto.DataType.values()) - {TensorProto.UNDEFINED}
# Bits per element of every type with a fixed size (not strings); some pack below a byte.
_DTYPE_BITS = {
    dtype: 8 * onnx.helper.tensor_dtype_to_np_dtype(dtype).itemsize
    for dtype in _VALID_DTYPES - {TensorProto.STRING}
}
for _name, _bits in (
    ("UINT4", 4),
    ("INT4", 4),
    ("FLOAT4E2M1", 4),
    ("UINT2", 2),
    ("INT2", 2),
    ("FLOAT6E2M3", 6),
    ("FLOAT6E3M2", 6),
):
    if hasattr(TensorProto, _name):
        _DTYPE_BITS[getattr(TensorProto, _name)] = _bits
# The field an attribute of each single-value type keeps its value in.
_ATTRIBUTE_FIELDS = {
    onnx.AttributeProto.FLOAT: "f",
    onnx.AttributeProto.INT: "i",
    onnx.AttributeProto.STRING: "s",
    onnx.AttributeProto.TENSOR: "t",
    onnx.AttributeProto.GRAPH: "g",
    onnx.AttributeProto.SPARSE_TENSOR: "sparse_tensor",
    onnx.AttributeProto.TYPE_PROTO: "tp",
}


class OutputInvariantError(FusectlError):
    """A valid input gave an invalid output: a fusectl bug, exit 3, and nothing written."""

    exit_code = 3
    label = "internal error"


@dataclass(frozen=True)
class Finding:
    message: str
    error: bool


@dataclass
class _Scope:
    """What one graph defines, for reads from its nodes and its subgraphs."""

    defined: set[str]
    outer: _Scope | None = None
    outer_reads: set[str] = field(default_factory=set)

    def resolves(self, name: str) -> bool:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.defined:
                return True
            scope = scope.outer
        return False


# Read once, before fusectl registers schemas for a while (contrib_inference's): onnx keeps a
# domain in this map after its last schema is removed, and a contrib domain in it would be
# checked against schemas it no longer has.
_ONNX_OPSETS = dict(onnx.defs.C.schema_version_map())


def supported_opsets() -> dict[str, tuple[int, int]]:
    """Version range per operator domain that the installed onnx defines (and onnxruntime,
    built against it, loads)."""
    return dict(_ONNX_OPSETS)


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return f"'{node.name}'" if node.name else f"#{index} ({node.op_type})"


def _type_problem(type_proto: TypeProto) -> str | None:
    """Why a value's type is unusable, or None."""
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" or kind == "sparse_tensor_type":
        elem = getattr(type_proto, kind).elem_type
        return None if elem in _VALID_DTYPES else f"unknown element type {elem}"
    if kind in ("sequence_type", "optional_type"):
        inner = getattr(type_proto, kind)
        return _type_problem(inner.elem_type) if inner.HasField("elem_type") else None
    if kind == "map_type":
        if type_proto.map_type.key_type not in _VALID_DTYPES:
            return f"unknown map key type {type_proto.map_type.key_type}"
        return _type_problem(type_proto.map_type.value_type)
    return None if kind is not None else "no type"


def _tensor_problem(tensor: TensorProto) -> str | None:
    """Why an initializer's stored data cannot be its declared shape and type, or None."""
    if tensor.data_type not in _VALID_DTYPES:
        return f"has unknown element type {tensor.data_type}"
    if any(d < 0 for d in tensor.dims):
        return f"has a negative dimension in its shape {list(tensor.dims)}"
    if tensor.data_location == TensorProto.EXTERNAL:
        return None  # sizes are checked against the data file by model_io
    count = math.prod(tensor.dims)
    if tensor.data_type == TensorProto.STRING:
        if tensor.HasField("raw_data"):
            return "is a string tensor with raw data"
        if len(tensor.string_data) != count:
            return (
                f"holds {len(tensor.string_data)} strings; shape {list(tensor.dims)} needs {count}"
            )
        return None
    bits = _DTYPE_BITS[tensor.data_type]
    if tensor.HasField("raw_data"):
        needed = (count * bits + 7) // 8
        if len(tensor.raw_data) != needed:
            return (
                f"holds {len(tensor.raw_data)} bytes; shape {list(tensor.dims)} of "
                f"{TensorProto.DataType.Name(tensor.data_type)} needs {needed}"
            )
        return None
    if bits % 8:
        return None  # packed values in int32_data: left to onnxruntime
    held = len(getattr(tensor, onnx.helper.tensor_dtype_to_field(tensor.data_type)))
    complex_parts = 2 if tensor.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128) else 1
    if held != count * complex_parts:
        return f"holds {held} values; shape {list(tensor.dims)} needs {count * complex_parts}"
    return None


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def _cycle(reads: list[set[int]]) -> list[int] | None:
    """Node indices forming a cycle (in data-flow order), or None when the graph is acyclic;
    ``reads[i]`` holds the nodes whose outputs node i reads."""
    pending = [len(r) for r in reads]
    readers: list[list[int]] = [[] for _ in reads]
    for index, sources in enumerate(reads):
        for source in sources:
            readers[source].append(index)
    ready = [i for i, count in enumerate(pending) if count == 0]
    while ready:
        for reader in readers[ready.pop()]:
            pending[reader] -= 1
            if pending[reader] == 0:
                ready.append(reader)
    stuck = [i for i, count in enumerate(pending) if count > 0]
    if not stuck:
        return None
    # Every stuck node reads a stuck node: walking back from one must come round again.
    seen: dict[int, int] = {}
    path: list[int] = []
    current = stuck[0]
    while current not in seen:
        seen[current] = len(path)
        path.append(current)
        current = next(s for s in sorted(reads[current]) if pending[s] > 0)
    return list(reversed(path[seen[current] :]))


class _Validator:
    def __init__(self, proto: onnx.ModelProto) -> None:
        self.proto = proto
        self.findings: list[Finding] = []
        self.ranges = supported_opsets()
        self.opsets = {entry.domain or "ai.onnx": entry.version for entry in proto.opset_import}
        self.functions = {(f.domain, f.name) for f in proto.functions}
        self.schemas: dict[tuple[str, str], onnx.defs.OpSchema | None] = {}

    def error(self, message: str) -> None:
        self.findings.append(Finding(message, error=True))

    def warning(self, message: str) -> None:
        self.findings.append(Finding(message, error=False))

    def run(self) -> list[Finding]:
        self.versions()
        proto = self.proto
        texts = [proto.producer_name, proto.producer_version, proto.domain, proto.doc_string]
        texts += [entry.domain for entry in proto.opset_import]
        texts += [text for entry in proto.metadata_props for text in (entry.key, entry.value)]
        if _has_bytes(texts):
            self.error("model metadata (producer, domain, doc string) is not valid UTF-8 text")
        self.graph(proto.graph, None, "")
        return self.findings

    def versions(self) -> None:
        ir_version = self.proto.ir_version
        if not MIN_IR_VERSION <= ir_version <= MAX_IR_VERSION:
            self.error(
                f"unsupported IR version {ir_version} (onnx {onnx.__version__} and the "
                f"onnxruntime built on it support {MIN_IR_VERSION} to {MAX_IR_VERSION})"
            )
        for domain, version in self.opsets.items():
            known = self.ranges.get("" if domain == "ai.onnx" else domain)
            if known is not None and not known[0] <= version <= known[1]:
                self.error(
                    f"unsupported opset {version} of domain '{domain}' (onnx "
                    f"{onnx.__version__} supports {known[0]} to {known[1]})"
                )

    def operator(self, node: onnx.NodeProto, label: str) -> onnx.defs.OpSchema | None:
        """The op's schema; each (domain, op type) is checked once: imported, and an operator
        of its domain's opset (custom and contrib domains have no schema here)."""
        key = (node.domain, node.op_type)
        if key not in self.schemas:
            self.schemas[key] = self.schema(key, label)
        return self.schemas[key]

    def schema(self, key: tuple[str, str], label: str) -> onnx.defs.OpSchema | None:
        if _has_bytes(key):
            self.error(f"node {label} has an op type or domain that is not valid UTF-8 text")
            return None
        domain = key[0] or "ai.onnx"
        if domain not in self.opsets:
            self.error(f"node {label} uses domain '{domain}', which the model does not import")
            return None
        schema_domain = "" if domain == "ai.onnx" else domain
        if schema_domain not in self.ranges or key in self.functions:
            return None
        try:
            return onnx.defs.get_schema(key[1], self.opsets[domain], schema_domain)
        except onnx.defs.SchemaError:
            if schema_domain == "" and runtime.has_kernel(key[1], "", self.opsets[domain], None):
                # onnxruntime's own ops in the ONNX domain (SimplifiedLayerNormalization, which
                # its optimizer and onnxscript's write): it runs them, so they are no fault
                return None
            self.error(
                f"op '{key[1]}' is not in domain '{domain}' at opset {self.opsets[domain]} "
                f"(node {label})"
            )
            return None

    def attributes(
        self, node: onnx.NodeProto, label: str, schema: onnx.defs.OpSchema | None
    ) -> None:
        """Attribute types: valid, and the ones the op's schema declares."""
        for attribute in node.attribute:
            if attribute.ref_attr_name:
                continue  # a function body's reference, typed by the caller
            if attribute.type not in _ATTRIBUTE_TYPES:
                self.error(f"node {label}: attribute '{attribute.name}' has no valid type")
                continue
            field = _ATTRIBUTE_FIELDS.get(attribute.type)
            if field is not None and not attribute.HasField(field):
                self.error(f"node {label}: attribute '{attribute.name}' holds no value of its type")
                continue
            for tensor in (*([attribute.t] if field == "t" else []), *attribute.tensors):
                problem = _tensor_problem(tensor)
                if problem is not None:
                    self.error(f"node {label}: attribute '{attribute.name}'s tensor {problem}")
            if schema is None:
                continue
            declared = schema.attributes.get(attribute.name)
            if declared is None:
                self.error(f"node {label}: {node.op_type} has no attribute '{attribute.name}'")
            elif declared.type.value != attribute.type:
                self.error(
                    f"node {label}: attribute '{attribute.name}' is "
                    f"{onnx.AttributeProto.AttributeType.Name(attribute.type)}, "
                    f"{node.op_type} takes {declared.type.name}"
                )

    def signature(self, graph: onnx.GraphProto, where: str) -> None:
        """The types of the graph's inputs and outputs (an output may leave its type to
        inference, as onnxruntime does; onnx.checker wants it declared)."""
        for kind, values in (("input", graph.input), ("output", graph.output)):
            for value in values:
                problem = _type_problem(value.type)
                if problem == "no type" and kind == "output":
                    self.warning(f"{where}graph output '{value.name}' declares no type")
                elif problem is not None:
                    self.error(f"{where}graph {kind} '{value.name}' has {problem}")
                elif kind == "input" and not where:
                    self.one_name_for_two_axes(value)

    def one_name_for_two_axes(self, value: onnx.ValueInfoProto) -> None:
        """A script that makes every axis dynamic with one name (``"?"``) declares them one
        size: the passes prove on that, and the output may not run where they differ (ImageGPT
        and XLNet fused so fail at the attention's bias where batch and sequence differ)."""
        seen: dict[str, int] = {}
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if not dim.dim_param:
                continue
            if dim.dim_param in seen:
                self.warning(
                    f"graph input '{value.name}' names axes {seen[dim.dim_param]} and {axis} "
                    f"both '{dim.dim_param}': equal names are one size to fusectl, as to "
                    "onnxruntime, so the output may not run where they differ; name them apart"
                )
                return
            seen[dim.dim_param] = axis

    def graph(self, graph: onnx.GraphProto, outer: _Scope | None, where: str) -> set[str]:
        """Check one graph and its subgraphs; returns the names it reads from outer scopes.
        ``where`` prefixes the messages about a subgraph ("" for the main graph)."""
        scope = _Scope(set(), outer)
        self.signature(graph, where)
        scope.defined.update(value.name for value in graph.input)
        for tensor in graph.initializer:
            problem = _tensor_problem(tensor)
            if problem is not None:
                self.error(f"{where}initializer '{tensor.name}' {problem}")
            scope.defined.add(tensor.name)
        scope.defined.update(sparse.values.name for sparse in graph.sparse_initializer)
        nodes = list(graph.node)
        inputs = [[name for name in node.input if name] for node in nodes]
        outputs = [[name for name in node.output if name] for node in nodes]
        producers: dict[str, int] = {}
        for index, names in enumerate(outputs):
            for name in names:
                if name in producers or name in scope.defined:
                    first = producers.get(name)
                    origin = (
                        f"node {_node_label(nodes[first], first)}"
                        if first is not None
                        else "a graph input or initializer"
                    )
                    self.error(
                        f"{where}value '{name}' has two producers: {origin} and node "
                        f"{_node_label(nodes[index], index)}"
                    )
                else:
                    producers[name] = index
        scope.defined.update(producers)
        reads: list[set[int]] = []
        for index, node in enumerate(nodes):
            label = _node_label(node, index)
            self.attributes(node, label, self.operator(node, label))
            if _has_bytes((node.name, node.doc_string)):
                self.error(
                    f"{where}node #{index} ({node.op_type}) has a name or doc string "
                    "that is not valid UTF-8 text"
                )
            names = set(inputs[index])
            if node.attribute:
                for sub in _subgraphs(node):
                    names |= self.graph(
                        sub, scope, f"{where}subgraph '{sub.name}' of node {label}: "
                    )
            for name in names:
                if name not in scope.defined:
                    if scope.resolves(name):
                        scope.outer_reads.add(name)
                    else:
                        self.error(f"{where}node {label} reads '{name}', which nothing defines")
            reads.append({producers[n] for n in names if n in producers})
        if _has_bytes(scope.defined) or _has_bytes(scope.outer_reads):
            self.error(f"{where}a value name is not valid UTF-8 text")
        for value in graph.output:
            if not scope.resolves(value.name):
                self.error(f"{where}graph output '{value.name}' is produced by nothing")
        for info in graph.value_info:
            problem = _type_problem(info.type)
            if problem is not None and problem != "no type":
                self.error(f"{where}value_info '{info.name}' has {problem}")
        if _has_bytes(info.name for info in graph.value_info):
            self.error(f"{where}a value_info name is not valid UTF-8 text")
        self.order(nodes, reads, where)
        return scope.outer_reads

    def order(self, nodes: list[onnx.NodeProto], reads: list[set[int]], where: str) -> None:
        cycle = _cycle(reads)
        if cycle is not None:
            names = " -> ".join(_node_label(nodes[i], i) for i in [*cycle, cycle[0]])
            self.error(f"{where}graph has a cycle: {names}")
        elif any(source >= index for index, sources in enumerate(reads) for source in sources):
            self.warning(
                f"{where}nodes are not in topological order (onnx.checker requires it, "
                "onnxruntime sorts them); the output is sorted"
            )


def _has_bytes(texts: Iterable[object]) -> bool:
    """Protobuf hands back string fields that are not valid UTF-8 as bytes."""
    return any(type(text) is bytes for text in texts)


def validate_model(proto: onnx.ModelProto) -> list[Finding]:
    """Every problem found in the model, errors and warnings, in graph order."""
    return _Validator(proto).run()


def _checker_problem(path: Path, *, full_check: bool = True) -> str | None:
    """onnx.checker's objection (full check: types and shapes too) as one line, or None."""
    try:
        onnx.checker.check_model(str(path), full_check=full_check)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as error:
        return _one_line(error)
    return None


def _runtime_problem(path: Path) -> str | None:
    """Why onnxruntime cannot load the model file (as one line), or None."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types per failure
        return _one_line(error)
    return None


def _one_line(error: Exception) -> str:
    """The error as one line, cut to a readable length."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def check_input(proto: onnx.ModelProto, path: Path, *, external: bool) -> None:
    """Refuse the model (exit 2, one line) on the first error; log warnings; --log debug lists
    every finding.

    onnx.checker (C++) clears most models fast. Only a model it objects to is walked here, and
    when the walk finds no fault onnxruntime decides: a model it cannot load is refused with
    its reason, one it loads goes on with the checker's objection as a warning."""
    validator = _Validator(proto)
    validator.versions()
    validator.signature(proto.graph, "")
    findings = validator.findings
    faulty = any(f.error for f in findings)
    # By path: onnx parses the file in C++, faster than handing it the parsed proto. Shape
    # inference cannot read external data (a Reshape's shape stored outside): for such a model
    # the checker's structural checks only.
    problem = None if faulty else _checker_problem(path, full_check=not external)
    if faulty or problem is not None:
        findings = validate_model(proto)  # every finding, for --log debug
    if problem is not None and not any(f.error for f in findings):
        refused = _runtime_problem(path)
        runtime = "onnxruntime loads it" if refused is None else "onnxruntime refuses it too"
        findings.append(Finding(f"onnx.checker rejects it ({runtime}): {problem}", False))
    for finding in findings:
        logger.debug("validation %s: %s", "error" if finding.error else "warning", finding.message)
    errors = [f.message for f in findings if f.error]
    if errors:
        more = f" (and {len(errors) - 1} more; --log debug lists them)" if errors[1:] else ""
        raise FusectlError(errors[0] + more, path=path)
    for finding in findings:
        logger.warning("%s: %s", path, finding.message)


def _ir_texts(model: ir.Model) -> Iterator[object]:
    """The names, doc strings and metadata of the model, its graphs (subgraphs included),
    functions, nodes and values: everything fusectl reads or writes back as text."""
    yield from (model.doc_string, model.producer_name, model.producer_version, model.domain)
    yield from (text for item in model.metadata_props.items() for text in item)
    for graph in (model.graph, *model.functions.values()):
        yield from _graph_texts(graph)


def _graph_texts(graph: ir.Graph | ir.Function) -> Iterator[object]:
    yield from (graph.name, graph.doc_string)
    yield from (text for item in graph.metadata_props.items() for text in item)
    values = _own_values(graph)
    for node in graph:
        yield from (node.name, node.op_type, node.domain, node.overload, node.doc_string)
        yield from node.attributes
        yield from (text for item in node.metadata_props.items() for text in item)
        values += node.outputs
        values += (value for value in node.inputs if value is not None)
        for attribute in node.attributes.values():
            for subgraph in attribute_graphs(attribute):
                yield from _graph_texts(subgraph)
    for value in values:
        yield from (value.name, value.doc_string)
        yield from (text for item in value.metadata_props.items() for text in item)
        yield from (dim for dim in value.shape or () if not isinstance(dim, int))


def _own_values(graph: ir.Graph | ir.Function) -> list[ir.Value]:
    """A graph's inputs, outputs and initializers (a function has none)."""
    values = [*graph.inputs, *graph.outputs]
    if isinstance(graph, ir.Graph):
        values += graph.initializers.values()
    return values


def _metadata(item: ir.Node | ir.Value) -> dict[str, str]:
    """The item's metadata_props, without making them: onnx-ir's property creates an empty
    dict on first read, and one per node and value of a 100k-node graph is about 20 MB that
    stays for the whole run. Empty when there are none, which callers test before walking."""
    props = getattr(item, "_metadata_props", False)
    return item.metadata_props if props is False else (props or {})


def _graph_has_bytes(graph: ir.Graph | ir.Function, shapes: set[int]) -> bool:
    """Whether any text of the graph, its nodes and values, subgraphs included, is bytes: the
    walk _graph_texts makes, in one tight loop (it runs over every node of every model)."""
    if _has_bytes((graph.name, graph.doc_string)):
        return True
    if _has_bytes(text for item in graph.metadata_props.items() for text in item):
        return True
    values = _own_values(graph)
    # A value a node reads is defined in a graph (validation refuses it otherwise), so only a
    # function body, which validation does not walk, may read a name nothing else holds.
    function = isinstance(graph, ir.Function)
    for node in graph:
        if (
            type(node.name) is bytes
            or type(node.op_type) is bytes
            or type(node.domain) is bytes
            or type(node.overload) is bytes
            or type(node.doc_string) is bytes
        ):
            return True
        if node.attributes:
            if _has_bytes(node.attributes):
                return True
            for attribute in node.attributes.values():
                if any(_graph_has_bytes(sub, shapes) for sub in attribute_graphs(attribute)):
                    return True
        props = _metadata(node)
        if props and _has_bytes(t for i in props.items() for t in i):
            return True
        values += node.outputs
        if function:
            values += node.inputs
    for value in values:
        if value is None:
            continue
        if type(value.name) is bytes or type(value.doc_string) is bytes:
            return True
        props = _metadata(value)
        if props and _has_bytes(t for i in props.items() for t in i):
            return True
        shape = value.shape
        if shape is not None and id(shape) not in shapes:
            shapes.add(id(shape))  # deserialized shapes are shared between values
            if any(type(getattr(dim, "value", None)) is bytes for dim in shape):
                return True
    return False


def _model_has_bytes(model: ir.Model) -> bool:
    if _has_bytes((model.doc_string, model.producer_name, model.producer_version, model.domain)):
        return True
    if _has_bytes(text for item in model.metadata_props.items() for text in item):
        return True
    shapes: set[int] = set()
    return any(_graph_has_bytes(g, shapes) for g in (model.graph, *model.functions.values()))


def check_text(model: ir.Model, path: Path) -> None:
    """Protobuf hands back string fields that are not valid UTF-8 as bytes, which no later
    step (reports, serialization) can handle: refuse them after load."""
    if not _model_has_bytes(model):
        return
    for text in _ir_texts(model):  # the first in _ir_texts' order names the fault
        if type(text) is bytes or (isinstance(text, ir.SymbolicDim) and type(text.value) is bytes):
            raise FusectlError(f"text {text!r} in the model is not valid UTF-8", path=path)


# A weight at least this large read only by nodes no output needs is worth a warning.
_WEIGHT_ELEMENTS = 1024


def warn_unread_weights(model: ir.Model, path: Path) -> None:
    """Warn when computation that reads weights feeds no graph output: the dead-node pass
    removes it, silently, and a miswired export (an output dropped, a head reading the wrong
    layer) looks exactly like that."""
    graph = model.graph
    weights = [
        value
        for value in graph.initializers.values()
        if value.const_value is not None and element_count(value.const_value) >= _WEIGHT_ELEMENTS
    ]
    if not weights:
        return
    live = live_nodes(graph)
    unread = [
        value
        for value in weights
        if value.uses()
        and all(user.graph is graph and user not in live for user, _ in value.uses())
    ]
    if not unread:
        return
    readers = [user for user, _ in unread[0].uses()]
    megabytes = sum(value.const_value.nbytes for value in unread) / 2**20
    logger.warning(
        "%s: %d weight(s) (%.1f MB, the first '%s', read by %s '%s') feed no graph output; "
        "the nodes computing with them are removed. If the model should compute with them, "
        "an output may be missing from its export",
        path,
        len(unread),
        megabytes,
        unread[0].name,
        readers[0].op_type,
        readers[0].name,
    )


def check_output(
    staged: Path, source: Path, *, external: bool, conflict: str | None = None
) -> None:
    """The staged output, before it is renamed into place: it must pass onnx.checker (full
    check) whenever the input does, and load in onnxruntime whenever the input does.

    ``conflict``: a contrib op's types breaking its onnxruntime schema (runtime.type_conflict),
    which onnx.checker cannot see; onnxruntime then decides, on the output and on the input.

    - input passes, output fails: a fusectl bug (exit 3), unless onnxruntime loads the output,
      which is what an onnxruntime-only op in the ONNX domain does (SimplifiedLayerNormalization,
      from a pass that is off by default and says so): a warning;
    - both fail, onnxruntime loads the input but not the output: the input's declarations are
      inconsistent in a way the passes trusted; refused (exit 2)."""
    if conflict is not None and _runtime_problem(staged) is not None:
        if _runtime_problem(source) is None:
            raise OutputInvariantError(
                f"the optimized model does not load in onnxruntime though the input does "
                f"({conflict}); nothing written, please report this",
                path=source,
            )
        logger.warning(
            "%s: onnxruntime refuses the input; so does the output (%s)", source, conflict
        )
    problem = _checker_problem(staged, full_check=not external)
    if problem is None:
        return
    output_refused = _runtime_problem(staged)
    source_problem = _checker_problem(source, full_check=not external)
    if source_problem is None:
        if output_refused is not None:
            raise OutputInvariantError(
                f"the optimized model fails onnx.checker though the input passes ({problem}); "
                "nothing written, please report this",
                path=source,
            )
        logger.warning(
            "%s: the output fails onnx.checker, onnxruntime loads it: %s", source, problem
        )
        return
    if output_refused is not None and _runtime_problem(source) is None:
        raise FusectlError(
            f"the model's declarations are inconsistent ({source_problem}) and its optimized "
            "form would not load in onnxruntime; nothing written",
            path=source,
        )
    logger.warning("%s: the input fails onnx.checker; so does the output", source)
