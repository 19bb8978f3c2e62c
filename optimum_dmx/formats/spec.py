"""The equations of an MX element format, and the table of OCP MX formats.

Every number that describes a float element format comes from one function here, and the exact cast, the
continuous (differentiable) quantizer and the fused calibration kernel all call them. The functions take
Python numbers or tensors alike, so the continuous quantizer can evaluate them at real-valued exponent bits
``e`` and mantissa bits ``m`` (see ``docs/method.md``):

    b = 2^(e-1) - 1                          exponent_bias
    emax = 2^(e-1)                           largest_exponent   (also the MX block-scale offset)
    e_min = 1 - b - m                        smallest_step_exponent
    qmax = (2 - (1 + r) 2^-m) 2^emax         max_normal         (r top codes reserved, e.g. E4M3's NaN)
    eta(x) = max(floor(log2|x|) - m, e_min)  grid_exponent      (the rounding step of x is 2^eta)

This module knows nothing about tensors' blocks, models or transformers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = [
    "FP32_EXPONENT_BIAS",
    "FP32_MANTISSA_BITS",
    "E8M0_BIAS",
    "E8M0_NAN",
    "MXFormat",
    "MX_FORMATS",
    "FORMAT_ALIASES",
    "get_format",
    "exponent_bias",
    "largest_exponent",
    "smallest_step_exponent",
    "max_normal",
    "grid_exponent",
    "packed_row_lengths",
    "packed_bits",
    "SCALE_RULES",
    "validate_scale_rule",
    "scale_rounding_bits",
]

# float32 bit layout: sign | 8 exponent bits (bias 127) | 23 mantissa bits.
FP32_EXPONENT_BIAS = 127
FP32_MANTISSA_BITS = 23
# E8M0 block scale: an unsigned biased exponent; 0xFF encodes NaN, there is no zero and no Inf.
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_EXPONENT_MIN, SCALE_EXPONENT_MAX = -127, 127  # the E8M0 range; 128 (0xFF - 127) is NaN
SCALE_BITS = 8

Number = TypeVar("Number", float, torch.Tensor)


def _exp2(x: Number) -> Number:
    return torch.exp2(x) if isinstance(x, torch.Tensor) else 2.0**x


def exponent_bias(ebits: Number) -> Number:
    """``b = 2^(e-1) - 1``: the IEEE-style bias of an ``e``-bit exponent field."""
    return _exp2(ebits - 1) - 1


def largest_exponent(ebits: Number) -> Number:
    """``emax = 2^(e-1)``: the exponent of the largest normal of the MX element types (no Inf/NaN exponent).

    It is also the offset that the MX block scale subtracts from the block maximum's exponent.
    """
    return _exp2(ebits - 1)


def smallest_step_exponent(ebits: Number, mbits: Number) -> Number:
    """``e_min = 1 - b - m``: the exponent of the subnormal grid step (the smallest representable step)."""
    return 1 - exponent_bias(ebits) - mbits


def max_normal(ebits: Number, mbits: Number, reserved_codes: Number = 0) -> Number:
    """``qmax = (2 - (1 + r) 2^-m) 2^emax``: the largest normal, with ``r`` top mantissa codes reserved.

    The MX types use every code for numbers (``r = 0``), except E4M3, whose all-ones code is NaN (``r = 1``:
    448 instead of 480). A real-valued ``r`` lets the continuous quantizer move between the two.
    """
    return (2 - (1 + reserved_codes) * _exp2(-mbits)) * _exp2(largest_exponent(ebits))


def grid_exponent(floor_log2: torch.Tensor, mbits: Number, step_exponent_min: Number) -> torch.Tensor:
    """``eta = max(floor(log2|x|) - m, e_min)``: the exponent of the rounding step of each element.

    Normal elements keep ``m`` mantissa bits below their leading bit; subnormal ones share the smallest step.
    Real-valued (the continuous quantizer) it is written with ``where``, so that under autograd a tie passes its
    gradient to ``floor(log2|x|) - m``; integer-valued with ``clamp``: inductor's AVX2 C++ code (torch 2.13) selects
    the wrong side of an int32 ``where``, which made the compiled casts return unrounded values on AVX2 CPUs.
    """
    normal = floor_log2 - mbits
    if not normal.is_floating_point():
        return normal.clamp(min=step_exponent_min)
    return torch.where(normal >= step_exponent_min, normal, step_exponent_min)


def packed_row_lengths(length: int, element_bits: int, block_size: int) -> tuple[int, int]:
    """Bytes of element codes and number of E8M0 scales that store one row of ``length`` elements.

    The row is padded to whole blocks, and its codes to whole bytes (FP6 packs four codes in three bytes).
    """
    n_blocks = -(-length // block_size)
    codes_per_group, bytes_per_group = PACKING[element_bits]
    return -(-n_blocks * block_size // codes_per_group) * bytes_per_group, n_blocks


def packed_bits(shape: Sequence[int], element_bits: int, block_size: int) -> int:
    """Bits that storing a tensor of ``shape`` takes: padded element codes plus one E8M0 scale per block."""
    *leading, last = shape
    code_bytes, n_blocks = packed_row_lengths(last, element_bits, block_size)
    return math.prod(leading) * (code_bytes * 8 + n_blocks * SCALE_BITS)


# How the E8M0 block scale is derived from the block maximum. "ocp": the OCP MX v1.0 rule,
# floor(log2 max|block|) - emax. The others round the block maximum up to the next power of two first when its
# mantissa is at least 2 - 2^-(r+1), so that it does not saturate: compressed-tensors' rule (r = 3 for E2M3,
# else 1; also vLLM's reference) and AMD Quark's "even" rule (r = the element's own mantissa bits).
SCALE_RULES = ("ocp", "compressed-tensors", "quark")


def validate_scale_rule(rule: str) -> str:
    """Return ``rule`` if it names a block-scale rule, else raise naming the allowed ones."""
    if rule not in SCALE_RULES:
        raise ValueError(f"scale_rule={rule!r} is not supported; allowed: {', '.join(SCALE_RULES)}.")
    return rule


def scale_rounding_bits(rule: str, ebits: Number, mbits: Number) -> Number | None:
    """``r``: the mantissa width to which ``rule`` rounds the block maximum before taking its exponent.

    ``None`` for the OCP rule (no rounding: ``floor``). Real-valued ``ebits``/``mbits`` (the continuous quantizer)
    give a real ``r`` that meets the integer formats' values at their endpoints.
    """
    validate_scale_rule(rule)
    if rule == "ocp":
        return None
    if rule == "quark":
        return mbits
    # compressed-tensors: E2M3's own 3 mantissa bits, 1 for every other format (E2M1, E4M3).
    if isinstance(ebits, torch.Tensor) or isinstance(mbits, torch.Tensor):
        return torch.where(torch.as_tensor(ebits) == 2, torch.as_tensor(mbits, dtype=torch.float32), 1.0)
    return mbits if ebits == 2 else 1


# element bits -> (codes per packed group, bytes per packed group)
PACKING = {8: (1, 1), 6: (4, 3), 4: (2, 1)}


@dataclass(frozen=True)
class MXFormat:
    """One MX element format: a sign bit, ``ebits`` exponent bits and ``mbits`` mantissa bits.

    ``reserved_codes`` counts the top mantissa codes of the largest exponent that are not numbers (E4M3: its
    all-ones code is NaN). The other numbers follow from the functions above.
    """

    name: str
    ebits: int
    mbits: int
    reserved_codes: int = 0

    @property
    def bits(self) -> int:
        """Element bits, sign included (the shared scale is not counted)."""
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        return int(exponent_bias(self.ebits))

    @property
    def emax(self) -> int:
        """Exponent of the largest normal; the block scale subtracts it from the block maximum's exponent."""
        return int(largest_exponent(self.ebits))

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal; subnormals share it with a step of ``2^(emin - mbits)``."""
        return 1 - self.bias

    @property
    def step_exponent_min(self) -> int:
        """Exponent of the subnormal step, ``emin - mbits``."""
        return int(smallest_step_exponent(self.ebits, self.mbits))

    @property
    def max_normal(self) -> float:
        return float(max_normal(self.ebits, self.mbits, self.reserved_codes))

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0**self.step_exponent_min

    def storage_bits(self, block_size: int = 32) -> float:
        """Bits per element in storage: the element code plus its share of the 8-bit E8M0 scale."""
        return packed_bits((1, block_size), self.bits, validate_block_size(block_size)) / block_size

    def __str__(self) -> str:
        return self.name


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
        MXFormat("mxfp8_e4m3", ebits=4, mbits=3, reserved_codes=1),
        MXFormat("mxfp6_e3m2", ebits=3, mbits=2),
        MXFormat("mxfp6_e2m3", ebits=2, mbits=3),
        MXFormat("mxfp4_e2m1", ebits=2, mbits=1),
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
    """``block_size`` if it is a positive integer; otherwise a ``ValueError`` naming it."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer (32 for OCP MX), got {block_size!r}.")
    return block_size
