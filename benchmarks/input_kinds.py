"""fusectl on one model in the forms users hand it over in: quantized, exported at an old
opset, or already optimized by a peer.

For the committed tiny BERT, GPT-2 and LLaMA (tests/fixtures, TorchScript, opset 17) it makes
each input kind below into benchmarks/out/input_kinds/, runs ``fusectl optimize`` and
``fusectl verify`` on it in subprocesses, and prints the fused-op classes of every output next
to those of the float original's output, so that a kind that loses fusions shows:

    float       the fixture as it is
    int4        onnxruntime's MatMulNBitsQuantizer (blocks of 16, symmetric): MatMulNBits
    int8        onnxruntime's quantize_dynamic: DynamicQuantizeLinear + MatMulInteger
    qdq         onnxruntime's quantize_static, QDQ format, 4 random calibration batches
    old-opset   the eager export at opset 11 (BERT, LLaMA) or 13 (GPT-2), tests/fixtures
    ort         onnxruntime.transformers.optimizer's output (model type bert / gpt2)
    onnxscript  onnxscript's optimize_for_ort output (of the dynamo export, as its users run it)

A peer's output already holds fused ops, which fusectl's count includes: the column says what
the model holds after fusectl, not what fusectl fused.

    python benchmarks/input_kinds.py [--models bert,gpt2,llama] [--json R.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import _harness as h
from transformers_peers import ONNXSCRIPT_SCRIPT, count_ops, one_line

sys.path.insert(0, str(h.REPO_ROOT))
from tests.conftest import fused_op_classes  # shared with the tests

FIXTURES = h.REPO_ROOT / "tests" / "fixtures"
OUT = h.OUT_DIR / "input_kinds"
CLASSES = ("attention", "norm", "skip_norm", "gelu", "rotary")
# model: (fixture stem, old-opset fixture, onnxruntime model type, heads, hidden)
MODELS = {
    "bert": ("bert_tiny", "bert_tiny_eager_ts11", "bert", 4, 32),
    "gpt2": ("gpt2_tiny", "gpt2_tiny_eager_ts13", "gpt2", 4, 32),
    "llama": ("llama_tiny", "llama_tiny_eager_ts11", "gpt2", 4, 64),
}


def _feeds(path: Path, batches: int) -> list[dict]:
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = []
    for _ in range(batches):
        batch = {}
        for value in session.get_inputs():
            shape = [d if isinstance(d, int) else 6 for d in value.shape]
            if "mask" in value.name:
                batch[value.name] = np.ones(shape, np.int64)
            elif "int" in value.type:
                batch[value.name] = rng.integers(0, 50, shape).astype(np.int64)
            else:
                batch[value.name] = rng.normal(size=shape).astype(np.float32)
        feeds.append(batch)
    return feeds


def _int4(source: Path, target: Path) -> None:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), block_size=16, is_symmetric=True)
    quantizer.process()
    quantizer.model.save_model_to_file(str(target))


def _int8(source: Path, target: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


def _qdq(source: Path, target: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter(_feeds(source, 4))

        def get_next(self) -> dict | None:
            return next(self.batches, None)

    quantize_static(str(source), str(target), Reader(), quant_format=QuantFormat.QDQ)


def _ort(model: str) -> Callable[[Path, Path], None]:
    def optimize(source: Path, target: Path) -> None:
        _, _, model_type, heads, hidden = MODELS[model]
        subprocess.run(
            [
                sys.executable, "-m", "onnxruntime.transformers.optimizer", "--input",
                str(source), "--output", str(target), "--model_type", model_type,
                "--num_heads", str(heads), "--hidden_size", str(hidden),
            ],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    return optimize


def _onnxscript(source: Path, target: Path) -> None:
    dynamo = source.with_name(source.name.replace("_ts17", "_dynamo"))
    subprocess.run(
        [sys.executable, "-c", ONNXSCRIPT_SCRIPT, str(dynamo), str(target)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def _kinds(model: str) -> dict[str, Callable[[Path, Path], None] | Path]:
    """Each input kind: how it is made from the float fixture, or the committed file."""
    stem, old, *_ = MODELS[model]
    return {
        "float": FIXTURES / f"{stem}_ts17.onnx",
        "int4": _int4,
        "int8": _int8,
        "qdq": _qdq,
        "old-opset": FIXTURES / f"{old}.onnx",
        "ort": _ort(model),
        "onnxscript": _onnxscript,
    }


def _run(kind: str, model: str, made: Callable[[Path, Path], None] | Path) -> dict:
    source = FIXTURES / f"{MODELS[model][0]}_ts17.onnx"
    path = made if isinstance(made, Path) else OUT / f"{model}_{kind}.onnx"
    row: dict = {"model": model, "kind": kind}
    if not isinstance(made, Path):
        try:
            made(source, path)
        except Exception as error:  # a quantizer or peer that fails: recorded, the table goes on
            message = error.stderr if isinstance(error, subprocess.CalledProcessError) else error
            return row | {"status": f"not made: {one_line(str(message))}"}
    output = OUT / f"{model}_{kind}.fusectl.onnx"
    optimized = subprocess.run(h.fusectl_cmd(path, output), capture_output=True, text=True)
    if optimized.returncode != 0:
        return row | {"status": f"exit {optimized.returncode}: {one_line(optimized.stderr)}"}
    verified = subprocess.run(
        [sys.executable, "-m", "fusectl", "verify", str(path), str(output)],
        capture_output=True, text=True,
    )  # fmt: skip
    before, nodes_before = count_ops(path)
    after, nodes_after = count_ops(output)
    return row | {
        "status": "ok" if verified.returncode == 0 else f"verify: {one_line(verified.stderr)}",
        "nodes": [nodes_before, nodes_after],
        "input": fused_op_classes(before),
        "output": fused_op_classes(after),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        for kind, made in _kinds(model).items():
            rows.append(_run(kind, model, made))
            print(f"{model} {kind}: {rows[-1]['status']}", file=sys.stderr)
    print(h.machine_note())
    cells = [
        [
            row["model"], row["kind"],
            *(
                f"{row['input'][cls]} -> {row['output'][cls]}" if "output" in row else "-"
                for cls in CLASSES
            ),
            " -> ".join(map(str, row["nodes"])) if "nodes" in row else "-",
            row["status"],
        ]
        for row in rows
    ]  # fmt: skip
    print(h.table(["model", "input", *CLASSES, "nodes", "status"], cells))
    print("cells: fused ops of the class in the input -> in fusectl's output; status: fusectl")
    print("verify of the output against that input (ok: within the passes' tolerance)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
