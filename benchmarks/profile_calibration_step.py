#!/usr/bin/env python
"""Where the time of a default-recipe calibration step goes: a CPU profile split by job.

Runs `calibrate` (default recipe, `kl_weight=0`: the KL scan is not part of a step) for `--steps` steps under
`torch.profiler` and splits the profiled CPU time into

* weight quantization (forward): `DMXLinear.frozen_weight` (a frozen weight's values at a probe endpoint,
  computed in the first steps and reused after) and `DMXLinear.quantized_weight` (off the endpoints);
* input-activation quantization (forward): `DMXLinear.quantized_input`;
* the quantizers' backward: `dL/dx` and `dL/dbeta` of the inputs and `dL/dbeta` of the frozen weights, their
  derivatives recomputed from them (`FrozenWeightQuantization.beta_gradient`);
* matrix products (`aten::mm`/`addmm`/`bmm`, forward and backward, outside the parts above);
* the rest of the model (attention, norms, activations, the loss) and the trainer.

A two-step calibration runs first, unprofiled: it compiles the MX kernels (`optimum_dmx.formats.compilation`),
whose one-time cost is reported beside the table, not in it. The first profiled step (setup, first weight
quantizations) is profiled too: use enough steps that it does not dominate.
Profiling adds overhead to every small operation, so the shares are indicative; the step's cost without the
profiler is `bench_calibration_step.py`'s.

On a GPU (`--device cuda`) the table splits the host's time, what bounds a small model's step there (the GPU
waits for kernels to be launched); the GPU's own busy time per step is printed beside it.

usage: python benchmarks/profile_calibration_step.py [--model DIR] [--batch-size 4] [--seq-len 128] [--steps 4]
                                                     [--threads 1] [--device cpu] [--dtype float32] [--output FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from optimum_dmx.calibration import CalibrationSettings, DMXLinear, calibrate
from optimum_dmx.continuous import FrozenWeightQuantization

from common import MODEL_DTYPES, device_description, load_model_and_calibration, synchronize, write_report

WEIGHTS, INPUTS, BACKWARD = ("weight quantization (forward)", "input-activation quantization (forward)",
                             "quantizers' backward (dL/dx, dL/dbeta)")
LABELS = {(DMXLinear, "frozen_weight"): WEIGHTS, (DMXLinear, "quantized_weight"): WEIGHTS,
          (DMXLinear, "quantized_input"): INPUTS, (FrozenWeightQuantization, "beta_gradient"): BACKWARD}
INPUT_BACKWARD = "_AttachContinuousMXBackward"  # the inputs' dL/dx and dL/dbeta, derivatives recomputed
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def labelled(method, label: str):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with record_function(label):
            return method(*args, **kwargs)

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the de-gridded SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="text files (default: the Austen novels)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="torch device of the model, e.g. cuda (default: cpu)")
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="float32", help="the model's dtype")
    p.add_argument("--output", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    model, a.model, ids = load_model_and_calibration(a.model, a.calibration, a.seq_len, a.steps * a.batch_size,
                                                     device=a.device, dtype=MODEL_DTYPES[a.dtype])
    on_gpu = torch.device(a.device).type != "cpu"
    settings = CalibrationSettings(target_bits=5.0, num_samples=len(ids), seq_len=a.seq_len,
                                   batch_size=a.batch_size, steps=a.steps, kl_weight=0.0)
    for (owner, name), label in LABELS.items():  # label the quantizers' entry points for the profiler
        setattr(owner, name, labelled(getattr(owner, name), label))

    start = time.perf_counter()
    calibrate(model, ids, dataclasses.replace(settings, steps=2), progress=False)  # compiles the kernels
    warm_up = time.perf_counter() - start

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof, record_function("calibration"):
        calibrate(model, ids, settings, progress=False)
        synchronize(a.device)
    events = prof.key_averages()
    inclusive = {e.key: e.cpu_time_total for e in events}
    total = inclusive["calibration"]
    parts = {label: inclusive.get(label, 0) for label in (WEIGHTS, INPUTS, BACKWARD)}
    parts[BACKWARD] += inclusive.get(INPUT_BACKWARD, 0)
    # matrix products outside the quantizers (the quantizers use none)
    parts["matrix products (model forward and backward)"] = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
    parts["rest of the model and the trainer"] = total - sum(parts.values())

    host, device_busy = "", ""
    if on_gpu:  # the host that launches the work, and the device's own time (its kernels' self time)
        host = f", host {platform.processor() or platform.machine()} with {a.threads} torch thread(s)"
        busy = sum(e.self_device_time_total for e in events) / 1e6 / a.steps
        device_busy = f" The GPU was busy {busy:.3f} s per step."
    lines = [
        f"Model `{a.model.name}` ({a.dtype}) on {device_description(a.device)}, {a.steps} default-recipe steps of "
        f"{a.batch_size} x {a.seq_len} tokens{host}; profiled host (CPU) time {total / 1e6:.1f} s "
        f"({total / 1e6 / a.steps:.2f} s per step), after an unprofiled two-step warm-up (kernel compilation) of "
        f"{warm_up:.1f} s.{device_busy}",
        "",
        "| part | s per step | share |",
        "|---|---|---|",
        *(f"| {name} | {us / 1e6 / a.steps:.2f} | {100 * us / total:.1f}% |" for name, us in parts.items()),
    ]
    text = "\n".join(lines) + "\n"
    write_report(text, a.output, "Calibration step profile")


if __name__ == "__main__":
    main()
