"""fusectl on models exported by Optimum, the way most users get an LLM as ONNX.

The exports come from ``tests/fixtures/make_optimum_fixtures.py --probe DIR`` (tiny random-weight
models of every text-generation type Optimum exports, its seq2seq and Whisper decoders with their
merged If form, a few encoders; Optimum needs transformers < 4.58, so in its own venv). For every
``.onnx`` under DIR, in fresh subprocesses:

    fusectl optimize MODEL -o OUT --report R.json --log null
    fusectl verify MODEL OUT --json                     (generated inputs, the default sizes)

and per model: fusectl's exit code, the fused classes its report counts (fused / sites), nodes
before and after (If branches included), and verify's verdict with the largest absolute
difference. ``--checkout PATH`` runs a second fusectl tree (another commit's clone) on the same
exports in the same run, for a before/after.

    python benchmarks/optimum_exports.py DIR [--checkout /tmp/base] [--only llama,bart]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness as h

CLASSES = ("attention", "norms", "GELU", "rotary")


def run_fusectl(tree: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m fusectl ARGS`` with ``tree`` first on the path (cwd outside every tree)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-m", "fusectl", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)


def measure(tree: Path, model: Path, work: Path) -> dict:
    output, report = work / "out.onnx", work / "report.json"
    for stale in (output, report):
        stale.unlink(missing_ok=True)
    done = run_fusectl(
        tree,
        ["optimize", str(model), "-o", str(output), "--report", str(report), "--log", "null"],
        work,
    )
    row: dict = {"exit": done.returncode}
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or [""])[-1][:160]
        return row
    document = json.loads(report.read_text())
    row["coverage"] = {k: (v["fused"], v["total"]) for k, v in document["coverage"].items()}
    graphs = document["graphs"]  # the main graph and every If branch
    row["nodes"] = tuple(
        sum(g[key] or 0 for g in graphs) for key in ("nodes_before", "nodes_after")
    )
    checked = run_fusectl(tree, ["verify", str(model), str(output), "--json"], work)
    if checked.returncode in (0, 1) and checked.stdout.strip():
        result = json.loads(checked.stdout)
        worst = max((o.get("max_abs") or 0.0 for o in result["outputs"]), default=0.0)
        row["verify"] = f"{'ok' if checked.returncode == 0 else 'FAIL'} {worst:.1e}"
    else:
        row["verify"] = "cannot run the original" if checked.returncode == 2 else "error"
    return row


def cells(row: dict) -> list[str]:
    if row["exit"] != 0:
        return [f"exit {row['exit']}: {row['error']}", *[""] * (len(CLASSES) + 1)]
    coverage = row["coverage"]
    classes = [f"{coverage[c][0]}/{coverage[c][1]}" if c in coverage else "" for c in CLASSES]
    return [*classes, "{} -> {}".format(*row["nodes"]), row["verify"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--checkout", type=Path, help="a second fusectl tree to compare with")
    parser.add_argument("--only", default="", help="comma-separated model folder names")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    models = sorted(
        path for path in args.directory.rglob("*.onnx") if not only or path.parent.name in only
    )
    trees = [("this", h.REPO_ROOT)]
    if args.checkout is not None:
        trees.append((args.checkout.name, args.checkout))
    headers = ["model", *(["tree"] if args.checkout else []), *CLASSES, "nodes", "verify"]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for model in models:
            name = str(model.relative_to(args.directory).with_suffix(""))
            for label, tree in trees:
                row = measure(tree.resolve(), model.resolve(), Path(work))
                rows.append([name, *([label] if args.checkout else []), *cells(row)])
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(h.table(headers, rows))


if __name__ == "__main__":
    main()
