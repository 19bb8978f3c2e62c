"""KL sensitivity: how much each layer alone in the pair's low format moves the model's next-token distribution.

KL pre-selection (`method="kl"`) ranks layers by it; the default method blends its ranking with the learned
offsets' (`budget.blended_priority`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from ..continuous import get_format_pair
from ..nn.surgery import emulate_format_map, linear_modules_to_quantize
from .settings import CalibrationSettings

KL_SAMPLES = 4  # calibration sequences the scan reads (the first ones): its ranking is stable from 4 on


@torch.no_grad()
def kl_sensitivities(
    model: nn.Module, input_ids: torch.LongTensor, settings: CalibrationSettings, progress: bool = True
) -> dict[str, float]:
    """Per-layer KL(float || only this layer in the pair's low format), in nats per token.

    The scan reads the first `KL_SAMPLES` sequences of `input_ids`: one float forward pass gives the reference
    distributions, then one pass per layer, in batches of `settings.batch_size`. The low format is the same for
    both pairs (MXFP4), so the result can be reused across pairs and targets.
    """
    input_ids = input_ids[:KL_SAMPLES]
    low = get_format_pair(settings.format_pair).low.name
    targets = linear_modules_to_quantize(model, settings.modules_to_not_convert)
    device = next(model.parameters()).device
    batches = [b.to(device) for b in input_ids.split(settings.batch_size)]
    tokens = input_ids.numel()

    with emulate_format_map(model, {}):
        reference = [next_token_log_probs(model, b) for b in batches]
    sensitivities = {}
    for name in tqdm(targets, desc="KL sensitivity", disable=not progress):
        with emulate_format_map(
            model, {name: low}, settings.block_size, settings.quantize_activations, settings.scale_rule
        ):
            kl = sum(next_token_kl(ref, next_token_log_probs(model, b)).item() for b, ref in zip(batches, reference))
        sensitivities[name] = kl / tokens
    return sensitivities


def next_token_log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """`[batch, seq_len, vocab]` float32 log-probabilities of the next token at every position of `batch`."""
    return F.log_softmax(model(input_ids=batch, use_cache=False).logits.float(), dim=-1)


def next_token_kl(reference: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """`sum KL(p_reference || p)` over every position, from log-probabilities (`next_token_log_probs`)."""
    return F.kl_div(log_probs, reference, log_target=True, reduction="sum")
