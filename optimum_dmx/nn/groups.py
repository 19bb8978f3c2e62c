"""Fused-projection groups: linears that serving engines run as one matmul, so they need one format.

vLLM and SGLang load q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` and run each with a single
quantization scheme. The Llama, Qwen, Gemma and Mistral families name these projections alike, so the groups
are found from module names: siblings under one parent whose last names form a known set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["FUSED_PROJECTIONS", "fused_projection_groups", "mixed_groups"]

# Fused name -> the projections it is made of, as transformers' decoder families name them.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_projection_groups(module_names: Iterable[str]) -> list[tuple[str, ...]]:
    """The groups of `module_names` that an engine fuses, each as full module names in projection order.

    A group is formed when all its projections are present under the same parent module; partial sets (a
    projection excluded from quantization, say) form no group.
    """
    names = set(module_names)
    parents = sorted({name.rpartition(".")[0] for name in names})
    groups = []
    for parent in parents:
        prefix = parent + "." if parent else ""
        for members in FUSED_PROJECTIONS.values():
            full = tuple(prefix + member for member in members)
            if all(name in names for name in full):
                groups.append(full)
    return groups


def mixed_groups(format_map: Mapping[str, str]) -> list[tuple[str, ...]]:
    """The fused-projection groups of `format_map` whose members do not all have the same format."""
    return [group for group in fused_projection_groups(format_map) if len({format_map[n] for n in group}) > 1]
