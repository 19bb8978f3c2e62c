#!/usr/bin/env python
"""Total calibration wall time of the default recipe against KL pre-selection, in one process on the same tokens.

The calibration-quality bar compares whole runs: the default recipe (`calibrate` with nothing but the run's size
set: its sampled-map learning plus its KL scan for the blend) against KL pre-selection (`kl_preselection`: the
scan plus the budget rule). Both run here one after the other on the same calibration sequences, `--repeats`
times alternately, and the table gives the medians and their ratio.

usage: python benchmarks/bench_calibration_time.py [--model DIR] [--calibration FILE ...] [--steps 80]
                                                   [--batch-size 4] [--seq-len 128] [--pair mxfp8-mxfp4]
                                                   [--target 5] [--repeats 1] [--threads 1] [--output FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from optimum_dmx.calibration import CalibrationSettings, calibrate, kl_preselection

from common import load_model_and_calibration, write_report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the de-gridded SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="text files (default: the Austen novels)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--pair", default="mxfp8-mxfp4")
    p.add_argument("--target", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=None, help="also write the table (and command) here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    model, a.model, ids = load_model_and_calibration(a.model, a.calibration, a.seq_len, a.steps * a.batch_size)
    settings = CalibrationSettings(target_bits=a.target, format_pair=a.pair, num_samples=len(ids), seq_len=a.seq_len,
                                   batch_size=a.batch_size, steps=a.steps)
    runs = {"KL pre-selection (scan + budget rule)": lambda: kl_preselection(model, ids, settings, progress=False),
            f"dMX default recipe ({a.steps} steps + its KL scan)": lambda: calibrate(model, ids, settings, progress=False)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(a.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
            print(f"{name}: {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    reference = next(iter(medians.values()))
    lines = [
        f"Model `{a.model.name}` (float32), pair {a.pair}, target {a.target:g} bits, {a.steps} steps of "
        f"{a.batch_size} x {a.seq_len} tokens, {a.threads} torch thread(s), {platform.processor() or platform.machine()}; "
        f"medians of {a.repeats} alternated run(s), wall clock.",
        "",
        "| method | seconds | / KL pre-selection |",
        "|---|---|---|",
        *(f"| {name} | {seconds:.2f} | {seconds / reference:.2f}x |" for name, seconds in medians.items()),
    ]
    text = "\n".join(lines) + "\n"
    write_report(text, a.output, "Calibration wall time")


if __name__ == "__main__":
    main()
