"""Scaling benchmark: fusectl on synthetic transformer-ish graphs of 1k / 10k / 100k nodes.

Each block (17 nodes, opset 17, hidden 16, input ["N", 16]) is

    decomposed LayerNorm  ReduceMean, Sub, Pow, ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta
    MatMul + Add bias
    erf-GELU              Div sqrt2, Erf, Add 1, Mul, Mul 0.5
    residual Add

and blocks are chained. For each size the script generates the model, then times in fresh
subprocesses: a plain onnx.load + onnx.save of the file (reference), ``fusectl optimize`` and
optionally onnxscript's ``optimize_for_ort``.

    python benchmarks/synthetic.py                      # 1k, 10k, 100k
    python benchmarks/synthetic.py --sizes 1k,10k --onnxscript
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import _harness as h
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 16
NODES_PER_BLOCK = 17
OPSET = 17


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1], 1)
    return int(float(text.rstrip("km")) * scale)


def build_model(target_nodes: int, *, value_info: bool = True, seed: int = 0) -> onnx.ModelProto:
    """Chain ceil(target/17) blocks; every intermediate gets a value_info unless told not to."""
    rng = np.random.default_rng(seed)
    blocks = max(1, math.ceil(target_nodes / NODES_PER_BLOCK))
    f32 = TensorProto.FLOAT
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    infos: list[onnx.ValueInfoProto] = []

    def scalar(name: str, value: float) -> None:
        inits.append(numpy_helper.from_array(np.array(value, dtype=np.float32), name))

    scalar("eps", 1e-5)
    scalar("two", 2.0)
    scalar("sqrt2", math.sqrt(2.0))
    scalar("one", 1.0)
    scalar("half", 0.5)

    x = "x"
    for b in range(blocks):
        p = f"b{b}_"

        def node(
            op: str, inputs: list[str], out: str, reduced: bool = False, p: str = p, **attrs
        ) -> str:
            name = p + out
            nodes.append(helper.make_node(op, inputs, [name], name=p + op + "_" + out, **attrs))
            if value_info:
                infos.append(
                    helper.make_tensor_value_info(name, f32, ["N", 1 if reduced else HIDDEN])
                )
            return name

        inits += [
            numpy_helper.from_array(
                (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), p + "gamma"
            ),
            numpy_helper.from_array(
                (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), p + "beta"
            ),
            numpy_helper.from_array(
                (rng.standard_normal((HIDDEN, HIDDEN)) / math.sqrt(HIDDEN)).astype(np.float32),
                p + "W",
            ),
            numpy_helper.from_array(
                (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), p + "bias"
            ),
        ]
        # decomposed LayerNorm (9 nodes)
        mean = node("ReduceMean", [x], "mean", reduced=True, axes=[-1], keepdims=1)
        d = node("Sub", [x, mean], "d")
        sq = node("Pow", [d, "two"], "sq")
        var = node("ReduceMean", [sq], "var", reduced=True, axes=[-1], keepdims=1)
        ve = node("Add", [var, "eps"], "ve", reduced=True)
        std = node("Sqrt", [ve], "std", reduced=True)
        norm = node("Div", [d, std], "norm")
        scaled = node("Mul", [norm, p + "gamma"], "scaled")
        ln = node("Add", [scaled, p + "beta"], "ln")
        # MatMul + bias (2 nodes)
        mm = node("MatMul", [ln, p + "W"], "mm")
        hb = node("Add", [mm, p + "bias"], "h")
        # erf-GELU (5 nodes)
        g1 = node("Div", [hb, "sqrt2"], "g_div")
        g2 = node("Erf", [g1], "g_erf")
        g3 = node("Add", [g2, "one"], "g_add")
        g4 = node("Mul", [hb, g3], "g_mul")
        g5 = node("Mul", [g4, "half"], "gelu")
        # residual (1 node)
        x = node("Add", [x, g5], "out")

    if value_info:
        infos.pop()  # the last block's output is the graph output, declared below
    graph = helper.make_graph(
        nodes,
        "synthetic",
        [helper.make_tensor_value_info("x", f32, ["N", HIDDEN])],
        [helper.make_tensor_value_info(x, f32, ["N", HIDDEN])],
        initializer=inits,
        value_info=infos,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


ONNXSCRIPT_SCRIPT = r"""
import sys, onnx_ir as ir
from onnxscript.rewriter.ort_fusions import optimize_for_ort
model = ir.load(sys.argv[1])
model, counts = optimize_for_ort(model)
ir.save(model, sys.argv[2])
print({k: v for k, v in counts.items() if v})
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1k,10k,100k", help="target node counts [1k,10k,100k]")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per measurement; the best wall time is kept"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per fusectl run [1800]"
    )
    parser.add_argument(
        "--no-value-info",
        action="store_true",
        help="omit value_info for intermediates (MatMul rank then unknown to fusectl)",
    )
    parser.add_argument(
        "--onnxscript",
        action="store_true",
        help="also time onnxscript.rewriter.ort_fusions.optimize_for_ort",
    )
    parser.add_argument(
        "--onnxscript-max-nodes",
        type=parse_size,
        default=20_000,
        help="only sizes up to this many nodes for onnxscript [20k]",
    )
    parser.add_argument("--onnxscript-timeout", type=float, default=300, help="seconds [300]")
    parser.add_argument("--out-dir", type=Path, default=h.OUT_DIR / "synthetic")
    parser.add_argument("--keep", action="store_true", help="keep the generated models")
    args = parser.parse_args()

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# synthetic scaling benchmark ({h.machine_note()})")
    startup = min(
        (h.measure(h.startup_cmd()) for _ in range(max(args.repeat, 1))), key=lambda m: m.wall_s
    )
    print(
        f"fusectl fixed cost (interpreter + imports + pass registry): "
        f"{startup.wall_s:.2f} s, {startup.peak_rss_mb:.0f} MB peak RSS\n"
    )

    rows = []
    for target in sizes:
        began = time.perf_counter()
        model = build_model(target, value_info=not args.no_value_info)
        n_nodes = len(model.graph.node)
        src = args.out_dir / f"synthetic_{n_nodes}.onnx"
        onnx.save(model, src)
        del model
        gc.collect()
        gen_s = time.perf_counter() - began
        print(
            f"generated {src.name}: {n_nodes} nodes, "
            f"{h.human_bytes(h.file_size(src))}, {gen_s:.1f} s",
            flush=True,
        )

        def best(cmd: list[str], timeout: float = 0) -> h.Measurement:
            runs = [h.measure(cmd, timeout=timeout) for _ in range(max(args.repeat, 1))]
            return min(runs, key=lambda m: (not m.ok, m.wall_s))

        ref_out = args.out_dir / f"synthetic_{n_nodes}.loadsave.onnx"
        ref = best(h.load_save_cmd(src, ref_out, external=False))
        h.remove_model(ref_out)

        out = args.out_dir / f"synthetic_{n_nodes}.fusectl.onnx"
        report_path = args.out_dir / f"synthetic_{n_nodes}.report.json"
        fus = best(h.fusectl_cmd(src, out, report=report_path), timeout=args.timeout)
        summary = h.report_summary(h.read_report(report_path) if fus.ok else None)
        if not fus.ok:
            print(
                f"  fusectl failed ({fus.status()}):\n{fus.stderr.strip()[-2000:]}", file=sys.stderr
            )
        if not args.keep:
            h.remove_model(out)
        report_path.unlink(missing_ok=True)
        per_k = 1000 / n_nodes
        rows.append(
            [
                "load+save",
                n_nodes,
                f"{ref.wall_s:.2f}",
                f"{ref.wall_s * per_k:.3f}",
                "-",
                f"{ref.peak_rss_mb:.0f}",
                ref.status(),
                "-",
            ]
        )
        rows.append(
            [
                "fusectl",
                n_nodes,
                f"{fus.wall_s:.2f}",
                f"{fus.wall_s * per_k:.3f}",
                f"{summary['passes_s']:.2f}" if summary["passes_s"] is not None else "-",
                f"{fus.peak_rss_mb:.0f}",
                fus.status(),
                f"{summary['nodes']} {summary['fusions']}",
            ]
        )
        print(
            f"  load+save {ref.wall_s:.2f} s; fusectl {fus.wall_s:.2f} s ({fus.status()})",
            flush=True,
        )

        if args.onnxscript and n_nodes <= args.onnxscript_max_nodes:
            oxs_out = args.out_dir / f"synthetic_{n_nodes}.onnxscript.onnx"
            oxs = best(
                [sys.executable, "-c", ONNXSCRIPT_SCRIPT, src, oxs_out],
                timeout=args.onnxscript_timeout,
            )
            oxs_nodes = "-"
            if oxs.ok:
                oxs_nodes = (
                    f"{n_nodes}->{len(onnx.load(oxs_out, load_external_data=False).graph.node)} "
                )
                oxs_nodes += oxs.stdout.strip().splitlines()[-1] if oxs.stdout.strip() else ""
            else:
                print(
                    f"  onnxscript failed ({oxs.status()}):\n{oxs.stderr.strip()[-2000:]}",
                    file=sys.stderr,
                )
            h.remove_model(oxs_out)
            rows.append(
                [
                    "onnxscript optimize_for_ort",
                    n_nodes,
                    f"{oxs.wall_s:.2f}",
                    f"{oxs.wall_s * per_k:.3f}",
                    "-",
                    f"{oxs.peak_rss_mb:.0f}",
                    oxs.status(),
                    oxs_nodes,
                ]
            )
            print(f"  onnxscript {oxs.wall_s:.2f} s ({oxs.status()})", flush=True)
        if not args.keep:
            src.unlink(missing_ok=True)

    print()
    print(
        h.table(
            [
                "tool",
                "nodes",
                "wall s",
                "s / 1k nodes",
                "passes s",
                "peak RSS MB",
                "status",
                "nodes / fusions",
            ],
            rows,
        )
    )
    print(
        "\nwall s: whole subprocess (includes the fixed cost above); passes s: fusectl's own "
        "pass time from --report; fusions: effected/matched per pass."
    )


if __name__ == "__main__":
    main()
