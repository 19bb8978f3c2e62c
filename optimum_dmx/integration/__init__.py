"""The Hugging Face side of dMX: `DMXConfig`, the transformers quantizer hooks, optimum's quantizer and the
model card. Everything below this layer knows nothing about the Hub or `from_pretrained`.

The names below load on first use (`optimum_dmx.lazy`): `optimum-dmx inspect` reads a folder with the model card's
helpers without importing transformers' quantizer registry. The package's import (`optimum_dmx`) makes sure
quant_method "dmx" is registered whenever that registry is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and editors see; the names load on first use (`__getattr__`)
    from .configuration import QUANT_METHOD as QUANT_METHOD
    from .configuration import DMXConfig as DMXConfig
    from .hf_quantizer import DMXHfQuantizer as DMXHfQuantizer
    from .model_card import ModelCardInfo as ModelCardInfo
    from .model_card import PerplexityComparison as PerplexityComparison
    from .model_card import checkpoint_bytes as checkpoint_bytes
    from .model_card import write_model_card as write_model_card
    from .quantizer import DMXQuantizer as DMXQuantizer

_EXPORTS = {
    "QUANT_METHOD": "configuration",
    "DMXConfig": "configuration",
    "DMXHfQuantizer": "hf_quantizer",
    "DMXQuantizer": "quantizer",
    "ModelCardInfo": "model_card",
    "PerplexityComparison": "model_card",
    "checkpoint_bytes": "model_card",
    "write_model_card": "model_card",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
