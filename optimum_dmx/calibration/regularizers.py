"""Bit-width accounting and the bit regularizers of dMX (DESIGN section 2).

Per-layer element bits `b_i` apply to the layer's weight and, when activations are quantized, to its
input activation (one offset per layer is shared by both). Two model-level averages exist:

* simple: `mean_i b_i`;
* weighted: `sum_i n_i b_i / sum_i n_i`, where `n_i` counts the layer's quantized tensor elements
  (weight numel, plus `in_features` for the activation: its per-token size).

Averages exclude the E8M0 block scales (MXFP4 = 4.0 bits); `storage_bits` includes them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def tensor_sizes(weight_shapes: Sequence[tuple[int, int]], quantize_activations: bool = True) -> torch.Tensor:
    """`n_i` of the weighted average for linears with weights of shape `(out_features, in_features)`."""
    sizes = [out_f * in_f + (in_f if quantize_activations else 0) for out_f, in_f in weight_shapes]
    return torch.tensor(sizes, dtype=torch.float64)


def average_bits(bits: torch.Tensor, kind: str = "simple", sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Model-level average of the per-layer bits `bits` (a 1-D tensor, differentiable).

    `kind` is `"simple"` or `"weighted"`; the weighted average needs the `sizes` from `tensor_sizes`.
    """
    if kind == "simple":
        return bits.mean()
    if kind == "weighted":
        if sizes is None:
            raise ValueError("average_bits(kind='weighted') needs the per-layer tensor sizes.")
        sizes = sizes.to(bits.dtype)
        return (bits * sizes).sum() / sizes.sum()
    raise ValueError(f"bit average {kind!r} is not supported; allowed: simple, weighted.")


def storage_bits(
    element_bits: Sequence[float], weight_shapes: Sequence[tuple[int, int]], block_size: int = 32
) -> float:
    """Stored bits per weight element, including one 8-bit E8M0 scale per block of each weight row."""
    if len(element_bits) != len(weight_shapes):
        raise ValueError(f"got {len(element_bits)} bit widths for {len(weight_shapes)} weights.")
    total_bits = 0.0
    total_elements = 0
    for bits, (out_f, in_f) in zip(element_bits, weight_shapes):
        total_bits += out_f * in_f * bits + out_f * math.ceil(in_f / block_size) * 8
        total_elements += out_f * in_f
    return total_bits / total_elements


def target_regularizer(bits: torch.Tensor, target_bits: float, reg_lambda: float) -> torch.Tensor:
    """Target-aware penalty `R_t = max(0, lambda (bits - target))`: zero once the budget is met."""
    return torch.clamp(reg_lambda * (bits - target_bits), min=0.0)


def simple_regularizer(bits: torch.Tensor, reg_lambda: float) -> torch.Tensor:
    """Plain size penalty `R_s = lambda bits`: always pushes toward fewer bits."""
    return reg_lambda * bits


def bit_regularizer(bits: torch.Tensor, kind: str, reg_lambda: float, target_bits: float) -> torch.Tensor:
    """The regularizer named `kind` (`"target"` or `"simple"`) applied to the average `bits`."""
    if kind == "target":
        return target_regularizer(bits, target_bits, reg_lambda)
    if kind == "simple":
        return simple_regularizer(bits, reg_lambda)
    raise ValueError(f"regularizer {kind!r} is not supported; allowed: target, simple.")


def bit_summary(
    element_bits: Sequence[float],
    weight_shapes: Sequence[tuple[int, int]],
    quantize_activations: bool = True,
    block_size: int = 32,
) -> dict[str, float]:
    """Both averages and the storage bits of a format assignment (one element-bit value per layer)."""
    bits = torch.tensor(element_bits, dtype=torch.float64)
    return {
        "bits_simple": average_bits(bits, "simple").item(),
        "bits_weighted": average_bits(bits, "weighted", tensor_sizes(weight_shapes, quantize_activations)).item(),
        "storage_bits": storage_bits(element_bits, weight_shapes, block_size),
    }
