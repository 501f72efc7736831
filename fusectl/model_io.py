"""Loading and saving models: weights stay memory-mapped, outputs appear whole or not at all."""

from __future__ import annotations

import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from fusectl.errors import FusectlError
from fusectl.validate import check_input, check_output, check_text, validate_model

# Protobuf cannot serialise a message of 2 GiB or more; leave room for the graph itself.
PROTOBUF_LIMIT = 2**31 - 1
INLINE_WEIGHTS_LIMIT = PROTOBUF_LIMIT - 64 * 2**20


@dataclass
class LoadedModel:
    """A model and what is known about the file it came from."""

    model: ir.Model
    path: Path
    external_files: frozenset[Path]
    # The parsed file, kept for on-demand shape inference; the IR's in-memory weights are
    # views of its tensors, so keeping it costs no extra memory.
    proto: onnx.ModelProto

    @property
    def uses_external_data(self) -> bool:
        return bool(self.external_files)


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
    nodes: list[onnx.NodeProto] = [n for f in proto.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            yield from (sparse.values for sparse in graph.sparse_initializer)
            nodes.extend(graph.node)
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
        proto = onnx.load(str(model_path), load_external_data=False)
    except DecodeError as error:
        raise FusectlError(
            f"not an ONNX model, or truncated (protobuf parse failed: {error})", path=model_path
        ) from None
    except OSError as error:
        raise FusectlError(f"cannot read: {error.strerror}", path=model_path) from None
    if not proto.HasField("graph") or proto.ir_version == 0 or not proto.opset_import:
        raise FusectlError(
            "not an ONNX model, or truncated (no graph, IR version or opset imports)",
            path=model_path,
        )
    if not proto.graph.output:
        raise FusectlError("model graph declares no outputs (truncated file?)", path=model_path)
    external_files = _check_external_data(proto, model_path)
    check_input(proto, model_path, external=bool(external_files))
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as error:  # onnx-ir raises several types for malformed graphs
        # The full walk names the fault where it finds one; onnx-ir's message may not.
        found = [f.message for f in validate_model(proto) if f.error]
        reason = found[0] if found else f"malformed ONNX model: {error}"
        raise FusectlError(reason, path=model_path) from None
    check_text(model, model_path)
    ir.external_data.set_base_dir(model.graph, model_path.parent)
    return LoadedModel(model, model_path, external_files, proto)


def check_output_path(source: LoadedModel, output: Path) -> None:
    """Refuse outputs that would overwrite the input or land in an unwritable place."""
    if output.exists() and output.is_dir():
        raise FusectlError("output path is a directory", path=output)
    if output.resolve() == source.path.resolve():
        raise FusectlError(
            "output path is the input model; fusectl never modifies its input", path=output
        )
    data_path = external_data_path(output).resolve()
    if data_path in source.external_files:
        raise FusectlError(
            f"output's external data file '{data_path.name}' is the input model's weight file",
            path=output,
        )
    directory = output.parent
    if not directory.is_dir():
        raise FusectlError("output directory does not exist", path=directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise FusectlError("output directory is not writable", path=directory)


def external_data_path(output: Path) -> Path:
    return output.with_name(output.name + ".data")


def weight_bytes(model: ir.Model) -> int:
    return sum(
        value.const_value.nbytes
        for value in model.graph.initializers.values()
        if value.const_value is not None
    )


def save_model(
    model: ir.Model, output: Path, *, external: bool, source: Path | None = None
) -> Path | None:
    """Write the model atomically; returns the external data file when one was written.

    Everything is written into a temporary directory beside the target and then renamed into
    place, so a failure part-way leaves neither a partial model nor a partial weight file.
    With ``source`` (the input model), the staged output is checked first: it must pass
    onnx.checker whenever the input does.
    """
    external = external or weight_bytes(model) > INLINE_WEIGHTS_LIMIT
    data_path = external_data_path(output) if external else None
    if data_path is None:
        # Weights a --dump_graph run moved into its folder come back inline: the output must
        # not refer to files beside the dumps.
        ir.external_data.load_to_model(model)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    except OSError as error:
        raise FusectlError(f"cannot write output: {error.strerror or error}", path=output) from None
    try:
        staged_model = staging / output.name
        ir.save(model, staged_model, external_data=data_path.name if data_path else None)
        if source is not None:
            check_output(staged_model, source, external=data_path is not None)
        if data_path is not None:
            os.replace(staging / data_path.name, data_path)
        os.replace(staged_model, output)
    except OSError as error:
        raise FusectlError(f"cannot write output: {error.strerror or error}", path=output) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return data_path
