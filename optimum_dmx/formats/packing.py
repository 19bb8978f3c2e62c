"""MX storage form: uint8 element codes and uint8 E8M0 scales (the layout compressed-tensors also uses).

FP8 stores one code per byte; FP6 four codes in three bytes (``c0 | c1 << 6 | c2 << 12 | c3 << 18``,
little-endian); FP4 two codes per byte, the even-indexed element in the low nibble. Scales are the block
exponents biased by 127 (0xFF = NaN), one per block along the last dimension.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .blocks import block_scale, to_blocks, validate_input
from .cast import compiles, element_binades, quantize_blocks
from .compilation import CompiledKernel
from .spec import (
    E8M0_BIAS,
    FP32_EXPONENT_BIAS,
    FP32_MANTISSA_BITS,
    SCALE_EXPONENT_MAX,
    MXFormat,
    get_format,
    packed_row_lengths,
    validate_block_size,
    validate_scale_rule,
)


@dataclass
class MXPackedTensor:
    """An MX-quantized tensor in storage form.

    Attributes:
        codes: uint8 element codes, ``[*leading, packed_len]``: FP8 one code per byte; FP6 four codes in three
            bytes; FP4 two codes per byte, the even-indexed element in the low nibble.
        scales: uint8 E8M0 shared exponents (biased by 127, 0xFF = NaN), ``[*leading, n_blocks]``.
        fmt: the element format.
        shape: the original, unpadded shape.
        block_size: elements per shared scale.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: MXFormat
    shape: torch.Size
    block_size: int = 32


def packed_shapes(shape: Sequence[int], fmt: str | MXFormat, block_size: int = 32) -> tuple[torch.Size, torch.Size]:
    """Shapes of ``(codes, scales)`` that ``pack_mx`` produces for a tensor of ``shape``."""
    fmt = get_format(fmt)
    *leading, last = shape
    code_bytes, n_blocks = packed_row_lengths(last, fmt.bits, validate_block_size(block_size))
    return torch.Size([*leading, code_bytes]), torch.Size([*leading, n_blocks])


def element_codes(elements: torch.Tensor, fmt: MXFormat, from_bits: bool = True) -> torch.Tensor:
    """Sign-magnitude codes ``S|E|M`` of element values that lie on the ``fmt`` grid, as float32 integers.

    Two ways give the same codes, as ``cast.quantize_blocks``' two roundings do: from the float32 bit pattern
    (``from_bits``: a normal value's pattern shifted right keeps its exponent and top mantissa bits, re-biased from
    float32's bias to the format's; a few integer operations, the fastest eagerly), or by comparisons and float32
    arithmetic, for compiled kernels: a magnitude in the binade ``b`` above the format's smallest normal one (0 for
    subnormals) with rounding step ``s`` has the code ``b * 2^m + |v| / s`` (``cast.element_binades``), and
    ``copysign`` adds the sign bit for every negative sign, -0.0's included. torch 2.13's inductor writes each float32
    <-> int32 bit reinterpretation (and ``signbit``) for a CPU as a scalar loop (``cast.element_steps``), and the
    comparisons run on vectors; eagerly each of them is a pass over memory."""
    magnitude = elements.abs()
    if from_bits:
        bits = magnitude.view(torch.int32)
        normal = (bits >> (FP32_MANTISSA_BITS - fmt.mbits)) - ((FP32_EXPONENT_BIAS - fmt.bias) << fmt.mbits)
        subnormal = (magnitude / fmt.min_subnormal).to(torch.int32)
        codes = torch.where(magnitude >= fmt.min_normal, normal, subnormal)
        return (codes | torch.signbit(elements).to(torch.int32) << (fmt.ebits + fmt.mbits)).float()
    step, binade = element_binades(magnitude, fmt)
    half_sign_bit = 2.0 ** (fmt.bits - 2)
    sign = half_sign_bit - torch.copysign(torch.full_like(elements, half_sign_bit), elements)  # 0 or the sign bit
    return binade * 2.0**fmt.mbits + magnitude / step + sign


def code_values(fmt: MXFormat) -> torch.Tensor:
    """float32 value of every code of ``fmt`` (a lookup table of 2^bits entries)."""
    codes = torch.arange(2**fmt.bits, dtype=torch.int32)
    mantissa = (codes & (2**fmt.mbits - 1)).float()
    exponent = (codes >> fmt.mbits) & (2**fmt.ebits - 1)
    normal = (1 + mantissa / 2**fmt.mbits) * torch.exp2((exponent - fmt.bias).float())
    values = torch.where(exponent > 0, normal, mantissa * fmt.min_subnormal)
    sign = (codes >> (fmt.ebits + fmt.mbits)) & 1
    return torch.where(sign.bool(), -values, values)


@dataclass(frozen=True)
class ElementGrid:
    """The magnitudes of an element format and the boundaries between them, for rounding by lookup.

    ``magnitudes[c]`` is the value of magnitude code ``c`` (ascending, largest normal last). ``boundaries[c]`` is
    where rounding moves from code ``c`` up to ``c + 1``: their midpoint, which rounds down, or where the tie
    belongs to the odd code ``c``'s even neighbour above, the float32 just below the midpoint. `round` then agrees
    with ``cast.round_elements`` (half to even, subnormals, saturation) bit for bit in a few operations, which is
    what a loop over a handful of elements at a time (GPTQ's columns) needs.
    """

    magnitudes: torch.Tensor
    boundaries: torch.Tensor

    @classmethod
    def of(cls, fmt: MXFormat, device: torch.device | str = "cpu") -> ElementGrid:
        values = code_values(fmt)[: 2 ** (fmt.bits - 1)]  # the positive sign's codes, ascending
        magnitudes = values[values <= fmt.max_normal]  # E4M3's top code is NaN
        midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2  # exact: one more mantissa bit than the format's
        tie_goes_up = torch.arange(len(midpoints)) % 2 == 1  # the code above the midpoint is the even one
        below = torch.nextafter(midpoints, torch.tensor(-math.inf))
        return cls(magnitudes.to(device), torch.where(tie_goes_up, below, midpoints).to(device))

    def round(self, v: torch.Tensor) -> torch.Tensor:
        """Finite ``v`` (float32, already divided by its block's scale) rounded to the grid, saturated, sign kept."""
        return self.magnitudes[torch.bucketize(v.abs(), self.boundaries)].copysign(v)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., n]`` (n a multiple of the group size) into uint8 bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)
    quads = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 4)
    word = quads[..., 0] | (quads[..., 1] << 6) | (quads[..., 2] << 12) | (quads[..., 3] << 18)
    packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return packed.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 bytes -> int64 codes ``[..., n]``."""
    data = packed.long()
    if bits == 8:
        return data
    if bits == 4:
        return torch.stack([data & 0xF, data >> 4], dim=-1).reshape(*data.shape[:-1], -1)
    triples = data.reshape(*data.shape[:-1], -1, 3)
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    codes = torch.stack([(word >> shift) & 0x3F for shift in (0, 6, 12, 18)], dim=-1)
    return codes.reshape(*data.shape[:-1], -1)


def negate_rows(codes: torch.Tensor, fmt: str | MXFormat, rows: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[out, packed_len]`` of the tensor whose rows where ``rows`` (bool, ``[out]``) is true are
    negated: each of their element codes has its sign bit flipped. Exact, and the block scales stay as they are:
    the element formats are sign-magnitude and a block's largest magnitude does not change."""
    fmt = get_format(fmt)
    flipped = unpack_codes(codes, fmt.bits)
    flipped[rows] ^= 1 << (fmt.bits - 1)
    return pack_codes(flipped, fmt.bits)


def pack_mx(x: torch.Tensor, fmt: str | MXFormat, block_size: int = 32, scale_rule: str = "ocp") -> MXPackedTensor:
    """Quantize ``x`` to an MX format along its last dimension and return its storage form.

    ``unpack_mx(pack_mx(x, fmt, scale_rule=r))`` equals ``quantize_mx(x, fmt, scale_rule=r)`` bit for bit (in
    float32). Rows of whole blocks get their codes from one compiled kernel (``compilation``; the same bits), which
    are then packed into bytes: 3.5-7x as fast as eagerly on a CPU (``benchmarks/results/formats.md``).
    """
    fmt = get_format(fmt)
    block_size = validate_block_size(block_size)
    validate_scale_rule(scale_rule)
    validate_input(x)
    if compiles(x.shape[-1], block_size):  # as a matrix of rows: one kernel serves every row count of a width
        codes, scales = fused_code_rows(x.detach().reshape(-1, x.shape[-1]).float(), fmt, block_size, scale_rule)
        codes_shape, scales_shape = packed_shapes(x.shape, fmt, block_size)
        packed = pack_codes(codes, fmt.bits)
        return MXPackedTensor(packed.view(codes_shape), scales.view(scales_shape), fmt, x.shape, block_size)
    elements, k, shift = quantize_blocks(to_blocks(x, block_size), fmt, scale_rule)
    return pack_blocks(elements * 2.0**shift, k, fmt, x.shape)


def code_rows(rows: torch.Tensor, fmt: MXFormat, block_size: int, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_mx``'s arithmetic on float32 rows ``[n, width]`` but the packing of codes into bytes: each element's
    code in a byte of its own and the scales (``block_codes``; the scales are a block output, ``compilation``).

    The rounding is float32 arithmetic (no host synchronisation), so that it compiles into one kernel. The codes go
    into bytes two or four at a time afterwards, eagerly (``pack_codes``): inside the kernel, inductor's CPU code
    reads the pairs or fours of elements at a stride one element at a time (``benchmarks/results/formats.md`` has
    the packing's time before and after this split)."""
    elements, k, _ = quantize_blocks(to_blocks(rows, block_size), fmt, scale_rule, native_cast=False)
    return block_codes(elements, k, fmt, rows.shape, from_bits=False)


def block_codes(
    elements: torch.Tensor, k: torch.Tensor, fmt: MXFormat, shape: Sequence[int], from_bits: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_blocks``' codes, one per element and byte (uint8, ``[*shape[:-1], n]``: zero-padded to whole blocks,
    and for FP6 to a multiple of 4), and its scales (uint8 E8M0); ``from_bits`` as in ``element_codes``."""
    shape = torch.Size(shape)
    codes = torch.where(k > SCALE_EXPONENT_MAX, 0.0, element_codes(elements, fmt, from_bits))  # NaN blocks
    codes = codes.reshape(*shape[:-1], -1)
    codes_shape, _ = packed_shapes(shape, fmt, elements.shape[-1])
    padding = codes_shape[-1] * 8 // fmt.bits - codes.shape[-1]  # FP6 packs codes by fours
    if padding:  # (a pad of nothing would make a compiled kernel's row count static: torch 2.13 guards on it)
        codes = torch.nn.functional.pad(codes, (0, padding))
    return codes.to(torch.uint8), (k.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


def pack_blocks(elements: torch.Tensor, k: torch.Tensor, fmt: MXFormat, shape: Sequence[int]) -> MXPackedTensor:
    """The storage form of blocks already rounded to ``fmt`` with shared exponents of the caller's choice.

    ``elements`` (float32, ``[*leading, n_blocks, block_size]``, the last block zero-padded) lie on ``fmt``'s
    grid in units of ``2^k``; ``k`` (int32, ``[*leading, n_blocks, 1]``) are the blocks' exponents, 128 for NaN
    blocks; ``shape`` is the unpadded tensor's. ``pack_mx`` packs its own rounding this way; a rounding that picks
    its scales otherwise (GPTQ) keeps them exactly.
    """
    codes, scales = block_codes(elements, k, fmt, shape)
    return MXPackedTensor(pack_codes(codes, fmt.bits), scales, fmt, torch.Size(shape), elements.shape[-1])


def unpack_mx(packed: MXPackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize an ``MXPackedTensor`` to ``dtype`` with its original shape."""
    fmt, block_size = packed.fmt, packed.block_size
    codes_shape, scales_shape = packed_shapes(packed.shape, fmt, block_size)
    if packed.codes.shape != codes_shape or packed.scales.shape != scales_shape:
        raise ValueError(
            f"Packed {fmt.name} tensor of shape {tuple(packed.shape)} needs codes {tuple(codes_shape)} and "
            f"scales {tuple(scales_shape)}, got {tuple(packed.codes.shape)} and {tuple(packed.scales.shape)}."
        )
    table = code_values(fmt).to(packed.codes.device)
    compiled = packed.codes.dim() == 2 and compiles(packed.shape[-1], block_size)
    run = fused_dequantize if compiled else dequantize
    return run(packed.codes, packed.scales, table, fmt.bits, block_size, packed.shape[-1], dtype)[0]


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    table: torch.Tensor,
    bits: int,
    block_size: int,
    length: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``unpack_mx``'s arithmetic: codes to values (``table``), times their block scales, cut to ``length``; and
    the block scales (float32; a block output, ``compilation``)."""
    elements = table[unpack_codes(codes, bits)[..., : scales.shape[-1] * block_size]]
    elements = elements.reshape(*scales.shape, block_size)
    block_scales = block_scale(scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    values = elements.mul_(block_scales).reshape(*scales.shape[:-1], -1)
    return values[..., :length].to(dtype), block_scales


fused_code_rows = CompiledKernel(code_rows)  # one kernel each (``compilation``), the same bits
fused_dequantize = CompiledKernel(dequantize)
