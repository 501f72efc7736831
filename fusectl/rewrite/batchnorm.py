"""Inference BatchNormalization as the per-channel affine map it computes, and constants that
broadcast one value per channel, for the passes that fold them into a neighbouring linear op (a
Conv's weights, a MatMul's or Gemm's)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.graph import constant_value


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


def inference_affine(batchnorm: ir.Node, channels: int) -> tuple[np.ndarray, np.ndarray] | str:
    """The normalization of ``channels`` channels as ``x * factor + offset`` (float64), from
    its constant parameters; or why it is no such map."""
    refusal = inference_refusal(batchnorm)
    if refusal is not None:
        return refusal
    if any(out.uses() or out.is_graph_output() for out in batchnorm.outputs[1:]):
        return "the BatchNormalization's running statistics are read"
    params = [constant_value(value) for value in batchnorm.inputs[1:5]]
    if len(params) != 4 or any(p is None for p in params):
        return "the BatchNormalization parameters are not constants"
    if any(p.size != channels for p in params):  # type: ignore[union-attr]
        return "the BatchNormalization parameters do not match the channels it is folded over"
    return affine(batchnorm, params)  # type: ignore[arg-type]


def per_channel(array: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """A constant broadcast against an [N, C, ...] tensor of ``rank`` axes as one value per
    channel (a scalar, [C, 1, ..] or [1, C, 1, ..]: broadcasting aligns trailing axes, so a
    bare [C] would vary along the last axis), in its own type; None if it is not one."""
    if array.ndim > rank:
        return None
    padded = (1,) * (rank - array.ndim) + array.shape
    if padded[0] != 1 or any(d != 1 for d in padded[2:]) or padded[1] not in (1, channels):
        return None
    return np.broadcast_to(array.reshape(-1), (channels,))
