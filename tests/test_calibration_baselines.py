import copy
from unittest import mock

import pytest
import torch
from scipy.stats import spearmanr
from torch.nn import functional as F

from optimum_dmx.calibration import (
    CalibrationSettings,
    calibrate,
    kl_preselection,
    kl_sensitivities,
    uniform,
    uniform_format_map,
)
from optimum_dmx.calibration.budget import BUDGET_TOLERANCE
from optimum_dmx.calibration.sensitivity import KL_UNITS_PER_PASS, ScanSplit
from optimum_dmx.formats import quantize_mx
from optimum_dmx.nn import average_bits, emulate_format_map, linear_modules_to_quantize, tensor_sizes
from optimum_dmx.nn.rotation import rotate_model
from optimum_dmx.nn.surgery import swapped_modules

from .helpers import sensitive_llama_and_data, tiny_llama


@pytest.fixture(scope="module")
def sensitive():
    model, ids = sensitive_llama_and_data()
    return model, ids[:8]


@pytest.fixture(scope="module")
def sensitivities(sensitive):
    model, ids = sensitive
    return kl_sensitivities(model, ids, CalibrationSettings(batch_size=4), progress=False)


def settings(**overrides):
    return CalibrationSettings(**{**dict(num_samples=8, seq_len=32, batch_size=4, steps=20), **overrides})


@pytest.mark.parametrize("fmt, bits", [("mxfp4", 4.0), ("mxfp6_e2m3", 6.0), ("mxfp8", 8.0)])
def test_uniform_baseline(fmt, bits):
    model = tiny_llama()
    result = uniform(model, fmt, settings())
    assert len(result.format_map) == 14 and "lm_head" not in result.format_map
    assert result.bits_simple == result.bits_weighted == bits
    assert result.storage_bits == pytest.approx(bits + 0.25)
    assert set(uniform_format_map(model, fmt).values()) == {result.format_map["model.layers.0.mlp.up_proj"]}


def test_emulated_layer_equals_exact_mx_quantization():
    model = tiny_llama()
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 5, 128)
    with emulate_format_map(model, {"model.layers.0.mlp.down_proj": "mxfp6_e2m3"}):
        emulated = model.model.layers[0].mlp.down_proj(x)
    expected = F.linear(quantize_mx(x, "mxfp6_e2m3"), quantize_mx(linear.weight, "mxfp6_e2m3"))
    assert torch.equal(emulated, expected)
    assert model.model.layers[0].mlp.down_proj is linear
    with pytest.raises(ValueError, match="Unknown MX format 'mxfp5'"):
        with emulate_format_map(model, {"model.layers.0.mlp.down_proj": "mxfp5"}):
            pass


def test_kl_sensitivities_cover_every_layer_and_are_positive(sensitive, sensitivities):
    model, _ = sensitive
    assert set(sensitivities) == set(linear_modules_to_quantize(model, ["lm_head"]))
    assert all(v > 0 for v in sensitivities.values())
    assert len({round(v, 8) for v in sensitivities.values()}) > 1


def test_the_scan_multiplies_in_bfloat16_with_layers_low_from_their_float32_weights(sensitive, sensitivities):
    """With bfloat16 products (`"auto"` on a float32 model, where the device multiplies bfloat16 natively) the float
    layers hold bfloat16 copies of their weights, a layer goes low from its float32 weight (every low layer the scan
    builds holds that weight's MXFP4 rounding, not its copy's), the layers rank as in float32, and every weight comes
    back as it was."""
    from optimum_dmx.calibration import sensitivity
    from optimum_dmx.calibration.sensitivity import native_bfloat16

    model, ids = sensitive
    s = CalibrationSettings(batch_size=4)
    targets = linear_modules_to_quantize(model, ["lm_head"])
    weights = {name: (linear.weight, linear.weight.detach().clone()) for name, linear in targets.items()}
    seen = set()
    probe = model.model.layers[1].mlp.down_proj
    handle = probe.register_forward_pre_hook(
        lambda module, args: seen.add((module.weight.dtype, torch.is_autocast_enabled("cpu")))
    )
    low_weights, build = {}, sensitivity.mx_linears_from

    def recorded(*args, **kwargs):
        lows = build(*args, **kwargs)
        low_weights.update({name: layer.dequantized_weight(torch.float32) for name, layer in lows.items()})
        return lows

    try:
        with mock.patch.object(sensitivity, "mx_linears_from", recorded):
            half = kl_sensitivities(model, ids, s, progress=False, matmul_dtype=torch.bfloat16)
    finally:
        handle.remove()
    assert seen == {(torch.bfloat16, True)}  # the probe's float passes; in its own it is replaced by its MX layer
    for name, linear in targets.items():
        weight, values = weights[name]
        assert linear.weight is weight and weight.dtype == torch.float32 and torch.equal(weight, values)
    assert low_weights.keys() == weights.keys()
    for name, (weight, _) in weights.items():
        assert torch.equal(low_weights[name], quantize_mx(weight, "mxfp4_e2m1")), name
        assert not torch.equal(low_weights[name], quantize_mx(weight.bfloat16().float(), "mxfp4_e2m1")), name
    single = kl_sensitivities(model, ids, s, progress=False, matmul_dtype=torch.float32)
    names = list(single)
    assert spearmanr([single[n] for n in names], [half[n] for n in names]).statistic > 0.95
    assert half != single
    native = native_bfloat16(torch.device("cpu"))
    assert sensitivities == (half if native else single)  # "auto", the default


def test_a_rotated_models_float_layers_skip_their_online_transforms_in_the_bfloat16_scan(sensitive):
    """With online block-Hadamard transforms (`TransformedLinear`: `y = (x T) W'^T`), the bfloat16 scan's float
    layers hold `W' T^T` and compute no transform, while a layer goes low with its own transform and float32
    weight: its values stay those of the float32 scan, which computes every transform (measured within 15%, 13% with
    every position weighed alike; a layer low without its transform is off by up to 68x), and every weight and
    transform comes back."""
    model, ids = sensitive
    model = copy.deepcopy(model)
    rotate_model(model, "online_block_hadamard", list(linear_modules_to_quantize(model, ["lm_head"])), 32)
    targets = linear_modules_to_quantize(model, ["lm_head"])  # `TransformedLinear`s now
    own = {
        name: (linear.weight, linear.weight.detach().clone(), linear.input_transform)
        for name, linear in targets.items()
    }
    calls = []
    handles = [t.register_forward_hook(lambda *args: calls.append(1)) for _, _, t in own.values()]
    s = CalibrationSettings(batch_size=4)
    try:
        half = kl_sensitivities(model, ids, s, progress=False, matmul_dtype=torch.bfloat16)
        assert not calls  # the low layer quantizes through its transform's own kernel (`quantize`), not `forward`
        single = kl_sensitivities(model, ids, s, progress=False, matmul_dtype=torch.float32)
        assert calls
    finally:
        for handle in handles:
            handle.remove()
    names = list(single)
    assert spearmanr([single[n] for n in names], [half[n] for n in names]).statistic > 0.95
    assert max(abs(half[n] / single[n] - 1) for n in names) < 0.2
    for name, linear in targets.items():
        weight, values, transform = own[name]
        assert linear.weight is weight and torch.equal(weight, values) and linear.input_transform is transform


def test_the_scans_products_are_never_wider_than_the_weights_and_a_bad_dtype_is_refused(sensitive):
    """On a bfloat16 model, float32 products leave the model as it is (as "auto" does); an integer dtype is refused,
    naming the value and the choices."""
    model, ids = sensitive
    half = copy.deepcopy(model).to(torch.bfloat16)
    s = CalibrationSettings(batch_size=4)
    as_is = kl_sensitivities(half, ids[:4], s, progress=False)
    assert kl_sensitivities(half, ids[:4], s, progress=False, matmul_dtype=torch.float32) == as_is
    with pytest.raises(ValueError, match=r"matmul_dtype=torch.int8 is not one of auto, torch.float32, torch.bfloat16"):
        kl_sensitivities(model, ids, s, progress=False, matmul_dtype=torch.int8)


@pytest.mark.parametrize("bit_average", ["simple", "weighted"])
@pytest.mark.parametrize("pair, target", [("mxfp8-mxfp4", 5.0), ("mxfp6-mxfp4", 5.5), ("mxfp8-mxfp4", 6.0)])
def test_kl_preselection_meets_the_budget(sensitive, sensitivities, pair, target, bit_average):
    model, ids = sensitive
    s = settings(format_pair=pair, target_bits=target, bit_average=bit_average)
    result = kl_preselection(model, ids, s, sensitivities=sensitivities)
    achieved = result.bits_simple if bit_average == "simple" else result.bits_weighted
    assert achieved <= target + BUDGET_TOLERANCE  # 14 layers: the simple average moves in steps of 2/14 or 4/14
    if achieved > target:  # the rule's top-up step (few, unequal layers): one unit at a time while still short
        return
    # Greedy is tight: promoting any remaining low layer would break the budget.
    names = list(result.format_map)
    sizes = tensor_sizes([tuple(model.get_submodule(n).weight.shape) for n in names])
    high = {"mxfp8-mxfp4": 8.0, "mxfp6-mxfp4": 6.0}[pair]
    bits = torch.tensor([high if f != "mxfp4_e2m1" else 4.0 for f in result.format_map.values()], dtype=torch.float64)
    for i, f in enumerate(result.format_map.values()):
        if f == "mxfp4_e2m1":
            trial = bits.clone()
            trial[i] = high
            assert average_bits(trial, bit_average, sizes).item() > target
    # The most sensitive layer is in the high format.
    assert result.format_map[max(sensitivities, key=sensitivities.get)] != "mxfp4_e2m1"
    assert result.method == "kl"


def test_swapped_modules_freeze_and_evaluate_the_model_within_and_give_back_modes_and_flags(monkeypatch):
    """Inside `swapped_modules` every weight is frozen and every module in eval mode; on exit the replaced modules,
    the `requires_grad` flags and the mode come back. A model already frozen and in eval mode is left as it is: no
    module's mode is set (the scan swaps modules once per pass)."""
    model = tiny_llama()
    model.train()
    model.lm_head.weight.requires_grad_(False)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    original = model.model.layers[0].mlp.down_proj
    replacement = torch.nn.Linear(original.in_features, original.out_features)
    with swapped_modules(model, {"model.layers.0.mlp.down_proj": replacement}):
        assert model.model.layers[0].mlp.down_proj is replacement
        assert not any(m.training for m in model.modules() if m is not replacement)
        own = {id(p) for p in replacement.parameters()}  # the replacement's are its caller's to set
        assert not any(p.requires_grad for p in model.parameters() if id(p) not in own)
    assert model.model.layers[0].mlp.down_proj is original
    assert all(m.training for m in model.modules())
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags

    model.eval()
    model.model.layers[1].train()  # one module in train mode in an eval model: evaluated within, as the rest
    with swapped_modules(model, {}):
        assert not any(m.training for m in model.modules())
    assert not model.training

    for p in model.parameters():
        p.requires_grad_(False)
    calls = []
    monkeypatch.setattr(torch.nn.Module, "train", lambda module, mode=True: calls.append(mode) or module)
    with swapped_modules(model, {"model.layers.0.mlp.down_proj": replacement}):
        assert model.model.layers[0].mlp.down_proj is replacement
    assert calls == [] and not any(p.requires_grad for p in model.parameters())


def test_kl_scan_reads_the_first_half_of_the_first_kl_samples_sequences(sensitive, sensitivities):
    """The scan reads the first `KL_SAMPLES` sequences wherever it runs (KL pre-selection, the default method's
    blend), so a caller passing the whole calibration set does not pay one pass per layer over all of it, and of
    each the first `KL_POSITIONS` (half) of its positions, rounded up; `positions` reads another share."""
    from optimum_dmx.calibration import sensitivity

    model, ids = sensitive
    s = CalibrationSettings(batch_size=4)
    assert sensitivity.KL_SAMPLES == 4 and sensitivity.KL_POSITIONS == 0.5 and ids.shape[1] % 2 == 0
    half = ids.shape[1] // 2
    alike = dict(progress=False, position_weighting=0)  # as a scan of whole sequences weighs them
    assert kl_sensitivities(model, ids[:4, :half], s, progress=False, positions=1.0) == kl_sensitivities(
        model, ids, s, **alike
    )
    assert kl_sensitivities(model, ids[:4], s, progress=False, positions=0.5) == sensitivities
    assert kl_sensitivities(model, ids[:4, : half + 1], s, progress=False) != sensitivities  # ceil(half + 1/2)
    whole = kl_sensitivities(model, ids[:4], s, progress=False, positions=1.0)
    assert whole != sensitivities
    assert kl_sensitivities(model, ids[:4, :5], s, positions=0.25, **alike) == kl_sensitivities(
        model, ids[:4, :2], s, progress=False, positions=1.0
    )
    different = torch.cat([ids[4:], ids[:4]])
    assert kl_sensitivities(model, different, s, progress=False) != sensitivities
    for bad in (0, 1.5, -0.5, True, "half"):
        with pytest.raises(ValueError, match=rf"positions={bad!r} is not a share .* allowed: 0 < positions <= 1"):
            kl_sensitivities(model, ids[:4], s, progress=False, positions=bad)


def test_kl_scan_weighs_each_position_of_a_part_read_by_the_square_root_of_its_place(sensitive):
    """By default, in a scan of part of each sequence, a position `p`'s divergence counts `sqrt(p + 1)` times in its
    sequence's mean, the weights scaled to a mean of 1: each layer's value is `F.kl_div` per position of whole passes
    over the part read, weighted so; `position_weighting=0` gives the plain mean, another power its own weights, whole
    sequences weigh every position alike, and a value that weighs nothing is refused."""
    from optimum_dmx.calibration import sensitivity
    from optimum_dmx.calibration.sensitivity import next_token_log_probs

    model, ids = sensitive
    assert sensitivity.KL_POSITION_WEIGHTING == 0.5 and sensitivity.KL_POSITIONS == 0.5
    read = ids[:4, : ids.shape[1] // 2]
    exact = dict(progress=False, head_tokens=None, matmul_dtype=torch.float32)
    s = CalibrationSettings(batch_size=4)
    scans = {power: kl_sensitivities(model, ids[:4], s, position_weighting=power, **exact) for power in (0, 0.5, 2)}
    assert kl_sensitivities(model, ids[:4], s, **exact) == scans[0.5] != scans[0]
    whole = kl_sensitivities(model, ids[:4], s, positions=1.0, **exact)
    assert kl_sensitivities(model, ids[:4], s, positions=1.0, position_weighting=0, **exact) == whole
    place = torch.arange(1, read.shape[1] + 1, dtype=torch.float64)
    with torch.no_grad():
        float_log_probs = next_token_log_probs(model, read)
        for name in scans[0]:
            with emulate_format_map(model, {name: "mxfp4"}):
                log_probs = next_token_log_probs(model, read)
            per_position = F.kl_div(log_probs, float_log_probs, log_target=True, reduction="none").sum(-1).double()
            for power in (0, 0.5, 2):
                weights = place**power / (place**power).mean()
                expected = (per_position * weights).sum().item() / read.numel()
                assert scans[power][name] == pytest.approx(expected, rel=1e-4), (name, power)
    for bad in (-0.5, True, "sqrt", float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"position_weighting=.* is not a weighting .* allowed: a number >= 0"):
            kl_sensitivities(model, ids[:4], s, progress=False, position_weighting=bad)


def test_kl_scan_equals_one_whole_pass_per_layer(sensitive):
    """Replaying the decoder layers before a layer's own gives what a whole forward pass per layer gives (in
    float32: under bfloat16 products the layers after the perturbed one round differently in every pass)."""
    from optimum_dmx.calibration.sensitivity import NextTokenReference, next_token_kl, next_token_log_probs

    model, ids = sensitive
    batch = ids[:4]
    exact = dict(progress=False, head_tokens=None, matmul_dtype=torch.float32, positions=1.0)  # the whole batch
    sensitivities = kl_sensitivities(model, batch, CalibrationSettings(batch_size=4), **exact)
    with torch.no_grad():
        reference = NextTokenReference.from_log_probs(next_token_log_probs(model, batch))
        for name, value in sensitivities.items():
            with emulate_format_map(model, {name: "mxfp4"}):
                whole = next_token_kl(reference, next_token_log_probs(model, batch)).item() / batch.numel()
            assert value == whole, name


def test_kl_scan_puts_a_group_low_whole_in_one_pass(sensitive):
    """A group that shares a format goes low together in its pass: its members' shares are equal and sum to the
    divergence of a whole forward pass with all of them low; a layer outside every group keeps its own value."""
    from optimum_dmx.calibration.groups import offset_groups
    from optimum_dmx.calibration.sensitivity import NextTokenReference, next_token_kl, next_token_log_probs

    model, ids = sensitive
    batch = ids[:4]
    names = list(linear_modules_to_quantize(model, ["lm_head"]))
    groups = offset_groups("fused", names)
    assert len(groups) == 2 * len(model.model.layers)  # q/k/v and gate/up of each decoder layer
    exact = dict(progress=False, head_tokens=None, matmul_dtype=torch.float32, positions=1.0)  # as the passes below
    grouped = kl_sensitivities(model, batch, CalibrationSettings(batch_size=4, offset_groups="fused"), **exact)
    assert grouped == kl_sensitivities(model, batch, CalibrationSettings(batch_size=4), groups=groups, **exact)
    alone = kl_sensitivities(model, batch, CalibrationSettings(batch_size=4), **exact)
    with torch.no_grad():
        reference = NextTokenReference.from_log_probs(next_token_log_probs(model, batch))
        for group in groups:
            with emulate_format_map(model, dict.fromkeys(group, "mxfp4")):
                whole = next_token_kl(reference, next_token_log_probs(model, batch)).item() / batch.numel()
            assert len({grouped[name] for name in group}) == 1
            assert sum(grouped[name] for name in group) == pytest.approx(whole, rel=1e-12, abs=0), group
            # not the members' divergences alone, summed (the scan without groups)
            assert sum(grouped[name] for name in group) != pytest.approx(sum(alone[n] for n in group))
    ungrouped = [name for name in names if not any(name in group for group in groups)]
    assert ungrouped and all(grouped[name] == alone[name] for name in ungrouped)
    # an explicit group across decoder layers, named last layer first: its pass starts at its first decoder layer
    across = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"]
    spanning = kl_sensitivities(model, batch, CalibrationSettings(batch_size=4, offset_groups=[across]), **exact)
    with torch.no_grad(), emulate_format_map(model, dict.fromkeys(across, "mxfp4")):
        whole = next_token_kl(reference, next_token_log_probs(model, batch)).item() / batch.numel()
    assert spanning[across[0]] + spanning[across[1]] == pytest.approx(whole, rel=1e-12, abs=0)


def test_kl_scan_divergence_is_the_elementwise_kl_divergence(sensitive, monkeypatch):
    """The scan's KL (a dot product per position, a block of positions at a time) is torch's element-wise
    `F.kl_div` of the same distributions, for a model's real perturbations (each layer in MXFP4) and for
    distributions that barely differ, whatever the block."""
    from optimum_dmx.calibration import sensitivity
    from optimum_dmx.calibration.sensitivity import NextTokenReference, next_token_kl, next_token_log_probs

    model, ids = sensitive
    batch = ids[:4]
    with torch.no_grad():
        float_log_probs = next_token_log_probs(model, batch)
        reference = NextTokenReference.from_log_probs(float_log_probs)
        perturbed = []
        for name in linear_modules_to_quantize(model, ["lm_head"]):
            with emulate_format_map(model, {name: "mxfp4"}):
                perturbed.append(next_token_log_probs(model, batch))
        noise = torch.randn(float_log_probs.shape, generator=torch.Generator().manual_seed(0)) * 1e-2
        perturbed.append(torch.log_softmax(float_log_probs + noise, dim=-1))
    for log_probs in perturbed:
        elementwise = torch.nn.functional.kl_div(log_probs, float_log_probs, log_target=True, reduction="sum")
        assert next_token_kl(reference, log_probs).item() == pytest.approx(elementwise.item(), rel=1e-4)
    whole = next_token_kl(reference, perturbed[0])
    monkeypatch.setattr(sensitivity, "KL_BLOCK_ELEMENTS", 3 * float_log_probs.shape[-1])  # blocks of 3 positions
    assert next_token_kl(reference, perturbed[0]).item() == pytest.approx(whole.item(), rel=1e-6)
    assert next_token_kl(reference, float_log_probs).abs().item() < 1e-6 * batch.numel()


def test_kl_scan_computes_each_decoder_layer_only_from_the_perturbed_one_on(sensitive):
    model, ids = sensitive
    decoder_layers = list(model.model.layers)
    calls = [0] * len(decoder_layers)

    def count(index):
        def hook(module, args):
            calls[index] += 1

        return hook

    handles = [layer.self_attn.register_forward_pre_hook(count(i)) for i, layer in enumerate(decoder_layers)]
    try:
        kl_sensitivities(model, ids[:4], CalibrationSettings(batch_size=4), progress=False)
    finally:
        for handle in handles:
            handle.remove()
    per_layer = len(linear_modules_to_quantize(model, ["lm_head"])) // len(decoder_layers)
    passes = -(-per_layer // KL_UNITS_PER_PASS)  # each decoder layer's 7 linears, 4 to a pass
    assert (per_layer, passes) == (7, 2)
    # the float reference pass, then each decoder layer's linears' passes run layers i.. and their successors
    assert calls == [1 + passes * (i + 1) for i in range(len(decoder_layers))]
    calls[:] = [0] * len(decoder_layers)
    handles = [layer.self_attn.register_forward_pre_hook(count(i)) for i, layer in enumerate(decoder_layers)]
    try:
        kl_sensitivities(model, ids[:4], CalibrationSettings(batch_size=4, offset_groups="fused"), progress=False)
    finally:
        for handle in handles:
            handle.remove()
    # grouped: q/k/v, o_proj, gate/up and down_proj in one pass
    assert calls == [1 + (i + 1) for i in range(len(decoder_layers))]


@pytest.mark.parametrize("rotation", ["none", "online_block_hadamard"])
@pytest.mark.parametrize("matmul_dtype", [torch.float32, torch.bfloat16])
def test_a_pass_over_copies_of_the_batch_gives_each_unit_the_divergence_of_its_own_pass(
    sensitive, matmul_dtype, rotation
):
    """Up to `units_per_pass` units of a decoder layer share a pass, each low in its own copy of the batch: each
    gets the divergence a pass of its own gives, for layers alone and groups, batches of 2 sequences, layers with an
    online transform (low with it; float from the bfloat16 copies without it), and every module comes back."""
    model, ids = sensitive
    model = copy.deepcopy(model)
    names = list(linear_modules_to_quantize(model, ["lm_head"]))
    rotate_model(model, rotation, names, 32)
    modules = dict(model.named_modules())
    for offset_groups in ("none", "fused"):
        s = CalibrationSettings(batch_size=2, offset_groups=offset_groups)  # the scan's 4 sequences in 2 batches
        shared = kl_sensitivities(model, ids, s, progress=False, matmul_dtype=matmul_dtype)  # 4 units per pass
        alone = kl_sensitivities(model, ids, s, progress=False, matmul_dtype=matmul_dtype, units_per_pass=1)
        assert shared.keys() == alone.keys() == set(names)
        for name in names:
            assert shared[name] == pytest.approx(alone[name], rel=1e-5)  # equal here; a larger product may round apart
        assert dict(model.named_modules()) == modules
    for bad in (0, 1.5, True, "4"):
        with pytest.raises(ValueError, match=rf"units_per_pass={bad!r} .*an integer >= 1"):
            kl_sensitivities(model, ids, s, progress=False, units_per_pass=bad)


@pytest.mark.parametrize(
    "world_size, sequences, expected",
    [
        (1, 4, (1, 1)),
        (2, 4, (2, 1)),  # the sequences shared: 14 sequence passes per decoder layer and process
        (4, 4, (4, 1)),  # 7
        (3, 4, (1, 3)),  # the layers dealt out: 3 rounds of 4 sequences, 12 (every process scanned everything: 28)
        (8, 4, (4, 2)),  # both: 4 rounds of 1 sequence, 4 (28); 8 slots would take 1 round of 4 sequences, as many
        (2, 3, (1, 2)),  # 4 rounds of 3 sequences, 12 (21)
    ],
)
def test_scan_split_gives_each_process_the_fewest_passes(world_size, sequences, expected):
    split = ScanSplit.choose(world_size, sequences, [7, 7, 7])
    assert (split.sequence_groups, split.layer_slots) == expected


@pytest.mark.parametrize("units_per_pass", [1, 4])
@pytest.mark.parametrize("world_size", range(1, 9))
def test_scan_split_scans_each_layer_once_per_sequence_group_with_every_process_in_step(world_size, units_per_pass):
    # each decoder layer: a group of three, one layer alone, a group of two, two alone (as units of the scan)
    sizes = [3, 1, 2, 1, 1]
    stages = [
        [
            (tuple(f"{d}.{u}.{m}" for m in range(size)), [f"decoder {e}" for e in range(d)])
            for u, size in enumerate(sizes)
        ]
        for d in range(3)
    ]
    stages.append([(("lm_head",), [])])
    split = ScanSplit.choose(world_size, 4, [len(stage) for stage in stages])
    alone = {stages[1][2][0]}  # a unit scanned in passes of its own (a mixture of experts' experts)
    passes = [split.passes(rank, stages, units_per_pass, alone) for rank in range(world_size)]
    # in step: every process gathers the same layers and replays the same decoder layers in each of its passes
    # (FSDP2's gathers match), the round's names being those of all its units
    assert len({tuple((tuple(names), tuple(replayed)) for _, names, replayed in p) for p in passes}) == 1
    assert all(set(unit) <= set(names) for p in passes for units, names, _ in p for unit in units)
    assert all(len(units) <= units_per_pass for p in passes for units, _, _ in p)
    assert all(units == (unit,) for p in passes for units, _, _ in p for unit in units if unit in alone)
    # a pass's units share the decoder layers replayed before them
    unit_stage = {unit: tuple(replayed) for stage in stages for unit, replayed in stage}
    assert all(unit_stage[unit] == tuple(replayed) for p in passes for units, _, replayed in p for unit in units)
    scanned = [
        (unit, split.sequence_group(rank)) for rank, p in enumerate(passes) for units, _, _ in p for unit in units
    ]
    everything = [
        (unit, (g, split.sequence_groups)) for s in stages for unit, _ in s for g in range(split.sequence_groups)
    ]
    assert sorted(scanned) == sorted(everything)


def test_kl_scan_gives_back_a_forward_installed_on_a_layer(sensitive, sensitivities):
    """Replaying overrides a decoder layer's `forward`; one installed on the instance (accelerate's offload hooks
    do that) is the one it has afterwards, and it is the one the reference pass runs."""
    model, ids = sensitive
    layer = model.model.layers[0]
    runs = []

    def installed(*args, **kwargs):
        runs.append(1)
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = installed
    try:
        again = kl_sensitivities(model, ids[:4], CalibrationSettings(batch_size=4), progress=False)
        # the reference pass and the passes of layer 0's own linears, 4 to a pass
        assert layer.forward is installed and len(runs) == 1 + 2
    finally:
        del layer.forward
    assert again == sensitivities
    assert "forward" not in model.model.layers[1].__dict__


def test_kl_preselection_computes_sensitivities_itself(sensitive, sensitivities):
    model, ids = sensitive
    s = settings(target_bits=5.0)
    assert (
        kl_preselection(model, ids, s, progress=False).format_map
        == kl_preselection(model, ids, s, sensitivities=sensitivities).format_map
    )
    with pytest.raises(ValueError, match="sensitivities lack 1 targeted layers"):
        kl_preselection(model, ids, s, sensitivities={k: v for k, v in list(sensitivities.items())[1:]})


def test_method_kl_is_kl_preselection(sensitive):
    model, ids = sensitive
    s = settings(target_bits=5.0, method="kl")
    result = calibrate(model, ids, s, progress=False)
    assert result.method == "kl" and result.history == []
    assert result.format_map == kl_preselection(model, ids, s, progress=False).format_map
