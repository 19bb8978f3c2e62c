"""optimum-dmx: differentiable mixed-precision assignment of OCP microscaling (MX) float formats.

Importing the package registers quant_method ``"dmx"`` with transformers, so that
``from_pretrained(..., quantization_config=DMXConfig(...))`` quantizes a float model and dMX checkpoints
load: at once if transformers' quantizer registry (``transformers.quantizers.auto``) is already imported,
otherwise the moment it is (the finder of ``optimum_dmx_autoregister``, which an installed package also puts in
place at interpreter start-up). The names below load on first use (PEP 562), so ``import optimum_dmx`` imports
neither torch nor transformers, and the ``optimum-dmx`` command answers ``--help`` and usage errors without them.
Nothing here loads the calibration machinery (the trainer, tqdm, ``datasets``): that happens when a model is
calibrated.

The package is layered, each layer importing only from the ones before it:
``formats`` -> ``continuous`` -> ``nn`` (and ``text``) -> ``calibration`` (and ``evaluation``) ->
``integration`` (and ``defaults``) -> ``cli``.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

import optimum_dmx_autoregister

from .lazy import lazy_exports

__version__ = "0.1.0.dev0"

if TYPE_CHECKING:  # what type checkers and editors see; the names load on first use (`__getattr__`)
    from .continuous import FORMAT_PAIRS as FORMAT_PAIRS
    from .continuous import FormatPair as FormatPair
    from .continuous import get_format_pair as get_format_pair
    from .continuous import quantize_mx_continuous as quantize_mx_continuous
    from .formats import MX_FORMATS as MX_FORMATS
    from .formats import MXFormat as MXFormat
    from .formats import MXPackedTensor as MXPackedTensor
    from .formats import get_format as get_format
    from .formats import pack_mx as pack_mx
    from .formats import quantize_mx as quantize_mx
    from .formats import set_compile_enabled as set_compile_enabled
    from .formats import unpack_mx as unpack_mx
    from .integration.configuration import DMXConfig as DMXConfig
    from .integration.hf_quantizer import DMXHfQuantizer as DMXHfQuantizer
    from .integration.quantizer import DMXQuantizer as DMXQuantizer
    from .nn import MXLinear as MXLinear

_EXPORTS = {
    "FORMAT_PAIRS": "continuous",
    "FormatPair": "continuous",
    "get_format_pair": "continuous",
    "quantize_mx_continuous": "continuous",
    "MX_FORMATS": "formats",
    "MXFormat": "formats",
    "MXPackedTensor": "formats",
    "get_format": "formats",
    "pack_mx": "formats",
    "quantize_mx": "formats",
    "set_compile_enabled": "formats",
    "unpack_mx": "formats",
    "DMXConfig": "integration.configuration",
    "DMXHfQuantizer": "integration.hf_quantizer",
    "DMXQuantizer": "integration.quantizer",
    "MXLinear": "nn",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if optimum_dmx_autoregister.TRIGGER in sys.modules:
    importlib.import_module(optimum_dmx_autoregister.REGISTRAR)  # its import registers quant_method "dmx"
else:
    optimum_dmx_autoregister.install(at_startup=False)
