"""The continuous (differentiable) MX quantizer that dMX trains through, and the format pairs it moves along.

* ``pairs``: ``FormatPair`` / ``FORMAT_PAIRS``: one offset ``beta`` in [0, 2] -> exponent bits, mantissa bits,
  largest normal and element bits;
* ``reference``: ``quantize_mx_continuous``, the autograd reference;
* ``fused``: ``quantize_mx_continuous_fused``, the same values with closed-form gradients (what calibration
  runs), ``ContinuousQuantization``, one such quantization computed once and attached to the graph many times,
  and ``FrozenWeightQuantization``, a frozen weight's quantization kept compactly for a whole run.

At the integer endpoints of a pair both equal the exact ``quantize_mx`` bit for bit. This package knows
nothing about models or transformers.
"""

from .fused import ContinuousQuantization, FrozenWeightQuantization, quantize_mx_continuous_fused, weight_block_max
from .pairs import FORMAT_PAIRS, MAX_OFFSET, FormatPair, get_format_pair
from .reference import float_quantize, quantize_mx_continuous

__all__ = [
    "ContinuousQuantization",
    "FORMAT_PAIRS",
    "MAX_OFFSET",
    "FormatPair",
    "FrozenWeightQuantization",
    "float_quantize",
    "get_format_pair",
    "quantize_mx_continuous",
    "quantize_mx_continuous_fused",
    "weight_block_max",
]
