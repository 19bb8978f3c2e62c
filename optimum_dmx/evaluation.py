"""Perplexity of a causal language model on held-out text, with its protocol.

Protocol: the text is tokenized once without special tokens and truncated to `max_tokens`; it is cut into
non-overlapping windows of `seq_len` tokens that each start the way the model's tokenizer starts a text
(its BOS token where it adds one, e.g. Llama 3 and Gemma; nothing for SmolLM2), followed by the next text
tokens (a trailing partial window is dropped). Each window is scored on its own, predicting its tokens
2..seq_len from their prefix inside the window. The perplexity is `exp(mean NLL)` over all predicted
tokens. Numbers are only comparable under the same protocol, so the result carries it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .nn.placement import input_device
from .text import start_tokens, text_tokens, token_windows


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity and the protocol that produced it."""

    perplexity: float
    nll: float
    """Mean negative log-likelihood per predicted token, in nats."""
    tokens: int
    """Tokens fed to the model (`windows * seq_len`)."""
    predicted_tokens: int
    """Tokens scored (`windows * (seq_len - 1)`)."""
    windows: int
    seq_len: int
    start_tokens: tuple[int, ...] = ()
    """Token ids each window starts with (the tokenizer's BOS, where it adds one)."""

    @property
    def protocol(self) -> str:
        start = f"each starting with token(s) {list(self.start_tokens)}" if self.start_tokens else "no start token"
        return f"{self.tokens} tokens, {self.windows} non-overlapping windows of {self.seq_len}, {start}"

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"perplexity {self.perplexity:.4f} ({self.protocol})"


@torch.no_grad()
def evaluate_perplexity(
    model: torch.nn.Module,
    tokenizer,
    text: str,
    seq_len: int = 512,
    max_tokens: int | None = None,
    batch_size: int = 1,
) -> PerplexityResult:
    """Perplexity of `model` on `text` over non-overlapping `seq_len`-token windows.

    Args:
        model: a causal LM returning `.logits` of shape `[batch, seq, vocab]`.
        tokenizer: the model's tokenizer.
        text: held-out text.
        seq_len: window length in tokens.
        max_tokens: use only the first `max_tokens` text tokens (all when None).
        batch_size: windows per forward pass (does not change the result).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty string of held-out text.")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r} must be at least 2 to predict a next token.")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < seq_len):
        raise ValueError(f"max_tokens={max_tokens!r} must be an integer of at least seq_len={seq_len}.")

    ids = text_tokens(tokenizer, text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    start = start_tokens(tokenizer)
    blocks = token_windows(ids, seq_len, start)
    windows = len(blocks)
    if windows == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}.")
    device = input_device(model)

    was_training = model.training
    model.eval()
    total_nll = 0.0
    try:
        for batch in blocks.split(batch_size):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits
            total_nll += F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction="sum"
            ).item()
    finally:
        model.train(was_training)
    predicted = windows * (seq_len - 1)
    nll = total_nll / predicted
    return PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        tokens=windows * seq_len,
        predicted_tokens=predicted,
        windows=windows,
        seq_len=seq_len,
        start_tokens=tuple(start),
    )
