"""What llm-compressor's peer scripts share: `oneshot` on the calibration token ids dMX reads, and the versions run.

Imported by `llmcompressor_gptq.py` and `llmcompressor_quip.py` (their folder is on `sys.path` when they run), in
llm-compressor's own environment.
"""

from __future__ import annotations

import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from llmcompressor import oneshot
from safetensors.torch import load_file


def oneshot_on_tokens(model: torch.nn.Module, tokens: Path, recipe: Any) -> float:
    """Apply `recipe` to `model` with llm-compressor's `oneshot` on the `input_ids` stored in `tokens` (every sequence,
    in order, whole); returns its wall time in seconds."""
    input_ids = load_file(tokens)["input_ids"]
    dataset = Dataset.from_dict(
        {"input_ids": input_ids.tolist(), "attention_mask": [[1] * input_ids.shape[1]] * len(input_ids)}
    )
    start = time.perf_counter()
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(input_ids),
        max_seq_length=input_ids.shape[1],
        shuffle_calibration_samples=False,
    )
    return time.perf_counter() - start


def library_versions() -> dict[str, str]:
    """The versions of the libraries a peer run depends on, for its `run.json`."""
    return {name: version(name) for name in ("llmcompressor", "compressed-tensors", "transformers", "torch")}
