"""BERT-base (random weights, ~440 MB external data): fusectl vs a plain onnx load + save.

Builds ``BertModel(BertConfig()).eval()``, exports it once to benchmarks/out/ (input_ids and
attention_mask with dynamic batch and sequence axes, weights in one .data file) and then
measures, each in a fresh subprocess:

    (a) onnx.load(path) + onnx.save(model, out, save_as_external_data=True)
    (b) fusectl optimize path -o out

    python benchmarks/bert_base.py                   # TorchScript exporter, cached export
    python benchmarks/bert_base.py --exporter dynamo --repeat 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _harness as h
import onnx


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per measurement; best wall time kept [3]"
    )
    parser.add_argument("--force-export", action="store_true", help="export again even if cached")
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip comparing original and optimized outputs in onnxruntime",
    )
    parser.add_argument("--out-dir", type=Path, default=h.OUT_DIR)
    parser.add_argument("--keep-output", action="store_true", help="keep the optimized model")
    args = parser.parse_args()

    model = args.out_dir / f"bert_base_{args.exporter}.onnx"
    print(f"# BERT-base benchmark ({h.machine_note()})")
    export_rows = h.ensure_export("bert", model, exporter=args.exporter, force=args.force_export)
    proto = onnx.load(str(model), load_external_data=False)
    n_nodes, n_inits = len(proto.graph.node), len(proto.graph.initializer)
    del proto
    print(
        f"model: {model.name}: {n_nodes} nodes, {n_inits} initializers, "
        f"{h.human_bytes(h.file_size(model))} with external data\n",
        flush=True,
    )
    h.warm_page_cache(model)

    def best(cmd: list[str]) -> h.Measurement:
        runs = [h.measure(cmd) for _ in range(max(args.repeat, 1))]
        for run in runs:
            if not run.ok:
                print(
                    f"FAILED ({run.status()}): {' '.join(map(str, cmd[:4]))} ...\n"
                    f"{run.stderr.strip()[-3000:]}",
                    file=sys.stderr,
                )
        return min(runs, key=lambda m: (not m.ok, m.wall_s))

    ref_out = args.out_dir / "bert_base.loadsave.onnx"
    ref = best(h.load_save_cmd(model, ref_out, external=True))
    h.remove_model(ref_out)

    startup = best(h.startup_cmd())
    out = args.out_dir / "bert_base.fusectl.onnx"
    report_path = args.out_dir / "bert_base.report.json"
    fus = best(h.fusectl_cmd(model, out, report=report_path))
    summary = h.report_summary(h.read_report(report_path) if fus.ok else None)

    check = "skipped"
    if fus.ok and not args.no_check:
        checked = h.measure(h.check_cmd(model, out, 30522))
        if checked.ok:
            check = f"max |diff| {float(checked.stdout.strip().splitlines()[-1]):.2e}"
        else:
            last = checked.stderr.strip().splitlines()[-1:] or [checked.status()]
            check = f"FAILED: {last[0]}"
    out_size = h.file_size(out)
    if not args.keep_output:
        h.remove_model(out)
    report_path.unlink(missing_ok=True)

    rows = [
        [
            "(a) onnx.load + onnx.save (external data)",
            f"{ref.wall_s:.2f}",
            f"{ref.user_s + ref.sys_s:.2f}",
            f"{ref.peak_rss_mb:.0f}",
            ref.status(),
        ],
        [
            "fusectl fixed cost (python + imports)",
            f"{startup.wall_s:.2f}",
            f"{startup.user_s + startup.sys_s:.2f}",
            f"{startup.peak_rss_mb:.0f}",
            startup.status(),
        ],
        [
            "(b) fusectl optimize",
            f"{fus.wall_s:.2f}",
            f"{fus.user_s + fus.sys_s:.2f}",
            f"{fus.peak_rss_mb:.0f}",
            fus.status(),
        ],
    ]
    print(
        h.table(
            [f"step (best of {max(args.repeat, 1)})", "wall s", "cpu s", "peak RSS MB", "status"],
            rows,
        )
    )
    if ref.ok and fus.ok:
        print(
            f"\nratio fusectl / load+save: wall {fus.wall_s / ref.wall_s:.2f}x, "
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
