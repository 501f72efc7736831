"""Checking what the optimizer did: ``verify`` compares outputs on onnxruntime, ``bisect``
finds the rewrite that broke them, ``bench`` times models, ``sitecheck`` checks each custom
rewrite in isolation (--check_custom), ``inputs`` generates the feeds they all run on.
Built on ``fusectl.core`` and ``fusectl.rewrite``; the CLI and ``fusectl.api`` sit above.
"""
