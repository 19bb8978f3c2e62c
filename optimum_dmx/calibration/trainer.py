"""The dMX calibration loop: learn one format offset per linear layer by gradient descent.

`calibrate` swaps the targeted `nn.Linear` modules for `DMXLinear` in place, freezes every model weight,
and trains only the offsets `beta_hat` with SGD on `causal-LM cross-entropy + bit regularizer` while the
temperature of `F(beta_hat, T)` is annealed. Each layer is then discretized (`beta_hat >= 1` -> the pair's
high format) and the original modules are put back, untouched. Turning the returned format map into
quantized modules is the caller's job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..nn.bits import average_bits, tensor_sizes
from ..nn.surgery import linear_modules_to_quantize, swapped_modules
from .data import build_calibration_batches
from .dmx_linear import DMXLinear
from .regularizers import bit_regularizer
from .result import CalibrationResult, result_from_format_map
from .schedule import temperature_at
from .settings import CalibrationSettings


logger = logging.getLogger(__name__)


def _batches(num_samples: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Row indices of each step's batch: seeded random epochs over the samples, cycled as needed."""
    generator = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while len(pending) < batch_size:
            pending = torch.cat([pending, torch.randperm(num_samples, generator=generator)])
        yield pending[:batch_size]
        pending = pending[batch_size:]


@contextmanager
def dmx_linears(
    model: nn.Module, settings: CalibrationSettings, straight_through: bool = False
) -> Iterator[dict[str, nn.Module]]:
    """Temporarily replace the targeted linears of `model` by `DMXLinear` (offsets at 0), weights frozen.

    Yields the new modules by name; see `swapped_modules` for what is restored on exit.
    """
    targets = linear_modules_to_quantize(model, settings.modules_to_not_convert)
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear left to quantize after excluding "
            f"modules_to_not_convert={settings.modules_to_not_convert}."
        )
    layers = {
        name: DMXLinear(
            linear,
            settings.format_pair,
            block_size=settings.block_size,
            quantize_activations=settings.quantize_activations,
            temperature=settings.t_start,
            straight_through=straight_through,
        )
        for name, linear in targets.items()
    }
    with swapped_modules(model, layers):
        yield layers


def calibrate(
    model: nn.Module,
    input_ids: torch.LongTensor,
    settings: CalibrationSettings,
    progress: bool = True,
    *,
    straight_through: bool = False,
) -> CalibrationResult:
    """Learn a per-layer MX format assignment for `model` on calibration tokens.

    Args:
        model: a Hugging Face causal LM (anything returning `.loss` for `model(input_ids=, labels=)`).
        input_ids: `[num_samples, seq_len]` calibration token ids (see `build_calibration_batches`).
        settings: the run's hyper-parameters.
        progress: show a progress bar with step, loss, current average bits and temperature.
        straight_through: ROUND+STE baseline: use the discrete format in every forward pass and pass
            gradients straight through the rounding.

    Returns:
        The discretized format map, its bits (simple, weighted, storage) and the per-step history.
        The model comes back with its original modules, `requires_grad` flags and train/eval mode.
    """
    if not isinstance(settings, CalibrationSettings):
        raise TypeError(f"settings must be a CalibrationSettings, got {type(settings).__name__}.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a 2-D LongTensor of shape [num_samples, seq_len].")
    if input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} holds no sequence of at least 2 tokens.")

    start = time.perf_counter()
    device = next(model.parameters()).device
    history: list[dict] = []
    with dmx_linears(model, settings, straight_through) as layers:
        modules = list(layers.values())
        sizes = tensor_sizes([tuple(m.weight.shape) for m in modules], settings.quantize_activations)
        optimizer = torch.optim.SGD([m.beta_hat for m in modules], lr=settings.lr)
        batches = _batches(len(input_ids), settings.batch_size, settings.steps, settings.seed)
        bar = tqdm(batches, total=settings.steps, desc="dMX calibration", disable=not progress)
        for step, rows in enumerate(bar):
            temperature = temperature_at(
                step, settings.steps, settings.t_start, settings.t_end, settings.t_warmup_ratio
            )
            for m in modules:
                m.temperature = temperature
            batch = input_ids[rows].to(device)
            task_loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            bits = torch.stack([m.element_bits() for m in modules])
            avg_bits = average_bits(bits, settings.bit_average, sizes)
            reg_loss = bit_regularizer(avg_bits, settings.regularizer, settings.reg_lambda, settings.target_bits)
            loss = task_loss.float() + reg_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            record = {
                "step": step,
                "loss": loss.item(),
                "task_loss": task_loss.item(),
                "reg_loss": reg_loss.item(),
                "bits": avg_bits.item(),
                "bits_simple": average_bits(bits.detach(), "simple").item(),
                "bits_weighted": average_bits(bits.detach(), "weighted", sizes).item(),
                "temperature": temperature,
            }
            history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", bits=f"{record['bits']:.3f}", T=f"{temperature:.1f}")

        format_map = {name: m.discrete_format.name for name, m in layers.items()}
        beta_hat = {name: m.beta_hat.item() for name, m in layers.items()}
        result = result_from_format_map(
            format_map,
            layers,
            settings,
            history=history,
            beta_hat=beta_hat,
            method="round_ste" if straight_through else "dmx",
            seconds=time.perf_counter() - start,
        )
    logger.info(
        "Calibrated %d layers: %.3f bits (simple), %.3f bits (weighted), %.3f storage bits.",
        len(format_map), result.bits_simple, result.bits_weighted, result.storage_bits,
    )
    return result


def calibrate_on_text(
    model: nn.Module, dataset: Any, tokenizer: Any, settings: CalibrationSettings, progress: bool = True
) -> CalibrationResult:
    """`calibrate` on `settings.num_samples` blocks of `settings.seq_len` tokens drawn from `dataset`.

    `dataset` is any source `build_calibration_batches` accepts (Hub name, files, `datasets.Dataset`, texts).
    """
    input_ids = build_calibration_batches(dataset, tokenizer, settings.seq_len, settings.num_samples, settings.seed)
    return calibrate(model, input_ids, settings, progress)
