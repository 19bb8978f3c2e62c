"""The dMX calibration loop: learn one format offset per linear layer from the task loss's gradient.

`calibrate` swaps the targeted `nn.Linear` modules for `DMXLinear` in place, freezes every model weight, learns
the offsets by the settings' method (`docs/method.md`), turns them into a format map, and puts the original
modules back, untouched. Turning the returned format map into quantized modules is the caller's job.

* `"dmx"` (`_sampled_offsets`): every step draws a format map at the budget (Gumbel top-k on the offsets, uniform
  while `T` is at its start, then sharper), and each layer drawn in its low format learns from the derivative of
  the cross-entropy with respect to its offset there; the final ranking blends the learned offsets with the KL
  scan's (`KL_WEIGHT`) and the budget's highest layers go high.
* `"paper"` (`_relaxed_offsets`): SGD on `cross-entropy + bit regularizer` through the relaxed offsets
  `F(beta_hat, T)`, the temperature annealed (`PaperRecipe`).
* `"kl"`: KL pre-selection (`baselines.kl_preselection`), no training steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm

from ..continuous import MAX_OFFSET, get_format_pair
from ..formats import kernel_setup_seconds
from ..nn.bits import average_bits, tensor_sizes
from ..nn.experts import linearizable_experts
from ..nn.placement import input_device
from ..nn.surgery import linear_modules_to_quantize, swapped_modules
from .baselines import kl_preselection
from .budget import blended_priority, blended_value, budget_format_map, layer_costs
from .checkpointing import activation_checkpointing
from .distributed import average_across_processes, process_share, world
from .dmx_linear import DMXLinear, EndpointProbe, OffsetStrategy, RelaxedOffset, SharedInputs
from .groups import offset_groups
from .regularizers import bit_regularizer
from .result import CalibrationResult, result_from_format_map
from .rotations import LearnedRotations, learnable_sites, learned_rotations
from .schedule import T_END, T_START, T_WARMUP_RATIO, temperature_at
from .sensitivity import kl_sensitivities
from .settings import CalibrationSettings

T = TypeVar("T")

logger = logging.getLogger(__name__)

# The default method's final ranking: `(1 - KL_WEIGHT) rank(learned offset) + KL_WEIGHT rank(KL sensitivity)`. The
# two signals are complementary: the blend's maps beat either ranking alone on held-out text (docs/method.md).
KL_WEIGHT = 0.5


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
    model: nn.Module, settings: CalibrationSettings, offset: Callable[[], OffsetStrategy] = RelaxedOffset
) -> Iterator[dict[str, DMXLinear]]:
    """Temporarily replace the targeted linears of `model` by `DMXLinear` (offsets at 0), weights frozen.

    `offset()` makes each layer's offset strategy (`dmx_linear`); return one object from every call to share it.
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
            offset=offset(),
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
    model: nn.Module, input_ids: torch.LongTensor, settings: CalibrationSettings, progress: bool = True
) -> CalibrationResult:
    """Learn a per-layer MX format assignment for `model` on calibration tokens.

    Args:
        model: a Hugging Face causal LM (anything returning `.loss` for `model(input_ids=, labels=)`).
        input_ids: `[num_samples, seq_len]` calibration token ids (see `build_calibration_batches`).
        settings: the run's settings; `settings.method` chooses the procedure.
        progress: show progress bars with step, loss, current average bits and temperature.

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
    packed = linearizable_experts(model, settings.modules_to_not_convert)
    if packed:
        raise ValueError(
            f"{packed[0]}{f' and {len(packed) - 1} more' if len(packed) > 1 else ''} hold a mixture of experts' packed "
            "experts, which calibration would leave float outside the budget: replace them by linears first "
            "(optimum_dmx.nn.linearize_experts(model, optimum_dmx.nn.linearizable_experts(model, "
            "modules_to_not_convert)), as from_pretrained with a DMXConfig does), or name them in "
            "modules_to_not_convert to keep them float."
        )
    if settings.cost_table is not None:  # a table that lacks a shape fails now, not after the steps or the scan
        linears = linear_modules_to_quantize(model, settings.modules_to_not_convert).values()
        layer_costs(
            [tuple(linear.weight.shape) for linear in linears],
            get_format_pair(settings.format_pair),
            cost_table=settings.cost_table,
        )
    if settings.method == "kl":
        return kl_preselection(model, input_ids, settings, progress)

    rank, world_size = world(input_device(model))
    if settings.batch_size % world_size:
        raise ValueError(
            f"batch_size={settings.batch_size} must be a multiple of the {world_size} processes "
            "calibrating together: each takes an equal share of every batch."
        )

    start = time.perf_counter()
    sampled = settings.method == "dmx"
    if sampled:
        shared_inputs = SharedInputs()  # q/k/v and gate/up quantize their common input once per endpoint and step
        offset = lambda: EndpointProbe(shared_inputs)  # noqa: E731  (one probe per layer)
    else:
        relaxed = RelaxedOffset(settings.paper.t_start)
        offset = lambda: relaxed  # noqa: E731  (one temperature for every layer)
    sites = learnable_sites(model) if settings.learn_rotations else None  # found before the DMXLinears go in
    with (
        dmx_linears(model, settings, offset) as layers,
        activation_checkpointing(model, settings.gradient_checkpointing),
        learned_rotations(model, layers, sites) if sites else nullcontext() as rotations,
    ):
        batches = _batches(len(input_ids), settings.batch_size, settings.steps, settings.seed)
        bar = tqdm(batches, total=settings.steps, desc="dMX calibration", disable=not progress or rank > 0)
        step_seconds: list[float] = []
        kernels_before_steps = kernel_setup_seconds()
        batches = _timed((input_ids[process_share(rows, rank, world_size)] for rows in bar), step_seconds)
        if sampled:
            offsets, history = _sampled_offsets(model, layers, batches, settings, bar, world_size, rotations)
        else:
            offsets, history = _relaxed_offsets(model, layers, relaxed, batches, settings, bar, world_size, rotations)
        shapes = {name: tuple(layer.weight.shape) for name, layer in layers.items()}
        threshold_map = {name: layer.discrete_format.name for name, layer in layers.items()}
        kernel_seconds = {"steps": kernel_setup_seconds() - kernels_before_steps}
    # The KL scan swaps modules itself: it runs on the restored model.
    sensitivities, scan_seconds = {}, 0.0
    if sampled:
        scan_start, kernels_before_scan = time.perf_counter(), kernel_setup_seconds()
        sensitivities = kl_sensitivities(model, input_ids, settings, progress)
        scan_seconds = time.perf_counter() - scan_start
        kernel_seconds["scan"] = kernel_setup_seconds() - kernels_before_scan
    if settings.discretization == "threshold":
        format_map = threshold_map
    elif sampled:
        format_map = blended_format_map(offsets, sensitivities, shapes, settings)
    else:
        format_map = _budget_map(offsets, shapes, settings)
    result = result_from_format_map(
        format_map,
        linear_modules_to_quantize(model, settings.modules_to_not_convert),
        settings,
        history=history,
        beta_hat=offsets,
        kl_sensitivities=sensitivities,
        method=settings.method,
        seconds=time.perf_counter() - start,
        step_seconds=step_seconds,
        scan_seconds=scan_seconds,
        kernel_seconds=kernel_seconds,
    )
    logger.info(
        "Calibrated %d layers: %.3f bits (simple), %.3f bits (weighted), %.3f storage bits.",
        len(format_map),
        result.bits_simple,
        result.bits_weighted,
        result.storage_bits,
    )
    return result


def _timed(items: Iterable[T], seconds: list[float]) -> Iterator[T]:
    """Yield `items`, appending to `seconds` the wall time the consumer spends on each (a step, here)."""
    for item in items:
        start = time.perf_counter()
        yield item
        seconds.append(time.perf_counter() - start)


def blended_format_map(
    offsets: dict[str, float],
    sensitivities: dict[str, float],
    shapes: dict[str, tuple[int, ...]],
    settings: CalibrationSettings,
) -> dict[str, str]:
    """The default method's format map from its learned offsets and one sensitivity per layer: each layer valued by
    the blend of the two, then the budget rule of `settings`. `calibrate` passes the KL scan's sensitivities; a study
    can pass another signal (a scan of GPTQ-rounded weights, say) and keep everything else the method does."""
    return _budget_map(_blend(offsets, sensitivities, settings.bit_average), shapes, settings)


def _blend(offsets: dict[str, float], sensitivities: dict[str, float], bit_average: str) -> dict[str, float]:
    """The default method's value of each layer: its learned offset blended with its KL sensitivity. In the simple
    average only the order counts (every layer costs the same bits): ranks, as measured; in the weighted average
    the knapsack needs values comparable across layers."""
    if bit_average == "simple":
        return blended_priority(offsets, sensitivities, KL_WEIGHT)
    return blended_value(offsets, sensitivities, KL_WEIGHT)


def _budget_map(priority: dict[str, float], shapes: dict[str, tuple], settings: CalibrationSettings) -> dict[str, str]:
    """The layers worth most per bit get the high format (`calibration.budget`), groups moving as one; the
    paper's `beta_hat` is an order, not a gain, and is taken as one."""
    return budget_format_map(
        priority,
        shapes,
        get_format_pair(settings.format_pair),
        settings.target_bits,
        settings.bit_average,
        settings.quantize_activations,
        groups=offset_groups(settings.offset_groups, list(shapes)),
        per_bit=settings.method != "paper",
        cost_table=settings.cost_table,
    )


def _task_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The causal-LM cross-entropy of `model` on the batch's own next tokens (the paper's task loss)."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss


def _relaxed_offsets(
    model: nn.Module,
    layers: dict[str, DMXLinear],
    relaxed: RelaxedOffset,
    batches,
    settings: CalibrationSettings,
    bar,
    world_size: int = 1,
    rotations: LearnedRotations | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """The paper's loop: SGD on `cross-entropy + bit regularizer` through `F(beta_hat, T)` (and a Cayley step on
    the `rotations` being learned, if any). Returns the final `beta_hat` of every layer and the per-step history."""
    recipe = settings.paper
    modules = list(layers.values())
    device = modules[0].beta_hat.device  # where the layers compute
    sizes = tensor_sizes([tuple(m.weight.shape) for m in modules], settings.quantize_activations)
    parameters = list({id(m.beta_hat): m.beta_hat for m in modules}.values())  # grouped layers share one
    optimizer = torch.optim.SGD(parameters, lr=recipe.lr)
    history = []
    for step, batch in enumerate(batches):
        temperature = temperature_at(step, settings.steps, recipe.t_start, recipe.t_end, recipe.t_warmup_ratio)
        relaxed.temperature = temperature
        task_loss = _task_loss(model, batch.to(device))
        bits = torch.stack([m.element_bits() for m in modules])
        avg_bits = average_bits(bits, settings.bit_average, sizes)
        reg_loss = bit_regularizer(avg_bits, recipe.regularizer, recipe.reg_lambda, settings.target_bits)
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
        history.append(
            {
                "step": step,
                "loss": loss.item(),
                "task_loss": task_loss.item(),
                "reg_loss": reg_loss.item(),
                "bits": avg_bits.item(),
                "bits_simple": average_bits(bits.detach(), "simple").item(),
                "bits_weighted": average_bits(bits.detach(), "weighted", sizes).item(),
                "temperature": temperature,
            }
        )
        bar.set_postfix(loss=f"{loss.item():.4f}", bits=f"{avg_bits.item():.3f}", T=f"{temperature:.1f}")
    return {name: m.beta_hat.item() for name, m in layers.items()}, history


def _sampled_offsets(
    model: nn.Module,
    layers: dict[str, DMXLinear],
    batches,
    settings: CalibrationSettings,
    bar,
    world_size: int = 1,
    rotations: LearnedRotations | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """The default method's loop. Each step draws a format map at the budget, runs the model in it, and adds to
    the running mean of each layer drawn in its low format `-dL/dbeta` at `beta = 0`: the first-order loss decrease
    of leaving the low format, its offset.

    The draw is Gumbel top-k on the standardized offsets per unit of cost (`calibration.budget.layer_costs`: the
    offsets themselves in the simple average) scaled by `(T - T_START) / T_START`: uniform over the maps at the
    budget while `T` stays at its start (the layers' effects are measured in contexts with the budget's share of
    high layers), then concentrating on the budget's highest offsets per unit of cost as `T` rises (the last
    decisions are measured in the context of the final map). A layer never measured keeps an infinite offset:
    nothing said its high format could go. The `rotations` being learned, if any, take a Cayley step on the same
    backward pass (the loss of the drawn map).
    """
    names = list(layers)
    modules = list(layers.values())
    probes: list[EndpointProbe] = [m.offset for m in modules]
    device = modules[0].beta_hat.device  # where the layers compute
    pair = get_format_pair(settings.format_pair)
    shapes = {name: tuple(m.weight.shape) for name, m in layers.items()}
    sizes = tensor_sizes(list(shapes.values()), settings.quantize_activations)
    low, high = layer_costs(
        list(shapes.values()), pair, settings.bit_average, settings.quantize_activations, settings.cost_table
    )
    raise_costs = (high - low).clamp_min(1e-12 * float((high - low).abs().max()) or 1.0)  # a free raise: ~0
    costs = raise_costs / raise_costs.mean()  # exactly 1 for every layer in the simple average
    means = _RunningMeans(len(names))
    generator = torch.Generator().manual_seed(settings.seed)
    groups = offset_groups(settings.offset_groups, names)
    history = []
    try:
        for step, batch in enumerate(batches):
            temperature = temperature_at(step, settings.steps, T_START, T_END, T_WARMUP_RATIO)
            sharpness = (temperature - T_START) / T_START
            per_bit = means.offsets(missing=0.0) / costs
            spread = per_bit.std() if len(per_bit) > 1 and per_bit.std() > 0 else torch.tensor(1.0, dtype=torch.float64)
            uniform = torch.rand(len(names), generator=generator, dtype=torch.float64)
            gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-12)))
            draw = sharpness * (per_bit - per_bit.mean()) / spread + gumbel
            drawn = budget_format_map(
                dict(zip(names, draw.tolist())),
                shapes,
                pair,
                settings.target_bits,
                settings.bit_average,
                settings.quantize_activations,
                groups=groups,
                per_bit=False,  # a random order, already per unit of cost
                cost_table=settings.cost_table,
                warn_when_short=False,  # a draw, not the map: the final map warns
            )
            high = [drawn[n] != pair.low.name for n in names]
            for probe, is_high in zip(probes, high):
                probe.set(MAX_OFFSET if is_high else 0.0, device, measure=not is_high)
            loss = _task_loss(model, batch.to(device))
            if loss.requires_grad:
                loss.backward()  # into the probes, and into learned rotations, if any
            probes[0].shared_inputs.clear()
            if rotations is not None:
                rotations.step(world_size)
            low = [i for i, is_high in enumerate(high) if not is_high]
            if low:
                gains = torch.stack([probes[i].gain() for i in low]).double().cpu()
                means.add(torch.tensor(low), average_across_processes(gains, world_size))
            loss = average_across_processes(loss.detach().float(), world_size)
            bits = torch.tensor([pair.high.bits if is_high else pair.low.bits for is_high in high], dtype=torch.float64)
            history.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "task_loss": loss.item(),
                    "reg_loss": 0.0,
                    "bits": average_bits(bits, settings.bit_average, sizes).item(),
                    "bits_simple": average_bits(bits, "simple").item(),
                    "bits_weighted": average_bits(bits, "weighted", sizes).item(),
                    "temperature": temperature,
                }
            )
            bar.set_postfix(loss=f"{loss.item():.4f}", T=f"{temperature:.1f}")
    finally:
        for probe in probes:
            probe.reset()
    return dict(zip(names, means.offsets(missing=math.inf).tolist())), history


class _RunningMeans:
    """Running mean of each layer's measured gain; a layer never measured has none."""

    def __init__(self, size: int):
        self.total = torch.zeros(size, dtype=torch.float64)
        self.count = torch.zeros(size, dtype=torch.float64)

    def add(self, indices: torch.Tensor, gains: torch.Tensor) -> None:
        self.total.index_put_((indices,), gains, accumulate=True)
        self.count.index_put_((indices,), torch.ones_like(gains), accumulate=True)

    def offsets(self, missing: float) -> torch.Tensor:
        measured = self.count > 0
        means = self.total / self.count.clamp_min(1)
        return torch.where(measured, means, torch.full_like(means, missing))
