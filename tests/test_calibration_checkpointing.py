"""Activation checkpointing during calibration (`CalibrationSettings.gradient_checkpointing`): same results bit
for bit, each decoder layer recomputed exactly once per step, the model's own settings restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from optimum_dmx import DMXConfig
from optimum_dmx.calibration import CalibrationSettings, DMXLinear, calibrate

from .helpers import sensitive_llama_and_data


@pytest.fixture(scope="module")
def sensitive():
    return sensitive_llama_and_data()


@pytest.fixture
def forward_calls(monkeypatch):
    """Counts `DMXLinear.forward` calls (a recomputed layer calls them again, without module hooks)."""
    calls = {"count": 0}
    original = DMXLinear.forward

    def counted(self, x):
        calls["count"] += 1
        return original(self, x)

    monkeypatch.setattr(DMXLinear, "forward", counted)
    return calls


@pytest.mark.parametrize("method", ["dmx", "paper"])
def test_checkpointed_calibration_gives_the_same_result(sensitive, forward_calls, method):
    model, data = sensitive
    results, calls = [], []
    for checkpointing in (False, True):
        settings = CalibrationSettings(
            method=method,
            target_bits=5.0,
            num_samples=len(data),
            seq_len=data.shape[1],
            batch_size=4,
            steps=3,
            gradient_checkpointing=checkpointing,
        )
        forward_calls["count"] = 0
        results.append(calibrate(model, data, settings, progress=False))
        calls.append(forward_calls["count"])
    plain, checkpointed = results
    assert checkpointed.format_map == plain.format_map
    assert checkpointed.beta_hat == plain.beta_hat
    assert [h["loss"] for h in checkpointed.history] == [h["loss"] for h in plain.history]
    assert calls[1] == 2 * calls[0]  # one recomputation per layer and step, no more
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert not model.is_activation_checkpointing and not any(layer.training for layer in layers)


def test_checkpointing_keeps_a_model_that_had_it_on(sensitive):
    model, data = sensitive
    model.activation_checkpointing_enable()
    try:
        settings = CalibrationSettings(
            target_bits=5.0,
            num_samples=len(data),
            seq_len=data.shape[1],
            batch_size=4,
            steps=2,
            gradient_checkpointing=True,
        )
        calibrate(model, data, settings, progress=False)
        assert model.is_activation_checkpointing
    finally:
        model.activation_checkpointing_disable()


def test_checkpointing_settings_are_checked():
    with pytest.raises(ValueError, match="gradient_checkpointing='yes' must be True or False"):
        CalibrationSettings(gradient_checkpointing="yes")
    assert DMXConfig(target_bits=5, gradient_checkpointing=True).calibration_settings().gradient_checkpointing


class _NoDecoderLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.proj = nn.Linear(32, 16)

    def forward(self, input_ids, labels=None, use_cache=False):
        raise AssertionError("not reached: the settings are refused first")


def test_a_model_without_checkpointable_layers_is_refused():
    settings = CalibrationSettings(
        target_bits=5.0, num_samples=2, seq_len=4, batch_size=2, steps=1, gradient_checkpointing=True
    )
    with pytest.raises(ValueError, match="_NoDecoderLayers has none.*gradient_checkpointing=False"):
        calibrate(_NoDecoderLayers(), torch.zeros(2, 4, dtype=torch.long), settings, progress=False)
