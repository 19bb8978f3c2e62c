"""Inference modules and model surgery: `MXLinear`, which linears to quantize, swapping them in and out, and
the bit accounting of a format assignment. Nothing here trains or reads data."""

from .bits import BIT_AVERAGES, average_bits, bit_summary, format_map_bits, storage_bits, tensor_sizes
from .experts import LinearExperts, linearizable_experts, linearize_experts, packed_weight_modules
from .input_cache import InputCache
from .mx_linear import MXLinear
from .surgery import (
    dequantize_mx_linears,
    emulate_format_map,
    linear_modules_to_quantize,
    replace_with_mx_linear,
    swapped_modules,
)

__all__ = [
    "BIT_AVERAGES",
    "InputCache",
    "LinearExperts",
    "MXLinear",
    "average_bits",
    "bit_summary",
    "dequantize_mx_linears",
    "emulate_format_map",
    "format_map_bits",
    "linear_modules_to_quantize",
    "linearizable_experts",
    "linearize_experts",
    "packed_weight_modules",
    "replace_with_mx_linear",
    "storage_bits",
    "swapped_modules",
    "tensor_sizes",
]
