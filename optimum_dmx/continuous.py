"""Differentiable continuous-format MX quantizer and the format pairs that dMX interpolates between.

A float format with real-valued exponent bits ``e`` and mantissa bits ``m`` quantizes an element as

    b = 2^(e-1) - 1,  e_min = 1 - b - m,  eta(x) = max(floor(log2|x|) - m, e_min),  ss = 2^eta,
    Q(x) = clip(ss * round(x / ss), -qmax, qmax),  qmax = (2 - 2^-m) * 2^(2^e - b - 1).

``round`` and ``floor`` are straight-through (value kept, derivative 1), so ``Q`` has useful gradients with
respect to ``e`` and ``m``. A format pair maps one offset ``beta`` in [0, 2] to ``(e, m)``: the MXFP8 pair
walks E2M1 -> E3M2 -> E4M3, the MXFP6 pair E2M1 -> E2M3. At integer endpoints the quantizer equals the exact
MX quantizer of :mod:`optimum_dmx.formats` bit for bit.

This module is the autograd reference; it knows nothing about models or transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .formats import MX_FORMATS, MXFormat, block_max_exponent, get_format, to_blocks, validate_block_size, validate_input

__all__ = ["float_quantize", "FormatPair", "FORMAT_PAIRS", "get_format_pair", "quantize_mx_continuous"]


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
        return (torch.frexp(x).exponent - 1).to(x.dtype)

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


def default_max_normal(e: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``(2 - 2^-m) * 2^(2^e - b - 1)``: the largest value with all exponent and mantissa bits set."""
    bias = torch.exp2(e - 1) - 1
    return (2 - torch.exp2(-m)) * torch.exp2(torch.exp2(e) - bias - 1)


def float_quantize(
    x: torch.Tensor, e: torch.Tensor, m: torch.Tensor, qmax: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize ``x`` to the float format with real-valued exponent bits ``e`` and mantissa bits ``m``.

    Differentiable with respect to ``x``, ``e``, ``m`` and ``qmax`` (default ``default_max_normal(e, m)``).
    The clipped range starts strictly above ``qmax``: an input above ``qmax`` that rounds onto it counts as
    clipped, an input at or below it as not clipped; the normal range includes the smallest normal binade.
    """
    e = torch.as_tensor(e, dtype=x.dtype, device=x.device)
    m = torch.as_tensor(m, dtype=x.dtype, device=x.device)
    qmax = default_max_normal(e, m) if qmax is None else torch.as_tensor(qmax, dtype=x.dtype, device=x.device)
    return _quantize_elements(x, m, _subnormal_exponent(e, m), qmax)


def _subnormal_exponent(e: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``e_min = 1 - b - m`` with ``b = 2^(e-1) - 1``: the exponent of the subnormal grid step."""
    return 1 - (torch.exp2(e - 1) - 1) - m


def _quantize_elements(x: torch.Tensor, m: torch.Tensor, e_min: torch.Tensor, qmax: torch.Tensor) -> torch.Tensor:
    """The element quantizer of :func:`float_quantize` with its format parameters already derived."""
    normal_exponent = _FloorLog2STE.apply(x) - m
    eta = torch.where(normal_exponent >= e_min, normal_exponent, e_min)
    step = torch.exp2(eta)
    q = step * _RoundSTE.apply(x / step)
    above = (q > qmax) | ((q == qmax) & (x > qmax))
    below = (q < -qmax) | ((q == -qmax) & (x < -qmax))
    return torch.where(above, qmax, torch.where(below, -qmax, q))


@dataclass(frozen=True)
class FormatPair:
    """A low and a high MX format joined by one offset ``beta`` in [0, 2].

    ``e = low.ebits + exponent_slope * beta`` and ``m = low.mbits + beta``: the MXFP8 pair moves both
    (E2M1 -> E3M2 -> E4M3, ``exponent_slope=1``), the MXFP6 pair only the mantissa (E2M1 -> E2M3).
    """

    name: str
    low: MXFormat
    high: MXFormat
    exponent_slope: int

    @property
    def min_bits(self) -> float:
        return float(self.low.bits)

    @property
    def max_bits(self) -> float:
        return float(self.high.bits)

    def exponent_bits(self, beta: torch.Tensor | float) -> torch.Tensor | float:
        return self.low.ebits + self.exponent_slope * beta

    def mantissa_bits(self, beta: torch.Tensor | float) -> torch.Tensor | float:
        return self.low.mbits + beta

    def element_bits(self, beta: torch.Tensor | float) -> torch.Tensor | float:
        """Bits per element at ``beta`` (the shared scale excluded): ``4 + 2 beta`` or ``4 + beta``."""
        return self.low.bits + (1 + self.exponent_slope) * beta

    def max_normal(self, beta: torch.Tensor) -> torch.Tensor:
        """Saturation bound at ``beta``, exact at every integer endpoint.

        When the high format reserves its top mantissa code (E4M3's NaN), the bound drops by one mantissa step
        as beta goes from 1 to 2, ending at 448 instead of 480.
        """
        beta = torch.as_tensor(beta)
        m = self.mantissa_bits(beta)
        emax = torch.exp2(self.exponent_bits(beta) - 1)
        top_code_reserved = self.high.max_normal < (2 - 2.0**-self.high.mbits) * 2.0**self.high.emax
        lost_codes = 1 + torch.clamp(beta - 1, min=0) if top_code_reserved else 1
        return (2 - torch.exp2(-m) * lost_codes) * torch.exp2(emax)

    def format_at(self, beta: int) -> MXFormat:
        """The MX format at an integer ``beta`` (``beta = 1`` of the MXFP6 pair, E2M2, is not an MX format)."""
        ebits, mbits = self.exponent_bits(beta), self.mantissa_bits(beta)
        for fmt in MX_FORMATS.values():
            if (fmt.ebits, fmt.mbits) == (ebits, mbits):
                return fmt
        raise ValueError(f"beta={beta!r} of pair {self.name!r} is E{ebits}M{mbits}, which is not an MX format.")

    def __str__(self) -> str:
        return self.name


FORMAT_PAIRS: Mapping[str, FormatPair] = {
    "mxfp8-mxfp4": FormatPair("mxfp8-mxfp4", get_format("mxfp4_e2m1"), get_format("mxfp8_e4m3"), exponent_slope=1),
    "mxfp6-mxfp4": FormatPair("mxfp6-mxfp4", get_format("mxfp4_e2m1"), get_format("mxfp6_e2m3"), exponent_slope=0),
}


def get_format_pair(pair: str | FormatPair) -> FormatPair:
    """Resolve a pair name (``"mxfp8-mxfp4"`` or ``"mxfp6-mxfp4"``) or a ``FormatPair``."""
    if isinstance(pair, FormatPair):
        return pair
    if isinstance(pair, str) and pair in FORMAT_PAIRS:
        return FORMAT_PAIRS[pair]
    raise ValueError(f"Unknown format pair {pair!r}. Allowed: {', '.join(FORMAT_PAIRS)}.")


def quantize_mx_continuous(
    x: torch.Tensor, beta: torch.Tensor | float, pair: str | FormatPair, block_size: int = 32
) -> torch.Tensor:
    """Block-scaled continuous-format quantize-dequantize of ``x`` along its last dimension.

    Each block of ``block_size`` elements shares the scale ``2^(floor(log2 max|block|) - 2^(e-1))``, treated
    as a constant for the gradient; its elements go through :func:`float_quantize` at the pair's
    ``(e, m, qmax)`` for ``beta``. Differentiable with respect to ``x`` and ``beta``; at ``beta`` = 0, 1, 2
    (MXFP8 pair) or 0, 2 (MXFP6 pair) the result equals ``quantize_mx`` bit for bit.
    """
    pair = get_format_pair(pair)
    block_size = validate_block_size(block_size)
    validate_input(x)
    beta = torch.as_tensor(beta, dtype=torch.float32, device=x.device)
    if beta.dim() != 0:
        raise ValueError(f"beta must be a scalar, got a tensor of shape {tuple(beta.shape)}.")

    blocks = to_blocks(x, block_size)
    floor_log2, finite = block_max_exponent(blocks.detach())
    emax = torch.exp2(pair.exponent_bits(beta.detach()) - 1)
    scale = torch.exp2((floor_log2 - emax).clamp(-127, 127)).masked_fill_(~finite, math.nan)
    # The format parameters are derived once, as scalars, then broadcast to the blocks.
    e, m = pair.exponent_bits(beta), pair.mantissa_bits(beta)
    m, e_min, qmax = (
        _BroadcastScalingGradient.apply(param, scale)
        for param in (m, _subnormal_exponent(e, m), pair.max_normal(beta))
    )
    elements = _RescaleKeepingGradient.apply(blocks, scale, True)
    y = _RescaleKeepingGradient.apply(_quantize_elements(elements, m, e_min, qmax), scale, False)
    return y.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]].to(x.dtype)
