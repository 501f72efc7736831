"""Keras transformers through tf2onnx, as TensorFlow users convert them.

    /path/to/tf-venv/bin/python benchmarks/keras_models.py build   # tensorflow-cpu, tf2onnx
    python benchmarks/keras_models.py bench --baseline /path/to/older/fusectl/checkout

``build`` (in a virtual environment with tensorflow-cpu and tf2onnx; fusectl does not need
them) exports two 4-layer models of Keras's ``Embedding``, ``MultiHeadAttention``,
``LayerNormalization`` and ``Dense`` layers (hidden 768, 12 heads, tanh GELU, random weights
with random norm scales and shifts) at opset 17 into benchmarks/out/keras/ (207 MB each): a
BERT-base-sized encoder at 128 tokens and a dynamic batch, and a GPT-style decoder
(``use_causal_mask=True``) with batch and length dynamic. tf2onnx writes Keras's layer norms
in TensorFlow's moments form, takes its einsums apart into 5-D Transposes and Reshapes whose
targets it computes at run time, and writes the causal mask's ``where`` as arithmetic.
``bench`` runs each through ``fusectl optimize``, the full checker, ``fusectl verify`` and
``fusectl bench`` (1 thread, interleaved, 1 x 128 tokens), with ``--baseline``'s output too,
as pypi_models.py does for the wheels' models.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pypi_models import bench_rows, build_or_bench

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "keras"
MODELS = {"keras_bert4": False, "keras_gpt4": True}  # name: causal
LENGTH = 128


def build() -> None:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import onnx
    import tensorflow as tf
    import tf2onnx
    from tensorflow.keras import layers

    OUT.mkdir(parents=True, exist_ok=True)
    for name, causal in MODELS.items():
        tf.random.set_seed(0)
        length = None if causal else LENGTH
        ids = layers.Input((length,), dtype="int32", name="ids")
        x = layers.Embedding(30522, 768)(ids)
        random = {"gamma_initializer": "random_normal", "beta_initializer": "random_normal"}
        for _ in range(4):
            attended = layers.MultiHeadAttention(12, 64)(x, x, use_causal_mask=causal)
            x = layers.LayerNormalization(epsilon=1e-12, **random)(x + attended)
            gelu = layers.Dense(3072, activation=lambda t: tf.nn.gelu(t, approximate=True))
            x = layers.LayerNormalization(epsilon=1e-12, **random)(x + layers.Dense(768)(gelu(x)))
        spec = (tf.TensorSpec((None, length), tf.int32, name="ids"),)
        model = tf.keras.Model(ids, x)
        proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
        onnx.save(proto, str(OUT / f"{name}.onnx"))
        print(name, len(proto.graph.node), "nodes")


def bench(args: argparse.Namespace) -> None:
    feeds = ["--input_shape", f"ids:1,{LENGTH}"]
    bench_rows([(OUT / f"{name}.onnx", feeds) for name in MODELS], args)


if __name__ == "__main__":
    build_or_bench(__doc__.splitlines()[0], lambda args: build(), bench)
