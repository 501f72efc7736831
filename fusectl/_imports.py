"""Start-up: onnx-ir imported without importing sympy.

onnx-ir imports sympy when it is imported, for arithmetic on symbolic dimensions, which few
fusectl runs do. sympy takes half a second to import, a third of fusectl's start-up and most
of a run on a model of a few thousand nodes. While onnx-ir is imported, ``sympy`` is a
stand-in module: what onnx-ir reads from it then (functions it keeps in a table) become
forwarders. The first use of sympy after that (any attribute, or a submodule import)
executes sympy for real, into the same module object, so every holder of it sees the real
module. Should an import read sympy in a way a forwarder cannot serve (a base class, say),
the import is redone with sympy loaded as usual: never slower than not deferring.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from typing import Any


class _Deferred(types.ModuleType):
    """A module executed on its first use; until then, within ``deferring``, attributes
    read are forwarders to the real ones."""

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(spec.name)
        self.__spec__ = spec
        self.__loader__ = spec.loader
        self.__file__ = spec.origin
        self.__package__ = spec.parent if spec.submodule_search_locations is None else spec.name
        # No __path__ yet: importing a submodule asks for it, which executes the module.
        self.__dict__["_fusectl_deferring"] = True
        self.__dict__["_fusectl_lock"] = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if self.__dict__.get("_fusectl_deferring") and not name.startswith("__"):
            return _forwarder(self, name)
        _execute(self)
        return getattr(self, name)


def _forwarder(module: types.ModuleType, name: str) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return getattr(module, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


def _execute(module: _Deferred) -> None:
    """Execute the real module into ``module`` (once, whichever thread asks first)."""
    with module.__dict__["_fusectl_lock"]:
        if type(module) is not _Deferred:
            return
        spec = module.__spec__
        assert spec is not None and spec.loader is not None
        for key in ("_fusectl_deferring", "_fusectl_lock"):
            module.__dict__.pop(key, None)
        module.__class__ = types.ModuleType
        if spec.submodule_search_locations is not None:
            module.__path__ = list(spec.submodule_search_locations)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            if sys.modules.get(spec.name) is module:
                del sys.modules[spec.name]
            raise


def import_deferring(name: str, deferred: str) -> None:
    """Import module ``name`` with module ``deferred`` (one it imports) not yet executed.

    Nothing is deferred when either is imported already or ``deferred`` is not installed."""
    if name in sys.modules or deferred in sys.modules:
        importlib.import_module(name)
        return
    spec = importlib.util.find_spec(deferred)
    if spec is None or spec.loader is None:
        importlib.import_module(name)
        return
    stand_in = _Deferred(spec)
    sys.modules[deferred] = stand_in
    try:
        importlib.import_module(name)
    except Exception:
        # The import used the stand-in in a way forwarders cannot serve: import both as usual.
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        if sys.modules.get(deferred) is stand_in and type(stand_in) is _Deferred:
            del sys.modules[deferred]
        importlib.import_module(name)
    finally:
        stand_in.__dict__.pop("_fusectl_deferring", None)
