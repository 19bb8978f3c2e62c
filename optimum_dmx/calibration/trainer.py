"""The dMX calibration loop: learn one format offset per linear layer by gradient descent.

`calibrate` swaps the targeted `nn.Linear` modules for `DMXLinear` in place, freezes every model weight,
and trains only the offsets `beta_hat` with SGD on `causal-LM cross-entropy + bit regularizer` while the
temperature of `F(beta_hat, T)` is annealed. Each layer is then discretized (`beta_hat >= 1` -> the pair's
high format) and the original modules are put back, untouched. Turning the returned format map into
quantized modules is the caller's job.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..formats import get_format
from .regularizers import average_bits, bit_regularizer, bit_summary, tensor_sizes
from .schedule import temperature_at
from .settings import CalibrationSettings


logger = logging.getLogger(__name__)


@dataclass
class CalibrationResult:
    """Outcome of a calibration (or of a baseline format assignment).

    Attributes:
        format_map: full module name -> canonical MX format name.
        bits_simple: mean element bits over the quantized layers (scales excluded).
        bits_weighted: element bits averaged by tensor size (weight numel + in_features per layer).
        storage_bits: stored bits per weight element, E8M0 block scales included.
        history: one record per step: `step`, `loss`, `task_loss`, `reg_loss`, `bits` (the average the
            regularizer uses), `bits_simple`, `bits_weighted`, `temperature`.
        beta_hat: final raw offset per module (empty for methods without offsets).
        method: which procedure produced the assignment (`"dmx"`, `"round_ste"`, `"kl"`, `"uniform"`).
        seconds: wall time of the procedure.
    """

    format_map: dict[str, str]
    bits_simple: float
    bits_weighted: float
    storage_bits: float
    history: list[dict] = field(default_factory=list)
    beta_hat: dict[str, float] = field(default_factory=dict)
    method: str = "dmx"
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the result, history included, as indented JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)


def _matches(name: str, pattern: str) -> bool:
    """A pattern names the module itself, a suffix or a prefix of its dotted name at a module boundary."""
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def linear_modules_to_quantize(model: nn.Module, modules_to_not_convert: Sequence[str] | None) -> dict[str, nn.Linear]:
    """The `nn.Linear` modules of `model` that dMX quantizes, by full name, in model order.

    A module is skipped when a pattern of `modules_to_not_convert` equals its full name, is a suffix of it
    at a module boundary (`"lm_head"`, `"mlp.down_proj"`), or a prefix at a module boundary
    (`"model.layers.0"` skips that layer's linears but not those of `model.layers.0x`).
    """
    patterns = list(modules_to_not_convert or [])
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(_matches(name, p) for p in patterns)
    }


def result_from_format_map(
    format_map: Mapping[str, str],
    linears: Mapping[str, nn.Linear],
    settings: CalibrationSettings,
    **fields,
) -> CalibrationResult:
    """A `CalibrationResult` for `format_map` over `linears`, with its bit accounting filled in."""
    names = list(format_map)
    summary = bit_summary(
        [get_format(format_map[n]).bits for n in names],
        [tuple(linears[n].weight.shape) for n in names],
        settings.quantize_activations,
        settings.block_size,
    )
    return CalibrationResult(format_map=dict(format_map), **summary, **fields)


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
def _swapped(model: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[None]:
    """Temporarily install `replacements` (full name -> module) with every model weight frozen and the model
    in eval mode (no dropout: calibration is deterministic). On exit, also on error, the original modules,
    the `requires_grad` flags and the train/eval mode come back."""
    originals = {name: model.get_submodule(name) for name in replacements}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        for name, module in replacements.items():
            model.set_submodule(name, module)
        yield
    finally:
        for name, module in originals.items():
            model.set_submodule(name, module)
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


@contextmanager
def dmx_linears(
    model: nn.Module, settings: CalibrationSettings, straight_through: bool = False
) -> Iterator[dict[str, nn.Module]]:
    """Temporarily replace the targeted linears of `model` by `DMXLinear` (offsets at 0), weights frozen.

    Yields the new modules by name; see `_swapped` for what is restored on exit.
    """
    from ..modules import DMXLinear  # modules.py imports this package's schedule and fused quantizer

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
    with _swapped(model, layers):
        yield layers


@contextmanager
def emulate_format_map(
    model: nn.Module, format_map: Mapping[str, str], block_size: int = 32, quantize_activations: bool = True
) -> Iterator[None]:
    """Temporarily quantize the linears named in `format_map` (weights and activations) to their formats.

    Inside the block each named linear is an `MXLinear` built from it (the inference module: packed weight,
    input quantized per call), so an assignment is evaluated exactly as a saved dMX model computes. Weights
    are frozen and the model is in eval mode inside the block; the original linears are restored on exit.
    """
    from ..modules import MXLinear  # modules.py imports this package's schedule and fused quantizer

    layers = {
        name: MXLinear.from_linear(model.get_submodule(name), fmt, block_size=block_size,
                                   quantize_activations=quantize_activations)
        for name, fmt in format_map.items()
    }
    with _swapped(model, layers):
        yield


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
