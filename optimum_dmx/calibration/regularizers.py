"""The bit regularizers of dMX, applied to the model's average element bits (see `optimum_dmx.nn.bits`)."""

from __future__ import annotations

import torch

REGULARIZERS = ("target", "simple")


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
    raise ValueError(f"regularizer {kind!r} is not supported; allowed: {', '.join(REGULARIZERS)}.")
