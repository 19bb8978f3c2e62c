"""Baselines that dMX is compared with, on the same data and with the same bit accounting.

* uniform: every targeted layer in one format (weights and activations);
* KL pre-selection (`method="kl"`): rank layers by KL(float || model with only that layer in the pair's low
  format) on calibration tokens, and give the high format to the most sensitive layers while the budget allows.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..continuous import get_format_pair
from ..formats import get_format, kernel_setup_seconds
from ..nn.surgery import linear_modules_to_quantize
from .budget import budget_format_map
from .groups import offset_groups
from .result import CalibrationResult, result_from_format_map
from .sensitivity import kl_sensitivities
from .settings import CalibrationSettings

__all__ = ["kl_preselection", "kl_sensitivities", "uniform", "uniform_format_map"]


def uniform_format_map(model: nn.Module, fmt: str, modules_to_not_convert: list[str] | None = None) -> dict[str, str]:
    """Every linear that dMX would target, in the single format `fmt`."""
    name = get_format(fmt).name
    return {n: name for n in linear_modules_to_quantize(model, modules_to_not_convert)}


def uniform(model: nn.Module, fmt: str, settings: CalibrationSettings) -> CalibrationResult:
    """The uniform baseline as a result (bits are those of `fmt` by construction)."""
    format_map = uniform_format_map(model, fmt, settings.modules_to_not_convert)
    linears = linear_modules_to_quantize(model, settings.modules_to_not_convert)
    return result_from_format_map(format_map, linears, settings, method="uniform")


def kl_preselection(
    model: nn.Module,
    input_ids: torch.LongTensor,
    settings: CalibrationSettings,
    progress: bool = True,
    sensitivities: dict[str, float] | None = None,
) -> CalibrationResult:
    """KL pre-selection: the most sensitive layers get the high format while the average stays within
    `settings.target_bits` (in `settings.bit_average`), by the rule every method shares (`budget_format_map`).
    Pass precomputed `sensitivities` to skip the scan."""
    start, kernels_before = time.perf_counter(), kernel_setup_seconds()
    if sensitivities is None:
        sensitivities = kl_sensitivities(model, input_ids, settings, progress)
    scan_seconds = time.perf_counter() - start
    kernel_seconds = {"scan": kernel_setup_seconds() - kernels_before}
    targets = linear_modules_to_quantize(model, settings.modules_to_not_convert)
    missing = set(targets) - set(sensitivities)
    if missing:
        raise ValueError(f"sensitivities lack {len(missing)} targeted layers, e.g. {sorted(missing)[:3]}.")
    format_map = budget_format_map(
        {name: sensitivities[name] for name in targets},
        {name: tuple(linear.weight.shape) for name, linear in targets.items()},
        get_format_pair(settings.format_pair),
        settings.target_bits,
        settings.bit_average,
        settings.quantize_activations,
        groups=offset_groups(settings.offset_groups, list(targets)),
        cost_table=settings.cost_table,
    )
    return result_from_format_map(
        format_map,
        targets,
        settings,
        method="kl",
        seconds=time.perf_counter() - start,
        scan_seconds=scan_seconds,
        kernel_seconds=kernel_seconds,
    )
