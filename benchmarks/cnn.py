"""CNN benchmark: fusectl on the zoo CNNs and full-size ResNet-50 / MobileNet-V2 exports.

    python benchmarks/cnn.py                          # every model below
    python benchmarks/cnn.py --models resnet50_torchscript,squeezenet --runs 50 --threads 2
    python benchmarks/cnn.py --target onnx            # standard ONNX ops only (no contrib ops)

Per model: ``fusectl optimize MODEL -o OUT --report R.json --log null`` in a subprocess (its
wall time, nodes before -> after from the report, the passes that took effect), then
onnxruntime CPU latency at batch 1 of the original and the optimized model, each with ORT's
graph optimizer fully on (``ORT_ENABLE_ALL``) and fully off (``ORT_DISABLE_ALL``): median and
p90 of ``--runs`` timed runs after ``--warmup`` untimed ones. The four sessions are timed round
robin (one run of each per round), so background load hits them alike. ``goal`` is
opt/DISABLE_ALL median over orig/ENABLE_ALL median: at most 1.00 means the fused model with
ORT's optimizer off runs at least as fast as the original with ORT doing all its own fusions.
``--extended`` adds the original under ``ORT_ENABLE_EXTENDED`` (every ORT fusion, but not
the NCHWc layout transform that ``ORT_ENABLE_ALL`` adds on x86) and ``goal EXT``, opt/DISABLE_ALL
over that: the part of ORT's advantage that fusion alone can win back.
``diff`` is the largest absolute difference between the outputs of the original and the
optimized model (both under ORT_DISABLE_ALL, same random input); ``rel`` divides it by the
largest absolute output value.

Models:

* the nine zoo CNNs of tests/zoo.py (onnx's "light" models with seeded random weights);
* ``resnet50_*`` = ``transformers.ResNetModel(ResNetConfig())`` and ``mobilenetv2_*`` =
  ``MobileNetV2Model(MobileNetV2Config())``, random weights with trained-looking BN statistics,
  input 1x3x224x224, exported as ``_torchscript`` (dynamo=False, opset 17,
  training=PRESERVE: BatchNormalization kept), ``_torchscript_eval`` (the exporter's default:
  BN folded by the exporter), ``_dynamo`` (dynamo=True, opset 18, default optimize=True: BN
  folded by onnxscript) and ``_dynamo_noopt`` (optimize=False: BN kept).

Exports are cached in benchmarks/out/cnn/ (``--force-export`` redoes them); the optimized
models are deleted after each model unless ``--keep``. Timings are noisy on a shared machine:
compare ratios within one run rather than absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_OUT = BENCH_DIR / "out" / "cnn"

ARCHS = ("resnet50", "mobilenetv2")
VARIANTS = ("torchscript", "torchscript_eval", "dynamo", "dynamo_noopt")
EXPORTED = tuple(f"{arch}_{variant}" for arch in ARCHS for variant in VARIANTS)


def _load_zoo():  # tests/zoo.py: the zoo list and its materializer, loaded by path
    spec = importlib.util.spec_from_file_location("_fusectl_zoo", REPO_ROOT / "tests" / "zoo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ZOO = _load_zoo()
ZOO_MODELS = ZOO.ZOO
ALL_MODELS = ZOO_MODELS + EXPORTED


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def export_one(name: str, path: Path) -> None:
    """Build and export one transformers model (runs in its own process: torch stays out)."""
    import onnx
    import torch
    import transformers

    arch, variant = name.split("_", 1)
    torch.manual_seed(0)
    if arch == "resnet50":
        inner = transformers.ResNetModel(transformers.ResNetConfig())
    elif arch == "vit":  # ViT-base at 224x224 (benchmarks/latency.py): no BatchNorm to perturb
        inner = transformers.ViTModel(transformers.ViTConfig())
    else:
        inner = transformers.MobileNetV2Model(transformers.MobileNetV2Config())
    for bn in inner.modules():  # trained-looking statistics, so folding BN is not a no-op
        if isinstance(bn, torch.nn.BatchNorm2d):
            channels = bn.num_features
            with torch.no_grad():
                bn.weight.copy_(torch.rand(channels) + 0.5)
                bn.bias.copy_(torch.randn(channels) * 0.1)
                bn.running_mean.copy_(torch.randn(channels) * 0.1)
                bn.running_var.copy_(torch.rand(channels) + 0.5)

    class Backbone(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            out = self.inner(pixel_values=pixel_values)
            return out.last_hidden_state, out.pooler_output

    model = Backbone().eval()
    kwargs: dict = {
        "input_names": ["pixel_values"],
        "output_names": ["last_hidden_state", "pooler_output"],
    }
    if variant.startswith("torchscript"):
        kwargs.update(dynamo=False, opset_version=17)
        if variant == "torchscript":
            kwargs["training"] = torch.onnx.TrainingMode.PRESERVE
    else:
        kwargs.update(dynamo=True, opset_version=18, external_data=False)
        kwargs["optimize"] = variant == "dynamo"
    began = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), str(path), **kwargs)
    proto = onnx.load(str(path))
    for stray in path.parent.glob(path.name + "*.data"):
        stray.unlink()
    onnx.save(proto, str(path))
    print(f"exported {name} ({len(proto.graph.node)} nodes) in {time.perf_counter() - began:.1f} s")


def prepare(name: str, out_dir: Path, force: bool) -> Path:
    """The model file for ``name``: a zoo model materialized, or a cached export."""
    if name in ZOO_MODELS:
        zoo_dir = out_dir / "zoo"
        zoo_dir.mkdir(parents=True, exist_ok=True)
        path = zoo_dir / f"{name}.onnx"
        if force or not path.exists():
            ZOO.materialize(name, zoo_dir)
        return path
    path = out_dir / f"{name}.onnx"
    if force or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"exporting {name} -> {path} ...", file=sys.stderr, flush=True)
        partial = path.with_name(path.name + ".partial.onnx")
        proc = subprocess.run(
            [sys.executable, __file__, "--export-one", name, str(partial)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"export of {name} failed:\n{proc.stderr[-4000:]}")
        os.replace(partial, path)
        print(proc.stdout.strip(), file=sys.stderr)
    return path


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def run_fusectl(model: Path, output: Path, report: Path, target: str) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "fusectl", "optimize", str(model), "-o", str(output)]
    cmd += ["--report", str(report), "--log", "null", "--target", target]
    cmd += ["--fusion_result", str(output.with_suffix(".fusion_result.json"))]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"fusectl exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return wall, json.loads(report.read_text())


def _feeds(session, seed: int = 0) -> dict:
    import numpy as np

    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in arg.shape]
        feeds[arg.name] = rng.standard_normal(shape).astype(types.get(arg.type, np.float32))
    return feeds


def latencies(
    original: Path, optimized: Path, *, runs: int, warmup: int, threads: int, extended: bool
) -> tuple[dict[str, tuple[float, float]], float, float]:
    """{'orig/all': (median ms, p90 ms), ...}, max abs diff and relative diff of the outputs."""
    import numpy as np
    import onnxruntime as ort

    levels = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }
    plan = [("orig", original, "all"), ("orig", original, "none")]
    plan += [("opt", optimized, "all"), ("opt", optimized, "none")]
    if extended:
        levels["ext"] = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        plan.append(("orig", original, "ext"))
    sessions = {}
    for label, path, level in plan:
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[level]
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        sessions[f"{label}/{level}"] = ort.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
    feeds = _feeds(sessions["orig/none"])
    reference = sessions["orig/none"].run(None, feeds)
    fused = sessions["opt/none"].run(None, feeds)
    diff = max(
        float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        for a, b in zip(reference, fused, strict=True)
    )
    scale = max(float(np.max(np.abs(a))) for a in reference) or 1.0
    for session in sessions.values():
        for _ in range(warmup):
            session.run(None, feeds)
    times: dict[str, list[float]] = {key: [] for key in sessions}
    for _ in range(runs):
        for key, session in sessions.items():
            began = time.perf_counter()
            session.run(None, feeds)
            times[key].append((time.perf_counter() - began) * 1000)
    stats = {}
    for key, values in times.items():
        ordered = sorted(values)
        p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
        stats[key] = (statistics.median(ordered), p90)
    return stats, diff, diff / scale


def fusions(report: dict) -> str:
    infrastructure = ("EliminationPass", "SortPass", "ImportPass")
    effected = [
        f"{p['name'].removesuffix('FusionPass')}={p['effected']}/{p['matched']}"
        for p in report["passes"]
        if p.get("matched") and not p["name"].endswith(infrastructure)
    ]
    return ", ".join(effected) or "none"


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ]
        return " | ".join(parts).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _ms(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.2f}/{pair[1]:.2f}"


def parse_models(values: list[str] | None) -> list[str]:
    if not values:
        return list(ALL_MODELS)
    names: list[str] = []
    for value in values:
        for name in filter(None, (v.strip() for v in value.split(","))):
            if name == "zoo":
                names += ZOO_MODELS
            elif name == "exported":
                names += EXPORTED
            elif name in ARCHS:
                names += [f"{name}_{v}" for v in VARIANTS]
            elif name in ALL_MODELS:
                names.append(name)
            else:
                raise SystemExit(f"unknown model {name!r}; choose from {', '.join(ALL_MODELS)}")
    return list(dict.fromkeys(names))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        action="append",
        help="comma list (repeatable): model names, 'zoo', 'exported', 'resnet50' or "
        "'mobilenetv2' (all four exports) [all]",
    )
    parser.add_argument("--target", choices=["ort", "onnx"], default="ort", help="[ort]")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per session [20]")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per session [5]")
    parser.add_argument(
        "--threads", type=int, default=1, help="onnxruntime intra_op_num_threads (0: ORT's) [1]"
    )
    parser.add_argument(
        "--extended", action="store_true", help="also time the original under ORT_ENABLE_EXTENDED"
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="[benchmarks/out/cnn]")
    parser.add_argument("--force-export", action="store_true", help="redo cached exports")
    parser.add_argument("--keep", action="store_true", help="keep the optimized models")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--export-one", nargs=2, metavar=("NAME", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.export_one:
        export_one(args.export_one[0], Path(args.export_one[1]))
        return 0

    import onnxruntime as ort

    models = parse_models(args.models)
    opt_dir = args.out_dir / "optimized"
    opt_dir.mkdir(parents=True, exist_ok=True)
    headers = [
        "model",
        "nodes",
        "fusectl s",
        "orig ALL ms",
        "orig NONE ms",
        "opt ALL ms",
        "opt NONE ms",
        "goal",
        "diff",
        "rel",
    ]
    if args.extended:
        headers[7:7] = ["orig EXT ms"]
        headers[9:9] = ["goal EXT"]
    rows, fusion_lines, results, failures = [], [], [], 0
    for name in models:
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        try:
            model = prepare(name, args.out_dir, args.force_export)
            output = opt_dir / f"{name}.{args.target}.onnx"
            report_path = opt_dir / f"{name}.{args.target}.report.json"
            wall, report = run_fusectl(model, output, report_path, args.target)
            stats, diff, rel = latencies(
                model,
                output,
                runs=args.runs,
                warmup=args.warmup,
                threads=args.threads,
                extended=args.extended,
            )
        except Exception as error:  # one model failing must not stop the others
            failures += 1
            rows.append([name, "FAILED", *[None] * (len(headers) - 2)])
            fusion_lines.append(f"  {name}: {str(error).splitlines()[0][:300]}")
            continue
        finally:
            if not args.keep:
                for suffix in (".onnx", ".onnx.data", ".fusion_result.json", ".report.json"):
                    (opt_dir / f"{name}.{args.target}{suffix}").unlink(missing_ok=True)
        before, after = report["model"]["before"]["nodes"], report["model"]["after"]["nodes"]
        goal = stats["opt/none"][0] / stats["orig/all"][0]
        rows.append(
            [
                name,
                f"{before} -> {after}",
                f"{wall:.2f}",
                _ms(stats["orig/all"]),
                _ms(stats["orig/none"]),
                _ms(stats["opt/all"]),
                _ms(stats["opt/none"]),
                f"{goal:.2f} {'ok' if goal <= 1.0 else 'slower'}",
                f"{diff:.1e}",
                f"{rel:.1e}",
            ]
        )
        if args.extended:
            goal_ext = stats["opt/none"][0] / stats["orig/ext"][0]
            rows[-1][7:7] = [_ms(stats["orig/ext"])]
            rows[-1][9:9] = [f"{goal_ext:.2f} {'ok' if goal_ext <= 1.0 else 'slower'}"]
        fusion_lines.append(f"  {name}: {fusions(report)}")
        results.append(
            {
                "model": name,
                "nodes_before": before,
                "nodes_after": after,
                "fusectl_wall_s": wall,
                "fusectl_passes_s": report.get("time_s"),
                "latency_ms": {k: {"median": v[0], "p90": v[1]} for k, v in stats.items()},
                "goal_ratio": goal,
                "max_abs_diff": diff,
                "rel_diff": rel,
                "fusions": fusions(report),
            }
        )

    print(
        f"fusectl --target {args.target}; onnxruntime {ort.__version__} CPU, batch 1, "
        f"intra_op_num_threads={args.threads}, {args.runs} runs after {args.warmup} warm-up; "
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    print("latency = median/p90 ms; ALL = ORT_ENABLE_ALL, NONE = ORT_DISABLE_ALL;")
    print("goal = opt NONE median / orig ALL median (<= 1.00: fused model without ORT's")
    print("optimizer at least as fast as the original with it); diff = max |orig - opt|")
    print()
    print(table(headers, rows))
    print()
    print("passes that matched (effected/matched):")
    print("\n".join(fusion_lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep and not any(opt_dir.iterdir()):
        shutil.rmtree(opt_dir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
