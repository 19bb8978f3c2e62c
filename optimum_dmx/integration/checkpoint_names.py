"""How transformers names a model's tensors in its checkpoints, from its conversion mapping for the model.

Some families' checkpoints name modules otherwise than transformers' classes do: Mixtral's say `block_sparse_moe`
for `mlp` (a renaming, which `save_pretrained` applies in reverse), and store each expert's projections as `w1`
(gate), `w3` (up) and `w2` (down), which transformers merges into its packed experts' `gate_up_proj` and `down_proj`
while loading (a converter, which `save_pretrained` reverses only for the packed tensors). dMX saves a layer's
experts as one linear per expert under transformers' projection names, so that its own loading reads them back; an
export for another loader writes them under the family's checkpoint names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key

from ..nn.experts import PROJECTIONS

__all__ = ["checkpoint_key_renaming", "converted_weight_target", "expert_projection_names"]

# transformers' packed experts tensors and the per-expert projections merged into each, in order.
_MERGED_PROJECTIONS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}


def checkpoint_key_renaming(model: nn.Module) -> Callable[[str], str]:
    """The name in `model` that transformers loads a checkpoint key into, by its renamings for this model (the
    reverse of what `save_pretrained` applied: Mixtral's checkpoints say `block_sparse_moe` for `mlp`). A packed
    tensor never matches one of its converters (they merge float experts' `weight`s)."""
    renamings = [
        transform for transform in get_model_conversion_mapping(model) if isinstance(transform, WeightRenaming)
    ]
    return functools.partial(apply_renamings, weight_renamings=renamings)


def converted_weight_target(model: nn.Module) -> Callable[[str], str | None]:
    """For a checkpoint key, the tensor of `model` that one of transformers' converters for this model builds from it
    while loading, or None when no converter reads it (it loads as it is, renamed at most). Only converters of
    `weight`s count: those merging a mixture of experts' per-expert weights into its packed experts
    (`model.layers.0.mlp.experts.gate_up_proj`), or concatenating OLMo-Hybrid's q/k/v convolutions, stored apart, into
    one (`model.layers.0.linear_attn.conv1d.weight`). A loader that quantizes (compressed-tensors) runs its
    decompression before each of them (`HfQuantizer.update_weight_conversions`)."""
    transforms = get_model_conversion_mapping(model)
    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    converters = [
        transform
        for transform in transforms
        if isinstance(transform, WeightConverter)
        and all(source.endswith(".weight") for source in transform._original_source_patterns)
    ]

    def target(key: str) -> str | None:
        renamed, converter_source = rename_source_key(key, renamings, converters)
        return None if converter_source is None else renamed

    return target


def expert_projection_names(model: nn.Module) -> dict[str, str]:
    """Each expert projection's name (`nn.experts.PROJECTIONS`) in the checkpoints of `model`'s family, read from the
    converters that merge them into packed experts (Mixtral: `{"gate_proj": "w1", "up_proj": "w3", "down_proj":
    "w2"}`); a projection no converter names keeps its own name."""
    names = dict(zip(PROJECTIONS, PROJECTIONS))
    for transform in get_model_conversion_mapping(model):
        if not isinstance(transform, WeightConverter) or len(transform._original_target_patterns) != 1:
            continue
        target, sources = transform._original_target_patterns[0], transform._original_source_patterns
        for merged, projections in _MERGED_PROJECTIONS.items():
            if target.endswith(merged) and len(sources) == len(projections):  # sources: ".experts.*.w1.weight"
                names.update({projection: source.split(".")[-2] for projection, source in zip(projections, sources)})
    return names
