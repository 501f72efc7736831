"""Scaling benchmark: fusectl on synthetic transformer-ish graphs of 1k / 10k / 100k nodes.

Each block (17 nodes, opset 17, hidden 16, input ["N", 16]) is

    decomposed LayerNorm  ReduceMean, Sub, Pow, ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta
    MatMul + Add bias
    erf-GELU              Div sqrt2, Erf, Add 1, Mul, Mul 0.5
    residual Add

and blocks are chained. For each size the script generates the model, then times in fresh
subprocesses, round-robin (one run of each tool per round, best of --repeat rounds): a plain
onnx.load + onnx.save of the file (reference), ``fusectl optimize``, onnxruntime's offline
optimizer (an InferenceSession with ``optimized_model_filepath``, at ORT_ENABLE_EXTENDED and/or
ORT_ENABLE_ALL) and optionally onnxscript's ``optimize_for_ort``. Every tool is printed as a
ratio to load+save and to onnxruntime's optimizer from the same run, so that a busy machine
slows the reference as much as the tool.

    python benchmarks/synthetic.py                      # 1k, 10k, 100k
    python benchmarks/synthetic.py --sizes 1k,10k --onnxscript --ort-level extended,all
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections import Counter
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


# onnxruntime's offline optimizer: the session creation writes the optimized model; it is
# timed on its own (session_s) besides the whole process (interpreter and import included).
ORT_SCRIPT = r"""
import sys, time
import onnxruntime as ort
source, output, level = sys.argv[1:4]
options = ort.SessionOptions()
options.graph_optimization_level = {
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}[level]
options.optimized_model_filepath = output
options.intra_op_num_threads = 1
options.log_severity_level = 3
began = time.perf_counter()
ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
print(f"session_s={time.perf_counter() - began:.3f}")
"""


def _session_s(run: h.Measurement) -> float | None:
    for line in run.stdout.splitlines():
        if line.startswith("session_s="):
            return float(line.split("=", 1)[1])
    return None


# The op types of the generated graph: whatever else an optimized model holds was fused.
SOURCE_OPS = frozenset({"ReduceMean", "Sub", "Pow", "Add", "Sqrt", "Div", "Mul", "MatMul", "Erf"})


def _fused_summary(path: Path, n_nodes: int) -> str:
    """Nodes before -> after and the ops of an optimized model that the source does not have."""
    graph = onnx.load(str(path), load_external_data=False).graph
    fused = Counter(node.op_type for node in graph.node if node.op_type not in SOURCE_OPS)
    ops = ", ".join(f"{op} {count}" for op, count in sorted(fused.items()))
    return f"{n_nodes}->{len(graph.node)}" + (f" ({ops})" if ops else "")


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
    parser.add_argument(
        "--ort-level",
        default="extended",
        help="onnxruntime offline optimizer levels to time: extended, all, or both as "
        "'extended,all'; 'none' skips it [extended]",
    )
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

    ort_levels = [lv.strip() for lv in args.ort_level.split(",") if lv.strip() not in ("", "none")]
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
        stem = args.out_dir / f"synthetic_{n_nodes}"
        report_path = Path(f"{stem}.report.json")
        # tool -> (command, output, timeout); run round-robin so that load on the machine
        # falls on every tool alike.
        tools: dict[str, tuple[list[str], Path, float]] = {
            "load+save": (
                h.load_save_cmd(src, Path(f"{stem}.loadsave.onnx"), external=False),
                Path(f"{stem}.loadsave.onnx"),
                0,
            ),
            "fusectl": (
                h.fusectl_cmd(src, Path(f"{stem}.fusectl.onnx"), report=report_path),
                Path(f"{stem}.fusectl.onnx"),
                args.timeout,
            ),
        }
        for level in ort_levels:
            out = Path(f"{stem}.ort_{level}.onnx")
            tools[f"ORT {level}"] = (
                [sys.executable, "-c", ORT_SCRIPT, str(src), str(out), level],
                out,
                args.timeout,
            )
        if args.onnxscript and n_nodes <= args.onnxscript_max_nodes:
            out = Path(f"{stem}.onnxscript.onnx")
            tools["onnxscript optimize_for_ort"] = (
                [sys.executable, "-c", ONNXSCRIPT_SCRIPT, str(src), str(out)],
                out,
                args.onnxscript_timeout,
            )
        runs: dict[str, list[h.Measurement]] = {name: [] for name in tools}
        reports: dict[int, dict] = {}  # id of a fusectl run -> its report's summary
        for _ in range(max(args.repeat, 1)):
            for name, (cmd, _, timeout) in tools.items():
                run = h.measure(cmd, timeout=timeout)
                runs[name].append(run)
                if name == "fusectl":
                    reports[id(run)] = h.report_summary(h.read_report(report_path))
                    report_path.unlink(missing_ok=True)
        best = {
            name: min(found, key=lambda m: (not m.ok, m.wall_s)) for name, found in runs.items()
        }
        summary = reports[id(best["fusectl"])]
        results: dict[str, str] = {}
        for name, (_, out, _) in tools.items():
            run = best[name]
            if not run.ok:
                print(
                    f"  {name} failed ({run.status()}):\n{run.stderr.strip()[-2000:]}",
                    file=sys.stderr,
                )
                results[name] = "-"
            elif name == "fusectl":
                results[name] = f"{summary['nodes']} {summary['fusions']}"
            elif name.startswith("ORT"):
                results[name] = _fused_summary(out, n_nodes)
            elif name.startswith("onnxscript"):
                lines = run.stdout.strip().splitlines()
                results[name] = _fused_summary(out, n_nodes) + (f" {lines[-1]}" if lines else "")
            else:
                results[name] = ""
            if not args.keep or name != "fusectl":
                h.remove_model(out)
            out.with_suffix(".fusion_result.json").unlink(missing_ok=True)
        reference = best["load+save"].wall_s
        ort_ref = best[f"ORT {ort_levels[0]}"].wall_s if ort_levels else None
        per_k = 1000 / n_nodes
        for name, run in best.items():
            if name == "fusectl":
                inner = f"{summary['passes_s']:.2f}" if summary["passes_s"] is not None else "-"
            elif name.startswith("ORT"):
                inner = f"{_session_s(run):.2f}" if _session_s(run) is not None else "-"
            else:
                inner = "-"
            rows.append(
                [
                    name,
                    n_nodes,
                    f"{run.wall_s:.2f}",
                    f"{run.wall_s * per_k:.3f}",
                    inner,
                    f"{run.peak_rss_mb:.0f}",
                    f"{run.peak_rss_mb * 1024 / n_nodes:.1f}",
                    f"{run.wall_s / reference:.2f}",
                    f"{run.wall_s / ort_ref:.2f}" if ort_ref else "-",
                    run.status(),
                    results[name],
                ]
            )
        print(
            "  " + "; ".join(f"{name} {run.wall_s:.2f} s" for name, run in best.items()),
            flush=True,
        )
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
                "inner s",
                "peak RSS MB",
                "KB / node",
                "x load+save",
                f"x ORT {ort_levels[0]}" if ort_levels else "x ORT",
                "status",
                "nodes / fusions",
            ],
            rows,
        )
    )
    print(
        "\nwall s: whole subprocess (includes the fixed cost above), best of --repeat rounds "
        "run round-robin; inner s: fusectl's pass time from --report, onnxruntime's session "
        "creation (which writes the optimized model); x load+save, x ORT: wall time over that "
        "tool's wall time on the same graph in the same run; fusions: effected/matched per pass."
    )


if __name__ == "__main__":
    main()
