import math

import pytest
import torch

from optimum_dmx.calibration import temperature_at, temperature_sigmoid


@pytest.mark.parametrize("temperature", [0.5, 8.0, 400.0])
def test_midpoint_is_one_for_every_temperature(temperature):
    assert temperature_sigmoid(torch.tensor(1.0), temperature).item() == pytest.approx(1.0, abs=1e-7)


def test_sigmoid_matches_formula_and_range():
    beta_hat = torch.linspace(-3, 5, 41)
    for t in (1.0, 8.0, 50.0):
        expected = 2 / (1 + torch.exp(-t * (beta_hat / 2 - 0.5)))
        got = temperature_sigmoid(beta_hat, t)
        torch.testing.assert_close(got, expected)
        assert got.min() >= 0 and got.max() <= 2
    # Range over beta_hat in [0, 2] at T = 5 (from the closed form): [0.152, 1.848].
    ends = temperature_sigmoid(torch.tensor([0.0, 2.0]), 5.0)
    torch.testing.assert_close(ends, torch.tensor([0.1517, 1.8483]), atol=1e-4, rtol=0)


def test_slope_at_midpoint_is_t_over_4():
    beta_hat = torch.tensor(1.0, requires_grad=True)
    temperature_sigmoid(beta_hat, 8.0).backward()
    assert beta_hat.grad.item() == pytest.approx(2.0)


def test_high_temperature_is_a_step_at_one():
    values = temperature_sigmoid(torch.tensor([0.9, 1.1]), 400.0)
    torch.testing.assert_close(values, torch.tensor([0.0, 2.0]), atol=1e-8, rtol=0)


def test_schedule_constant_then_exponential_to_t_end():
    steps, t_start, t_end, ratio = 10, 8.0, 400.0, 0.6
    temps = [temperature_at(s, steps, t_start, t_end, ratio) for s in range(steps)]
    assert temps[:6] == [t_start] * 6
    assert temps[-1] == pytest.approx(t_end)
    ratios = [b / a for a, b in zip(temps[6:], temps[7:])]
    assert ratios == pytest.approx([(t_end / t_start) ** (1 / 4)] * 3)
    assert temps[6] == pytest.approx(t_start * (t_end / t_start) ** (1 / 4))


def test_schedule_without_warmup_and_all_warmup():
    assert temperature_at(0, 4, 2.0, 32.0, 0.0) == pytest.approx(4.0)
    assert temperature_at(3, 4, 2.0, 32.0, 0.0) == pytest.approx(32.0)
    assert {temperature_at(s, 4, 2.0, 32.0, 1.0) for s in range(4)} == {2.0}
    assert temperature_at(0, 1, 8.0, 400.0, 0.6) == pytest.approx(400.0)


@pytest.mark.parametrize("step", [-1, 5])
def test_schedule_rejects_steps_outside_the_run(step):
    with pytest.raises(ValueError, match=f"step={step}"):
        temperature_at(step, 5, 8.0, 400.0, 0.6)


def test_log_temperature_is_linear_after_warmup():
    temps = [temperature_at(s, 100, 8.0, 400.0, 0.6) for s in range(60, 100)]
    logs = [math.log(t) for t in temps]
    diffs = {round(b - a, 9) for a, b in zip(logs, logs[1:])}
    assert len(diffs) == 1
