"""The loss the offsets learn from: the model's own cross-entropy on the calibration text, or its divergence from
the float model's next-token distributions (distillation)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from .dmx_linear import DMXLinear, unquantized
from .settings import LOSSES


def calibration_loss(model: nn.Module, batch: torch.Tensor, loss: str, layers: Iterable[DMXLinear]) -> torch.Tensor:
    """The calibration loss of `model` (its targeted linears quantized as they are set now) on `batch`.

    * `"cross_entropy"`: the causal-LM loss on the batch's own next tokens (the paper's task loss).
    * `"distillation"`: `KL(float || quantized)` of the next-token distributions at every position, in nats per
      token, the float distributions from a gradient-free pass with `layers` unquantized. Its gradient with respect
      to the logits is `q - p_float` where cross-entropy's is `q - onehot(next token)`: the difference,
      `p_float - onehot`, does not depend on the formats, so distillation reads the same format effects without the
      sampling noise of single next tokens, and without rewarding quantization errors that happen to fit the
      calibration text.
    """
    if loss == "cross_entropy":
        return model(input_ids=batch, labels=batch, use_cache=False).loss
    if loss != "distillation":
        raise ValueError(f"loss={loss!r} is not supported; allowed: {', '.join(LOSSES)}.")
    with torch.no_grad(), unquantized(layers):
        reference = next_token_log_probs(model, batch)
    return next_token_kl(reference, next_token_log_probs(model, batch)) / batch.numel()


def next_token_log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """`[batch, seq_len, vocab]` float32 log-probabilities of the next token at every position of `batch`."""
    return F.log_softmax(model(input_ids=batch, use_cache=False).logits.float(), dim=-1)


def next_token_kl(reference: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """`sum KL(p_reference || p)` over every position, from log-probabilities (`next_token_log_probs`)."""
    return F.kl_div(log_probs, reference, log_target=True, reduction="sum")
