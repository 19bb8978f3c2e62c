"""OCP Microscaling (MX) v1.0 float formats: the format equations, exact quantize-dequantize, E8M0 block
scales and bit packing.

* ``spec``: the equations of an element format (bias, largest exponent, grid step, largest normal, stored
  bits) and the table ``MX_FORMATS``;
* ``blocks``: blocks along the last dimension and their shared E8M0 scales;
* ``cast``: ``quantize_mx``, bit-exact with the specification;
* ``compilation``: the casts compiled into fused kernels by inductor, with the eager path as fallback
  (``set_compile_enabled``, ``$OPTIMUM_DMX_COMPILE``; ``kernel_setup_seconds``: the time their first calls took);
* ``packing``: ``pack_mx`` / ``unpack_mx``, the uint8 storage form.

This package knows nothing about models or transformers.
"""

from .cast import quantize_mx
from .compilation import compile_enabled, kernel_setup_seconds, set_compile_enabled
from .packing import MXPackedTensor, pack_mx, packed_shapes, unpack_mx
from .spec import E8M0_BIAS, E8M0_NAN, FORMAT_ALIASES, MX_FORMATS, SCALE_RULES, MXFormat, get_format

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "FORMAT_ALIASES",
    "MX_FORMATS",
    "MXFormat",
    "MXPackedTensor",
    "SCALE_RULES",
    "compile_enabled",
    "get_format",
    "kernel_setup_seconds",
    "pack_mx",
    "packed_shapes",
    "quantize_mx",
    "set_compile_enabled",
    "unpack_mx",
]
