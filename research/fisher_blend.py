#!/usr/bin/env python
"""Study: the default recipe's map with its KL scan replaced by a one-pass Fisher estimate of it.

The default method blends its learned offsets with a KL scan (one forward pass per layer), which costs more than
its 40 calibration steps on a CPU (`benchmarks/results/calibration_cost.md`). `benchmarks/bench_sensitivity.py`
measured a Fisher estimate of the same sensitivities (every layer from one forward and a few backward passes) at
about 5% of the scan's time, ranking the layers with Spearman 0.93 against it. A ranking is not a map: this study
calibrates each cell once and evaluates three maps built from the same learned offsets, so only the sensitivity
signal differs:

* `kl`: the default recipe's own map (offsets blended with the KL scan);
* `fisher`: offsets blended with the Fisher estimate (per-token form, `--fisher-samples` sampled backward passes on
  the scan's `KL_SAMPLES` sequences), by the same rule (`budget.blended_value`, `KL_WEIGHT`);
* `offsets`: the offsets alone (no sensitivity, what a run without any scan would give).

Held-out perplexity as in `benchmarks/bench_quality.py` (same model, texts, preset and evaluation); each finished
cell is appended to `--runs` (resumable). The `kl` map must equal that cell's `dmx` row in
`benchmarks/results/quality_runs.jsonl` when the calibration is deterministic (same seed, one thread):

    python research/fisher_blend.py --cells mxfp8-mxfp4:5:0,mxfp6-mxfp4:5:0 --threads 1 \
        --output research/fisher_blend.md
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_quality import Runner, Sweep  # noqa: E402
from bench_sensitivity import fisher_sensitivities  # noqa: E402

from optimum_dmx.calibration import CalibrationSettings, calibrate, get_preset  # noqa: E402
from optimum_dmx.calibration.budget import blended_value, budget_format_map  # noqa: E402
from optimum_dmx.calibration.sensitivity import KL_SAMPLES  # noqa: E402
from optimum_dmx.calibration.trainer import KL_WEIGHT  # noqa: E402
from optimum_dmx.continuous import get_format_pair  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

SIGNALS = ("kl", "fisher", "offsets")


def study_cell(runner: Runner, pair: str, target: float, seed: int, fisher_samples: int) -> dict:
    """Calibrate the cell once; evaluate the map of each signal."""
    sweep = runner.sweep
    settings = CalibrationSettings(
        method="dmx",
        format_pair=pair,
        target_bits=target,
        seed=seed,
        bit_average=sweep.bit_average,
        **get_preset(sweep.preset).settings(),
    )
    input_ids = runner.calibration_ids(seed)
    result = calibrate(runner.model, input_ids, settings)
    start = time.perf_counter()
    fisher, _ = fisher_sensitivities(runner.model, input_ids[:KL_SAMPLES], settings, fisher_samples, seed)
    fisher_seconds = time.perf_counter() - start
    offsets = result.beta_hat
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in offsets}
    values = {
        "kl": blended_value(offsets, result.kl_sensitivities, KL_WEIGHT),
        "fisher": blended_value(offsets, fisher, KL_WEIGHT),
        "offsets": offsets,
    }
    row = {
        "pair": pair,
        "target": target,
        "seed": seed,
        "steps_seconds": round(sum(result.step_seconds), 1),
        "scan_seconds": round(result.scan_seconds, 1),
        "fisher_seconds": round(fisher_seconds, 1),
        "fisher_samples": fisher_samples,
    }
    for signal in SIGNALS:
        format_map = budget_format_map(
            values[signal], shapes, get_format_pair(pair), target, sweep.bit_average, settings.quantize_activations
        )
        if signal == "kl" and format_map != result.format_map:
            raise RuntimeError("the rebuilt default map differs from the calibration's own")
        evaluated = runner.run(
            "dmx", pair, f"{target:g}", seed, known={"format_map": format_map, "calibration_seconds": 0}
        )
        row[signal] = {k: v for k, v in evaluated.items() if k.startswith(("ppl_", "bits_"))}
        row[signal]["format_map"] = format_map
    return row


def report(rows: list[dict]) -> str:
    texts = sorted(k[len("ppl_") :] for k in rows[0]["kl"] if k.startswith("ppl_"))
    lines = [
        "| pair | target | seed | "
        + " | ".join(f"{s} PPL {t}" for s in SIGNALS for t in texts)
        + " | bits (weighted) kl / fisher / offsets | layers differing from kl: fisher / offsets "
        "| steps s | KL scan s | Fisher s |",
        "|---|---|---|" + "---|" * (len(SIGNALS) * len(texts)) + "---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {s: [] for s in SIGNALS[1:]}
    for r in rows:
        ppl = [f"{r[s][f'ppl_{t}']:.2f}" for s in SIGNALS for t in texts]
        bits = " / ".join(f"{r[s]['bits_weighted']:.3f}" for s in SIGNALS)
        differing = " / ".join(
            str(sum(r[s]["format_map"][n] != r["kl"]["format_map"][n] for n in r["kl"]["format_map"]))
            for s in SIGNALS[1:]
        )
        lines.append(
            f"| {r['pair']} | {r['target']:g} | {r['seed']} | {' | '.join(ppl)} | {bits} | {differing} | "
            f"{r['steps_seconds']} | {r['scan_seconds']} | {r['fisher_seconds']} |"
        )
        for s in SIGNALS[1:]:
            ratios[s] += [r[s][f"ppl_{t}"] / r["kl"][f"ppl_{t}"] for t in texts]
    lines.append("")
    for s, values in ratios.items():
        mean = math.exp(sum(map(math.log, values)) / len(values))
        lines.append(
            f"- `{s}` against `kl`: lower in {sum(v < 1 for v in values)} of {len(values)} comparisons; geometric mean "
            f"perplexity ratio {mean:.3f}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", required=True, help="comma list of PAIR:TARGET:SEED")
    p.add_argument("--fisher-samples", type=int, default=4)
    p.add_argument("--preset", default="cpu-bench")
    p.add_argument("--model", type=Path, help="model folder (default: the quality benchmark's SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="calibration texts (default: the benchmark's)")
    p.add_argument("--eval", nargs="+", metavar="NAME=FILE", help="held-out texts (default: the benchmark's)")
    p.add_argument("--threads", type=int)
    p.add_argument("--runs", type=Path, default=Path(__file__).with_suffix(".jsonl"))
    p.add_argument("--output", type=Path)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cells = [(pair, float(target), int(seed)) for pair, target, seed in (c.split(":") for c in a.cells.split(","))]
    done = {(r["pair"], r["target"], r["seed"], r["fisher_samples"]) for r in read_json_lines(a.runs)}
    todo = [c for c in cells if (*c, a.fisher_samples) not in done]
    if todo:
        eval_texts = dict(item.split("=", 1) for item in a.eval) if a.eval else None
        runner = Runner(Sweep(model=a.model, calibration=a.calibration, eval_texts=eval_texts, preset=a.preset))
        for cell in todo:
            print(f"== {cell}", flush=True)
            append_json_line(a.runs, study_cell(runner, *cell, a.fisher_samples))
    rows = read_json_lines(a.runs)
    print(json.dumps([{k: v for k, v in r.items() if k not in SIGNALS} for r in rows]))
    table = report(rows)
    print(table)
    if a.output:
        command = "python research/fisher_blend.py " + shlex.join(sys.argv[1:])
        title = "The default map with a Fisher estimate in place of the KL scan"
        a.output.write_text(f"# {title}\n\nCommand: `{command}`\n\n{table}")


if __name__ == "__main__":
    main()
