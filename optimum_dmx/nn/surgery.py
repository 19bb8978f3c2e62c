"""Model surgery: which linears dMX quantizes, and swapping them for MX modules (for good or for a while)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .input_cache import InputCache
from .mx_linear import MXLinear
from .placement import is_sharded, loaded_weights
from .transforms import RandomizedHadamard, TransformedLinear

__all__ = [
    "linear_modules_to_quantize",
    "swapped_modules",
    "emulate_format_map",
    "replace_with_mx_linear",
    "dequantize_mx_linears",
]


def is_skipped(name: str, pattern: str) -> bool:
    """A pattern names the module itself, or a suffix or a prefix of its dotted name at a module boundary.

    Stricter than transformers' `should_convert_module`, whose suffix rule also matches inside a name
    (`"up_proj"` would skip `gate_up_proj`); the set of modules skipped by default still comes from
    transformers (`DMXHfQuantizer`).
    """
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def per_layer_pattern(name: str) -> str:
    """`name` after its last numeric component (`model.layers.3.mlp.experts` -> `mlp.experts`): the
    `modules_to_not_convert` pattern that names the same module in every layer."""
    parts = name.split(".")
    numeric = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[numeric[-1] + 1 :]) if numeric and numeric[-1] + 1 < len(parts) else name


def subtree_prefixes(found: Sequence[str], names: Sequence[str]) -> list[str]:
    """The module names that cover every name in `found` and no other name in `names`, as `modules_to_not_convert`
    prefixes: for each found name, its highest ancestor (or itself) under which every name of `names` is found
    (`model.vision_tower` for every linear of a vision encoder), sorted."""
    ancestors_of_others = {
        ".".join(parts[:depth])
        for name in set(names) - set(found)
        for parts in [name.split(".")]
        for depth in range(1, len(parts) + 1)
    }
    prefixes = set()
    for name in found:
        parts = name.split(".")
        candidates = (".".join(parts[:depth]) for depth in range(1, len(parts) + 1))
        prefixes.add(next(prefix for prefix in candidates if prefix not in ancestors_of_others))
    return sorted(prefixes)


def linear_modules_to_quantize(model: nn.Module, modules_to_not_convert: Sequence[str] | None) -> dict[str, nn.Linear]:
    """The `nn.Linear` modules of `model` that dMX quantizes, by full name, in model order.

    A module is skipped when a pattern of `modules_to_not_convert` equals its full name, is a suffix of it
    at a module boundary (`"lm_head"`, `"mlp.down_proj"`), or a prefix at a module boundary
    (`"model.layers.0"` skips that layer's linears but not those of `model.layers.01`).
    """
    patterns = list(modules_to_not_convert or [])
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(is_skipped(name, p) for p in patterns)
    }


@contextmanager
def swapped_modules(model: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[None]:
    """Temporarily install `replacements` (full name -> module) with every model weight frozen and the model
    in eval mode (no dropout). On exit, also on error, the original modules, the `requires_grad` flags and
    the train/eval mode come back."""
    originals = {name: model.get_submodule(name) for name in replacements}
    trainable = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    # A model already in eval mode is left as it is: the KL scan swaps modules in every pass, and setting every
    # module's mode and back walks the whole model twice (about 3 ms on SmolLM2-135M, once per pass).
    switch_mode = any(module.training for module in model.modules())
    try:
        for p in trainable:
            p.requires_grad_(False)
        if switch_mode:
            model.eval()
        for name, module in replacements.items():
            model.set_submodule(name, module)
        yield
    finally:
        for name, module in originals.items():
            model.set_submodule(name, module)
        for p in trainable:
            p.requires_grad_(True)
        if switch_mode:
            model.train(was_training)


@contextmanager
def emulate_format_map(
    model: nn.Module,
    format_map: Mapping[str, str],
    block_size: int = 32,
    quantize_activations: bool = True,
    scale_rule: str = "ocp",
    *,
    in_step_with: Sequence[str] = (),
) -> Iterator[None]:
    """Temporarily quantize the linears named in `format_map` (weights and activations) to their formats.

    Inside the block each named linear is an `MXLinear` built from it (`mx_linears_from`: the inference module), so
    an assignment is evaluated exactly as a saved dMX model computes. Weights are frozen and the model is in eval
    mode inside the block; the original linears are restored on exit. `in_step_with`: as `mx_linears_from`'s.
    """
    layers = mx_linears_from(model, format_map, block_size, quantize_activations, scale_rule, in_step_with=in_step_with)
    with swapped_modules(model, layers):
        yield


def mx_linears_from(
    model: nn.Module,
    format_map: Mapping[str, str],
    block_size: int = 32,
    quantize_activations: bool = True,
    scale_rule: str = "ocp",
    *,
    in_step_with: Sequence[str] = (),
) -> dict[str, MXLinear]:
    """An `MXLinear` built from each linear named in `format_map`, in its format, by name; the model is unchanged.

    Each is the inference module (packed weight, input quantized per call), and they share one input cache: linears
    that read the same input in the same format quantize it once. A weight sharded by FSDP2 or offloaded by
    accelerate is gathered or loaded to be packed (`placement`).

    `in_step_with` names linears whose sharded weights are gathered first, in its order, whether `format_map` names
    them or not: processes of a sharded model that quantize different linears (the KL scan's passes) then make the
    same collective calls.
    """
    input_casts = InputCache()
    layers = {}
    for name in [*in_step_with, *(name for name in format_map if name not in in_step_with)]:
        if name not in format_map and not is_sharded(model.get_submodule(name)):
            continue  # nothing to pack, and no collective call to match
        with loaded_weights(model, name) as linear:  # a sharded or offloaded weight, gathered or loaded
            if name not in format_map:
                continue  # gathered only to keep the processes' collective calls in step
            layers[name] = MXLinear.from_linear(
                linear,
                format_map[name],
                block_size=block_size,
                quantize_activations=quantize_activations,
                scale_rule=scale_rule,
            )
        layers[name].input_casts = input_casts
    return layers


def replace_with_mx_linear(
    model: nn.Module,
    format_map: Mapping[str, str],
    *,
    block_size: int = 32,
    quantize_activations: bool = True,
    scale_rule: str = "ocp",
    input_transforms: Mapping[str, dict] | None = None,
) -> nn.Module:
    """Replace, in place, every `nn.Linear` named in `format_map` by an `MXLinear` in its format.

    Weights are packed from the float linears (an offloaded or sharded weight is loaded or gathered for it: the
    packed module lives on the device the linear computes on); on a meta-device skeleton the new modules are empty
    and wait for a packed checkpoint. `input_transforms` (module name -> `RandomizedHadamard.to_dict()`, as
    config.json records them) gives modules their online input transform; a `TransformedLinear` keeps its own.
    Raises `ValueError` naming the module when `format_map` names a module the model lacks, a module that is not an
    `nn.Linear`, or one that is already an `MXLinear` (the model was already quantized: quantizing twice would
    compound the error).

    The new modules share one `InputCache`: linears reading the same input in the same format quantize it once.
    """
    input_casts = InputCache()
    for name, fmt in format_map.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"format_map names module {name!r}, which {type(model).__name__} does not have") from None
        if isinstance(module, MXLinear):
            raise ValueError(
                f"module {name!r} is already an MXLinear ({module.fmt.name}): the model is already dMX-quantized"
            )
        if not isinstance(module, nn.Linear):
            kind = type(module).__name__
            raise ValueError(f"format_map names module {name!r}, a {kind}; only nn.Linear can be quantized")
        spec = (input_transforms or {}).get(name)
        with loaded_weights(model, name):  # a sharded or offloaded weight, gathered or loaded to be packed
            new = MXLinear.from_linear(
                module,
                fmt,
                block_size=block_size,
                quantize_activations=quantize_activations,
                scale_rule=scale_rule,
                input_transform=None if spec is None else RandomizedHadamard.from_dict(spec),
            )
        new.input_casts = input_casts
        model.set_submodule(name, new)
    return model


def dequantize_mx_linears(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace, in place, every `MXLinear` by an `nn.Linear` holding its dequantized (MX-valued) weight.

    The float model computes what the MX weights hold, without activation quantization; a module with an
    online input transform becomes a `TransformedLinear` that keeps it. `dtype` defaults
    to each module's bias dtype (float32 when it has none).
    """
    for name, module in list(model.named_modules()):
        if not isinstance(module, MXLinear):
            continue
        target = dtype or (module.bias.dtype if module.bias is not None else torch.float32)
        linear = nn.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=module.weight_packed.device,
            dtype=target,
        )
        with torch.no_grad():
            linear.weight.copy_(module.dequantized_weight(target))
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        if module.input_transform is not None:
            linear = TransformedLinear(linear, module.input_transform)
        model.set_submodule(name, linear)
    return model
