"""Calibration of a model whose weights are not all in memory: accelerate's `device_map` offloading half of the
decoder layers to disk gives the map of a plain load, and keeps them offloaded.

On a machine without accelerators, "disk" is the offload target accelerate can exercise (a "cpu" entry is the
execution device itself); offloading to CPU memory next to a GPU uses the same hook with its weights in memory.
FSDP2 sharding is tested with real processes in `test_calibration_distributed.py`.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_dmx.calibration import CalibrationSettings, calibrate
from optimum_dmx.calibration.dmx_linear import DMXLinear, EndpointProbe
from optimum_dmx.nn.placement import execution_device, is_offloaded, loaded_weights

from .helpers import tiny_llama

SETTINGS = {"target_bits": 5.5, "steps": 6, "batch_size": 4, "seq_len": 16, "num_samples": 16}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=4).save_pretrained(folder)
    return folder


def _half_on_disk(folder, offload_folder):
    """The saved model with decoder layers 2 and 3 offloaded to disk by accelerate (through `from_pretrained`)."""
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" if i < 2 else "disk" for i in range(4)})
    return AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=offload_folder).eval()


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


def test_learned_rotations_on_an_offloaded_model_are_refused_naming_a_layer(saved_model, tmp_path):
    model = _half_on_disk(saved_model, tmp_path / "offload")
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(learn_rotations=True, **SETTINGS)
    with pytest.raises(ValueError, match=r"sharded or offloaded \(e\.g\. 'model\.layers\.2\.self_attn\.q_proj'\)"):
        calibrate(model, ids, settings, progress=False)
