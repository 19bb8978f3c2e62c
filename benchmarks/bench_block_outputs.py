"""What the compiled kernels' block outputs buy: each kernel with and without its per-block tensors as outputs.

Every compiled MX kernel (``optimum_dmx.formats.compilation``) returns, beside its results, the per-block tensors
its elements are scaled by (the cast's shared exponents, the continuous quantizer's and unpacking's block scales),
which the library's callers drop. As a kernel output, inductor computes a block's scale once, vectorised across
blocks, and stores it; dropped inside the compiled function (``[:-1]`` before the kernel returns, the variant here
called "without"), it becomes an intermediate that inductor inlines into every vector of elements that reads it,
recomputing its scalar arithmetic each time. Both variants are the same function, so their results are checked
bit for bit; they run alternately in one process, on tensors the size of a SmolLM2-135M calibration batch's
activations (4 x 128 tokens x 576 and x 1536 features, which fit in cache) and on a 4096 x 4096 tensor (memory
bound).

    python benchmarks/bench_block_outputs.py [--repeats 7] [--threads 1] [--output results/block_outputs.md]
"""

from __future__ import annotations

import platform
from functools import partial

import torch

from optimum_dmx.continuous.fused import _format_parameters, _gradients_kernel, _values_kernel
from optimum_dmx.continuous.pairs import get_format_pair
from optimum_dmx.formats import get_format, pack_mx
from optimum_dmx.formats.cast import fused_cast_mx
from optimum_dmx.formats.compilation import CompiledKernel, _same_bits
from optimum_dmx.formats.packing import code_values, fused_dequantize

from common import kernel_benchmark_parser, median_seconds, write_report

SHAPES = ((512, 576), (512, 1536), (4096, 4096))


# Each kernel returns its block output last: these return the rest.
def cast_without_block_outputs(*args):
    return fused_cast_mx.fn(*args)[:-1]


def values_without_block_outputs(*args):
    return _values_kernel.fn(*args)[:-1]


def gradients_without_block_outputs(*args):
    return _gradients_kernel.fn(*args)[:-1]


def dequantize_without_block_outputs(*args):
    return fused_dequantize.fn(*args)[:-1]


WITHOUT = {
    fused_cast_mx: CompiledKernel(cast_without_block_outputs),
    _values_kernel: CompiledKernel(values_without_block_outputs),
    _gradients_kernel: CompiledKernel(gradients_without_block_outputs),
    fused_dequantize: CompiledKernel(dequantize_without_block_outputs),
}


def kernel_calls(x: torch.Tensor) -> dict[str, tuple[CompiledKernel, tuple]]:
    """Each kernel with the arguments the library passes it for ``x`` (rows of whole blocks)."""
    calls = {}
    for name in ("mxfp4_e2m1", "mxfp8_e4m3"):
        calls[f"cast {name}"] = (fused_cast_mx, (x, get_format(name), 32, "ocp"))
    for pair in ("mxfp8-mxfp4", "mxfp6-mxfp4"):
        p = _format_parameters(get_format_pair(pair), 2.0, "ocp", x.device)
        grid = (p.m, p.e_min, p.qmax, p.scale_offset, p.rounding_bits)
        calls[f"continuous {pair} beta 2, values"] = (_values_kernel, (x, None, *grid, 32))
        calls[f"continuous {pair} beta 2, dL/dx and dL/dbeta's block sums"] = (
            _gradients_kernel, (x, torch.ones_like(x), None, *grid, p.de, p.dm, p.dqmax, 32, True, True))
    for name, dtype in (("mxfp4_e2m1", torch.bfloat16), ("mxfp8_e4m3", torch.float32)):
        packed = pack_mx(x, name)
        table = code_values(packed.fmt)
        calls[f"unpack {name} to {str(dtype).removeprefix('torch.')}"] = (
            fused_dequantize, (packed.codes, packed.scales, table, packed.fmt.bits, 32, x.shape[-1], dtype))
    return calls


def main() -> None:
    parser = kernel_benchmark_parser(__doc__)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    for shape in SHAPES:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        n = x.numel()
        for label, (kernel, arguments) in kernel_calls(x).items():
            with_outputs, without = partial(kernel, *arguments), partial(WITHOUT[kernel], *arguments)
            exact = _same_bits(with_outputs()[:-1], without())
            t_with, t_without = median_seconds([with_outputs, without], args.repeats)
            rows.append((label, shape, "yes" if exact else "NO", t_with / n * 1e9, t_without / n * 1e9))

    lines = [
        f"float32 inputs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, median of {args.repeats} alternated repeats; "
        "ns per element\n",
        "| kernel | shape | same bits | with block outputs | without | with / without |",
        "|---|---|---|---|---|---|",
    ]
    for label, shape, exact, t_with, t_without in rows:
        lines.append(f"| {label} | {shape[0]} x {shape[1]} | {exact} | {t_with:.2f} | {t_without:.2f} | "
                     f"**{t_with / t_without:.2f}** |")
    write_report("\n".join(lines) + "\n", args.output, "Compiled kernels with and without block outputs")


if __name__ == "__main__":
    main()
