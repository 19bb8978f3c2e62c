"""Which transformers class builds a model dMX quantizes or loads: the generating model of its configuration."""

from __future__ import annotations

from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
)


def generating_model_class(config: PretrainedConfig) -> type[AutoModelForCausalLM | AutoModelForImageTextToText]:
    """The Auto class whose `from_pretrained` builds `config`'s generating model: `AutoModelForCausalLM`, or
    `AutoModelForImageTextToText` for an image-text model transformers has no causal-LM class for (Llava, Qwen2-VL,
    Idefics3; Gemma 3 has one). Both compute the language-modelling loss calibration needs from text alone. Any other
    configuration gets `AutoModelForCausalLM`, whose error names the configurations it builds."""
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
