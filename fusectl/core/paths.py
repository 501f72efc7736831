"""Where a run may write: every output is checked before anything is written, then staged under
a temporary name beside its target and renamed into place only once the whole run succeeded.

One place for these rules, so -o, --fusion_result, --report, --dump_graph and bisect's switch
file all refuse the same things: special files (a device such as /dev/null, a FIFO, a socket),
the input model or its weight files, and each other.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from fusectl.errors import FusectlError

# What GraphDumper writes into the --dump_graph directory (kept here so checks match it).
DUMP_WEIGHTS_FILE = "weights.data"
DUMP_FILE_PATTERN = re.compile(r"\d{4}_.*\.onnx")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_file_target(path: Path, role: str) -> None:
    """A file may be written at ``path``: absent or a regular file, in a writable directory."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise FusectlError(f"{role}: cannot check: {error.strerror or error}", path=path) from None
    if mode is not None and not stat.S_ISREG(mode):
        raise FusectlError(f"{role} is {_kind(mode)}, not a regular file", path=path)
    _check_directory(path.parent, role)


def check_directory_target(path: Path, role: str) -> None:
    """A directory may be created or filled at ``path``."""
    if path.exists():
        if not path.is_dir():
            raise FusectlError(f"{role} exists and is not a directory", path=path)
        _check_directory(path, role)
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    _check_directory(parent, role)


def _check_directory(directory: Path, role: str) -> None:
    directory = directory if str(directory) else Path(".")
    if not directory.is_dir():
        raise FusectlError(f"output directory does not exist ({role})", path=directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise FusectlError(f"output directory is not writable ({role})", path=directory)


def _dump_writes(directory: Path, path: Path) -> bool:
    """Would --dump_graph into ``directory`` write ``path``?"""
    return path.parent == directory and (
        path.name == DUMP_WEIGHTS_FILE or DUMP_FILE_PATTERN.fullmatch(path.name) is not None
    )


def check_outputs(
    files: Mapping[str, Path | None],
    *,
    protected: Mapping[Path, str],
    dump_dir: Path | None = None,
) -> None:
    """Check every file a run will write (by role, e.g. ``{"-o": out}``) before writing any.

    ``protected`` names the files no output may replace (the input model and its weights).
    Raises FusectlError naming the first conflict.
    """
    guarded = {path.resolve(): what for path, what in protected.items()}
    seen: dict[Path, str] = {}
    dump = dump_dir.resolve() if dump_dir is not None else None
    if dump_dir is not None:
        check_directory_target(dump_dir, "--dump_graph")
        for path, what in guarded.items():
            if _dump_writes(dump, path):
                raise FusectlError(f"--dump_graph would overwrite {what}", path=path)
    for role, path in files.items():
        if path is None:
            continue
        resolved = path.resolve()
        if resolved in guarded:
            raise FusectlError(
                f"{role} is {guarded[resolved]}; fusectl never modifies its input", path=path
            )
        if resolved in seen:
            raise FusectlError(f"{role} is the same file as {seen[resolved]}", path=path)
        if dump is not None and _dump_writes(dump, resolved):
            raise FusectlError(f"{role} is inside --dump_graph's files", path=path)
        check_file_target(path, role)
        seen[resolved] = role


class StagedOutputs:
    """Files of one run, written under temporary names beside their targets.

    ``commit`` renames them all into place; ``discard`` (or leaving the ``with`` block on an
    error) removes every temporary, so a failed run leaves nothing behind.
    """

    def __init__(self) -> None:
        self._staging: dict[Path, Path] = {}
        self._files: list[tuple[Path, Path]] = []
        self._directories: list[tuple[Path, Path]] = []

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    def _staging_dir(self, directory: Path) -> Path:
        key = directory.resolve()
        if key not in self._staging:
            try:
                self._staging[key] = Path(tempfile.mkdtemp(prefix=".fusectl-", dir=key))
            except OSError as error:
                raise FusectlError(
                    f"cannot write: {error.strerror or error}", path=directory
                ) from None
        return self._staging[key]

    def file(self, target: Path) -> Path:
        """Where to write what becomes ``target`` on commit (its own name, in a staging dir)."""
        staged = self._staging_dir(target.parent) / target.name
        self._files.append((staged, target))
        return staged

    def write_text(self, target: Path, text: str) -> None:
        self.write(target, lambda staged: staged.write_text(text, encoding="utf-8"))

    def write(self, target: Path, writer: Callable[[Path], object]) -> None:
        """Stage ``target`` as ``writer`` writes it (given the staged file's path)."""
        staged = self.file(target)
        try:
            writer(staged)
        except OSError as error:
            raise FusectlError(f"cannot write: {error.strerror or error}", path=target) from None

    def directory(self, target: Path) -> Path:
        """A directory whose files are moved into ``target`` (created if need be) on commit."""
        existing = target
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        staged = self._staging_dir(existing) / "dump"
        staged.mkdir()
        self._directories.append((staged, target))
        return staged

    def commit(self) -> None:
        try:
            for staged, target in self._directories:
                target.mkdir(parents=True, exist_ok=True)
                for child in sorted(staged.iterdir()):
                    os.replace(child, target / child.name)
            for staged, target in self._files:
                if staged.exists():  # an optional file (external data) may not have been written
                    os.replace(staged, target)
        except OSError as error:
            raise FusectlError(
                f"cannot write: {error.strerror or error}", path=error.filename
            ) from None
        finally:
            self.discard()

    def discard(self) -> None:
        for staging in self._staging.values():
            shutil.rmtree(staging, ignore_errors=True)
        self._staging.clear()
        self._files.clear()
        self._directories.clear()


def write_text_atomic(path: Path, text: str) -> None:
    """Write one file whole or not at all."""
    with StagedOutputs() as staged:
        staged.write_text(path, text)
        staged.commit()
