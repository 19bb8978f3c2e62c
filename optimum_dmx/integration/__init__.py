"""The Hugging Face side of dMX: `DMXConfig`, the transformers quantizer hooks, optimum's quantizer and the
model card. Everything below this layer knows nothing about the Hub or `from_pretrained`.

The names below load on first use (`optimum_dmx.lazy`): `optimum-dmx inspect` reads a folder with the model card's
helpers without importing transformers' quantizer registry. The package's import (`optimum_dmx`) makes sure
quant_method "dmx" is registered whenever that registry is imported.
"""

from __future__ import annotations

from ..lazy import lazy_exports

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
