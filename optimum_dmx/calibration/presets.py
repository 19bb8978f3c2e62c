"""Named calibration sizes: how much text a run reads and how long it trains, in one place.

`DMXConfig(preset=...)`, the CLI's `--preset` and the benchmarks pick these by name; a field given explicitly
overrides its preset's value. The default is `"paper"`.

* `"paper"`: the dMX paper's 400 steps of 8 x 2048 tokens, from 3,200 sequences.
* `"gpu"`: the paper's sizes with activation checkpointing, for an 8B model on one 80 GB GPU. Sized on paper: a
  step of a frozen 8B model costs about 3 forward passes (forward, input gradients, recomputation) of 16,384
  tokens, 7.4e14 FLOP, about 2 s at 400 TFLOP/s; the H100 run of this package measured a quantized step at
  2.3x an unquantized one, so 400 steps take about 30 minutes and the KL scan (224 forward passes of 4,096
  tokens: the first half of 4 sequences) about 1. Memory: 16 GB of bf16 weights, two bf16 copies of them
  quantized at the format endpoints (32 GB), one decoder layer's activations per sequence kept by checkpointing.
* `"cpu-demo"`: what the CLI's default run uses, for a 135M model on 2 idle CPU cores: 40 steps of 4 x 128 tokens;
  GPTQ reads the first 64 of its 160 sequences, in about half the time of all 160. Measured: on the quality
  benchmark's 5-bit map, GPTQ on 32 / 64 / 160 / 320 sequences gave held-out perplexities within 2% of each other
  (`benchmarks/results/quality.md`); the CLI's own run reported 60.15 with 64 against 58.80 with 160.
* `"cpu-bench"`: the quality benchmark's runs on a 135M model on a CPU: 80 steps of 4 x 128 tokens; the paper's
  procedure then needs a larger step than the paper's lr of 1 to move its offsets in so few steps (20).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .settings import PaperRecipe


@dataclass(frozen=True)
class Preset:
    """Calibration sizes (and the paper recipe's values where a size calls for other ones)."""

    num_samples: int
    seq_len: int
    batch_size: int
    steps: int
    gradient_checkpointing: bool = False
    paper: PaperRecipe = field(default_factory=PaperRecipe)
    gptq_samples: int | None = None  # GPTQ reads the first ones of the calibration sequences (None: all)

    def settings(self) -> dict:
        """The `CalibrationSettings` fields this preset sets (GPTQ's sequences are not calibration's)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "gptq_samples"}


_PAPER = Preset(num_samples=3200, seq_len=2048, batch_size=8, steps=400)

PRESETS: dict[str, Preset] = {
    "paper": _PAPER,
    "gpu": dataclasses.replace(_PAPER, gradient_checkpointing=True),
    "cpu-demo": Preset(num_samples=160, seq_len=128, batch_size=4, steps=40, gptq_samples=64),
    "cpu-bench": Preset(num_samples=320, seq_len=128, batch_size=4, steps=80, paper=PaperRecipe(lr=20.0)),
}
DEFAULT_PRESET = "paper"


def get_preset(name: str) -> Preset:
    """The preset called `name`; raises naming the allowed ones."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not a preset; allowed: {', '.join(map(repr, PRESETS))}.")
    return PRESETS[name]
