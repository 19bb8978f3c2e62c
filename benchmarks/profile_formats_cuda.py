#!/usr/bin/env python
"""GPU kernel time against wall time per call of the MX kernels on one large tensor (CUDA only).

For a ``clone`` (the copy floor), ``quantize_mx`` to MXFP4 and MXFP8, and the fused continuous quantizer's forward
+ backward at beta 2 (the MXFP8 pair, beta a tensor as the public function takes it), on a ``--size`` square
float32 tensor: the wall time per call of 20 calls queued back to back, and ``torch.profiler``'s CUDA time per call
of each kernel over 5 calls. Where the wall time exceeds the kernels' sum, the GPU waited for the host.

    python benchmarks/profile_formats_cuda.py [--size 8192] [--output FILE]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from optimum_dmx import quantize_mx
from optimum_dmx.continuous import quantize_mx_continuous_fused

from common import kernel_benchmark_parser, write_report

QUEUED_CALLS = 20
PROFILED_CALLS = 5


def wall_seconds_per_call(fn: Callable[[], object]) -> float:
    """Wall time per call of ``QUEUED_CALLS`` calls queued back to back, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(QUEUED_CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / QUEUED_CALLS


def kernel_us_per_call(fn: Callable[[], object]) -> dict[str, float]:
    """Each CUDA kernel's time per call (us), from ``torch.profiler`` over ``PROFILED_CALLS`` calls."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    return {event.key: event.device_time_total / PROFILED_CALLS
            for event in prof.key_averages() if event.device_time_total > 0}


def main() -> None:
    parser = kernel_benchmark_parser(__doc__)
    parser.add_argument("--size", type=int, default=8192, help="the tensor is size x size float32")
    args = parser.parse_args()
    if torch.device(args.device).type != "cuda":
        parser.error(f"--device {args.device!r}: this profile reads CUDA kernel times; pass --device cuda.")

    x = torch.randn(args.size, args.size, device=args.device)
    grad = torch.randn_like(x)
    beta = torch.tensor(2.0, device=args.device, requires_grad=True)
    x_with_grad = x.clone().requires_grad_()

    def continuous() -> None:
        quantize_mx_continuous_fused(x_with_grad, beta, "mxfp8-mxfp4").backward(grad)
        x_with_grad.grad = beta.grad = None

    work = {"clone": x.clone, "quantize_mx mxfp4_e2m1": lambda: quantize_mx(x, "mxfp4_e2m1"),
            "quantize_mx mxfp8_e4m3": lambda: quantize_mx(x, "mxfp8_e4m3"),
            "continuous mxfp8-mxfp4 beta 2, forward+backward": continuous}
    lines = [f"{args.size}x{args.size} float32, {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| work | wall us per call | kernels (us per call) |", "|---|---|---|"]
    for name, fn in work.items():
        wall = wall_seconds_per_call(fn)
        kernels = ", ".join(f"`{key[:48]}` {us:.1f}" for key, us in kernel_us_per_call(fn).items())
        lines.append(f"| {name} | {wall * 1e6:.1f} | {kernels} |")
    write_report("\n".join(lines) + "\n", args.output, "MX kernels on a GPU: kernel time and wall time")


if __name__ == "__main__":
    main()
