"""--dump_graph: the model before the first pass and after each pass that changed it.

Weights go once into DIR/weights.data and every dump refers to them there, so a dozen dumps of
a 400 MB model cost 400 MB of disk, not 5 GB. Each weight moved there is swapped for a
memory-mapped view of its copy, so the run itself holds no more in memory than before (the
optimized output itself is saved with its weights read back in: it never refers to DIR).
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from fusectl.core.outside_ir import OutsideIR
from fusectl.core.paths import DUMP_WEIGHTS_FILE as WEIGHTS_FILE
from fusectl.errors import FusectlError

_ALIGNMENT = 64
_INLINE_BYTES = 1024


class GraphDumper:
    def __init__(self, directory: Path, outside_ir: OutsideIR | None = None) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._weights = directory / WEIGHTS_FILE
            self._weights.write_bytes(b"")
        except OSError as error:
            raise FusectlError(
                f"cannot create dump directory: {error.strerror or error}", path=directory
            ) from None
        self.directory = directory
        self._outside_ir = outside_ir
        self.count = 0
        self.files: list[Path] = []

    def discard(self) -> None:
        """Remove the dumps of a run that is started again from the input."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files.clear()

    def _share_weights(self, model: ir.Model) -> None:
        with self._weights.open("ab") as stream:
            for value in model.graph.initializers.values():
                tensor = value.const_value
                if tensor is None or tensor.nbytes < _INLINE_BYTES:
                    continue
                if isinstance(tensor, ir.ExternalTensor) and Path(tensor.path) == self._weights:
                    continue
                offset = -stream.tell() % _ALIGNMENT + stream.tell()
                stream.write(b"\0" * (offset - stream.tell()))
                stream.write(tensor.tobytes())
                stream.flush()
                value.const_value = ir.ExternalTensor(
                    WEIGHTS_FILE,
                    offset,
                    tensor.nbytes,
                    tensor.dtype,
                    shape=tensor.shape,
                    name=tensor.name or value.name or "",
                    base_dir=self.directory,
                )

    def dump(self, model: ir.Model, label: str) -> Path:
        self._share_weights(model)
        path = self.directory / f"{self.count:04d}_{label}.onnx"
        ir.save(model, path)
        if self._outside_ir is not None:
            self._outside_ir.put_back_into_file(path)
        self.count += 1
        self.files.append(path)
        return path
