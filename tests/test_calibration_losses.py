import pytest
import torch

from .helpers import sensitive_llama_and_data
from optimum_dmx.calibration import CalibrationSettings, calibrate
from optimum_dmx.calibration.dmx_linear import unquantized
from optimum_dmx.calibration.losses import calibration_loss
from optimum_dmx.calibration.trainer import dmx_linears


def settings(**overrides) -> CalibrationSettings:
    base = dict(target_bits=5.0, num_samples=16, seq_len=32, batch_size=4, steps=8, kl_weight=0.0)
    return CalibrationSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def sensitive():
    return sensitive_llama_and_data()


def _kl_per_token(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """sum_v p (log p - log q), averaged over positions, written out (not `F.kl_div`)."""
    log_p = reference_logits.double().log_softmax(-1)
    log_q = logits.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def test_distillation_is_the_kl_from_the_float_model(sensitive):
    """The distillation loss reads the untouched float model as its reference (the float pass inside calibration
    gives the same logits) and is the per-token KL of the quantized model's next-token distributions from it."""
    model, ids = sensitive
    batch = ids[:4]
    with torch.no_grad():
        float_logits = model(input_ids=batch).logits
    with dmx_linears(model, settings()) as layers:
        for layer in layers.values():
            layer.probe = torch.tensor(0.0)  # every layer in MXFP4
        with torch.no_grad():
            quantized_logits = model(input_ids=batch).logits
            with unquantized(layers.values()):
                torch.testing.assert_close(model(input_ids=batch).logits, float_logits, rtol=0, atol=1e-6)
                assert calibration_loss(model, batch, "distillation", layers.values()).item() == 0.0
        loss = calibration_loss(model, batch, "distillation", layers.values())
    assert loss.item() == pytest.approx(_kl_per_token(float_logits, quantized_logits), rel=1e-5)
    assert loss.item() > 1e-3  # MXFP4 moves this model's distributions
    assert not any(layer.bypass for layer in layers.values())


@pytest.mark.parametrize("recipe", ["dmx", "paper"])
def test_both_recipes_learn_from_the_distillation_loss(sensitive, recipe):
    """A distillation run keeps the budget (the budget rule's grid point, as cross-entropy's), learns offsets of its
    own (not the cross-entropy run's) and records the KL, which is never negative, as its loss."""
    model, ids = sensitive
    runs = {loss: calibrate(model, ids, settings(recipe=recipe, loss=loss, discretization="budget", lr=20.0),
                            progress=False)
            for loss in ("cross_entropy", "distillation")}
    distilled = runs["distillation"]
    assert distilled.bits_simple == runs["cross_entropy"].bits_simple <= 5.0  # 14 layers: 4.857 is the closest
    assert distilled.beta_hat != runs["cross_entropy"].beta_hat
    assert all(step["task_loss"] >= 0 for step in distilled.history)
    assert max(step["task_loss"] for step in distilled.history) < min(
        step["task_loss"] for step in runs["cross_entropy"].history)  # KL to the float model, not the text's loss
