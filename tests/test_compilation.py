"""Compiled MX kernels (`formats.compilation`): bit-identical to the eager casts, compiled once per format and
dtype (not per shape), and replaced by the eager path with one warning where no compiler works."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from optimum_dmx.continuous import FORMAT_PAIRS, get_format_pair, weight_block_max
from optimum_dmx.continuous.fused import _gradients_kernel, _Quantizer, _values_kernel
from optimum_dmx.formats import (
    MX_FORMATS,
    SCALE_RULES,
    get_format,
    pack_mx,
    quantize_mx,
    set_compile_enabled,
    unpack_mx,
)
from optimum_dmx.formats import cast as cast_module
from optimum_dmx.formats.cast import cast_mx, compiles, fused_cast_mx
from optimum_dmx.formats.compilation import (
    COMPILE_ENV_VAR,
    KERNEL_CACHE_ENV_VAR,
    CompiledKernel,
    _compile,
    compile_enabled,
    inductor_options,
    kernel_cache_dir,
)
from optimum_dmx.formats.packing import fused_code_rows, fused_dequantize
from optimum_dmx.nn import transforms
from optimum_dmx.nn.transforms import RandomizedHadamard, _sylvester_kernel, _transform_kernel

from .helpers import awkward_tensor, compiling_then_loading, last_json_line, run_python


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor, NaNs made canonical (their payload is not part of the format)."""
    t = t.float()
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Every format with every scale rule, each combination in one dtype chosen so that every format and every rule meets
# every dtype: 12 of the 36 kernels, as each compiles in seconds on a machine whose inductor cache is empty.
CAST_CASES = [
    (name, rule, DTYPES[(i + j) % len(DTYPES)])
    for i, name in enumerate(MX_FORMATS)
    for j, rule in enumerate(SCALE_RULES)
]


@pytest.mark.parametrize("name, rule, dtype", CAST_CASES, ids=[f"{n}-{r}-{str(d)[6:]}" for n, r, d in CAST_CASES])
def test_compiled_cast_is_bit_identical_to_the_eager_cast(compiled, name, rule, dtype):
    x = awkward_tensor().to(dtype).reshape(2, 12, 128)
    fmt = get_format(name)
    eager = cast_mx(x, fmt, 32, rule)  # the native-float8 path where there is one, else the bit pattern
    assert compiles(x.shape[-1], 32)  # quantize_mx runs the compiled kernel on it
    assert torch.equal(_bits(quantize_mx(x, fmt, 32, rule)), _bits(eager))


def test_the_cast_cases_pair_every_format_and_every_rule_with_every_dtype():
    assert {(name, dtype) for name, _, dtype in CAST_CASES} == {(n, d) for n in MX_FORMATS for d in DTYPES}
    assert {(rule, dtype) for _, rule, dtype in CAST_CASES} == {(r, d) for r in SCALE_RULES for d in DTYPES}
    assert {(name, rule) for name, rule, _ in CAST_CASES} == {(n, r) for n in MX_FORMATS for r in SCALE_RULES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 2 x 16 (all in the kernel), 8 x 16, 8 x 64, 2 x (16 x odd 3)
@pytest.mark.parametrize("size, block_size", [(128, 32), (256, 128), (1024, 512), (96, 96)])
def test_compiled_online_transform_is_bit_identical_to_the_eager_one(compiled, monkeypatch, dtype, size, block_size):
    """An online transform's kernel (32-blocks: the signs, the products, the division, the rounding to the input's
    dtype and, for `quantize`, the MX cast) gives the bits of the same steps run eagerly, which
    `quantize_mx(transform(x))` is; with the signs apart from the last factor (float32) and in one copy of it per run
    (bfloat16 and float16 on a CPU). Larger blocks: the product by the last factor runs as torch's matrix product,
    the product across its runs, division, rounding and cast in `_sylvester_kernel`, with the same bits."""
    signs_apart = []  # per call of the transform's kernel: whether the signs came apart from the factor
    casts_compiled = []  # per call of the cast's kernel: its format
    sylvester_casts = []  # per call of the kernel after a large block's first product: its cast (None: none)

    class Recorded:
        def __init__(self, kernel, record):
            self.kernel, self.record = kernel, record

        active = property(lambda self: self.kernel.active)

        def __call__(self, *args):
            self.record(*args)
            return self.kernel(*args)

    monkeypatch.setattr(
        transforms,
        "_transform_kernel",
        Recorded(_transform_kernel, lambda x, signs, *rest: signs_apart.append(signs is not None)),
    )
    monkeypatch.setattr(
        cast_module, "fused_cast_mx", Recorded(fused_cast_mx, lambda x, fmt, *rest: casts_compiled.append(fmt))
    )
    monkeypatch.setattr(
        transforms, "_sylvester_kernel", Recorded(_sylvester_kernel, lambda *args: sylvester_casts.append(args[-1]))
    )
    transform = RandomizedHadamard(size, block_size, seed=3)
    x = awkward_tensor(24, size).to(dtype).reshape(2, 12, size)
    casts = [(get_format("mxfp4_e2m1"), 32, "ocp"), (get_format("mxfp6_e2m3"), 32, "compressed-tensors")]
    compiled_results = [transform(x), *(transform.quantize(x, *cast) for cast in casts)]
    assert _transform_kernel.rejected_variants == 0 and fused_cast_mx.rejected_variants == 0
    assert _sylvester_kernel.rejected_variants == 0
    # 32-blocks (a 16 x 16 last factor, then order 2): the transform's kernel computes the whole transform and cast;
    # larger blocks and larger last factors: the Sylvester kernel computes what follows the first product, cast included
    if block_size == 32:
        assert signs_apart == [dtype == torch.float32] * (1 + len(casts)) and not casts_compiled
        assert not sylvester_casts
    else:
        assert not signs_apart and not casts_compiled and sylvester_casts == [None, *casts]
    set_compile_enabled(False)
    eager = transform(x)
    eager_results = [eager, *(quantize_mx(eager, *cast) for cast in casts)]
    for got, expected in zip(compiled_results, eager_results, strict=True):
        assert got.dtype == dtype and torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activations_are_cast_in_one_call_and_large_transforms_a_chunk_of_rows_at_a_time_on_a_cpu(
    compiled, monkeypatch, dtype
):
    """On a CPU an activation is cast in one kernel call that reads and writes its dtype (no float32 temporary), with
    the bits of the eager cast; so is a 32-block online transform with its cast. One whose first product runs before
    its kernel (blocks over 32, float32 temporaries as large as the input) is transformed a chunk of rows at a
    time."""
    monkeypatch.setattr(cast_module, "ROW_CHUNK_ELEMENTS", 5 * 128)  # 5 rows of 128 per chunk
    calls = []

    def recorded(kernel):
        class Recorded:
            active = property(lambda self: kernel.active)

            def __call__(self, x, *args):
                calls.append((len(x), x.dtype))
                return kernel(x, *args)

        return Recorded()

    monkeypatch.setattr(cast_module, "fused_cast_mx", recorded(fused_cast_mx))
    monkeypatch.setattr(transforms, "_transform_kernel", recorded(_transform_kernel))
    monkeypatch.setattr(transforms, "_sylvester_kernel", recorded(_sylvester_kernel))
    x = awkward_tensor(23, 128).to(dtype).reshape(1, 23, 128)
    fmt = get_format("mxfp4_e2m1")
    got = quantize_mx(x, fmt)
    assert calls == [(23, dtype)]
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(_bits(got), _bits(cast_mx(x, fmt, 32, "ocp")))
    for block_size in (32, 128):
        transform = RandomizedHadamard(128, block_size, seed=1)
        calls.clear()
        got = transform.quantize(x, fmt, 32, "ocp")
        assert [rows for rows, _ in calls] == ([23] if block_size == 32 else [5, 5, 5, 5, 3])
        set_compile_enabled(False)
        expected = quantize_mx(transform(x), fmt)
        set_compile_enabled(True)
        assert got.dtype == dtype and torch.equal(_bits(got), _bits(expected))


def test_a_padded_last_block_is_cast_eagerly(compiled):
    """inductor miscompiles a padded bfloat16 block, so widths that are not whole blocks never compile."""
    x = awkward_tensor(8, 100).bfloat16()
    before = fused_cast_mx.compiled_variants
    assert torch.equal(_bits(quantize_mx(x, "mxfp8")), _bits(cast_mx(x, get_format("mxfp8"), 32, "ocp")))
    assert fused_cast_mx.compiled_variants == before


def test_quantize_mx_runs_the_compiled_kernel_unless_a_gradient_is_wanted(compiled):
    fmt = get_format("mxfp6_e3m2")
    x = torch.randn(3, 128)
    before = fused_cast_mx.compiled_variants
    quantize_mx(x, fmt, block_size=64)  # a block size no other test uses: a kernel of its own
    assert fused_cast_mx.compiled_variants == before + 1
    x.requires_grad_(True)
    y = quantize_mx(x, fmt, block_size=16)  # the eager cast, as before compilation existed: its graph is kept
    assert y.requires_grad and fused_cast_mx.compiled_variants == before + 1


def test_the_cast_kernels_block_output_is_each_blocks_shared_exponent(compiled):
    """The cast kernel returns its blocks' shared exponents beside the values (a block output, so that inductor
    computes them once per block): they are the E8M0 scales that pack_mx stores, 128 for NaN blocks."""
    x = awkward_tensor(16, 128)  # the width of the cast and unpacking tests: some of their kernels serve here
    for name in MX_FORMATS:
        values, exponents = fused_cast_mx(x, get_format(name), 32, "ocp")
        assert torch.equal(exponents.squeeze(-1), pack_mx(x, name).scales.to(torch.int32) - 127), name
        assert torch.equal(_bits(values), _bits(cast_mx(x, get_format(name), 32, "ocp"))), name
    assert fused_cast_mx.rejected_variants == 0


def test_each_input_dtype_of_a_width_gets_a_cast_kernel_that_reads_and_writes_it(compiled):
    """bfloat16 and float16 activations are cast by kernels of their own, which read and write that dtype and compute
    in float32 (no float32 copy of the activation, no float32 result to convert); the bits are the eager cast's."""
    fmt = get_format("mxfp6_e2m3")
    before = fused_cast_mx.compiled_variants
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = awkward_tensor(6, 224).to(dtype)  # a width no other test uses: a kernel of its own
        y = quantize_mx(x, fmt)
        assert y.dtype == dtype and torch.equal(_bits(y), _bits(cast_mx(x, fmt, 32, "ocp")))
    assert fused_cast_mx.compiled_variants == before + 3


def test_disabled_compilation_runs_the_eager_cast():
    set_compile_enabled(False)
    try:
        assert not compile_enabled() and not fused_cast_mx.active
        before = fused_cast_mx.compiled_variants
        x = torch.randn(2, 32, 40)
        assert torch.equal(quantize_mx(x, "mxfp4"), cast_mx(x, get_format("mxfp4"), 32, "ocp"))
        assert fused_cast_mx.compiled_variants == before
    finally:
        set_compile_enabled(None)
    with pytest.raises(TypeError, match="True, False or None"):
        set_compile_enabled("yes")


def _continuous(x, offset, pair, rule="ocp", amax=None, grad_y=None):
    """The fused continuous quantizer's values, `dL/dx` and the per-block sums of `dL/dy * dy/dbeta` (from `grad_y`)
    of `x` at `offset`."""
    quantizer = _Quantizer.at(offset, x.device, pair, x.shape[-1], 32, rule, amax)
    return (quantizer.values(x), *quantizer.gradients(x, grad_y, True, True))


@pytest.mark.parametrize("pair_name", list(FORMAT_PAIRS))
def test_compiled_continuous_quantizer_is_bit_identical_at_the_pairs_formats(compiled, pair_name):
    pair = get_format_pair(pair_name)
    x = awkward_tensor(16, 96).reshape(4, 4, 96) * 1e-30  # keep most blocks finite and in range
    x[0, 0, 0] = float("nan")
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    # every offset, rule and dtype, with the weights' block maxima (amax) given or not in turn, so that each of the
    # three meets both cases of amax: half of the 24 combinations, each a values and a gradients kernel of its own
    for k, offset in enumerate((0.0, 1.0, 2.0)):
        for r, rule in enumerate(("ocp", "quark")):
            for d, dtype in enumerate((torch.float32, torch.bfloat16)):
                amax = weight_block_max(x) if (k + r + d) % 2 else None
                set_compile_enabled(False)
                eager = _continuous(x.to(dtype), offset, pair, rule, amax, grad_y.to(dtype))
                set_compile_enabled(True)
                fused = _continuous(x.to(dtype), offset, pair, rule, amax, grad_y.to(dtype))
                for name, a, b in zip(("values", "dL/dx", "dL/dbeta per block"), eager, fused):
                    case = (pair_name, offset, rule, dtype, amax is None, name)
                    assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), case


def test_the_continuous_gradient_kernel_costs_less_than_three_values_kernels(compiled):
    """The backward pass's kernel recomputes the grid, the subnormal and the saturation masks from `x` and gives
    `dL/dx` and `dL/dbeta`'s per-block sums: about 2x the values kernel on this activation, as it evaluates the
    grid twice (per element for `dL/dx`, per block for the sums). Compiled with inductor's default options, the
    kernel before the sums moved into it kept those masks in boolean buffers written element by element, about 8x
    the values kernel (`compilation.INDUCTOR_OPTIONS`)."""
    pair = get_format_pair("mxfp8-mxfp4")
    generator = torch.Generator().manual_seed(0)
    x, grad_y = torch.randn(256, 1536, generator=generator), torch.randn(256, 1536, generator=generator)
    quantizer = _Quantizer.at(0.0, x.device, pair, x.shape[-1], 32, "ocp", None)
    runs = {"values": lambda: quantizer.values(x), "gradients": lambda: quantizer.gradients(x, grad_y, True, True)}
    times = {name: [] for name in runs}
    for run in runs.values():  # compile both kernels before timing
        run()
    for _ in range(15):  # interleaved, so that a busy machine slows both alike
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    # The fastest of each: what the kernel costs when nothing else runs (medians failed once at 4.4x on a machine
    # whose other core ran a benchmark; the same test alone passed there).
    values, gradients = (min(times[name]) for name in runs)
    assert gradients < 3 * values, (gradients, values)


def test_fractional_offsets_run_the_eager_continuous_kernel(compiled):
    """Compiled exp2 differs from eager's in the last bit at fractional exponents: those offsets never compile."""
    pair = get_format_pair("mxfp8-mxfp4")
    x, grad_y = torch.randn(4, 64), torch.randn(4, 64)
    before = _values_kernel.compiled_variants + _gradients_kernel.compiled_variants
    set_compile_enabled(False)
    eager = _continuous(x, 0.37, pair, grad_y=grad_y)
    set_compile_enabled(True)
    again = _continuous(x, 0.37, pair, grad_y=grad_y)
    assert _values_kernel.compiled_variants + _gradients_kernel.compiled_variants == before
    for a, b in zip(eager, again):
        assert torch.equal(_bits(a), _bits(b))


def test_kernels_do_not_recompile_when_the_number_of_tokens_changes(compiled):
    """Batch sizes and sequence lengths change from call to call (a generation loop, a last short batch): once a
    layer width has been seen with many rows and with one, no token count compiles anything new, and no kernel goes
    through torch.compile's frame evaluation (dynamo records no graph)."""
    fmt = get_format("mxfp8_e4m3")
    pair = get_format_pair("mxfp6-mxfp4")

    def run(batch: int, length: int, width: int) -> None:
        x = torch.randn(batch, length, width)
        assert torch.equal(_bits(quantize_mx(x, fmt)), _bits(cast_mx(x, fmt, 32, "ocp")))
        _continuous(x, 2.0, pair, grad_y=torch.randn_like(x))

    graphs = counters["stats"]["unique_graphs"]
    widths = (64, 128)
    for width in widths:
        for batch, length in [(2, 7), (1, 1)]:
            run(batch, length, width)
    kernels = fused_cast_mx.compiled_variants
    for batch, length in [(2, 8), (3, 9), (4, 130), (5, 3), (1, 17), (2, 1), (1, 7)]:
        for width in widths:
            run(batch, length, width)
    assert fused_cast_mx.compiled_variants == kernels
    run(2, 7, 480)  # a layer width no other test uses (xdist workers share kernels across tests): a kernel of its own
    assert fused_cast_mx.compiled_variants == kernels + 1
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_kernel_first_called_with_as_many_rows_as_its_width_serves_every_row_count(compiled):
    """Inductor gives symbolic sizes of equal value one symbol: had the width been symbolic too, a kernel compiled
    from a first call whose row count equals the width would take its width for its row count and fail on any other
    (and with it, compilation everywhere). The width is a constant of the kernel: later calls of any row count use
    it."""
    fmt = get_format("mxfp6_e3m2")
    first = torch.randn(352, 352)  # a width no other test uses: a kernel of its own
    before = fused_cast_mx.compiled_variants
    for x in (first, torch.randn(7, 352), torch.randn(400, 352), torch.randn(3, 5, 352)):
        assert torch.equal(_bits(quantize_mx(x, fmt)), _bits(cast_mx(x, fmt, 32, "ocp")))
    assert fused_cast_mx.compiled_variants == before + 1 and fused_cast_mx.active
    assert fused_cast_mx.rejected_variants == 0


def test_a_kernel_compiled_for_one_width_is_never_served_to_another(tmp_path):
    """A kernel is compiled with its width static and only its row count symbolic, so inductor's on-disk cache
    keeps an entry per width. (Compiled with every size symbolic, the cast's kernel for rows of one block laid out
    its shared exponents with a stride that only holds for one block per row, and the cache served it to wider rows:
    wrong scales, which only the first-call check caught.) A fresh process with an empty cache casts rows of one
    block, then of two, then of two in a second process that finds both widths in the cache."""
    script = textwrap.dedent("""
        import json, warnings
        import torch
        from optimum_dmx.formats import quantize_mx
        from optimum_dmx.formats.cast import cast_mx, fused_cast_mx
        from optimum_dmx.formats.spec import get_format
        warnings.simplefilter("ignore")
        same = []
        for width in WIDTHS:
            x = torch.randn(48, width, generator=torch.Generator().manual_seed(width))
            x = x * torch.logspace(-4, 4, 48).unsqueeze(-1)  # rows of very different scales
            eager = cast_mx(x, get_format("mxfp8_e4m3"), 32, "compressed-tensors")
            same.append(torch.equal(quantize_mx(x, "mxfp8_e4m3", scale_rule="compressed-tensors"), eager))
        print(json.dumps({"same": same, "rejected": fused_cast_mx.rejected_variants}))
    """)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "OPTIMUM_DMX_COMPILE": "1"}
    for widths in ((32, 64), (64,)):
        result = last_json_line(run_python(script.replace("WIDTHS", repr(widths)), env=env))
        assert result == {"same": [True] * len(widths), "rejected": 0}, widths


def test_a_later_process_loads_the_kernels_an_earlier_one_compiled(tmp_path):
    """Compiled kernels are stored (in inductor's cache directory by default) and a later process loads them instead
    of tracing and compiling: with tracing made to fail there, every kernel of the first process still runs compiled,
    first-call checked, with the same bits; with storing turned off (`OPTIMUM_DMX_KERNEL_CACHE=0`) a process compiles
    its kernels though stored ones are there."""
    script = textwrap.dedent("""
        import json, warnings
        import torch
        from optimum_dmx.formats import compilation, get_format, pack_mx, quantize_mx
        from optimum_dmx.formats.cast import fused_cast_mx
        from optimum_dmx.formats.packing import fused_code_rows
        from optimum_dmx.nn.transforms import RandomizedHadamard, _transform_kernel
        warnings.simplefilter("error", RuntimeWarning)  # a failed compilation or a rejected kernel fails the test
        x = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
        results = [
            quantize_mx(x, "mxfp8_e4m3"), quantize_mx(x[:1], "mxfp4_e2m1"), pack_mx(x, "mxfp6_e2m3").codes,
            RandomizedHadamard(96, 32, seed=1).quantize(x.bfloat16(), get_format("mxfp4_e2m1"), 32, "ocp").float(),
        ]
        kernels = [fused_cast_mx, fused_code_rows, _transform_kernel]
        folder = compilation.kernel_cache_dir()
        print(json.dumps({
            "compiled": [k.compiled_variants for k in kernels], "rejected": [k.rejected_variants for k in kernels],
            "loaded": [all(v.loaded for v in k._kernels.values()) for k in kernels],
            "sums": [r.double().sum().item() for r in results],
            "folder": None if folder is None else str(folder),
            "stored": 0 if folder is None or not folder.exists() else len(list(folder.glob("*.json"))),
        }))
    """)
    first, later = compiling_then_loading(script, tmp_path / "inductor")
    assert first["folder"] == str(tmp_path / "inductor" / "optimum_dmx")
    assert first["compiled"] == [2, 1, 1] and first["rejected"] == [0, 0, 0] and first["loaded"] == [False] * 3
    assert first["stored"] == 4
    assert later["compiled"] == [2, 1, 1] and later["rejected"] == [0, 0, 0] and later["loaded"] == [True] * 3
    assert later["sums"] == first["sums"] and later["stored"] == 4
    inductor = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OPTIMUM_DMX_COMPILE": "1"}
    off = last_json_line(run_python(script, env={**inductor, "OPTIMUM_DMX_KERNEL_CACHE": "0"}))
    assert off["folder"] is None and off["loaded"] == [False] * 3 and off["sums"] == first["sums"]


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _tripled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_a_stored_kernel_that_gives_other_bits_or_cannot_be_read_is_compiled_anew(compiled, tmp_path, monkeypatch):
    """A stored kernel is checked on its first call like a new one: one that computes something else (here another
    function's kernel, stored under its key) is deleted, compiled anew and stored, with no warning; a damaged file
    is compiled over."""
    from optimum_dmx.formats import compilation

    monkeypatch.setenv("OPTIMUM_DMX_KERNEL_CACHE", str(tmp_path))
    x = torch.arange(96.0).reshape(3, 32)
    CompiledKernel(_tripled)(x)
    (tripled,) = [path for path in tmp_path.iterdir() if path.name.startswith("_tripled") and path.suffix != ".json"]
    doubled = compilation._kernel_path(_doubled, (x,), inductor_options((x,)))
    for suffix in ("", ".json"):  # the other function's kernel under this one's key
        doubled.with_name(doubled.name + suffix).write_bytes(tripled.with_name(tripled.name + suffix).read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        kernel = CompiledKernel(_doubled)
        assert torch.equal(kernel(x), x * 2) and kernel.rejected_variants == 0
        (compiled_anew,) = kernel._kernels.values()
        assert not compiled_anew.loaded and compilation._Kernel.load(doubled) is not None
        assert torch.equal(CompiledKernel(_doubled)(x), x * 2)  # the kernel stored anew, loaded
        doubled.write_bytes(b"damaged")
        again = CompiledKernel(_doubled)
        assert torch.equal(again(x), x * 2) and not next(iter(again._kernels.values())).loaded
    assert torch.equal(CompiledKernel(_doubled)(x), x * 2)


def test_a_kernel_that_cannot_be_keyed_for_storing_is_compiled_all_the_same(compiled, tmp_path, monkeypatch):
    """Storing kernels saves time and never decides whether one is compiled: where no stored kernel's path can be
    made (here the package's source cannot be read), the kernel is compiled, not stored, and compilation stays on."""
    from optimum_dmx.formats import compilation

    def unreadable(device: str) -> tuple:
        raise OSError("no source")

    monkeypatch.setenv("OPTIMUM_DMX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(compilation, "_build", unreadable)
    kernel = CompiledKernel(_doubled)
    x = torch.arange(64.0).reshape(2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert torch.equal(kernel(x), x * 2)
    assert kernel.compiled_variants == 1 and kernel.rejected_variants == 0 and kernel.active
    assert not list(tmp_path.iterdir())


def test_a_compiled_kernel_takes_its_width_as_a_constant():
    """The graph's traced sizes reach inductor (its row count symbolic, its width static): the kernel serves any row
    count of its width and refuses another width, where a kernel with every size symbolic would run it."""
    fmt = get_format("mxfp8_e4m3")
    x = awkward_tensor(40, 64)
    kernel = _compile(fused_cast_mx.fn, (x, fmt, 32, "ocp"), inductor_options((x,)))
    for rows in (x, x[:7].contiguous()):
        assert torch.equal(_bits(kernel(rows, fmt, 32, "ocp")[0]), _bits(cast_mx(rows, fmt, 32, "ocp")))
    with pytest.raises(AssertionError):
        kernel(awkward_tensor(40, 96), fmt, 32, "ocp")


def test_a_kernel_first_called_with_a_view_is_right_under_torchs_strict_aliasing_checks(compiled):
    """`quantize_mx` hands its kernel a view of the caller's tensor. Traced from that view, with torch's stricter
    aliasing checks on (their default when `$CI` is set), inductor built a cast returning garbage, which only the
    first-call check caught; kernels are traced from copies."""
    from torch._functorch import config as functorch_config

    fmt = get_format("mxfp6_e2m3")
    x = awkward_tensor(6, 416)  # a width no other test uses: a kernel of its own
    rejected = fused_cast_mx.rejected_variants
    with functorch_config.patch(error_on_custom_op_aliasing=True):
        assert torch.equal(_bits(quantize_mx(x, fmt)), _bits(cast_mx(x, fmt, 32, "ocp")))
    assert fused_cast_mx.rejected_variants == rejected


def test_single_row_kernels_are_compiled_without_dynamo_and_bit_identical(compiled):
    """One row (a token being generated) gets a kernel traced and compiled by inductor directly, skipping
    torch.compile's per-call frame evaluation: no graph goes through dynamo, and the casts and the continuous
    quantizer's values and gradients equal the eager functions bit for bit."""
    x = awkward_tensor(24, 160)[:, None, None, :]  # rows of shape (1, 1, 160): a new width, no kernel yet
    graphs, kernels = counters["stats"]["unique_graphs"], fused_cast_mx.compiled_variants
    for i, name in enumerate(MX_FORMATS):  # each format in one dtype, each dtype for two formats
        fmt, dtype = get_format(name), (torch.float32, torch.bfloat16)[i % 2]
        for row in x[:6].to(dtype):  # several rows through the same kernel (the first call is checked)
            assert torch.equal(_bits(quantize_mx(row, fmt)), _bits(cast_mx(row, fmt, 32, "ocp"))), (name, dtype)
    assert fused_cast_mx.compiled_variants > kernels and fused_cast_mx.rejected_variants == 0
    for pair_name in FORMAT_PAIRS:
        pair = get_format_pair(pair_name)
        for row in x[6:12] * 1e-30:
            grad_y = torch.randn(row.shape, generator=torch.Generator().manual_seed(1))
            set_compile_enabled(False)
            eager = _continuous(row, 2.0, pair, grad_y=grad_y)
            set_compile_enabled(True)
            for name, a, b in zip(
                ("values", "dL/dx", "dL/dbeta per block"), eager, _continuous(row, 2.0, pair, grad_y=grad_y)
            ):
                assert torch.equal(_bits(a), _bits(b)), (pair_name, name)
    assert counters["stats"]["unique_graphs"] == graphs
    assert _values_kernel.rejected_variants == 0 and _gradients_kernel.rejected_variants == 0


def test_without_a_working_compiler_one_warning_and_identical_results(tmp_path):
    """A real process whose C++ compiler does not exist (and whose inductor cache is empty) warns once and casts
    eagerly; every result equals the eager cast."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        from optimum_dmx.continuous import quantize_mx_continuous_fused
        from optimum_dmx.formats import get_format, quantize_mx
        from optimum_dmx.formats.cast import cast_mx, compiles, fused_cast_mx

        x = torch.randn(4, 96)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [(quantize_mx(rows, name), cast_mx(rows, get_format(name), 32, "ocp"))
                       for name in ("mxfp4", "mxfp8") for rows in (x[:1], x)]  # static and symbolic rows
            beta = torch.tensor(2.0, requires_grad=True)
            quantize_mx_continuous_fused(x.requires_grad_(True), beta, "mxfp8-mxfp4").sum().backward()
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1, messages
        assert "inductor could not build" in messages[0] and "OPTIMUM_DMX_COMPILE=0" in messages[0], messages
        assert all(torch.equal(a, b) for a, b in results)
        assert not fused_cast_mx.active
        print("FELL BACK")
        """
    )
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
        "OPTIMUM_DMX_COMPILE": "1",
    }
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FELL BACK" in result.stdout


def test_environment_variables_turn_compilation_and_storing_off_or_name_the_folder(monkeypatch, tmp_path):
    """Both are read at each call, so a process can change them; `set_compile_enabled` overrides the first."""
    for value, expected in (("0", False), ("off", False), ("No", False), ("1", True), ("", True)):
        monkeypatch.setenv(COMPILE_ENV_VAR, value)
        assert compile_enabled() is expected, value
    monkeypatch.delenv(COMPILE_ENV_VAR)
    assert compile_enabled()
    set_compile_enabled(False)
    try:
        assert not compile_enabled()
    finally:
        set_compile_enabled(None)
    in_inductors_cache = Path(inductor_cache_dir()) / "optimum_dmx"
    for value, expected in (("0", None), ("false", None), (str(tmp_path), tmp_path), ("", in_inductors_cache)):
        monkeypatch.setenv(KERNEL_CACHE_ENV_VAR, value)
        assert kernel_cache_dir() == expected, value


def test_calibration_and_inference_are_identical_with_and_without_compiled_kernels():
    """The whole default recipe (sampled maps at the budget, KL blend) and the MXLinear model it gives: the same
    offsets, history, format map and logits bit for bit, compiled or eager. In bfloat16, the dtype transformers loads
    most checkpoints in and the one whose kernels round the most; each kernel is checked in float32 too, above."""
    from optimum_dmx.calibration import CalibrationSettings, calibrate
    from optimum_dmx.nn.surgery import replace_with_mx_linear

    from .helpers import sensitive_llama_and_data

    model, data = sensitive_llama_and_data()
    model = model.to(torch.bfloat16)
    settings = CalibrationSettings(target_bits=5.0, num_samples=len(data), seq_len=data.shape[1], batch_size=4, steps=4)
    runs = []
    for enabled in (True, False):
        set_compile_enabled(enabled)
        try:
            result = calibrate(model, data, settings, progress=False)
            quantized = replace_with_mx_linear(copy.deepcopy(model), result.format_map)
            with torch.no_grad():
                logits = quantized(data[:2]).logits
        finally:
            set_compile_enabled(None)
        runs.append((result, logits))
    (compiled_result, compiled_logits), (eager_result, eager_logits) = runs
    assert compiled_result.format_map == eager_result.format_map
    assert compiled_result.beta_hat == eager_result.beta_hat
    assert [h["loss"] for h in compiled_result.history] == [h["loss"] for h in eager_result.history]
    assert torch.equal(_bits(compiled_logits), _bits(eager_logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_unpacking_is_bit_identical(compiled, dtype):
    """`unpack_mx` (the packed-only `MXLinear`'s weight, every call) runs compiled: the same values."""
    weight = awkward_tensor(48, 128) * 1e-30
    weight[1, 7] = float("nan")
    for name in MX_FORMATS:
        packed = pack_mx(weight, name)
        set_compile_enabled(False)
        eager = unpack_mx(packed, dtype)
        set_compile_enabled(True)
        assert compiles(packed.shape[-1], 32) and packed.codes.dim() == 2  # unpack_mx runs the compiled kernel
        assert torch.equal(_bits(unpack_mx(packed, dtype)), _bits(eager)), (name, dtype)
    assert fused_dequantize.compiled_variants > 0


def test_compiled_packing_is_bit_identical_and_serves_every_row_count(compiled):
    """`pack_mx` (every `MXLinear` built from a linear, every export) runs one compiled kernel per format and width,
    for every input dtype (it packs float32 rows): the codes and scales of the eager packing, NaN and Inf blocks
    included, for any row count after the first call (a pad of nothing made the row count static: the kernel then
    failed on the next weight's rows, and compilation was off for the rest of the process)."""
    weight = awkward_tensor(48, 160) * 1e-30  # a width no other test packs: kernels of their own
    weight[1, 7] = float("nan")
    before = fused_code_rows.compiled_variants
    for dtype in (torch.float32, torch.bfloat16):
        for name in MX_FORMATS:
            for rows in (weight, weight[5:17], weight[:1], weight.reshape(4, 12, 160)):
                packed = pack_mx(rows.to(dtype), name)
                set_compile_enabled(False)
                eager = pack_mx(rows.to(dtype), name)
                set_compile_enabled(True)
                assert torch.equal(packed.codes, eager.codes) and torch.equal(packed.scales, eager.scales), name
                assert packed.shape == rows.shape and packed.codes.shape[:-1] == rows.shape[:-1]
    assert fused_code_rows.compiled_variants == before + 2 * len(MX_FORMATS)  # many rows and one, per format
    assert fused_code_rows.rejected_variants == 0 and fused_code_rows.active


def _one_more_when_compiled(x: torch.Tensor) -> torch.Tensor:
    """A function whose compiled kernel differs from it (it adds 1 while being traced into the kernel's graph): the
    stand-in for a miscompiled kernel."""
    return x + 1 if get_proxy_mode() is not None else x.clone()


def test_a_kernel_whose_first_result_differs_from_the_eager_function_is_rejected_with_one_warning(compiled):
    kernel = CompiledKernel(_one_more_when_compiled)
    x = torch.arange(64.0).reshape(2, 32)
    with pytest.warns(RuntimeWarning, match="gave other values than its eager reference") as caught:
        first = kernel(x)
    assert len([w for w in caught if "eager reference" in str(w.message)]) == 1
    assert torch.equal(first, x) and kernel.rejected_variants == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the rejected kernel runs eagerly, silently
        assert torch.equal(kernel(x + 2), x + 2)
    checked = CompiledKernel(lambda t: t * 2)  # a correct kernel is kept after its first call
    assert torch.equal(checked(x), x * 2) and checked.rejected_variants == 0 and checked.compiled_variants == 1


def _doubled_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes `2 x` into `out` (`2 x + 1` while traced into a kernel's graph: a miscompiled kernel with
    `miscompiled`) and returns the rows' sums."""
    out.copy_(x * 2 + 1 if _doubled_into.miscompiled and get_proxy_mode() is not None else x * 2)
    return x.sum(-1)


@pytest.mark.parametrize("miscompiled", [False, True])
def test_a_kernel_that_writes_into_a_tensor_stores_there_what_the_eager_function_writes(
    compiled, monkeypatch, miscompiled
):
    """`writes_into`: the kernel stores its values into the caller's tensor (rows of a larger one), and its first
    call compares them with what the eager function writes; a kernel that writes other values is rejected, and the
    caller's tensor gets the eager values."""
    monkeypatch.setattr(_doubled_into, "miscompiled", miscompiled, raising=False)
    kernel = CompiledKernel(_doubled_into, writes_into="out")
    x, output = torch.arange(96.0).reshape(3, 32), torch.full((7, 32), -1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sums = kernel(x, output[2:5])
    assert len([w for w in caught if "eager reference" in str(w.message)]) == int(miscompiled)
    assert kernel.rejected_variants == int(miscompiled) and kernel.compiled_variants == 1
    assert torch.equal(sums, x.sum(-1)) and torch.equal(output[2:5], x * 2)
    assert torch.all(output[:2] == -1) and torch.all(output[5:] == -1)  # the other rows untouched
    assert torch.equal(kernel(x + 1, output[:3]), (x + 1).sum(-1)) and torch.equal(output[:3], (x + 1) * 2)
    with pytest.raises(ValueError, match="writes into a contiguous tensor only"):
        kernel(x, output[:3].t().contiguous().t())
    with pytest.raises(ValueError, match=r"has no parameter 'result' to write into; it has \['x', 'out'\]"):
        CompiledKernel(_doubled_into, writes_into="result")


def test_a_large_blocks_transform_writes_each_chunk_of_rows_into_the_output(compiled, monkeypatch):
    """On a CPU the kernel after a large block's first product stores each chunk's values into the rows of the
    output (no chunk result copied there), with or without the cast, with the eager bits."""
    monkeypatch.setattr(cast_module, "ROW_CHUNK_ELEMENTS", 5 * 512)  # 5 rows of 512 per chunk
    written = []

    class Recorded:
        active = property(lambda self: _sylvester_kernel.active)

        def __call__(self, mixed, sylvester, out, *rest):
            written.append((out.untyped_storage().data_ptr(), out.storage_offset(), len(out)))
            return _sylvester_kernel(mixed, sylvester, out, *rest)

    monkeypatch.setattr(transforms, "_sylvester_kernel", Recorded())
    transform = RandomizedHadamard(512, 512, seed=2, signed=False)
    x = awkward_tensor(12, 512).reshape(3, 4, 512)
    fmt = get_format("mxfp8_e4m3")
    got = [transform(x), transform.quantize(x, fmt, 32, "ocp")]
    assert _sylvester_kernel.rejected_variants == 0
    for output, calls in zip(got, (written[:3], written[3:]), strict=True):
        assert calls == [
            (output.untyped_storage().data_ptr(), 512 * start, rows) for start, rows in ((0, 5), (5, 5), (10, 2))
        ]
    set_compile_enabled(False)
    expected = [transform(x), transform.quantize(x, fmt, 32, "ocp")]
    set_compile_enabled(True)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, expected, strict=True))


# Where torch's own choice is AVX2, every compiled test of this file checks AVX2 code already.
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="x86 with AVX-512 only")
def test_kernels_compiled_for_avx2_are_bit_identical(tmp_path):
    """A real process whose inductor emits AVX2 code (`ATEN_CPU_CAPABILITY=avx2`, an empty inductor cache): every
    format's cast and unpacking (with NaN and Inf blocks) and the continuous quantizer's values and gradients equal
    the eager functions, and no kernel is rejected. (torch 2.13's AVX2 code selects the wrong side of an int32
    `where` or `masked_fill`: the casts returned unrounded values until `grid_exponent` clamped, and every block came
    out NaN until `shared_exponent` marked NaN blocks with a maximum.)"""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        from optimum_dmx.formats import MX_FORMATS, get_format, pack_mx, quantize_mx, set_compile_enabled, unpack_mx
        from optimum_dmx.continuous import quantize_mx_continuous_fused
        from optimum_dmx.continuous.fused import _gradients_kernel, _values_kernel
        from optimum_dmx.formats.cast import cast_mx, fused_cast_mx
        from optimum_dmx.formats.compilation import _same_bits
        from optimum_dmx.formats.packing import fused_dequantize, fused_code_rows
        from optimum_dmx.nn.transforms import RandomizedHadamard, _transform_kernel

        assert torch.backends.cpu.get_cpu_capability() == "AVX2"
        finite = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 3
        x = finite.clone()
        x[1, 3], x[2, 40] = float("nan"), float("inf")  # two blocks with the NaN scale
        warnings.simplefilter("error", RuntimeWarning)  # a rejected kernel's warning fails the test
        for name in MX_FORMATS:
            for rows in (x, x[1:2]):  # many rows (torch.compile) and one (inductor directly)
                expected = cast_mx(rows, get_format(name), 32, "ocp", native_cast=False)
                assert _same_bits(quantize_mx(rows, name), expected), name
            packed = pack_mx(x, name)
            set_compile_enabled(False)
            eager = unpack_mx(packed)
            eager_packed = pack_mx(x, name)
            set_compile_enabled(True)
            assert _same_bits(unpack_mx(packed), eager), name
            assert _same_bits((packed.codes, packed.scales), (eager_packed.codes, eager_packed.scales)), name
        for pair in ("mxfp8-mxfp4", "mxfp6-mxfp4"):
            runs = []
            for compiled in (True, False):
                set_compile_enabled(compiled)
                inputs, beta = finite.clone().requires_grad_(), torch.tensor(2.0, requires_grad=True)
                y = quantize_mx_continuous_fused(inputs, beta, pair)
                y.backward(finite)
                runs.append((y.detach(), inputs.grad, beta.grad))
            set_compile_enabled(True)
            assert _same_bits(runs[0], runs[1]), pair
        transform = RandomizedHadamard(96, 32, seed=1)
        for dtype in (torch.float32, torch.bfloat16):
            transformed = transform.quantize(finite.to(dtype), get_format("mxfp4_e2m1"), 32, "ocp")
            assert _same_bits(transformed, quantize_mx(transform(finite.to(dtype)), "mxfp4_e2m1")), dtype
        assert _transform_kernel.compiled_variants == 4 and _transform_kernel.rejected_variants == 0
        # two per format (many rows, one row), and the bfloat16 reference cast of the transform
        assert fused_cast_mx.compiled_variants == 2 * len(MX_FORMATS) + 1 and fused_cast_mx.rejected_variants == 0
        assert fused_dequantize.rejected_variants == 0 and fused_code_rows.rejected_variants == 0
        assert fused_code_rows.compiled_variants == len(MX_FORMATS)
        assert _values_kernel.compiled_variants > 0 and _gradients_kernel.compiled_variants > 0
        assert _values_kernel.rejected_variants == 0 and _gradients_kernel.rejected_variants == 0
        print("EXACT")
        """
    )
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "avx2",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
        "OPTIMUM_DMX_COMPILE": "1",
    }
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EXACT" in result.stdout
