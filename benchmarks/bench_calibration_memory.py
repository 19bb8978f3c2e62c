#!/usr/bin/env python
"""Peak memory of a calibration step against an unquantized training step on the same batch (CPU on Linux, or CUDA).

Each measurement runs in a process of its own (this script started again with `--measure`), so that no
allocation of one lingers in the next, with glibc's `MALLOC_MMAP_THRESHOLD_=65536`: every tensor buffer above
64 KiB is its own mapping, returned to the system when freed, so the resident set follows the live tensors
instead of keeping freed memory. The process loads the model and the batch, runs one untimed warm-up of
what it measures (kernel compilation, the trainer's setup, the optimizer state), resets the kernel's resident-set
high-water mark (`/proc/self/clear_refs`), runs the measured work and reads the peak (`VmHWM`):

* `unquantized`: a forward + backward of the float model with every weight trainable (the reference);
* `dMX`: a default-recipe calibration of `--steps` steps (`kl_weight=0`: the KL scan is a once-per-run forward
  pass, not a step), which includes the trainer's one-time setup (wrapping the linears, the frozen weights'
  block maxima and their quantizations at the probe endpoints);
* `dMX eager`: the same with the compiled MX kernels off;
* `dMX checkpointed`: the default recipe with `gradient_checkpointing=True` (decoder layers recomputed in the
  backward pass).

With `--device cuda` the memory is the GPU's: the work's peak of `torch.cuda.max_memory_allocated` (reset after the
warm-up), and the memory allocated before it as the baseline.

Reported: the peak resident memory of the process (or allocated GPU memory) during the work, and the same less
the memory held before it (the model, the batch, Python and torch), with ratios to the reference.

usage: python benchmarks/bench_calibration_memory.py [--model DIR] [--calibration FILE ...] [--batch-sizes 2,4]
                                                     [--seq-len 128] [--steps 2] [--threads 1] [--device cpu]
                                                     [--dtype float32] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from common import (MODEL_DTYPES, calibration_benchmark_parser, device_description, load_model_and_calibration,
                    write_report)

WORKLOADS = ("unquantized", "dMX", "dMX eager", "dMX checkpointed")


def resident_kib(field: str) -> int:
    """A `/proc/self/status` memory field (`VmRSS`, `VmHWM`) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field: this benchmark needs Linux.")


def measure(workload: str, model_dir: Path | None, calibration: list[Path] | None, batch_size: int, seq_len: int,
            steps: int, device: str, dtype: str) -> dict[str, float]:
    """Peak and peak-over-baseline memory (MiB) of `workload`, measured in this process: resident memory on the
    CPU, allocated memory on a CUDA device."""
    from optimum_dmx import set_compile_enabled
    from optimum_dmx.calibration import CalibrationSettings, calibrate

    model, _, ids = load_model_and_calibration(model_dir, calibration, seq_len, batch_size, device=device,
                                               dtype=MODEL_DTYPES[dtype])
    ids = ids.to(device)

    if workload == "unquantized":
        for p in model.parameters():
            p.requires_grad_(True)

        def work() -> None:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        set_compile_enabled(False if workload == "dMX eager" else None)
        settings = CalibrationSettings(target_bits=5.0, num_samples=len(ids), seq_len=seq_len, batch_size=batch_size,
                                       steps=steps, kl_weight=0.0,
                                       gradient_checkpointing=workload == "dMX checkpointed")

        def work() -> None:
            calibrate(model, ids, settings, progress=False)

    work()  # warm-up: compilation, allocator pools
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device) / 1024
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 1024
    else:
        baseline = resident_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        work()
        peak = resident_kib("VmHWM")
    return {"peak_mib": peak / 1024, "over_baseline_mib": (peak - baseline) / 1024}


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference > 0 else "-"


def main() -> None:
    p = calibration_benchmark_parser(__doc__)
    p.add_argument("--steps", type=int, default=2, help="calibration steps in a dMX measurement")
    p.add_argument("--measure", choices=WORKLOADS, help=argparse.SUPPRESS)  # internal: one measurement
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    if a.measure:
        print(json.dumps(measure(a.measure, a.model, a.calibration, a.batch_size, a.seq_len, a.steps, a.device,
                                 a.dtype)))
        return

    memory = "allocated GPU memory" if torch.device(a.device).type == "cuda" else "resident memory"
    lines = [
        f"Model `{a.model.name if a.model else 'smollm2-135m-degridded'}` ({a.dtype}), {device_description(a.device)}"
        f", torch {torch.__version__}; {memory}; one process per measurement; dMX: {a.steps} default-recipe steps.",
        "",
        "| batch x seq | workload | peak MiB | / unquantized | over baseline MiB | / unquantized |",
        "|---|---|---|---|---|---|",
    ]
    for batch_size in [int(b) for b in a.batch_sizes.split(",")]:
        results = {}
        for workload in WORKLOADS:
            command = [sys.executable, __file__, "--measure", workload, "--batch-size", str(batch_size),
                       "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--threads", str(a.threads),
                       "--device", a.device, "--dtype", a.dtype]
            if a.model:
                command += ["--model", str(a.model)]
            if a.calibration:
                command += ["--calibration", *map(str, a.calibration)]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
            if out.returncode:
                raise SystemExit(f"measuring {workload} failed:\n{out.stderr[-3000:]}")
            results[workload] = json.loads(out.stdout.strip().splitlines()[-1])
        reference = results["unquantized"]
        for workload, r in results.items():
            lines.append(
                f"| {batch_size} x {a.seq_len} | {workload} | {r['peak_mib']:.0f} | "
                f"{ratio(r['peak_mib'], reference['peak_mib'])} | {r['over_baseline_mib']:.0f} | "
                f"{ratio(r['over_baseline_mib'], reference['over_baseline_mib'])} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    write_report("\n".join(lines) + "\n", a.output, "Calibration step memory")


if __name__ == "__main__":
    main()
