"""Learned rotations: Cayley SGD on orthogonal matrices, the merged rotations trained with the offsets (function kept,
weights changed, quantized loss lowered), their errors, and a checkpoint calibrated with them reloaded in a fresh
process."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig
from optimum_dmx.calibration import CalibrationSettings, calibrate, dmx_linears
from optimum_dmx.calibration.rotations import CayleySGD, learnable_sites, learned_rotations
from optimum_dmx.nn import emulate_format_map, linear_modules_to_quantize
from optimum_dmx.nn.rotation import rotate_model

from .helpers import (
    INPUT_IDS,
    last_json_line,
    run_python,
    sensitive_llama_and_data,
    tiny_decoder,
    word_tokenizer,
    words,
)


def _random_rotation(size: int, seed: int) -> torch.Tensor:
    """A random orthogonal matrix of determinant 1 (the Cayley steps from the identity stay in that component)."""
    q, _ = torch.linalg.qr(torch.randn(size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    q[:, 0] *= torch.linalg.det(q)
    return q


def test_cayley_sgd_stays_orthogonal_and_solves_procrustes():
    """min ||A X - B|| over orthogonal X, with B = A Q: the steps stay on the orthogonal group and reach Q."""
    a = torch.randn(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    target = _random_rotation(16, 1)
    x = torch.eye(16, dtype=torch.float64, requires_grad=True)
    optimizer = CayleySGD([x], lr=0.003)
    first = None
    for _ in range(200):
        loss = (a @ x - a @ target).square().sum()
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch.testing.assert_close(x.detach() @ x.detach().T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-10)
    assert loss.item() < 1e-6 * first
    torch.testing.assert_close(x.detach(), target, rtol=0, atol=1e-4)


def test_cayley_sgd_caps_each_turn():
    x = torch.eye(8, dtype=torch.float64, requires_grad=True)
    x.grad = 1e6 * torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    CayleySGD([x], lr=1.5).step()
    # X - I = -(I + aA/2)^-1 aA with ||aA||_F <= 1 (the cap) and a skew A: at most 1, and about 1 when capped; an
    # uncapped step at this gradient would turn nearly every plane by ~pi (||X - I||_F near 2 sqrt(8)).
    assert 0.5 < torch.linalg.matrix_norm(x.detach() - torch.eye(8, dtype=torch.float64)) <= 1.0
    with pytest.raises(ValueError, match="lr=0"):
        CayleySGD([x], lr=0)


@pytest.mark.parametrize(
    "kind, dtype", [("llama", "float32"), ("qwen2", "float32"), ("gemma3", "float32"), ("llama", "bfloat16")]
)
@pytest.mark.parametrize("method", ["dmx", "paper"])
def test_learned_rotations_keep_the_function_and_change_the_weights(kind, dtype, method):
    model = tiny_decoder(kind, tied=True, dtype=getattr(torch, dtype))
    rotate_model(model, "hadamard", linear_modules_to_quantize(model, ["lm_head"]))
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits.float()
    before = copy.deepcopy(model.state_dict())
    settings = CalibrationSettings(
        method=method, target_bits=5, num_samples=8, seq_len=16, batch_size=2, steps=4, learn_rotations=True
    )
    calibrate(model, ids, settings, progress=False)
    with torch.no_grad():
        logits = model(ids).logits.float()
    tolerance = 1e-4 if dtype == "float32" else 0.02 * reference.abs().max().item()  # bf16: the rotation's rounding
    assert (logits - reference).abs().max().item() < tolerance
    changed = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    expected = {"model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight"}  # R2
    if kind == "qwen2":
        expected.add("model.layers.0.self_attn.v_proj.bias")
    if kind != "gemma3":  # R1: the residual stream, everything that reads or writes it
        expected |= {
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
        }
    else:  # post-block norms: the residual stream is not rotated
        assert "model.embed_tokens.weight" not in changed and "model.layers.0.mlp.up_proj.weight" not in changed
    assert expected <= changed
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_learned_rotations_lower_the_quantized_loss():
    model, ids = sensitive_llama_and_data(num_samples=16, seq_len=32)
    rotate_model(model, "hadamard", linear_modules_to_quantize(model, ["lm_head"]))
    format_map = {name: "mxfp4_e2m1" for name in linear_modules_to_quantize(model, ["lm_head"])}

    def quantized_loss(m):
        with torch.no_grad(), emulate_format_map(m, format_map):
            return m(input_ids=ids, labels=ids).loss.item()

    learned = copy.deepcopy(model)
    settings = CalibrationSettings(
        target_bits=4.5, num_samples=16, seq_len=32, batch_size=4, steps=30, learn_rotations=True
    )
    calibrate(learned, ids, settings, progress=False)
    assert quantized_loss(learned) < 0.97 * quantized_loss(model)


def test_learned_rotations_leave_the_model_as_it_was_on_error():
    model = tiny_decoder("llama", tied=False)
    rotate_model(model, "hadamard", linear_modules_to_quantize(model, ["lm_head"]))
    before = copy.deepcopy(model.state_dict())
    settings = CalibrationSettings(target_bits=5, num_samples=1, seq_len=2, batch_size=1, steps=1)
    sites = learnable_sites(model)
    with pytest.raises(RuntimeError, match="stop"), dmx_linears(model, settings) as layers:
        with learned_rotations(model, layers, sites, lr=1.5) as rotations:
            with torch.no_grad():
                rotations.residual.copy_(torch.linalg.qr(torch.randn(96, 96, dtype=torch.float64))[0])
            raise RuntimeError("stop")
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert all(layer.input_rotation is None and layer.output_rotation is None for layer in layers.values())


def test_learned_rotations_refuse_what_they_cannot_train():
    model = tiny_decoder("llama", tied=False)  # not rotated: its norm scales are not folded
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError, match="rotate the model first"):
        calibrate(
            model,
            ids,
            CalibrationSettings(num_samples=2, seq_len=8, batch_size=1, steps=1, learn_rotations=True),
            progress=False,
        )
    with pytest.raises(
        ValueError,
        match="learn_rotations=True trains merged rotations: it needs rotation='hadamard' "
        "or 'block_hadamard', got rotation='online_block_hadamard'",
    ):
        DMXConfig(learn_rotations=True, rotation="online_block_hadamard")
    with pytest.raises(ValueError, match="learn_rotations='yes'"):
        CalibrationSettings(learn_rotations="yes")


def test_checkpoint_with_learned_rotations_reloads_exactly(tmp_path):
    """from_pretrained(DMXConfig(rotation=..., learn_rotations=True)) -> save -> a fresh process gets the same logits
    with nothing of the learned rotations recorded but the flag: they live in the weights."""
    tiny_decoder("llama", tied=True).save_pretrained(tmp_path / "float")
    tokenizer = word_tokenizer(num_words=200)
    config = DMXConfig(
        target_bits=5,
        dataset=[words(0, 3000, 200)],
        tokenizer=tokenizer,
        rotation="block_hadamard",
        learn_rotations=True,
        num_samples=8,
        seq_len=16,
        batch_size=2,
        steps=3,
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    model.save_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    assert model.config.quantization_config.learn_rotations is True
    code = f"""
import json, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "dmx")!r})
with torch.no_grad():
    torch.save(model(torch.tensor({INPUT_IDS.tolist()})).logits, {str(tmp_path / "reloaded.pt")!r})
print(json.dumps({{"learn_rotations": model.config.quantization_config.learn_rotations}}))
"""
    assert last_json_line(run_python(code)) == {"learn_rotations": True}
    assert torch.equal(torch.load(tmp_path / "reloaded.pt"), logits)
