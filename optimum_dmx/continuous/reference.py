"""Differentiable continuous-format MX quantizer: the autograd reference.

A float format with real-valued exponent bits ``e`` and mantissa bits ``m`` quantizes an element as

    eta(x) = max(floor(log2|x|) - m, e_min),  Q(x) = clip(2^eta * round(x / 2^eta), -qmax, qmax)

with ``e_min`` and ``qmax`` from :mod:`optimum_dmx.formats.spec`. ``round`` and ``floor`` are
straight-through (value kept, derivative 1), so ``Q`` has useful gradients with respect to ``e`` and ``m``
(their closed forms are in ``docs/method.md``). At the integer endpoints of a format pair the block-scaled
quantizer equals the exact MX quantizer bit for bit. The fused variant (:mod:`.fused`) computes the same
values with closed-form gradients; this one is the readable reference it is tested against.
"""

from __future__ import annotations

import math

import torch

from ..formats.blocks import (
    block_max,
    block_max_exponent,
    block_scale,
    floor_log2,
    from_blocks,
    shared_exponent,
    to_blocks,
    validate_input,
)
from ..formats.spec import grid_exponent, max_normal, smallest_step_exponent, validate_block_size, validate_scale_rule
from .pairs import FormatPair, get_format_pair

__all__ = ["float_quantize", "quantize_mx_continuous"]


class _RoundSTE(torch.autograd.Function):
    """Round half to even; the backward pass treats it as the identity."""

    @staticmethod
    def forward(ctx, u: torch.Tensor) -> torch.Tensor:
        return torch.round(u)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _FloorLog2STE(torch.autograd.Function):
    """``floor(log2|x|)`` read exactly from the float exponent; the backward pass is that of ``log2|x|``.

    Zeros get a finite exponent (their quantized value is zero whatever the step) and no gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return floor_log2(x.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        nonzero = x != 0
        return torch.where(nonzero, grad / (torch.where(nonzero, x, 1.0) * math.log(2)), 0.0)


class _RescaleKeepingGradient(torch.autograd.Function):
    """``x * scale`` (or ``x / scale`` with ``divide``) whose backward pass leaves the gradient unscaled.

    Dividing by the block scale on the way in and multiplying on the way out cancel in ``dy/dx``; doing
    neither in the backward pass keeps intermediate gradients at the size of the element grid, so they do not
    overflow for inputs near the top of the float32 range.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, divide: bool) -> torch.Tensor:
        return x / scale if divide else x * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _BroadcastScalingGradient(torch.autograd.Function):
    """Broadcast a scalar to ``scale``'s shape; the backward pass sums the gradient weighted by ``scale``.

    Pairs with ``_RescaleKeepingGradient``: the block scale left out of the element gradients is applied
    once per block to the gradient of the format parameters.
    """

    @staticmethod
    def forward(ctx, value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return value.expand(scale.shape).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        finite = torch.isfinite(scale)
        return torch.where(finite, grad * scale, 0.0).sum(), None


def float_quantize(x: torch.Tensor, e: torch.Tensor, m: torch.Tensor, qmax: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``x`` to the float format with real-valued exponent bits ``e`` and mantissa bits ``m``.

    Differentiable with respect to ``x``, ``e``, ``m`` and ``qmax`` (default: the largest normal with no code
    reserved). The clipped range starts strictly above ``qmax``: an input above ``qmax`` that rounds onto it
    counts as clipped, an input at or below it as not clipped; the normal range includes the smallest normal
    binade.
    """
    e = torch.as_tensor(e, dtype=x.dtype, device=x.device)
    m = torch.as_tensor(m, dtype=x.dtype, device=x.device)
    qmax = max_normal(e, m) if qmax is None else torch.as_tensor(qmax, dtype=x.dtype, device=x.device)
    return _quantize_elements(x, m, smallest_step_exponent(e, m), qmax)


def _quantize_elements(x: torch.Tensor, m: torch.Tensor, e_min: torch.Tensor, qmax: torch.Tensor) -> torch.Tensor:
    """The element quantizer of :func:`float_quantize` with its format parameters already derived."""
    step = torch.exp2(grid_exponent(_FloorLog2STE.apply(x), m, e_min))
    q = step * _RoundSTE.apply(x / step)
    above = (q > qmax) | ((q == qmax) & (x > qmax))
    below = (q < -qmax) | ((q == -qmax) & (x < -qmax))
    return torch.where(above, qmax, torch.where(below, -qmax, q))


def quantize_mx_continuous(
    x: torch.Tensor,
    beta: torch.Tensor | float,
    pair: str | FormatPair,
    block_size: int = 32,
    scale_rule: str = "ocp",
) -> torch.Tensor:
    """Block-scaled continuous-format quantize-dequantize of ``x`` along its last dimension.

    Each block of ``block_size`` elements shares the scale ``2^(floor(log2 max|block|) - 2^(e-1))``, treated
    as a constant for the gradient (``scale_rule`` as in ``quantize_mx``, its rounding width taken at ``beta``);
    its elements go through :func:`float_quantize` at the pair's ``(e, m, qmax)`` for ``beta``. Differentiable with
    respect to ``x`` and ``beta``; at ``beta`` = 0, 1, 2 (MXFP8 pair) or 0, 2 (MXFP6 pair) the result equals
    ``quantize_mx`` bit for bit.
    """
    pair = get_format_pair(pair)
    block_size = validate_block_size(block_size)
    validate_input(x)
    beta = torch.as_tensor(beta, dtype=torch.float32, device=x.device)
    if beta.dim() != 0:
        raise ValueError(f"beta must be a scalar, got a tensor of shape {tuple(beta.shape)}.")

    validate_scale_rule(scale_rule)
    blocks = to_blocks(x, block_size)
    exponent = block_max_exponent(block_max(blocks.detach()), pair.scale_rounding_bits(beta.detach(), scale_rule))
    scale = block_scale(shared_exponent(*exponent, pair.scale_offset(beta.detach())))
    # The format parameters are derived once, as scalars, then broadcast to the blocks.
    m, e_min, qmax = (
        _BroadcastScalingGradient.apply(param, scale)
        for param in (pair.mantissa_bits(beta), pair.step_exponent_min(beta), pair.max_normal(beta))
    )
    elements = _RescaleKeepingGradient.apply(blocks, scale, True)
    y = _RescaleKeepingGradient.apply(_quantize_elements(elements, m, e_min, qmax), scale, False)
    return from_blocks(y, x.shape).to(x.dtype)
