"""Load an exported checkpoint with transformers and finish it with its loader's own code.

transformers loads a compressed-tensors or Quark export of a rotated dMX checkpoint without finishing its online
transforms: compressed-tensors' `transform_config` is not applied (the model computes another function), and Quark's
rotating linears are built but not finished (the model cannot run). `load_exported` loads the folder and calls the
loader's own functions that do it (what the export's model card shows), so that evaluating an export measures the
model vLLM serves.

A compressed-tensors export also stores each transform's matrix beside the layer it applies to, which vLLM loads.
transformers, which builds no transform modules, would report those tensors as unexpected and skip them, and
`apply_transform_config` builds the matrices again from `transform_config`. `load_exported` leaves them out of
transformers' report and checks instead that each stored matrix is the one compressed-tensors built, so that the
loaded model computes what vLLM serves from the same folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..integration.checkpoint_names import checkpoint_key_renaming
from ..integration.hf_quantizer import initialization_stand_in

__all__ = ["EXPORTED_METHODS", "finish_loading", "is_export", "load_exported"]

EXPORTED_METHODS = ("compressed-tensors", "quark")  # `quant_method` of the folders `export_checkpoint` writes


def _quantization_config(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text()).get("quantization_config") or {}


def is_export(folder: str | Path) -> bool:
    """Whether the saved model in `folder` is in a format `export_checkpoint` writes (its `quant_method`)."""
    return _quantization_config(folder).get("quant_method") in EXPORTED_METHODS


def load_exported(folder: str | Path, **from_pretrained: Any) -> nn.Module:
    """`from_pretrained(folder, **from_pretrained)` of the model's Auto class (`generating_model_class`) for a folder
    `export_checkpoint` wrote, with its online transforms applied by its loader's code (`finish_loading`). The
    transform matrices a compressed-tensors export stores are checked against those compressed-tensors built (raising
    `ValueError` naming one that differs) instead of being reported as unexpected by transformers."""
    from transformers import AutoConfig

    from ..integration.model_classes import generating_model_class

    quantization = _quantization_config(folder)
    if quantization.get("quant_method") not in EXPORTED_METHODS:
        raise ValueError(
            f"{str(folder)!r} is not an exported checkpoint: its quant_method is "
            f"{quantization.get('quant_method')!r}; allowed: {', '.join(EXPORTED_METHODS)}"
        )
    stored_transforms = _stored_transform_matrix(quantization)
    with (
        _initializing_packed_linears_with_stand_ins(),
        _not_reported_as_unexpected(stored_transforms) if stored_transforms else nullcontext(),
    ):
        model = generating_model_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder, **from_pretrained)
    finish_loading(model, quantization)
    if stored_transforms:
        _check_stored_transform_matrices(model, folder, stored_transforms)
    return model


def _stored_transform_matrix(quantization_config: Mapping[str, Any]) -> re.Pattern[str] | None:
    """The names of the transform matrices a compressed-tensors export stores (`<layer>.<scheme>_input.weight`: the
    matrix of the module `_transform_module` names), or None without a `transform_config`."""
    schemes = ((quantization_config.get("transform_config") or {}).get("config_groups")) or {}
    if quantization_config.get("quant_method") != "compressed-tensors" or not schemes:
        return None
    modules = "|".join(re.escape(_transform_module(scheme)) for scheme in schemes)
    return re.compile(rf"\.({modules})\.weight$")


def _transform_module(scheme: str) -> str:
    """The name of the module compressed-tensors attaches to a layer for its input transform of `scheme`."""
    return f"{scheme}_input"


@contextmanager
def _not_reported_as_unexpected(keys: re.Pattern[str]) -> Iterator[None]:
    """While transformers loads a model, leave the checkpoint keys matching `keys` out of its unexpected keys (and so
    out of its load report): tensors `load_exported` checks itself after the load."""
    from transformers import PreTrainedModel

    adjust = PreTrainedModel._adjust_missing_and_unexpected_keys

    def adjust_and_leave_out(self: PreTrainedModel, loading_info: Any) -> None:
        adjust(self, loading_info)
        loading_info.unexpected_keys = {key for key in loading_info.unexpected_keys if not keys.search(key)}

    PreTrainedModel._adjust_missing_and_unexpected_keys = adjust_and_leave_out
    try:
        yield
    finally:
        PreTrainedModel._adjust_missing_and_unexpected_keys = adjust


def _check_stored_transform_matrices(model: nn.Module, folder: str | Path, keys: re.Pattern[str]) -> None:
    """Raise, naming the tensor, unless every transform matrix stored in `folder` (checkpoint keys matching `keys`)
    equals the matrix of the transform compressed-tensors attached to that layer of `model`: vLLM computes with the
    stored matrix, the loaded model with the attached one."""
    module_name = checkpoint_key_renaming(model)
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as reader:
            for key in filter(keys.search, reader.keys()):
                try:
                    attached = model.get_parameter(module_name(key))
                except AttributeError:
                    problem = "compressed-tensors attached no transform to its layer"
                else:
                    stored = reader.get_tensor(key).to(attached.device, attached.dtype)
                    if torch.equal(stored, attached.detach()):
                        continue
                    problem = "it is not the matrix compressed-tensors built for its layer"
                raise ValueError(
                    f"{problem} from the transform_config in config.json, for the transform matrix {key!r} stored "
                    f"in {file.name}: vLLM would compute with the stored matrix and this model with another. The "
                    "checkpoint is damaged or its config.json was edited."
                )


@contextmanager
def _initializing_packed_linears_with_stand_ins() -> Iterator[None]:
    """While transformers loads a model, give every linear without a `weight` (a packed layer) a stand-in `weight`
    for as long as the weight initialization runs on it or on a module holding it.

    The stand-in is a meta tensor of the weight's shape marked initialized (`_is_hf_initialized`), which
    transformers' initializers leave alone: the initialization runs as transformers means it to, and a family's
    initializer that reads a packed layer's `weight` (the module docstring) reads the stand-in instead of failing."""
    from transformers import PreTrainedModel

    initialize = PreTrainedModel._initialize_weights

    def initialize_with_stand_ins(self: PreTrainedModel, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        weightless = [
            linear
            for linear in module.modules()
            if isinstance(linear, nn.Linear) and "weight" not in linear._parameters and "weight" not in vars(linear)
        ]
        for linear in weightless:
            vars(linear)["weight"] = initialization_stand_in((linear.out_features, linear.in_features))
        try:
            initialize(self, module, *args, **kwargs)
        finally:
            for linear in weightless:
                del vars(linear)["weight"]

    PreTrainedModel._initialize_weights = initialize_with_stand_ins
    try:
        yield
    finally:
        PreTrainedModel._initialize_weights = initialize


def finish_loading(model: nn.Module, quantization_config: Mapping[str, Any]) -> int:
    """Apply the online transforms of an export that transformers loaded as `model`, with the loader's own code:
    compressed-tensors' `apply_transform_config` for its `transform_config` (unless its transforms are already
    attached), Quark's `post_process_after_loading` for each rotating linear (once per load: Quark has no record of
    a finished layer to check). Returns how many transformed layers were finished (0: none to do)."""
    if quantization_config.get("quant_method") == "compressed-tensors":
        return _apply_compressed_tensors_transforms(model, quantization_config.get("transform_config"))
    rotating = [module for module in model.modules() if hasattr(module, "input_rotation")]
    for module in rotating:
        module.post_process_after_loading()
    return len(rotating)


def _apply_compressed_tensors_transforms(model: nn.Module, transform_config: Mapping[str, Any] | None) -> int:
    if not transform_config:
        return 0
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    config = TransformConfig.model_validate(transform_config)
    attached = {_transform_module(scheme) for scheme in config.config_groups}  # what each transformed layer gets
    if any(name.rpartition(".")[2] in attached for name, _ in model.named_modules()):
        return 0  # a loader that applies the transforms itself
    apply_transform_config(model, config)
    return sum(name.rpartition(".")[2] in attached for name, _ in model.named_modules())
