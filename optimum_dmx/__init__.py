"""optimum-dmx: differentiable mixed-precision assignment of OCP microscaling (MX) float formats.

Importing the package registers quant_method ``"dmx"`` with transformers, so that
``from_pretrained(..., quantization_config=DMXConfig(...))`` quantizes and dMX checkpoints load.
"""

from .configuration import DMXConfig
from .formats import MX_FORMATS, pack_mx, quantize_mx, unpack_mx
from .hf_quantizer import DMXHfQuantizer
from .modules import MXLinear
from .quantizer import DMXQuantizer

__version__ = "0.1.0.dev0"

__all__ = [
    "MX_FORMATS",
    "DMXConfig",
    "DMXHfQuantizer",
    "DMXQuantizer",
    "MXLinear",
    "pack_mx",
    "quantize_mx",
    "unpack_mx",
]
