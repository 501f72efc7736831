"""Shared helpers for the benchmark scripts: run a command in a subprocess and measure it.

Peak RSS is taken from ``os.wait4`` on the measured process, spawned by a tiny wrapper
interpreter. Going through the wrapper matters: Linux carries the RSS high-water mark of the
process that forks/execs into the child's ``ru_maxrss``, so spawning the measured command
directly from a benchmark that has torch or a big model loaded would report the parent's RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
OUT_DIR = BENCH_DIR / "out"

# Runs argv[3:], kills it after argv[2] seconds (0: never), writes wall time and rusage to argv[1].
_WRAPPER = r"""
import json, os, subprocess, sys, threading, time
out, timeout, cmd = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
state = {"timed_out": False}
start = time.perf_counter()
proc = subprocess.Popen(cmd)
peaks = {"RssAnon": 0, "RssFile": 0}
def _sample():
    path = f"/proc/{proc.pid}/status"
    while True:
        try:
            with open(path) as f:
                for line in f:
                    key = line.split(":", 1)[0]
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(line.split()[1]))
        except (OSError, ValueError, IndexError):
            return
        if done.wait(0.02):
            return
done = threading.Event()
sampler = threading.Thread(target=_sample, daemon=True)
sampler.start()
def _kill():
    state["timed_out"] = True
    proc.kill()
timer = threading.Timer(timeout, _kill) if timeout > 0 else None
if timer:
    timer.start()
_, status, usage = os.wait4(proc.pid, 0)
wall = time.perf_counter() - start
done.set()
if timer:
    timer.cancel()
proc.returncode = os.waitstatus_to_exitcode(status)
with open(out, "w") as f:
    json.dump({"wall_s": wall, "maxrss_kb": usage.ru_maxrss, "user_s": usage.ru_utime,
               "sys_s": usage.ru_stime, "rc": proc.returncode,
               "timed_out": state["timed_out"],
               "anon_kb": peaks["RssAnon"], "file_kb": peaks["RssFile"]}, f)
"""


@dataclass
class Measurement:
    wall_s: float
    peak_rss_mb: float
    user_s: float
    sys_s: float
    rc: int
    timed_out: bool
    peak_anon_mb: float  # sampled every 20 ms from /proc/PID/status: heap and other private memory
    peak_file_mb: float  # sampled likewise: file-backed pages (memory-mapped weights, libraries)
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def status(self) -> str:
        if self.timed_out:
            return "TIMEOUT"
        return "ok" if self.rc == 0 else f"rc={self.rc}"


def installed_env(env: dict | None = None) -> dict:
    """The environment a measured command runs in: Python as an installed package runs it, with
    its bytecode cached. Where the environment turns bytecode off (``PYTHONDONTWRITEBYTECODE``,
    as some CI and sandbox images do), every run of a source checkout compiles fusectl's modules
    again: 0.24 s on top of a 0.52 s run of the 12-node sample, a cost no ``pip install`` pays
    (pip compiles at install). The cache goes to benchmarks/out/pycache, outside the tree."""
    env = dict(os.environ if env is None else env)
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        env.setdefault("PYTHONPYCACHEPREFIX", str(OUT_DIR / "pycache"))
    return env


def measure(
    cmd: list[str], *, timeout: float = 0, cwd: Path | None = None, env: dict | None = None
) -> Measurement:
    """Run ``cmd`` once in a fresh process (in ``installed_env``); wall time, peak RSS and CPU
    time of that process."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as handle:
        result_path = handle.name
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _WRAPPER, result_path, str(timeout), *map(str, cmd)],
            cwd=cwd,
            env=installed_env(env),
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            data = json.loads(Path(result_path).read_text() or "null")
        except json.JSONDecodeError:
            data = None
        if data is None:
            raise RuntimeError(f"measurement wrapper failed:\n{proc.stderr[-4000:]}")
    finally:
        os.unlink(result_path)
    return Measurement(
        wall_s=data["wall_s"],
        peak_rss_mb=data["maxrss_kb"] / 1024,
        user_s=data["user_s"],
        sys_s=data["sys_s"],
        rc=data["rc"],
        timed_out=data["timed_out"],
        peak_anon_mb=data["anon_kb"] / 1024,
        peak_file_mb=data["file_kb"] / 1024,
        stdout=proc.stdout,
        stderr=proc.stderr,
    )


def fusectl_cmd(model: Path, output: Path, *, report: Path | None = None) -> list[str]:
    """``fusectl optimize`` as the benchmarks run it (quiet, fusion_result beside the output)."""
    cmd = [sys.executable, "-m", "fusectl", "optimize", str(model), "-o", str(output)]
    cmd += ["--log", "null", "--fusion_result", str(output.with_suffix(".fusion_result.json"))]
    if report is not None:
        cmd += ["--report", str(report)]
    return cmd


# Plain onnx.load + onnx.save of the same model: the floor any ONNX-to-ONNX tool pays.
LOAD_SAVE_SCRIPT = r"""
import sys, onnx
src, dst, external = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
model = onnx.load(src)
if external:
    onnx.save(model, dst, save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.rsplit("/", 1)[-1] + ".data", size_threshold=1024)
else:
    onnx.save(model, dst)
"""


def load_save_cmd(model: Path, output: Path, *, external: bool) -> list[str]:
    return [
        sys.executable,
        "-c",
        LOAD_SAVE_SCRIPT,
        str(model),
        str(output),
        "1" if external else "0",
    ]


# Interpreter start + fusectl imports + pass registry: the fixed cost of every fusectl run.
STARTUP_SCRIPT = r"""
from fusectl import cli
from fusectl.core.plugins import load_builtin_passes
load_builtin_passes()
"""


def startup_cmd() -> list[str]:
    return [sys.executable, "-c", STARTUP_SCRIPT]


def read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def report_summary(report: dict | None) -> dict:
    """Pass time and the fusions that took effect, from a fusectl --report document."""
    if not report:
        return {"passes_s": None, "fusions": "-", "nodes": "-"}
    fusions = ", ".join(
        f"{p['name']}={p['effected']}/{p['matched']}"
        for p in report["passes"]
        if p.get("matched")
        and not p["name"].endswith(("EliminationPass", "SortPass", "ImportPass"))
    )
    nodes = f"{report['model']['before']['nodes']}->{report['model']['after']['nodes']}"
    return {"passes_s": report["time_s"], "fusions": fusions or "none", "nodes": nodes}


def file_size(path: Path) -> int:
    total = path.stat().st_size if path.exists() else 0
    data = path.with_name(path.name + ".data")
    return total + (data.stat().st_size if data.exists() else 0)


def remove_model(path: Path) -> None:
    for candidate in (
        path,
        path.with_name(path.name + ".data"),
        path.with_suffix(".fusion_result.json"),
    ):
        candidate.unlink(missing_ok=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain-text table, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [
        ["-" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = []
        for i, cell in enumerate(row):
            numeric = cell.replace(".", "", 1).replace("x", "", 1).lstrip("-").isdigit()
            parts.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return " | ".join(parts).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def machine_note() -> str:
    import platform

    try:
        mem_kb = int(
            next(
                line
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            ).split()[1]
        )
        mem = f"{mem_kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        mem = "? RAM"
    python = f"{platform.python_implementation()} {platform.python_version()}"
    return f"{python}, {os.cpu_count()} CPUs, {mem}"


def ensure_export(
    kind: str,
    model: Path,
    *,
    exporter: str = "torchscript",
    layers: int | None = None,
    force: bool = False,
    extra: list[str] | None = None,
) -> list[list[object]]:
    """Export ``kind`` to ``model`` (+ .data) unless it is already there; rows of what it cost."""
    data = model.with_name(model.name + ".data")
    if model.exists() and data.exists() and not force:
        print(f"using cached {model} ({human_bytes(file_size(model))}); --force-export to redo")
        return []
    model.parent.mkdir(parents=True, exist_ok=True)
    remove_model(model)
    script = str(BENCH_DIR / "_export.py")
    cmd = [sys.executable, script, kind, str(model), "--exporter", exporter]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    cmd += extra or []
    print(f"exporting {kind} with {exporter} -> {model} ...", flush=True)
    step = measure(cmd)
    sys.stdout.write(step.stdout)
    if not step.ok:
        raise SystemExit(f"export failed ({step.status()}):\n{step.stderr[-4000:]}")
    scratch = next(
        line.split("=", 1)[1] for line in step.stdout.splitlines() if line.startswith("SCRATCH=")
    )
    merge = measure([sys.executable, script, "consolidate", str(model), "--scratch", scratch])
    sys.stdout.write(merge.stdout)
    if not merge.ok:
        raise SystemExit(
            f"consolidating the export failed ({merge.status()}):\n{merge.stderr[-4000:]}"
        )
    return [
        [f"export ({exporter}, torch)", f"{step.wall_s:.1f}", f"{step.peak_rss_mb:.0f}"],
        [
            "export: rewrite as one .data file (onnx)",
            f"{merge.wall_s:.1f}",
            f"{merge.peak_rss_mb:.0f}",
        ],
    ]


def warm_page_cache(model: Path) -> None:
    """Read the model and its weights once so that no measured run pays the first disk read."""
    for path in (model, model.with_name(model.name + ".data")):
        if path.exists():
            with open(path, "rb") as f:
                while f.read(64 * 2**20):
                    pass


# Runs the original and the optimized model in onnxruntime on one random input and compares.
CHECK_SCRIPT = r"""
import sys, numpy as np, onnxruntime as ort
ref, opt, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(0)
feeds = {"input_ids": rng.integers(0, vocab, (2, 11)).astype(np.int64),
         "attention_mask": np.ones((2, 11), np.int64)}
feeds["attention_mask"][1, 7:] = 0
so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
a = ort.InferenceSession(ref, so, providers=["CPUExecutionProvider"]).run(None, feeds)
b = ort.InferenceSession(opt, so, providers=["CPUExecutionProvider"]).run(None, feeds)
print(max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)))
"""


def check_cmd(reference: Path, optimized: Path, vocab: int) -> list[str]:
    return [sys.executable, "-c", CHECK_SCRIPT, str(reference), str(optimized), str(vocab)]
