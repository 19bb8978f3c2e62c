"""Budgets are kept: with the default recipe, from 20 steps on, for both pairs and both averages, the achieved
average bits land within 0.05 of `target_bits`, never above; and the budget rule itself."""

import math
import re
import warnings

import pytest
import torch

from optimum_dmx.calibration import CalibrationSettings, PaperRecipe, calibrate
from optimum_dmx.calibration.budget import BUDGET_TOLERANCE, budget_format_map
from optimum_dmx.continuous import FORMAT_PAIRS
from optimum_dmx.nn import average_bits, tensor_sizes

from .helpers import sensitive_llama_and_data, tiny_llama

TARGETS = {"mxfp8-mxfp4": [4.5, 5.0, 6.0, 7.3], "mxfp6-mxfp4": [4.5, 5.0, 5.5]}


@pytest.fixture(scope="module")
def deep():
    """A 7-layer tiny Llama: 49 decoder linears, fine-grained enough for a +-0.05 budget in either average."""
    model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=7)
    ids = torch.randint(0, model.config.vocab_size, (40, 16), generator=torch.Generator().manual_seed(0))
    return model, ids


def achieved(result, bit_average: str) -> float:
    return result.bits_simple if bit_average == "simple" else result.bits_weighted


@pytest.mark.parametrize("bit_average", ["simple", "weighted"])
@pytest.mark.parametrize("pair, target", [(p, t) for p, ts in TARGETS.items() for t in ts])
def test_default_recipe_keeps_the_budget_in_20_steps(deep, pair, target, bit_average):
    model, ids = deep
    settings = CalibrationSettings(
        target_bits=target,
        format_pair=pair,
        bit_average=bit_average,
        steps=20,
        batch_size=2,
        seq_len=16,
        num_samples=40,
    )
    result = calibrate(model, ids, settings, progress=False)
    bits = achieved(result, bit_average)
    assert target - BUDGET_TOLERANCE - 1e-9 <= bits <= target + BUDGET_TOLERANCE + 1e-9, bits
    assert set(result.format_map.values()) <= {FORMAT_PAIRS[pair].low.name, FORMAT_PAIRS[pair].high.name}


@pytest.mark.parametrize("steps", [20, 60])
def test_the_paper_trainer_keeps_it_too_with_the_budget_rule(deep, steps):
    model, ids = deep
    settings = CalibrationSettings(
        method="paper",
        paper=PaperRecipe(discretization="budget"),
        target_bits=5.5,
        steps=steps,
        batch_size=2,
        seq_len=16,
        num_samples=40,
    )
    result = calibrate(model, ids, settings, progress=False)
    assert abs(result.bits_simple - 5.5) <= BUDGET_TOLERANCE + 1e-9


def test_the_papers_procedure_is_selectable_and_misses_the_budget_at_a_short_run(deep):
    """method="paper": SGD at lr 1 and `beta_hat >= 1`; 20 steps leave every offset near 0 (all MXFP4)."""
    model, ids = deep
    settings = CalibrationSettings(method="paper", target_bits=6.0, steps=20, batch_size=2, seq_len=16, num_samples=40)
    assert settings.discretization == "threshold" and settings.paper.lr == 1.0
    result = calibrate(model, ids, settings, progress=False)
    assert result.bits_simple < 5.0  # what the budget rule of the default recipe fixes
    for name, fmt in result.format_map.items():
        assert (fmt == "mxfp8_e4m3") == (result.beta_hat[name] >= 1.0)


def test_the_simple_regularizer_has_no_target_it_reaches_what_lambda_gives(deep):
    """regularizer="simple" sets no budget (the threshold rule decides): a strong size penalty ends at the bottom
    of the pair whatever `target_bits` says, and no penalty at all lets the task loss raise layers."""
    model, ids = deep
    common = dict(method="paper", target_bits=6.0, steps=20, batch_size=2, seq_len=16, num_samples=40)

    def recipe(reg_lambda: float) -> PaperRecipe:
        return PaperRecipe(regularizer="simple", lr=50.0, reg_lambda=reg_lambda)

    assert CalibrationSettings(**common, paper=recipe(50.0)).discretization == "threshold"
    penalized = calibrate(model, ids, CalibrationSettings(**common, paper=recipe(50.0)), progress=False)
    assert penalized.bits_simple == 4.0
    free = calibrate(model, ids, CalibrationSettings(**common, paper=recipe(0.0)), progress=False)
    assert free.bits_simple > 4.0 and {h["reg_loss"] for h in free.history} == {0.0}


def test_learned_offsets_carry_the_signal():
    """The default recipe's map has a lower task loss than the map its offsets rank last (same budget)."""
    from optimum_dmx.nn import emulate_format_map

    model, ids = sensitive_llama_and_data(num_samples=24)
    settings = CalibrationSettings(target_bits=6.0, steps=40, batch_size=4, seq_len=32, num_samples=16)
    result = calibrate(model, ids[:16], settings, progress=False)
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in result.format_map}
    reversed_map = budget_format_map(
        {n: -v for n, v in result.beta_hat.items()}, shapes, FORMAT_PAIRS["mxfp8-mxfp4"], 6.0
    )
    assert sum(f == "mxfp8_e4m3" for f in reversed_map.values()) == sum(
        f == "mxfp8_e4m3" for f in result.format_map.values()
    )
    held_out = ids[16:]

    def loss(format_map):
        with torch.no_grad(), emulate_format_map(model, format_map):
            return model(input_ids=held_out, labels=held_out).loss.item()

    assert loss(result.format_map) < loss(reversed_map)


# --- the budget rule -------------------------------------------------------------------------------------


def shapes_of(sizes):
    return {f"l{i}": (out, 64) for i, out in enumerate(sizes)}


@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
@pytest.mark.parametrize("bit_average", ["simple", "weighted"])
def test_budget_rule_is_the_closest_map_below_the_tolerance(pair, bit_average):
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(16, 512, (60,), generator=generator).tolist()
    shapes = shapes_of(sizes)
    priority = dict(zip(shapes, torch.rand(60, generator=generator).tolist()))
    p = FORMAT_PAIRS[pair]
    weights = tensor_sizes(list(shapes.values()))
    for target in torch.linspace(p.min_bits, p.max_bits, 23).tolist():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # within the tolerance: no shortfall warning
            fmap = budget_format_map(priority, shapes, p, target, bit_average)
        bits = torch.tensor(
            [float(p.high.bits if f == p.high.name else p.low.bits) for f in fmap.values()], dtype=torch.float64
        )
        avg = average_bits(bits, bit_average, weights).item()
        assert avg <= target + BUDGET_TOLERANCE + 1e-9
        assert avg >= target - BUDGET_TOLERANCE - 1e-9, (target, avg)


def test_budget_rule_prefers_priority_and_skips_what_does_not_fit():
    p = FORMAT_PAIRS["mxfp8-mxfp4"]
    shapes = shapes_of([64, 64, 64, 64])
    fmap = budget_format_map({"l0": 0.1, "l1": 0.9, "l2": 0.5, "l3": 0.3}, shapes, p, 6.0)
    assert fmap == {"l0": "mxfp4_e2m1", "l1": "mxfp8_e4m3", "l2": "mxfp8_e4m3", "l3": "mxfp4_e2m1"}
    # coarse layers: 4 layers of 4 bits' step each; 5.0 is 1 bit from either neighbour -> the lower one
    fmap = budget_format_map({"l0": 0.1, "l1": 0.9, "l2": 0.5, "l3": 0.3}, shapes, p, 5.0)
    assert list(fmap.values()).count("mxfp8_e4m3") == 1
    # the weighted average skips a large layer that would overshoot and takes a smaller one
    shapes = {"big": (512, 64), "small": (16, 64), "rest": (512, 64)}
    fmap = budget_format_map({"big": 0.9, "small": 0.5, "rest": 0.1}, shapes, p, 4.2, "weighted")
    assert fmap == {"big": "mxfp4_e2m1", "small": "mxfp8_e4m3", "rest": "mxfp4_e2m1"}


def reached_and_reachable(message: str) -> tuple[float, float]:
    """The bits a shortfall warning says the map reaches, and those its cheapest raise left would reach."""
    reached, reachable = re.search(r"reaches (\d\.\d+) average bits.* would reach (\d\.\d+)", message).groups()
    return float(reached), float(reachable)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_map_the_layers_are_too_coarse_for_warns_with_the_bits_it_reaches(grouped):
    """A mixture-of-experts-like model: one layer's experts hold most of the weights. At 5 bits the two small layers
    go high (4.44 bits) and the experts cannot without overshooting (8.0): the map is short, and the warning says
    so with the bits of this map and of the one raise left, each checked against the average of the map built."""
    p = FORMAT_PAIRS["mxfp8-mxfp4"]
    shapes = {"q": (64, 64), "k": (64, 64), "experts.0": (512, 64), "experts.1": (512, 64)}
    values = {"q": 1.0, "k": 1.0, "experts.0": 1.0, "experts.1": 1.0}
    groups = [["experts.0", "experts.1"]] if grouped else []
    weights = tensor_sizes(list(shapes.values()))

    def average(format_map) -> float:
        bits = [float(p.high.bits if f == p.high.name else p.low.bits) for f in format_map.values()]
        return average_bits(torch.tensor(bits, dtype=torch.float64), "weighted", weights).item()

    with pytest.warns(RuntimeWarning, match="too coarse for this target") as record:
        fmap = budget_format_map(values, shapes, p, 5.0, "weighted", groups=groups)
    assert [f for f in fmap.values()] == [p.high.name, p.high.name, p.low.name, p.low.name]
    (message,) = [str(w.message) for w in record]
    reached, reachable = reached_and_reachable(message)
    assert reached == pytest.approx(average(fmap), abs=5e-4)
    raised = {**fmap, **{name: p.high.name for name in groups[0]}} if grouped else {**fmap, "experts.0": p.high.name}
    assert reachable == pytest.approx(average(raised), abs=5e-4)
    unit = "experts.0 with 1 more layer(s) sharing its format" if grouped else "experts.0 to"
    assert unit in message and "target_bits=5.0" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the maps calibration draws at every step stay silent
        budget_format_map(values, shapes, p, 5.0, "weighted", groups=groups, warn_when_short=False)


def test_calibration_warns_once_for_a_target_its_layers_are_too_coarse_for():
    """One decoder layer, seven linears: in the simple average each raise adds 4/7 bits, so 5.0 lies 0.43 above one
    map and 0.14 below the next. The steps draw maps at that budget too; only the result warns."""
    model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(
        target_bits=5.0, bit_average="simple", steps=4, batch_size=2, seq_len=16, num_samples=8
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = calibrate(model, ids, settings, progress=False)
    shortfalls = [str(w.message) for w in record if "too coarse for this target" in str(w.message)]
    assert len(shortfalls) == 1, shortfalls
    reached, reachable = reached_and_reachable(shortfalls[0])
    assert reached == pytest.approx(result.bits_simple, abs=5e-4) and reached == pytest.approx(4 + 4 / 7, abs=5e-4)
    assert reachable == pytest.approx(4 + 8 / 7, abs=5e-4)


def test_the_weighted_budget_takes_layers_by_value_per_bit():
    """A knapsack: four small layers worth 0.3 each beat one large layer worth 1.0 that costs as much as all four
    together; taken as an order (`per_bit=False`) the large one goes first and nothing else fits."""
    p = FORMAT_PAIRS["mxfp8-mxfp4"]
    shapes = {"large": (256, 64), **{f"small{i}": (64, 64) for i in range(4)}, "rest": (1024, 64)}
    values = {"large": 1.0, **{f"small{i}": 0.3 for i in range(4)}, "rest": 0.0}
    weights = tensor_sizes(list(shapes.values()))
    target = 4.0 + 4.0 * weights[1:5].sum().item() / weights.sum().item()  # the four small ones, or "large"
    assert weights[0] < weights[1:5].sum()

    def high(format_map):
        return {name for name, fmt in format_map.items() if fmt == p.high.name}

    knapsack = budget_format_map(values, shapes, p, target, "weighted", tolerance=0.0)
    assert high(knapsack) == {f"small{i}" for i in range(4)}
    by_order = budget_format_map(values, shapes, p, target, "weighted", tolerance=0.0, per_bit=False)
    assert high(by_order) == {"large"}
    assert sum(values[n] for n in high(knapsack)) > sum(values[n] for n in high(by_order))


@pytest.mark.parametrize("grouped", [False, True])
def test_in_the_simple_average_value_per_bit_is_the_order_of_the_values(grouped):
    """Every layer costs the same bits in the simple average: the knapsack is the old rule, groups included."""
    generator = torch.Generator().manual_seed(1)
    shapes = shapes_of(torch.randint(16, 512, (30,), generator=generator).tolist())
    values = dict(zip(shapes, torch.randn(30, generator=generator, dtype=torch.float64).tolist()))
    groups = [["l0", "l1", "l2"], ["l10", "l11"]] if grouped else []
    for target in (4.5, 5.0, 6.0, 7.3):
        p = FORMAT_PAIRS["mxfp8-mxfp4"]
        by_value = budget_format_map(values, shapes, p, target, groups=groups)
        assert by_value == budget_format_map(values, shapes, p, target, groups=groups, per_bit=False)


def test_a_group_is_worth_its_summed_value_over_its_summed_cost():
    """q/k/v-like group: a large member worth 2.0 and a small one worth 0 (0.5 per unit of cost over the group's
    4 units) loses to a single small layer worth 0.6 (0.6 per unit), which wins the one place the budget has;
    by mean priority (an order) the group's 1.0 would have won."""
    p = FORMAT_PAIRS["mxfp8-mxfp4"]
    shapes = {"q": (192, 64), "k": (64, 64), "single": (64, 64), "rest": (1024, 64)}
    values = {"q": 2.0, "k": 0.0, "single": 0.6, "rest": 0.0}
    weights = tensor_sizes(list(shapes.values()))
    target = 4.0 + 4.0 * (weights[0] + weights[1]).item() / weights.sum().item()  # the group, or the single
    groups = [["q", "k"]]
    knapsack = budget_format_map(values, shapes, p, target, "weighted", tolerance=0.0, groups=groups)
    assert [n for n, f in knapsack.items() if f == p.high.name] == ["single"]
    by_order = budget_format_map(values, shapes, p, target, "weighted", tolerance=0.0, groups=groups, per_bit=False)
    assert [n for n, f in by_order.items() if f == p.high.name] == ["q", "k"]


# --- what a layer costs is data ------------------------------------------------------------------------------


@pytest.mark.parametrize("bit_average", ["simple", "weighted"])
def test_a_table_of_bits_is_the_bit_average(bit_average):
    """A cost table holding each format's bits (times the weight's size, for the weighted average) gives the map of
    `bit_average` itself, at every target: the averages are two such tables."""
    from optimum_dmx.calibration.budget import shape_key

    generator = torch.Generator().manual_seed(2)
    shapes = {f"l{i}": (64 * int(k), 64) for i, k in enumerate(torch.randint(1, 9, (40,), generator=generator))}
    values = dict(zip(shapes, torch.rand(40, generator=generator, dtype=torch.float64).tolist()))
    p = FORMAT_PAIRS["mxfp8-mxfp4"]
    table = {
        fmt.name: {shape_key(s): fmt.bits * (s[0] * s[1] if bit_average == "weighted" else 1) for s in shapes.values()}
        for fmt in (p.low, p.high)
    }
    for target in (4.3, 5.0, 6.0, 7.7):
        by_average = budget_format_map(values, shapes, p, target, bit_average, quantize_activations=False)
        assert budget_format_map(values, shapes, p, target, cost_table=table) == by_average


def test_a_latency_table_buys_the_raises_that_cost_least():
    """Same shapes' worth: layers of a shape whose high format is slow are raised last, and a shape whose high
    format is faster than its low one (an emulated low format) is always raised, whatever its value."""
    p = FORMAT_PAIRS["mxfp6-mxfp4"]
    shapes = {"fast0": (64, 64), "fast1": (64, 64), "slow0": (64, 128), "slow1": (64, 128), "free": (32, 64)}
    table = {
        p.low.name: {"64x64": 1.0, "64x128": 1.0, "32x64": 3.0},
        p.high.name: {"64x64": 2.0, "64x128": 5.0, "32x64": 2.0},
    }
    values = {"fast0": 1.0, "fast1": 1.0, "slow0": 2.0, "slow1": 2.0, "free": -1.0}
    # costs: all low 7.0, all high 16.0; 5 bits = half way: 11.5 -> free (-1), fast0, fast1 (+1 each) and no slow
    fmap = budget_format_map(values, shapes, p, 5.0, cost_table=table, tolerance=0.0)
    assert [n for n, f in fmap.items() if f == p.high.name] == ["fast0", "fast1", "free"]
    with pytest.raises(ValueError, match=r"no cost for mxfp6_e2m3 at weight shape\(s\) 32x64"):
        budget_format_map(values, shapes, p, 5.0, cost_table={**table, p.high.name: {"64x64": 2.0, "64x128": 5.0}})


def test_the_stored_bytes_table_counts_codes_scales_and_padding():
    from optimum_dmx.calibration.budget import storage_cost_table
    from optimum_dmx.nn.bits import storage_bits

    table = storage_cost_table([(64, 96), (16, 40)], ["mxfp4", "mxfp8_e4m3"])
    assert table["mxfp4_e2m1"]["64x96"] == 64 * (96 * 4 + 3 * 8)  # three blocks a row, one E8M0 scale each
    assert table["mxfp8_e4m3"]["16x40"] == storage_bits([8], [(16, 40)]) * 16 * 40  # a padded second block


def test_calibration_keeps_a_cost_table_budget(deep):
    """The default method and KL pre-selection meet a cost-table budget (here: the stored bytes) instead of the
    average bits: the map's total cost lands within the tolerance's share of the table's range."""
    from optimum_dmx.calibration import kl_preselection
    from optimum_dmx.calibration.budget import layer_costs, shape_key, storage_cost_table

    model, ids = deep
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if n.endswith("_proj")}
    p = FORMAT_PAIRS["mxfp8-mxfp4"]
    table = storage_cost_table(shapes.values(), [p.low.name, p.high.name])
    low, high = layer_costs(list(shapes.values()), p, cost_table=table)
    common = dict(target_bits=5.0, steps=20, batch_size=2, seq_len=16, num_samples=40, cost_table=table)
    for result in (
        calibrate(model, ids, CalibrationSettings(**common), progress=False),
        kl_preselection(model, ids, CalibrationSettings(method="kl", **common), progress=False),
    ):
        cost = sum(table[fmt][shape_key(shapes[name])] for name, fmt in result.format_map.items())
        share = (cost - low.sum().item()) / (high.sum() - low.sum()).item()
        assert 0.25 - BUDGET_TOLERANCE / 4 - 1e-9 <= share <= 0.25 + BUDGET_TOLERANCE / 4 + 1e-9, share


# --- blending the learned ranking with KL pre-selection's --------------------------------------------------


def test_blended_priority_averages_ranks():
    from optimum_dmx.calibration.budget import blended_priority

    offsets = {"a": 10.0, "b": -1.0, "c": 0.5}
    sensitivities = {"a": 0.001, "b": 0.3, "c": 0.2}
    assert blended_priority(offsets, sensitivities, 0.0) == {"a": 1.0, "b": 0.0, "c": 0.5}
    assert blended_priority(offsets, sensitivities, 1.0) == {"a": 0.0, "b": 1.0, "c": 0.5}
    assert blended_priority(offsets, sensitivities, 0.5) == {"a": 0.5, "b": 0.5, "c": 0.5}
    with pytest.raises(ValueError, match="same layers"):
        blended_priority(offsets, {"a": 1.0}, 0.5)


def test_blended_value_adds_the_signals_in_units_of_their_mean_magnitude():
    from optimum_dmx.calibration.budget import blended_value

    offsets = {"a": 2.0, "b": -1.0, "c": 3.0, "d": math.inf}
    sensitivities = {"a": 0.001, "b": 0.003, "c": 0.002, "d": 0.002}
    blend = blended_value(offsets, sensitivities, 0.5)
    # mean |offset| over the finite ones: 2.0; mean sensitivity: 0.002
    assert blend["a"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)
    assert blend["b"] == pytest.approx(0.5 * -0.5 + 0.5 * 1.5)
    assert blend["c"] == pytest.approx(0.5 * 1.5 + 0.5 * 1.0)
    assert blend["d"] == math.inf  # never measured: nothing said its high format could go
    rescaled = blended_value(offsets, {n: 1000.0 * v for n, v in sensitivities.items()}, 0.5)
    assert rescaled == pytest.approx(blend)  # units do not matter, unlike adding the raw values
    assert blended_value(offsets, sensitivities, 0.0)["c"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="same layers"):
        blended_value(offsets, {"a": 1.0}, 0.5)


@pytest.mark.parametrize("bit_average", ["simple", "weighted"])
def test_the_default_method_ranks_by_its_offsets_blended_with_the_kl_scan(deep, bit_average):
    """The map is the budget rule on `blended_priority(offsets, KL scan, KL_WEIGHT)`; `method="kl"` ranks by the
    same scan alone (KL pre-selection)."""
    from optimum_dmx.calibration import kl_preselection, kl_sensitivities
    from optimum_dmx.calibration.budget import blended_priority, blended_value
    from optimum_dmx.calibration.trainer import KL_WEIGHT

    model, ids = deep
    settings = CalibrationSettings(
        target_bits=5.5, steps=20, batch_size=2, seq_len=16, num_samples=40, bit_average=bit_average
    )
    result = calibrate(model, ids, settings, progress=False)
    assert result.kl_sensitivities == kl_sensitivities(model, ids, settings, progress=False)
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in result.format_map}
    blend = blended_priority if bit_average == "simple" else blended_value  # ranks suffice for equal costs
    priority = blend(result.beta_hat, result.kl_sensitivities, KL_WEIGHT)
    pair = FORMAT_PAIRS["mxfp8-mxfp4"]
    assert result.format_map == budget_format_map(priority, shapes, pair, 5.5, bit_average)
    assert abs(achieved(result, bit_average) - 5.5) <= BUDGET_TOLERANCE + 1e-9
    kl_only = budget_format_map(result.kl_sensitivities, shapes, pair, 5.5, bit_average)
    assert kl_preselection(model, ids, settings, progress=False).format_map == kl_only
