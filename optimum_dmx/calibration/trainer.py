"""The dMX calibration loop: learn one format offset per linear layer from the task loss's gradient.

`calibrate` swaps the targeted `nn.Linear` modules for `DMXLinear` in place, freezes every model weight, learns
the offsets with the settings' recipe (`docs/method.md`), turns them into a format map (the budget's highest
offsets, or the paper's `beta_hat >= 1`), and puts the original modules back, untouched. Turning the returned
format map into quantized modules is the caller's job.

* `"paper"` recipe (`_relaxed_offsets`): SGD on `cross-entropy + bit regularizer` through the relaxed offsets
  `F(beta_hat, T)`, the temperature annealed.
* `"dmx"` recipe (`_sampled_offsets`): every step draws a format map at the budget (Gumbel top-k on the
  offsets, uniform while `T` is at `t_start`, then sharper), and each layer drawn in its low format learns
  from the derivative of the cross-entropy with respect to its offset there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..continuous import MAX_OFFSET, get_format_pair
from ..nn.bits import average_bits, tensor_sizes
from ..nn.surgery import linear_modules_to_quantize, swapped_modules
from .budget import blended_priority, budget_format_map
from .checkpointing import activation_checkpointing
from .data import build_calibration_batches
from .distributed import average_across_processes, process_share, world
from .dmx_linear import DMXLinear, SharedInputs
from .groups import offset_groups
from .losses import calibration_loss
from .regularizers import bit_regularizer
from .result import CalibrationResult, result_from_format_map
from .rotations import LearnedRotations, learnable_sites, learned_rotations
from .schedule import temperature_at
from .sensitivity import kl_sensitivities
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
            scale_rule=settings.scale_rule,
            temperature=settings.t_start,
            straight_through=straight_through,
        )
        for name, linear in targets.items()
    }
    for group in offset_groups(settings.offset_groups, list(layers)):
        shared = layers[group[0]].beta_hat
        for name in group[1:]:
            layers[name].beta_hat = shared  # one parameter: gradients of all members add up in it
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

    Run under `torchrun` / `accelerate launch`, the processes share every batch and average the offsets'
    gradients (`calibration.distributed`): each ends with the single-process result for the same global batch.

    With `settings.learn_rotations`, the model's merged rotations are trained with the offsets
    (`calibration.rotations`) and the learned ones are merged into its weights: the model comes back with the same
    float function and different weights.
    """
    if not isinstance(settings, CalibrationSettings):
        raise TypeError(f"settings must be a CalibrationSettings, got {type(settings).__name__}.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a 2-D LongTensor of shape [num_samples, seq_len].")
    if input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} holds no sequence of at least 2 tokens.")

    rank, world_size = world(next(model.parameters()).device)
    if settings.batch_size % world_size:
        raise ValueError(f"batch_size={settings.batch_size} must be a multiple of the {world_size} processes "
                         "calibrating together: each takes an equal share of every batch.")

    start = time.perf_counter()
    sampled = settings.recipe == "dmx" and not straight_through
    sites = learnable_sites(model) if settings.learn_rotations else None  # found before the DMXLinears go in
    with dmx_linears(model, settings, straight_through) as layers, \
            activation_checkpointing(model, settings.gradient_checkpointing), \
            (learned_rotations(model, layers, sites, settings.rotation_lr) if sites else nullcontext()) as rotations:
        batches = _batches(len(input_ids), settings.batch_size, settings.steps, settings.seed)
        bar = tqdm(batches, total=settings.steps, desc="dMX calibration", disable=not progress or rank > 0)
        batches = (input_ids[process_share(rows, rank, world_size)] for rows in bar)
        learn = _sampled_offsets if sampled else _relaxed_offsets
        offsets, history = learn(model, layers, batches, settings, bar, world_size, rotations)
        shapes = {name: tuple(layer.weight.shape) for name, layer in layers.items()}
        threshold_map = {name: layer.discrete_format.name for name, layer in layers.items()}
    # The KL scan swaps modules itself: it runs on the restored model.
    blend = settings.kl_weight > 0 and not straight_through
    sensitivities = kl_sensitivities(model, input_ids, settings, progress) if blend else {}
    priority = blended_priority(offsets, sensitivities, settings.kl_weight) if blend else offsets
    format_map = threshold_map if settings.discretization == "threshold" else _budget_map(priority, shapes, settings)
    result = result_from_format_map(
        format_map,
        linear_modules_to_quantize(model, settings.modules_to_not_convert),
        settings,
        history=history,
        beta_hat=offsets,
        kl_sensitivities=sensitivities,
        method="round_ste" if straight_through else "dmx",
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "Calibrated %d layers: %.3f bits (simple), %.3f bits (weighted), %.3f storage bits.",
        len(format_map), result.bits_simple, result.bits_weighted, result.storage_bits,
    )
    return result


def _budget_map(priority: dict[str, float], shapes: dict[str, tuple], settings: CalibrationSettings) -> dict[str, str]:
    """The budget's highest priorities get the high format (`calibration.budget`), groups moving as one."""
    return budget_format_map(
        priority,
        shapes,
        get_format_pair(settings.format_pair),
        settings.target_bits,
        settings.bit_average,
        settings.quantize_activations,
        groups=offset_groups(settings.offset_groups, list(shapes)),
    )


def _relaxed_offsets(
    model: nn.Module, layers: dict[str, DMXLinear], batches, settings: CalibrationSettings, bar, world_size: int = 1,
    rotations: LearnedRotations | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """The paper's loop: SGD on `cross-entropy + bit regularizer` through `F(beta_hat, T)` (and a Cayley step on
    the `rotations` being learned, if any). Returns the final `beta_hat` of every layer and the per-step history."""
    modules = list(layers.values())
    device = modules[0].weight.device
    sizes = tensor_sizes([tuple(m.weight.shape) for m in modules], settings.quantize_activations)
    parameters = list({id(m.beta_hat): m.beta_hat for m in modules}.values())  # grouped layers share one
    optimizer = torch.optim.SGD(parameters, lr=settings.lr)
    history = []
    for step, batch in enumerate(batches):
        temperature = temperature_at(step, settings.steps, settings.t_start, settings.t_end, settings.t_warmup_ratio)
        for m in modules:
            m.temperature = temperature
        batch = batch.to(device)
        task_loss = calibration_loss(model, batch, settings.loss, modules)
        bits = torch.stack([m.element_bits() for m in modules])
        avg_bits = average_bits(bits, settings.bit_average, sizes)
        reg_loss = bit_regularizer(avg_bits, settings.regularizer, settings.reg_lambda, settings.target_bits)
        loss = task_loss.float() + reg_loss
        optimizer.zero_grad(set_to_none=True)
        task_loss.float().backward()  # the regularizer's gradient is the same in every process: added after
        for parameter in parameters:
            if parameter.grad is not None:
                average_across_processes(parameter.grad, world_size)
        reg_loss.backward()
        optimizer.step()
        if rotations is not None:
            rotations.step(world_size)
        task_loss = average_across_processes(task_loss.detach().float(), world_size)
        loss = task_loss + reg_loss.detach()
        history.append({
            "step": step,
            "loss": loss.item(),
            "task_loss": task_loss.item(),
            "reg_loss": reg_loss.item(),
            "bits": avg_bits.item(),
            "bits_simple": average_bits(bits.detach(), "simple").item(),
            "bits_weighted": average_bits(bits.detach(), "weighted", sizes).item(),
            "temperature": temperature,
        })
        bar.set_postfix(loss=f"{loss.item():.4f}", bits=f"{avg_bits.item():.3f}", T=f"{temperature:.1f}")
    return {name: m.beta_hat.item() for name, m in layers.items()}, history


def _sampled_offsets(
    model: nn.Module, layers: dict[str, DMXLinear], batches, settings: CalibrationSettings, bar, world_size: int = 1,
    rotations: LearnedRotations | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """The `"dmx"` recipe's loop. Each step draws a format map at the budget, runs the model in it, and adds to
    each layer's running means an estimate of the loss decrease its high format buys (its offset):

    * `offset_probe="low"` / `"path"`: `-dL/dbeta` at `beta = 0` (or at a random point of the path) for every
      layer drawn in its low format;
    * `offset_probe="swap"`: for every layer, `-<dL/dy, y_high - y_low>` measured at the format it was drawn
      in: a first-order estimate of the whole swap from the low end and from the high end, whose average (the
      trapezoid rule) is exact for a loss quadratic in the layer's output.

    The draw is Gumbel top-k on the standardized offsets scaled by `(T - t_start) / t_start`: uniform over
    the maps at the budget while `T` stays at `t_start` (the layers' effects are measured in contexts with the
    budget's share of high layers), then concentrating on the budget's highest offsets as `T` rises (the last
    decisions are measured in the context of the final map). A layer never measured keeps an infinite offset:
    nothing said its high format could go. The `rotations` being learned, if any, take a Cayley step on the same
    backward pass (the loss of the drawn map).
    """
    names = list(layers)
    modules = list(layers.values())
    device = modules[0].weight.device
    pair = get_format_pair(settings.format_pair)
    shapes = {name: tuple(m.weight.shape) for name, m in layers.items()}
    sizes = tensor_sizes(list(shapes.values()), settings.quantize_activations)
    means = _EndMeans(len(names))
    generator = torch.Generator().manual_seed(settings.seed)
    groups = offset_groups(settings.offset_groups, names)
    measure = _swap_gains if settings.offset_probe == "swap" else _probe_gains
    shared_inputs = SharedInputs()  # q/k/v and gate/up quantize their common input once per endpoint and step
    for m in modules:
        m.shared_inputs = shared_inputs
    history = []
    try:
        for step, batch in enumerate(batches):
            temperature = temperature_at(step, settings.steps, settings.t_start, settings.t_end, settings.t_warmup_ratio)
            sharpness = (temperature - settings.t_start) / settings.t_start
            offsets = means.offsets(missing=0.0)
            spread = offsets.std() if len(offsets) > 1 and offsets.std() > 0 else torch.tensor(1.0, dtype=torch.float64)
            uniform = torch.rand(len(names), generator=generator, dtype=torch.float64)
            gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-12)))
            draw = sharpness * (offsets - offsets.mean()) / spread + gumbel
            drawn = budget_format_map(dict(zip(names, draw.tolist())), shapes, pair, settings.target_bits,
                                      settings.bit_average, settings.quantize_activations, groups=groups)
            high = torch.tensor([drawn[n] != pair.low.name for n in names])
            loss, measured, gains = measure(model, modules, batch.to(device), high, settings, generator)
            shared_inputs.clear()
            if rotations is not None:
                rotations.step(world_size)
            if len(measured):
                means.add(measured, high[measured], average_across_processes(gains, world_size))
            loss = average_across_processes(loss.detach().float(), world_size)
            bits = torch.where(high, float(pair.high.bits), float(pair.low.bits)).double()
            history.append({
                "step": step,
                "loss": loss.item(),
                "task_loss": loss.item(),
                "reg_loss": 0.0,
                "bits": average_bits(bits, settings.bit_average, sizes).item(),
                "bits_simple": average_bits(bits, "simple").item(),
                "bits_weighted": average_bits(bits, "weighted", sizes).item(),
                "temperature": temperature,
            })
            bar.set_postfix(loss=f"{loss.item():.4f}", T=f"{temperature:.1f}")
    finally:
        for m in modules:
            m.probe = m.probe_offset = m.drawn_high = m.swap = m.shared_inputs = None
    return dict(zip(names, means.offsets(missing=math.inf).tolist())), history


def _probe_gains(
    model: nn.Module, modules: list[DMXLinear], batch: torch.Tensor, high: torch.Tensor,
    settings: CalibrationSettings, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`offset_probe` `"low"` / `"path"`: the loss, the layers drawn low, and `-dL/dbeta` at their probe."""
    device = batch.device
    low = torch.nonzero(~high).flatten()
    points = _probe_points(len(low), settings.offset_probe, generator)
    offsets = dict(zip(low.tolist(), points.tolist()))
    probes = {i: torch.tensor(offset, device=device, requires_grad=True) for i, offset in offsets.items()}
    high_offset = torch.tensor(MAX_OFFSET, device=device)
    for i, m in enumerate(modules):
        m.probe, m.probe_offset = probes.get(i, high_offset), offsets.get(i, MAX_OFFSET)
    loss = calibration_loss(model, batch, settings.loss, modules)
    if loss.requires_grad:
        loss.backward()  # into the probes, and into learned rotations, if any
    if not probes:
        return loss, low, torch.zeros(0, dtype=torch.float64)
    return loss, low, -torch.stack([probe.grad for probe in probes.values()]).double().cpu()


def _swap_gains(
    model: nn.Module, modules: list[DMXLinear], batch: torch.Tensor, high: torch.Tensor,
    settings: CalibrationSettings, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`offset_probe="swap"`: the loss, every layer, and `L(low) - L(high)` to first order from its drawn end."""
    for m, is_high in zip(modules, high.tolist()):
        m.drawn_high = is_high
    loss = calibration_loss(model, batch, settings.loss, modules)
    outputs, changes = zip(*(m.swap for m in modules))
    grads = torch.autograd.grad(loss, outputs, allow_unused=True)
    swap = torch.stack([
        torch.zeros((), dtype=torch.float64) if g is None else (g.double() * change.double()).sum().cpu()
        for g, change in zip(grads, changes)
    ])  # L(other format) - L(drawn format), to first order
    for m in modules:
        m.swap = None
    return loss, torch.arange(len(modules)), torch.where(high, swap, -swap)


class _EndMeans:
    """Running means of each layer's gain, kept apart by the format it was measured in; a layer's offset is the
    mean of its two ends' means (the trapezoid rule), or of the one it has."""

    def __init__(self, size: int):
        self.total = torch.zeros(2, size, dtype=torch.float64)
        self.count = torch.zeros(2, size, dtype=torch.float64)

    def add(self, indices: torch.Tensor, at_high: torch.Tensor, gains: torch.Tensor) -> None:
        end = at_high.long()
        self.total.index_put_((end, indices), gains, accumulate=True)
        self.count.index_put_((end, indices), torch.ones_like(gains), accumulate=True)

    def offsets(self, missing: float) -> torch.Tensor:
        means = self.total / self.count.clamp_min(1)
        measured = self.count > 0
        ends = measured.sum(dim=0)
        combined = (means * measured).sum(dim=0) / ends.clamp_min(1)
        return torch.where(ends > 0, combined, torch.full_like(combined, missing))


def _probe_points(count: int, offset_probe: str, generator: torch.Generator) -> torch.Tensor:
    """Offsets at which the layers drawn low read the loss's derivative: 0, or uniform on `[0, MAX_OFFSET]`
    (`"path"`: the mean derivative over the path is the high format's whole gain, divided by its length)."""
    if offset_probe == "low":
        return torch.zeros(count)
    return torch.rand(count, generator=generator) * MAX_OFFSET


def calibrate_on_text(
    model: nn.Module, dataset: Any, tokenizer: Any, settings: CalibrationSettings, progress: bool = True
) -> CalibrationResult:
    """`calibrate` on `settings.num_samples` blocks of `settings.seq_len` tokens drawn from `dataset`.

    `dataset` is any source `build_calibration_batches` accepts (Hub name, files, `datasets.Dataset`, texts).
    """
    input_ids = build_calibration_batches(dataset, tokenizer, settings.seq_len, settings.num_samples, settings.seed)
    return calibrate(model, input_ids, settings, progress)
