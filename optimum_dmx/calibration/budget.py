"""Meeting a budget with a discrete format map: the high format goes to the layers that gain most per unit of cost.

Every method that ends with a value per layer (dMX's learned offsets, KL pre-selection's sensitivities) turns it
into a format map with `budget_format_map`, so they meet the budget by the same rule: a greedy knapsack that takes
layers in decreasing value per unit of cost that raising them adds. What a layer costs in a format is data
(`layer_costs`): its element bits in the simple (per-layer) average, where every layer costs the same and the
order is that of the values; its element bits times its size in the weighted (per-element) average, where a large
layer must be worth proportionally more than a small one to go first; or any per-format, per-shape table, such as
a latency measured on a serving target or the stored bytes (`storage_cost_table`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence

import torch

from ..continuous import FormatPair
from ..formats import get_format
from ..formats.spec import packed_bits
from ..nn.bits import BIT_AVERAGES, tensor_sizes

BUDGET_TOLERANCE = 0.05  # bits: how far from the target a budget-exact map may land when layers are coarse

CostTable = Mapping[str, Mapping[str, float]]  # format name -> "OUTxIN" weight shape -> what one such layer costs


def shape_key(shape: Sequence[int]) -> str:
    """A cost table's key for a linear of weight shape `(out_features, in_features)`: `"OUTxIN"`."""
    out_features, in_features = tuple(shape)[-2:]
    return f"{out_features}x{in_features}"


def storage_cost_table(
    weight_shapes: Iterable[Sequence[int]], formats: Iterable[str], block_size: int = 32
) -> dict[str, dict[str, float]]:
    """The bits each weight shape takes stored in each format (padded codes and E8M0 scales): a budget in bytes."""
    shapes = {shape_key(shape): tuple(shape)[-2:] for shape in weight_shapes}
    table = {}
    for fmt in map(get_format, formats):
        table[fmt.name] = {key: float(packed_bits(shape, fmt.bits, block_size)) for key, shape in shapes.items()}
    return table


def layer_costs(
    weight_shapes: Sequence[Sequence[int]],
    pair: FormatPair,
    bit_average: str = "simple",
    quantize_activations: bool = True,
    cost_table: CostTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's cost in the pair's low and in its high format, in the units a budget caps the sum of.

    Without `cost_table`: element bits, times `n_i / mean(n)` in the weighted average (`nn.bits.tensor_sizes`),
    so that a sum over the layers divided by their count is the average bits. With one: its entry for the format
    and the layer's shape (`shape_key`); a missing entry is an error that names it.
    """
    if cost_table is not None:
        keys = [shape_key(shape) for shape in weight_shapes]
        costs = []
        for fmt in (pair.low, pair.high):
            table = cost_table.get(fmt.name, {})
            missing = sorted({key for key in keys if key not in table})
            if missing:
                raise ValueError(
                    f"cost_table has no cost for {fmt.name} at weight shape(s) {', '.join(missing)}: it needs one "
                    f"for each format of the pair ({pair.low.name}, {pair.high.name}) and every quantized shape"
                )
            costs.append(torch.tensor([float(table[key]) for key in keys], dtype=torch.float64))
        return costs[0], costs[1]
    if bit_average == "simple":
        weights = torch.ones(len(weight_shapes), dtype=torch.float64)
    elif bit_average == "weighted":
        sizes = tensor_sizes([tuple(shape)[-2:] for shape in weight_shapes], quantize_activations)
        weights = sizes / sizes.mean()
    else:
        raise ValueError(f"bit average {bit_average!r} is not supported; allowed: {', '.join(BIT_AVERAGES)}.")
    return weights * pair.low.bits, weights * pair.high.bits


def budget_limit(low: torch.Tensor, high: torch.Tensor, pair: FormatPair, bits: float) -> float:
    """The total cost that `bits` allows: placed between the all-low and the all-high totals as `bits` lies between
    the pair's element bits (for the bit tables, exactly `bits` times the layer count)."""
    fraction = (bits - pair.low.bits) / (pair.high.bits - pair.low.bits)
    return (low.sum() + fraction * (high.sum() - low.sum())).item()


def bits_at_cost(low: torch.Tensor, high: torch.Tensor, pair: FormatPair, cost: float) -> float:
    """The inverse of `budget_limit`: the bits whose budget is the total `cost` (for the bit tables, a map of that
    total cost averages exactly these bits)."""
    fraction = (cost - low.sum().item()) / (high.sum() - low.sum()).item()
    return pair.low.bits + fraction * (pair.high.bits - pair.low.bits)


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
    cost_table: CostTable | None = None,
    warn_when_short: bool = True,
) -> dict[str, str]:
    """The pair's high format for the layers worth most per unit of cost that fit the budget, the low format
    elsewhere.

    The budget: the layers' total cost (`layer_costs`: bits in `bit_average`, or `cost_table`'s) at most
    `budget_limit(target_bits)`. `priority` is each layer's value: what raising it gains (a loss decrease,
    comparable across layers). With `per_bit` (default) layers are taken in decreasing value per unit of cost that
    raising them adds, a greedy knapsack (a raise that costs nothing comes first); with `per_bit=False`,
    `priority` is only an order (a random draw, the paper's `beta_hat`) and layers are taken in decreasing
    priority. The two orders are the same in the simple average.

    In that order (ties: model order), a layer takes the high format if the total stays within the budget; a
    layer that does not fit is skipped and the next one is tried (a cheaper one may fit). When that leaves the
    total more than `tolerance` bits' worth below the budget (a model with few, or very unequal, layers), the
    first remaining layers that keep it within `target_bits + tolerance` are raised too. The result is the closest
    map to the target that this order allows, never above `target_bits + tolerance`.

    `groups` (disjoint sets of layer names, e.g. `calibration.groups.offset_groups`) move as one: a group takes
    the high format whole or not at all, worth its members' summed value over their summed cost (with
    `per_bit=False`: their mean priority).

    A map still more than `tolerance` below the target when no unit fits any more (units too coarse for it: a
    small model, or a mixture of experts whose layer's experts are a large share of the weights) comes with a
    `RuntimeWarning` that gives the bits reached, what raising the cheapest unit left would reach, and that unit
    (`warn_when_short=False`: silent, for the maps calibration draws at every step).
    """
    names = list(priority)
    missing = [name for name in names if name not in weight_shapes]
    if missing:
        raise ValueError(f"no weight shape for {len(missing)} layers, e.g. {missing[:3]}")
    position = {name: i for i, name in enumerate(names)}
    grouped = {name for group in groups for name in group}
    units = sorted(
        [[position[name] for name in group] for group in groups]
        + [[i] for i, name in enumerate(names) if name not in grouped]
    )  # model order
    low, high = layer_costs([weight_shapes[n] for n in names], pair, bit_average, quantize_activations, cost_table)
    raise_cost = [(high[unit] - low[unit]).sum().item() for unit in units]

    def unit_priority(u: int) -> float:
        value = sum(priority[names[i]] for i in units[u])
        if not per_bit:
            return value / len(units[u])  # an order: the members' mean
        return value / raise_cost[u] if raise_cost[u] > 0 else math.inf

    order = sorted(range(len(units)), key=lambda u: -unit_priority(u))  # stable: ties keep model order
    limit = budget_limit(low, high, pair, target_bits)
    band = budget_limit(low, high, pair, target_bits + tolerance) - limit
    slack = 1e-9 * (high.sum() - low.sum()).item() / (pair.high.bits - pair.low.bits)  # float rounding, in cost
    raised = [False] * len(units)
    spent = low.sum().item()

    def fill(cap: float) -> None:
        nonlocal spent
        for u in order:
            if raised[u] or spent + raise_cost[u] > cap + slack:
                continue
            raised[u], spent = True, spent + raise_cost[u]
            if cap > limit:
                return  # beyond the target, one more unit at a time only while still short

    fill(limit)
    while spent < limit - band:
        before = list(raised)
        fill(limit + band)
        if raised == before:
            break  # nothing more fits in the band
    left = [u for u, up in enumerate(raised) if not up and raise_cost[u] > 0] if warn_when_short else []
    if left and spent < limit - band - slack:
        cheapest = min(left, key=raise_cost.__getitem__)
        reached, reachable = (bits_at_cost(low, high, pair, c) for c in (spent, spent + raise_cost[cheapest]))
        _warn_short([names[i] for i in units[cheapest]], reached, reachable, pair.high.name, target_bits, tolerance)
    high_layers = {names[i] for u, unit in enumerate(units) if raised[u] for i in unit}
    return {name: (pair.high if name in high_layers else pair.low).name for name in names}


def _warn_short(
    members: Sequence[str], reached: float, reachable: float, high: str, target_bits: float, tolerance: float
) -> None:
    """Warn that the budget rule's map is short of `target_bits` by more than `tolerance`: it `reached` these bits,
    and raising the cheapest unit left (`members`) to the format `high` would reach `reachable`."""
    unit = members[0] if len(members) == 1 else f"{members[0]} with {len(members) - 1} more layer(s) sharing its format"
    warnings.warn(
        f"optimum-dmx: the format map reaches {reached:.3f} average bits, short of target_bits={target_bits} by more "
        f"than the budget's tolerance of {tolerance}: the cheapest raise left, {unit} to {high}, would reach "
        f"{reachable:.3f}. The quantized layers are too coarse for this target.",
        RuntimeWarning,
        stacklevel=3,
    )


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
