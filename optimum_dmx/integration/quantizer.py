"""`DMXQuantizer`: dMX quantization of an already-loaded model (optimum's `OptimumQuantizer`), and saving.

`quantize_model` runs the very hooks `from_pretrained(..., quantization_config=DMXConfig(...))` runs
(`DMXHfQuantizer.preprocess_model` and `postprocess_model`), so both paths quantize and record the result the
same way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from optimum.quantization_base import OptimumQuantizer

from .configuration import DMXConfig
from .folders import staged_folder
from .hf_quantizer import DMXHfQuantizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .model_card import ModelCardInfo


class DMXQuantizer(OptimumQuantizer):
    """dMX quantization without `from_pretrained`.

    Example:
        >>> quantizer = DMXQuantizer(DMXConfig(target_bits=5.0, dataset="wikitext"))
        >>> model = quantizer.quantize_model(model, tokenizer)
        >>> quantizer.save(model, "smollm2-dmx")
    """

    def __init__(self, config: DMXConfig):
        self.config = config

    def quantize_model(self, model: PreTrainedModel, tokenizer: Any = None) -> PreTrainedModel:
        """Quantize `model` in place, exactly as `from_pretrained` with this config would.

        Without a `format_map` in the config the model is calibrated on `config.dataset`, tokenized by
        `tokenizer` (default `config.tokenizer`). Everything is checked before any weight is touched; afterwards
        `model.config.quantization_config` records the applied map and its bits (no dataset, no tokenizer).
        """
        hf_quantizer = DMXHfQuantizer(self.config.with_runtime_inputs(tokenizer=tokenizer), pre_quantized=False)
        hf_quantizer.validate_environment(device_map=getattr(model, "hf_device_map", None))
        hf_quantizer.preprocess_model(model)
        model.hf_quantizer = hf_quantizer  # what from_pretrained sets before post-processing
        hf_quantizer.postprocess_model(model)
        return model

    def save(
        self,
        model: PreTrainedModel,
        save_dir: str | os.PathLike,
        card_info: ModelCardInfo | None = None,
        *,
        tokenizer: Any = None,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        """`model.save_pretrained(save_dir, **kwargs)` (and `tokenizer.save_pretrained`), with the dMX model card,
        atomically.

        `card_info` adds to the card what only the caller knows (base model, data, measurements). The checkpoint,
        the tokenizer and the card are written to a staging sibling folder that replaces `save_dir` only once all
        of them are complete (`folders.staged_folder`), so an interrupted save never leaves a partial checkpoint
        there and never removes the old one. A `save_dir` that exists and is not empty is replaced only with
        `overwrite=True`; a second process saving to the same `save_dir` at the same time gets `FolderInUseError`.
        """
        if card_info is not None:
            model.dmx_card_info = card_info
        with staged_folder(save_dir, overwrite=overwrite) as staging:
            model.save_pretrained(staging, **kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)

    def push_to_hub(
        self, model: PreTrainedModel, repo_id: str, card_info: ModelCardInfo | None = None, **kwargs: Any
    ) -> Any:
        """`model.push_to_hub(repo_id, **kwargs)`: uploads the checkpoint with its dMX model card."""
        if card_info is not None:
            model.dmx_card_info = card_info
        return model.push_to_hub(repo_id, **kwargs)

    def quantize(
        self,
        save_dir: str | os.PathLike,
        file_prefix: str | None = None,
        *,
        model: PreTrainedModel,
        tokenizer: Any = None,
    ) -> PreTrainedModel:
        """`quantize_model` then `save` (the `OptimumQuantizer` entry point).

        `file_prefix` is not supported: file names follow transformers' safetensors naming.
        """
        if file_prefix is not None:
            raise ValueError(f"file_prefix={file_prefix!r} is not supported; checkpoint files use transformers' names")
        self.quantize_model(model, tokenizer)
        self.save(model, save_dir)
        return model
