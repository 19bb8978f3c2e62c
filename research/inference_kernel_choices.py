#!/usr/bin/env python
"""Study: how the inference kernels came to be what they are, each timed beside what it replaced.

The online transforms' and the MX casts' compiled kernels were shaped one measured choice at a time
(`optimum_dmx/nn/transforms.py`, `optimum_dmx/formats/cast.py`, `optimum_dmx/formats/compilation.py`). This script
keeps those choices measurable on any machine: each table puts the library's kernel beside the way the same work ran
before it (or the alternative it was chosen over), in one run, on one input. `benchmarks/bench_inference.py` measures
what the product costs; this measures why it is built so.

1. **Online transforms with their MX cast** (1024 rows: 8 x 128 tokens), per call, against the cast alone: for
   32-blocks in float32 the kernel compiled with inductor's default fusion thresholds (the 16 x 16 product split in
   two passes over a buffer as large as the input); in bfloat16 the rounding to bfloat16 on the bit pattern and, for
   a signed transform (the library's: the signs inside one copy of the 16 x 16 factor per run), the signs apart from
   the factor, and besides the sums divided and rounded after they are put together; for
   `hadamard`'s 512-blocks each chunk's values copied into the output, both products, the division and the rounding
   as torch's operations before the cast's kernel, the division and rounding in the cast's kernel and, in float32,
   the transform split into a 64 x 64 product and a Sylvester factor of order 8 across its runs
   (`transforms.kronecker_split` takes 32 and 16).
2. **Per call on one row and on 64** (a generated token, a short prompt; float32, 576 wide): the MX cast's
   `CompiledKernel` (compiled by inductor directly) against the same cast function through `torch.compile` with the
   same options and the rows dynamic, as the kernels ran before.
3. **Compiled element-wise kernels per element** (1024 x 1536 float32): a multiply-add, the same through a bit
   reinterpretation (float32 -> int32 -> float32, which torch 2.13's inductor wrote as scalar loops through memory
   on an Intel Xeon with AMX and vectorised on the AMD EPYCs measured) and the MX cast, whose rounding steps come
   from comparisons instead (`formats.cast.element_steps`).

Times are median CPU times over `--repeats` repeats of 20 calls (wall time of 1000 calls per repeat for the
per-call table), one torch thread by default:

    python research/inference_kernel_choices.py --repeats 7 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_inference import log, table, timed_per_call_rows, timed_transform_rows, transform_inputs  # noqa: E402

from optimum_dmx.formats import get_format, quantize_mx  # noqa: E402
from optimum_dmx.formats.cast import cast_mx_blocks, fused_cast_mx, map_row_chunks  # noqa: E402
from optimum_dmx.formats.compilation import INDUCTOR_OPTIONS, CompiledKernel  # noqa: E402
from optimum_dmx.nn import transforms  # noqa: E402

from common import median_seconds, processor_description  # noqa: E402

CAST = ("mxfp4_e2m1", 32, "ocp")  # the casts' format, block size and scale rule


def rounded_as_before(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 `x` rounded to `dtype` and kept in float32 as the transform kernel did before it used `.to(dtype)`:
    to bfloat16 on the float32 bit pattern (ties to even; infinities and NaNs unchanged)."""
    if dtype != torch.bfloat16:
        return x.to(dtype).float()
    bits = x.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    rounded = (magnitude + (0x7FFF + ((magnitude >> 16) & 1))) & -0x10000  # no overflow: finite magnitudes only
    signed = (rounded | (bits & torch.iinfo(torch.int32).min)).view(torch.float32)
    return torch.where(magnitude < 0x7F800000, signed, x)


def split_64_by_8(power: int, odd: torch.Tensor) -> tuple[int, torch.Tensor]:
    """`transforms.kronecker_split` as it was for blocks of 512 and more: a last factor of order 64 (times the odd
    one), the rest as the Sylvester factor across its runs."""
    return (power // 64).bit_length() - 1, torch.kron(transforms.sylvester_matrix(64), odd.contiguous())


def transform_then_round(
    x: torch.Tensor,
    signs: torch.Tensor | None,
    matrices: torch.Tensor | None,
    pairs: bool,
    last: int,
    norm: float,
    dtype: torch.dtype,
    cast: tuple,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`transforms._transform_kernel` for 32-blocks as it was: the sums and differences put together, then divided
    and rounded to `dtype` (which inductor then computes in each of the MX cast's two loops over the stored sums)."""
    summed = transforms._sum_and_difference(transforms._signed_product_in_order(x, signs, matrices, last), last)
    values, block_output = cast_mx_blocks(rounded_as_before(summed / norm, dtype), *cast, native_cast=False)
    return values.to(dtype), block_output


def rounded_on_the_bits(
    x: torch.Tensor,
    signs: torch.Tensor | None,
    matrices: torch.Tensor | None,
    pairs: bool,
    last: int,
    norm: float,
    dtype: torch.dtype,
    cast: tuple,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`transforms._transform_kernel` for 32-blocks as it was before the rounding became `.to(dtype)`: the division
    and the rounding (`rounded_as_before`) before the sums and differences are put together."""

    def finish(values: torch.Tensor) -> torch.Tensor:
        return rounded_as_before(values / norm, dtype)

    product = transforms._signed_product_in_order(x, signs, matrices, last)
    values, block_output = cast_mx_blocks(
        transforms._sum_and_difference(product, last, finish), *cast, native_cast=False
    )
    return values.to(dtype), block_output


def finish_and_cast(products: torch.Tensor, norm: float, dtype: torch.dtype, cast: tuple) -> torch.Tensor:
    """The division, rounding and MX cast of a transform's products in one kernel: how blocks over 32 ran before
    (the rounding, through scalar bit casts in inductor's code, then computed in each of the cast's loops)."""
    return cast_mx_blocks(rounded_as_before(products / norm, dtype), *cast, native_cast=False)


def rounded_in_the_cast(
    kernel: CompiledKernel, transform: transforms.RandomizedHadamard, x: torch.Tensor, cast: tuple
) -> torch.Tensor:
    """`transform.quantize(x, *cast)` for blocks over 32 as it was: the products, then `kernel` (`finish_and_cast`),
    a chunk of rows at a time."""

    def chunk(rows: torch.Tensor) -> torch.Tensor:
        return kernel(transform._products(rows, torch.float32), float(transform._norm), x.dtype, cast)[0]

    return map_row_chunks(chunk, x.reshape(-1, transform.size), x.dtype).view(x.shape)


def products_then_cast(transform: transforms.RandomizedHadamard, x: torch.Tensor, cast: tuple) -> torch.Tensor:
    """`transform.quantize(x, *cast)` for blocks over 32 as it was before `transforms._sylvester_kernel`: both matrix
    products, the division and the rounding as torch's operations, then the MX cast's kernel, a chunk of rows at a
    time."""

    def chunk(rows: torch.Tensor) -> torch.Tensor:
        return quantize_mx(transform._products(rows, torch.float32).div_(transform._norm).to(x.dtype), *cast)

    return map_row_chunks(chunk, x.reshape(-1, transform.size), x.dtype).view(x.shape)


def chunks_copied(transform: transforms.RandomizedHadamard, x: torch.Tensor, cast: tuple) -> torch.Tensor:
    """`transform.quantize(x, *cast)` for blocks over 32 as it was before `transforms._sylvester_kernel` wrote into the
    output: each chunk of rows transformed into a tensor of its own, then copied into the output."""

    def chunk(rows: torch.Tensor) -> torch.Tensor:
        values = torch.empty(rows.shape, dtype=x.dtype)
        transform._sylvester_kernel_into(rows, values, cast)
        return values

    return map_row_chunks(chunk, x.reshape(-1, transform.size), x.dtype).view(x.shape)


def signs_apart(transform: transforms.RandomizedHadamard, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`RandomizedHadamard._kernel_factor` as it is for float32 rows: the signs apart from the last factor."""
    signs, last, _ = transform._factors_as(rows.device, torch.float32)
    return signs, last.view(-1)


def transform_choices(repeats: int, tokens: int = 1024) -> list[list[str]]:
    """Rows of the first table: per dtype and input, the cast alone, the library's transform with its cast, then
    each earlier or rejected way of computing the same values."""
    fmt, block_size, scale_rule = get_format(CAST[0]), *CAST[1:]
    cast = (fmt, block_size, scale_rule)
    kernel = transforms._transform_kernel
    options = {key: value for key, value in kernel.options.items() if not key.startswith("realize_")}
    default_thresholds = CompiledKernel(kernel.fn, options=options)
    rounded_after = CompiledKernel(transform_then_round, options=kernel.options)
    on_the_bits = CompiledKernel(rounded_on_the_bits, options=kernel.options)
    finished_in_the_cast = CompiledKernel(finish_and_cast, options=kernel.options)
    table = []
    for x, block, transform, signed in transform_inputs(tokens):
        dtype, width = x.dtype, x.shape[-1]

        def with_kernel(
            replacement: CompiledKernel,
            factor: Callable | None = None,
            on: transforms.RandomizedHadamard = transform,
            x: torch.Tensor = x,
        ) -> Callable[[], None]:
            def call() -> None:
                with contextlib.ExitStack() as patches:
                    patches.enter_context(mock.patch.object(transforms, "_transform_kernel", replacement))
                    if factor is not None:
                        patches.enter_context(mock.patch.object(on, "_kernel_factor", factor))
                    on.quantize(x, *cast)

            return call

        candidates = {
            "MX cast alone (quantize_mx)": functools.partial(quantize_mx, x, fmt),
            "transform and cast (the library's)": functools.partial(transform.quantize, x, *cast),
        }
        if block == 32 and dtype == torch.float32:
            candidates["inductor's default fusion thresholds"] = with_kernel(default_thresholds)
        elif block == 32:
            apart = functools.partial(signs_apart, signed)
            candidates["rounded to bfloat16 on the bit pattern"] = with_kernel(on_the_bits)
            candidates["signed (the library's: the signs inside copies of the factor)"] = functools.partial(
                signed.quantize, x, *cast
            )
            candidates["signed, signs apart from the factor"] = with_kernel(kernel, apart, signed)
            candidates["signed, signs apart, sums rounded after they are put together"] = with_kernel(
                rounded_after, apart, signed
            )
        else:
            candidates["each chunk's values copied into the output"] = functools.partial(
                chunks_copied, transform, x, cast
            )
            candidates["the product across runs as torch's, then the cast's kernel"] = functools.partial(
                products_then_cast, transform, x, cast
            )
            candidates["division and rounding in the cast's kernel"] = functools.partial(
                rounded_in_the_cast, finished_in_the_cast, transform, x, cast
            )
        if block > 32 and dtype == torch.float32:
            with mock.patch.object(transforms, "kronecker_split", split_64_by_8):
                split_before = transforms.RandomizedHadamard(width, block, seed=0, signed=False)
            candidates["64 x 64 product then order 8"] = functools.partial(split_before.quantize, x, *cast)
        table += timed_transform_rows(candidates, x, block, repeats)
    return table


def per_call_choices(repeats: int, calls: int = 1000) -> list[list[str]]:
    """Rows of the second table: the cast's `CompiledKernel` call against the same function through `torch.compile`
    (rows marked dynamic beyond one), on one row and on 64."""
    fmt = get_format(CAST[0])
    through_torch_compile = torch.compile(fused_cast_mx.fn, options=INDUCTOR_OPTIONS)

    def cast_through_torch_compile(rows: torch.Tensor) -> None:
        if rows.shape[0] > 1:
            torch._dynamo.mark_dynamic(rows, 0)
        through_torch_compile(rows, fmt, *CAST[1:])

    table = []
    for count in (1, 64):
        rows = torch.randn(count, 576, generator=torch.Generator().manual_seed(0))
        candidates = {
            "the cast through torch.compile": functools.partial(cast_through_torch_compile, rows),
            "CompiledKernel call (the library's)": functools.partial(fused_cast_mx, rows, fmt, *CAST[1:]),
        }
        table += timed_per_call_rows(candidates, count, repeats, calls)
    return table


def multiply_add(x: torch.Tensor) -> torch.Tensor:
    """The plainest element-wise kernel: what the third table measures the others against."""
    return x * 2 + 1


def multiply_add_on_the_bits(x: torch.Tensor) -> torch.Tensor:
    """`multiply_add` of `abs(x)` taken on the float32 bit pattern, as the MX casts once read exponents and rounded:
    the pattern viewed as int32 and back."""
    return (x.view(torch.int32) & 0x7FFFFFFF).view(torch.float32) * 2 + 1


def bit_pattern_choices(repeats: int, tokens: int = 1024, width: int = 1536) -> list[list[str]]:
    """Rows of the third table: nanoseconds per element of a multiply-add, the same on the bit pattern, and the
    MX cast, compiled, on a `tokens` x `width` float32 input."""
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0))
    fmt = get_format(CAST[0])
    plain, on_the_bits = CompiledKernel(multiply_add), CompiledKernel(multiply_add_on_the_bits)
    candidates = {
        "x * 2 + 1": functools.partial(plain, x),
        "abs(x) * 2 + 1, abs(x) taken on the bit pattern (float32 -> int32 -> float32)": functools.partial(
            on_the_bits, x
        ),
        "MX cast (quantize_mx, float32)": functools.partial(quantize_mx, x, fmt),
    }
    with torch.inference_mode():
        seconds = median_seconds(list(candidates.values()), repeats, time.process_time, calls=20)
    table = []
    for name, per_call in zip(candidates, seconds):
        log(f"{name}: {per_call / x.numel() * 1e9:.2f} ns per element")
        table.append(
            [f"{tokens} x {width}", name, f"{per_call / x.numel() * 1e9:.2f}", f"{per_call / seconds[0]:.2f}x"]
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU time is summed over them)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    print(
        f"Machine: {processor_description()}, {args.threads} torch threads, torch {torch.__version__}; median of "
        f"{args.repeats} repeats\n"
    )
    print("### Online transforms with their MX cast, per call (CPU time in ms, 20 calls a repeat)")
    print(
        table(["input", "dtype", "block", "call", "ms per call", "x the cast alone"], transform_choices(args.repeats))
    )
    print("\n### The cast per call: one row (a generated token) and 64 (a short prompt), wall time in us")
    print(table(["rows", "call", "us per call", "x torch.compile"], per_call_choices(args.repeats)))
    print("\n### Compiled element-wise kernels, CPU time per element (20 calls a repeat)")
    print(table(["input", "kernel", "ns per element", "x the multiply-add"], bit_pattern_choices(args.repeats)))


if __name__ == "__main__":
    main()
