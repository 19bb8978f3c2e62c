"""Meeting a bit budget with a discrete format map: the high format goes to the layers that gain most per bit.

Every method that ends with a value per layer (dMX's learned offsets, KL pre-selection's sensitivities) turns it
into a format map with `budget_format_map`, so they meet the budget by the same rule: a greedy knapsack that takes
layers in decreasing value per bit they add to the average. In the simple (per-layer) average every layer adds the
same bits, so this is the order of the values; in the weighted (per-element) average a small layer costs less than
a large one, and a large layer must be worth proportionally more to be raised first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..continuous import FormatPair
from ..nn.bits import average_bits, tensor_sizes

BUDGET_TOLERANCE = 0.05  # bits: how far from the target a budget-exact map may land when layers are coarse


def relative_costs(
    weight_shapes: Sequence[Sequence[int]], bit_average: str = "simple", quantize_activations: bool = True
) -> torch.Tensor:
    """What raising each layer to the high format adds to the average bits, relative to the mean layer: 1 for
    every layer in the simple average, `n_i / mean(n)` in the weighted one (`nn.bits.tensor_sizes`)."""
    if bit_average == "simple":
        return torch.ones(len(weight_shapes), dtype=torch.float64)
    sizes = tensor_sizes([tuple(shape)[-2:] for shape in weight_shapes], quantize_activations)
    if bit_average == "weighted":
        return sizes / sizes.mean()
    raise ValueError(f"bit average {bit_average!r} is not supported; allowed: simple, weighted.")


def budget_format_map(
    priority: Mapping[str, float],
    weight_shapes: Mapping[str, Sequence[int]],
    pair: FormatPair,
    target_bits: float,
    bit_average: str = "simple",
    quantize_activations: bool = True,
    tolerance: float = BUDGET_TOLERANCE,
    groups: Sequence[Sequence[str]] = (),
    per_bit: bool = True,
) -> dict[str, str]:
    """The pair's high format for the layers worth most per bit that fit the budget, the low format elsewhere.

    `priority` is each layer's value: what raising it gains (a loss decrease, comparable across layers). With
    `per_bit` (default) layers are taken in decreasing value per bit they add to the average (`relative_costs`),
    a greedy knapsack; with `per_bit=False`, `priority` is only an order (a random draw, the paper's `beta_hat`)
    and layers are taken in decreasing priority. The two orders are the same in the simple average.

    In that order (ties: model order), a layer takes the high format if the average bits (in
    `bit_average`) stay at or below `target_bits`; a layer that does not fit is skipped and the next one is
    tried (a smaller one may fit the size-weighted average). When that leaves the average more than
    `tolerance` below the target (a model with few, or very unequal, layers), the highest-priority remaining
    layers that keep it within `target_bits + tolerance` are raised too. The result is the closest map to the
    target that this order allows, never above `target_bits + tolerance`.

    `groups` (disjoint sets of layer names, e.g. `calibration.groups.offset_groups`) move as one: a group takes
    the high format whole or not at all, ranked by its members' summed value over their summed cost (with
    `per_bit=False`: their mean priority).
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
    # An order (per_bit=False) counts every layer as one: a unit's priority is then its members' mean.
    shapes = [weight_shapes[name] for name in names]
    costs = relative_costs(shapes, bit_average if per_bit else "simple", quantize_activations)
    unit_priority = [sum(priority[names[i]] for i in unit) / costs[unit].sum().item() for unit in units]
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


def blended_value(
    offsets: Mapping[str, float], sensitivities: Mapping[str, float], kl_weight: float
) -> dict[str, float]:
    """`(1 - kl_weight) * offset / scale(offsets) + kl_weight * sensitivity / scale(sensitivities)` per layer, each
    signal in units of its mean magnitude over the layers (`scale`, finite values only).

    Values, not ranks: a knapsack over layers of unequal cost (the weighted average) weighs how much more one layer
    gains than another, which ranks discard. A layer whose offset was never measured (infinite) stays infinite.
    """
    names = list(offsets)
    if set(sensitivities) != set(names):
        raise ValueError("offsets and sensitivities must name the same layers")

    def scaled(values: Mapping[str, float]) -> dict[str, float]:
        finite = [abs(values[name]) for name in names if math.isfinite(values[name])]
        scale = sum(finite) / len(finite) if finite and sum(finite) > 0 else 1.0
        return {name: values[name] / scale for name in names}

    by_offset, by_sensitivity = scaled(offsets), scaled(sensitivities)
    return {name: (1 - kl_weight) * by_offset[name] + kl_weight * by_sensitivity[name] for name in names}
