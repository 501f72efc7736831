"""Inference BatchNormalization as the per-channel affine map it computes, for the passes that
fold it into a neighbouring linear op (a Conv's weights, a MatMul's or Gemm's)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir


def inference_refusal(batchnorm: ir.Node) -> str | None:
    """Why the node is not an inference normalization a fold may replace, if it is not."""
    if batchnorm.attributes.get_int("training_mode", 0) != 0:
        return "BatchNormalization is in training mode"
    if batchnorm.attributes.get_int("spatial", 1) != 1:
        return "BatchNormalization has spatial=0"
    return None


def affine(
    batchnorm: ir.Node, params: Sequence[np.ndarray], dtype: type = np.float64
) -> tuple[np.ndarray, np.ndarray]:
    """``x * factor + offset`` per channel for the node's constant (scale, bias, mean,
    variance), in ``dtype``."""
    scale, shift, mean, variance = (p.astype(dtype).reshape(-1) for p in params)
    epsilon = batchnorm.attributes.get_float("epsilon", 1e-5)
    factor = scale / np.sqrt(variance + np.asarray(epsilon, dtype))
    return factor, shift - mean * factor
