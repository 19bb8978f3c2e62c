#!/usr/bin/env python
"""Calibration cost: a step, the KL scan and a whole run, in time and memory, against an unquantized training step.

Regenerate `results/calibration_cost.md` (longer than 30 minutes on 2 CPU cores; not yet run to the end):

    python benchmarks/bench_calibration_cost.py --threads 2 --batch-sizes 4 --repeats 1 --memory \
        --output benchmarks/results/calibration_cost.md

Everything is measured in one run on the same model and batch, so the ratios compare like with like:

* **Step** (per batch size, medians of `--repeats` alternated repeats): the reference is a forward + backward pass
  of the float model with every weight trainable. A dMX step is the marginal time of the real trainer
  (`calibrate`): two runs that differ only in their step count, 1 and `1 + --steps`, their difference divided by
  `--steps` (without the one-time setup). Rows: the default method, the same with activation checkpointing, the
  paper's method. Each runs once untimed first; that first run pays the kernels' compilation ("warm-up s").
* **Run**: one whole default-method calibration at `--preset` sizes (its steps, its KL scan and its setup), the
  KL scan alone (what `method="kl"` costs), and both in units of unquantized steps of the preset's batch.
* **Memory** (`--memory`): peak resident memory (CPU, Linux) or allocated GPU memory of one unquantized step and
  of `--steps` dMX steps, each in a process of its own with glibc's `MALLOC_MMAP_THRESHOLD_=65536` (freed buffers
  go back to the system, so the resident set follows the live tensors), after an untimed warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from optimum_dmx.calibration import (
    CalibrationSettings,
    build_calibration_batches,
    calibrate,
    get_preset,
    kl_sensitivities,
)

from common import (
    MODEL_DTYPES,
    benchmark_texts,
    calibration_benchmark_parser,
    device_description,
    fwd_bwd_seconds,
    load_model_and_calibration,
    write_report,
)

# name -> the settings that differ from the default method's
TRAINERS = {"dMX": {}, "dMX checkpointed": {"gradient_checkpointing": True}, "dMX paper": {"method": "paper"}}
MEMORY_WORKLOADS = ("unquantized", "dMX", "dMX checkpointed")


def step_seconds(name: str, model: torch.nn.Module, batch: torch.Tensor, pair: str, steps: int) -> float:
    """Marginal wall time of one step of trainer `name` on `batch` (every step sees the whole batch)."""

    def run(num_steps: int) -> float:
        settings = CalibrationSettings(
            target_bits=5.0,
            format_pair=pair,
            num_samples=len(batch),
            seq_len=batch.shape[1],
            batch_size=len(batch),
            steps=num_steps,
            **TRAINERS[name],
        )
        start = time.perf_counter()
        calibrate(model, batch, settings, progress=False)
        return time.perf_counter() - start

    return (run(1 + steps) - run(1)) / steps  # the setup and the default method's KL scan cancel out


def _scan_seconds(model: torch.nn.Module, ids: torch.Tensor, pair: str, batch_size: int = 4) -> float:
    """Wall time of the KL scan (`kl_sensitivities`) on `ids`."""
    settings = CalibrationSettings(format_pair=pair, batch_size=batch_size)
    start = time.perf_counter()
    kl_sensitivities(model, ids, settings, progress=False)
    return time.perf_counter() - start


def step_table(model: torch.nn.Module, ids: torch.Tensor, a: argparse.Namespace) -> list[str]:
    lines = [
        "## Step",
        "",
        "| batch x seq | unquantized fwd+bwd ms | "
        + " | ".join(f"{name} step ms | {name} / unquantized" for name in TRAINERS)
        + " | "
        + " | ".join(f"{name} warm-up s" for name in TRAINERS)
        + " |",
        "|---|---|" + "---|---|" * len(TRAINERS) + "---|" * len(TRAINERS),
    ]
    for batch_size in [int(b) for b in a.batch_sizes.split(",")]:
        batch = ids[:batch_size]
        warm_up = {}
        for name in TRAINERS:
            start = time.perf_counter()
            step_seconds(name, model, batch, a.pair, a.steps)
            warm_up[name] = time.perf_counter() - start
        times: dict[str, list[float]] = {"unquantized": [], **{name: [] for name in TRAINERS}}
        for _ in range(a.repeats):
            times["unquantized"].append(fwd_bwd_seconds(model, batch, repeats=1))
            for name in TRAINERS:
                times[name].append(step_seconds(name, model, batch, a.pair, a.steps))
        t = {name: statistics.median(values) for name, values in times.items()}
        reference = t["unquantized"]
        cells = " | ".join(f"{t[name] * 1e3:.1f} | {t[name] / reference:.2f}x" for name in TRAINERS)
        cells += " | " + " | ".join(f"{warm_up[name]:.1f}" for name in TRAINERS)
        lines.append(f"| {batch_size} x {batch.shape[1]} | {reference * 1e3:.1f} | {cells} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def run_table(model: torch.nn.Module, model_dir: Path, a: argparse.Namespace) -> list[str]:
    from transformers import AutoTokenizer

    preset = get_preset(a.preset)
    texts = a.calibration or benchmark_texts().calibration  # the model is loaded once, in main
    ids = build_calibration_batches(texts, AutoTokenizer.from_pretrained(model_dir), preset.seq_len, preset.num_samples)
    settings = CalibrationSettings(format_pair=a.pair, **preset.settings())
    reference = fwd_bwd_seconds(model, ids[: preset.batch_size], repeats=3)
    scan = _scan_seconds(model, ids, a.pair, preset.batch_size)
    start = time.perf_counter()
    calibrate(model, ids, settings, progress=False)
    whole = time.perf_counter() - start
    lines = [
        "## Run",
        "",
        f"Preset `{a.preset}`: {preset.steps} steps of {preset.batch_size} x {preset.seq_len} tokens; one "
        f"unquantized step of that batch takes {reference * 1e3:.1f} ms.",
        "",
        "| what | seconds | unquantized steps |",
        "|---|---|---|",
        f'| KL scan alone (`method="kl"`) | {scan:.1f} | {scan / reference:.0f} |',
        f"| whole default-method run (steps + scan + setup) | {whole:.1f} | {whole / reference:.0f} |",
        f"| its steps and setup (run less scan), per step | {(whole - scan) / preset.steps:.2f} | "
        f"{(whole - scan) / preset.steps / reference:.1f} |",
    ]
    print("\n".join(lines[-3:]), file=sys.stderr, flush=True)
    return lines


def resident_kib(field: str) -> int:
    """A `/proc/self/status` memory field (`VmRSS`, `VmHWM`) in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field: the memory table needs Linux.")


def measure_memory(workload: str, a: argparse.Namespace) -> dict[str, float]:
    """Peak and peak-over-baseline memory (MiB) of `workload`, measured in this process."""
    model, _, ids = load_model_and_calibration(
        a.model, a.calibration, a.seq_len, a.batch_size, device=a.device, dtype=MODEL_DTYPES[a.dtype]
    )
    ids = ids.to(a.device)
    if workload == "unquantized":
        for p in model.parameters():
            p.requires_grad_(True)

        def work() -> None:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        settings = CalibrationSettings(
            target_bits=5.0,
            format_pair=a.pair,
            num_samples=len(ids),
            seq_len=a.seq_len,
            batch_size=a.batch_size,
            steps=a.steps,
            **TRAINERS[workload],
        )

        def work() -> None:
            calibrate(model, ids, settings, progress=False)

    work()  # warm-up: compilation, allocator pools
    if torch.device(a.device).type == "cuda":
        torch.cuda.synchronize(a.device)
        baseline = torch.cuda.memory_allocated(a.device) / 1024
        torch.cuda.reset_peak_memory_stats(a.device)
        work()
        torch.cuda.synchronize(a.device)
        peak = torch.cuda.max_memory_allocated(a.device) / 1024
    else:
        baseline = resident_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM to the current resident set
        work()
        peak = resident_kib("VmHWM")
    return {"peak_mib": peak / 1024, "over_baseline_mib": (peak - baseline) / 1024}


def memory_table(a: argparse.Namespace) -> list[str]:
    memory = "allocated GPU memory" if torch.device(a.device).type == "cuda" else "resident memory"
    lines = [
        "## Memory",
        "",
        f"{memory}, one process per measurement; dMX rows: {a.steps} steps.",
        "",
        "| batch x seq | workload | peak MiB | over baseline MiB | / unquantized |",
        "|---|---|---|---|---|",
    ]
    for batch_size in [int(b) for b in a.batch_sizes.split(",")]:
        results = {}
        for workload in MEMORY_WORKLOADS:
            command = [
                sys.executable,
                __file__,
                "--measure-memory",
                workload,
                "--batch-size",
                str(batch_size),
                "--seq-len",
                str(a.seq_len),
                "--steps",
                str(a.steps),
                "--threads",
                str(a.threads),
                "--device",
                a.device,
                "--dtype",
                a.dtype,
                "--pair",
                a.pair,
            ]
            if a.model:
                command += ["--model", str(a.model)]
            if a.calibration:
                command += ["--calibration", *map(str, a.calibration)]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
            if out.returncode:
                raise SystemExit(f"measuring {workload} failed:\n{out.stderr[-3000:]}")
            results[workload] = json.loads(out.stdout.strip().splitlines()[-1])
        reference = results["unquantized"]["over_baseline_mib"]
        for workload, r in results.items():
            ratio = f"{r['over_baseline_mib'] / reference:.2f}x" if reference > 0 else "-"
            lines.append(
                f"| {batch_size} x {a.seq_len} | {workload} | {r['peak_mib']:.0f} | "
                f"{r['over_baseline_mib']:.0f} | {ratio} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main() -> None:
    p = calibration_benchmark_parser(__doc__)
    p.add_argument("--pair", default="mxfp8-mxfp4")
    p.add_argument("--steps", type=int, default=2, help="extra steps whose time is divided out (and memory steps)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", default="cpu-demo", help="sizes of the whole run (optimum_dmx.calibration.presets)")
    p.add_argument("--memory", action="store_true", help="add the memory table")
    p.add_argument("--no-run", action="store_true", help="leave out the whole run")
    p.add_argument("--measure-memory", choices=MEMORY_WORKLOADS, help=argparse.SUPPRESS)  # internal: one process
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.measure_memory:
        print(json.dumps(measure_memory(a.measure_memory, a)))
        return

    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    model, model_dir, ids = load_model_and_calibration(
        a.model, a.calibration, a.seq_len, max(batch_sizes), device=a.device, dtype=MODEL_DTYPES[a.dtype]
    )
    lines = [
        f"Model `{model_dir.name}` ({a.dtype}), pair {a.pair}, {device_description(a.device)}, torch "
        f"{torch.__version__}.",
        "",
        *step_table(model, ids, a),
    ]
    if not a.no_run:
        lines += ["", *run_table(model, model_dir, a)]
    if a.memory:
        lines += ["", *memory_table(a)]
    write_report("\n".join(lines) + "\n", a.output, "Calibration cost")


if __name__ == "__main__":
    main()
