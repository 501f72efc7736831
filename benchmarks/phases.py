"""Where one ``fusectl optimize`` run spends its time and memory, phase by phase.

Runs ``fusectl.optimize`` in this process (the garbage collector off, as the CLI runs) with a
timer around each phase: wall and CPU seconds, RSS after it and the peak RSS so far. The ten
slowest passes come from the run's report. For scaling, generate a model first:

    python benchmarks/synthetic.py --sizes 100k --keep --ort-level none
    python benchmarks/phases.py benchmarks/out/synthetic/synthetic_100011.onnx
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

gc.disable()  # as fusectl's console entry point runs
_STARTED = time.perf_counter()

import onnx_ir as ir  # noqa: E402

import fusectl.api as api  # noqa: E402
from fusectl.core import model_io  # noqa: E402

# (module, function, phase): the functions a run goes through, in order.
PHASES = [
    (model_io, "_check_external_data", "external data check"),
    (model_io, "check_input", "input validation (onnx.checker)"),
    (model_io, "_deserialize", "onnx-ir deserialize (+ value_info)"),
    (model_io, "check_text", "UTF-8 text check"),
    (model_io, "_detach", "let the parsed file go"),
    (api, "load_source", "load total (parse .. detach)"),
    (api, "run_plan", "passes"),
    (ir, "save", "serialize + write"),
    (model_io, "check_output", "output check (onnx.checker)"),
    (api, "stage_model", "save total"),
    (api.reports, "write_report", "report"),
]


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn: Callable[..., Any], label: str, rows: dict[str, list[float]]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            row = rows.setdefault(label, [0.0, 0.0, 0.0, 0.0])
            row[0] += time.perf_counter() - wall
            row[1] += time.process_time() - cpu
            row[2], row[3] = _rss_mb(), _peak_mb()

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path)
    args = parser.parse_args()
    imports_s, imports_mb = time.perf_counter() - _STARTED, _rss_mb()
    rows: dict[str, list[float]] = {}
    for module, name, label in PHASES:
        if hasattr(module, name):
            setattr(module, name, _timed(getattr(module, name), label, rows))
    with tempfile.TemporaryDirectory(prefix="fusectl-phases-") as tmp:
        report = Path(tmp, "report.json")
        began, cpu = time.perf_counter(), time.process_time()
        api.optimize(args.model, Path(tmp, "out.onnx"), report=report)
        total, total_cpu = time.perf_counter() - began, time.process_time() - cpu
        passes = json.loads(report.read_text())["passes"]
    print(f"imports {imports_s:.2f} s, RSS after them {imports_mb:.0f} MB")
    print(f"{'phase':40s} {'wall s':>7s} {'cpu s':>7s} {'RSS after MB':>13s} {'peak MB':>8s}")
    for _, _, label in PHASES:
        if label in rows:
            wall, cpu_s, rss, peak = rows[label]
            print(f"{label:40s} {wall:7.2f} {cpu_s:7.2f} {rss:13.0f} {peak:8.0f}")
    rss, peak = _rss_mb(), _peak_mb()
    print(f"{'optimize() total':40s} {total:7.2f} {total_cpu:7.2f} {rss:13.0f} {peak:8.0f}")
    slowest = sorted(passes, key=lambda p: -(p.get("time_ms") or 0))[:10]
    print("slowest passes: " + ", ".join(f"{p['name']} {p['time_ms'] / 1000:.2f}" for p in slowest))


if __name__ == "__main__":
    main()
