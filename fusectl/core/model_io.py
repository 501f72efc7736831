"""Loading and saving models: weights stay memory-mapped, outputs appear whole or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from fusectl.core.outside_ir import (
    OutsideIR,
    holds_map,
    main_graph_maps,
    maps_hidden,
    sparse_copies,
    sparse_names_expected,
)
from fusectl.core.paths import StagedOutputs
from fusectl.core.validate import (
    check_input,
    check_output,
    check_text,
    validate_model,
    warn_unread_weights,
)
from fusectl.errors import FusectlError
from fusectl.rewrite import runtime

# Protobuf cannot serialise a message of 2 GiB or more; leave room for the graph itself.
PROTOBUF_LIMIT = 2**31 - 1
INLINE_WEIGHTS_LIMIT = PROTOBUF_LIMIT - 64 * 2**20


@dataclass
class LoadedModel:
    """A model and what is known about the file it came from."""

    model: ir.Model
    path: Path | None  # None for a model given in memory
    external_files: frozenset[Path]
    # The input as parsed, for on-demand shape inference: the message itself while the IR's
    # in-memory weights are views of its tensors, else the file's digest (see _detach): the
    # file is then read again if asked for, which is rare (value_info gives most shapes).
    parsed: onnx.ModelProto | bytes
    # What onnx-ir has no place for, put back into what is saved.
    outside_ir: OutsideIR

    @property
    def proto(self) -> onnx.ModelProto:
        """The input model as parsed (read again when it was let go; it must not have
        changed since)."""
        if not isinstance(self.parsed, bytes):
            return self.parsed
        assert self.path is not None
        try:
            data = self.path.read_bytes()
        except OSError as error:
            raise FusectlError(f"cannot read: {error.strerror}", path=self.path) from None
        if _digest(data) != self.parsed:
            raise FusectlError("the model file changed while fusectl ran", path=self.path)
        return onnx.load_model_from_string(data)

    @property
    def uses_external_data(self) -> bool:
        return bool(self.external_files)

    def protected_files(self) -> dict[Path, str]:
        """The files no output of the run may replace."""
        files = {data: "the input model's external data file" for data in self.external_files}
        if self.path is not None:
            files[self.path] = "the input model"
        return files


class _Escape(Exception):
    """An external data location that leads outside the model's folder."""


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _confined_file(folder: str, location: str) -> str:
    """The real path of ``location`` inside ``folder``, following symbolic links by reading them
    only: nothing outside the folder is opened or stat'ed. Raises _Escape when the location or
    a link on the way leads out, FileNotFoundError when it does not name a regular file."""
    pending = location.replace("\\", "/").split("/")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ".." in pending:
        raise _Escape
    current, hops = folder, 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        candidate = os.path.join(current, part)
        info = os.lstat(candidate)  # inside the folder: current never leaves it
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        hops += 1
        target = os.path.normpath(os.path.join(current, os.readlink(candidate)))
        if hops > 40 or not _inside(target, folder):
            raise _Escape
        pending = os.path.relpath(target, folder).split(os.sep) + pending
        current = folder
    if not stat.S_ISREG(os.lstat(current).st_mode):
        raise FileNotFoundError(current)
    return current


def _check_external_data(proto: onnx.ModelProto, model_path: Path) -> frozenset[Path]:
    """Every external tensor's file, confined to the model's folder and long enough for the
    bytes the tensor says it holds. Returns the data files."""
    folder = os.path.realpath(model_path.parent)
    files: set[Path] = set()
    for tensor in _all_tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        where = f"external data of initializer '{tensor.name}'"
        try:
            offset, length = int(info.get("offset") or 0), info.get("length")
            needed = int(length) if length else _tensor_bytes(tensor)
        except ValueError:
            raise FusectlError(
                f"{where} has a malformed offset or length", path=model_path
            ) from None
        if offset < 0 or needed < 0:
            raise FusectlError(f"{where} has a negative offset or length", path=model_path)
        try:
            data_file = _confined_file(folder, location)
        except _Escape:
            raise FusectlError(
                f"{where} points outside the model's folder ({location!r})", path=model_path
            ) from None
        except OSError:
            raise FusectlError(
                f"external data file '{location}' of initializer '{tensor.name}' is missing",
                path=model_path,
            ) from None
        end = offset + needed
        if os.stat(data_file).st_size < end:
            raise FusectlError(
                f"external data file '{location}' is shorter than initializer "
                f"'{tensor.name}' needs ({end} bytes)",
                path=model_path,
            )
        files.add(Path(data_file))
    return frozenset(files)


def _all_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Initializers and attribute tensors of every graph and function of the model."""
    graphs = [proto.graph]
    # Only nodes with attributes hold tensors or graphs: most nodes are passed over here.
    nodes: list[onnx.NodeProto] = [n for f in proto.functions for n in f.node if n.attribute]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            yield from (sparse.values for sparse in graph.sparse_initializer)
            nodes.extend(node for node in graph.node if node.attribute)
            continue
        for attribute in nodes.pop().attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                graphs.append(attribute.g)
            graphs.extend(attribute.graphs)


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes a tensor of this shape and type needs, when its size is fixed (0 if not)."""
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError):
        return 0
    return itemsize * math.prod(tensor.dims) if tensor.data_type != onnx.TensorProto.STRING else 0


def _external_tensors(model: ir.Model) -> list[tuple[str, ir.ExternalTensor]]:
    found = []
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            found.append((value.name or "", tensor))
    return found


def load_model(path: str | os.PathLike[str]) -> LoadedModel:
    """Parse the model file and check that every external weight file is present.

    Weights are not read: onnx-ir memory-maps external data when a pass first asks for values.
    """
    model_path = Path(path)
    if not model_path.exists():
        raise FusectlError("no such file", path=model_path)
    if model_path.is_dir():
        raise FusectlError("is a directory, not an ONNX model file", path=model_path)
    try:
        data = model_path.read_bytes()
        proto = onnx.load_model_from_string(data)
    except DecodeError as error:
        raise FusectlError(
            f"not an ONNX model, or truncated (protobuf parse failed: {error})", path=model_path
        ) from None
    except OSError as error:
        raise FusectlError(f"cannot read: {error.strerror}", path=model_path) from None
    # The file's bytes go before the IR is built (the peak of a run). Their digest is kept
    # when the parsed file is let go once the IR is built (_detach), which copies the weights
    # held in it: worth it while they are the smaller part of the file.
    inline = sum(tensor.ByteSize() for tensor in proto.graph.initializer)
    digest = _digest(data) if 2 * inline <= len(data) else None
    del data
    return _from_proto(proto, model_path, digest)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


# Where a tensor of the IR sits: an initializer's value, or (node, attribute name, index in
# a TENSORS attribute or None).
_Place = ir.Value | tuple[ir.Node, str, int | None]


def _ir_tensors(model: ir.Model) -> Iterator[tuple[ir.TensorProtocol, _Place]]:
    """Every tensor of the IR with its place: initializers and the tensors of node attributes
    (Constant values), in every graph, subgraph and function."""
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    while graphs:
        graph = graphs.pop()
        if isinstance(graph, ir.Graph):
            for value in graph.initializers.values():
                if value.const_value is not None:
                    yield value.const_value, value
        for node in graph:
            if not node.attributes:  # most nodes: spares iterating an empty UserDict
                continue
            for name, attr in node.attributes.items():
                if attr.is_ref():
                    continue
                if attr.type == ir.AttributeType.GRAPH:
                    graphs.append(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    graphs.extend(attr.value)
                elif attr.type == ir.AttributeType.TENSOR:
                    yield attr.value, (node, name, None)
                elif attr.type == ir.AttributeType.TENSORS:
                    for index, tensor in enumerate(attr.value):
                        yield tensor, (node, name, index)


def _put(place: _Place, tensor: ir.TensorProtocol) -> None:
    """Put ``tensor`` where another tensor of the IR was."""
    if isinstance(place, ir.Value):
        place.const_value = tensor
        return
    node, name, index = place
    attr = node.attributes[name]
    content = tensor if index is None else [*attr.value]
    if index is not None:
        content[index] = tensor
    node.attributes[name] = ir.Attr(name, attr.type, content, doc_string=attr.doc_string)


def _detach(model: ir.Model) -> None:
    """Give every in-memory tensor of the IR a message of its own, so that the parsed file,
    which onnx-ir's tensors are views of, can be freed once the IR is built: its parse tree
    takes about five times the file's size (86 MB for the 16 MB, 100k-node synthetic graph).
    Copying costs the weights' size: load_model asks for it only while they are the smaller
    part of the file."""
    tensors = [
        (tensor, place)
        for tensor, place in _ir_tensors(model)
        if isinstance(tensor, ir.serde.TensorProtoTensor)
    ]
    # One message holds the copies: a message of its own per tensor would cost an arena each.
    holder = onnx.GraphProto()
    holder.initializer.extend(tensor.raw for tensor, _ in tensors)
    for own, (_, place) in zip(holder.initializer, tensors, strict=True):
        _put(place, ir.serde.TensorProtoTensor(own))


def load_source(source: str | os.PathLike[str] | onnx.ModelProto | ir.Model) -> LoadedModel:
    """A model given as a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``.

    In-memory models are never modified: the run works on its own copy.
    """
    if isinstance(source, onnx.ModelProto):
        return _from_proto(source, None)
    if isinstance(source, ir.Model):
        return _from_proto(ir.serde.serialize_model(source), None)
    if isinstance(source, str | os.PathLike):
        return load_model(source)
    raise FusectlError(
        f"a model is a path, an onnx.ModelProto or an onnx_ir.Model, not {type(source).__name__}"
    )


def _deserialize(proto: onnx.ModelProto, held: list[onnx.ValueInfoProto]) -> ir.Model:
    """onnx-ir's deserialize_model of ``proto``, whose main graph's value_info (``held``) the
    caller took out: it is applied here.

    onnx-ir builds a new shape and type for every value_info entry, which costs half the load
    of a graph that declares every intermediate (2.5 s of 5 at 100k nodes). Entries repeat a
    handful of types, and onnx-ir's shapes are frozen, meant to be shared: each distinct type
    is deserialized once.
    """
    model = ir.serde.deserialize_model(proto)
    graph = model.graph
    values = {value.name: value for node in graph for value in node.outputs}
    # onnx-ir gives value_info to initializers that are not graph inputs, and the graph
    # output entries last say over both.
    inputs = {value.name for value in graph.inputs}
    values.update((name, value) for name, value in graph.initializers.items() if name not in inputs)
    outputs = {info.name: info for info in proto.graph.output}
    # Per distinct entry, but for its name: the shape, shared, and the element type (a
    # TensorType each value owns: Value.dtype's setter changes the type in place), or None
    # for an entry onnx-ir must read itself (doc string, metadata, denotation, not a tensor).
    known: dict[bytes, tuple[ir.Shape | None, ir.TensorType | None] | None] = {}
    for name, info in {info.name: info for info in held}.items():  # the last entry wins
        value = values.get(name)
        if value is None:
            continue
        key = _without_name(info.SerializeToString())
        if key not in known:
            known[key] = _plain_tensor_type(info)
        found = known[key]
        if found is None and holds_map(info.type):
            continue  # set aside (outside_ir), put back on saving
        if found is None:
            ir.serde.deserialize_value_info_proto(info, value)
            value.shape = _unknown_if_negative(value.shape)
        else:
            value.shape, tensor_type = found
            value.type = None if tensor_type is None else ir.TensorType(tensor_type.dtype)
            value.doc_string = None
        if name in outputs:
            ir.serde.deserialize_value_info_proto(outputs[name], value)
    if model.functions and model.ir_version < _FUNCTION_VALUE_INFO_IR:
        _function_value_info(model, held)
    signature = [*graph.inputs, *graph.outputs]
    signature += [v for f in model.functions.values() for v in (*f.inputs, *f.outputs)]
    signature += [v for f in model.functions.values() for node in f for v in node.outputs]
    _negative_dims_unknown(signature)
    return model


def _read_ir(
    proto: onnx.ModelProto, held: list[onnx.ValueInfoProto], outside: OutsideIR
) -> ir.Model:
    """_deserialize, and where onnx-ir cannot read the model, again with its map types set
    aside in ``outside`` (classical-ML models: ZipMap's sequence of maps). The walk for them
    is made only then, sparing every other load."""
    try:
        return _deserialize(proto, held)
    except Exception:
        maps = main_graph_maps(proto, held)
        with maps_hidden(proto) as hidden:
            if not hidden and not maps:
                raise
            model = _deserialize(proto, held)
        outside.map_types, outside.hides_maps = maps, True
        return model


def _negative_dims_unknown(values: Iterable[ir.Value]) -> None:
    """A negative size, as Paddle2ONNX and older converters declare a dynamic dimension
    (``dim_value: -1``), becomes an unknown dimension: onnxruntime reads it so, and a size
    below zero would reach every pass that computes with sizes. (The main graph's value_info
    shapes are made unknown where _deserialize reads them, once per distinct entry.)"""
    for value in values:
        value.shape = _unknown_if_negative(value.shape)


def _unknown_if_negative(shape: ir.Shape | None) -> ir.Shape | None:
    if shape is None or not any(isinstance(d, int) and d < 0 for d in shape.dims):
        return shape
    return ir.Shape([ir.SymbolicDim(None) if isinstance(d, int) and d < 0 else d for d in shape])


# From IR version 10 a function keeps its own value_info; before, onnx-ir writes it into the
# main graph's as ``<domain>::<function>/<value>``.
_FUNCTION_VALUE_INFO_IR = 10


def _function_value_info(model: ir.Model, held: list[onnx.ValueInfoProto]) -> None:
    """The types of function body values, from the main graph's value_info: onnx-ir reads
    back only value names without a '/' (exporters' and fusectl's names have them), so that
    types written by one run would be lost to the next (which would then differ)."""
    bodies = {
        f"{domain}::{name}": function
        for (domain, name, overload), function in model.functions.items()
        if not overload
    }
    found: dict[str, dict[str, onnx.ValueInfoProto]] = {}
    for info in held:
        function, slash, name = info.name.partition("/")
        if slash and function in bodies:
            found.setdefault(function, {})[name] = info
    for function, infos in found.items():
        body = bodies[function]
        values = [*body.inputs, *(value for node in body for value in node.outputs)]
        for value in values:
            info = infos.get(value.name or "")
            if info is not None:
                ir.serde.deserialize_value_info_proto(info, value)


def _without_name(entry: bytes) -> bytes:
    """A serialized ValueInfoProto without its name (field 1, written first), so that entries
    that differ only by name are one key."""
    if not entry.startswith(b"\x0a"):
        return entry
    length, shift, position = 0, 0, 1
    while True:  # the name's length, a varint
        byte = entry[position]
        length |= (byte & 0x7F) << shift
        position += 1
        shift += 7
        if byte < 0x80:
            return entry[position + length :]


def _plain_tensor_type(
    info: onnx.ValueInfoProto,
) -> tuple[ir.Shape | None, ir.TensorType | None] | None:
    """The shape and element type of a value_info entry that is a tensor type and nothing
    else; None for any other entry."""
    type_proto = info.type
    if info.doc_string or info.metadata_props or type_proto.denotation:
        return None
    if not type_proto.HasField("tensor_type"):
        return None
    tensor_type = ir.serde.deserialize_type_proto_for_type(type_proto)
    assert tensor_type is None or isinstance(tensor_type, ir.TensorType)
    return _unknown_if_negative(ir.serde.deserialize_type_proto_for_shape(type_proto)), tensor_type


def _from_proto(
    proto: onnx.ModelProto, model_path: Path | None, digest: bytes | None = None
) -> LoadedModel:
    """The model of ``proto``, checked; ``digest``, the file's, when the caller lets the
    proto go as soon as this returns and the IR is to let it go too (see _detach). Any other
    proto is left as it was."""
    where = model_path or "<in-memory model>"
    if not proto.HasField("graph") or proto.ir_version == 0 or not proto.opset_import:
        raise FusectlError(
            "not an ONNX model, or truncated (no graph, IR version or opset imports)", path=where
        )
    if not proto.graph.output:
        raise FusectlError("model graph declares no outputs (truncated file?)", path=where)
    confined = _check_external_data(proto, model_path) if model_path is not None else None
    check_input(proto, Path(where), external=bool(confined))
    # onnx-ir must not see the value_info (_deserialize applies it); it goes back unless the
    # proto is let go, which spares growing its parse tree for nothing.
    infos = proto.graph.value_info
    held = list(infos)
    del infos[:]
    detached = False
    try:
        loaded = _build(proto, model_path, where, held, bool(confined), keep=digest is None)
        if digest is not None:
            _detach(loaded.model)
            loaded.parsed = digest
            detached = True
    finally:
        if not detached:
            infos.extend(held)
    return loaded


def _build(
    proto: onnx.ModelProto,
    model_path: Path | None,
    where: Path | str,
    held: list[onnx.ValueInfoProto],
    external: bool,
    *,
    keep: bool,
) -> LoadedModel:
    """The IR of ``proto``, checked. ``keep``: the proto is kept, and ``held``, its main
    graph's value_info (applied here), goes back into it; otherwise it goes as soon as it is
    applied, before the IR's peak."""
    try:
        outside = OutsideIR(sparse_copies(proto))
        with sparse_names_expected(proto):
            model = _read_ir(proto, held, outside)
    except Exception as error:  # onnx-ir raises several types for malformed graphs
        # The full walk names the fault where it finds one; onnx-ir's message may not.
        proto.graph.value_info.extend(held)
        held.clear()
        found = [f.message for f in validate_model(proto) if f.error]
        reason = found[0] if found else f"malformed ONNX model: {error}"
        raise FusectlError(reason, path=where) from None
    if not keep:
        held.clear()
    outside.mark(model)
    check_text(model, Path(where))
    warn_unread_weights(model, Path(where))
    external_files: set[Path] = set()
    if external:  # onnx-ir resolves external tensors' paths from here (a walk of every node)
        assert model_path is not None
        ir.external_data.set_base_dir(model.graph, model_path.parent)
    for name, tensor in _external_tensors(model):
        data_path = Path(tensor.path)
        if not data_path.is_file():
            raise FusectlError(
                f"external data file '{tensor.location}' of initializer '{name}' is missing",
                path=where,
            )
        end = (tensor.offset or 0) + (tensor.length or tensor.nbytes)
        if data_path.stat().st_size < end:
            raise FusectlError(
                f"external data file '{tensor.location}' is shorter than initializer "
                f"'{name}' needs ({end} bytes)",
                path=where,
            )
        external_files.add(data_path.resolve())
    return LoadedModel(model, model_path, frozenset(external_files), proto, outside)


def model_copy(loaded: LoadedModel) -> ir.Model:
    """A second IR model of the same file, for a run that must not touch ``loaded.model``
    (weights are shared with the parsed file or read from its external data on demand)."""
    proto = loaded.proto
    hidden = maps_hidden(proto) if loaded.outside_ir.hides_maps else contextlib.nullcontext()
    with sparse_names_expected(proto), hidden:
        model = ir.serde.deserialize_model(proto)
    loaded.outside_ir.mark(model)
    _negative_dims_unknown(
        [*model.graph.inputs, *(v for node in model.graph for v in node.outputs)]
    )
    if loaded.path is not None:
        ir.external_data.set_base_dir(model.graph, loaded.path.parent)
    return model


def _holds_external_tensors(model: ir.Model) -> bool:
    """Whether a tensor of the model is external: onnx-ir's load_to_model walks every graph
    to find out, several times slower than this."""
    return any(isinstance(tensor, ir.ExternalTensor) for tensor, _ in _ir_tensors(model))


def external_data_path(output: Path) -> Path:
    return output.with_name(output.name + ".data")


def weight_bytes(model: ir.Model) -> int:
    return sum(
        value.const_value.nbytes
        for value in model.graph.initializers.values()
        if value.const_value is not None
    )


def stage_model(
    model: ir.Model,
    output: Path,
    staged: StagedOutputs,
    *,
    external: bool,
    outside_ir: OutsideIR | None = None,
    source: Path | None = None,
) -> Path | None:
    """Write the model into ``staged`` (renamed to ``output`` on commit); returns the external
    data file it will have, if any.

    An output with its weights inline refers to no other file: weights that live elsewhere
    (memory-mapped from --dump_graph's weight file, say) are read in first. With ``source``
    (the input model file), the staged output is checked: it must pass onnx.checker whenever
    the input does.
    """
    external = external or weight_bytes(model) > INLINE_WEIGHTS_LIMIT
    data_path = external_data_path(output) if external else None
    staged_model = staged.file(output)
    if data_path is not None:
        staged.file(data_path)
    elif _holds_external_tensors(model):
        ir.external_data.load_to_model(model)
    try:
        ir.save(model, staged_model, external_data=data_path.name if data_path else None)
        if outside_ir is not None:
            outside_ir.put_back_into_file(staged_model)
        if source is not None:
            conflict = runtime.type_conflict(model)
            check_output(staged_model, source, external=data_path is not None, conflict=conflict)
    except OSError as error:
        raise FusectlError(f"cannot write output: {error.strerror or error}", path=output) from None
    return data_path


def save_model(
    model: ir.Model,
    output: Path,
    *,
    external: bool,
    outside_ir: OutsideIR | None = None,
    source: Path | None = None,
) -> Path | None:
    """Write the model atomically: a failure part-way leaves neither a partial model nor a
    partial weight file."""
    with StagedOutputs() as staged:
        data_path = stage_model(
            model, output, staged, external=external, outside_ir=outside_ir, source=source
        )
        staged.commit()
    return data_path
