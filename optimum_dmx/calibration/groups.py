"""Offset groups: layers that share one format offset, so that they always get the same format.

Serving engines fuse q/k/v and gate/up into one matmul with one format, and run a mixture-of-experts layer's
experts with one format (`nn.groups`); calibrating them with one shared offset makes every learned map servable.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..nn.groups import serving_groups

OFFSET_GROUPINGS = ("none", "fused")


def validate_offset_groups(offset_groups: str | Sequence[Sequence[str]]) -> str | list[list[str]]:
    """`"none"`, `"fused"`, or explicit groups (lists of module names); raise naming what is allowed."""
    if isinstance(offset_groups, str):
        if offset_groups not in OFFSET_GROUPINGS:
            raise ValueError(
                f"offset_groups={offset_groups!r} is not supported; allowed: {', '.join(OFFSET_GROUPINGS)}"
                " or a list of module-name lists."
            )
        return offset_groups
    if not isinstance(offset_groups, (list, tuple)) or not all(
        isinstance(g, (list, tuple)) and g and all(isinstance(n, str) for n in g) for g in offset_groups
    ):
        raise ValueError(
            f"offset_groups={offset_groups!r} must be 'none', 'fused' or a list of non-empty lists of module names."
        )
    names = [name for group in offset_groups for name in group]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"offset_groups names {repeated[:3]} in more than one group; groups must be disjoint.")
    return [list(group) for group in offset_groups]


def offset_groups(setting: str | Sequence[Sequence[str]], layer_names: Sequence[str]) -> list[tuple[str, ...]]:
    """The groups of `layer_names` that share an offset under `setting` (groups of one are left out).

    Raises `ValueError` when explicit groups name a layer that is not calibrated.
    """
    setting = validate_offset_groups(setting)
    if setting == "none":
        return []
    if setting == "fused":
        return serving_groups(layer_names)
    known = set(layer_names)
    unknown = sorted(name for group in setting for name in group if name not in known)
    if unknown:
        raise ValueError(f"offset_groups names {len(unknown)} modules that are not calibrated, e.g. {unknown[:3]}")
    return [tuple(group) for group in setting if len(group) > 1]
