"""Fused-projection groups: linears that serving engines run as one matmul, so they need one format.

vLLM and SGLang load q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` and run each with a single
quantization scheme. The Llama, Qwen, Gemma and Mistral families name these projections alike, so the groups
are found from module names: siblings under one parent whose last names form a known set. vLLM also runs a
mixture-of-experts layer's experts (`nn.experts.LinearExperts`: `<layer>.experts.<e>.gate_proj`, `.up_proj`,
`.down_proj`) as one fused operation with one scheme, so all of them form one group (`expert_groups`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .experts import PROJECTIONS

__all__ = [
    "FUSED_PROJECTIONS",
    "expert_groups",
    "experts_module",
    "experts_wildcard",
    "fused_projection_groups",
    "mixed_groups",
    "serving_groups",
]

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


# An expert's projection, as `nn.experts.LinearExperts` names it: (experts module, expert index, projection).
_EXPERT_LINEAR = re.compile(rf"(.*\bexperts)\.(\d+)\.({'|'.join(PROJECTIONS)})")


def expert_groups(module_names: Iterable[str]) -> list[tuple[str, ...]]:
    """The linears of each mixture-of-experts layer among `module_names`, one group per experts module, by expert
    index and then projection (gate, up, down)."""
    members: dict[str, list[tuple[int, int, str]]] = {}
    for name in module_names:
        match = _EXPERT_LINEAR.fullmatch(name)
        if match:
            parent, index, projection = match.groups()
            members.setdefault(parent, []).append((int(index), PROJECTIONS.index(projection), name))
    return [tuple(name for *_, name in sorted(group)) for _, group in sorted(members.items()) if len(group) > 1]


def experts_module(expert_linear: str) -> str:
    """The experts module `<layer>.experts` of an expert's linear `<layer>.experts.<e>.<projection>`."""
    return expert_linear.rpartition(".")[0].rpartition(".")[0]


def experts_wildcard(name: str) -> str:
    """`name` with an expert's index replaced by `*` (`<layer>.experts.*.<projection>`), so that one name stands for
    a projection of all of a layer's experts; any other name unchanged."""
    match = _EXPERT_LINEAR.fullmatch(name)
    return f"{match.group(1)}.*.{match.group(3)}" if match else name


def serving_groups(module_names: Iterable[str]) -> list[tuple[str, ...]]:
    """The groups of `module_names` a serving engine runs with one format: each mixture-of-experts layer's experts
    (`expert_groups`), and the fused projections (`fused_projection_groups`) of the other linears."""
    names = list(module_names)
    experts = expert_groups(names)
    in_experts = {name for group in experts for name in group}
    return experts + fused_projection_groups(name for name in names if name not in in_experts)


def mixed_groups(format_map: Mapping[str, str]) -> list[tuple[str, ...]]:
    """The serving groups of `format_map` (`serving_groups`) whose members do not all have the same format."""
    return [group for group in serving_groups(format_map) if len({format_map[n] for n in group}) > 1]
