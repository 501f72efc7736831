"""Custom passes from outside fusectl: plugin files (``--plugin``) and installed packages that
declare a ``fusectl.passes`` entry point. Each registers its passes through the same API as the
built-in ones; the registry stamps them with where they came from.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from fusectl.core import logs
from fusectl.errors import FusectlError
from fusectl.rewrite.registry import BUILTIN_ORIGIN, REGISTRY, PassRegistry, loading_origin

ENTRY_POINT_GROUP = "fusectl.passes"
# Set (to anything but "" or "0") to skip installed entry points, as pytest's
# PYTEST_DISABLE_PLUGIN_AUTOLOAD does: a broken package must not block every fusectl run.
AUTOLOAD_OFF = "FUSECTL_DISABLE_PLUGIN_AUTOLOAD"

# What each loaded plugin registered, so a second load in one process (tests, notebooks)
# does not register the same passes twice.
_loaded: dict[str, tuple[str, ...]] = {}


_builtins_loaded = False


def load_builtin_passes() -> PassRegistry:
    """Import every module of fusectl.passes (each registers its passes) exactly once."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        with loading_origin(BUILTIN_ORIGIN):
            package = importlib.import_module("fusectl.passes")
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
                importlib.import_module(f"{package.__name__}.{info.name}")
    return REGISTRY


def load_passes(plugins: Sequence[Path] = ()) -> PassRegistry:
    """The registry with the built-in passes, the installed entry points' and ``plugins``'."""
    registry = load_builtin_passes()
    if os.environ.get(AUTOLOAD_OFF, "") in ("", "0"):
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            load_entry_point(entry_point)
    for path in plugins:
        load_plugin_file(Path(path))
    return registry


def load_plugin_file(path: Path) -> tuple[str, ...]:
    """Import a plugin file; its module-level code registers its passes. Returns their names."""
    if not path.exists():
        raise FusectlError("plugin does not exist", path=path)
    if not path.is_file():
        raise FusectlError("plugin is not a file", path=path)
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"fusectl_plugin_{_identifier(path.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise FusectlError("plugin is not a Python file", path=path)
    loader = spec.loader

    def load() -> None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up there
        try:
            loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise

    return _load(f"plugin {path}", str(resolved), load, f"plugin {path}", resolved)


def load_entry_point(entry_point: importlib.metadata.EntryPoint) -> tuple[str, ...]:
    """Load a ``fusectl.passes`` entry point: a module (importing it registers its passes) or
    a function called with no arguments to register them."""
    dist = entry_point.dist
    where = f"{dist.name} {dist.version}" if dist is not None else entry_point.value
    origin = f"entry point {entry_point.name} ({where})"

    def load() -> None:
        target = entry_point.load()
        if callable(target) and not isinstance(target, type):
            target()

    return _load(origin, f"entry point {entry_point.value}", load, f"plugin {origin}", None)


def _load(
    origin: str, key: str, load: Callable[[], None], label: str, source: Path | None
) -> tuple[str, ...]:
    """Run ``load`` once per process with ``origin`` stamped on what it registers; any failure
    becomes a one-line error naming the plugin, and takes back what it registered."""
    previous = _loaded.get(key)
    if previous is not None and all(REGISTRY.canonical(name) == name for name in previous):
        return previous
    for name in previous or ():
        if REGISTRY.canonical(name) == name:
            REGISTRY.unregister(name)
    before = {fusion_pass.spec.name for fusion_pass in REGISTRY}
    try:
        with loading_origin(origin):
            load()
    except (Exception, SystemExit) as error:
        for fusion_pass in REGISTRY:
            if fusion_pass.spec.name not in before:
                REGISTRY.unregister(fusion_pass.spec.name)
        raise FusectlError(f"{label} failed to load: {_describe(error, source)}") from None
    added = tuple(p.spec.name for p in REGISTRY if p.spec.name not in before)
    if not added:
        logs.logger.warning("%s registered no pass", label)
    _loaded[key] = added
    return added


def _describe(error: BaseException, source: Path | None) -> str:
    """The error in one line, with the plugin's own line where the traceback passes it."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    text = " ".join(text.split())
    if isinstance(error, SyntaxError) or source is None:
        return text
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == source]
    return f"{text} (line {frames[-1].lineno})" if frames else text


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)
