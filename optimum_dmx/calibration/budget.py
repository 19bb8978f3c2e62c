"""Meeting a bit budget with a discrete format map: the high format goes to the layers that want it most.

Every method that ends with a ranking of the layers (dMX's learned offsets, KL pre-selection's sensitivities)
turns it into a format map with `budget_format_map`, so they meet the budget by the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..continuous import FormatPair
from ..nn.bits import average_bits, tensor_sizes

BUDGET_TOLERANCE = 0.05  # bits: how far from the target a budget-exact map may land when layers are coarse


def budget_format_map(
    priority: Mapping[str, float],
    weight_shapes: Mapping[str, Sequence[int]],
    pair: FormatPair,
    target_bits: float,
    bit_average: str = "simple",
    quantize_activations: bool = True,
    tolerance: float = BUDGET_TOLERANCE,
    groups: Sequence[Sequence[str]] = (),
) -> dict[str, str]:
    """The pair's high format for the highest-priority layers that fit the budget, the low format elsewhere.

    In decreasing priority (ties: model order), a layer takes the high format if the average bits (in
    `bit_average`) stay at or below `target_bits`; a layer that does not fit is skipped and the next one is
    tried (a smaller one may fit the size-weighted average). When that leaves the average more than
    `tolerance` below the target (a model with few, or very unequal, layers), the highest-priority remaining
    layers that keep it within `target_bits + tolerance` are raised too. The result is the closest map to the
    target that this order allows, never above `target_bits + tolerance`.

    `groups` (disjoint sets of layer names, e.g. `calibration.groups.offset_groups`) move as one: a group takes
    the high format whole or not at all, ranked by its members' mean priority (the gain per layer raised).
    """
    names = list(priority)
    missing = [name for name in names if name not in weight_shapes]
    if missing:
        raise ValueError(f"no weight shape for {len(missing)} layers, e.g. {missing[:3]}")
    sizes = tensor_sizes([tuple(weight_shapes[name])[-2:] for name in names], quantize_activations)
    position = {name: i for i, name in enumerate(names)}
    grouped = {name for group in groups for name in group}
    units = sorted(
        [[position[name] for name in group] for group in groups]
        + [[i] for i, name in enumerate(names) if name not in grouped]
    )  # model order
    unit_priority = [sum(priority[names[i]] for i in unit) / len(unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: -unit_priority[u])  # stable: ties keep model order
    bits = torch.full((len(names),), float(pair.low.bits), dtype=torch.float64)

    def fill(limit: float) -> None:
        for u in order:
            members = units[u]
            if bits[members[0]] == pair.high.bits:
                continue
            bits[members] = pair.high.bits
            if average_bits(bits, bit_average, sizes).item() > limit + 1e-9:
                bits[members] = pair.low.bits
            elif limit > target_bits:
                return  # beyond the target, one more unit at a time only while still short

    fill(target_bits)
    while average_bits(bits, bit_average, sizes).item() < target_bits - tolerance:
        before = bits.clone()
        fill(target_bits + tolerance)
        if torch.equal(bits, before):
            break  # nothing more fits in the band
    return {name: (pair.high if b == pair.high.bits else pair.low).name for name, b in zip(names, bits.tolist())}


def blended_priority(
    offsets: Mapping[str, float], sensitivities: Mapping[str, float], kl_weight: float
) -> dict[str, float]:
    """`(1 - kl_weight) * rank(offset) + kl_weight * rank(sensitivity)` per layer, ranks as fractions in `[0, 1]`
    (0: lowest). Ranks, not values: the two signals have unrelated scales (nats per token vs loss per offset)."""
    names = list(offsets)
    if set(sensitivities) != set(names):
        raise ValueError("offsets and sensitivities must name the same layers")
    denominator = max(len(names) - 1, 1)

    def ranks(values: Mapping[str, float]) -> dict[str, float]:
        order = sorted(names, key=lambda name: values[name])
        return {name: index / denominator for index, name in enumerate(order)}

    by_offset, by_sensitivity = ranks(offsets), ranks(sensitivities)
    return {name: (1 - kl_weight) * by_offset[name] + kl_weight * by_sensitivity[name] for name in names}
