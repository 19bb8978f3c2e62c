#!/usr/bin/env python
"""Study: the KL scan's divergences: what they cost, what a smaller vocabulary head would save, and how exact the
whole vocabulary's divergences are when the scan multiplies in bfloat16.

Issue 41 asks the default recipe's KL scan to cost at most 10% of the default run's calibration steps. The scan
computes each unit's divergence from the final hidden states, exactly on the `HEAD_TOKENS` most probable tokens and to
second order on the rest (`calibration.vocabulary_head`): a product with that many rows of the output embedding per
pass and copy (its `dz = W dh` in bfloat16 where the scan multiplies in it), and element-wise work on as many
log-probabilities per position. How much of the scan is that, and how much would a smaller head save, at what cost to
the ranking? A model whose logits are not its output embedding's output (Gemma 2's soft-capped logits, scaled ones)
is scanned over the whole vocabulary instead, from its logits: under bfloat16 products the output embedding's product
was rounded to bfloat16 whole, the reference's and every pass's independently, until the library took each pass's
logits as the reference's float32 logits plus the bfloat16 product of the final hidden states' shift
(`calibration.sensitivity._pass_logits`, as the head's `dz`). How far did the rounding move the values, and how far
does the shift?

The model is the de-gridded SmolLM2-135M (float32, the benchmarks' own; its logits are its output embedding's
output), rotated `online_block_hadamard` with `offset_groups="fused"` (the default recipe's scan), and the first
sequences of the `cpu-demo` preset's calibration batches from the Austen novels. Every scan is the library's
(`kl_sensitivities` as calibration calls it), with glibc's allocator thresholds fixed as the inference benchmark does:

* `exact`: the whole vocabulary (`head_tokens=None`) and float32 products (`matmul_dtype=torch.float32`): the values
  every other row is compared with;
* `head K`: the library's scan with a head of `K` tokens (`HEAD_TOKENS` first, the library's), bfloat16 products where
  the CPU multiplies them natively; run `--rounds` times in turn after one untimed scan each, the time spent in the
  divergences (`VocabularyHeadReference.kl`) added up during each timed scan;
* `whole vocabulary`: `head_tokens=None` with the same products, as the library scans a model with soft-capped logits;
* `whole vocabulary, output embedding in float32`: the same with autocast paused around the output embedding (the
  library's `_autocast_paused`, installed by this script around the scan's own hooks), so that the logits are float32
  products.

Each row's ranking of the budget's units (a fused group, or a layer alone) is compared with the library's head and with
`exact`, and its values with `exact`'s (the ratios' median and range over the units). The tail mass is the reference's
probability outside the head, averaged over the positions the scan reads, from the float model in float32.

    python research/scan_head.py --threads 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from sensitivity_signals import spearman  # noqa: E402

from optimum_dmx.calibration import CalibrationSettings, get_preset  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.calibration.sensitivity import (  # noqa: E402
    KL_POSITIONS,
    KL_SAMPLES,
    _autocast_paused,
    kl_sensitivities,
    scan_units,
)
from optimum_dmx.calibration.vocabulary_head import HEAD_TOKENS, VocabularyHeadReference  # noqa: E402
from optimum_dmx.nn import linear_modules_to_quantize  # noqa: E402
from optimum_dmx.nn.rotation import rotate_model  # noqa: E402

from common import fixed_malloc_thresholds, load_model_and_calibration, processor_description  # noqa: E402

PRESET = "cpu-demo"


@contextmanager
def divergence_seconds() -> Iterator[list[float]]:
    """Within the block, the wall seconds spent in `VocabularyHeadReference.kl` are added to the yielded list's one
    element."""
    total = [0.0]
    own = VocabularyHeadReference.kl

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return own(self, *args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    VocabularyHeadReference.kl = timed
    try:
        yield total
    finally:
        VocabularyHeadReference.kl = own


def tail_mass(model: nn.Module, ids: torch.Tensor, head_tokens: int) -> float:
    """The float model's next-token probability outside the `head_tokens` most probable tokens, averaged over the
    positions the scan reads."""
    read = math.ceil(ids.shape[1] * KL_POSITIONS)
    with torch.no_grad():
        hidden = model(input_ids=ids[:KL_SAMPLES, :read], output_hidden_states=True).hidden_states[-1]
        head = model.get_output_embeddings()
        reference = VocabularyHeadReference.from_hidden(hidden, head.weight, head.bias, head_tokens)
    return float(reference.tail_log_mass.exp().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--heads", default=f"{HEAD_TOKENS},4096,2048", help="comma list; the first is the one compared")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    allocator = fixed_malloc_thresholds()

    heads = [int(n) for n in a.heads.split(",")]
    preset = get_preset(PRESET)
    model, _, ids = load_model_and_calibration(None, None, preset.seq_len, preset.num_samples)
    quantized = linear_modules_to_quantize(model, ["lm_head"])
    rotate_model(model, "online_block_hadamard", quantized)
    settings = CalibrationSettings(format_pair="mxfp8-mxfp4", **preset.settings(), offset_groups="fused")
    names = list(quantized)
    units = scan_units(names, offset_groups("fused", names))

    def scan(**kwargs) -> tuple[list[float], float]:
        start = time.perf_counter()
        values = kl_sensitivities(model, ids, settings, progress=False, **kwargs)
        return [sum(values[n] for n in unit) for unit in units], time.perf_counter() - start

    exact, exact_seconds = scan(head_tokens=None, matmul_dtype=torch.float32)
    seconds: dict[str, list[float]] = {}
    divergences: dict[str, list[float]] = {}
    values: dict[str, list[float]] = {}
    for head in heads:
        scan(head_tokens=head)
    for _ in range(a.rounds):
        for head in heads:
            with divergence_seconds() as spent:
                values[f"head {head}"], spent_seconds = scan(head_tokens=head)
            seconds.setdefault(f"head {head}", []).append(spent_seconds)
            divergences.setdefault(f"head {head}", []).append(spent[0])
    values["whole vocabulary"], whole_seconds = scan(head_tokens=None)
    seconds["whole vocabulary"] = [whole_seconds]
    with _autocast_paused(model.get_output_embeddings(), "cpu"):  # the library's own pause, around the scan's
        values["whole vocabulary, output embedding in float32"], whole_seconds = scan(head_tokens=None)
    seconds["whole vocabulary, output embedding in float32"] = [whole_seconds]

    library = f"head {heads[0]}"
    base = statistics.median(seconds[library])
    print(f"{processor_description()}, torch {torch.__version__}, {a.threads} threads; {allocator}")
    vocabulary = model.get_output_embeddings().weight.shape[0]
    print(
        f'SmolLM2-135M (de-gridded) rotated `online_block_hadamard`, `offset_groups="fused"`, preset `{PRESET}`: '
        f"{len(units)} units; vocabulary {vocabulary}; `exact` took {exact_seconds:.1f} s"
    )
    print()
    print(
        "| scan | seconds (each round) | median s | x the library's | divergences s (median) | share of the scan "
        f"| tail mass | Spearman vs {library} | vs exact | value / exact's: median (range) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row, row_values in values.items():
        median = statistics.median(seconds[row])
        rounds = ", ".join(f"{s:.2f}" for s in seconds[row])
        ratios = [v / w for v, w in zip(row_values, exact) if w > 0]
        if row.startswith("head "):
            spent = statistics.median(divergences[row])
            divergence = f"{spent:.2f} | {spent / median:.1%} | {tail_mass(model, ids, int(row.split()[1])):.1%}"
        else:
            divergence = "- | - | -"
        print(
            f"| {row} | {rounds} | {median:.2f} | {median / base:.3f}x | {divergence} "
            f"| {spearman(values[library], row_values):.5f} | {spearman(exact, row_values):.5f} "
            f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )


if __name__ == "__main__":
    main()
