#!/usr/bin/env python
"""Host cost of one quantized layer in a calibration step: a `DMXLinear`'s forward + backward on a few tokens.

On a GPU a small model's training step is bound by the host, which launches the kernels, not by the device, which
waits for them (results/gpu_h100.md: an unquantized SmolLM2-135M step takes the same 110-134 ms from 256 to 16384
tokens). What dMX adds there is the host's work per quantized layer, paid 210 times per SmolLM2 step whatever the
batch: the Python around the quantizers, their kernels' call paths and the autograd functions. This script
measures it on a narrow layer (64 features) and few tokens, where a CPU's arithmetic is negligible too (on a
decoder-sized layer a CPU spends most of the time recomputing the weight's `dy/dbeta`, which a GPU does in
microseconds; `--width 576` on a GPU):

* the reference: an `nn.Linear` with a trainable weight, forward + backward (what an unquantized trainable step
  runs per layer);
* `DMXLinear` probed at the low endpoint with the loss's derivative wanted there (a layer the default recipe
  draws low: input and weight quantized, `dL/dx` and `dL/dbeta` in the backward pass);
* `DMXLinear` probed at the high endpoint without it (a layer drawn high: `dL/dx` only).

Both `DMXLinear` rows run as in calibration: the frozen weight's quantization at the endpoint computed once and
reused, the input's quantization computed afresh every call (`SharedInputs`, cleared per call as per step).
Medians of `--repeats` rounds, each the mean of `--calls` calls. With `--profile N`, a second table splits each
`DMXLinear` row's host time by operation and autograd function (torch.profiler, `--calls` calls, the N with the
most time of their own; the profiler's own work inflates the times).

usage: python benchmarks/bench_layer_overhead.py [--tokens 8] [--width 64] [--repeats 7] [--calls 200]
                                                 [--threads 1] [--device cpu] [--profile N] [--output FILE]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from optimum_dmx.calibration.dmx_linear import DMXLinear, SharedInputs

from common import device_description, kernel_benchmark_parser, median_seconds, write_report


def linear_step(layer: nn.Linear, x: torch.Tensor):
    """Forward + backward of a trainable `nn.Linear` on a fresh input that needs its gradient."""

    def step() -> None:
        layer(x.detach().requires_grad_(True)).sum().backward()
        layer.weight.grad = None

    return step


def dmx_step(layer: DMXLinear, x: torch.Tensor, offset: float, beta_grad: bool):
    """Forward + backward of `layer` probed at `offset`, the probe's gradient wanted or not, as a calibration
    step runs it."""

    def step() -> None:
        layer.probe = torch.tensor(offset, device=x.device, requires_grad=beta_grad)
        layer.probe_offset = offset
        layer(x.detach().requires_grad_(True)).sum().backward()
        layer.shared_inputs.clear()

    return step


def host_profile(step: Callable[[], None], calls: int, rows: int) -> list[tuple[str, float]]:
    """The ``rows`` operations (and autograd functions) with the most host time of their own over ``calls`` calls of
    ``step``, with that time in microseconds per call."""
    step()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        for _ in range(calls):
            step()
    events = sorted(profiled.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    return [(_operation_name(event.key), event.self_cpu_time_total / calls) for event in events[:rows]]


def _operation_name(key: str) -> str:
    """A profiler key, with an inductor kernel's (``## Call CompiledFxGraph <hash> ##``) shortened."""
    if key.startswith("## Call CompiledFxGraph"):
        return f"compiled kernel {key.split()[3][:8]}"
    return key


def main() -> None:
    p = kernel_benchmark_parser(__doc__)
    p.add_argument("--tokens", type=int, default=8, help="rows of the input (few: the arithmetic stays negligible)")
    p.add_argument("--width", type=int, default=64, help="in and out features (SmolLM2-135M's hidden size: 576)")
    p.add_argument("--calls", type=int, default=200, help="calls per sample")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also list each DMXLinear row's N operations with the most host time of their own")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(a.tokens, a.width, generator=generator).to(a.device)
    linear = nn.Linear(a.width, a.width, bias=False).to(a.device)
    dmx = DMXLinear(nn.Linear(a.width, a.width, bias=False).to(a.device))
    dmx.weight.requires_grad_(False)
    dmx.shared_inputs = SharedInputs()
    low, high = dmx.pair.low.name, dmx.pair.high.name
    runs = {
        "`nn.Linear`, trainable weight (reference)": linear_step(linear, x),
        f"`DMXLinear` at {low}, `dL/dbeta` wanted": dmx_step(dmx, x, 0.0, True),
        f"`DMXLinear` at {high}, no `dL/dbeta`": dmx_step(dmx, x, 2.0, False),
    }
    times = median_seconds(list(runs.values()), a.repeats, device=a.device, calls=a.calls)
    reference = times[0]
    lines = [
        f"{a.tokens} x {a.width} input, {a.width} x {a.width} weight, float32, {device_description(a.device)}, torch "
        f"{torch.__version__}; medians of {a.repeats} rounds of {a.calls} calls.",
        "",
        "| layer, forward + backward | us per call | / reference |",
        "|---|---|---|",
        *(f"| {name} | {t * 1e6:.1f} | {t / reference:.2f}x |" for name, t in zip(runs, times)),
    ]
    if a.profile:
        lines += ["", "Host time by operation (torch.profiler, self time):", "",
                  "| layer, forward + backward | operation | us per call |", "|---|---|---|"]
        for name, step in list(runs.items())[1:]:
            lines += [f"| {name} | `{op}` | {us:.1f} |" for op, us in host_profile(step, a.calls, a.profile)]
    write_report("\n".join(lines) + "\n", a.output, "Host cost of a quantized layer")


if __name__ == "__main__":
    main()
