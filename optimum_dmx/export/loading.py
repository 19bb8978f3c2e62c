"""Load an exported checkpoint with transformers and finish it with its loader's own code.

transformers loads a compressed-tensors or Quark export of a rotated dMX checkpoint without finishing its online
transforms: compressed-tensors' `transform_config` is not applied (the model computes another function), and Quark's
rotating linears are built but not finished (the model cannot run). `load_exported` loads the folder and calls the
loader's own functions that do it (what the export's model card shows), so that evaluating an export measures the
model vLLM serves.

A compressed-tensors checkpoint stores each online transform's tensors (its matrix, and its permutation for a
`randomize`d scheme) beside the layer it applies to. transformers, which builds no transform modules, would report
them as unexpected and skip them. `load_exported` leaves them out of transformers' report, attaches the transforms with
compressed-tensors' `apply_transform_config` (only the online ones: the offline ones are inside the stored weights
already), and then:

* for a `"hadamard"` scheme (not randomized, not learned), whose matrix the configuration determines and which vLLM
  computes without reading it (its Hadamard kernel), checks that each stored matrix is the one compressed-tensors built,
  refusing a damaged checkpoint by name;
* for every other scheme (`"random-hadamard"`, `"random-matrix"`, randomized or learned ones: checkpoints llm-compressor
  writes for QuIP or SpinQuant), takes the stored tensors, which vLLM computes with too: the generator that drew them
  is not in the configuration.
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
    `export_checkpoint` wrote (or another compressed-tensors or Quark checkpoint), with its online transforms applied
    by its loader's code (`finish_loading`) and the transform tensors a compressed-tensors checkpoint stores checked
    or taken (the module docstring) instead of being reported as unexpected by transformers; raises `ValueError`
    naming a stored tensor that cannot be what the configuration says."""
    from transformers import AutoConfig

    from ..integration.model_classes import generating_model_class

    quantization = _quantization_config(folder)
    if quantization.get("quant_method") not in EXPORTED_METHODS:
        raise ValueError(
            f"{str(folder)!r} is not an exported checkpoint: its quant_method is "
            f"{quantization.get('quant_method')!r}; allowed: {', '.join(EXPORTED_METHODS)}"
        )
    is_compressed_tensors = quantization["quant_method"] == "compressed-tensors"
    transforms = _online_transforms(quantization.get("transform_config")) if is_compressed_tensors else {}
    stored = _stored_transform_key(transforms)
    with (
        _initializing_packed_linears_with_stand_ins(),
        _not_reported_as_unexpected(stored) if stored else nullcontext(),
    ):
        model = generating_model_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder, **from_pretrained)
    finish_loading(model, quantization)
    if stored:
        _settle_stored_transforms(model, folder, stored, transforms)
    return model


def _online_transforms(transform_config: Mapping[str, Any] | None) -> dict[str, bool]:
    """The modules compressed-tensors attaches to a layer for the online transforms of `transform_config`
    (`<scheme>_<location>`), each with whether the configuration determines its tensors (a `"hadamard"` scheme,
    neither randomized nor learned)."""
    return {
        f"{name}_{args['location']}": (
            scheme.get("type") == "hadamard" and not scheme.get("randomize") and not scheme.get("requires_grad")
        )
        for name, scheme in _online_only(transform_config)["config_groups"].items()
        for args in scheme["apply"]
    }


def _online_only(transform_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """`transform_config` (compressed-tensors' `TransformConfig` as a dict) with only its online transforms: those
    applied to the weights (`weight_input`, `weight_output`) are inside a saved checkpoint's weights already, and
    applying them again would transform the weights twice."""
    transform_config = dict(transform_config or {})
    online = {}
    for name, scheme in (transform_config.get("config_groups") or {}).items():
        applied = [args for args in scheme.get("apply", ()) if args.get("location") not in _OFFLINE_LOCATIONS]
        if applied:
            online[name] = {**scheme, "apply": applied}
    return {**transform_config, "config_groups": online}


_OFFLINE_LOCATIONS = ("weight_input", "weight_output")  # compressed-tensors' transforms merged into the weights


def _stored_transform_key(transforms: Mapping[str, bool]) -> re.Pattern[str] | None:
    """The checkpoint keys of the tensors of the transform modules `transforms` (`_online_transforms`), or None for
    none."""
    if not transforms:
        return None
    modules = "|".join(re.escape(module) for module in sorted(transforms))
    return re.compile(rf"\.({modules})\.(weight|perm)$")


@contextmanager
def _not_reported_as_unexpected(keys: re.Pattern[str]) -> Iterator[None]:
    """While transformers loads a model, leave the checkpoint keys matching `keys` out of its unexpected keys (and so
    out of its load report): tensors `load_exported` settles itself after the load."""
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


def _settle_stored_transforms(
    model: nn.Module, folder: str | Path, keys: re.Pattern[str], determined: Mapping[str, bool]
) -> None:
    """Check or take each transform tensor stored in `folder` (checkpoint keys matching `keys`) for the transform
    compressed-tensors attached to its layer of `model`: `determined[module]` says whether the configuration
    determines it (then it must equal the attached one) or the stored one is taken.

    compressed-tensors shares one tensor between the layers whose transforms have the same size, and saves it under
    the first of them. A stored tensor fills the shared one, layers in the model's order; one that differs from what
    an earlier layer's stored tensor put there gets its layer a tensor of its own. Raises `ValueError` naming a stored
    tensor without an attached transform, of another shape, or, where determined, of another value."""
    module_name = checkpoint_key_renaming(model)
    stored: dict[str, tuple[Path, str]] = {}  # by the name of the model's tensor: the file and key holding it
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as reader:
            stored |= {module_name(key): (file, key) for key in filter(keys.search, reader.keys())}
    attached_tensors = dict(model.named_parameters(remove_duplicate=False))
    unattached = sorted(stored.keys() - attached_tensors.keys())
    if unattached:
        file, key = stored[unattached[0]]
        raise _stored_transform_error(key, file, "compressed-tensors attached no transform to its layer")
    taken: dict[int, torch.Tensor] = {}  # the attached tensors filled so far, by id, with what filled them
    for name, attached in attached_tensors.items():
        if name not in stored:
            continue
        file, key = stored[name]
        with safe_open(file, framework="pt") as reader:
            tensor = reader.get_tensor(key).to(attached.device, attached.dtype)
        if tensor.shape != attached.shape:
            problem = f"its shape is {tuple(tensor.shape)}, the attached transform's {tuple(attached.shape)}"
            raise _stored_transform_error(key, file, problem)
        owner, _, attribute = name.rpartition(".")
        if determined[owner.rpartition(".")[2]]:
            if not torch.equal(tensor, attached.detach()):
                raise _stored_transform_error(key, file, "it is not the matrix compressed-tensors built for its layer")
        elif id(attached) not in taken:
            attached.data.copy_(tensor)
            taken[id(attached)] = tensor
        elif not torch.equal(taken[id(attached)], tensor):
            own = nn.Parameter(tensor, requires_grad=attached.requires_grad)
            setattr(model.get_submodule(owner), attribute, own)
            taken[id(own)] = tensor


def _stored_transform_error(key: str, file: Path, problem: str) -> ValueError:
    return ValueError(
        f"The transform tensor {key!r} stored in {file.name} does not fit the transform_config in config.json: "
        f"{problem}. vLLM would compute with another transform than this model: the checkpoint is damaged or its "
        "config.json was edited."
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
    compressed-tensors' `apply_transform_config` for the online transforms of its `transform_config` (unless they
    are attached already), Quark's `post_process_after_loading` for each rotating linear (once per load: Quark has
    no record of a finished layer to check). Returns how many transformed layers were finished (0: none to do).

    The transforms compressed-tensors attaches hold the tensors it builds from the configuration: a checkpoint's own
    random or learned ones are taken by `load_exported`, which reads them from the folder."""
    if quantization_config.get("quant_method") == "compressed-tensors":
        return _apply_compressed_tensors_transforms(model, quantization_config.get("transform_config"))
    rotating = [module for module in model.modules() if hasattr(module, "input_rotation")]
    for module in rotating:
        module.post_process_after_loading()
    return len(rotating)


def _apply_compressed_tensors_transforms(model: nn.Module, transform_config: Mapping[str, Any] | None) -> int:
    online = _online_only(transform_config)
    if not online["config_groups"]:
        return 0
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    attached = set(_online_transforms(online))  # the modules a transformed layer gets
    if any(name.rpartition(".")[2] in attached for name, _ in model.named_modules()):
        return 0  # a loader that applies the transforms itself
    apply_transform_config(model, TransformConfig.model_validate(online))
    return sum(any(child in attached for child, _ in module.named_children()) for module in model.modules())
