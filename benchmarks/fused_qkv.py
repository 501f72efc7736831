"""transformers decoders that project query, key and value with one fused weight, at width.

    python benchmarks/fused_qkv.py build
    python benchmarks/fused_qkv.py bench --baseline /path/to/older/fusectl/checkout

``build`` exports, from transformers config classes (random weights, 4 layers, hidden 768, 12
query heads, a vocabulary of 1,024, eager attention, no cache; ``input_ids`` and an
``attention_mask`` of dynamic batch and length), through the TorchScript (``_ts17``) and
dynamo (``_dynamo``) exporters, into benchmarks/out/fused_qkv/:

- ``falcon_new``: Falcon's new decoder architecture (Falcon-40B/180B), 4 key/value groups,
  its QKV viewed as ``[B, L, KV, r+2, H]``, key and value taken by index and broadcast to the
  group before the rotary;
- ``falcon_mqa``: Falcon-7B's multi-query layout, ``[B, L, N+2, H]``, one key/value head;
- ``neox``: GPT-NeoX, ``[B, L, N, 3H]`` cut along the head size, partial rotary (25%);
- ``bloom``: Bloom, ``[B, L, N, 3, H]``, ALiBi.

``bench`` runs each through ``fusectl optimize``, the full checker, ``fusectl verify`` and
``fusectl bench`` (1 thread, interleaved, 1 x 128 tokens), with ``--baseline``'s output too,
as pypi_models.py does for the wheels' models.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pypi_models import bench_rows, build_or_bench

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "fused_qkv"
LENGTH, HIDDEN, HEADS, LAYERS, VOCAB = 128, 768, 12, 4, 1024
EXPORTERS = ("ts17", "dynamo")
NAMES = ("falcon_new", "falcon_mqa", "neox", "bloom")
FEEDS = ["--input_shape", f"input_ids:1,{LENGTH}", "--input_shape", f"attention_mask:1,{LENGTH}"]


def _configs() -> dict:
    import transformers as t

    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS)
    falcon = dict(sizes, num_attention_heads=HEADS, alibi=False)
    return {
        "falcon_new": (
            t.FalconModel,
            t.FalconConfig(**falcon, num_kv_heads=4, new_decoder_architecture=True, bias=False),
        ),
        "falcon_mqa": (
            t.FalconModel,
            t.FalconConfig(**falcon, multi_query=True, parallel_attn=True, bias=True),
        ),
        "neox": (
            t.GPTNeoXModel,
            t.GPTNeoXConfig(
                **sizes, num_attention_heads=HEADS, intermediate_size=4 * HIDDEN, rotary_pct=0.25
            ),
        ),
        "bloom": (
            t.BloomModel,
            t.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS),
        ),
    }


def build() -> None:
    import torch

    class Hidden(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False)[0]

    OUT.mkdir(parents=True, exist_ok=True)
    names = ["input_ids", "attention_mask"]
    for name, (cls, config) in _configs().items():
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = Hidden(cls(config).eval())
        args = (torch.randint(0, VOCAB, (1, LENGTH)), torch.ones(1, LENGTH, dtype=torch.int64))
        axes = {0: "batch", 1: "length"}
        with torch.no_grad():
            torch.onnx.export(
                model, args, str(OUT / f"{name}_ts17.onnx"), input_names=names,
                output_names=["hidden"], dynamic_axes=dict.fromkeys(names, axes),
                opset_version=17, dynamo=False,
            )  # fmt: skip
            dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("length")}
            torch.onnx.export(
                model, args, str(OUT / f"{name}_dynamo.onnx"), input_names=names,
                output_names=["hidden"], dynamic_shapes={"ids": dims, "mask": dims},
                opset_version=18, dynamo=True,
            )  # fmt: skip
        print(f"wrote {name}_ts17.onnx and {name}_dynamo.onnx", flush=True)


def bench(args: argparse.Namespace) -> None:
    stems = [f"{name}_{exporter}" for name in NAMES for exporter in EXPORTERS]
    chosen = [stem for stem in stems if not args.only or stem in args.only.split(",")]
    bench_rows([(OUT / f"{stem}.onnx", FEEDS) for stem in chosen], args)


if __name__ == "__main__":
    build_or_bench(
        __doc__.splitlines()[0],
        lambda args: build(),
        bench,
        ("--only", {"default": "", "help": "bench: comma-separated model stems [all]"}),
    )
