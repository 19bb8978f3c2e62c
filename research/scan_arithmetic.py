#!/usr/bin/env python
"""Study: how much of the KL scan, and of a calibration step, is matrix products, and what that bounds.

Issue 41 asks the default recipe's KL scan to cost at most 10% of the default run's 40 calibration steps. On CPUs
that multiply bfloat16 natively (AMX, AVX-512 BF16) the scan's products run in bfloat16 (`calibration.sensitivity`,
`matmul_dtype="auto"`) and the share measured 8-12%; on a CPU without (AVX2 only) they stay float32. If the scan is
mostly matrix products there, no change to its other work can bring it under the bar: only fewer products (tokens,
passes, decoder layers per pass) or faster ones.

The model is the CLI's default run's, in shape: SmolLM2-135M (randomly initialised: the products do not depend on the
weights), rotated `online_block_hadamard` with `offset_groups="fused"` as `rotation="auto"` and the servable recipe
do, calibrated at the `cpu-demo` preset's sizes (4 x 128 tokens per step). Three measurements in one process, after
a calibration that makes every kernel ready:

* wall time, uncounted: a whole calibration at the preset's sizes, its steps (the first pays no compilation, but
  each step that draws a layer's endpoint for the first time quantizes its weight: the early steps cost more than
  the later ones, so every step of the run is timed) and its scan;
* matrix products, counted at the dispatcher (a `TorchDispatchMode`): their floating-point operations and their
  own wall time (`aten.mm`, `addmm`, `bmm`, `baddbmm`: the linears, forward and backward, and the vocabulary head;
  attention's own products run in a fused kernel not counted here, a few percent at 128 tokens), in the scan alone
  (`kl_sensitivities` as calibration calls it) and in calibrations of one and three steps, whose difference gives a
  step's (and checks that calibration adds no products besides its steps and its scan);
* with `--operators N`, where the scan's time goes: one more scan under `torch.profiler`, its `N` operators of the
  most time of their own, with their calls and their share of the profiled scan (the profiler adds its own cost to
  every call, so the shares, not the seconds, compare with the table above).

    python research/scan_arithmetic.py --threads 2 --operators 12
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from optimum_dmx.calibration import CalibrationSettings, calibrate, get_preset  # noqa: E402
from optimum_dmx.calibration.sensitivity import kl_sensitivities, native_bfloat16  # noqa: E402
from optimum_dmx.nn import linear_modules_to_quantize  # noqa: E402
from optimum_dmx.nn.rotation import rotate_model  # noqa: E402

from common import processor_description, random_ids, random_model  # noqa: E402

SHAPE = "smollm2-135m"
PRESET = "cpu-demo"  # the CLI's default run: 40 steps of 4 x 128 tokens
MATRIX_PRODUCTS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


@dataclass
class Products:
    """The matrix products of a call: floating-point operations and their own seconds."""

    flops: float
    seconds: float

    def __add__(self, other: Products) -> Products:
        return Products(self.flops + other.flops, self.seconds + other.seconds)

    def __sub__(self, other: Products) -> Products:
        return Products(self.flops - other.flops, self.seconds - other.seconds)

    def __mul__(self, factor: float) -> Products:
        return Products(self.flops * factor, self.seconds * factor)


class _CountedProducts(TorchDispatchMode):
    """Counts the matrix products run under it: their floating-point operations and their own wall time."""

    def __init__(self):
        super().__init__()
        self.products = Products(0.0, 0.0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket not in MATRIX_PRODUCTS:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - start
        left, right = args[-2], args[-1]  # (bias or input,) a, b: a is (..., m, k), b (..., k, n)
        flops = 2 * left.numel() * right.shape[-1]  # 2 m k n (times the batch of a bmm)
        self.products = self.products + Products(flops, seconds)
        return out


def products_of(call) -> Products:
    """The matrix products `call()` runs, forward and backward (counted at the dispatcher, below autograd)."""
    with _CountedProducts() as counted:
        call()
    return counted.products


def print_operators(call, count: int) -> None:
    """The `count` operators of `call()` with the most time of their own (`torch.profiler`, CPU), as a table; the
    compiled kernels (inductor's, one profiler entry each) are counted together as one."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        call()
    own: dict[str, list[float]] = {}  # operator -> [calls, own microseconds]
    for event in profiled.key_averages():
        compiled = event.key.startswith("## Call CompiledFxGraph")
        totals = own.setdefault("compiled kernels (inductor)" if compiled else f"`{event.key}`", [0, 0.0])
        totals[0] += event.count
        totals[1] += event.self_cpu_time_total
    total = sum(seconds for _, seconds in own.values())
    print()
    print(f"The scan by operator (`torch.profiler`, {total / 1e6:.2f} s profiled; the {count} of most own time):")
    print()
    print("| operator | calls | own s | share of the scan |")
    print("|---|---|---|---|")
    for name, (calls, seconds) in sorted(own.items(), key=lambda item: item[1][1], reverse=True)[:count]:
        print(f"| {name} | {calls} | {seconds / 1e6:.2f} | {seconds / total:.1%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--operators", type=int, default=0, help="also print the scan's N operators of most own time")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    model = random_model(SHAPE)
    rotate_model(model, "online_block_hadamard", linear_modules_to_quantize(model, ["lm_head"]))
    preset = get_preset(PRESET)
    ids = random_ids(SHAPE, preset.seq_len, preset.num_samples)
    base = CalibrationSettings(format_pair="mxfp8-mxfp4", **preset.settings(), offset_groups="fused")

    def calibration(steps: int):
        return calibrate(copy.deepcopy(model), ids, dataclasses.replace(base, steps=steps), progress=False)

    calibration(2)  # every kernel ready (compiled, or loaded from the kernel cache)
    timed = calibration(preset.steps)
    steps = preset.steps
    step_wall, scan_wall = sum(timed.step_seconds) / steps, timed.scan_seconds
    scan = products_of(lambda: kl_sensitivities(model, ids, base, progress=False))
    one, three = products_of(lambda: calibration(1)), products_of(lambda: calibration(3))
    step = (three - one) * 0.5
    unaccounted = one - step - scan

    all_steps = step * steps
    rows = [
        (f"a step (mean of {steps})", step_wall, step),
        (f"{steps} steps (the run's)", step_wall * steps, all_steps),
        ("KL scan", scan_wall, scan),
    ]
    native = native_bfloat16(torch.device("cpu"))
    print(
        f"{processor_description()}, torch {torch.__version__}, {a.threads} threads: the scan's products in "
        f"{'bfloat16' if native else 'float32'}"
    )
    print(
        f'`{SHAPE}` rotated `online_block_hadamard`, `offset_groups="fused"`, preset `{PRESET}`; wall: one whole '
        "calibration, uncounted"
    )
    print()
    print("| phase | wall s | matrix products GFLOP | their s | GFLOP/s | share of the wall |")
    print("|---|---|---|---|---|---|")
    for name, wall, products in rows:
        print(
            f"| {name} | {wall:.2f} | {products.flops / 1e9:.0f} | {products.seconds:.2f} | "
            f"{products.flops / 1e9 / products.seconds:.0f} | {products.seconds / wall:.0%} |"
        )
    print(
        f"| scan / {steps} steps | {scan_wall / (step_wall * steps):.3f} | {scan.flops / all_steps.flops:.3f} | "
        f"{scan.seconds / all_steps.seconds:.3f} | | |"
    )
    print()
    at_steps_rate = scan.flops / (all_steps.flops / all_steps.seconds)
    print(
        f"The scan's matrix products alone take {scan.seconds:.1f} s at the rate they ran, {at_steps_rate:.1f} s at "
        f"the steps' rate: {scan.seconds / (step_wall * steps):.1%} and {at_steps_rate / (step_wall * steps):.1%} of "
        f"the {steps} steps' wall time (the issue's bar: 10%)."
    )
    print(
        f"Products in a one-step calibration besides its step and its scan: {unaccounted.flops / 1e9:.1f} GFLOP "
        f"({unaccounted.flops / one.flops:.1%} of its total)."
    )
    if a.operators:
        print_operators(lambda: kl_sensitivities(model, ids, base, progress=False), a.operators)


if __name__ == "__main__":
    main()
