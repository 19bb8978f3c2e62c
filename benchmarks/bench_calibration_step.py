#!/usr/bin/env python
"""Cost of one calibration step against an unquantized training step on the same batch.

For each batch size the script alternates, `--repeats` times:

* the reference: a forward + backward pass of the float model with every weight trainable;
* dMX, default recipe: two runs of the real trainer (`calibrate`) that differ only in their step count, 1 and
  `1 + --steps`; their time difference divided by `--steps` is the cost of one step, without the one-time
  setup (wrapping the linears, computing the weights' block maxima; `kl_weight=0`, since the default recipe's
  KL scan runs once per calibration, not per step: the scan's own cost is the KL baseline's, in `pareto.py`);
* dMX, paper recipe: the same with `recipe="paper"`;
* ROUND+STE: the same with `calibrate_round_ste`;
* "dMX eager": the default recipe with the compiled MX kernels off (`set_compile_enabled(False)`), to show what
  compilation (`optimum_dmx.formats.compilation`) buys in the same run;
* "dMX checkpointed": the default recipe with `gradient_checkpointing=True` (what the memory saving costs).

Before the repeats, each trainer runs once untimed for the step count it is measured at: that first run pays the
kernels' compilation (once per format, dtype and layer width), reported separately as "warm-up s".

Medians over the repeats are reported with the ratio to the reference: the issue's speed bar is a dMX step
at most 2x the unquantized forward + backward. Alternating the three measurements keeps a noisy, shared
machine from favouring one of them.

usage: python benchmarks/bench_calibration_step.py [--model DIR] [--calibration FILE ...] [--batch-sizes 2,4]
                                                   [--seq-len 128] [--pair mxfp8-mxfp4] [--steps 2]
                                                   [--repeats 3] [--threads 1] [--trainers dMX,...]
                                                   [--device cpu] [--dtype float32] [--output FILE]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from optimum_dmx import set_compile_enabled
from optimum_dmx.calibration import CalibrationSettings, calibrate, calibrate_round_ste

from common import (MODEL_DTYPES, calibration_benchmark_parser, device_description, fwd_bwd_seconds,
                    load_model_and_calibration, write_report)

# name -> (trainer, recipe, compiled kernels, gradient checkpointing)
TRAINERS = {"dMX": (calibrate, "dmx", True, False), "dMX eager": (calibrate, "dmx", False, False),
            "dMX checkpointed": (calibrate, "dmx", True, True), "dMX paper": (calibrate, "paper", True, False),
            "ROUND+STE": (calibrate_round_ste, "paper", True, False)}


def step_seconds(name: str, model: torch.nn.Module, batch: torch.Tensor, pair: str, steps: int) -> float:
    """Marginal wall time of one step of trainer `name` on `batch` (every step sees the whole batch)."""
    trainer, recipe, compiled, checkpointing = TRAINERS[name]

    def run(num_steps: int) -> float:
        settings = CalibrationSettings(
            recipe=recipe, target_bits=5.0, format_pair=pair, num_samples=len(batch), seq_len=batch.shape[1],
            batch_size=len(batch), steps=num_steps, discretization="budget", kl_weight=0.0,
            gradient_checkpointing=checkpointing,
        )
        set_compile_enabled(None if compiled else False)
        try:
            return trainer(model, batch, settings, progress=False).seconds
        finally:
            set_compile_enabled(None)

    return (run(1 + steps) - run(1)) / steps


def warm_up_seconds(name: str, model: torch.nn.Module, batch: torch.Tensor, pair: str, steps: int) -> float:
    """Wall time of one untimed measurement of trainer `name`: it compiles the kernels the timed ones reuse."""
    start = time.perf_counter()
    step_seconds(name, model, batch, pair, steps)
    return time.perf_counter() - start


def measure(
    model: torch.nn.Module, batch: torch.Tensor, pair: str, steps: int, repeats: int, trainers: list[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of the reference step and of each trainer's step, measured alternately, and each trainer's
    warm-up seconds."""
    times: dict[str, list[float]] = {"unquantized": [], **{name: [] for name in trainers}}
    warm_up = {name: warm_up_seconds(name, model, batch, pair, steps) for name in trainers}
    for _ in range(repeats):
        times["unquantized"].append(fwd_bwd_seconds(model, batch, repeats=1))
        for name in trainers:
            times[name].append(step_seconds(name, model, batch, pair, steps))
    return {name: statistics.median(values) for name, values in times.items()}, warm_up


def main() -> None:
    p = calibration_benchmark_parser(__doc__)
    p.add_argument("--pair", default="mxfp8-mxfp4")
    p.add_argument("--steps", type=int, default=2, help="extra steps whose time is divided out")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma list of {', '.join(TRAINERS)}")
    a = p.parse_args()
    trainers = a.trainers.split(",")
    unknown = [name for name in trainers if name not in TRAINERS]
    if unknown:
        p.error(f"unknown trainer {unknown}; allowed: {', '.join(TRAINERS)}")
    torch.set_num_threads(a.threads)

    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    model, a.model, ids = load_model_and_calibration(a.model, a.calibration, a.seq_len, max(batch_sizes),
                                                     device=a.device, dtype=MODEL_DTYPES[a.dtype])

    lines = [
        f"Model `{a.model.name}` ({a.dtype}), pair {a.pair}, {device_description(a.device)}, torch "
        f"{torch.__version__}; medians of {a.repeats} alternated repeats.",
        "",
        "| batch x seq | unquantized fwd+bwd ms | "
        + " | ".join(f"{name} step ms | {name} / unquantized" for name in trainers)
        + " | " + " | ".join(f"{name} warm-up s" for name in trainers) + " |",
        "|---|---|" + "---|---|" * len(trainers) + "---|" * len(trainers),
    ]
    for batch_size in batch_sizes:
        t, warm_up = measure(model, ids[:batch_size], a.pair, a.steps, a.repeats, trainers)
        ref = t["unquantized"]
        cells = " | ".join(f"{t[name] * 1e3:.1f} | {t[name] / ref:.2f}x" for name in trainers)
        cells += " | " + " | ".join(f"{warm_up[name]:.1f}" for name in trainers)
        lines.append(f"| {batch_size} x {a.seq_len} | {ref * 1e3:.1f} | {cells} |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    write_report(text, a.output, "Calibration step cost")


if __name__ == "__main__":
    main()
