"""Temperature annealing of the format offset, and the discretization rule it converges to.

Each layer learns a raw offset `beta_hat`; the quantizer sees `beta = F(beta_hat, T)`, a sigmoid scaled to
[0, 2] whose midpoint sits at `beta_hat = 1`. A low temperature keeps the relaxation smooth; raising it
makes `F` a step at 1, so the continuous format converges to the discrete choice made after calibration.
"""

from __future__ import annotations

import math

import torch

from ..continuous import MAX_OFFSET

MIDPOINT = MAX_OFFSET / 2  # F(MIDPOINT, T) = MIDPOINT for every T: where the step lands as T grows
# The paper's schedule: T = 8 for the first 60% of the steps, then an exponential rise to 400. The default method
# anneals its map sampling on the same schedule.
T_START, T_END, T_WARMUP_RATIO = 8.0, 400.0, 0.6


def temperature_sigmoid(beta_hat: torch.Tensor, temperature: float) -> torch.Tensor:
    """`F(beta_hat, T) = 2 / (1 + exp(-T (beta_hat / 2 - 0.5)))`, with `F(1, T) = 1` for every `T`."""
    return MAX_OFFSET * torch.sigmoid(temperature * (beta_hat / MAX_OFFSET - 0.5))


def discrete_offset(beta_hat: torch.Tensor) -> torch.Tensor:
    """The discretization rule: `F(beta_hat, T)` as `T` grows, a step to 2 (the high format) at `beta_hat >= 1`."""
    return torch.where(beta_hat >= MIDPOINT, MAX_OFFSET, 0.0)


def temperature_at(step: int, steps: int, t_start: float, t_end: float, warmup_ratio: float) -> float:
    """Temperature used at `step` (0-based) of a run of `steps` steps.

    The first `int(warmup_ratio * steps)` steps use `t_start`; the remaining ones rise geometrically so
    that the last step uses exactly `t_end`.
    """
    if not 0 <= step < steps:
        raise ValueError(f"step={step!r} must lie in [0, {steps}) for a run of {steps} steps.")
    warmup = int(warmup_ratio * steps)
    if step < warmup:
        return float(t_start)
    progress = (step - warmup + 1) / (steps - warmup)
    return float(t_start * math.exp(progress * math.log(t_end / t_start)))
