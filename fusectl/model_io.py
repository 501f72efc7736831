"""Loading and saving models: weights stay memory-mapped, outputs appear whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from fusectl.errors import FusectlError

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
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as error:  # onnx-ir raises several types for malformed graphs
        raise FusectlError(f"malformed ONNX model: {error}", path=model_path) from None
    base_dir = model_path.parent
    ir.external_data.set_base_dir(model.graph, base_dir)
    external_files: set[Path] = set()
    for name, tensor in _external_tensors(model):
        data_path = Path(tensor.path)
        if not data_path.is_file():
            raise FusectlError(
                f"external data file '{tensor.location}' of initializer '{name}' is missing",
                path=model_path,
            )
        end = (tensor.offset or 0) + (tensor.length or tensor.nbytes)
        if data_path.stat().st_size < end:
            raise FusectlError(
                f"external data file '{tensor.location}' is shorter than initializer "
                f"'{name}' needs ({end} bytes)",
                path=model_path,
            )
        external_files.add(data_path.resolve())
    return LoadedModel(model, model_path, frozenset(external_files), proto)


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


def save_model(model: ir.Model, output: Path, *, external: bool) -> Path | None:
    """Write the model atomically; returns the external data file when one was written.

    Everything is written into a temporary directory beside the target and then renamed into
    place, so a failure part-way leaves neither a partial model nor a partial weight file.
    """
    external = external or weight_bytes(model) > INLINE_WEIGHTS_LIMIT
    data_path = external_data_path(output) if external else None
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    except OSError as error:
        raise FusectlError(f"cannot write output: {error.strerror or error}", path=output) from None
    try:
        staged_model = staging / output.name
        ir.save(model, staged_model, external_data=data_path.name if data_path else None)
        if data_path is not None:
            os.replace(staging / data_path.name, data_path)
        os.replace(staged_model, output)
    except OSError as error:
        raise FusectlError(f"cannot write output: {error.strerror or error}", path=output) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return data_path
