"""MX blocks and their E8M0 shared scales.

A block of ``block_size`` consecutive elements along the last dimension shares one power-of-two scale
``X = 2^k`` with ``k = floor(log2(max|block|)) - emax``, clamped to [-127, 127] and stored as the E8M0 byte
``k + 127``; a block holding a NaN or an Inf gets the NaN scale. A scale rule other than the OCP one
(``spec.SCALE_RULES``) first rounds the block maximum up to the next power of two when its mantissa is at least
``2 - 2^-(r+1)``. The block maxima's exponents and mantissas are read from the float32 bit pattern, so they are
exact (one per block: the elements' rounding steps come from comparisons, ``cast.element_steps``).
"""

from __future__ import annotations

import math

import torch

from .spec import (
    E8M0_BIAS,
    E8M0_NAN,
    FP32_EXPONENT_BIAS,
    FP32_MANTISSA_BITS,
    SCALE_EXPONENT_MAX,
    SCALE_EXPONENT_MIN,
    Number,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAN_SCALE_EXPONENT = E8M0_NAN - E8M0_BIAS  # 128: the unbiased exponent that encodes a NaN block


def validate_input(x: torch.Tensor) -> None:
    """Raise a clear error unless ``x`` is a floating-point tensor that can be cut into blocks."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Expected a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"MX quantization takes a floating-point tensor ({allowed}), got dtype {x.dtype}.")
    if x.dim() == 0:
        raise ValueError("MX quantization needs at least one dimension to form blocks; got a 0-dim tensor.")


def to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 view of ``x`` as ``[*leading, n_blocks, block_size]``, zero-padding the last block."""
    x = x.float()
    pad = -x.shape[-1] % block_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block_size)


def from_blocks(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Undo ``to_blocks``: ``[*leading, n_blocks, block_size]`` -> ``shape`` (the padding dropped)."""
    flat = blocks.reshape(*shape[:-1], -1)
    return flat if flat.shape[-1] == shape[-1] else flat[..., : shape[-1]]


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2|x|)`` of a float32 tensor (int32), read from its exponent field.

    Exact for normal numbers; zeros and float32 subnormals read as -127 (below every MX grid, so they round
    like the smallest step).
    """
    return ((x.view(torch.int32) >> FP32_MANTISSA_BITS) & 0xFF) - FP32_EXPONENT_BIAS


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2^exponent`` for int32 exponents in [-126, 127], built from the bit pattern."""
    return ((exponent + FP32_EXPONENT_BIAS) << FP32_MANTISSA_BITS).view(torch.float32)


def block_max(blocks: torch.Tensor) -> torch.Tensor:
    """``max|block|`` per block (float32, ``[..., n_blocks, 1]``); NaN or Inf where the block holds one."""
    return blocks.abs().amax(dim=-1, keepdim=True)


def rounds_up(amax: torch.Tensor, rounding_bits: Number) -> torch.Tensor:
    """Whether ``amax`` rounded to ``r = rounding_bits`` mantissa bits reaches the next power of two: its
    mantissa ``1.f`` satisfies ``f >= 1 - 2^-(r+1)``. Exact: ``f`` is read from the float32 bit pattern."""
    fraction = (amax.view(torch.int32) & ((1 << FP32_MANTISSA_BITS) - 1)).float() * 2.0**-FP32_MANTISSA_BITS
    threshold = 1 - (
        torch.exp2(-(rounding_bits + 1)) if isinstance(rounding_bits, torch.Tensor) else 2.0 ** -(rounding_bits + 1)
    )
    return fraction >= threshold


def block_max_exponent(amax: torch.Tensor, rounding_bits: Number | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponent the block scale starts from (int32) and a mask of finite blocks.

    ``floor(log2 amax)`` (the OCP rule, ``rounding_bits=None``), plus one where ``amax`` rounds up to the next
    power of two at ``rounding_bits`` mantissa bits (``spec.scale_rounding_bits``).
    """
    exponent = floor_log2(amax)
    if rounding_bits is not None:
        exponent = exponent + rounds_up(amax, rounding_bits).to(exponent.dtype)
    return exponent, torch.isfinite(amax)


def shared_exponent(block_exponent: torch.Tensor, finite: torch.Tensor, emax: Number) -> torch.Tensor:
    """The block scale's exponent ``k = clamp(floor(log2 max|block|) - emax, -127, 127)``; 128 for NaN blocks.

    ``emax`` may be real-valued (the continuous quantizer); then so is ``k``. NaN blocks get their 128 through a
    maximum (with 128 for them, with -128, below every ``k``, for the others) rather than a select: inductor's AVX2
    C++ code (torch 2.13) selects the wrong side of an int32 ``masked_fill`` or ``where`` (``spec.grid_exponent``).
    """
    k = (block_exponent - emax).clamp(SCALE_EXPONENT_MIN, SCALE_EXPONENT_MAX)
    span = NAN_SCALE_EXPONENT - (SCALE_EXPONENT_MIN - 1)
    return torch.maximum(k, (~finite).to(k.dtype) * span + (SCALE_EXPONENT_MIN - 1))


def block_scale(k: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """``2^(k + shift)`` as float32 (subnormal or infinite where the exponent leaves float32's normal range, as
    ``ldexp``); NaN for NaN blocks.

    Integer exponents are built from the bit pattern as the product of two normal powers of two (exact, and a
    handful of vector instructions where ``ldexp`` is a library call per block in a compiled kernel); real-valued
    ones (the continuous quantizer between formats) go through ``ldexp``.
    """
    exponent = k.clamp(max=SCALE_EXPONENT_MAX) + shift
    if exponent.is_floating_point():
        scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    else:
        normal = exponent.clamp(SCALE_EXPONENT_MIN + 1, SCALE_EXPONENT_MAX)
        scale = pow2(normal) * pow2(exponent - normal)
    return scale.masked_fill_(k > SCALE_EXPONENT_MAX, math.nan)
