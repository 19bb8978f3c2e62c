"""Token windows that start the way the model's tokenizer starts a text.

A causal LM sees, during training, sequences that begin the way its tokenizer begins a text: Llama 3 and
Gemma tokenizers put a BOS token first, SmolLM2's puts nothing. Calibration sequences and perplexity windows
follow the same rule (as lm-eval and transformers' perplexity guide do): every window is the tokenizer's start
tokens followed by the next tokens of the text, tokenized once without special tokens.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["start_tokens", "text_tokens", "token_windows"]

_PROBE = "a"


def start_tokens(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text's own tokens (``[bos_token_id]`` for Llama 3, ``[]`` for SmolLM2)."""
    plain = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer(_PROBE, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    raise ValueError(
        f"cannot tell how {type(tokenizer).__name__} starts a text: {_PROBE!r} tokenizes to {plain} alone and to "
        f"{full} with special tokens"
    )


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` without special tokens (the tokenizer's length warning silenced: it is cut later)."""
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def token_windows(ids: list[int], seq_len: int, start: list[int]) -> torch.LongTensor:
    """Non-overlapping ``[n, seq_len]`` windows: each is ``start`` followed by the next text tokens of ``ids``.

    A trailing partial window is dropped; ``n`` may be 0.
    """
    if seq_len <= len(start):
        raise ValueError(f"seq_len={seq_len} leaves no room for text after the {len(start)} start token(s).")
    body = seq_len - len(start)
    n = len(ids) // body
    text = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
    return torch.cat([torch.tensor(start, dtype=torch.long).expand(n, len(start)), text], dim=1)
