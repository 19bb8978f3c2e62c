"""optimum-dmx: differentiable mixed-precision assignment of OCP microscaling (MX) float formats."""

from .continuous import FORMAT_PAIRS, FormatPair, get_format_pair, quantize_mx_continuous
from .formats import MX_FORMATS, MXFormat, MXPackedTensor, get_format, pack_mx, quantize_mx, unpack_mx

__version__ = "0.1.0.dev0"

__all__ = [
    "FORMAT_PAIRS",
    "MX_FORMATS",
    "FormatPair",
    "MXFormat",
    "MXPackedTensor",
    "get_format",
    "get_format_pair",
    "pack_mx",
    "quantize_mx",
    "quantize_mx_continuous",
    "unpack_mx",
]
