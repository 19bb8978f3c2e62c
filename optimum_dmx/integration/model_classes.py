"""Which transformers class builds a model dMX quantizes or loads, and which models it can calibrate."""

from __future__ import annotations

from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    PretrainedConfig,
)
from transformers.models.auto import modeling_auto

# The mappings of transformers' Auto classes whose models predict the next token of text (with images or not).
_GENERATING = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
)
# Mappings that say nothing of the loss: transformers lists decoder-only audio-text models (Qwen2-Audio, Voxtral)
# among its sequence-to-sequence ones; an encoder-decoder model is told by its configuration instead.
_NOT_A_TASK = (
    "CONFIG_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
)
ENCODER_DECODER = "sequence-to-sequence generation (an encoder-decoder model)"


def generating_model_class(
    config: PretrainedConfig,
) -> type[AutoModelForCausalLM | AutoModelForImageTextToText | AutoModelForSeq2SeqLM]:
    """The Auto class whose `from_pretrained` builds `config`'s generating model: `AutoModelForCausalLM`;
    `AutoModelForImageTextToText` for an image-text model transformers has no causal-LM class for (Llava, Qwen2-VL,
    Idefics3; Gemma 3 has one); `AutoModelForSeq2SeqLM` for a decoder-only audio-text model transformers lists among
    its sequence-to-sequence ones (Qwen2-Audio, Voxtral). Each computes the language-modelling loss calibration needs
    from text alone. Any other configuration gets `AutoModelForCausalLM`, whose error names the configurations it
    builds."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    if type(config) in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING and not getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM


# Tasks a refused model's class may be built for, most specific first, as error messages name them; the other
# mappings of transformers' Auto classes come after these, named after their constant.
_TASKS = {
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": "masked language modelling",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": "sequence classification",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": "token classification",
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": "question answering",
}
_LAST = {"MODEL_FOR_PRETRAINING_MAPPING_NAMES": "pretraining", "MODEL_MAPPING_NAMES": "hidden states (no head)"}


def other_task(model: nn.Module) -> str | None:
    """What transformers builds `model`'s class for when that is not predicting the next token of text (`"sequence
    classification"`, `"hidden states (no head)"`, `ENCODER_DECODER`), else `None`: a causal, image-text or multimodal
    language model, or a class transformers does not name (remote code, a model of the caller's), which calibration
    takes as it is. Subclasses count as their transformers class (FSDP2 wraps a sharded model's class)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return ENCODER_DECODER
    mappings = {name: getattr(modeling_auto, name) for name in dir(modeling_auto) if name.endswith("_MAPPING_NAMES")}
    classes = {cls.__name__ for cls in type(model).__mro__}
    if any(classes & set(mappings[name].values()) for name in _GENERATING):
        return None
    others = {
        name: name.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").replace("_", " ").lower()
        for name in sorted(mappings)
        if name not in (*_TASKS, *_LAST, *_NOT_A_TASK)
    }
    for name, task in {**_TASKS, **others, **_LAST}.items():
        if classes & set(mappings[name].values()):
            return task
    return None
