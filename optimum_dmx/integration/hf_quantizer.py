"""`DMXHfQuantizer`: the transformers loading hooks of the dMX backend, and its registration.

* **Float checkpoint + `DMXConfig`**: the linears stay `nn.Linear` while the float weights load; after
  loading, the model is calibrated (or the config's explicit `format_map` is taken as is) and the chosen
  linears become `MXLinear`s. `model.config.quantization_config` then records the applied map.
* **dMX checkpoint** (`quant_method: "dmx"` in config.json): the `MXLinear`s are rebuilt on the meta
  skeleton from the saved `format_map`, the checkpoint's packed tensors are checked against them, and
  the loader fills them. Nothing is recalibrated.

`DMXQuantizer.quantize_model` runs the same hooks on an already-loaded model. Importing this module registers
quant_method `"dmx"` with transformers (idempotently).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils import cached_file

from ..nn import (
    MXLinear,
    dequantize_mx_linears,
    format_map_bits,
    linear_modules_to_quantize,
    linearizable_experts,
    linearize_experts,
    packed_weight_modules,
    replace_with_mx_linear,
)
from ..nn.replaceable import NOT_REACHED, linears_kept_in_float
from ..nn.rotation import LEARNABLE_ROTATIONS, online_transform_targets, resolve_rotation, rotate_model
from ..nn.surgery import is_skipped, per_layer_pattern, subtree_prefixes
from .checkpoint_names import checkpoint_key_renaming
from .configuration import QUANT_METHOD, DMXConfig
from .integrity import CHECKSUMS_NAME, verify_integrity
from .model_card import attach_model_card, detach_model_card
from .model_classes import other_task

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..calibration.result import CalibrationResult

MODEL_TAGS = ("dmx", "mx-formats")

logger = logging.getLogger(__name__)


class DMXHfQuantizer(HfQuantizer):
    """Quantizes a float checkpoint with dMX while loading it, or loads a saved dMX checkpoint."""

    requires_calibration = False
    quantization_config: DMXConfig
    calibration_result: CalibrationResult | None = None  # what calibrating gave (its times), when it calibrated

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Fail before any weight is loaded when the config cannot be carried out."""
        config = self.quantization_config
        if self.pre_quantized:
            if config.format_map is None:
                raise ValueError("this dMX checkpoint's quantization_config has no format_map: it cannot be rebuilt")
        else:
            config.check_calibration_inputs()

    def _process_model_before_weight_loading(
        self, model: PreTrainedModel, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> PreTrainedModel:
        if self.pre_quantized:
            config = self.quantization_config
            linearize_experts(model, linearizable_experts(model, [], config.format_map), skeleton=True)
            replace_with_mx_linear(
                model, config.format_map, input_transforms=config.input_transforms, **_mx_options(config)
            )
            module_name = checkpoint_key_renaming(model)
            _check_packed_tensors(model, checkpoint_files or [], module_name)
            verify_integrity(
                _integrity_record_path(model, checkpoint_files or []),
                checkpoint_files or [],
                config.format_map,
                module_name,
            )
            _add_initialization_stand_ins(model, config.format_map)
        else:
            _check_not_quantized(model)
            _check_quantizable(model, self._modules_to_skip(model))
        return model

    def _process_model_after_weight_loading(self, model: PreTrainedModel, **kwargs: Any) -> PreTrainedModel:
        if not self.pre_quantized:
            # `postprocess_model` has just set the user's config on the model: replace it with the record of
            # what was applied (no dataset, no tokenizer), as config.json must hold.
            self.quantization_config = self._quantize(model)
            model.config.quantization_config = self.quantization_config
        else:
            _remove_initialization_stand_ins(model)
        model.add_model_tags(list(MODEL_TAGS))
        attach_model_card(model)  # save_pretrained and push_to_hub write the dMX model card
        return model

    def _quantize(self, model: PreTrainedModel) -> DMXConfig:
        """Calibrate (or take the explicit map), install the `MXLinear`s, return the config that records it."""
        config = self.quantization_config
        if config.needs_data:
            _check_next_token_model(model)
            _check_sequence_length(model, config.seq_len)
        skip = self._modules_to_skip(model)
        linearize_experts(model, linearizable_experts(model, skip, config.format_map))  # experts as linears
        # Imported when needed, not at the top: calibration pulls in the trainer, tqdm and `datasets`, which
        # loading a saved dMX checkpoint (the other use of this module) never needs.
        input_ids = None
        if config.needs_data:
            from ..calibration.data import build_calibration_batches

            input_ids = build_calibration_batches(
                config.dataset, config.tokenizer, config.seq_len, config.num_samples, config.seed
            )
            skip = _skip_linears_kept_in_float(model, input_ids[:1], skip, config.format_map, config.rotation)
        # Rotations first: calibration must see (and the saved weights hold) the rotated model.
        quantized = linear_modules_to_quantize(model, skip)
        rotation = resolve_rotation(model, config.rotation, quantized, config.block_size)
        transformed = online_transform_targets(config.rotation, quantized)  # "auto": no expert
        rotate_model(model, rotation, transformed, config.block_size, config.seed)
        if config.needs_calibration:
            from ..calibration.trainer import calibrate

            settings = config.calibration_settings(modules_to_not_convert=skip)
            self.calibration_result = calibrate(model, input_ids, settings)
            format_map = self.calibration_result.format_map
        else:
            format_map = config.format_map
        # GPTQ rounds from the float linears, which the MX modules replace: keep them until it has run.
        gptq = config.weight_rounding == "gptq"
        float_linears = {n: model.get_submodule(n) for n in format_map} if gptq else {}
        replace_with_mx_linear(model, format_map, **_mx_options(config))
        if float_linears:
            from ..calibration.gptq import round_weights_by_gptq
            from ..calibration.presets import get_preset

            sequences = input_ids[: get_preset(config.preset).gptq_samples]
            round_weights_by_gptq(model, float_linears, sequences, config.batch_size)
        shapes = {name: model.get_submodule(name).weight_shape for name in format_map}
        bits = format_map_bits(format_map, shapes, config.quantize_activations, config.block_size)
        # What the MX linears compute with, rotated here or by the caller before (`rotate_model` on the float model):
        # a transform config.json did not record would be missing on load.
        transforms = {
            name: module.input_transform.to_dict()
            for name in format_map
            if (module := model.get_submodule(name)).input_transform is not None
        }
        return config.with_result(
            format_map, input_transforms=transforms, achieved_bits=bits, modules_to_not_convert=skip, rotation=rotation
        )

    def _modules_to_skip(self, model: PreTrainedModel) -> list[str]:
        """The config's `modules_to_not_convert` and transformers' default skips (output embeddings, tied weights,
        `keep_in_fp32` modules), sorted."""
        skip = self.get_modules_to_not_convert(
            model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules, add_default_skips=True
        )
        return sorted(set(skip))

    def _dequantize(self, model: PreTrainedModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
        """`model.dequantize()`: every `MXLinear` back to an `nn.Linear` holding its MX-valued weight."""
        detach_model_card(model)
        return dequantize_mx_linears(model, dtype)

    def is_serializable(self, safe_serialization: bool | None = None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def _mx_options(config: DMXConfig) -> dict[str, Any]:
    """How the config's `MXLinear`s quantize: block size, activation quantization, block-scale rule."""
    return {
        "block_size": config.block_size,
        "quantize_activations": config.quantize_activations,
        "scale_rule": config.scale_rule,
    }


def _check_next_token_model(model: PreTrainedModel) -> None:
    """Refuse, before anything is computed, a model that transformers builds for another task than predicting the
    next token of text (a classifier, a masked or encoder-decoder model, a model without a head): calibration and
    GPTQ learn from that loss on calibration text."""
    task = other_task(model)
    if task is not None:
        raise ValueError(
            f"{type(model).__name__} is built for {task}, but dMX calibrates on the next-token loss of text: load "
            "the model with AutoModelForCausalLM (AutoModelForImageTextToText for an image-text model), or quantize "
            "it without calibration text, with a given format_map (weight_rounding='rtn', its default there)"
        )


def _check_sequence_length(model: PreTrainedModel, seq_len: int) -> None:
    """Refuse calibration sequences longer than the model's positions, before anything is computed."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} is longer than {type(model).__name__}'s max_position_embeddings={limit}: pass "
            f"seq_len={limit} or less"
        )


def _add_initialization_stand_ins(model: PreTrainedModel, names: Iterable[str]) -> None:
    """Give the `MXLinear`s `names` a stand-in `weight` while the checkpoint loads (`_remove_initialization_stand_ins`
    takes them away after).

    After loading a checkpoint, transformers runs the model's weight initialization on the modules it has not marked
    initialized, and some models initialize a linear's weight from the module that holds it (GPT-BigCode's MLP and
    attention scale `c_proj.weight` by depth; Mamba's mixer scales `out_proj.weight`), which fails on an `MXLinear`:
    it has no `weight`. The stand-in is a meta tensor of the weight's shape, marked initialized: transformers'
    initializers leave it alone, anything else done to it computes nothing, and it is in no state dict."""
    for name in names:
        module = model.get_submodule(name)
        module.__dict__["weight"] = initialization_stand_in(module.weight_shape)


def initialization_stand_in(shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A stand-in for a weight a layer does not hold (it holds packed or MX values), while transformers initializes
    the model's weights: a meta tensor of the weight's `shape` (no memory, and anything done to it computes nothing),
    marked initialized (`_is_hf_initialized`), which transformers' initializers leave alone."""
    stand_in = torch.empty(shape, device="meta")
    stand_in._is_hf_initialized = True
    return stand_in


def _remove_initialization_stand_ins(model: PreTrainedModel) -> None:
    for module in model.modules():
        if isinstance(module, MXLinear):
            module.__dict__.pop("weight", None)


def _check_not_quantized(model: PreTrainedModel) -> None:
    for name, module in model.named_modules():
        if isinstance(module, MXLinear):
            raise ValueError(
                f"the model is already dMX-quantized (module {name!r} is an MXLinear in {module.fmt.name}); "
                "quantize the float model instead"
            )


def _check_quantizable(model: PreTrainedModel, skip: list[str]) -> None:
    """Refuse, before any weight is loaded, a model with nothing to quantize outside `skip` (GPT-2's layers are
    `Conv1D`s), and one whose weights outside `skip` are not all in `nn.Linear` layers or packed experts dMX can
    linearize (`nn.experts`): dMX would leave those in float under a bit budget that does not count them. Adding
    their modules to `modules_to_not_convert` says the user wants exactly that."""
    linears = linear_modules_to_quantize(model, skip)
    experts = linearizable_experts(model, skip)
    if not linears and not experts:
        holders = sorted(
            {
                type(module).__name__
                for name, module in model.named_modules()
                if not isinstance(module, torch.nn.Embedding)
                and not any(is_skipped(name, pattern) for pattern in skip)
                and any(p.dim() == 2 for p in module.parameters(recurse=False))
            }
        )
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear layer to quantize outside modules_to_not_convert={skip}: its "
            f"weight matrices are in {holders} modules; dMX quantizes nn.Linear layers only"
        )
    packed = packed_weight_modules(model, skip)
    if not packed:
        return
    packed_elements = sum(math.prod(shape) for shapes in packed.values() for shape in shapes.values())
    linear_elements = sum(linear.weight.numel() for linear in linears.values()) + sum(
        model.get_submodule(name).gate_up_proj.numel() + model.get_submodule(name).down_proj.numel() for name in experts
    )
    share = packed_elements / (packed_elements + linear_elements)
    name, shapes = next(iter(packed.items()))
    tensors = ", ".join(f"{parameter} {shape}" for parameter, shape in shapes.items())
    others = f" and {len(packed) - 1} more" if len(packed) > 1 else ""
    patterns = sorted({per_layer_pattern(name) for name in packed})
    flags = " ".join(f"--modules-to-not-convert {pattern}" for pattern in patterns)
    raise ValueError(
        f"{share:.0%} of the weights {type(model).__name__} would have quantized lie outside nn.Linear layers, in "
        f"tensors of three dimensions or more that dMX cannot quantize: {name} "
        f"({type(model.get_submodule(name)).__name__}: {tensors}){others}. dMX quantizes nn.Linear layers and the "
        "mixture-of-experts experts of Qwen3-MoE's and Mixtral's layout (gate and up concatenated, no bias). To "
        "quantize the other linears and keep these weights in their float dtype, add "
        f"{patterns} to modules_to_not_convert (command line: {flags}); the bit budget and the achieved bits then "
        "count the quantized linears only."
    )


def _skip_linears_kept_in_float(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    skip: list[str],
    format_map: dict[str, str] | None,
    rotation: str,
) -> list[str]:
    """`skip` and the linears calibration must leave in float (`nn.replaceable`), with a warning for each kind: those
    an `MXLinear` cannot stand in for (the model would not use a quantized layer there as one) and those no
    calibration token reaches (no signal to calibrate them from). They stay in their float dtype, recorded in
    `modules_to_not_convert`, and the bit budget counts the other linears only. A given `format_map` that names a
    linear of the first kind is refused; one that names an unreached linear is applied as given. A `rotation` merged
    into the residual stream is refused beside unreached linears: they may write into it unrotated (an image-text
    model's projector does)."""
    names = list(linear_modules_to_quantize(model, skip))
    reasons = linears_kept_in_float(model, input_ids, names)
    unreached = [name for name, reason in reasons.items() if reason == NOT_REACHED]
    irreplaceable = {name: reason for name, reason in reasons.items() if reason != NOT_REACHED}
    if format_map:
        _refuse_mapped_irreplaceable(format_map, irreplaceable)
        return skip
    patterns = _irreplaceable_patterns(model, names, irreplaceable) if irreplaceable else []
    if unreached:
        prefixes = subtree_prefixes(unreached, names)
        if rotation in LEARNABLE_ROTATIONS:  # the merged ones
            raise ValueError(
                f"rotation={rotation!r} rotates the residual stream, but linears no calibration token reaches "
                f"({', '.join(prefixes)}) stay float and unrotated, and may write into it (an image-text model's "
                "projector does): use rotation='online_block_hadamard' (the default's choice), which merges nothing "
                "into it, or 'none'"
            )
        logger.warning(
            "%s has %d linear(s) that no calibration token reaches (%s): calibration has no signal for them, so "
            "they stay in float, modules_to_not_convert gets these prefixes, and the bit budget counts the other "
            "linears only. An image- or audio-text model calibrated on text keeps its vision or audio encoder in float "
            "this way.",
            type(model).__name__,
            len(unreached),
            ", ".join(prefixes),
        )
        patterns += prefixes
    return sorted({*skip, *patterns})


def _refuse_mapped_irreplaceable(format_map: dict[str, str], irreplaceable: dict[str, str]) -> None:
    """Refuse a given `format_map` that names a linear an `MXLinear` cannot stand in for."""
    mapped = [name for name in irreplaceable if name in format_map]
    if mapped:
        raise ValueError(
            f"format_map names {mapped[0]!r}{f' and {len(mapped) - 1} more' if len(mapped) > 1 else ''}, which a "
            f"quantized layer cannot stand in for ({irreplaceable[mapped[0]]}): leave it out of the map (it then "
            "stays in float)"
        )


def _irreplaceable_patterns(model: PreTrainedModel, names: list[str], irreplaceable: dict[str, str]) -> list[str]:
    """The `modules_to_not_convert` patterns of the linears an `MXLinear` cannot stand in for (per layer, such as
    `mixer.dt_proj`, where that names exactly them), logged in a warning that names them and why."""
    found = list(irreplaceable)
    patterns = sorted({per_layer_pattern(name) for name in found})
    if [n for n in names if any(is_skipped(n, p) for p in patterns)] != found:
        patterns = found  # a per-layer name would also match linears that a quantized layer can stand in for
    by_reason = "; ".join(
        f"{reason}: {', '.join(sorted({per_layer_pattern(n) for n in found if irreplaceable[n] == reason}))}"
        for reason in dict.fromkeys(irreplaceable.values())
    )
    logger.warning(
        "%s has %d linear(s) that a quantized layer cannot stand in for (%s): they stay in float, "
        "modules_to_not_convert gets %s, and the bit budget counts the other linears only.",
        type(model).__name__,
        len(found),
        by_reason,
        patterns,
    )
    return patterns


def _integrity_record_path(model: PreTrainedModel, checkpoint_files: list[str]) -> Path | None:
    """The checkpoint's integrity record: beside its weights, or fetched from the Hub repo it was loaded from."""
    if checkpoint_files and (Path(checkpoint_files[0]).parent / CHECKSUMS_NAME).is_file():
        return Path(checkpoint_files[0]).parent / CHECKSUMS_NAME
    source = getattr(model.config, "name_or_path", None)
    if not source or Path(source).exists():
        return None
    try:
        found = cached_file(
            source,
            CHECKSUMS_NAME,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except (OSError, ValueError):
        return None
    return Path(found) if found else None


def _check_packed_tensors(
    model: PreTrainedModel, checkpoint_files: list[str], module_name: Callable[[str], str] = str
) -> None:
    """Raise, naming the module, unless the checkpoint holds every MXLinear's tensors in the expected shapes and
    every packed layer it holds is in the format map. `module_name` maps a checkpoint key to the model's name.

    The loader would only warn about a missing tensor (and leave uninitialized memory in its place, or a randomly
    initialised layer where the map forgot a packed one), so a checkpoint that does not match its own format map is
    refused here, before anything is loaded. Only the safetensors headers are read.
    """
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in checkpoint_files:
        if not str(path).endswith(".safetensors"):
            continue
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                found[module_name(key)] = (tuple(tensor.get_shape()), tensor.get_dtype())
    if not found:
        raise ValueError("a dMX checkpoint must be stored as safetensors; no .safetensors file was found")
    mapped = {name for name, module in model.named_modules() if isinstance(module, MXLinear)}
    unmapped = sorted(key.rpartition(".")[0] for key in found if key.endswith(".weight_packed"))
    unmapped = [name for name in unmapped if name not in mapped]
    if unmapped:
        raise ValueError(
            f"the checkpoint stores {len(unmapped)} packed layers that its format_map does not name (e.g. "
            f"{unmapped[0]!r}): they would load randomly initialised. The checkpoint is damaged or its config.json "
            "was edited."
        )
    for name, module in model.named_modules():
        if not isinstance(module, MXLinear):
            continue
        for tensor_name, expected in (("weight_packed", module.weight_packed), ("weight_scale", module.weight_scale)):
            key = f"{name}.{tensor_name}"
            if key not in found:
                raise ValueError(
                    f"module {name!r} is {module.fmt.name} in the format_map, but the checkpoint has no {key!r}"
                )
            shape, dtype = found[key]
            if shape != tuple(expected.shape) or dtype != "U8":
                raise ValueError(
                    f"module {name!r}: checkpoint tensor {key!r} is {dtype}{list(shape)}, but {module.fmt.name} "
                    f"with in_features={module.in_features}, out_features={module.out_features} needs "
                    f"U8{list(expected.shape)}"
                )


def register() -> None:
    """Register `DMXConfig` and `DMXHfQuantizer` under quant_method `"dmx"`.

    Safe to call repeatedly: a registration left by an earlier import of this module (e.g. before
    `importlib.reload`) is replaced; one by another package is an error.
    """
    for mapping, cls, decorator in (
        (AUTO_QUANTIZATION_CONFIG_MAPPING, DMXConfig, register_quantization_config),
        (AUTO_QUANTIZER_MAPPING, DMXHfQuantizer, register_quantizer),
    ):
        current = mapping.get(QUANT_METHOD)
        if current is None:
            decorator(QUANT_METHOD)(cls)
        elif current is not cls:
            if (current.__module__, current.__qualname__) != (cls.__module__, cls.__qualname__):
                owner = f"{current.__module__}.{current.__qualname__}"
                raise ValueError(f"quant_method {QUANT_METHOD!r} is already registered by {owner}")
            mapping[QUANT_METHOD] = cls


register()
