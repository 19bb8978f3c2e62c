#!/usr/bin/env python
"""Study: does the KL scan get cheaper with transformers' eager attention instead of torch's SDPA on a CPU?

At the scan's shapes on an AMD EPYC with AVX-512 BF16 (16 sequences of 64 positions per pass, bfloat16 products),
attention's fused CPU kernel (`aten::_scaled_dot_product_flash_attention_for_cpu`) is the largest part of the scan
after its matrix products (`scan_arithmetic.py --operators`), and a plain product, softmax and product of the same
shape takes about half its time. This study runs the whole scan both ways on the same model and tokens and compares
its time and its ranking.

The model is the de-gridded SmolLM2-135M (float32, the benchmarks' own), rotated `online_block_hadamard` with
`offset_groups="fused"` (the default recipe's scan), and the first sequences of the `cpu-demo` preset's calibration
batches from the Austen novels. Each implementation is set with `model.set_attn_implementation`; the two alternate,
`--rounds` times each, every scan timed after one untimed scan of the same implementation.

    python research/scan_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from optimum_dmx.calibration import CalibrationSettings, get_preset  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.calibration.sensitivity import kl_sensitivities, scan_units  # noqa: E402
from optimum_dmx.nn import linear_modules_to_quantize  # noqa: E402
from optimum_dmx.nn.rotation import rotate_model  # noqa: E402

from common import load_model_and_calibration, processor_description  # noqa: E402

PRESET = "cpu-demo"
IMPLEMENTATIONS = ("sdpa", "eager")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (no ties expected)."""
    ranks = torch.stack([torch.tensor(v, dtype=torch.float64).argsort().argsort().double() for v in (a, b)])
    return float(torch.corrcoef(ranks)[0, 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    preset = get_preset(PRESET)
    model, _, ids = load_model_and_calibration(None, None, preset.seq_len, preset.num_samples)
    quantized = linear_modules_to_quantize(model, ["lm_head"])
    rotate_model(model, "online_block_hadamard", quantized)
    settings = CalibrationSettings(format_pair="mxfp8-mxfp4", **preset.settings(), offset_groups="fused")
    names = list(quantized)
    units = [unit[0] for unit in scan_units(names, offset_groups("fused", names))]  # a group's members: equal shares

    seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    values: dict[str, dict[str, float]] = {}
    for _ in range(a.rounds):
        for name in IMPLEMENTATIONS:
            model.set_attn_implementation(name)
            kl_sensitivities(model, ids, settings, progress=False)
            start = time.perf_counter()
            values[name] = kl_sensitivities(model, ids, settings, progress=False)
            seconds[name].append(time.perf_counter() - start)

    reference, other = values["sdpa"], values["eager"]
    change = max(abs(other[n] - reference[n]) / abs(reference[n]) for n in reference)
    print(f"{processor_description()}, torch {torch.__version__}, {a.threads} threads")
    print(f'SmolLM2-135M (de-gridded) rotated `online_block_hadamard`, `offset_groups="fused"`, preset `{PRESET}`')
    print()
    print("| attention | scan s (each round) | median s | x SDPA |")
    print("|---|---|---|---|")
    base = statistics.median(seconds["sdpa"])
    for name in IMPLEMENTATIONS:
        median = statistics.median(seconds[name])
        rounds = ", ".join(f"{s:.2f}" for s in seconds[name])
        print(f"| {name} | {rounds} | {median:.2f} | {median / base:.3f}x |")
    print()
    print(
        f"Ranking of the {len(units)} units, eager against SDPA: Spearman "
        f"{spearman([reference[n] for n in units], [other[n] for n in units]):.4f}; the largest change of one layer's "
        f"value: {change:.1%}."
    )


if __name__ == "__main__":
    main()
