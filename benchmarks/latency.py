"""Latency on onnxruntime CPU: fusectl's output against the original and the peers' outputs.

Models (random weights, default sizes, TorchScript exports; cached under
benchmarks/out/latency/models):

* ``bert`` BERT-base, ``gpt2`` GPT-2 small, ``llama`` a LLaMA-style model (_export.py's: hidden
  2048, 16 query / 4 KV heads, intermediate 5504) cut to 4 layers so that five copies fit in
  memory and time: inputs ``input_ids`` and ``attention_mask`` at batch 1, sequence 128;
* ``vit`` ViT-base, ``resnet50`` ResNet-50, ``mobilenetv2`` MobileNet-V2 (cnn.py's exports,
  BatchNorm folded by the exporter): one 1x3x224x224 image;
* opt-in (``--models``), float16: ``bert-fp16``, ``gpt2-fp16`` and ``llama-fp16``, the same
  models exported in float16 (``_export.py --half``); ``vit-fp16``, ``resnet50-fp16`` and
  ``mobilenetv2-fp16``, the float32 exports converted with onnxruntime's
  ``float16.convert_float_to_float16`` (inputs and outputs float16 too), as GPU deployments
  of exported vision models are usually made;
* opt-in, ``llama-opset23``: the same LLaMA by the dynamo exporter at opset 23, which writes
  its RMS norms and rotary as the standard RMSNormalization and RotaryEmbedding ops (its
  attention, written out by _export.py's model, stays so);
* opt-in, a decode step: ``llama-decode``, the same 4-layer LLaMA exported with its KV cache
  (``_export.py --past``: past_key_<i> / past_value_<i> in, presents out, batch, new tokens and
  past all dynamic), timed at one new token on a past of 128 (batch 1), which is what a
  generation loop runs for every token after the prompt.

Outputs per model (each tool once, in a fresh process, as transformers_peers.py runs them):

    fusectl       fusectl optimize MODEL -o OUT   (default: the shipped knowledge repository)
    fusectl-none  fusectl optimize MODEL -o OUT --repository none
    fusectl-ext   fusectl optimize MODEL -o OUT --external_data  (only where the original keeps
                  its weights inline: ViT and the CNNs)
    fusectl-fixed fusectl optimize MODEL -o OUT --input_shape SHAPE, the shape it is timed at
                  (only for llama-decode: one new token, where GroupQueryAttention takes the
                  cache)
    onnxscript    onnxscript.rewriter.ort_fusions.optimize_for_ort
    ORT           python -m onnxruntime.transformers.optimizer --model_type bert|gpt2|vit
                  (none for the CNNs: onnxruntime's optimizer has no CNN model type; for a GPU
                  provider in its GPU mode, --use_gpu --provider cuda, on that machine)

Then one ``fusectl bench`` per model over the original and every output, in a fresh process:
the same feeds for all, ORT_ENABLE_ALL and ORT_DISABLE_ALL, 1 intra-op thread, --runs timed runs
per model and level interleaved round-robin (the order rotating) after --warmup untimed runs,
session creation the median of --session-runs interleaved creations. The table gives each
output's median and its ratio to the original's at the same level, its session creation at both
levels, and the cold start: its session creation under ORT_DISABLE_ALL over the original's under
ORT_ENABLE_ALL.

    python benchmarks/latency.py                          # every model
    python benchmarks/latency.py --models bert,resnet50 --runs 50
    python benchmarks/latency.py --print-only             # the last results again
    python benchmarks/latency.py --tune-repository fusectl/data/repository.json
                                                          # re-measure the shipped repository
    python benchmarks/latency.py --providers cuda --tools fusectl,fusectl-none,onnxscript,ORT
                                                          # on a GPU (onnxruntime-gpu)

With ``--providers cuda`` the fusectl outputs are made for CUDA (``--providers cuda``, the
repository's CUDA section or ``--repository``) and bench keeps every input and output in GPU
memory, so the times are the models' and not the host copies'. ``--reuse`` keeps tool outputs
already in benchmarks/out/latency/<model>/ (made on another machine, say: onnxscript's output
does not depend on the provider) and makes only the missing ones. An output the provider cannot
load, or whose run kills onnxruntime, is recorded as that tool's error and left out of the bench.

Results: benchmarks/out/latency/results.json (results_cuda.json for CUDA, and so on).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import _harness as h
from transformers_peers import ONNXSCRIPT_SCRIPT, one_line, remove_outputs

LATENCY_DIR = h.OUT_DIR / "latency"
MODEL_DIR = LATENCY_DIR / "models"
RESULTS = LATENCY_DIR / "results.json"
TEXT = "input_ids:1,128;attention_mask:1,128"
BERT = {"kind": "bert", "ort": "bert", "heads": 12, "hidden": 768, "shape": TEXT}
LLAMA = {
    "kind": "llama",
    "layers": 4,
    "ort": "gpt2",
    "heads": 16,
    "kv_heads": 4,  # _export.py's LLAMA_CONFIG
    "hidden": 2048,
    "shape": TEXT,
}
GPT2 = {"kind": "gpt2", "ort": "gpt2", "heads": 12, "hidden": 768, "shape": TEXT}
VIT = {"vision": "vit_torchscript_eval", "ort": "vit", "heads": 12, "hidden": 768}
MODELS: dict[str, dict] = {
    "bert": BERT,
    "gpt2": GPT2,
    "llama": LLAMA,
    "vit": VIT,
    "resnet50": {"vision": "resnet50_torchscript_eval"},
    "mobilenetv2": {"vision": "mobilenetv2_torchscript_eval"},
    # float16 (opt-in): what a GPU runs. onnxruntime's CPU provider runs what it has no float16
    # kernel for in float32, casting around it.
    "bert-fp16": {**BERT, "half": True},
    "gpt2-fp16": {**GPT2, "half": True},
    "llama-fp16": {**LLAMA, "half": True},
    "vit-fp16": {"converted": "vit", "ort": "vit", "heads": 12, "hidden": 768},
    "resnet50-fp16": {"converted": "resnet50"},
    "mobilenetv2-fp16": {"converted": "mobilenetv2"},
}
# One decode step of llama-decode: one new token after 128 (batch 1), every layer's cache.
DECODE_PAST = 128
DECODE = ";".join(
    [f"input_ids:1,1;attention_mask:1,{DECODE_PAST + 1}"]
    + [
        f"past_{part}_{i}:1,{LLAMA['kv_heads']},{DECODE_PAST},{LLAMA['hidden'] // LLAMA['heads']}"
        for i in range(LLAMA["layers"])
        for part in ("key", "value")
    ]
)
MODELS["llama-decode"] = {**LLAMA, "past": True, "shape": DECODE}
# The dynamo exporter at opset 23 (opt-in): RMS norm and rotary as the standard ops.
MODELS["llama-opset23"] = {**LLAMA, "exporter": "dynamo", "extra": ["--opset", "23"]}
DEFAULT_MODELS = ("bert", "gpt2", "llama", "vit", "resnet50", "mobilenetv2")
TOOLS = ("fusectl", "fusectl-none", "fusectl-ext", "fusectl-fixed", "onnxscript", "ORT")


def export(name: str, force: bool) -> Path:
    """The cached original of ``name``, exported on first use."""
    case = MODELS[name]
    path = MODEL_DIR / f"{name}.onnx"
    if "kind" in case:
        extra = ["--half"] if case.get("half") else []
        extra += ["--past"] if case.get("past") else []
        extra += case.get("extra", [])
        exporter = case.get("exporter", "torchscript")
        h.ensure_export(
            case["kind"], path, exporter=exporter, layers=case.get("layers"), force=force,
            extra=extra,
        )  # fmt: skip
        return path
    if "converted" in case:
        if force or not path.exists():
            convert_to_float16(export(case["converted"], force), path)
        return path
    if force or not path.exists():
        MODEL_DIR.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(h.BENCH_DIR / "cnn.py"), "--export-one", case["vision"]]
        step = h.measure([*cmd, str(path)])
        if not step.ok:
            raise SystemExit(f"export of {name} failed:\n{step.stderr[-4000:]}")
        print(step.stdout.strip(), flush=True)
    return path


def convert_to_float16(source: Path, path: Path) -> None:
    """``source`` with its weights, inputs and outputs in float16 (onnxruntime's converter)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=False)
    onnx.save(model, str(path))
    print(f"converted {source.name} to float16 -> {path}", flush=True)


def tool_command(
    tool: str, name: str, model: Path, out: Path, args: argparse.Namespace
) -> list[str] | None:
    case = MODELS[name]
    fusectl = [*h.fusectl_cmd(model, out), "--providers", args.providers]
    if tool == "fusectl":
        return fusectl + (["--repository", str(args.repository)] if args.repository else [])
    if tool == "fusectl-none":
        return [*fusectl, "--repository", "none"]
    if tool == "fusectl-ext":
        return [*fusectl, "--external_data"]
    if tool == "fusectl-fixed":
        return [*fusectl, "--input_shape", case["shape"]]
    if tool == "onnxscript":
        return [sys.executable, "-c", ONNXSCRIPT_SCRIPT, str(model), str(out)]
    if case.get("ort") is None:
        return None
    cmd = [sys.executable, "-m", "onnxruntime.transformers.optimizer"]
    cmd += ["--input", str(model), "--output", str(out), "--model_type", case["ort"]]
    cmd += ["--num_heads", str(case["heads"]), "--hidden_size", str(case["hidden"])]
    if args.providers != "cpu":
        # Its own GPU mode: the onnxruntime session it optimizes with runs on the GPU, so a
        # float16 model gets no Casts inserted for the CPU's missing float16 kernels.
        cmd += ["--use_gpu", "--provider", args.providers.split(",")[0].strip().lower()]
    return [*cmd, "--use_external_data_format"]


def run_model(name: str, args: argparse.Namespace) -> dict:
    model = export(name, args.force_export)
    out_dir = LATENCY_DIR / name
    if not args.reuse:
        shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A byte copy of the original beside it (it reads the same external data) is benched as
    # one more model: its ratio is the run's noise floor, what a ratio of 1.01 can be read
    # against on a shared machine.
    control = model.with_name(f"{model.stem}.control.onnx")
    shutil.copyfile(model, control)
    outputs: list[tuple[str, Path]] = [("original", model), ("control", control)]
    result: dict = {"model": name, "tools": {}}
    inline = not model.with_name(model.name + ".data").exists()
    for tool in args.tools:
        out = out_dir / f"{tool}.onnx"
        if tool == "fusectl-ext" and not inline:
            result["tools"][tool] = {"error": "weights external already: as fusectl"}
            continue
        if tool == "fusectl-fixed" and not MODELS[name].get("past"):
            continue  # a KV-cache model's decode step only
        if args.reuse and out.exists():
            result["tools"][tool] = {"reused": True}
            outputs.append((tool, out))
            continue
        cmd = tool_command(tool, name, model, out, args)
        if cmd is None:
            result["tools"][tool] = {"error": "no model type for this architecture"}
            continue
        run = h.measure(cmd, timeout=args.timeout)
        if not run.ok or not out.exists():
            error = "TIMEOUT" if run.timed_out else one_line(run.stderr)
            result["tools"][tool] = {"error": error}
            print(f"  {name} {tool}: {error}", flush=True)
            continue
        result["tools"][tool] = {"optimize_s": round(run.wall_s, 2)}
        outputs.append((tool, out))
    for _, path in outputs:
        h.warm_page_cache(path)
    timed = bench_outputs(name, outputs, result, args)
    control.unlink()  # only the copied .onnx: the external data is the original's
    if not timed.ok:
        result["error"] = one_line(timed.stderr)
        return result
    document = json.loads(timed.stdout)
    for (label, _), entry in zip(outputs, document["models"], strict=True):
        row = result["tools"].setdefault(label, {})
        row["cold_start"] = entry["cold_start"]
        for level, timing in entry["levels"].items():
            row[level] = {
                key: timing[key] for key in ("median_ms", "ratio", "session_s", "session_ratio")
            }
    if not args.keep and not args.reuse:
        for _, path in outputs[2:]:
            remove_outputs(path)
    return result


def _bench_command(
    name: str, paths: list[Path], args: argparse.Namespace, runs: int, warmup: int, sessions: int
) -> list[str]:
    bench = [sys.executable, "-m", "fusectl", "bench", *map(str, paths), "--threads", "1"]
    bench += ["--runs", str(runs), "--warmup", str(warmup), "--session_runs", str(sessions)]
    bench += ["--json", "--providers", args.providers]
    return bench + (["--input_shape", MODELS[name]["shape"]] if "shape" in MODELS[name] else [])


def bench_outputs(
    name: str, outputs: list[tuple[str, Path]], result: dict, args: argparse.Namespace
) -> h.Measurement:
    """One fusectl bench over ``outputs``. A tool's output the provider cannot load (bench
    names the file), or whose run kills onnxruntime, is recorded as that tool's error and
    benched without."""
    while True:
        paths = [path for _, path in outputs]
        bench = _bench_command(name, paths, args, args.runs, args.warmup, args.session_runs)
        timed = h.measure(bench, timeout=args.timeout)
        if timed.ok:
            return timed
        error = one_line(timed.stderr)
        failed = [o for o in outputs[2:] if str(o[1]) in error]
        if not failed and timed.rc < 0:  # the runtime crashed: find whose run it was
            failed = [o for o in outputs[2:] if _crashes(o[1], outputs[0][1], name, args)]
            error = f"onnxruntime crashed running it (signal {-timed.rc})"
        if not failed:
            return timed
        for output in failed:
            result["tools"][output[0]] = {"error": f"does not run: {error}"}
            print(f"  {name} {output[0]}: {error}", flush=True)
            outputs.remove(output)


def _crashes(model: Path, original: Path, name: str, args: argparse.Namespace) -> bool:
    """Whether one short bench of ``model`` beside the original kills the process."""
    bench = _bench_command(name, [original, model], args, runs=1, warmup=0, sessions=1)
    return h.measure(bench, timeout=args.timeout).rc < 0


def results_file(providers: str) -> Path:
    """results.json for the CPU provider (as before), results_<provider>.json for another."""
    short = providers.split(",")[0].strip().lower().removesuffix("executionprovider")
    return RESULTS if short == "cpu" else RESULTS.with_name(f"results_{short}.json")


def print_results(results: list[dict]) -> None:
    headers = ["model", "output", "ALL ms", "ALL ratio", "NONE ms", "NONE ratio"]
    headers += ["ALL session s", "NONE session s", "cold start"]
    rows = []
    for result in results:
        if "error" in result:
            rows.append([result["model"], "bench failed", result["error"], *[""] * 6])
            continue
        for label in ("original", "control", *TOOLS):
            row = result["tools"].get(label, {})
            if "error" in row:
                rows.append([result["model"], label, row["error"][:60], *[""] * 6])
                continue
            if "all" not in row:
                continue
            cells = [result["model"], label]
            for level in ("all", "none"):
                cells += [f"{row[level]['median_ms']:.2f}", f"{row[level]['ratio']:.3f}"]
            cells += [f"{row[level]['session_s']:.3f}" for level in ("all", "none")]
            cells.append(f"{row['cold_start']:.2f}")
            rows.append(cells)
    print(h.table(headers, rows))
    print(
        "ratio: median over the original's at the same level (<= 1.01: no slower); control: a "
        "byte copy of the original, benched as one more model (its ratio is the noise floor); "
        "cold start: session creation under ORT_DISABLE_ALL over the original's under "
        "ORT_ENABLE_ALL (<= 0.5: offline fusion halves start-up)."
    )
    print(h.machine_note())


def tune_repository(names: list[str], repository: Path, force: bool, providers: str) -> None:
    """Re-measure the knowledge repository on every model's original (fusectl tune)."""
    for name in names:
        model = export(name, force)
        cmd = [sys.executable, "-m", "fusectl", "tune", str(model), "--repository", str(repository)]
        cmd += ["--providers", providers]
        cmd += ["--input_shape", MODELS[name]["shape"]] if "shape" in MODELS[name] else []
        run = h.measure(cmd)
        print(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.status())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"[{','.join(DEFAULT_MODELS)}], or any of {','.join(MODELS)}",
    )
    parser.add_argument("--runs", type=int, default=30, help="timed runs per model and level [30]")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first [5]")
    parser.add_argument(
        "--session-runs", type=int, default=5, help="session creations per model and level [5]"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per step [1800]")
    parser.add_argument("--force-export", action="store_true", help="redo cached exports")
    parser.add_argument("--keep", action="store_true", help="keep the tools' output models")
    parser.add_argument("--print-only", action="store_true", help="print the saved results")
    parser.add_argument("--tune-repository", type=Path, help="fusectl tune every model into this")
    parser.add_argument("--providers", default="cpu", help="execution provider [cpu], e.g. cuda")
    parser.add_argument("--repository", type=Path, help="knowledge repository for fusectl's output")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"[{','.join(TOOLS)}]")
    parser.add_argument("--reuse", action="store_true", help="keep tool outputs already made")
    args = parser.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)})")
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if sorted(set(args.tools) - set(TOOLS)):
        parser.error(f"unknown tool(s) in --tools (known: {', '.join(TOOLS)})")
    results_path = results_file(args.providers)
    if args.print_only:
        print_results(json.loads(results_path.read_text()))
        return 0
    if args.tune_repository:
        tune_repository(names, args.tune_repository, args.force_export, args.providers)
        return 0
    results = []
    for name in names:
        print(f"{name} ...", flush=True)
        results.append(run_model(name, args))
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=2))
    print_results(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
