"""`DMXQuantizer`: dMX quantization of an already-loaded model, and checkpoint saving.

`apply_dmx` is the one place where a model is quantized: it calibrates (or takes the config's explicit
`format_map`), swaps the chosen linears for `MXLinear`s and returns the config that records the result.
Both `DMXQuantizer` and the `from_pretrained` path (`DMXHfQuantizer`) call it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimum.quantization_base import OptimumQuantizer

from .configuration import QUANT_METHOD, DMXConfig

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

    from .model_card import ModelCardInfo


def check_calibration_inputs(config: DMXConfig, tokenizer: Any = None) -> None:
    """Raise unless `config` can be carried out: a format map, or a dataset and a tokenizer to calibrate with."""
    if not config.needs_calibration:
        return
    missing = [name for name, value in (("dataset", config.dataset), ("tokenizer", tokenizer)) if value is None]
    if missing:
        raise ValueError(
            f"DMXConfig has no format_map, so the model must be calibrated, but no {' and no '.join(missing)} "
            "was given: pass DMXConfig(dataset=..., tokenizer=...), or a format_map to apply without calibrating"
        )


def _check_not_quantized(model: nn.Module) -> None:
    from .modules import MXLinear

    for name, module in model.named_modules():
        if isinstance(module, MXLinear):
            raise ValueError(
                f"the model is already dMX-quantized (module {name!r} is an MXLinear in {module.fmt.name}); "
                "quantize the float model instead"
            )


def apply_dmx(model: nn.Module, config: DMXConfig, tokenizer: Any = None) -> DMXConfig:
    """Quantize `model` in place as `config` says and return the config that records what was applied.

    Without a `format_map` in `config`, the model is calibrated on `config.dataset` (tokenized by
    `tokenizer`, default `config.tokenizer`) first. Everything is checked before any weight is touched.
    The returned config holds the format map and achieved bits and no dataset or tokenizer.
    """
    from .calibration.trainer import result_from_format_map
    from .modules import replace_with_mx_linear

    tokenizer = config.tokenizer if tokenizer is None else tokenizer
    check_calibration_inputs(config, tokenizer)
    _check_not_quantized(model)
    settings = config.calibration_settings()
    if config.needs_calibration:
        from .calibration.data import build_calibration_batches
        from .calibration.trainer import calibrate

        input_ids = build_calibration_batches(
            config.dataset, tokenizer, settings.seq_len, settings.num_samples, settings.seed
        )
        format_map = calibrate(model, input_ids, settings).format_map
    else:
        format_map = config.format_map
    linears = dict(model.named_modules())  # the float linears, for the bit accounting
    replace_with_mx_linear(
        model, format_map, block_size=config.block_size, quantize_activations=config.quantize_activations
    )
    result = result_from_format_map(format_map, {name: linears[name] for name in format_map}, settings)
    return config.with_result(
        format_map,
        bits_simple=result.bits_simple,
        bits_weighted=result.bits_weighted,
        storage_bits=result.storage_bits,
    )


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
        """Quantize `model` in place (see `apply_dmx`) and mark it quantized, as `from_pretrained` would."""
        from .hf_quantizer import DMXHfQuantizer

        applied = apply_dmx(model, self.config, tokenizer)
        hf_quantizer = DMXHfQuantizer(applied, pre_quantized=True)
        model.is_quantized = True
        model.quantization_method = QUANT_METHOD
        model.hf_quantizer = hf_quantizer
        hf_quantizer.postprocess_model(model)
        return model

    def save(
        self,
        model: PreTrainedModel,
        save_dir: str | os.PathLike,
        card_info: ModelCardInfo | None = None,
        *,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        """`model.save_pretrained(save_dir, **kwargs)`, with the dMX model card, atomically.

        `card_info` adds to the card what only the caller knows (base model, data, measurements). The
        checkpoint and its `README.md` are written to a temporary sibling directory that replaces `save_dir`
        only once complete, so an interrupted save never leaves a partial checkpoint there. A `save_dir` that
        exists and is not empty is replaced only with `overwrite=True`.
        """
        save_dir = Path(save_dir)
        if save_dir.exists() and not overwrite and (not save_dir.is_dir() or any(save_dir.iterdir())):
            raise FileExistsError(f"{str(save_dir)!r} exists and is not empty; pass overwrite=True to replace it")
        if card_info is not None:
            model.dmx_card_info = card_info
        save_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.", suffix=".partial", dir=save_dir.parent))
        try:
            model.save_pretrained(staging, **kwargs)
            if save_dir.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.", suffix=".old", dir=save_dir.parent))
                os.replace(save_dir, old / save_dir.name)
                os.replace(staging, save_dir)
                shutil.rmtree(old)
            else:
                os.replace(staging, save_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

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
