"""Calibration of a model whose weights are not all in memory: accelerate's `device_map` offloading half of the
decoder layers to disk gives the map of a plain load, and keeps them offloaded; rotations, fixed and learned,
write the weights of a plain load into the offload folder.

On a machine without accelerators, "disk" is the offload target accelerate can exercise (a "cpu" entry is the
execution device itself); offloading to CPU memory next to a GPU uses the same hook with its weights in memory.
FSDP2 sharding is tested with real processes in `test_calibration_distributed.py`.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_dmx.calibration import CalibrationSettings, calibrate
from optimum_dmx.calibration.dmx_linear import DMXLinear, EndpointProbe
from optimum_dmx.nn import linear_modules_to_quantize
from optimum_dmx.nn.placement import execution_device, is_offloaded, loaded_weights
from optimum_dmx.nn.rotation import rotate_model

from .helpers import file_bytes, tiny_llama

SETTINGS = {"target_bits": 5.5, "steps": 6, "batch_size": 4, "seq_len": 16, "num_samples": 16}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=4).save_pretrained(folder)
    return folder


def _half_on_disk(folder, offload_folder, dtype=torch.float32):
    """The saved model with decoder layers 2 and 3 offloaded to disk by accelerate (through `from_pretrained`)."""
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" if i < 2 else "disk" for i in range(4)})
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, device_map=device_map, offload_folder=offload_folder
    ).eval()


@pytest.mark.parametrize("method", ["dmx", pytest.param("paper", marks=pytest.mark.slow)])  # the same placement
def test_offloading_half_the_decoder_to_disk_gives_the_map_of_a_plain_load(method, saved_model, tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    # The paper's method at a learning rate that moves some offsets past the threshold in 6 steps (a map with both
    # formats); the offloaded run computes the same floats in the same order, so its SGD path is the same.
    recipe = {"paper": {"lr": 50.0}} if method == "paper" else {}
    settings = CalibrationSettings(method=method, **SETTINGS, **recipe)
    plain = calibrate(AutoModelForCausalLM.from_pretrained(saved_model).eval(), ids, settings, progress=False)

    model = _half_on_disk(saved_model, tmp_path / "offload")
    offloaded = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_offloaded(m)]
    assert len(offloaded) == 14  # 7 linears in each of the two offloaded decoder layers
    # With activation checkpointing, as a large model is calibrated: the backward pass loads each weight again.
    settings = CalibrationSettings(method=method, gradient_checkpointing=True, **SETTINGS, **recipe)
    result = calibrate(model, ids, settings, progress=False)

    assert result.format_map == plain.format_map
    assert len(set(plain.format_map.values())) == 2  # a real map, not all one format
    assert result.beta_hat == pytest.approx(plain.beta_hat, rel=1e-5, abs=1e-7)
    assert result.kl_sensitivities == pytest.approx(plain.kl_sensitivities, rel=1e-5)
    assert [h["loss"] for h in result.history] == pytest.approx([h["loss"] for h in plain.history], rel=1e-5)
    # The model comes back as it came: the same linears, still offloaded.
    assert [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_offloaded(m)] == offloaded


def test_a_stand_in_for_an_offloaded_linear_loads_its_weight_per_call_and_keeps_nothing_from_it(saved_model, tmp_path):
    model = _half_on_disk(saved_model, tmp_path / "offload")
    linear = model.model.layers[3].mlp.down_proj
    reference = AutoModelForCausalLM.from_pretrained(saved_model).model.layers[3].mlp.down_proj
    assert is_offloaded(linear) and execution_device(linear) == torch.device("cpu")
    with loaded_weights(linear) as loaded:
        assert torch.equal(loaded.weight, reference.weight)
    assert linear.weight.is_meta  # dropped again on exit

    x = torch.randn(2, 5, linear.in_features)
    layers = {}
    for name, source in (("offloaded", linear), ("in memory", reference)):
        layers[name] = DMXLinear(source, "mxfp8-mxfp4", offset=EndpointProbe())
        layers[name].offset.set(0.0, torch.device("cpu"), measure=True)
    outputs = {name: layer(x) for name, layer in layers.items()}
    assert torch.equal(outputs["offloaded"], outputs["in memory"])
    assert layers["offloaded"]._weight_block_max is None and not layers["offloaded"]._frozen_weights
    assert layers["in memory"]._frozen_weights  # a weight in memory: its endpoint quantization is kept
    assert linear.weight.is_meta


@pytest.mark.parametrize(
    "rotation, dtype",
    [("hadamard", torch.float32), ("online_block_hadamard", torch.float32), ("hadamard", torch.bfloat16)],
)
def test_rotating_an_offloaded_model_writes_the_weights_of_a_plain_load_and_leaves_its_checkpoint(
    rotation, dtype, saved_model, tmp_path
):
    checkpoint = file_bytes(saved_model)
    plain = AutoModelForCausalLM.from_pretrained(saved_model, dtype=dtype).eval()
    model = _half_on_disk(saved_model, tmp_path / "offload", dtype=dtype)
    for each in (plain, model):
        rotate_model(each, rotation, list(linear_modules_to_quantize(each, ["lm_head"])), seed=3)

    for name, module in plain.named_modules():
        if getattr(module, "weight", None) is not None:
            with loaded_weights(model, name) as rotated:
                assert rotated.weight.dtype == dtype and torch.equal(rotated.weight, module.weight), name
    down_proj = model.model.layers[3].mlp.down_proj
    assert is_offloaded(down_proj)  # still offloaded, by the same hook, under the module that replaced it
    if rotation == "online_block_hadamard":
        assert type(down_proj).__name__ == "TransformedLinear"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)  # the same weights, computed the same way
    assert file_bytes(saved_model) == checkpoint  # written to the offload folder, never to the checkpoint
    assert (tmp_path / "offload" / "model.layers.3.mlp.down_proj.weight.dat").is_file()


def test_learned_rotations_on_an_offloaded_model_give_the_map_and_weights_of_a_plain_load(saved_model, tmp_path):
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(learn_rotations=True, gradient_checkpointing=True, **SETTINGS)
    results, models = [], []
    for model in (AutoModelForCausalLM.from_pretrained(saved_model).eval(), _half_on_disk(saved_model, tmp_path)):
        rotate_model(model, "hadamard", list(linear_modules_to_quantize(model, ["lm_head"])))
        results.append(calibrate(model, ids, settings, progress=False))
        models.append(model)
    plain, offloaded = results

    assert offloaded.format_map == plain.format_map
    assert offloaded.beta_hat == pytest.approx(plain.beta_hat, rel=1e-5, abs=1e-7)
    assert [h["loss"] for h in offloaded.history] == pytest.approx([h["loss"] for h in plain.history], rel=1e-5)
    learned = 0
    for name, module in models[0].named_modules():  # the learned rotations merged into the offloaded weights too
        if isinstance(module, torch.nn.Linear):
            with loaded_weights(models[1], name) as merged:
                torch.testing.assert_close(merged.weight, module.weight, rtol=1e-4, atol=1e-6)
            learned += name.startswith("model.layers.3.")
    assert learned == 7 and is_offloaded(models[1].model.layers[3].self_attn.q_proj)
    reference = AutoModelForCausalLM.from_pretrained(saved_model).model.layers[3].self_attn.q_proj.weight
    with loaded_weights(models[1], "model.layers.3.self_attn.q_proj") as merged:
        assert not torch.allclose(merged.weight, reference, atol=1e-3)  # rewritten, not left as loaded


def test_rotating_a_model_offloaded_to_cpu_memory_writes_into_the_hooks_state_dict():
    # Accelerate's hook with its weights in a dict in CPU memory (a "cpu" entry of a device map beside a GPU),
    # here with the CPU as the execution device too.
    from accelerate import cpu_offload

    plain, model = (tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=2) for _ in range(2))
    cpu_offload(model.model.layers, execution_device=torch.device("cpu"))
    stored = model.model.layers[1].mlp.up_proj._hf_hook.weights_map
    before = stored["weight"].clone()
    for each in (plain, model):
        rotate_model(each, "hadamard", list(linear_modules_to_quantize(each, ["lm_head"])), seed=3)

    assert is_offloaded(model.model.layers[1].mlp.up_proj) and not torch.equal(stored["weight"], before)
    for name, module in plain.named_modules():
        if getattr(module, "weight", None) is not None:
            with loaded_weights(model, name) as rotated:
                assert torch.equal(rotated.weight, module.weight), name
