"""Export a randomly initialised Hugging Face model to ONNX with external data (one .data file).

Run by bert_base.py and llama_memory.py in a subprocess so that torch never inflates the
benchmark process itself:

    python benchmarks/_export.py bert  OUT.onnx [--exporter torchscript|dynamo]
    python benchmarks/_export.py llama OUT.onnx [--layers 16]
    python benchmarks/_export.py gpt2  OUT.onnx [--exporter torchscript|dynamo]
    python benchmarks/_export.py bert  OUT.onnx --half        # weights and activations float16
    python benchmarks/_export.py llama OUT.onnx --past        # with a KV cache (decode steps)

The TorchScript exporter writes to a scratch directory (one file per tensor once the model is
over 2 GB); a second step in a fresh process (``consolidate``) rewrites it as OUT.onnx +
OUT.onnx.data, so the peak memory of the torch step and the onnx step do not add up.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

BERT_CONFIG: dict = {}  # transformers.BertConfig() defaults: BERT-base, 12 layers, hidden 768
GPT2_CONFIG: dict = {}  # transformers.GPT2Config() defaults: GPT-2 small, 124 M, 12 layers, 768
LLAMA_CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5504,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)
KV_PARTS = ("key", "value")
PAST = 16  # the past length a KV-cache export is traced with


def _build(kind: str, layers: int | None, attn: str, half: bool = False, past: bool = False):
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(**BERT_CONFIG)
        cls = transformers.BertModel
    elif kind == "gpt2":
        config = transformers.GPT2Config(**GPT2_CONFIG)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(**LLAMA_CONFIG)
        cls = transformers.LlamaForCausalLM
    if layers is not None:
        config.num_hidden_layers = layers
    config._attn_implementation = attn
    config.use_cache = past
    with torch.no_grad():
        model = cls(config).eval()
        if half:
            model = model.half()

    class Wrapper(torch.nn.Module):
        """Plain tensor outputs (no ModelOutput) so both exporters are happy; with ``past``, the
        KV cache in as past_key_<i> / past_value_<i> and out as present_key_<i> / ..."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, *cache):
            if past:
                pairs = list(zip(cache[::2], cache[1::2], strict=True))
                cached = transformers.DynamicCache(pairs)
                out = self.inner(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    past_key_values=cached,
                    use_cache=True,
                )
                presents = [t for layer in cached.layers for t in (layer.keys, layer.values)]
                return (out.logits, *presents)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            if kind == "bert":
                return out.last_hidden_state, out.pooler_output
            return out.logits

    outputs = ["last_hidden_state", "pooler_output"] if kind == "bert" else ["logits"]
    if past:
        outputs += [
            f"present_{part}_{i}" for i in range(config.num_hidden_layers) for part in KV_PARTS
        ]
    n_params = sum(p.numel() for p in model.parameters())
    return Wrapper(model).eval(), outputs, n_params, config.vocab_size


def _past_inputs(kind: str, layers: int | None, half: bool) -> tuple[list[str], tuple]:
    """The KV cache a decoder is traced with: [2, KV heads, 16, head size] per layer and part
    (batch, new tokens and past all above 1, so that none is traced as a constant)."""
    import torch

    if kind != "llama":
        raise SystemExit(f"--past: only llama exports a KV cache here, not {kind}")
    count = layers or LLAMA_CONFIG["num_hidden_layers"]
    heads = LLAMA_CONFIG["num_key_value_heads"]
    size = LLAMA_CONFIG["hidden_size"] // LLAMA_CONFIG["num_attention_heads"]
    dtype = torch.float16 if half else torch.float32
    names = [f"past_{part}_{i}" for i in range(count) for part in KV_PARTS]
    tensors = tuple(torch.randn(2, heads, PAST, size, dtype=dtype) for _ in names)
    return names, tensors


def export(
    kind: str,
    out: Path,
    *,
    exporter: str,
    opset: int,
    layers: int | None,
    attn: str,
    half: bool = False,
    past: bool = False,
) -> Path:
    """Export to a scratch directory; returns the scratch model path."""
    import torch

    began = time.perf_counter()
    model, outputs, n_params, vocab = _build(kind, layers, attn, half, past)
    width, precision = (2, "fp16") if half else (4, "fp32")
    print(
        f"built {kind}: {n_params / 1e6:.1f} M parameters "
        f"({n_params * width / 2**30:.2f} GiB {precision}) "
        f"in {time.perf_counter() - began:.1f} s",
        flush=True,
    )
    input_ids = torch.randint(0, vocab, (2, 3 if past else 16), dtype=torch.int64)
    attention_mask = torch.ones(2, PAST + 3 if past else 16, dtype=torch.int64)
    cache_names, cache = _past_inputs(kind, layers, half) if past else ([], ())
    scratch_dir = out.with_name(out.name + ".scratch")
    shutil.rmtree(scratch_dir, ignore_errors=True)
    scratch_dir.mkdir(parents=True)
    scratch = scratch_dir / "model.onnx"
    began = time.perf_counter()
    with torch.no_grad():
        if exporter == "torchscript":
            mask = {0: "batch", 1: "total_sequence" if past else "sequence"}
            axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": mask}
            for name in cache_names:
                axes[name] = {0: "batch", 2: "past_sequence"}
            for name in outputs:
                axes[name] = (
                    {0: "batch", 2: "total_sequence"}
                    if name.startswith("present_")
                    else {0: "batch", 1: "sequence"}
                    if name != "pooler_output"
                    else {0: "batch"}
                )
            torch.onnx.export(
                model,
                (input_ids, attention_mask, *cache),
                str(scratch),
                dynamo=False,
                input_names=["input_ids", "attention_mask", *cache_names],
                output_names=outputs,
                dynamic_axes=axes,
                opset_version=opset,
            )
        elif past:
            raise SystemExit("--past: the TorchScript exporter only")
        else:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
            program = torch.onnx.export(
                model,
                (input_ids, attention_mask),
                dynamo=True,
                input_names=["input_ids", "attention_mask"],
                output_names=outputs,
                dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
                opset_version=opset,
                external_data=True,
                optimize=True,
            )
            program.save(str(scratch), external_data=True)
    print(
        f"exported with {exporter} (opset {opset}) in {time.perf_counter() - began:.1f} s",
        flush=True,
    )
    return scratch


def consolidate(scratch: Path, out: Path) -> None:
    """Rewrite the scratch export as OUT.onnx + OUT.onnx.data (tensors over 1 KB external)."""
    import onnx

    began = time.perf_counter()
    model = onnx.load(str(scratch))
    data_name = out.name + ".data"
    (out.parent / data_name).unlink(missing_ok=True)
    onnx.save(
        model,
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )
    print(
        f"wrote {out} + {data_name} ({len(model.graph.node)} nodes, "
        f"{len(model.graph.initializer)} initializers) in {time.perf_counter() - began:.1f} s",
        flush=True,
    )
    del model
    gc.collect()
    shutil.rmtree(scratch.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["bert", "gpt2", "llama", "consolidate"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript")
    parser.add_argument("--opset", type=int, default=None, help="[17 torchscript, 18 dynamo]")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--attn", default="eager", help="attention implementation [eager]")
    parser.add_argument("--half", action="store_true", help="export in float16")
    parser.add_argument("--past", action="store_true", help="llama with a KV cache in and out")
    parser.add_argument("--scratch", type=Path, help="consolidate: the scratch model")
    args = parser.parse_args()
    if args.kind == "consolidate":
        consolidate(args.scratch, args.out)
        return
    opset = args.opset or (17 if args.exporter == "torchscript" else 18)
    scratch = export(
        args.kind,
        args.out,
        exporter=args.exporter,
        opset=opset,
        layers=args.layers,
        attn=args.attn,
        half=args.half,
        past=args.past,
    )
    print(f"SCRATCH={scratch}")


if __name__ == "__main__":
    sys.exit(main())
