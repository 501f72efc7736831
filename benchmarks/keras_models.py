"""Keras transformers through tf2onnx, as TensorFlow users convert them.

    /path/to/tf-venv/bin/python benchmarks/keras_models.py build   # tensorflow-cpu, tf2onnx
    python benchmarks/keras_models.py bench --baseline /path/to/older/fusectl/checkout

``build`` (in a virtual environment with tensorflow-cpu and tf2onnx; fusectl does not need
them) exports a 4-layer BERT-base-sized encoder of Keras's ``Embedding``,
``MultiHeadAttention``, ``LayerNormalization`` and ``Dense`` layers (hidden 768, 12 heads,
tanh GELU, random weights with random norm scales and shifts) at opset 17, 128 tokens and a
dynamic batch, into benchmarks/out/keras/ (207 MB). tf2onnx writes Keras's layer norms in
TensorFlow's moments form and takes its einsums apart into 5-D Transposes and Reshapes whose
targets it computes at run time. ``bench`` runs it through ``fusectl optimize``, the full
checker, ``fusectl verify`` and ``fusectl bench`` (1 thread, interleaved, batch 1), with
``--baseline``'s output too, as pypi_models.py does for the wheels' models.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "keras"
MODEL = OUT / "keras_bert4.onnx"
LENGTH = 128


def build() -> None:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import onnx
    import tensorflow as tf
    import tf2onnx
    from tensorflow.keras import layers

    tf.random.set_seed(0)
    ids = layers.Input((LENGTH,), dtype="int32", name="ids")
    x = layers.Embedding(30522, 768)(ids)
    random = {"gamma_initializer": "random_normal", "beta_initializer": "random_normal"}
    for _ in range(4):
        attended = layers.MultiHeadAttention(12, 64)(x, x)
        x = layers.LayerNormalization(epsilon=1e-12, **random)(x + attended)
        hidden = layers.Dense(3072, activation=lambda t: tf.nn.gelu(t, approximate=True))(x)
        x = layers.LayerNormalization(epsilon=1e-12, **random)(x + layers.Dense(768)(hidden))
    spec = (tf.TensorSpec((None, LENGTH), tf.int32, name="ids"),)
    proto, _ = tf2onnx.convert.from_keras(tf.keras.Model(ids, x), input_signature=spec, opset=17)
    OUT.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(MODEL))
    print(MODEL, len(proto.graph.node), "nodes")


def bench(args: argparse.Namespace) -> None:
    from pypi_models import _row

    args.bench = True
    row = _row(MODEL, args, ["--input_shape", f"ids:1,{LENGTH}"])
    print(json.dumps(row, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["build", "bench"])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--baseline", type=Path, help="another fusectl checkout to compare with")
    args = parser.parse_args()
    if args.step == "build":
        build()
    else:
        bench(args)


if __name__ == "__main__":
    main()
