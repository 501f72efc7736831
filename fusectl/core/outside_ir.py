"""What an input model holds that onnx-ir has no place for, kept aside and put back into
every model fusectl saves: sparse initializers, and the map types of classical-ML models
(ZipMap's sequence of maps, DictVectorizer's map input)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

# The key of Value.meta (in memory only) that names a set-aside type, for messages.
OUTSIDE_TYPE = "fusectl.outside_type"


@dataclass
class OutsideIR:
    """The input's sparse initializers (the graph sees them as values with no producer) and
    its main graph's map-typed values by name (onnx-ir reads them as values of unknown type;
    no pass rewrites the ai.onnx.ml ops that make or read them)."""

    sparse_initializers: list[onnx.SparseTensorProto] = field(default_factory=list)
    map_types: dict[str, onnx.TypeProto] = field(default_factory=dict)
    # Whether onnx-ir read the model only with its map types hidden (maps_hidden), which
    # may be in subgraphs alone.
    hides_maps: bool = False

    def __bool__(self) -> bool:
        return bool(self.sparse_initializers or self.map_types)

    def put_back(self, proto: onnx.ModelProto) -> bool:
        """Put back into ``proto`` the sparse initializers its graph still reads and the map
        types of its values that still exist; True if anything was put back."""
        graph = proto.graph
        used = _names_used(graph)
        kept = [tensor for tensor in self.sparse_initializers if tensor.values.name in used]
        graph.sparse_initializer.extend(kept)
        typed = 0
        declared = {info.name for info in graph.value_info}
        for info in [*graph.input, *graph.output, *graph.value_info]:
            found = self.map_types.get(info.name)
            if found is not None and not info.HasField("type"):
                info.type.CopyFrom(found)
                typed += 1
        signature = {info.name for info in [*graph.input, *graph.output]}
        produced = {name for node in graph.node for name in node.output}
        for name, found in self.map_types.items():
            if name in produced and name not in declared and name not in signature:
                graph.value_info.add(name=name).type.CopyFrom(found)
                typed += 1
        return bool(kept or typed)

    def put_back_into_file(self, path: Path) -> None:
        """``put_back`` into a model file just written (its external data left where it is)."""
        if not self:
            return
        saved = onnx.load(str(path), load_external_data=False)
        if self.put_back(saved):
            onnx.save(saved, str(path))

    def mark(self, model: ir.Model) -> None:
        """Name the set-aside types on the graph's inputs and outputs (``OUTSIDE_TYPE``)."""
        for value in [*model.graph.inputs, *model.graph.outputs]:
            found = self.map_types.get(value.name or "")
            if found is not None:
                value.meta[OUTSIDE_TYPE] = type_text(found)


def sparse_copies(proto: onnx.ModelProto) -> list[onnx.SparseTensorProto]:
    """Copies of the main graph's sparse initializers (the proto itself may be let go)."""
    sparse = [onnx.SparseTensorProto() for _ in proto.graph.sparse_initializer]
    for own, tensor in zip(sparse, proto.graph.sparse_initializer, strict=True):
        own.CopyFrom(tensor)
    return sparse


def main_graph_maps(
    proto: onnx.ModelProto, value_info: Iterable[onnx.ValueInfoProto]
) -> dict[str, onnx.TypeProto]:
    """Copies of the map types of the main graph's inputs, outputs and ``value_info`` (given
    apart: the loader takes it out of the proto), by value name."""
    graph = proto.graph
    maps: dict[str, onnx.TypeProto] = {}
    for info in [*graph.input, *graph.output, *value_info]:
        if holds_map(info.type):
            maps.setdefault(info.name, onnx.TypeProto()).CopyFrom(info.type)
    return maps


def type_text(type_proto: onnx.TypeProto) -> str:
    """ONNX's spelling of a type: ``seq(map(int64, tensor(float)))``."""
    kind = type_proto.WhichOneof("value")
    if kind == "map_type":
        key = onnx.TensorProto.DataType.Name(type_proto.map_type.key_type).lower()
        return f"map({key}, {type_text(type_proto.map_type.value_type)})"
    if kind == "sequence_type":
        return f"seq({type_text(type_proto.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({type_text(type_proto.optional_type.elem_type)})"
    if kind in ("tensor_type", "sparse_tensor_type"):
        element = getattr(type_proto, kind).elem_type
        name = onnx.TensorProto.DataType.Name(element).lower() if element else "?"
        return f"{kind.removesuffix('_type').replace('_', ' ')}({name})"
    return "?"


def holds_map(type_proto: onnx.TypeProto) -> bool:
    """Whether the type is a map or holds one (a sequence or optional of maps)."""
    kind = type_proto.WhichOneof("value")
    if kind == "map_type":
        return True
    if kind == "sequence_type":
        return holds_map(type_proto.sequence_type.elem_type)
    if kind == "optional_type":
        return holds_map(type_proto.optional_type.elem_type)
    return False


@contextlib.contextmanager
def maps_hidden(proto: onnx.ModelProto) -> Iterator[int]:
    """``proto`` with no map types, which onnx-ir raises on: a map-typed input, output or
    value_info entry of any graph has no type until the block ends. Yields how many there
    were. A walk of every node: for models onnx-ir did not read as they are."""
    hidden: list[tuple[onnx.ValueInfoProto, onnx.TypeProto]] = []
    for graph in _graphs(proto.graph):
        for info in [*graph.input, *graph.output, *graph.value_info]:
            if info.HasField("type") and holds_map(info.type):
                kept = onnx.TypeProto()
                kept.CopyFrom(info.type)
                hidden.append((info, kept))
                info.ClearField("type")
    try:
        yield len(hidden)
    finally:
        for info, kept in hidden:
            info.type.CopyFrom(kept)


@contextlib.contextmanager
def sparse_names_expected(proto: onnx.ModelProto) -> Iterator[None]:
    """onnx-ir warns that a sparse initializer's name is undeclared; fusectl knows and keeps it."""
    serde_log = logging.getLogger("onnx_ir.serde")
    level = serde_log.level
    if proto.graph.sparse_initializer:
        serde_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        serde_log.setLevel(level)


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for subgraph in [attribute.g, *attribute.graphs]:
                yield from _graphs(subgraph)


def _names_used(graph: onnx.GraphProto) -> set[str]:
    used = {value.name for value in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            for subgraph in [attribute.g, *attribute.graphs]:
                used |= _names_used(subgraph)
    return used
