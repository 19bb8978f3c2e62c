"""Format pairs: a low and a high MX format joined by one real-valued offset ``beta`` in [0, 2].

``beta`` sets real-valued exponent bits ``e`` and mantissa bits ``m``; at integer ``beta`` the pair hits
real MX formats. The MXFP8 pair walks E2M1 -> E3M2 -> E4M3 (``e = 2 + beta``, ``m = 1 + beta``, ``4 + 2 beta``
bits), the MXFP6 pair E2M1 -> E2M3 (``e = 2``, ``m = 1 + beta``, ``4 + beta`` bits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..formats.spec import (
    MX_FORMATS,
    MXFormat,
    Number,
    get_format,
    largest_exponent,
    max_normal,
    scale_rounding_bits,
    smallest_step_exponent,
)

__all__ = ["FormatPair", "FORMAT_PAIRS", "get_format_pair", "MAX_OFFSET"]

MAX_OFFSET = 2.0  # beta runs over [0, MAX_OFFSET]: the low format at 0, the high one at 2


@dataclass(frozen=True)
class FormatPair:
    """A low and a high MX format joined by one offset ``beta`` in [0, 2].

    ``e = low.ebits + exponent_slope * beta`` and ``m = low.mbits + beta``: the MXFP8 pair moves both
    (``exponent_slope=1``), the MXFP6 pair only the mantissa (``exponent_slope=0``).
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

    def exponent_bits(self, beta: Number) -> Number:
        return self.low.ebits + self.exponent_slope * beta

    def mantissa_bits(self, beta: Number) -> Number:
        return self.low.mbits + beta

    def element_bits(self, beta: Number) -> Number:
        """Bits per element at ``beta`` (the shared scale excluded): ``4 + 2 beta`` or ``4 + beta``."""
        return self.low.bits + (1 + self.exponent_slope) * beta

    def scale_offset(self, beta: Number) -> Number:
        """``emax(e) = 2^(e-1)``: what the block scale subtracts from the block maximum's exponent."""
        return largest_exponent(self.exponent_bits(beta))

    def scale_rounding_bits(self, beta: Number, scale_rule: str) -> Number | None:
        """The block-scale rule's rounding width ``r`` at ``beta`` (``formats.spec.scale_rounding_bits``)."""
        return scale_rounding_bits(scale_rule, self.exponent_bits(beta), self.mantissa_bits(beta))

    def step_exponent_min(self, beta: Number) -> Number:
        """``e_min = 1 - b - m`` at ``beta``: the exponent of the subnormal grid step."""
        return smallest_step_exponent(self.exponent_bits(beta), self.mantissa_bits(beta))

    def max_normal(self, beta: Number) -> torch.Tensor:
        """Saturation bound at ``beta``, exact at every integer endpoint.

        When the high format reserves its top mantissa codes (E4M3's NaN), they are taken away gradually as beta
        goes from 1 to 2, so the bound ends at 448 instead of 480.
        """
        beta = torch.as_tensor(beta)
        reserved = self.high.reserved_codes * torch.clamp(beta - (MAX_OFFSET - 1), min=0)
        return max_normal(self.exponent_bits(beta), self.mantissa_bits(beta), reserved)

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
    raise ValueError(f"format_pair={pair!r} is not supported; allowed: {', '.join(FORMAT_PAIRS)}.")
