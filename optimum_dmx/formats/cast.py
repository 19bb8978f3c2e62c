"""Exact MX quantize-dequantize (OCP Microscaling v1.0).

Each element ``x / X`` of a block is rounded to the element format (round-half-to-even, IEEE-style
subnormals) and saturated to the format's largest normal. An all-zero block stays zero; a block that holds a
NaN or an Inf becomes all NaN. A last dimension that is not a multiple of the block size is zero-padded
inside the last block. Every step is exact, so the result is bit-identical to a reference implementation of
the specification.

Two ways of rounding give the same bits: a native float8 cast (fast eagerly, but it needs one host-side check of
the largest scale) and rounding in float32 arithmetic, each element's step found by comparisons (``element_steps``;
no host synchronisation, so inductor fuses the whole cast into one kernel: ``compilation``). ``quantize_mx`` runs
the compiled kernel, which reads and writes the activation's dtype, when compilation is on and no gradient is
wanted, else the eager cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .blocks import (
    block_max,
    block_max_exponent,
    block_scale,
    from_blocks,
    pow2,
    shared_exponent,
    to_blocks,
    validate_input,
)
from .compilation import CompiledKernel
from .spec import (
    SCALE_EXPONENT_MAX,
    SCALE_EXPONENT_MIN,
    MXFormat,
    get_format,
    scale_rounding_bits,
    validate_block_size,
    validate_scale_rule,
)


def float8_carrier(fmt: MXFormat) -> tuple[torch.dtype, int] | None:
    """A native float8 dtype that rounds exactly like ``fmt`` once values are scaled by ``2^-shift``.

    A float8 type with the same mantissa width rounds identically (half to even, subnormals included) when
    its smallest normal is aligned with ``fmt``'s, which a power-of-two shift does: E4M3 carries MXFP8 E4M3
    (shift 0) and MXFP6 E2M3 (shift 6), E5M2 carries MXFP6 E3M2 (shift 12). E2M1 has no float8 carrier.
    """
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        info = torch.finfo(dtype)
        if round(-math.log2(info.eps)) == fmt.mbits:
            shift = fmt.emin - round(math.log2(info.smallest_normal))
            if fmt.max_normal * 2.0**-shift <= info.max:
                return dtype, shift
    return None


# Binades above the smallest normal one up to which `element_steps` compares each element with every boundary in turn;
# for more (E4M3's 14, E3M2's 6) a binary search over them takes fewer operations.
CHAINED_BINADES = 4


def element_steps(v: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """The rounding step ``2^eta`` of block-scaled float32 elements (``spec.grid_exponent``): ``2^(e - m)`` for
    ``|v|`` in the binade ``[2^e, 2^(e+1))`` of the format's normal range, ``2^(emin - m)`` below it.

    Found by comparing ``|v|`` with powers of two, not read from the float32 exponent field as ``floor_log2`` does:
    a compiled kernel then runs on vectors of floats, where torch 2.13's inductor wrote each float32 <-> int32 bit
    reinterpretation as a scalar loop through memory on an Intel Xeon with AMX (one such round trip per element cost
    more than the whole cast; the AMD EPYCs measured vectorised it: `research/inference_kernel_choices.py`, "Compiled
    element-wise kernels", and `benchmarks/results/inference*.md`). Scaled elements lie below
    ``2^(emax+1)`` (finite blocks), so the largest binade is
    ``emax``'s; larger values (in a NaN or Inf block, or GPTQ's unscaled ones) get a step that still saturates them.
    """
    return _binade_search(v.abs(), fmt, count_binades=False)[0]


def element_binades(v: torch.Tensor, fmt: MXFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``element_steps`` and each element's binade above the format's smallest normal one, as float32 integers (0
    there and below it, in the subnormal range), found by the same comparisons: an element on the grid has the
    magnitude code ``binade * 2^m + |v| / step`` (``packing.element_codes``)."""
    return _binade_search(v.abs(), fmt, count_binades=True)


def _binade_search(
    magnitude: torch.Tensor, fmt: MXFormat, count_binades: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each magnitude's rounding step and, if ``count_binades``, its binade above ``emin`` (else None)."""
    step = torch.full_like(magnitude, 2.0**fmt.step_exponent_min)
    binade = torch.zeros_like(magnitude) if count_binades else None
    binades = fmt.emax - fmt.emin
    if binades <= CHAINED_BINADES:
        for e in range(fmt.emin + 1, fmt.emax + 1):
            above = magnitude >= 2.0**e
            step = torch.where(above, 2.0 ** (e - fmt.mbits), step)
            if count_binades:
                binade = torch.where(above, float(e - fmt.emin), binade)
        return step, binade
    # The offset of floor(log2 |v|) above emin, one bit at a time from the highest: |v| scaled down past each bit set.
    scaled = magnitude * 2.0**-fmt.emin
    bit = 1 << (binades.bit_length() - 1)
    while bit:
        above = scaled >= 2.0**bit
        scaled = torch.where(above, scaled * 2.0**-bit, scaled)
        step = torch.where(above, step * 2.0**bit, step)
        if count_binades:
            binade = torch.where(above, binade + bit, binade)
        bit >>= 1
    return step, binade


def round_elements(v: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Round block-scaled float32 elements to ``fmt`` in place: RNE on the element grid, then saturate."""
    step = element_steps(v, fmt)
    return v.div_(step).round_().mul_(step).clamp_(-fmt.max_normal, fmt.max_normal)


def block_exponents(blocks: torch.Tensor, fmt: MXFormat, scale_rule: str = "ocp") -> torch.Tensor:
    """The shared exponents ``k`` (int32, ``[..., n_blocks, 1]``) that ``scale_rule`` gives ``fmt``'s blocks."""
    rounding_bits = scale_rounding_bits(scale_rule, fmt.ebits, fmt.mbits)
    return shared_exponent(*block_max_exponent(block_max(blocks), rounding_bits), fmt.emax)


def quantize_blocks(
    blocks: torch.Tensor, fmt: MXFormat, scale_rule: str = "ocp", native_cast: bool = True
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Round blocks to ``fmt``: elements in units of ``2^shift``, shared exponents ``k``, and ``shift``.

    The value of an element is ``elements * 2^(k + shift)``. With ``native_cast`` and a float8 carrier
    (``shift`` may be non-zero) the rounding is one native cast; otherwise it is done in float32 arithmetic
    (``round_elements``, ``shift`` 0), which never synchronises with the host.
    """
    k = block_exponents(blocks, fmt, scale_rule)
    carrier = float8_carrier(fmt) if native_cast else None
    if carrier is not None:
        # The carrier's output scale 2^(k + shift) must stay a finite float32: true unless amax >= ~2^120. NaN
        # blocks (k = 128) do not count: they get their NaN from their scale at the end.
        largest_k = int(k.masked_fill(k > SCALE_EXPONENT_MAX, SCALE_EXPONENT_MIN).max())
        if largest_k + carrier[1] <= SCALE_EXPONENT_MAX:
            dtype, shift = carrier
            bound = fmt.max_normal * 2.0**-shift
            scaled = blocks * block_scale(-k.clamp(max=SCALE_EXPONENT_MAX), -shift)
            rounded = scaled.clamp_(-bound, bound).to(dtype)
            return scaled.copy_(rounded), k, shift  # reuse the float32 buffer: cheaper than a new allocation
    # Every finite block has k <= 126 (emax >= 2; a rounding scale rule may add one), so 1 / 2^k is a normal
    # float32; the clamp only tames NaN blocks.
    return round_elements(blocks * pow2(-k.clamp(max=SCALE_EXPONENT_MAX - 1)), fmt), k, 0


def cast_mx_blocks(
    x: torch.Tensor, fmt: MXFormat, block_size: int, scale_rule: str, native_cast: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_mx`` without argument checks (blocks, rounding by ``quantize_blocks``, rescaling), and the
    blocks' shared exponents."""
    elements, k, shift = quantize_blocks(to_blocks(x, block_size), fmt, scale_rule, native_cast)
    return from_blocks(elements.mul_(block_scale(k, shift)), x.shape).to(x.dtype), k


def cast_mx(x: torch.Tensor, fmt: MXFormat, block_size: int, scale_rule: str, native_cast: bool = True) -> torch.Tensor:
    """``quantize_mx`` without argument checks: ``cast_mx_blocks``' values."""
    return cast_mx_blocks(x, fmt, block_size, scale_rule, native_cast)[0]


@CompiledKernel
def fused_cast_mx(
    x: torch.Tensor, fmt: MXFormat, block_size: int, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cast_mx_blocks`` rounding in float32 arithmetic, compiled into one kernel (``compilation``); same bits. The
    shared exponents are a block output (``compilation``): callers drop them."""
    return cast_mx_blocks(x, fmt, block_size, scale_rule, native_cast=False)


def quantize_mx(x: torch.Tensor, fmt: str | MXFormat, block_size: int = 32, scale_rule: str = "ocp") -> torch.Tensor:
    """Quantize-dequantize ``x`` to an MX format along its last dimension.

    Args:
        x: float32, bfloat16 or float16 tensor of any shape; blocks run along the last dimension.
        fmt: an ``MXFormat`` or one of the names in ``MX_FORMATS`` (aliases ``mxfp8``, ``mxfp6``, ``mxfp4``).
        block_size: elements per shared scale (32 in the OCP specification).
        scale_rule: how the block scale follows the block maximum: ``"ocp"`` (the specification's floor),
            ``"compressed-tensors"`` or ``"quark"`` (those loaders' rounding, see ``formats.spec.SCALE_RULES``).

    Returns:
        A tensor of the same shape and dtype holding the MX-representable values.
    """
    fmt = get_format(fmt)
    block_size = validate_block_size(block_size)
    validate_scale_rule(scale_rule)
    validate_input(x)
    if compiles(x.shape[-1], block_size) and not (x.requires_grad and torch.is_grad_enabled()):
        # As a matrix of rows: one kernel serves every number of rows (tokens) of a width. It reads and writes
        # x's dtype and computes in float32 registers, so it allocates nothing but its output.
        return fused_cast_mx(x.reshape(-1, x.shape[-1]), fmt, block_size, scale_rule)[0].view(x.shape)
    # Traced by an outer `torch.compile`: the arithmetic rounding, whose graph has no host synchronisation to break.
    return cast_mx(x, fmt, block_size, scale_rule, native_cast=not torch.compiler.is_compiling())


# Rows per call of `map_row_chunks`' and `fill_row_chunks`' functions: at most this many elements (1 MiB of float32).
ROW_CHUNK_ELEMENTS = 2**18


def map_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fn(rows).to(dtype)`` for a row-wise ``fn`` that makes float32 temporaries as large as its input (an online
    transform's matrix products before its MX cast); on a CPU a chunk of rows at a time, into one output.

    On a CPU, glibc's allocator can hand temporaries of several MiB back to the system when they are freed, so that
    every call gets fresh pages, each faulted in and zeroed by the kernel: on SmolLM2-135M in bfloat16 at 8 x 128
    tokens, in a process holding only the quantized model, its forward took 1.25x as long with each activation's
    float32 copy made in one call as in chunks (`benchmarks/results/inference_processes.md` at `e84736a`, when the
    casts made such copies; whether it happens depends on what the process allocated before). Chunks of
    ``ROW_CHUNK_ELEMENTS`` keep the temporaries small enough to be reused (and in cache); each chunk's result is
    copied into the output (`fill_row_chunks` saves that copy for a function that can write there itself). On a GPU
    (a caching allocator) ``fn`` runs on all rows at once.
    """
    if rows.device.type != "cpu" or len(rows) <= _chunk_rows(rows):
        return fn(rows).to(dtype)
    return fill_row_chunks(lambda chunk, out: out.copy_(fn(chunk)), rows, dtype)


def fill_row_chunks(
    fill: Callable[[torch.Tensor, torch.Tensor], object], rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A new tensor of ``rows``' shape in ``dtype``, written by ``fill(chunk, out)``, which writes the result for a
    chunk of rows (``ROW_CHUNK_ELEMENTS`` elements at most: `map_row_chunks`) into ``out``, the output's same rows:
    a compiled kernel that stores its values there (`formats.compilation.CompiledKernel`'s ``writes_into``) saves
    the copy of a returned result (`hadamard`'s 512-block transform with its MX cast of a 1024 x 1536 float32 input,
    SmolLM2's `down_proj` at 8 x 128: 3.62 against 4.36 ms on a Xeon without bfloat16 instructions,
    `benchmarks/results/inference_xeon_avx512.md`, "Online transforms")."""
    out = torch.empty(rows.shape, dtype=dtype, device=rows.device)
    chunk_rows = _chunk_rows(rows)
    for start in range(0, len(rows), chunk_rows):
        fill(rows[start : start + chunk_rows], out[start : start + chunk_rows])
    return out


def _chunk_rows(rows: torch.Tensor) -> int:
    return max(1, ROW_CHUNK_ELEMENTS // max(1, rows.shape[-1]))


def compiles(width: int, block_size: int) -> bool:
    """Whether rows of ``width`` elements run a compiled kernel (the cast, the continuous quantizer, packing and
    unpacking): compilation is on and the rows are whole blocks.

    (Rows with a padded or cut last block run eagerly. Inductor (torch 2.13, C++ backend) miscompiles the cut last
    block of a bfloat16 or float16 unpacking; the cast and the continuous quantizer compile such rows correctly
    (checked in every dtype), but model widths are multiples of 32, so only toy models pad, and for their small
    tensors a compilation costs seconds that the kernel never wins back.)
    """
    return fused_cast_mx.active and width % block_size == 0
