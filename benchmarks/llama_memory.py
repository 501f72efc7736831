"""Peak memory of fusectl on a LLaMA-style model whose weights (~3.4 GB fp32) dwarf the graph.

Builds ``LlamaForCausalLM(LlamaConfig(hidden_size=2048, intermediate_size=5504,
num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000))`` with
random weights, exports it once to benchmarks/out/ with external data (one .data file), then
measures ``fusectl optimize`` in a fresh subprocess: wall time, peak RSS (ru_maxrss) and the
sampled peaks of private (RssAnon) and file-backed (RssFile, i.e. memory-mapped weights) memory.
A plain onnx.load + onnx.save is measured as the reference. Target: fusectl peak RSS < 300 MB.

    python benchmarks/llama_memory.py                 # 16 layers, TorchScript exporter
    python benchmarks/llama_memory.py --layers 8      # smaller, if the export does not fit
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import _harness as h
import onnx


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=16, help="num_hidden_layers [16]")
    parser.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    parser.add_argument("--rss-target-mb", type=float, default=300)
    parser.add_argument(
        "--repeat", type=int, default=1, help="fusectl runs; best wall time kept [1]"
    )
    parser.add_argument("--force-export", action="store_true", help="export again even if cached")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the onnx.load + onnx.save run"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare original and optimized outputs in onnxruntime (needs ~8 GB RAM)",
    )
    parser.add_argument("--out-dir", type=Path, default=h.OUT_DIR)
    parser.add_argument("--keep-output", action="store_true", help="keep the optimized model")
    args = parser.parse_args()

    print(f"# LLaMA memory benchmark ({h.machine_note()})")
    model = args.out_dir / f"llama_{args.layers}l_{args.exporter}.onnx"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.out_dir).free
    print(f"free disk in {args.out_dir}: {h.human_bytes(free)}")
    if free < 4 * 3.6 * 2**30 * args.layers / 16:
        print(
            "warning: the export, its scratch copy and the outputs need about 4x the model "
            "size on disk"
        )
    export_rows = h.ensure_export(
        "llama", model, exporter=args.exporter, layers=args.layers, force=args.force_export
    )
    proto = onnx.load(str(model), load_external_data=False)
    n_nodes, n_inits = len(proto.graph.node), len(proto.graph.initializer)
    del proto
    size = h.file_size(model)
    print(
        f"model: {model.name}: {n_nodes} nodes, {n_inits} initializers, "
        f"{h.human_bytes(size)} with external data\n",
        flush=True,
    )
    h.warm_page_cache(model)

    rows = []
    ref = None
    if not args.no_reference:
        ref_out = args.out_dir / "llama.loadsave.onnx"
        ref = h.measure(h.load_save_cmd(model, ref_out, external=True))
        h.remove_model(ref_out)
        rows.append(
            [
                "onnx.load + onnx.save (external data)",
                f"{ref.wall_s:.1f}",
                f"{ref.peak_rss_mb:.0f}",
                f"{ref.peak_anon_mb:.0f}",
                f"{ref.peak_file_mb:.0f}",
                ref.status(),
            ]
        )

    startup = h.measure(h.startup_cmd())
    rows.append(
        [
            "fusectl fixed cost (python + imports)",
            f"{startup.wall_s:.1f}",
            f"{startup.peak_rss_mb:.0f}",
            f"{startup.peak_anon_mb:.0f}",
            f"{startup.peak_file_mb:.0f}",
            startup.status(),
        ]
    )

    out = args.out_dir / "llama.fusectl.onnx"
    report_path = args.out_dir / "llama.report.json"
    runs = [
        h.measure(h.fusectl_cmd(model, out, report=report_path)) for _ in range(max(args.repeat, 1))
    ]
    fus = min(runs, key=lambda m: (not m.ok, m.wall_s))
    if not fus.ok:
        print(f"fusectl FAILED ({fus.status()}):\n{fus.stderr.strip()[-3000:]}", file=sys.stderr)
    rows.append(
        [
            "fusectl optimize",
            f"{fus.wall_s:.1f}",
            f"{fus.peak_rss_mb:.0f}",
            f"{fus.peak_anon_mb:.0f}",
            f"{fus.peak_file_mb:.0f}",
            fus.status(),
        ]
    )
    summary = h.report_summary(h.read_report(report_path) if fus.ok else None)
    out_size = h.file_size(out)

    check = "skipped (--check)"
    if fus.ok and args.check:
        checked = h.measure(h.check_cmd(model, out, 32000))
        check = (
            f"max |diff| {float(checked.stdout.strip().splitlines()[-1]):.2e}"
            if checked.ok
            else f"FAILED ({checked.status()})"
        )
    if not args.keep_output:
        h.remove_model(out)
    report_path.unlink(missing_ok=True)

    print(
        h.table(["step", "wall s", "peak RSS MB", "peak anon MB", "peak file MB", "status"], rows)
    )
    print(
        "\npeak RSS: ru_maxrss of the process; anon / file: peaks of RssAnon / RssFile sampled "
        "every 20 ms (file = memory-mapped weights and libraries)."
    )
    verdict = "PASS" if fus.ok and fus.peak_rss_mb < args.rss_target_mb else "FAIL"
    print(
        f"target: fusectl peak RSS < {args.rss_target_mb:.0f} MB -> {verdict} "
        f"({fus.peak_rss_mb:.0f} MB for a {h.human_bytes(size)} model)"
    )
    if ref is not None and ref.ok and fus.ok:
        print(
            f"ratio fusectl / load+save: wall {fus.wall_s / ref.wall_s:.2f}x, "
            f"peak RSS {fus.peak_rss_mb / ref.peak_rss_mb:.2f}x"
        )
    if summary["passes_s"] is not None:
        print(
            f"fusectl: pass time {summary['passes_s']:.2f} s, nodes {summary['nodes']}, "
            f"fusions {summary['fusions']}, output {h.human_bytes(out_size)}"
        )
    print(f"onnxruntime check of the optimized model against the original: {check}")
    if export_rows:
        print()
        print(h.table(["export step", "wall s", "peak RSS MB"], export_rows))


if __name__ == "__main__":
    main()
