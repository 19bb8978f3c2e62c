"""The Hugging Face side of dMX: `DMXConfig`, the transformers quantizer hooks, optimum's quantizer and the
model card. Everything below this layer knows nothing about the Hub or `from_pretrained`."""

from .configuration import QUANT_METHOD, DMXConfig
from .hf_quantizer import DMXHfQuantizer
from .model_card import ModelCardInfo, PerplexityComparison, checkpoint_bytes, write_model_card
from .quantizer import DMXQuantizer

__all__ = [
    "QUANT_METHOD",
    "DMXConfig",
    "DMXHfQuantizer",
    "DMXQuantizer",
    "ModelCardInfo",
    "PerplexityComparison",
    "checkpoint_bytes",
    "write_model_card",
]
