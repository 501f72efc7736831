"""fusectl: an ATC-style command-line fusion optimizer for ONNX models.

The public API is what plugins and built-in passes share: declare a pass with ``PassSpec``,
implement it as a ``PatternPass`` (onnxscript-style rules) or a ``FusionPass``, and register it
with ``@register_pass``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from fusectl.context import PassContext
from fusectl.patterns import Decline, PatternPass, Rule, Site
from fusectl.registry import (
    REGISTRY,
    Category,
    FusionPass,
    Numerics,
    PassSpec,
    register_pass,
)

__all__ = [
    "REGISTRY",
    "Category",
    "Decline",
    "FusionPass",
    "Numerics",
    "PassContext",
    "PassSpec",
    "PatternPass",
    "Rule",
    "Site",
    "__version__",
    "register_pass",
]
