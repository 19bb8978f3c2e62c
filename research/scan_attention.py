#!/usr/bin/env python
"""Study: does the KL scan get cheaper with transformers' eager attention instead of torch's SDPA on a CPU?

At the scan's shapes on an AMD EPYC with AVX-512 BF16 (16 sequences of 64 positions per pass, bfloat16 products),
attention's fused CPU kernel (`aten::_scaled_dot_product_flash_attention_for_cpu`) is the largest part of the scan
after its matrix products (`scan_arithmetic.py --operators`). The study first times one attention call at the shape
of a scan pass (SmolLM2-135M's 9 heads of 64, the key and value heads already repeated: torch's SDPA against a plain
product, softmax and product), then runs the whole scan both ways on the same model and tokens and compares its time
and its ranking.

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
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_sensitivity import spearman  # noqa: E402

from optimum_dmx.calibration import CalibrationSettings, get_preset  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.calibration.sensitivity import kl_sensitivities, scan_units  # noqa: E402
from optimum_dmx.nn import linear_modules_to_quantize  # noqa: E402
from optimum_dmx.nn.rotation import rotate_model  # noqa: E402

from common import load_model_and_calibration, median_seconds, processor_description  # noqa: E402

PRESET = "cpu-demo"
IMPLEMENTATIONS = ("sdpa", "eager")
PASS_ATTENTION_SHAPE = (16, 9, 64, 64)  # 4 copies x 4 sequences, heads, the first 64 positions, head size


def attention_call_ms(repeats: int = 7, calls: int = 20) -> tuple[float, float]:
    """Median ms of one causal attention call at `PASS_ATTENTION_SHAPE` in bfloat16: torch's SDPA, and a plain
    product, softmax and product."""
    q, k, v = (
        torch.randn(PASS_ATTENTION_SHAPE, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3)
    )
    positions = PASS_ATTENTION_SHAPE[2]
    mask = torch.full((positions, positions), float("-inf"), dtype=torch.bfloat16).triu(1)

    def plain() -> torch.Tensor:
        return ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + mask).softmax(-1) @ v

    with torch.inference_mode():
        sdpa, eager = median_seconds(
            [lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), plain], repeats, calls=calls
        )
    return sdpa * 1e3, eager * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    sdpa_ms, plain_ms = attention_call_ms()
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
    print(
        f"One attention call at {' x '.join(map(str, PASS_ATTENTION_SHAPE))}, bfloat16, causal: SDPA {sdpa_ms:.2f} ms, "
        f"a plain product, softmax and product {plain_ms:.2f} ms ({plain_ms / sdpa_ms:.2f}x)."
    )
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
