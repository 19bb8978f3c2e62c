#!/usr/bin/env python
"""Where the time of a default-recipe calibration step goes: a CPU profile split by job.

Runs `calibrate` (default recipe, `kl_weight=0`: the KL scan is not part of a step) for `--steps` steps under
`torch.profiler` and splits the profiled CPU time into

* weight quantization (forward): `DMXLinear.frozen_weight` (a frozen weight's values at a probe endpoint,
  computed in the first steps and reused after) and `DMXLinear.quantized_weight` (off the endpoints);
* input-activation quantization (forward): `DMXLinear.quantized_input`;
* the quantizers' backward: `dL/dx` and `dL/dbeta` of the inputs (their derivatives recomputed from them) and the
  frozen weights' `dy/dbeta`, recomputed in the backward pass (`FrozenWeightQuantization.beta_derivative`);
* matrix products (`aten::mm`/`addmm`/`bmm`, forward and backward, outside the parts above);
* the rest of the model (attention, norms, activations, the loss) and the trainer.

A two-step calibration runs first, unprofiled: it compiles the MX kernels (`optimum_dmx.formats.compilation`),
whose one-time cost is reported beside the table, not in it. The first profiled step (setup, first weight
quantizations) is profiled too: use enough steps that it does not dominate.
Profiling adds overhead to every small operation, so the shares are indicative; the step's cost without the
profiler is `bench_calibration_step.py`'s.

usage: python benchmarks/profile_calibration_step.py [--model DIR] [--batch-size 4] [--seq-len 128] [--steps 4]
                                                     [--threads 1] [--output FILE]
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

from common import load_model_and_calibration, write_report

WEIGHTS, INPUTS, BACKWARD = ("weight quantization (forward)", "input-activation quantization (forward)",
                             "quantizers' backward (dL/dx, dL/dbeta)")
LABELS = {(DMXLinear, "frozen_weight"): WEIGHTS, (DMXLinear, "quantized_weight"): WEIGHTS,
          (DMXLinear, "quantized_input"): INPUTS, (FrozenWeightQuantization, "beta_derivative"): BACKWARD}
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
    p.add_argument("--output", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    model, a.model, ids = load_model_and_calibration(a.model, a.calibration, a.seq_len, a.steps * a.batch_size)
    settings = CalibrationSettings(target_bits=5.0, num_samples=len(ids), seq_len=a.seq_len,
                                   batch_size=a.batch_size, steps=a.steps, kl_weight=0.0)
    for (owner, name), label in LABELS.items():  # label the quantizers' entry points for the profiler
        setattr(owner, name, labelled(getattr(owner, name), label))

    start = time.perf_counter()
    calibrate(model, ids, dataclasses.replace(settings, steps=2), progress=False)  # compiles the kernels
    warm_up = time.perf_counter() - start

    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("calibration"):
        calibrate(model, ids, settings, progress=False)
    events = prof.key_averages()
    inclusive = {e.key: e.cpu_time_total for e in events}
    total = inclusive["calibration"]
    parts = {label: inclusive.get(label, 0) for label in (WEIGHTS, INPUTS, BACKWARD)}
    parts[BACKWARD] += inclusive.get(INPUT_BACKWARD, 0)
    # matrix products outside the quantizers (the quantizers use none)
    parts["matrix products (model forward and backward)"] = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
    parts["rest of the model and the trainer"] = total - sum(parts.values())

    lines = [
        f"Model `{a.model.name}` (float32), {a.steps} default-recipe steps of {a.batch_size} x {a.seq_len} tokens, "
        f"{a.threads} torch thread(s), {platform.processor() or platform.machine()}; profiled CPU time "
        f"{total / 1e6:.1f} s ({total / 1e6 / a.steps:.2f} s per step), after an unprofiled two-step warm-up "
        f"(kernel compilation) of {warm_up:.1f} s.",
        "",
        "| part | s per step | share |",
        "|---|---|---|",
        *(f"| {name} | {us / 1e6 / a.steps:.2f} | {100 * us / total:.1f}% |" for name, us in parts.items()),
    ]
    text = "\n".join(lines) + "\n"
    write_report(text, a.output, "Calibration step profile")


if __name__ == "__main__":
    main()
