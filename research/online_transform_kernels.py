#!/usr/bin/env python
"""Study: what would hand-written kernels make of the 32-block online transform's cost at inference?

Issue 39 asks every rotation to cost at most 5% over the unrotated dMX forward on the CPU inference benchmark. In
bfloat16 on an AMX Xeon, `online_block_hadamard` costs +12-13% (`benchmarks/results/inference.md`): its transform runs
in the MX cast's compiled kernel (`nn.transforms`), a 16 x 16 product whose products are added in the order of the
factor's rows, then one sum and one difference, the division by sqrt(32) and the rounding to bfloat16. Is that
inductor's code, which a hand-written kernel could beat, or the arithmetic itself?

Kernels in C with AVX-512 intrinsics (compiled here with the system's C compiler, run through ctypes, one thread),
on rows of bfloat16, each 32-block transformed as the library transforms it:

* `copy`: load and store, nothing else (the memory traffic a transform fused into the cast would not add);
* `sequential transform`: the signs, the 16 x 16 +-1 product with its products added in the factor's row order (one
  multiply-add per product, exact with +-1 entries), the sum and difference, the division, the rounding: the
  library's order, so the library's bits (checked);
* `butterfly transform`: the same transform as a fast Walsh-Hadamard transform (four in-register stages of sums and
  differences, then the sum and difference across the halves): a few operations per element instead of 16, its
  sums in another order (so not always the library's bits: counted, on random inputs and on SmolLM2's own);
* `MX cast alone`: the library's MX cast (`formats.cast`), two blocks at a time; its bits checked equal to the
  library's for every format and scale rule, with zero, NaN and Inf blocks;
* `butterfly transform and MX cast`: both in one pass, nothing stored between (checked: the library's cast of the
  butterfly's transform).

Timed against the library's compiled transform alone and with its MX cast, and its cast alone (MXFP8 E4M3, the OCP
scale rule), first per element on 1024 random rows of SmolLM2-135M's two transformed widths, then on the model's own
inputs: `benchmarks/bench_inference.py`'s dMX model of SmolLM2-135M and the same map rotated `online_block_hadamard`,
in bfloat16, their forward passes on 1 x 512 tokens timed in turn, then every call above on each input the rotated
model's online transforms read in one such pass, summed. What the transform adds to the forward pass: the library's
transform-and-cast kernel less its cast alone; a transform alone in C less the copy (a bound for one fused into a
cast); the fused C kernel less the C cast alone, against the forward with the C cast in place of the library's.
The butterfly's bits are compared with the library's on random rows of wider and wider ranges and on the rotated
model's inputs over held-out text.

    python research/online_transform_kernels.py --threads 1

Needs an x86-64 CPU with AVX-512 F/BW and a C compiler (`cc`).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_inference import save_dmx_models  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from optimum_dmx.formats.cast import quantize_mx  # noqa: E402
from optimum_dmx.formats.spec import MX_FORMATS, SCALE_RULES, MXFormat, get_format, scale_rounding_bits  # noqa: E402
from optimum_dmx.nn.mx_linear import MXLinear  # noqa: E402
from optimum_dmx.nn.transforms import RandomizedHadamard  # noqa: E402
from optimum_dmx.text import start_tokens, text_tokens, token_windows  # noqa: E402

from common import benchmark_model, benchmark_texts, median_seconds, processor_description  # noqa: E402

KERNELS_C = r"""
#include <immintrin.h>
#include <stdint.h>

static inline __m512 load_bf16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Round to nearest even on the bit pattern, as torch's conversion to bfloat16 (every NaN to 0x7fc0). */
static inline void store_bf16(uint16_t *p, __m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

static inline __m512 signed_run(const uint16_t *x, const uint32_t *sign_bits) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(load_bf16(x)), _mm512_loadu_si512(sign_bits)));
}

static inline void store_halves(uint16_t *o, __m512 first, __m512 second, __m512 norm) {
  store_bf16(o, _mm512_div_ps(_mm512_add_ps(first, second), norm));
  store_bf16(o + 16, _mm512_div_ps(_mm512_sub_ps(first, second), norm));
}

void copy_bf16(const uint16_t *x, uint16_t *out, int64_t count) {
  for (int64_t i = 0; i < count; i += 32)
    _mm512_storeu_si512(out + i, _mm512_loadu_si512(x + i));
}

/* factor: the 16 x 16 +-1 matrix, row-major; products added in its row order, as the library adds them. */
void sequential_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width, const uint32_t *sign_bits,
                     const float *factor, float norm) {
  __m512 rows_of_factor[16];
  for (int k = 0; k < 16; ++k) rows_of_factor[k] = _mm512_loadu_ps(factor + 16 * k);
  __m512 vnorm = _mm512_set1_ps(norm);
  float run[32] __attribute__((aligned(64)));
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t *xr = x + r * width;
    for (int64_t b = 0; b < width; b += 32) {
      _mm512_store_ps(run, signed_run(xr + b, sign_bits + b));
      _mm512_store_ps(run + 16, signed_run(xr + b + 16, sign_bits + b + 16));
      __m512 first = _mm512_mul_ps(_mm512_set1_ps(run[0]), rows_of_factor[0]);
      __m512 second = _mm512_mul_ps(_mm512_set1_ps(run[16]), rows_of_factor[0]);
      for (int k = 1; k < 16; ++k) {
        first = _mm512_fmadd_ps(_mm512_set1_ps(run[k]), rows_of_factor[k], first);
        second = _mm512_fmadd_ps(_mm512_set1_ps(run[16 + k]), rows_of_factor[k], second);
      }
      store_halves(out + r * width + b, first, second, vnorm);
    }
  }
}

/* The four in-register stages' lane permutations (lane i's partner i ^ d) and masks (the lanes with bit d set). */
static void butterfly_lanes(__m512i partner[4], __mmask16 upper[4]) {
  for (int s = 0; s < 4; ++s) {
    int32_t lanes[16];
    upper[s] = 0;
    for (int i = 0; i < 16; ++i) {
      lanes[i] = i ^ (1 << s);
      if (i & (1 << s)) upper[s] |= (__mmask16)(1 << i);
    }
    partner[s] = _mm512_loadu_si512(lanes);
  }
}

/* One butterfly stage at distance d: lane i becomes x[i] + x[i ^ d] without bit d, x[i ^ d] - x[i] with it. */
static inline __m512 butterfly_stage(__m512 x, __m512i partner, __mmask16 upper) {
  __m512 p = _mm512_permutexvar_ps(partner, x);
  return _mm512_mask_sub_ps(_mm512_add_ps(x, p), upper, p, x);
}

void butterfly_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width, const uint32_t *sign_bits,
                    float norm) {
  __m512i partner[4];
  __mmask16 upper[4];
  butterfly_lanes(partner, upper);
  __m512 vnorm = _mm512_set1_ps(norm);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t *xr = x + r * width;
    for (int64_t b = 0; b < width; b += 32) {
      __m512 first = signed_run(xr + b, sign_bits + b), second = signed_run(xr + b + 16, sign_bits + b + 16);
      for (int s = 0; s < 4; ++s) {
        first = butterfly_stage(first, partner[s], upper[s]);
        second = butterfly_stage(second, partner[s], upper[s]);
      }
      store_halves(out + r * width + b, first, second, vnorm);
    }
  }
}

/* The MX cast of one 32-block held as two vectors of bfloat16 values (in float32), as `formats.cast` computes it:
   k = clamp(floor(log2 amax) (+1 where a scale rule rounds amax up) - emax, -127, 127), NaN for a block with a NaN
   or an Inf; each element times 2^-k, rounded half to even on its binade's step 2^(clamp(floor(log2|v|), emin,
   emax) - m), saturated, times 2^k, rounded to bfloat16. */
typedef struct {
  float emin, emax_element, mbits, max_normal;
  int emax, rounding_bits;
  uint32_t rounds_up_from;
} mx_format;

static inline float exact_pow2(int e) { /* 2^e for e in [-127, 127] from its bit pattern, subnormal at -127 */
  uint32_t bits = e < -126 ? 0x00400000u : (uint32_t)(e + 127) << 23;
  float value;
  __builtin_memcpy(&value, &bits, 4);
  return value;
}

static inline __m512 round_elements(__m512 v, const mx_format *f) {
  __m512 binade = _mm512_max_ps(_mm512_getexp_ps(v), _mm512_set1_ps(f->emin));
  binade = _mm512_min_ps(binade, _mm512_set1_ps(f->emax_element));
  __m512 step = _mm512_sub_ps(binade, _mm512_set1_ps(f->mbits)); /* the exponent of the element's step */
  __m512 scaled = _mm512_scalef_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), step));
  __m512 units = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 q = _mm512_scalef_ps(units, step);
  __m512 bound = _mm512_set1_ps(f->max_normal);
  return _mm512_min_ps(_mm512_max_ps(q, _mm512_sub_ps(_mm512_setzero_ps(), bound)), bound);
}

/* A block's maximum magnitude and whether it is finite (no NaN, no Inf among its two halves). */
static inline float block_max(__m512 first, __m512 second, int *finite) {
  __mmask16 ordered = _mm512_cmp_ps_mask(first, first, _CMP_ORD_Q) & _mm512_cmp_ps_mask(second, second, _CMP_ORD_Q);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
  *finite = ordered == 0xffff && amax != __builtin_inff();
  return amax;
}

/* The block's scale 2^k (NaN for a block that is not finite) and the 2^-k its elements are multiplied by. */
static inline void block_scales(float amax, int finite, const mx_format *f, __m512 *down, __m512 *up) {
  uint32_t bits;
  __builtin_memcpy(&bits, &amax, 4);
  int exponent = (int)((bits >> 23) & 0xff) - 127;
  if (f->rounding_bits >= 0 && (bits & 0x7fffff) >= f->rounds_up_from) exponent += 1; /* 1.f >= 2 - 2^-(r+1) */
  int k = exponent - f->emax;
  k = k < -127 ? -127 : (k > 127 ? 127 : k);
  *down = _mm512_set1_ps(exact_pow2(-(k > 126 ? 126 : k)));
  *up = _mm512_set1_ps(finite ? exact_pow2(k) : __builtin_nanf(""));
}

static inline void cast_half(uint16_t *o, __m512 half, __m512 down, __m512 up, const mx_format *f) {
  store_bf16(o, _mm512_mul_ps(round_elements(_mm512_mul_ps(half, down), f), up));
}

static inline void cast_block(uint16_t *o, __m512 first, __m512 second, const mx_format *f) {
  int finite;
  float amax = block_max(first, second, &finite);
  __m512 down, up;
  block_scales(amax, finite, f, &down, &up);
  cast_half(o, first, down, up, f);
  cast_half(o + 16, second, down, up, f);
}

/* Two blocks at a time: each block's scale waits on its maximum and its elements on the scale, and the two blocks'
   chains interleave (about a fifth faster than one block at a time here). */
static inline void cast_two_blocks(uint16_t *o, __m512 a0, __m512 a1, __m512 b0, __m512 b1, const mx_format *f) {
  int finite_a, finite_b;
  float amax_a = block_max(a0, a1, &finite_a), amax_b = block_max(b0, b1, &finite_b);
  __m512 down_a, up_a, down_b, up_b;
  block_scales(amax_a, finite_a, f, &down_a, &up_a);
  block_scales(amax_b, finite_b, f, &down_b, &up_b);
  cast_half(o, a0, down_a, up_a, f);
  cast_half(o + 16, a1, down_a, up_a, f);
  cast_half(o + 32, b0, down_b, up_b, f);
  cast_half(o + 48, b1, down_b, up_b, f);
}

/* Round to bfloat16 and back to float32 (nearest even), as the library rounds the transform before its cast. */
static inline __m512 to_bf16_and_back(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
  r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, v);
}

void cast_bf16(const uint16_t *x, uint16_t *out, int64_t count, const mx_format *f) {
  int64_t b = 0;
  for (; b + 64 <= count; b += 64)
    cast_two_blocks(out + b, load_bf16(x + b), load_bf16(x + b + 16), load_bf16(x + b + 32), load_bf16(x + b + 48), f);
  for (; b < count; b += 32) cast_block(out + b, load_bf16(x + b), load_bf16(x + b + 16), f);
}

void butterfly_cast_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width, const uint32_t *sign_bits,
                         float norm, const mx_format *f) {
  __m512i partner[4];
  __mmask16 upper[4];
  butterfly_lanes(partner, upper);
  __m512 vnorm = _mm512_set1_ps(norm);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t *xr = x + r * width;
    int64_t b = 0;
    for (; b + 64 <= width; b += 64) { /* two blocks at a time: their chains (a block's scale waits on its maximum,
                                          its elements on the scale) interleave */
      __m512 h[4];
      for (int q = 0; q < 4; ++q) h[q] = signed_run(xr + b + 16 * q, sign_bits + b + 16 * q);
      for (int s = 0; s < 4; ++s)
        for (int q = 0; q < 4; ++q) h[q] = butterfly_stage(h[q], partner[s], upper[s]);
      __m512 t0 = to_bf16_and_back(_mm512_div_ps(_mm512_add_ps(h[0], h[1]), vnorm));
      __m512 d0 = to_bf16_and_back(_mm512_div_ps(_mm512_sub_ps(h[0], h[1]), vnorm));
      __m512 t1 = to_bf16_and_back(_mm512_div_ps(_mm512_add_ps(h[2], h[3]), vnorm));
      __m512 d1 = to_bf16_and_back(_mm512_div_ps(_mm512_sub_ps(h[2], h[3]), vnorm));
      cast_two_blocks(out + r * width + b, t0, d0, t1, d1, f);
    }
    for (; b < width; b += 32) {
      __m512 first = signed_run(xr + b, sign_bits + b), second = signed_run(xr + b + 16, sign_bits + b + 16);
      for (int s = 0; s < 4; ++s) {
        first = butterfly_stage(first, partner[s], upper[s]);
        second = butterfly_stage(second, partner[s], upper[s]);
      }
      cast_block(out + r * width + b, to_bf16_and_back(_mm512_div_ps(_mm512_add_ps(first, second), vnorm)),
                 to_bf16_and_back(_mm512_div_ps(_mm512_sub_ps(first, second), vnorm)), f);
    }
  }
}
"""

SMOLLM2_WIDTHS = (576, 1536)  # hidden size (q/k/v, o_proj, gate/up inputs) and intermediate size (down_proj input)
ROWS = 1024
FORMAT = "mxfp8_e4m3"

LIBRARY_CAST, LIBRARY_TRANSFORM, LIBRARY_BOTH = (
    "MX cast alone (library, compiled)",
    "transform alone (library, compiled)",
    "transform and MX cast (library, compiled)",
)
C_COPY, C_SEQUENTIAL, C_BUTTERFLY, C_CAST, C_BOTH = (
    "copy (C)",
    "sequential transform (C)",
    "butterfly transform (C)",
    "MX cast alone (C)",
    "butterfly transform and MX cast (C)",
)


class MXFormatArguments(ctypes.Structure):
    """The C kernels' `mx_format`: an element format and the scale rule's rounding bits (-1: the OCP floor)."""

    _fields_ = [
        ("emin", ctypes.c_float),
        ("emax_element", ctypes.c_float),
        ("mbits", ctypes.c_float),
        ("max_normal", ctypes.c_float),
        ("emax", ctypes.c_int),
        ("rounding_bits", ctypes.c_int),
        ("rounds_up_from", ctypes.c_uint32),
    ]

    @classmethod
    def of(cls, fmt: MXFormat, block_size: int, scale_rule: str) -> MXFormatArguments:
        if block_size != 32:
            raise ValueError("the kernels cast 32-blocks")
        rounding = scale_rounding_bits(scale_rule, fmt.ebits, fmt.mbits)
        bits = -1 if rounding is None else rounding
        # the block maximum's mantissa field from which it rounds up: f / 2^23 >= 1 - 2^-(r+1)
        rounds_up_from = 0 if rounding is None else (1 << 23) - (1 << (23 - rounding - 1))
        return cls(fmt.emin, fmt.emax, fmt.mbits, fmt.max_normal, fmt.emax, bits, rounds_up_from)


class HandWrittenKernels:
    """The C kernels above, compiled once into `folder`, called on contiguous bfloat16 rows."""

    def __init__(self, folder: Path):
        flags = (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "").split()
        if not {"avx512f", "avx512bw"} <= set(flags):
            raise SystemExit("this study needs an x86-64 CPU with AVX-512 F and BW (the kernels use its intrinsics)")
        source, library = folder / "kernels.c", folder / "kernels.so"
        source.write_text(KERNELS_C)
        subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
        self.library = ctypes.CDLL(str(library))
        pointer, integer, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self.library.copy_bf16.argtypes = [pointer, pointer, integer]
        self.library.sequential_bf16.argtypes = [pointer, pointer, integer, integer, pointer, pointer, real]
        self.library.butterfly_bf16.argtypes = [pointer, pointer, integer, integer, pointer, real]
        self.library.cast_bf16.argtypes = [pointer, pointer, integer, pointer]
        self.library.butterfly_cast_bf16.argtypes = [pointer, pointer, integer, integer, pointer, real, pointer]

    def call(
        self, kernel: str, transform: RandomizedHadamard, cast: tuple | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function of bfloat16 rows `[n, transform.size]` running the named kernel: a copy, the transform
        (sequential or butterfly), the MX cast `cast` (format, block size, scale rule) alone, or both."""
        signs, last, _ = transform._factors_as(torch.device("cpu"), torch.float32)
        if transform.block_size != 32 or len(last) != 16:
            raise ValueError("the kernels transform 32-blocks (a 16 x 16 factor and one sum and difference)")
        sign_bits = torch.where(signs < 0, -(2**31), 0).to(torch.int32).contiguous()
        factor, norm = last.contiguous(), float(transform._norm)
        fmt = ctypes.byref(MXFormatArguments.of(*cast)) if cast is not None else None
        lib = self.library

        def run(rows: torch.Tensor) -> torch.Tensor:
            rows = rows.contiguous()
            out = torch.empty_like(rows)
            (n, width), x, o = rows.shape, rows.data_ptr(), out.data_ptr()
            if kernel == C_COPY:
                lib.copy_bf16(x, o, rows.numel())
            elif kernel == C_SEQUENTIAL:
                lib.sequential_bf16(x, o, n, width, sign_bits.data_ptr(), factor.data_ptr(), norm)
            elif kernel == C_BUTTERFLY:
                lib.butterfly_bf16(x, o, n, width, sign_bits.data_ptr(), norm)
            elif kernel == C_CAST:
                lib.cast_bf16(x, o, rows.numel(), fmt)
            else:
                lib.butterfly_cast_bf16(x, o, n, width, sign_bits.data_ptr(), norm, fmt)
            return out

        return run


def median_ms(fn: Callable[[], object], calls: int = 20, repeats: int = 7) -> float:
    """Median CPU time per call, in ms, of `repeats` runs of `calls` calls (one warm-up call first)."""
    return median_seconds([fn], repeats, time.process_time, calls=calls)[0] * 1e3


def activations(width: int, sigma: float, rows: int = ROWS, seed: int = 0) -> torch.Tensor:
    """Random bfloat16 rows whose magnitudes are log-normal (`sigma` of the log): wider ranges within a block as
    `sigma` grows."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(sigma * torch.randn(rows, width, generator=generator))
    return (torch.randn(rows, width, generator=generator) * magnitudes).bfloat16()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal, any NaN equal to any NaN (inductor's kernels and torch's conversions write different NaNs)."""
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


def check_kernels(kernels: HandWrittenKernels) -> int:
    """Raise unless the hand-written kernels give the library's bits where they should: the sequential transform
    the library's transform; the C cast the library's cast, for every format and scale rule, on rows with zero,
    NaN and Inf blocks and values over a wide range; the fused kernel the library's cast of the butterfly's
    transform. Returns the number of values checked."""
    checked = 0
    for width in SMOLLM2_WIDTHS:
        transform = RandomizedHadamard(width, 32, seed=0)
        x = activations(width, sigma=4.0, rows=256, seed=2)
        x[0, :32], x[1, 5], x[2, 40], x[3, 70] = 0.0, float("nan"), float("inf"), 2.0**-130
        with torch.no_grad():
            if not same_bits(kernels.call(C_SEQUENTIAL, transform)(x), transform(x)):
                raise AssertionError(f"the sequential kernel's bits differ from the library's at width {width}")
            butterfly = kernels.call(C_BUTTERFLY, transform)(x)
            for name in MX_FORMATS:
                for rule in SCALE_RULES:
                    cast = (get_format(name), 32, rule)
                    for rows, kernel, expected in (
                        (x, C_CAST, quantize_mx(x, *cast)),
                        (x, C_BOTH, quantize_mx(butterfly, *cast)),
                    ):
                        if not same_bits(kernels.call(kernel, transform, cast)(rows), expected):
                            raise AssertionError(f"{kernel} differs from the library's for {name}, {rule}, {width}")
                        checked += rows.numel()
    return checked


def width_calls(kernels: HandWrittenKernels, transform: RandomizedHadamard, x: torch.Tensor) -> dict[str, Callable]:
    """The timed calls on rows `x`: the library's cast and transform, and the hand-written kernels."""
    cast = (get_format(FORMAT), 32, "ocp")
    calls = {
        LIBRARY_CAST: lambda: quantize_mx(x, *cast),
        LIBRARY_TRANSFORM: lambda: transform(x),
        LIBRARY_BOTH: lambda: transform.quantize(x, *cast),
    }
    for kernel in (C_COPY, C_SEQUENTIAL, C_BUTTERFLY, C_CAST, C_BOTH):
        run = kernels.call(kernel, transform, cast)
        calls[kernel] = lambda run=run: run(x)
    return calls


def per_element_costs(kernels: HandWrittenKernels) -> dict[int, dict[str, float]]:
    """ns per element of every call, by width."""
    costs: dict[int, dict[str, float]] = {}
    for width in SMOLLM2_WIDTHS:
        x = activations(width, sigma=1.0)
        with torch.no_grad():
            calls = width_calls(kernels, RandomizedHadamard(width, 32, seed=0), x)
            costs[width] = {name: median_ms(call) * 1e6 / x.numel() for name, call in calls.items()}
    return costs


def timing_table(costs: dict[int, dict[str, float]]) -> str:
    lines = ["| input | call | ms per call | ns per element | x the library's cast alone |", "|---|---|---|---|---|"]
    for width, by_call in costs.items():
        for name, ns in by_call.items():
            ms = ns * ROWS * width / 1e6
            lines.append(f"| {ROWS} x {width} | {name} | {ms:.3f} | {ns:.3f} | {ns / by_call[LIBRARY_CAST]:.2f}x |")
    return "\n".join(lines)


def random_bits_table(kernels: HandWrittenKernels) -> str:
    """How many of the butterfly's bfloat16 outputs differ from the library's transform, on random rows."""
    lines = ["| input | log-normal sigma | values | differ |", "|---|---|---|---|"]
    for width in SMOLLM2_WIDTHS:
        transform = RandomizedHadamard(width, 32, seed=0)
        butterfly = kernels.call(C_BUTTERFLY, transform)
        for sigma in (0.5, 1.0, 2.0, 3.0):
            x = activations(width, sigma, rows=4096, seed=1)
            with torch.no_grad():
                differ = int((butterfly(x).view(torch.int16) != transform(x).view(torch.int16)).sum())
            lines.append(f"| 4096 x {width} | {sigma} | {x.numel():,} | {differ} |")
    return "\n".join(lines)


@dataclass
class ModelInputs:
    """The inputs that the online transforms of one forward pass of a rotated dMX model read, each with its transform
    and its MX cast (format, block size, scale rule); an input whose transform and cast several linears share (q/k/v,
    gate/up) once, as the model computes it once."""

    inputs: list[tuple[torch.Tensor, RandomizedHadamard, tuple]] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module, ids: torch.Tensor) -> ModelInputs:
        found, keys = cls(), []

        def hook(module: MXLinear, args: tuple) -> None:
            x, key = args[0], module.matmul_input_key
            if not any(x is seen and key == seen_key for seen, seen_key in keys):
                keys.append((x, key))
                found.inputs.append((x, module.input_transform, (module.fmt, module.block_size, module.scale_rule)))

        modules = [m for m in model.modules() if isinstance(m, MXLinear) and m.input_transform is not None]
        handles = [m.register_forward_pre_hook(hook) for m in modules]
        try:
            with torch.inference_mode():
                model(ids)
        finally:
            for handle in handles:
                handle.remove()
        return found

    @property
    def elements(self) -> int:
        return sum(x.numel() for x, _, _ in self.inputs)


def model_seconds(kernels: HandWrittenKernels, found: ModelInputs) -> dict[str, float]:
    """CPU seconds per forward pass of each call on the model's own transformed inputs, summed over them."""
    totals = dict.fromkeys([LIBRARY_CAST, LIBRARY_BOTH, C_COPY, C_SEQUENTIAL, C_BUTTERFLY, C_CAST, C_BOTH], 0.0)
    with torch.inference_mode():
        for x, transform, cast in found.inputs:
            calls = input_calls(kernels, x.reshape(-1, transform.size), transform, cast)
            for name, seconds in zip(calls, median_seconds(list(calls.values()), 5, time.process_time, calls=10)):
                totals[name] += seconds
    return totals


def input_calls(
    kernels: HandWrittenKernels, rows: torch.Tensor, transform: RandomizedHadamard, cast: tuple
) -> dict[str, Callable]:
    """The timed calls on one of the model's transformed inputs."""
    calls = {LIBRARY_CAST: lambda: quantize_mx(rows, *cast), LIBRARY_BOTH: lambda: transform.quantize(rows, *cast)}
    for kernel in (C_COPY, C_SEQUENTIAL, C_BUTTERFLY, C_CAST, C_BOTH):
        run = kernels.call(kernel, transform, (cast[0], cast[1], cast[2]))
        calls[kernel] = lambda run=run: run(rows)
    return calls


def butterfly_differences(kernels: HandWrittenKernels, model: nn.Module, windows: torch.Tensor) -> tuple[int, int]:
    """The transformed values of the rotated model's inputs over `windows` (one forward pass each), and how many of
    them the butterfly computes differently from the library."""
    values = differ = 0
    for window in windows:
        with torch.inference_mode():
            for x, transform, _ in ModelInputs.of(model, window[None]).inputs:
                rows = x.reshape(-1, transform.size)
                butterfly = kernels.call(C_BUTTERFLY, transform)(rows)
                differ += int((butterfly.view(torch.int16) != transform(rows).view(torch.int16)).sum())
                values += rows.numel()
    return values, differ


def added_per_forward(per_forward: dict[str, float], forward: float) -> str:
    """What each design's transform adds to the forward pass, against the forward pass with the same cast: the
    library's transform-and-cast less its cast alone; a hand-written transform fused into the library's cast at
    least its kernel less the copy's loads and stores (a bound); the hand-written butterfly-and-cast kernel less the
    hand-written cast alone, against the forward with the hand-written cast in place of the library's."""
    with_c_cast = forward - per_forward[LIBRARY_CAST] + per_forward[C_CAST]
    added = {
        "library: compiled transform and cast, less the cast alone": (
            per_forward[LIBRARY_BOTH] - per_forward[LIBRARY_CAST],
            forward,
        ),
        "sequential in C (the library's bits), less the copy": (
            per_forward[C_SEQUENTIAL] - per_forward[C_COPY],
            forward,
        ),
        "butterfly in C, less the copy": (per_forward[C_BUTTERFLY] - per_forward[C_COPY], forward),
        "butterfly and cast in C, less the C cast alone": (per_forward[C_BOTH] - per_forward[C_CAST], with_c_cast),
    }
    lines = ["| call | ms per forward |", "|---|---|"]
    lines += [f"| {name} | {seconds * 1e3:.1f} |" for name, seconds in per_forward.items()]
    lines += [
        "",
        "| transform | ms added per forward | forward without it, ms | x that forward |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {seconds * 1e3:.1f} | {base * 1e3:.0f} | {1 + seconds / base:.3f}x |"
        for name, (seconds, base) in added.items()
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the C kernels run on one)")
    parser.add_argument("--windows", type=int, default=8, help="512-token windows of each held-out text")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as folder:
        kernels = HandWrittenKernels(Path(folder))  # first: a CPU without AVX-512 is refused before any download
        model_dir = benchmark_model()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        checked = check_kernels(kernels)
        costs = per_element_costs(kernels)
        random_bits = random_bits_table(kernels)
        dmx_dir, rotated_dir = save_dmx_models(model_dir, Path(folder), ("online_block_hadamard",))
        dmx, rotated = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16) for d in (dmx_dir, rotated_dir))
        ids = torch.randint(0, dmx.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            forwards = median_seconds([lambda: dmx(ids), lambda: rotated(ids)], 7, time.process_time)
        found = ModelInputs.of(rotated, ids)
        per_forward = model_seconds(kernels, found)
        real = ["| text | windows | transformed values | differ |", "|---|---|---|---|"]
        for name, path in benchmark_texts().evaluation.items():
            text = path.read_text(encoding="utf-8")
            windows = token_windows(text_tokens(tokenizer, text), 512, start_tokens(tokenizer))[: a.windows]
            values, differ = butterfly_differences(kernels, rotated, windows)
            real.append(f"| {name} | {len(windows)} | {values:,} | {differ} |")

    machine = f"{processor_description()}, torch {torch.__version__}"
    print(f"Machine: {machine}, {a.threads} torch threads (the C kernels run on one)\n")
    print(
        f"Checked: {checked:,} values of the C cast and of the fused kernel equal to the library's (every format and "
        "scale rule, zero, NaN and Inf blocks); the sequential transform equal to the library's.\n"
    )
    print(f"Per call, bfloat16 rows, 32-blocks, {FORMAT}, log-normal sigma 1 (CPU time, median of 7 x 20 calls):\n")
    print(timing_table(costs))
    print("\nThe butterfly's outputs against the library's transform, random rows:\n")
    print(random_bits)
    print("\nThe butterfly on the rotated dMX model's own transformed inputs (held-out text, 1 x 512 per window):\n")
    print("\n".join(real))
    print(
        f"\nSmolLM2-135M, dMX (`bench_inference.py`'s map), bfloat16, 1 x 512 tokens: forward {forwards[0] * 1e3:.0f} "
        f"ms, rotated `online_block_hadamard` {forwards[1] * 1e3:.0f} ms ({forwards[1] / forwards[0]:.3f}x; CPU time, "
        f"median of 7). Its {len(found.inputs)} transformed inputs per forward ({found.elements:,} values), each call "
        "timed on them (median of 5 x 10 calls) and summed:\n"
    )
    print(added_per_forward(per_forward, forwards[0]))


if __name__ == "__main__":
    main()
