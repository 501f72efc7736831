"""The architecture matrix side by side: fusectl, onnxscript and onnxruntime's optimizer.

For every model in a matrix cache (``manifest.json`` written by
tests/fixtures/make_arch_matrix.py; default ``~/.cache/fusectl/arch_matrix/``) each tool runs once
in a fresh subprocess with a timeout (the commands of transformers_peers.py):

    fusectl     fusectl optimize MODEL -o OUT --report R.json --log null   (default --target ort)
    onnxscript  onnx_ir.load + onnxscript.rewriter.ort_fusions.optimize_for_ort + onnx_ir.save
    ORT         python -m onnxruntime.transformers.optimizer --model_type T --num_heads N
                --hidden_size H (T from the manifest: bert for encoders / vision / speech, gpt2
                for decoders, gpt_neox / qwen3 / bart / clip / vit / swin where onnxruntime has
                that type; its default opt_level for T)

Then per output: fused ops per class (attention, norms, skip norms, GELU-class, rotary; see
tests.conftest.FUSED_OP_CLASSES), nodes, and the largest absolute difference from the original
on onnxruntime CPU (ORT_DISABLE_ALL, the same feeds for all: tests.conftest.named_dim_feeds at
the manifest's dims).
Expected counts per model are the calls PyTorch makes (the manifest's ``expected``): attention
layers, norms, GELU + SiLU activations, rotary = 2 per attention layer of a rotary model.
For every model where fusectl fuses fewer attentions than there are attention layers, the
attention passes' near-misses from fusectl's report say why ("no near-miss reported" otherwise).

    python benchmarks/arch_matrix.py [CACHE] [--only qwen2,bart] [--tools fusectl,onnxscript,ort]
    python benchmarks/arch_matrix.py --tools fusectl       # fusectl again, the peers' kept
    python benchmarks/arch_matrix.py --print-only          # the last results again
    python benchmarks/arch_matrix.py --fixture-rows        # tests/test_arch_matrix.py's table

Results: benchmarks/out/arch_matrix/results.json (--json to put them elsewhere).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import _harness as h
from transformers_peers import ONNXSCRIPT_SCRIPT, count_ops, one_line

sys.path.insert(0, str(h.REPO_ROOT))
from tests.conftest import (  # shared with tests/test_arch_matrix.py
    FUSED_OP_CLASSES,
    fused_op_classes,
    named_dim_feeds,
    reference_outputs,
    run_model,
)

DEFAULT_CACHE = Path.home() / ".cache" / "fusectl" / "arch_matrix"
WORK_DIR = h.OUT_DIR / "arch_matrix"
FIXTURE_DIR = h.REPO_ROOT / "tests" / "fixtures" / "arch"
TOOLS = ("fusectl", "onnxscript", "ort")

# The fusectl passes whose near-misses explain a class that is not fused in every layer.
PASS_WORDS = {"attention": "Attention", "norm": "Norm", "gelu": "Gelu", "rotary": "Rotary"}


def expected_counts(entry: dict) -> dict[str, int]:
    """What PyTorch computes, per class (skip norms: not predicted, shown as '-')."""
    calls = entry["expected"]
    return {
        "attention": calls["attention"],
        "norm": calls["norm"],
        "gelu": calls["gelu"] + calls.get("silu", 0),  # SiLU fuses into QuickGelu(alpha=1)
        "rotary": calls["rotary"],
    }


def tool_command(tool: str, entry: dict, model: Path, out: Path, report: Path) -> list[str]:
    if tool == "fusectl":
        return h.fusectl_cmd(model, out, report=report)
    if tool == "onnxscript":
        return [sys.executable, "-c", ONNXSCRIPT_SCRIPT, str(model), str(out)]
    cmd = [sys.executable, "-m", "onnxruntime.transformers.optimizer", "--input", str(model)]
    cmd += ["--output", str(out), "--model_type", entry["ort_model_type"]]
    return [*cmd, "--num_heads", str(entry["heads"]), "--hidden_size", str(entry["hidden"])]


def max_difference(original: Path, optimized: Path, dims: dict[str, int]) -> float | str:
    """Largest |difference| over all outputs on onnxruntime CPU, optimizations off. Where
    onnxruntime cannot run the original at these sizes (the dynamo exporter's opset-23
    RotaryEmbedding, batch-1 caches, at batch 2), its outputs are onnx's reference evaluator's."""
    import numpy as np

    feeds = named_dim_feeds(original, dims)
    try:
        want = run_model(original, feeds)
    except Exception as error:
        try:
            want = reference_outputs(original, feeds)
        except Exception:  # onnx's evaluator neither (contrib ops): nothing to compare with
            return "ERR the original does not run: " + one_line(str(error), 140)
    try:
        got = run_model(optimized, feeds)
    except Exception as error:  # the tool wrote a model onnxruntime cannot run: say so
        return "ERR " + one_line(str(error), 160)
    if len(want) != len(got):
        return f"ERR {len(got)} outputs, not {len(want)}"
    pairs = zip(want, got, strict=True)
    return max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in pairs)


def near_misses(report: dict | None, cls: str) -> list[str]:
    """'Pass: reason (count)' for every near-miss of the class's fusectl passes."""
    word = PASS_WORDS[cls]
    found = []
    for entry in (report or {}).get("passes", []):
        if word in entry["name"]:
            found += [
                f"{entry['name']}: {m['reason']} ({m['count']})"
                for m in entry.get("near_misses", [])
            ]
    return found


def run_model_tools(entry: dict, cache: Path, dims: dict, tools: list[str], timeout: float) -> dict:
    model = cache / entry["file"]
    work = WORK_DIR / Path(entry["file"]).stem
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ops, nodes = count_ops(model)
    result: dict = {
        **{k: entry[k] for k in ("file", "arch", "exporter", "category", "attn_implementation")},
        "expected": expected_counts(entry),
        "tools": {"original": {"classes": fused_op_classes(ops), "nodes": nodes}},
    }
    for tool in tools:
        out, report = work / f"{tool}.onnx", work / f"{tool}.report.json"
        run = h.measure(tool_command(tool, entry, model, out, report), timeout=timeout)
        row: dict = {"wall_s": round(run.wall_s, 2), "status": run.status()}
        if run.ok and out.exists():
            ops, nodes = count_ops(out)
            row |= {"classes": fused_op_classes(ops), "nodes": nodes}
            row["diff"] = max_difference(model, out, dims)
            row["other_ms"] = ops.get("_other_ms", "")
        else:
            row["error"] = (
                f"TIMEOUT after {timeout:.0f} s" if run.timed_out else one_line(run.stderr)
            )
        if tool == "fusectl":
            fusectl_report = h.read_report(report)
            row["near_misses"] = {cls: near_misses(fusectl_report, cls) for cls in PASS_WORDS}
        result["tools"][tool] = row
    shutil.rmtree(work, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _cell(result: dict, cls: str) -> str:
    """'fusectl/onnxscript/ORT' counts of one class ('x': the tool failed)."""
    tools = result["tools"]
    return "/".join(
        str(tools[t]["classes"][cls]) if "classes" in tools.get(t, {}) else "x" for t in TOOLS
    )


def _diff(row: dict) -> str:
    value = row.get("diff")
    if value is None:
        return "x"
    return value[:3] if isinstance(value, str) else ("0" if value == 0 else f"{value:.0e}")


def complete(result: dict, tool: str, cls: str) -> bool:
    """The tool fused the class in every place PyTorch computes it."""
    row = result["tools"].get(tool, {})
    return "classes" in row and row["classes"][cls] >= result["expected"][cls]


def verdict(result: dict) -> str:
    """The issue's bar against the peers: per class >= the better peer; nodes <= the smallest
    peer (TorchScript) or within 10% of it (dynamo)."""
    tools = result["tools"]
    if "classes" not in tools.get("fusectl", {}):
        return "fusectl failed"
    peers = [tools[t] for t in ("onnxscript", "ort") if "classes" in tools.get(t, {})]
    # A diff that is a message: the output did not run. Where a peer's did, the original runs.
    if isinstance(tools["fusectl"].get("diff"), str) and any(
        isinstance(peer.get("diff"), float | int) for peer in peers
    ):
        return "fusectl output does not run"
    behind = [
        cls
        for cls in FUSED_OP_CLASSES
        if any(tools["fusectl"]["classes"][cls] < peer["classes"][cls] for peer in peers)
    ]
    fewest = min((peer["nodes"] for peer in peers), default=None)
    slack = 1.0 if result["exporter"] == "torchscript" else 1.1
    if fewest is not None and tools["fusectl"]["nodes"] > fewest * slack:
        behind.append(f"nodes>{fewest}")
    return "ok" if not behind else "behind: " + ",".join(behind)


def print_table(results: list[dict]) -> None:
    headers = ["model", "exp", "attn f/s/o", "norm", "skip", "gelu", "rotary", "nodes (orig)"]
    headers += ["diff f/s/o", "vs peers"]
    rows = []
    for r in results:
        e = r["expected"]
        tools = r["tools"]
        rows.append([
            f"{r['arch']} {'ts17' if r['exporter'] == 'torchscript' else 'dynamo'}",
            f"{e['attention']}/{e['norm']}/{e['gelu']}/{e['rotary']}",
            _cell(r, "attention"), _cell(r, "norm"), _cell(r, "skip_norm"), _cell(r, "gelu"),
            _cell(r, "rotary"),
            "/".join(str(tools.get(t, {}).get("nodes", "x")) for t in TOOLS)
            + f" ({tools['original']['nodes']})",
            " ".join(_diff(tools.get(t, {})) for t in TOOLS),
            verdict(r),
        ])  # fmt: skip
    print(h.table(headers, rows))
    print(
        "exp: attention layers / norms / GELU+SiLU / rotary that PyTorch computes; cells: "
        "fusectl/onnxscript/ORT counts; x: the tool failed (see below)."
    )


def print_why(results: list[dict]) -> None:
    print("\n### Where fusectl does not fuse every attention layer, and why")
    short = [r for r in results if not complete(r, "fusectl", "attention")]
    print("" if short else "(nowhere)")
    for r in short:
        fusectl = r["tools"].get("fusectl", {})
        if "classes" not in fusectl:
            continue
        got, want = fusectl["classes"]["attention"], r["expected"]["attention"]
        print(f"- {r['arch']} / {r['exporter']}: attention {got}/{want}")
        for line in fusectl["near_misses"]["attention"] or ["no near-miss reported"]:
            print(f"    {line}")
    failures = [
        f"- {r['arch']} / {r['exporter']} / {tool}: {row['error']}"
        for r in results
        for tool, row in r["tools"].items()
        if "error" in row
    ] + [
        f"- {r['arch']} / {r['exporter']} / {tool}: output does not run: {row['diff'][4:]}"
        for r in results
        for tool, row in r["tools"].items()
        if isinstance(row.get("diff"), str)
    ]
    if failures:
        print("\n### Tool failures")
        print("\n".join(failures))


def print_summary(results: list[dict]) -> None:
    print("\n### Per class: exports fused in every place (fusectl / onnxscript / ORT)")
    rows = []
    for cls in ("attention", "norm", "gelu", "rotary"):
        relevant = [r for r in results if r["expected"][cls] > 0]
        counts = [sum(complete(r, t, cls) for r in relevant) for t in TOOLS]
        rows.append([cls, *(f"{c}/{len(relevant)}" for c in counts)])
    print(h.table(["class", *TOOLS], rows))
    by_category: dict[str, list[dict]] = {}
    for r in results:
        by_category.setdefault(r["category"], []).append(r)
    rows = []
    for category, members in by_category.items():
        relevant = [r for r in members if r["expected"]["attention"] > 0]
        counts = [sum(complete(r, t, "attention") for r in relevant) for t in TOOLS]
        rows.append([category, *(f"{c}/{len(relevant)}" for c in counts)])
    print("\nattention in every layer, by category:")
    print(h.table(["category", *TOOLS], rows))
    ok = sum(verdict(r) == "ok" for r in results)
    print(f"\nfusectl meets the peer bar (classes >= peers, nodes) on {ok}/{len(results)} exports")


def print_all(results: list[dict]) -> None:
    print_table(results)
    print_summary(results)
    print_why(results)


ROW_CLASSES = ("attention", "norm", "skip_norm", "gelu", "rotary")  # tests/test_arch_matrix.py


def _literal_line(key: str, text: str) -> list[str]:
    """`key: "text",` as dict-literal lines of at most 100 characters."""
    line = f"    {key}: {json.dumps(text)},"
    if len(line) <= 100:
        return [line]
    parts = textwrap.wrap(text, 80, drop_whitespace=False)
    return [f"    {key}: (", *(f"        {json.dumps(part)}" for part in parts), "    ),"]


def print_fixture_rows(results: list[dict]) -> None:
    """ROWS and WHY of tests/test_arch_matrix.py for fusectl as it is now, to paste there."""
    rows, why = [], []
    for r in sorted(results, key=lambda r: r["file"]):
        name = Path(r["file"]).stem
        fusectl = r["tools"]["fusectl"]
        today = tuple(fusectl["classes"][cls] for cls in ROW_CLASSES)
        target = tuple(r["expected"].get(cls) for cls in ROW_CLASSES)
        rows.append(f'    "{name}": ({today}, {target}),')
        for cls in PASS_WORDS:
            index = ROW_CLASSES.index(cls)
            if today[index] < target[index]:
                reasons = "; ".join(dict.fromkeys(fusectl["near_misses"][cls]))
                reasons = re.sub(r" \(\d+\)(?=;|$)", "", reasons)  # the counts
                why += _literal_line(f'("{name}", "{cls}")', reasons or "no near-miss reported")
    print("ROWS: dict[str, tuple[tuple[int, ...], tuple[int | None, ...]]] = {")
    print("\n".join(rows) + "\n}")
    print("WHY: dict[tuple[str, str], str] = {")
    print("\n".join(why) + "\n}  # fmt: skip")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cache", nargs="?", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--only", default="", help="comma-separated architectures [all]")
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--tools", default=",".join(TOOLS), help="[fusectl,onnxscript,ort]")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per tool run [300]")
    parser.add_argument("--json", type=Path, default=WORK_DIR / "results.json")
    parser.add_argument("--print-only", action="store_true")
    parser.add_argument(
        "--fixture-rows",
        action="store_true",
        help="fusectl alone on tests/fixtures/arch: print ROWS / WHY for tests/test_arch_matrix.py",
    )
    args = parser.parse_args()
    if args.fixture_rows:
        args.cache, args.tools = FIXTURE_DIR, "fusectl"
    if args.print_only:
        print_all(json.loads(args.json.read_text())["results"])
        return
    manifest_path = args.cache / "manifest.json"
    if not manifest_path.exists():
        raise SystemExit(f"{manifest_path}: no manifest; run tests/fixtures/make_arch_matrix.py")
    manifest = json.loads(manifest_path.read_text())
    only = set(filter(None, args.only.split(",")))
    exporters = args.exporters.split(",")
    tools = [t for t in args.tools.split(",") if t]
    entries = [
        e
        for e in manifest["models"]
        if (not only or e["arch"] in only) and e["exporter"] in exporters
    ]
    # Tools not run this time keep their results of the last run on the same file (the peers
    # do not change when fusectl does: --tools fusectl re-measures fusectl alone).
    earlier = {}
    if args.json.exists() and not args.fixture_rows:
        earlier = {r["file"]: r["tools"] for r in json.loads(args.json.read_text())["results"]}
    results = []
    for number, entry in enumerate(entries, 1):
        print(f"[{number}/{len(entries)}] {entry['file']}", flush=True)
        result = run_model_tools(entry, args.cache, manifest["dims"], tools, args.timeout)
        kept = earlier.get(entry["file"], {})
        result["tools"] = {**{t: r for t, r in kept.items() if t not in tools}, **result["tools"]}
        results.append(result)
    if args.fixture_rows:
        print_fixture_rows(results)
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    document = {"machine": h.machine_note(), "cache": str(args.cache), "results": results}
    document["export_failures"] = manifest["failures"]
    args.json.write_text(json.dumps(document, indent=1) + "\n")
    print()
    print_all(results)
    for failure in manifest["failures"]:
        print(f"- export failed: {failure['arch']} / {failure['exporter']}: {failure['error']}")


if __name__ == "__main__":
    main()
