"""fusectl against its peers on exported transformers: onnxscript and onnxruntime's optimizer.

Models (random weights): BERT-base (``BertConfig()``), GPT-2 small (``GPT2Config()``, 124 M,
``GPT2LMHeadModel``) and a LLaMA-style GQA model (``LlamaConfig(hidden_size=2048,
intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4)``,
``LlamaForCausalLM``), each exported by the TorchScript exporter (opset 17) and the dynamo
exporter (opset 18) with external data; inputs ``input_ids`` and ``attention_mask`` with dynamic
batch and sequence (``_export.py``, eager attention, no KV cache). For every model x exporter,
each tool runs once in a fresh subprocess with a timeout (``_harness.measure``: wall time, peak
RSS):

    fusectl     fusectl optimize MODEL -o OUT --report R.json --log null   (default --target ort)
    onnxscript  onnx_ir.load + onnxscript.rewriter.ort_fusions.optimize_for_ort + onnx_ir.save
                (external data)
    ORT(type)   python -m onnxruntime.transformers.optimizer --input M --output O
                --model_type bert|gpt2 --num_heads N --hidden_size H --use_external_data_format
                (its default opt_level 1: onnxruntime's basic graph optimizations first)

Then it counts the fused-op classes in each output, and runs the original and each output in
onnxruntime on CPU (batch 1, sequence --seq, attention_mask all ones, ids drawn from the vocab;
1 intra-op thread; median of --runs runs after --warmup) under ORT_ENABLE_ALL and
ORT_DISABLE_ALL, comparing each output with the original's (both under DISABLE_ALL, and under
ENABLE_ALL). Small models are timed round-robin in one process; models whose sessions would not
fit in --latency-mem-gb run one at a time, each in its own process. A tool that fails gets its
error (one line) recorded and the tables go on. Results of each model x exporter are saved to
benchmarks/out/peers/results/ so that ``--print-only`` can print them again.

    python benchmarks/transformers_peers.py                               # everything
    python benchmarks/transformers_peers.py --models bert,gpt2 --exporters dynamo
    python benchmarks/transformers_peers.py --llama-layers 4 --llama-ort-types bert,gpt2
    python benchmarks/transformers_peers.py --print-only
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import _harness as h

PEERS_DIR = h.OUT_DIR / "peers"
RESULTS_DIR = PEERS_DIR / "results"

MODELS = {
    # name: export kind, vocab, heads, hidden, onnxruntime model types to try
    "bert": {"kind": "bert", "vocab": 30522, "heads": 12, "hidden": 768, "ort": ["bert"]},
    "gpt2": {"kind": "gpt2", "vocab": 50257, "heads": 12, "hidden": 768, "ort": ["gpt2"]},
    "llama": {
        "kind": "llama",
        "vocab": 32000,
        "heads": 16,
        "hidden": 2048,
        "ort": ["bert", "gpt2"],
    },
}
EXPORTERS = ["torchscript", "dynamo"]

# Fused-op classes counted in every output ("Gemm/FusedGemm" is the sum of both).
CLASSES = [
    "MultiHeadAttention",
    "Attention",
    "GroupQueryAttention",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "BiasGelu",
    "FastGelu",
    "Gelu",
    "QuickGelu",
    "FusedMatMul",
    "RotaryEmbedding",
    "EmbedLayerNormalization",
    "Gemm/FusedGemm",
]

ONNXSCRIPT_SCRIPT = r"""
import json, os, sys, time
import onnx_ir as ir
from onnxscript.rewriter.ort_fusions import optimize_for_ort
src, dst = sys.argv[1], sys.argv[2]
began = time.perf_counter()
model = ir.load(src)
result = optimize_for_ort(model)
model, counts = result if isinstance(result, tuple) else (result, {})
ir.save(model, dst, external_data=os.path.basename(dst) + ".data")
print("COUNTS=" + json.dumps({k: v for k, v in counts.items() if v}))
"""

# Times one or more models under the given levels; writes timings and the outputs (.npy).
LATENCY_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np, onnxruntime as ort
spec = json.load(open(sys.argv[1]))
levels = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
          "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
rng = np.random.default_rng(0)
base = {"input_ids": rng.integers(0, spec["vocab"], (1, spec["seq"])).astype(np.int64),
        "attention_mask": np.ones((1, spec["seq"]), np.int64)}
dtypes = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
result = {}
def one_line(exc):
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:400]
def open_session(path, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[level]
    so.intra_op_num_threads = spec["threads"]
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feeds = {}
    for arg in sess.get_inputs():
        if arg.name not in base:
            raise ValueError(f"unexpected input {arg.name}")
        feeds[arg.name] = base[arg.name].astype(dtypes.get(arg.type, np.int64))
    return sess, feeds
def save_outputs(key, outs):
    label, level = key
    for i, o in enumerate(outs):
        np.save(f"{spec['npy_dir']}/{label}.{level}.{i}.npy", np.asarray(o))
sessions = {}
for label, path in spec["models"]:
    result[label] = {}
    for level in spec["levels"]:
        try:
            began = time.perf_counter()
            sess, feeds = open_session(path, level)
            result[label][level + "_load_s"] = time.perf_counter() - began
            save_outputs((label, level), sess.run(None, feeds))
            sessions[(label, level)] = (sess, feeds)
        except Exception as exc:
            result[label][level] = {"error": one_line(exc)}
            continue
        if spec["sequential"]:
            try:
                for _ in range(spec["warmup"]):
                    sess.run(None, feeds)
                times = []
                for _ in range(spec["runs"]):
                    t = time.perf_counter(); sess.run(None, feeds)
                    times.append((time.perf_counter() - t) * 1000)
                result[label][level] = {"median_ms": statistics.median(times), "min_ms": min(times)}
            except Exception as exc:
                result[label][level] = {"error": one_line(exc)}
            del sessions[(label, level)], sess
if not spec["sequential"]:
    for sess, feeds in sessions.values():
        for _ in range(spec["warmup"]):
            sess.run(None, feeds)
    times = {key: [] for key in sessions}
    for _ in range(spec["runs"]):
        for key, (sess, feeds) in sessions.items():
            t = time.perf_counter(); sess.run(None, feeds)
            times[key].append((time.perf_counter() - t) * 1000)
    for (label, level), values in times.items():
        result[label][level] = {"median_ms": statistics.median(values), "min_ms": min(values)}
json.dump(result, open(spec["out"], "w"))
"""


def one_line(text: str, limit: int = 300) -> str:
    """The last meaningful line of a tool's stderr (the exception), shortened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith(("warnings.warn", "^", "~")):
            return line[:limit]
    return "(no message)"


def count_ops(path: Path) -> tuple[Counter, int]:
    """op_type counts over the graph and its subgraphs, and the node total."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    counts: Counter = Counter()
    domains: dict[str, str] = {}

    def walk(graph) -> None:
        for node in graph.node:
            counts[node.op_type] += 1
            domains[node.op_type] = node.domain
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    walk(proto.graph)
    total = sum(counts.values())
    counts["Gemm/FusedGemm"] = counts.get("Gemm", 0) + counts.get("FusedGemm", 0)
    known = set(CLASSES) | {"Gemm", "FusedGemm"}
    other = sorted(
        f"{op}={n}"
        for op, n in counts.items()
        if domains.get(op) == "com.microsoft" and op not in known
    )
    counts["_other_ms"] = ", ".join(other)  # type: ignore[assignment]
    return counts, total


def tool_commands(case: dict, model: Path) -> list[tuple[str, list[str], Path, Path | None]]:
    """(label, argv, output model, fusectl report) for every tool run on ``model``."""
    stem = PEERS_DIR / case["id"]
    runs = []
    out = Path(f"{stem}.fusectl.onnx")
    report = Path(f"{stem}.fusectl.report.json")
    runs.append(("fusectl", h.fusectl_cmd(model, out, report=report), out, report))
    out = Path(f"{stem}.onnxscript.onnx")
    runs.append(
        ("onnxscript", [sys.executable, "-c", ONNXSCRIPT_SCRIPT, str(model), str(out)], out, None)
    )
    for model_type in case["ort"]:
        out = Path(f"{stem}.ort_{model_type}.onnx")
        cmd = [sys.executable, "-m", "onnxruntime.transformers.optimizer"]
        cmd += ["--input", str(model), "--output", str(out), "--model_type", model_type]
        cmd += ["--num_heads", str(case["heads"]), "--hidden_size", str(case["hidden"])]
        cmd += ["--use_external_data_format"]
        runs.append((f"ORT({model_type})", cmd, out, None))
    return runs


def remove_outputs(path: Path) -> None:
    h.remove_model(path)
    for extra in path.parent.glob(path.name + "*"):
        if extra.is_file():
            extra.unlink()


def latency(
    case: dict, models: list[tuple[str, Path]], args: argparse.Namespace
) -> tuple[dict, dict]:
    """Timings per label and level, and max |diff| against the original's outputs."""
    import numpy as np

    npy_dir = PEERS_DIR / f"{case['id']}.npy"
    shutil.rmtree(npy_dir, ignore_errors=True)
    npy_dir.mkdir(parents=True)
    weights = sum(h.file_size(p) for _, p in models)
    sequential = weights * 2 * 1.5 > args.latency_mem_gb * 2**30
    groups = [[m] for m in models] if sequential else [models]
    timings: dict = {}
    for group in groups:
        spec_path = npy_dir / "spec.json"
        out_path = npy_dir / "latency.json"
        spec = {
            "models": [[label, str(path)] for label, path in group],
            "levels": ["all", "none"],
            "vocab": case["vocab"],
            "seq": args.seq,
            "threads": args.threads,
            "runs": args.runs,
            "warmup": args.warmup,
            "sequential": sequential,
            "npy_dir": str(npy_dir),
            "out": str(out_path),
        }
        spec_path.write_text(json.dumps(spec))
        for _, path in group:
            h.warm_page_cache(path)
        run = h.measure(
            [sys.executable, "-c", LATENCY_SCRIPT, str(spec_path)], timeout=args.latency_timeout
        )
        if run.ok:
            timings.update(json.loads(out_path.read_text()))
        else:
            error = "TIMEOUT" if run.timed_out else one_line(run.stderr)
            for label, _ in group:
                timings[label] = {"all": {"error": error}, "none": {"error": error}}
        print(
            f"  latency {', '.join(label for label, _ in group)}: {run.wall_s:.0f} s, "
            f"peak RSS {run.peak_rss_mb:.0f} MB ({run.status()})",
            flush=True,
        )

    def outputs(label: str, level: str) -> list:
        found = sorted(
            npy_dir.glob(f"{label}.{level}.*.npy"), key=lambda p: int(p.stem.split(".")[-1])
        )
        return [np.load(p) for p in found]

    diffs: dict = {}
    for level in ("none", "all"):
        reference = outputs("original", "none")
        for label, _ in models:
            mine = outputs(label, level)
            if not reference or not mine:
                continue
            if len(mine) != len(reference) or any(
                a.shape != b.shape for a, b in zip(reference, mine, strict=False)
            ):
                diffs.setdefault(label, {})[level] = "shape mismatch"
                continue
            diffs.setdefault(label, {})[level] = max(
                float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                for a, b in zip(reference, mine, strict=False)
            )
    reference = outputs("original", "none")
    if reference:
        diffs["_scale"] = max(float(np.max(np.abs(a))) for a in reference)
    shutil.rmtree(npy_dir, ignore_errors=True)
    return timings, diffs


def _commit() -> str:
    """The fusectl commit the run used (``+dirty`` when fusectl/ or passes/ had changes)."""
    import subprocess

    def git(*argv: str) -> str:
        proc = subprocess.run(
            ["git", *argv], cwd=h.REPO_ROOT, capture_output=True, text=True, check=False
        )
        return proc.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    return head + ("+dirty" if git("status", "--porcelain", "fusectl", "passes") else "")


def run_case(case: dict, args: argparse.Namespace) -> dict:
    model = case["path"]
    export_rows = h.ensure_export(
        case["kind"],
        model,
        exporter=case["exporter"],
        layers=case.get("layers"),
        force=args.force_export,
        extra=["--attn", case["attn"]],
    )
    counts, total = count_ops(model)
    result: dict = {
        "id": case["id"],
        "model": case["name"],
        "exporter": case["exporter"],
        "attn": case["attn"],
        "size": h.file_size(model),
        "export": export_rows,
        "fusectl_commit": _commit(),
        "tools": {"original": {"counts": dict(counts), "nodes": total, "status": "ok"}},
    }
    print(
        f"\n== {case['id']}: {total} nodes, {h.human_bytes(h.file_size(model))}",
        flush=True,
    )
    h.warm_page_cache(model)
    produced: list[tuple[str, Path]] = [("original", model)]
    for label, cmd, out, report in tool_commands(case, model):
        if args.tools and label.split("(")[0].lower() not in args.tools:
            continue
        remove_outputs(out)
        run = h.measure(cmd, timeout=args.timeout)
        entry: dict = {
            "wall_s": run.wall_s,
            "peak_rss_mb": run.peak_rss_mb,
            "status": run.status(),
        }
        if run.ok and out.exists():
            tool_counts, tool_total = count_ops(out)
            entry.update(counts=dict(tool_counts), nodes=tool_total)
            produced.append((label, out))
            if report is not None:
                summary = h.report_summary(h.read_report(report))
                entry["fusions"] = summary["fusions"]
                entry["passes_s"] = summary["passes_s"]
            for line in run.stdout.splitlines():
                if line.startswith("COUNTS="):
                    entry["fusions"] = line.split("=", 1)[1]
        else:
            if run.timed_out:
                entry["error"] = f"TIMEOUT after {args.timeout:.0f} s"
            elif run.ok:
                entry["error"] = f"no output written ({out.name})"
            else:
                entry["error"] = one_line(run.stderr)
            entry["status"] = "FAILED"
        if report is not None:
            report.unlink(missing_ok=True)
            out.with_suffix(".fusion_result.json").unlink(missing_ok=True)
        result["tools"][label] = entry
        print(
            f"  {label}: {run.wall_s:.1f} s, peak RSS {run.peak_rss_mb:.0f} MB, "
            f"{entry.get('nodes', '-')} nodes {entry.get('error', '')}",
            flush=True,
        )
    if not args.no_latency:
        timings, diffs = latency(case, produced, args)
        result["scale"] = diffs.pop("_scale", None)
        for label, _ in produced:
            result["tools"][label]["latency"] = timings.get(label, {})
            result["tools"][label]["diff"] = diffs.get(label, {})
    if not args.keep:
        for _, path in produced[1:]:
            remove_outputs(path)
    if args.delete_exports:
        remove_outputs(model)
    return result


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _lat(entry: dict, level: str) -> str:
    value = entry.get("latency", {}).get(level)
    if not value:
        return "-"
    if "error" in value:
        return "ERR"
    return f"{value['median_ms']:.1f}"


def _diff(entry: dict, level: str) -> str:
    value = entry.get("diff", {}).get(level)
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return "0" if value == 0 else f"{value:.1e}"


def print_case(result: dict) -> None:
    tools = result["tools"]
    scale = result.get("scale")
    print(
        f"\n### {result['model']} / {result['exporter']}"
        f"{'' if result.get('attn', 'eager') == 'eager' else ' / ' + result['attn']} "
        f"({tools['original']['nodes']} nodes, {h.human_bytes(result['size'])}, "
        f"fusectl {result.get('fusectl_commit', '?')}"
        + (f"; max |output| {scale:.2g}" if scale else "")
        + ")"
    )
    headers = ["tool", "status", "wall s", "peak RSS MB", "nodes", "ALL ms", "NONE ms"]
    headers += ["|diff| NONE", "|diff| ALL"]
    rows = []
    for label, entry in tools.items():
        rows.append(
            [
                label,
                entry["status"],
                f"{entry['wall_s']:.1f}" if "wall_s" in entry else "",
                f"{entry['peak_rss_mb']:.0f}" if "peak_rss_mb" in entry else "",
                entry.get("nodes", "-"),
                _lat(entry, "all"),
                _lat(entry, "none"),
                _diff(entry, "none"),
                _diff(entry, "all"),
            ]
        )
    print(h.table(headers, rows))
    # fused-op classes: only those present in some output
    labels = list(tools)
    present = [c for c in CLASSES if any(tools[t].get("counts", {}).get(c, 0) for t in labels)]
    if present:
        rows = [
            [c, *(tools[t]["counts"].get(c, 0) if "counts" in tools[t] else "-" for t in labels)]
            for c in present
        ]
        print()
        print(h.table(["fused-op class", *labels], rows))
    for label, entry in tools.items():
        if entry.get("counts", {}).get("_other_ms"):
            print(f"  {label}: other com.microsoft ops: {entry['counts']['_other_ms']}")
    for label, entry in tools.items():
        if "error" in entry:
            print(f"  {label} FAILED: {entry['error']}")
        for level in ("all", "none"):
            err = entry.get("latency", {}).get(level, {}).get("error")
            if err:
                print(f"  {label} under {level.upper()}: onnxruntime failed: {err}")
    for label, entry in tools.items():
        if entry.get("fusions"):
            print(f"  {label} fusions: {entry['fusions']}")


def _attn(result: dict, sep: str) -> str:
    attn = result.get("attn", "eager")
    return "" if attn == "eager" else f"{sep}{attn}"


def best_ort(tools: dict) -> str | None:
    """The ORT(type) run that produced the most fused ops (for the summary)."""
    candidates = [t for t in tools if t.startswith("ORT(")]
    ok = [t for t in candidates if "counts" in tools[t]]
    if not ok:
        return candidates[0] if candidates else None
    return max(
        ok,
        key=lambda t: sum(
            tools[t]["counts"].get(c, 0)
            for c in CLASSES
            if c not in ("LayerNormalization", "Gemm/FusedGemm")
        ),
    )


def print_summary(results: list[dict]) -> None:
    print("\n### Summary: fused-op class: fusectl / onnxscript / ORT (original in brackets)")
    cols = []
    for r in results:
        ort_label = best_ort(r["tools"])
        cols.append((r, ort_label))
    headers = ["fused-op class"]
    for r, lab in cols:
        suffix = f" {lab[4:-1]}" if lab and r["model"] == "llama" else ""
        headers.append(f"{r['model']}-{r['exporter'][:5]}{_attn(r, '-')}{suffix}")

    def cell(tools: dict, label: str | None, cls: str) -> str:
        if label is None or label not in tools or "counts" not in tools[label]:
            return "x"
        return str(tools[label]["counts"].get(cls, 0))

    rows = []
    for cls in CLASSES:
        row = [cls]
        for r, ort_label in cols:
            t = r["tools"]
            orig = t["original"]["counts"].get(cls, 0)
            text = "/".join(cell(t, lab, cls) for lab in ("fusectl", "onnxscript", ort_label))
            row.append(text + (f" [{orig}]" if orig else ""))
        rows.append(row)
    nodes_row = ["nodes"]
    for r, ort_label in cols:
        t = r["tools"]
        text = "/".join(
            str(t.get(lab or "", {}).get("nodes", "x"))
            for lab in ("fusectl", "onnxscript", ort_label)
        )
        nodes_row.append(f"{text} [{t['original']['nodes']}]")
    rows.append(nodes_row)
    print(h.table(headers, rows))
    print("x: the tool failed. For LLaMA the ORT column is the model type named in the header.")

    print("\n### Summary: onnxruntime CPU latency, median ms (ENABLE_ALL / DISABLE_ALL)")
    headers = ["model / exporter", "original", "fusectl", "onnxscript", "ORT"]
    rows = []
    for r, ort_label in cols:
        t = r["tools"]
        row = [f"{r['model']} / {r['exporter']}{_attn(r, ' / ')}"]
        for lab in ("original", "fusectl", "onnxscript", ort_label):
            entry = t.get(lab or "", {})
            row.append(f"{_lat(entry, 'all')} / {_lat(entry, 'none')}" if entry else "x")
        rows.append(row)
    print(h.table(headers, rows))

    print("\n### Summary: tool wall s / peak RSS MB")
    rows = []
    for r, ort_label in cols:
        t = r["tools"]
        row = [f"{r['model']} / {r['exporter']}{_attn(r, ' / ')}"]
        for lab in ("fusectl", "onnxscript", ort_label):
            entry = t.get(lab or "", {})
            row.append(
                f"{entry['wall_s']:.1f} / {entry['peak_rss_mb']:.0f}"
                + ("" if entry.get("status") == "ok" else " FAILED")
                if "wall_s" in entry
                else "x"
            )
        rows.append(row)
    print(h.table(["model / exporter", "fusectl", "onnxscript", "ORT"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="bert,gpt2,llama", help="[bert,gpt2,llama]")
    parser.add_argument("--exporters", default="torchscript,dynamo", help="[torchscript,dynamo]")
    parser.add_argument("--tools", default="", help="subset of fusectl,onnxscript,ort [all]")
    parser.add_argument("--llama-layers", type=int, default=16, help="[16]")
    parser.add_argument(
        "--llama-ort-types",
        default="bert,gpt2",
        help="onnxruntime --model_type values tried on LLaMA [bert,gpt2]",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per tool run [1800]")
    parser.add_argument("--latency-timeout", type=float, default=3600, help="seconds [3600]")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per session [20]")
    parser.add_argument("--warmup", type=int, default=3, help="[3]")
    parser.add_argument("--seq", type=int, default=128, help="sequence length [128]")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads [1]")
    parser.add_argument(
        "--latency-mem-gb",
        type=float,
        default=8,
        help="time all sessions of a model together when they fit in this [8]",
    )
    parser.add_argument(
        "--attn",
        default="eager",
        help="transformers attention implementation for the export (eager, sdpa) [eager]",
    )
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--force-export", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the tools' output models")
    parser.add_argument(
        "--delete-exports", action="store_true", help="delete each exported model after use"
    )
    parser.add_argument("--print-only", action="store_true", help="print the saved results")
    args = parser.parse_args()
    args.tools = [t.strip().lower() for t in args.tools.split(",") if t.strip()]

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    exporters = [e.strip() for e in args.exporters.split(",") if e.strip()]
    cases = []
    for name in models:
        spec = dict(MODELS[name])
        if name == "llama":
            spec["ort"] = [t.strip() for t in args.llama_ort_types.split(",") if t.strip()]
        for exporter in exporters:
            stem = name if name != "llama" else f"llama{args.llama_layers}"
            suffix = "" if args.attn == "eager" else f"_{args.attn}"
            case = dict(spec, name=name, exporter=exporter, attn=args.attn)
            case["id"] = f"{stem}_{exporter}{suffix}"
            case["path"] = PEERS_DIR / f"{case['id']}.onnx"
            if name == "llama":
                case["layers"] = args.llama_layers
            cases.append(case)

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    print(f"# fusectl vs onnxscript vs onnxruntime.transformers.optimizer ({h.machine_note()})")
    results = []
    for case in cases:
        saved = RESULTS_DIR / f"{case['id']}.json"
        if args.print_only:
            if saved.exists():
                results.append(json.loads(saved.read_text()))
            continue
        began = time.perf_counter()
        try:
            result = run_case(case, args)
        except SystemExit as exc:  # export failed: record it and go on
            print(f"  {case['id']}: {exc}", flush=True)
            continue
        result["case_s"] = time.perf_counter() - began
        saved.write_text(json.dumps(result, indent=1))
        results.append(result)
        print_case(result)
    if args.print_only:
        for result in results:
            print_case(result)
    if results:
        print_summary(results)
    print(
        f"\nlatency: batch 1, sequence {args.seq}, {args.threads} intra-op thread(s), "
        f"median of {args.runs} runs after {args.warmup} warm-up; |diff| = max abs difference "
        "from the original under DISABLE_ALL"
    )


if __name__ == "__main__":
    main()
