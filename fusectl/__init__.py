"""fusectl: an ATC-style command-line fusion optimizer for ONNX models.

From Python, ``fusectl.optimize(model, "out.onnx", enable_pass=[...])`` runs what
``fusectl optimize`` runs; ``verify``, ``bisect`` and ``bench`` mirror the other commands and
``FusectlPass`` composes fusectl inside an ``onnx_ir.passes.Sequential``.

The public API is what plugins and built-in passes share: ``register_replacement`` declares a
pass from a search and a replacement function; larger passes declare a ``PassSpec``, implement
a ``PatternPass`` (onnxscript-style rules) or a ``FusionPass``, and register with
``@register_pass``.
"""

from __future__ import annotations

import os as _os

from fusectl._imports import import_deferring as _import_deferring

_import_deferring("onnx_ir", deferred="sympy")  # sympy: half of the start-up, seldom used

# ruff: noqa: E402  (imports after onnx-ir's, and fusectl.api after the passes path)
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.patterns import Decline, PatternPass, Rule, Site
from fusectl.rewrite.registry import (
    REGISTRY,
    Category,
    FusionPass,
    Numerics,
    PassSpec,
    register_pass,
    unregister_pass,
)
from fusectl.rewrite.replacement import register_replacement
from fusectl.version import __version__

__all__ = [
    "REGISTRY",
    "Category",
    "Decline",
    "FusectlError",
    "FusectlPass",
    "FusionPass",
    "Numerics",
    "OptimizeResult",
    "PassContext",
    "PassSpec",
    "PatternPass",
    "Rule",
    "Site",
    "__version__",
    "bench",
    "bisect",
    "optimize",
    "register_pass",
    "register_replacement",
    "tune",
    "unregister_pass",
    "verify",
]

# Installed, the built-in passes are the subpackage fusectl.passes; in a source checkout they
# are the repository's top-level passes/ folder. Let `python -m fusectl` work from a checkout.
_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "passes")) and _os.path.isfile(
    _os.path.join(_here, _os.pardir, "passes", "__init__.py")
):
    __path__.append(_os.path.dirname(_here))  # type: ignore[name-defined]

from fusectl.api import (  # after the passes path above
    FusectlError,
    FusectlPass,
    OptimizeResult,
    bench,
    bisect,
    optimize,
    tune,
    verify,
)
