#!/usr/bin/env python
"""Which part of the merged rotation changes uniform MX quantization, one part at a time.

Variants of the model (each function-preserving, checked by the float perplexity):

* `none`; `fold`: the RMSNorm scales folded into the linears reading them (`fold_norm_scales`), nothing rotated;
* `residual`: `fold` and the residual stream rotated by a full-size randomized Hadamard matrix (R1);
* `heads`: the value heads rotated per layer (R2) only;
* `hadamard`, `online_block_hadamard`: `rotate_model` with that rotation (all parts; every input online).

For each: the held-out perplexity with every targeted linear in `--format` (weights and input activations, and
weights only), and the mean relative squared error of the weights' MX casts per projection. Rows are appended to
`--out` (JSON lines) as each variant finishes; `--report` prints the markdown table.

    python benchmarks/rotation_components.py --threads 1
    python benchmarks/rotation_components.py --report
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from common import append_json_line, read_json_lines, run_or_report
from pareto import Benchmark, Runner

from optimum_dmx.calibration import CalibrationSettings
from optimum_dmx.calibration.baselines import uniform_format_map
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.formats import quantize_mx
from optimum_dmx.nn import emulate_format_map, linear_modules_to_quantize
from optimum_dmx.nn.rotation import fold_norm_scales, merge_rotations, rotate_model, rotation_sites
from optimum_dmx.nn.transforms import RandomizedHadamard

VARIANTS = ("none", "fold", "residual", "heads", "hadamard", "online_block_hadamard")
OUT = Path(__file__).parent / "results" / "rotation_components.jsonl"


def apply(model: torch.nn.Module, variant: str) -> None:
    """Rotate `model` in place as `variant` says (seed 1 for the single parts, seed 0 for `rotate_model`)."""
    if variant in ("hadamard", "online_block_hadamard"):
        rotate_model(model, variant, linear_modules_to_quantize(model, CalibrationSettings().modules_to_not_convert), seed=0)
        return
    sites = rotation_sites(model)
    hidden = model.get_input_embeddings().weight.shape[1]
    if variant in ("fold", "residual"):
        fold_norm_scales(model)
    residual = RandomizedHadamard(hidden, hidden, seed=1).matrix() if variant == "residual" else None
    heads = [RandomizedHadamard(d, d, seed=2).matrix() if variant == "heads" else torch.eye(d, dtype=torch.float64)
             for _, _, d in sites.heads]
    merge_rotations(model, sites, residual, heads)


def weight_errors(model: torch.nn.Module, fmt: str, block_size: int = 32) -> dict[str, float]:
    """Mean over layers of `||cast(W) - W||^2 / ||W||^2`, per projection name."""
    errors = defaultdict(list)
    for name, linear in linear_modules_to_quantize(model, CalibrationSettings().modules_to_not_convert).items():
        weight = linear.weight.detach().float()
        error = (quantize_mx(weight, fmt, block_size) - weight).square().sum() / weight.square().sum()
        errors[name.rsplit(".", 1)[-1]].append(error.item())
    return {projection: round(sum(values) / len(values), 5) for projection, values in errors.items()}


def run(bench: Benchmark, variant: str, fmt: str, out: Path) -> None:
    runner = Runner(bench)  # bench.rotation is "none": the variant rotates
    apply(runner.model, variant)
    format_map = uniform_format_map(runner.model, fmt, CalibrationSettings().modules_to_not_convert)  # lm_head in float
    row = {"variant": variant, "format": fmt, "eval_tokens": bench.eval_tokens, "weight_error": weight_errors(runner.model, fmt)}
    for name, text in runner.texts.items():
        def perplexity() -> float:
            return round(evaluate_perplexity(runner.model, runner.tokenizer, text, bench.eval_seq_len, bench.eval_tokens,
                                             batch_size=4).perplexity, 3)

        row[f"float_{name}"] = perplexity()
        with emulate_format_map(runner.model, format_map):
            row[f"ppl_{name}"] = perplexity()
        with emulate_format_map(runner.model, format_map, quantize_activations=False):
            row[f"weights_only_{name}"] = perplexity()
    append_json_line(out, row)


def report(out: Path) -> str:
    rows = read_json_lines(out)
    texts = [k[4:] for k in rows[0] if k.startswith("ppl_")]
    projections = list(rows[0]["weight_error"])
    header = ["variant", "format", *(f"float {t}" for t in texts), *(f"W+A {t}" for t in texts),
              *(f"W only {t}" for t in texts), *(f"{p} rel. error" for p in projections)]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in rows:
        cells = [r["variant"], r["format"], *(f"{r['float_' + t]:.2f}" for t in texts),
                 *(f"{r['ppl_' + t]:.2f}" for t in texts), *(f"{r['weights_only_' + t]:.2f}" for t in texts),
                 *(f"{r['weight_error'][p]:.4f}" for p in projections)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--format", default="mxfp4_e2m1")
    p.add_argument("--eval-tokens", type=int, default=Benchmark.eval_tokens)
    a = run_or_report(p, argv, report, OUT)
    if a is None:
        return
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant {bad}; allowed: {', '.join(VARIANTS)}")
    done = {(r["variant"], r["format"], r["eval_tokens"]) for r in read_json_lines(a.out)}
    bench = Benchmark(eval_tokens=a.eval_tokens)
    bench.resolve_inputs()
    for variant in a.variants.split(","):
        if (variant, a.format, a.eval_tokens) not in done:
            run(bench, variant, a.format, a.out)


if __name__ == "__main__":
    sys.exit(main())
