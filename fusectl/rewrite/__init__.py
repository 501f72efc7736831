"""The toolkit passes are written with: ``registry`` declares a pass, ``context`` is what a
pass sees while it runs, ``patterns`` and ``replacement`` match and replace subgraphs,
``shapes`` and ``axes`` derive shapes and sizes, ``evaluate`` computes values before run
time (a constant fold, a subgraph at probe sizes), ``coverage`` recognizes the written-out
computations left unfused, ``runtime`` tells what onnxruntime's kernel registry can run.
The lowest room: at run time it imports nothing else of fusectl but ``fusectl.errors``.
"""
