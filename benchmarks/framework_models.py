"""PaddlePaddle, JAX/Flax, MindSpore and hand-written PyTorch transformers, as their users
convert them to ONNX.

    /path/to/paddle-venv/bin/python benchmarks/framework_models.py build paddle
    /path/to/jax-venv/bin/python benchmarks/framework_models.py build jax
    /path/to/mindspore-venv/bin/python benchmarks/framework_models.py build mindspore
    python benchmarks/framework_models.py build torch
    python benchmarks/framework_models.py bench --baseline /path/to/older/fusectl/checkout

``build paddle`` (a virtual environment with paddlepaddle, paddle2onnx and onnx-graphsurgeon),
``build jax`` (jax, flax, jax2onnx) and ``build mindspore`` (mindspore, numpy < 2) export, with
the model code of the test fixtures' scripts (tests/fixtures/make_paddle_fixtures.py,
make_jax_fixtures.py, make_mindspore_fixtures.py) at BERT-base width (4 layers, hidden 768, 12
heads, random weights), into benchmarks/out/frameworks/:

- ``paddle_gpt4``: a GPT-style decoder through paddle2onnx (opset 17, batch and length
  dynamic), its causal mask applied with ``paddle.where``, which broadcasts by adding zeros;
- ``paddle_llama4``: a LLaMA-style decoder (RMS norms, rotate_half rotary, 4 key/value heads,
  SiLU-gated MLP) through paddle2onnx;
- ``flax_encoder4``: a Flax NNX encoder through jax2onnx (opset 23, batch symbolic, 128
  tokens), its LayerNorms' variance the mean square less the squared mean, its projections
  reshaped straight to heads;
- ``flax_llama4``: a Flax LLaMA-style decoder through jax2onnx (RMS norms, rotate_half rotary,
  12 query and 4 key / value heads repeated with ``jnp.repeat``, einsum attention, a
  vocabulary of 1,024);
- ``mindspore_bert4`` and ``mindspore_gpt4``: a BERT-style encoder and a GPT-style decoder
  through MindSpore's exporter (opset 11, static 1 x 128 tokens), their norms' variances
  sums of squares over their count, the query, key and value reading one shared flatten, the
  decoder's mask a Where of full-size constants;
- ``llama2c4_*``, ``torchtune4_*``, ``lucidrains4_*``, ``litgpt4_*`` and ``gemmapt4_*``
  (``build torch``, this project's environment): decoders written outside transformers, as
  llama2.c, torchtune, rotary-embedding-torch, litgpt and gemma_pytorch write them
  (complex-pair rotary, rotate_half of pairs, llama2.c's key / value heads repeated before
  their transpose, litgpt's query-group QKV, gemma_pytorch's ``repeat_interleave``; 12 query
  and 4 key / value heads, 12 for lucidrains, a vocabulary of 1,024), with
  tests/fixtures/make_handwritten_lm_fixtures.py's model code, through the TorchScript
  (``_ts17``) and dynamo (``_dynamo``) exporters.

``bench`` runs each through ``fusectl optimize``, the full checker, ``fusectl verify`` and
``fusectl bench`` (1 thread, interleaved, 1 x 128 tokens), with ``--baseline``'s output too,
as pypi_models.py does for the wheels' models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pypi_models import bench_rows, build_or_bench

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "frameworks"
LENGTH, HIDDEN, HEADS, LAYERS = 128, 768, 12, 4
# name: fusectl's input options for it
MODELS = {
    "paddle_gpt4": ["--input_shape", f"input_ids:1,{LENGTH}"],
    "paddle_llama4": ["--input_shape", f"input_ids:1,{LENGTH}"],
    "flax_encoder4": ["--input_shape", f"x:1,{LENGTH},{HIDDEN}"],
    "flax_llama4": ["--input_shape", f"input_ids:1,{LENGTH}"],
    "mindspore_bert4": [],
    "mindspore_gpt4": [],
    **{
        f"{style}4_{exporter}": ["--input_shape", f"input_ids:1,{LENGTH}"]
        for style in ("llama2c", "torchtune", "lucidrains", "litgpt", "gemmapt")
        for exporter in ("ts17", "dynamo")
    },
}


def build(framework: str) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    OUT.mkdir(parents=True, exist_ok=True)
    if framework == "paddle":
        import paddle
        from make_paddle_fixtures import Decoder, export

        paddle.seed(0)
        sizes = {"vocab": 32000, "hidden": HIDDEN, "heads": HEADS, "layers": LAYERS}
        export(Decoder(**sizes), OUT / "paddle_gpt4.onnx")
        export(Decoder(**sizes, kv_heads=4), OUT / "paddle_llama4.onnx")
    elif framework == "torch":
        from make_handwritten_lm_fixtures import Sizes
        from make_handwritten_lm_fixtures import build as export_styles

        sizes = Sizes(1024, HIDDEN, HEADS, 4, LAYERS, 2 * LENGTH, 2048)
        export_styles(OUT, sizes, suffix=str(LAYERS))
    elif framework == "jax":
        from make_jax_fixtures import Encoder, Llama, export, export_llama

        encoder = Encoder(hidden=HIDDEN, heads=HEADS, layers=LAYERS)
        export(encoder, OUT / "flax_encoder4.onnx", sequence=LENGTH, hidden=HIDDEN)
        llama = Llama(
            vocab=1024, hidden=HIDDEN, heads=HEADS, kv_heads=4, layers=LAYERS, length=LENGTH
        )
        export_llama(llama, OUT / "flax_llama4.onnx", sequence=LENGTH)
    else:
        from make_mindspore_fixtures import Bert, Gpt, Sizes, export

        sizes = Sizes(1, LENGTH, 30522, HIDDEN, HEADS, LAYERS)
        export(Bert(sizes), sizes, OUT / "mindspore_bert4.onnx")
        export(Gpt(sizes), sizes, OUT / "mindspore_gpt4.onnx")


def bench(args: argparse.Namespace) -> None:
    chosen = set(args.only.split(",")) if args.only else set(MODELS)
    models = [(OUT / f"{name}.onnx", feeds) for name, feeds in MODELS.items() if name in chosen]
    bench_rows(models, args)


def _build(args: argparse.Namespace) -> None:
    if args.framework is None:
        raise SystemExit("build takes the framework: paddle, jax, mindspore or torch")
    build(args.framework)


if __name__ == "__main__":
    build_or_bench(
        __doc__.splitlines()[0],
        _build,
        bench,
        ("framework", {"nargs": "?", "choices": ["paddle", "jax", "mindspore", "torch"]}),
        ("--only", {"default": "", "help": "bench: comma-separated model names [all]"}),
    )
