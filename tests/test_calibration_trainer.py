import json
import math
import time

import pytest
import torch
from torch import nn

from optimum_dmx.calibration import CalibrationSettings, DMXLinear, PaperRecipe, calibrate
from optimum_dmx.calibration.dmx_linear import SharedInputs
from optimum_dmx.calibration.trainer import blended_format_map
from optimum_dmx.continuous import ContinuousQuantization, quantize_mx_continuous_fused
from optimum_dmx.nn import linear_modules_to_quantize
from optimum_dmx.nn.rotation import rotate_model
from optimum_dmx.nn.transforms import RandomizedHadamard

from .helpers import sensitive_llama_and_data, tiny_decoder, tiny_llama


@pytest.fixture(scope="module")
def sensitive():
    return sensitive_llama_and_data()


def settings(**overrides) -> CalibrationSettings:
    base = dict(target_bits=5.0, num_samples=16, seq_len=32, batch_size=4, steps=6)
    return CalibrationSettings(**{**base, **overrides})


def test_linear_modules_to_quantize_matches_at_module_boundaries():
    model = tiny_llama()
    names = set(linear_modules_to_quantize(model, ["lm_head"]))
    assert len(names) == 14 and "lm_head" not in names
    assert set(linear_modules_to_quantize(model, None)) == names | {"lm_head"}
    # suffix at a boundary
    kept = linear_modules_to_quantize(model, ["lm_head", "mlp.down_proj"])
    assert not any(n.endswith("down_proj") for n in kept) and len(kept) == 12
    assert len(linear_modules_to_quantize(model, ["lm_head", "own_proj"])) == 14
    # prefix at a boundary, and a full name
    kept = linear_modules_to_quantize(model, ["lm_head", "model.layers.1"])
    assert all(n.startswith("model.layers.0.") for n in kept) and len(kept) == 7
    assert len(linear_modules_to_quantize(model, ["lm_head", "model.layers.1.self"])) == 14
    assert "model.layers.0.self_attn.q_proj" not in linear_modules_to_quantize(
        model, ["model.layers.0.self_attn.q_proj"]
    )


def test_calibration_restores_the_model():
    model = tiny_llama()
    model.train()
    model.model.embed_tokens.weight.requires_grad_(False)
    before = {n: m for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    result = calibrate(model, ids, settings(steps=2, seq_len=16, num_samples=8), progress=False)
    after = {n: m for n, m in model.named_modules()}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert not any(isinstance(m, DMXLinear) for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training and not model.model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if "embed" not in n)
    assert all(p.grad is None for p in model.parameters())
    assert set(result.format_map) == set(linear_modules_to_quantize(model, ["lm_head"]))


def test_restores_the_model_when_a_step_fails():
    model = tiny_llama()
    before = {n: m for n, m in model.named_modules()}
    bad_ids = torch.full((4, 16), 10_000)  # out of the vocabulary: the embedding lookup fails
    with pytest.raises(IndexError):
        calibrate(model, bad_ids, settings(steps=1, seq_len=16), progress=False)
    assert all(m is before[n] for n, m in model.named_modules())


def test_deterministic_for_a_seed(sensitive):
    model, ids = sensitive
    a = calibrate(model, ids, settings(seed=1), progress=False)
    b = calibrate(model, ids, settings(seed=1), progress=False)
    c = calibrate(model, ids, settings(seed=2), progress=False)
    assert a.history == b.history and a.beta_hat == b.beta_hat and a.format_map == b.format_map
    assert [h["task_loss"] for h in a.history] != [h["task_loss"] for h in c.history]


def test_reused_quantizations_give_the_same_result_bit_for_bit(sensitive, monkeypatch):
    """The default recipe quantizes each frozen weight once per probe endpoint (`FrozenWeightQuantization`: values
    kept in bfloat16, `dy/dbeta` recomputed in the backward pass) and each input shared by q/k/v or gate/up once per
    endpoint and step: the same offsets and losses, bit for bit, as quantizing everything in every layer at every
    step in float32, with far fewer quantizations."""
    model, ids = sensitive
    computed = []
    original = ContinuousQuantization.compute.__func__

    def counting(cls, x, beta, *args, **kwargs):
        computed.append(beta)
        return original(cls, x, beta, *args, **kwargs)

    monkeypatch.setattr(ContinuousQuantization, "compute", classmethod(counting))
    reused = calibrate(model, ids, settings(steps=8), progress=False)
    layers, steps = len(reused.format_map), 8
    # weights: at most once per endpoint; inputs: q/k/v and gate/up share theirs whenever probed at the same end
    assert len(computed) < 2 * layers + layers * steps

    computed.clear()
    monkeypatch.setattr(DMXLinear, "frozen_weight", lambda self, offset: None)  # every weight quantized afresh
    monkeypatch.setattr(
        SharedInputs,
        "quantize",
        lambda self, x, beta, key: quantize_mx_continuous_fused(x, beta, key[1], key[2], key[3]),
    )
    recomputed = calibrate(model, ids, settings(steps=8), progress=False)
    assert len(computed) == 2 * layers * steps  # every weight and every input, every step
    assert reused.beta_hat == recomputed.beta_hat and reused.history == recomputed.history
    assert reused.format_map == recomputed.format_map


def test_layers_reading_one_input_through_one_online_transform_transform_it_once(monkeypatch):
    """With `online_block_hadamard`, q/k/v share one transform of their input and gate/up another (o_proj's input
    comes transformed from v_proj): a step transforms each input once (3 transforms per decoder layer, not 6), which
    also lets them share its quantization; the map and the offsets are those of transforming it in every layer (to
    float rounding: the gradients then add in another order)."""
    model = tiny_decoder("llama", tied=False)
    rotate_model(model, "online_block_hadamard", linear_modules_to_quantize(model, ["lm_head"]))
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    calls = []
    original = RandomizedHadamard.forward

    def counting(self, x):
        if torch.is_grad_enabled():  # the steps' forward passes (the KL scan runs without gradients)
            calls.append(self.key)
        return original(self, x)

    monkeypatch.setattr(RandomizedHadamard, "forward", counting)
    steps, layers = 3, len(model.model.layers)
    grouped = settings(steps=steps, seq_len=16, num_samples=8, offset_groups="fused")
    shared = calibrate(model, ids, grouped, progress=False)
    assert len(calls) == steps * layers * 3

    calls.clear()
    monkeypatch.setattr(DMXLinear, "transformed_input", lambda self, x: self.input_transform(x))
    separate = calibrate(model, ids, grouped, progress=False)
    assert len(calls) == steps * layers * 6
    assert shared.format_map == separate.format_map and shared.history == separate.history
    assert shared.beta_hat == pytest.approx(separate.beta_hat, rel=1e-5, abs=1e-9)


def test_shared_inputs_quantize_one_input_once_per_endpoint():
    shared = SharedInputs()
    x = torch.randn(4, 64, requires_grad=True)
    low = [torch.tensor(0.0, requires_grad=True) for _ in range(3)]
    key = (0.0, "mxfp8-mxfp4", 32, "ocp")
    outputs = [shared.quantize(x, beta, key) for beta in low]  # q, k and v at the low end
    high = shared.quantize(x, torch.tensor(2.0), (2.0, "mxfp8-mxfp4", 32, "ocp"))
    other = shared.quantize(x.detach().clone().requires_grad_(True), low[0], key)  # another tensor: not shared
    assert len(shared._cache) == 3
    expected = quantize_mx_continuous_fused(x, torch.tensor(0.0), "mxfp8-mxfp4")
    assert all(torch.equal(y, expected) for y in outputs) and torch.equal(other, expected)
    assert torch.equal(high, quantize_mx_continuous_fused(x, torch.tensor(2.0), "mxfp8-mxfp4"))
    grads = torch.autograd.grad(sum(y.sum() * (i + 1) for i, y in enumerate(outputs)), [x, *low])
    beta = torch.tensor(0.0, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = quantize_mx_continuous_fused(x_ref, beta, "mxfp8-mxfp4")
    g_x, g_beta = torch.autograd.grad(y_ref.sum(), [x_ref, beta])
    assert torch.allclose(grads[0], 6 * g_x)
    assert [g.item() for g in grads[1:]] == pytest.approx([g_beta.item() * k for k in (1, 2, 3)], rel=1e-6)
    shared.clear()
    assert len(shared._cache) == 0


@pytest.mark.parametrize("method", ["dmx", "paper"])
def test_a_run_leaves_no_tensors_behind(sensitive, method):
    # Regression: saved-tensor hooks that kept an output saved by its own autograd node made a reference cycle
    # through C++ that `gc` cannot collect: every step of every layer leaked its small format-parameter graph.
    import gc

    model, ids = sensitive

    def live_tensors_after(steps: int) -> int:
        calibrate(
            model,
            ids,
            CalibrationSettings(method=method, target_bits=6.0, num_samples=16, seq_len=32, batch_size=4, steps=steps),
            progress=False,
        )
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    live_tensors_after(2)  # warm-up: caches filled once per process
    assert live_tensors_after(8) == live_tensors_after(2)


def test_bits_move_up_toward_a_high_target(sensitive):
    model, ids = sensitive
    result = calibrate(model, ids, settings(method="paper", target_bits=8.0, steps=30), progress=False)
    start, end = result.history[0]["bits"], result.history[-1]["bits"]
    assert start == pytest.approx(4.0 + 4 / (1 + math.exp(4)), abs=1e-4)  # beta_hat = 0 at T = 8
    assert end > start + 1.0
    assert result.bits_simple > 5.0
    assert result.history[-1]["task_loss"] < result.history[0]["task_loss"]


def test_bits_come_down_to_a_low_target(sensitive):
    model, ids = sensitive
    result = calibrate(model, ids, settings(method="paper", target_bits=4.5, steps=40), progress=False)
    bits = [h["bits"] for h in result.history]
    peak = max(bits)
    assert peak > 4.6  # the task loss pushes above the target ...
    assert abs(bits[-1] - 4.5) < peak - 4.5  # ... and the regularizer pulls back toward it
    assert abs(result.bits_simple - 4.5) <= 4 / 14 + 1e-9  # within one layer's step (14 layers)


def test_simple_regularizer_and_weighted_average_are_used(sensitive):
    model, ids = sensitive
    s = settings(
        method="paper", paper=PaperRecipe(regularizer="simple", reg_lambda=50.0), bit_average="weighted", steps=10
    )
    result = calibrate(model, ids, s, progress=False)
    first = result.history[0]
    assert first["bits"] == pytest.approx(first["bits_weighted"])
    assert first["reg_loss"] == pytest.approx(50.0 * first["bits_weighted"], rel=1e-5)
    assert result.history[-1]["bits"] < first["bits"]  # a strong plain size penalty only pushes down


@pytest.mark.parametrize("method", ["dmx", "paper"])
def test_history_and_json(tmp_path, sensitive, method):
    model, ids = sensitive
    s = settings(method=method, steps=5)
    result = calibrate(model, ids, s, progress=False)
    assert [h["step"] for h in result.history] == list(range(5))
    assert [h["temperature"] for h in result.history][:3] == [8.0] * 3
    assert result.history[-1]["temperature"] == pytest.approx(400.0)
    for h in result.history:
        assert h["loss"] == pytest.approx(h["task_loss"] + h["reg_loss"], rel=1e-5)
    path = tmp_path / "result.json"
    result.to_json(path)
    loaded = json.loads(path.read_text())
    assert loaded["format_map"] == result.format_map and loaded["history"] == result.history
    assert loaded["method"] == method and loaded["beta_hat"] == result.beta_hat
    numel = {n: model.get_submodule(n).weight.numel() for n in result.format_map}
    element_bits = {n: {"mxfp4_e2m1": 4, "mxfp8_e4m3": 8}[f] for n, f in result.format_map.items()}
    expected = sum(numel[n] * (element_bits[n] + 8 / 32) for n in numel) / sum(numel.values())  # in_features % 32 == 0
    assert loaded["storage_bits"] == pytest.approx(expected)


@pytest.mark.parametrize("bit_average", ["weighted", "simple"])
def test_the_default_map_is_its_offsets_blended_with_its_scan(sensitive, bit_average):
    """`blended_format_map` is how the default method makes its map: given the run's own offsets and KL scan it
    returns the run's map; given another signal in place of the scan (the scan's order reversed) it ranks by it."""
    model, ids = sensitive
    s = settings(bit_average=bit_average)
    result = calibrate(model, ids, s, progress=False)
    linears = linear_modules_to_quantize(model, s.modules_to_not_convert)
    shapes = {name: tuple(linear.weight.shape) for name, linear in linears.items()}
    assert blended_format_map(result.beta_hat, result.kl_sensitivities, shapes, s) == result.format_map
    order = sorted(result.kl_sensitivities, key=result.kl_sensitivities.get)
    reversed_scan = dict(zip(order, sorted(result.kl_sensitivities.values(), reverse=True)))
    assert blended_format_map(result.beta_hat, reversed_scan, shapes, s) != result.format_map


@pytest.mark.parametrize("method", ["dmx", "paper", "kl"])
def test_step_and_scan_times(sensitive, method):
    """`step_seconds` times each training step, `scan_seconds` the KL scan: a pause in every forward pass shows in
    each step and in each of the scan's passes (one reference pass and 2 per decoder layer, for its 7 linears, 4
    sequences in one batch)."""
    model, ids = sensitive
    pause = 0.02
    handle = model.model.register_forward_pre_hook(lambda module, args: time.sleep(pause))
    try:
        result = calibrate(model, ids, settings(method=method, steps=3), progress=False)
    finally:
        handle.remove()
    steps = 0 if method == "kl" else 3
    assert len(result.step_seconds) == steps and all(t >= pause for t in result.step_seconds)
    if method == "paper":
        assert result.scan_seconds == 0
    else:
        assert result.scan_seconds >= pause * (1 + 2 * len(model.model.layers))
    assert sum(result.step_seconds) + result.scan_seconds <= result.seconds


@pytest.mark.parametrize("method, hidden, intermediate", [("dmx", 288, 608), ("kl", 544, 736)])
def test_the_time_spent_making_kernels_ready_is_reported_by_phase(compiled, method, hidden, intermediate):
    """A model of widths no other test quantizes (tests of kernels count the kernels of widths of their own) has its
    kernels compiled in this calibration: the steps' continuous quantizer's, and the scan's own (its low layers pack
    their weights and cast their inputs in the kernels of a quantized model). `kernel_seconds` reports that time
    within each phase's; calibrating the same model again compiles nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    s = settings(method=method, num_samples=8, seq_len=16, steps=2)
    first, again = (calibrate(model, ids, s, progress=False) for _ in range(2))
    phases = ["scan"] if method == "kl" else ["steps", "scan"]
    assert list(first.kernel_seconds) == list(again.kernel_seconds) == phases
    assert all(first.kernel_seconds[phase] > 0 and again.kernel_seconds[phase] == 0 for phase in phases)
    assert first.kernel_seconds["scan"] <= first.scan_seconds
    if method == "dmx":
        assert first.kernel_seconds["steps"] <= sum(first.step_seconds)


def test_discretization_threshold_is_beta_hat_one(sensitive):
    model, ids = sensitive
    result = calibrate(model, ids, settings(method="paper", target_bits=8.0, steps=20), progress=False)
    for name, fmt in result.format_map.items():
        assert (fmt == "mxfp8_e4m3") == (result.beta_hat[name] >= 1.0)
    assert {"mxfp8_e4m3", "mxfp4_e2m1"} >= set(result.format_map.values())


def test_bf16_model_calibrates():
    model = tiny_llama(dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    result = calibrate(model, ids, settings(steps=2, seq_len=16), progress=False)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)
    assert any(v != 0.0 for v in result.beta_hat.values())


def test_invalid_inputs():
    model = tiny_llama()
    with pytest.raises(TypeError, match="CalibrationSettings.*dict"):
        calibrate(model, torch.zeros(2, 8, dtype=torch.long), {"steps": 1})
    with pytest.raises(ValueError, match="2-D LongTensor"):
        calibrate(model, torch.zeros(8, dtype=torch.long), settings())
    with pytest.raises(ValueError, match="no nn.Linear left"):
        calibrate(model, torch.zeros(2, 8, dtype=torch.long), settings(modules_to_not_convert=["model", "lm_head"]))
    with pytest.raises(ValueError, match="no nn.Linear left"):
        calibrate(nn.Sequential(nn.Embedding(4, 4)), torch.zeros(2, 8, dtype=torch.long), settings())
