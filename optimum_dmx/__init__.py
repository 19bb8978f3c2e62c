"""optimum-dmx: differentiable mixed-precision assignment of OCP microscaling (MX) float formats.

Importing the package registers quant_method ``"dmx"`` with transformers, so that
``from_pretrained(..., quantization_config=DMXConfig(...))`` quantizes a float model and dMX checkpoints
load. (An installed package also registers itself when transformers' quantizer registry is first
imported; see ``optimum_dmx_autoregister``.) Importing it never loads the calibration machinery (the
trainer, tqdm, ``datasets``): that happens when a model is calibrated.

The package is layered, each layer importing only from the ones before it:
``formats`` -> ``continuous`` -> ``nn`` (and ``text``) -> ``calibration`` (and ``evaluation``) ->
``integration`` (and ``defaults``) -> ``cli``.
"""

from .continuous import FORMAT_PAIRS, FormatPair, get_format_pair, quantize_mx_continuous
from .formats import (
    MX_FORMATS,
    MXFormat,
    MXPackedTensor,
    get_format,
    pack_mx,
    quantize_mx,
    set_compile_enabled,
    unpack_mx,
)
from .integration.configuration import DMXConfig
from .integration.hf_quantizer import DMXHfQuantizer
from .integration.quantizer import DMXQuantizer
from .nn import MXLinear

__version__ = "0.1.0.dev0"

__all__ = [
    "FORMAT_PAIRS",
    "MX_FORMATS",
    "DMXConfig",
    "DMXHfQuantizer",
    "DMXQuantizer",
    "FormatPair",
    "MXFormat",
    "MXLinear",
    "MXPackedTensor",
    "get_format",
    "get_format_pair",
    "pack_mx",
    "quantize_mx",
    "quantize_mx_continuous",
    "set_compile_enabled",
    "unpack_mx",
]
