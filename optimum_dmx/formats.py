"""OCP Microscaling (MX) v1.0 float formats: exact quantize-dequantize, E8M0 block scales, bit packing.

A block of ``block_size`` consecutive elements along the last dimension shares one power-of-two scale
``X = 2^k`` stored as an E8M0 byte (``k + 127``), with ``k = floor(log2(max|block|)) - emax`` clamped to
[-127, 127]. Each element ``x / X`` is rounded to the element format (round-half-to-even, IEEE-style
subnormals) and saturated to the format's largest normal. An all-zero block stays zero; a block that holds
a NaN or an Inf becomes all NaN (scale byte 0xFF). A last dimension that is not a multiple of the block
size is zero-padded inside the last block.

The arithmetic works on the float32 bit pattern (exponent fields, power-of-two scales built from bits), so
every step is exact and the result is bit-identical to a reference implementation of the specification.
This module knows nothing about models or transformers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MXFormat",
    "MX_FORMATS",
    "FORMAT_ALIASES",
    "get_format",
    "quantize_mx",
    "MXPackedTensor",
    "pack_mx",
    "unpack_mx",
    "packed_shapes",
    "E8M0_NAN",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP32_MANTISSA_BITS = 23
_FP32_EXPONENT_MASK = 0x7F800000


@dataclass(frozen=True)
class MXFormat:
    """One MX element format: a sign bit, ``ebits`` exponent bits and ``mbits`` mantissa bits.

    ``emax`` is the exponent of the largest normal (the offset subtracted from the block maximum's exponent
    to form the shared scale) and ``max_normal`` the saturation bound. The MX types have no Inf; E4M3 also
    reserves its all-ones code for NaN, which is why its largest normal is 448 and not 480.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int
    max_normal: float

    @property
    def bits(self) -> int:
        """Element bits, sign included (the shared scale is not counted)."""
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal; subnormals share it with a step of ``2^(emin - mbits)``."""
        return 1 - self.bias

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    def storage_bits(self, block_size: int = 32) -> float:
        """Bits per element in storage: the element code plus its share of the 8-bit E8M0 scale."""
        return self.bits + 8 / validate_block_size(block_size)

    def __str__(self) -> str:
        return self.name


def _element_format(name: str, ebits: int, mbits: int, max_normal: float | None = None) -> MXFormat:
    bias = 2 ** (ebits - 1) - 1
    emax = 2 ** (ebits - 1)
    if max_normal is None:
        max_normal = (2 - 2.0**-mbits) * 2.0**emax
    return MXFormat(name=name, ebits=ebits, mbits=mbits, bias=bias, emax=emax, max_normal=max_normal)


class _FormatTable(Mapping[str, MXFormat]):
    """Read-only mapping of canonical format names that also resolves the short aliases on lookup."""

    def __init__(self, formats: Sequence[MXFormat], aliases: Mapping[str, str]):
        self._formats = {fmt.name: fmt for fmt in formats}
        self._aliases = dict(aliases)

    def __getitem__(self, name: str) -> MXFormat:
        return self._formats[self._aliases.get(name, name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._aliases.get(name, name) in self._formats

    def __iter__(self) -> Iterator[str]:
        return iter(self._formats)

    def __len__(self) -> int:
        return len(self._formats)

    def __repr__(self) -> str:
        return f"MX_FORMATS({', '.join(self._formats)}; aliases {self._aliases})"


FORMAT_ALIASES: Mapping[str, str] = {"mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3", "mxfp4": "mxfp4_e2m1"}

MX_FORMATS: Mapping[str, MXFormat] = _FormatTable(
    [
        _element_format("mxfp8_e4m3", ebits=4, mbits=3, max_normal=448.0),
        _element_format("mxfp6_e3m2", ebits=3, mbits=2),
        _element_format("mxfp6_e2m3", ebits=2, mbits=3),
        _element_format("mxfp4_e2m1", ebits=2, mbits=1),
    ],
    FORMAT_ALIASES,
)


def get_format(fmt: str | MXFormat) -> MXFormat:
    """Resolve a canonical name (``"mxfp6_e3m2"``), an alias (``"mxfp4"``) or an ``MXFormat`` to an ``MXFormat``."""
    if isinstance(fmt, MXFormat):
        return fmt
    if isinstance(fmt, str) and fmt in MX_FORMATS:
        return MX_FORMATS[fmt]
    allowed = ", ".join([*MX_FORMATS, *FORMAT_ALIASES])
    raise ValueError(f"Unknown MX format {fmt!r}. Allowed: {allowed}.")


def validate_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer (32 for OCP MX), got {block_size!r}.")
    return block_size


def validate_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Expected a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"MX quantization takes a floating-point tensor ({allowed}), got dtype {x.dtype}.")
    if x.dim() == 0:
        raise ValueError("MX quantization needs at least one dimension to form blocks; got a 0-dim tensor.")


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2^exponent`` for integer exponents in [-126, 127], built from the bit pattern."""
    return ((exponent + 127) << _FP32_MANTISSA_BITS).view(torch.float32)


def to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 view of ``x`` as ``[*leading, n_blocks, block_size]``, zero-padding the last block."""
    x = x.float()
    pad = -x.shape[-1] % block_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block_size)


def block_max_exponent(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``floor(log2(max|block|))`` per block (int32, ``[..., n_blocks, 1]``) and a mask of finite blocks.

    The exponent is read from the float32 exponent field, so it is exact; a zero or fp32-subnormal block
    maximum reads as -127, which the [-127, 127] clamp of the shared exponent absorbs.
    """
    low, high = torch.aminmax(blocks, dim=-1, keepdim=True)
    amax = torch.maximum(high, -low)
    floor_log2 = ((amax.view(torch.int32) >> _FP32_MANTISSA_BITS) & 0xFF) - 127
    return floor_log2, torch.isfinite(amax)


def _shared_exponents(blocks: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Unbiased shared exponent ``k`` per block (int32, ``[..., n_blocks, 1]``); NaN/Inf blocks get 128."""
    floor_log2, finite = block_max_exponent(blocks)
    k = (floor_log2 - fmt.emax).clamp_(-127, 127)
    return k.masked_fill_(~finite, E8M0_NAN - E8M0_BIAS)


def _block_scale(k: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """``2^(k + shift)`` as float32 (``ldexp``, since ``2^-127`` is an fp32 subnormal); NaN for NaN blocks."""
    scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k.clamp(max=127) + shift)
    return scale.masked_fill_(k > 127, math.nan)


def _float8_carrier(fmt: MXFormat) -> tuple[torch.dtype, int] | None:
    """A native float8 dtype that rounds exactly like ``fmt`` once values are scaled by ``2^-shift``.

    A float8 type with the same mantissa width rounds identically (half to even, subnormals included) when
    its smallest normal is aligned with ``fmt``'s, which a power-of-two shift does: E4M3 carries MXFP8 E4M3
    (shift 0) and MXFP6 E2M3 (shift 6), E5M2 carries MXFP6 E3M2 (shift 12). E2M1 has no float8 carrier.
    """
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        info = torch.finfo(dtype)
        if round(-math.log2(info.eps)) == fmt.mbits:
            shift = fmt.emin - round(math.log2(info.smallest_normal))
            if fmt.max_normal * 2.0**-shift <= info.max:
                return dtype, shift
    return None


def _round_elements(v: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Round block-scaled elements to ``fmt`` in place: RNE to the element grid, then saturate."""
    # Grid step of each element: 2^(max(floor(log2|v|), emin) - mbits), from the exponent field.
    exponent_field = (v.view(torch.int32) & _FP32_EXPONENT_MASK).clamp_(min=(fmt.emin + 127) << 23)
    step = exponent_field.sub_(fmt.mbits << _FP32_MANTISSA_BITS).view(torch.float32)
    return v.div_(step).round_().mul_(step).clamp_(-fmt.max_normal, fmt.max_normal)


def _quantize_blocks(blocks: torch.Tensor, fmt: MXFormat) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Round blocks to ``fmt``: elements in units of ``2^-shift`` element units, shared exponents, ``shift``.

    The value of an element is ``elements * 2^(k + shift)``. With a float8 carrier (``shift`` may be non-zero)
    the rounding is one native cast; otherwise it is done on the float32 bit pattern (``shift`` 0).
    """
    k = _shared_exponents(blocks, fmt)
    carrier = _float8_carrier(fmt)
    # The carrier's output scale 2^(k + shift) must stay a finite float32: true unless amax >= ~2^120.
    if carrier is not None and int(k.masked_fill(k > 127, -127).max()) + carrier[1] <= 127:
        dtype, shift = carrier
        bound = fmt.max_normal * 2.0**-shift
        scaled = blocks * _block_scale(-k.clamp(max=127), -shift)
        rounded = scaled.clamp_(-bound, bound).to(dtype)
        return scaled.copy_(rounded), k, shift  # reuse the float32 buffer: cheaper than a new allocation
    # 1 / 2^k for k in [-127, 125] is a normal float32; NaN blocks are fixed by their NaN scale later.
    return _round_elements(blocks * _pow2(-k.clamp(max=125)), fmt), k, 0


def quantize_mx(x: torch.Tensor, fmt: str | MXFormat, block_size: int = 32) -> torch.Tensor:
    """Quantize-dequantize ``x`` to an MX format along its last dimension.

    Args:
        x: float32, bfloat16 or float16 tensor of any shape; blocks run along the last dimension.
        fmt: an ``MXFormat`` or one of the names in ``MX_FORMATS`` (aliases ``mxfp8``, ``mxfp6``, ``mxfp4``).
        block_size: elements per shared scale (32 in the OCP specification).

    Returns:
        A tensor of the same shape and dtype holding the MX-representable values.
    """
    fmt = get_format(fmt)
    block_size = validate_block_size(block_size)
    validate_input(x)
    elements, k, shift = _quantize_blocks(to_blocks(x, block_size), fmt)
    y = elements.mul_(_block_scale(k, shift))
    return y.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]].to(x.dtype)


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


def packed_shapes(
    shape: Sequence[int], fmt: str | MXFormat, block_size: int = 32
) -> tuple[torch.Size, torch.Size]:
    """Shapes of ``(codes, scales)`` that ``pack_mx`` produces for a tensor of ``shape``."""
    fmt = get_format(fmt)
    block_size = validate_block_size(block_size)
    *leading, last = shape
    n_blocks = -(-last // block_size)
    codes_per_group, bytes_per_group = _PACKING[fmt.bits]
    n_groups = -(-n_blocks * block_size // codes_per_group)
    return torch.Size([*leading, n_groups * bytes_per_group]), torch.Size([*leading, n_blocks])


# element bits -> (codes per group, bytes per group)
_PACKING = {8: (1, 1), 6: (4, 3), 4: (2, 1)}


def _element_codes(elements: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Sign-magnitude codes ``S|E|M`` (int32) of element values that lie on the ``fmt`` grid."""
    magnitude = elements.abs()
    bits = magnitude.view(torch.int32)
    # A normal value's float32 pattern shifted right keeps (biased exponent, top mantissa bits);
    # re-biasing the exponent from 127 to fmt.bias gives the element code.
    normal = (bits >> (_FP32_MANTISSA_BITS - fmt.mbits)) - ((127 - fmt.bias) << fmt.mbits)
    subnormal = (magnitude * 2.0 ** (fmt.mbits - fmt.emin)).to(torch.int32)
    codes = torch.where(magnitude >= fmt.min_normal, normal, subnormal)
    sign = torch.signbit(elements).to(torch.int32) << (fmt.ebits + fmt.mbits)
    return codes | sign


def _code_values(fmt: MXFormat) -> torch.Tensor:
    """float32 value of every code of ``fmt`` (a lookup table of 2^bits entries)."""
    codes = torch.arange(2**fmt.bits, dtype=torch.int32)
    mantissa = (codes & (2**fmt.mbits - 1)).float()
    exponent = (codes >> fmt.mbits) & (2**fmt.ebits - 1)
    normal = (1 + mantissa / 2**fmt.mbits) * torch.exp2((exponent - fmt.bias).float())
    values = torch.where(exponent > 0, normal, mantissa * fmt.min_subnormal)
    sign = (codes >> (fmt.ebits + fmt.mbits)) & 1
    return torch.where(sign.bool(), -values, values)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int codes ``[..., n]`` (n a multiple of the group size) into uint8 bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        pairs = codes.reshape(*codes.shape[:-1], -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    # FP6: 4 codes (24 bits) -> 3 bytes, little-endian: c0 | c1 << 6 | c2 << 12 | c3 << 18.
    quads = codes.reshape(*codes.shape[:-1], -1, 4)
    word = quads[..., 0] | (quads[..., 1] << 6) | (quads[..., 2] << 12) | (quads[..., 3] << 18)
    packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return packed.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_pack_codes``: uint8 bytes -> int64 codes ``[..., n]``."""
    data = packed.long()
    if bits == 8:
        return data
    if bits == 4:
        return torch.stack([data & 0xF, data >> 4], dim=-1).reshape(*data.shape[:-1], -1)
    triples = data.reshape(*data.shape[:-1], -1, 3)
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    codes = torch.stack([(word >> shift) & 0x3F for shift in (0, 6, 12, 18)], dim=-1)
    return codes.reshape(*data.shape[:-1], -1)


def pack_mx(x: torch.Tensor, fmt: str | MXFormat, block_size: int = 32) -> MXPackedTensor:
    """Quantize ``x`` to an MX format along its last dimension and return its storage form.

    ``unpack_mx(pack_mx(x, fmt))`` equals ``quantize_mx(x, fmt)`` bit for bit (in float32).
    """
    fmt = get_format(fmt)
    block_size = validate_block_size(block_size)
    validate_input(x)
    elements, k, shift = _quantize_blocks(to_blocks(x, block_size), fmt)
    codes = _element_codes(elements * 2.0**shift, fmt).masked_fill_(k > 127, 0)
    codes = codes.reshape(*x.shape[:-1], -1)
    codes_shape, _ = packed_shapes(x.shape, fmt, block_size)
    codes = torch.nn.functional.pad(codes, (0, codes_shape[-1] * 8 // fmt.bits - codes.shape[-1]))
    scales = (k.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
    return MXPackedTensor(_pack_codes(codes, fmt.bits), scales, fmt, x.shape, block_size)


def unpack_mx(packed: MXPackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize an ``MXPackedTensor`` to ``dtype`` with its original shape."""
    fmt, block_size = packed.fmt, packed.block_size
    codes_shape, scales_shape = packed_shapes(packed.shape, fmt, block_size)
    if packed.codes.shape != codes_shape or packed.scales.shape != scales_shape:
        raise ValueError(
            f"Packed {fmt.name} tensor of shape {tuple(packed.shape)} needs codes {tuple(codes_shape)} and "
            f"scales {tuple(scales_shape)}, got {tuple(packed.codes.shape)} and {tuple(packed.scales.shape)}."
        )
    codes = _unpack_codes(packed.codes, fmt.bits)[..., : scales_shape[-1] * block_size]
    elements = _code_values(fmt).to(packed.codes.device)[codes]
    elements = elements.reshape(*scales_shape, block_size)
    k = packed.scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS
    values = elements.mul_(_block_scale(k)).reshape(*scales_shape[:-1], -1)
    return values[..., : packed.shape[-1]].to(dtype)
