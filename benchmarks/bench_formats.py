"""Speed of MX quantize-dequantize: optimum-dmx (compiled and eager) vs torchao (eager), against a memory-copy floor.

Regenerate `results/formats.md` (a few minutes on one CPU core):

    python benchmarks/bench_formats.py --repeats 7 --threads 1 --output benchmarks/results/formats.md

For each MX format, quantize-dequantize one float32 tensor (default 4096 x 4096) with ``quantize_mx`` (its compiled
kernel, ``formats.compilation``, and its eager cast) and with torchao's ``to_mx`` + ``to_dtype`` (FLOOR scaling, the
OCP rule), check that they agree bit for bit, and report the median time per element over interleaved repetitions
(they run alternately, so machine noise hits all alike) with the ratio ours / torchao. A ``clone`` of the same
tensor is the memory-bound floor. The time of the first compiled call (compilation) is reported separately.
``pack_mx`` (the storage form: codes and scales, what quantizing or exporting a model's weights runs), compiled and
eager, is timed against torchao's ``to_mx`` (its scales and element data), its values checked through ``unpack_mx``.
The continuous dMX quantizer's forward + backward (gradients for the input and beta, from a dense incoming gradient,
as inside a network) is timed on the same tensor, both pairs interleaved: the autograd reference and the fused
version at beta 0.5 (a fractional offset: the eager kernel), and the fused version at beta 2 (a format endpoint,
what the default recipe probes, given as a number as the recipe does), compiled and eager. On a GPU each timed
sample is ten calls in a row (the device's time per call, its launches overlapped).

    python benchmarks/bench_formats.py [--size 4096] [--repeats 7] [--threads N] [--device cpu]
                                       [--output results/formats.md]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from optimum_dmx import (
    FORMAT_PAIRS,
    MX_FORMATS,
    pack_mx,
    quantize_mx,
    quantize_mx_continuous,
    set_compile_enabled,
    unpack_mx,
)
from optimum_dmx.continuous import ContinuousQuantization, quantize_mx_continuous_fused

from common import device_description, kernel_benchmark_parser, median_seconds, synchronize, write_report

ENDPOINT = 2.0  # the continuous quantizer's high end: an exact format, what the default recipe probes


def torchao_references() -> tuple[Callable[[torch.Tensor, str], torch.Tensor], Callable[[torch.Tensor, str], tuple]]:
    """torchao's quantize-dequantize of a format by name, and its storage form (`to_mx`: scales, element data)."""
    from torchao.prototype.mx_formats import constants
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    elem_dtypes = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp6_e3m2": constants.DTYPE_FP6_E3M2,
        "mxfp6_e2m3": constants.DTYPE_FP6_E2M3,
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }

    def stored(x: torch.Tensor, name: str) -> tuple:
        return to_mx(x, elem_dtypes[name], 32)

    def quantize(x: torch.Tensor, name: str) -> torch.Tensor:
        scale, data = stored(x, name)
        return to_dtype(data, scale, elem_dtypes[name], 32, x.dtype)

    return quantize, stored


def eager(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` run with compiled kernels off."""

    def run() -> None:
        set_compile_enabled(False)
        try:
            fn()
        finally:
            set_compile_enabled(None)

    return run


def first_call_seconds(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def continuous_step(
    x: torch.Tensor, grad: torch.Tensor, pair: str, quantize: Callable = quantize_mx_continuous, offset: float = 0.5
) -> Callable[[], None]:
    """Forward + backward of a continuous quantizer at beta ``offset`` with the incoming gradient ``grad`` (as
    inside a network: a dense ``dL/dy``), computing the gradients for the input and beta."""
    beta = torch.tensor(offset, device=x.device, requires_grad=True)
    x = x.clone().requires_grad_()

    def step() -> None:
        quantize(x, beta, pair).backward(grad)
        x.grad = beta.grad = None

    return step


def fused_at_endpoint(x: torch.Tensor, beta: torch.Tensor, pair: str) -> torch.Tensor:
    """The fused quantizer at beta ``ENDPOINT`` as calibration runs it: the offset given as a number (a tensor's
    value would cost a device-to-host copy on a GPU), the values attached to the graphs of ``x`` and ``beta``."""
    return ContinuousQuantization.compute(x, ENDPOINT, pair).attach(x, beta)


def main() -> None:
    parser = kernel_benchmark_parser(__doc__)
    parser.add_argument("--size", type=int, default=4096, help="the tensor is size x size float32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    calls = 10 if device.type == "cuda" else 1  # on a GPU: the device's time per call, launches overlapped
    x = torch.randn(args.size, args.size, generator=generator).to(device)
    grad = torch.randn(args.size, args.size, generator=generator).to(device)
    n = x.numel()
    reference, reference_to_mx = torchao_references()
    rows = []
    (floor,) = median_seconds([x.clone], args.repeats, device=device, calls=calls)
    rows.append(("memory copy (`clone`)", "-", floor / n * 1e9, None, None, "-"))

    def against_torchao(label: str, exact: bool, seconds: float, theirs: float) -> tuple:
        """A table row: an operation of ours timed against torchao's, per element and against the copy floor."""
        return (
            label,
            "yes" if exact else "NO",
            seconds / n * 1e9,
            theirs / n * 1e9,
            seconds / theirs,
            f"{seconds / floor:.1f}",
        )

    compile_seconds = {}
    for name in MX_FORMATS:
        compile_seconds[f"`quantize_mx` {name}"] = first_call_seconds(lambda: quantize_mx(x, name), device)
        compiled, theirs = quantize_mx(x, name), reference(x, name)
        set_compile_enabled(False)
        eager_out = quantize_mx(x, name)
        set_compile_enabled(None)
        times = median_seconds(
            [lambda: quantize_mx(x, name), eager(lambda: quantize_mx(x, name)), lambda: reference(x, name)],
            args.repeats,
            device=device,
            calls=calls,
        )
        for label, out, t in (("compiled", compiled, times[0]), ("eager", eager_out, times[1])):
            exact = torch.equal(out.view(torch.int32), theirs.view(torch.int32))
            rows.append(against_torchao(f"`quantize_mx` {name}, {label}", exact, t, times[2]))
    for name in MX_FORMATS:  # the storage form: what quantizing or exporting a model's weights runs
        compile_seconds[f"`pack_mx` {name}"] = first_call_seconds(lambda: pack_mx(x, name), device)
        exact = torch.equal(unpack_mx(pack_mx(x, name)).view(torch.int32), reference(x, name).view(torch.int32))
        times = median_seconds(
            [lambda: pack_mx(x, name), eager(lambda: pack_mx(x, name)), lambda: reference_to_mx(x, name)],
            args.repeats,
            device=device,
            calls=calls,
        )
        for label, t in (("compiled", times[0]), ("eager", times[1])):
            rows.append(against_torchao(f"`pack_mx` {name}, {label} (torchao: `to_mx`)", exact, t, times[2]))
    steps = {}  # both pairs in one interleaved group: they run the same compiled kernel
    for pair in FORMAT_PAIRS:
        endpoint = continuous_step(x, grad, pair, fused_at_endpoint, offset=ENDPOINT)
        compile_seconds[f"continuous {pair}, fused, beta 2"] = first_call_seconds(endpoint, device)
        steps.update(
            {
                f"{pair}, autograd reference, beta 0.5": continuous_step(x, grad, pair, quantize_mx_continuous),
                f"{pair}, fused, beta 0.5 (eager kernel)": continuous_step(x, grad, pair, quantize_mx_continuous_fused),
                f"{pair}, fused, beta 2, compiled": endpoint,
                f"{pair}, fused, beta 2, eager": eager(endpoint),
            }
        )
    for label, t in zip(steps, median_seconds(list(steps.values()), args.repeats, device=device, calls=calls)):
        rows.append((f"continuous {label}, forward+backward", "-", t / n * 1e9, None, None, f"{t / floor:.1f}"))

    header = (
        f"{args.size}x{args.size} float32, torch {torch.__version__}, {device_description(device)}, "
        f"median of {args.repeats} interleaved repeats" + (f" of {calls} calls in a row" if calls > 1 else "") + "\n\n"
        "| operation | bit-exact vs torchao | ours ns/elem | torchao ns/elem | ratio ours/torchao | x copy floor |\n"
        "|---|---|---|---|---|---|"
    )
    lines = [header]
    for label, exact, ours_ns, theirs_ns, ratio, vs_floor in rows:
        theirs = f"{theirs_ns:.3g}" if theirs_ns is not None else "-"
        ratio_s = f"**{ratio:.2f}**" if ratio is not None else "-"
        lines.append(f"| {label} | {exact} | {ours_ns:.3g} | {theirs} | {ratio_s} | {vs_floor} |")
    lines += [
        "",
        "First compiled call (compilation, paid once per format, dtype and device; 0 when compilation is off):",
        "",
        "| kernel | first call s |",
        "|---|---|",
    ]
    lines += [f"| {label} | {seconds:.2f} |" for label, seconds in compile_seconds.items()]
    write_report("\n".join(lines) + "\n", args.output, "MX quantize-dequantize speed")


if __name__ == "__main__":
    main()
