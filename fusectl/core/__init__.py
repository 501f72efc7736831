"""The core path, in the order a run takes it: ``model_io`` loads and ``validate`` checks the
model, ``switches`` (with ``plugins``) resolves which passes run into a plan, ``engine`` runs
it, ``reports`` writes fusion_result.json and the --report, ``model_io`` and ``paths`` save
without half-written files. ``logs`` and ``dump`` are the run's ATC-style logs and graph dumps.
Depends on ``fusectl.rewrite`` (and the passes written with it), never on diagnostics or the CLI.
"""
