"""On a CUDA device: the compiled MX kernels (Triton) equal the eager functions and the CPU bit for bit, and
calibration runs on the GPU in bfloat16, through `from_pretrained` as a user calls it (its kernels compiled, as a
user's are: the suite's other tests run the eager functions).

Skipped where torch sees no CUDA device (CI has none). On a GPU machine: `python -m pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import copy
import random
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.calibration import CalibrationSettings, calibrate
from optimum_dmx.calibration.budget import BUDGET_TOLERANCE
from optimum_dmx.continuous import FORMAT_PAIRS, get_format_pair, weight_block_max
from optimum_dmx.continuous.fused import _gradients_kernel, _Quantizer, _values_kernel
from optimum_dmx.formats import MX_FORMATS, SCALE_RULES, get_format, quantize_mx, set_compile_enabled
from optimum_dmx.formats.cast import cast_mx, fused_cast_mx
from optimum_dmx.nn.transforms import RandomizedHadamard, _transform_kernel

from .helpers import (
    INPUT_IDS,
    adversarial_blocks,
    assert_bitwise_equal,
    awkward_tensor,
    compiling_then_loading,
    sensitive_llama_and_data,
    wide_range,
    word_tokenizer,
    words,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def _continuous(x: torch.Tensor, offset: float, pair, rule: str, amax, grad_y: torch.Tensor) -> tuple:
    """The fused continuous quantizer's values, `dL/dx` and per-block sums of `dL/dy * dy/dbeta` of `x` at `offset`."""
    quantizer = _Quantizer.at(offset, x.device, pair, x.shape[-1], 32, rule, amax)
    return (quantizer.values(x), *quantizer.gradients(x, grad_y, True, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_casts_on_cuda_equal_the_eager_casts_on_cuda_and_cpu(compiled, dtype):
    """Every format and scale rule, on NaN / Inf / zero / subnormal / huge blocks and the specification's edge
    values, many rows (torch.compile, Triton) and single rows (inductor directly): compiled on CUDA == eager on
    CUDA == eager on the CPU, and no kernel rejected by its first-call check."""
    rejected = fused_cast_mx.rejected_variants
    for name in MX_FORMATS:
        fmt = get_format(name)
        edges = adversarial_blocks(fmt)
        edges = torch.cat([edges, torch.zeros(-len(edges) % 4, 32)]).reshape(-1, 128)  # four blocks a row
        x = torch.cat([awkward_tensor(24, 128), edges]).to(dtype)
        for rule in SCALE_RULES:
            on_cpu = cast_mx(x, fmt, 32, rule)
            for rows in (x, x[:1]):
                gpu = rows.to(CUDA)
                assert_bitwise_equal(quantize_mx(gpu, fmt, 32, rule).cpu(), on_cpu[: len(rows)])
                assert_bitwise_equal(cast_mx(gpu, fmt, 32, rule).cpu(), on_cpu[: len(rows)])
    assert any(signature[0][1].type == "cuda" for signature in fused_cast_mx._kernels)
    assert fused_cast_mx.rejected_variants == rejected


@pytest.mark.parametrize("block_size", [32, 512])
def test_online_transform_on_cuda_equals_the_cpu(compiled, block_size):
    """A bfloat16 activation's online transform and its fused MX cast (compiled for CUDA) give the CPU's eager bits
    (the block sums of +-bfloat16 values are exact in float32, whatever order a GPU adds them in)."""
    transform = RandomizedHadamard(1024, block_size, seed=3)
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    cast = (get_format("mxfp4_e2m1"), 32, "ocp")
    set_compile_enabled(False)
    expected = transform(x), transform.quantize(x, *cast)
    set_compile_enabled(True)
    gpu = x.to(CUDA)
    assert_bitwise_equal(transform(gpu).cpu(), expected[0])
    assert_bitwise_equal(transform.quantize(gpu, *cast).cpu(), expected[1])
    kernel = _transform_kernel if block_size == 32 else fused_cast_mx  # larger blocks: the products, then the cast
    assert any(signature[0][1].type == "cuda" for signature in kernel._kernels)
    assert kernel.rejected_variants == 0


@pytest.mark.parametrize("name", list(MX_FORMATS))
def test_compiled_casts_on_cuda_match_torchao(compiled, name):
    """The independent reference: torchao's OCP MX cast (FLOOR scale) on the same device."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    constants = pytest.importorskip("torchao.prototype.mx_formats.constants")
    elem_dtypes = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp6_e3m2": constants.DTYPE_FP6_E3M2,
        "mxfp6_e2m3": constants.DTYPE_FP6_E2M3,
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }
    for dtype in (torch.float32, torch.bfloat16):
        x = wide_range((64, 256), seed=1, dtype=dtype).to(CUDA)
        scale, data = mx.to_mx(x, elem_dtypes[name], 32)
        assert_bitwise_equal(quantize_mx(x, name), mx.to_dtype(data, scale, elem_dtypes[name], 32, dtype))


@pytest.mark.parametrize("pair_name", list(FORMAT_PAIRS))
def test_continuous_quantizer_on_cuda_equals_eager_and_cpu(compiled, pair_name):
    """At the pair's formats (compiled) and at a fractional offset (eager everywhere), both scale rules, with and
    without the weights' block maxima, float32 and bfloat16: the values, `dL/dx` and `dL/dbeta`'s per-block sums
    compiled on CUDA equal eager CUDA's bit for bit; at the formats they equal the CPU's bit for bit too. At a
    fractional offset both devices use the same format parameters (computed on the CPU), but each element's grid step
    is an `exp2`, whose last bit may differ between them, so only the values are compared with the CPU's there, to
    that rounding (`dy/dbeta` holds `v - q`, whose relative error such a bit can make large)."""
    pair = get_format_pair(pair_name)
    x = awkward_tensor(16, 96).reshape(4, 4, 96) * 1e-30  # keep most blocks finite and in range
    x[0, 0, 0] = float("nan")
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    for offset in (0.0, 1.0, 2.0, 0.37):
        for rule in ("ocp", "quark"):
            for amax in (None, weight_block_max(x)):
                for dtype in (torch.float32, torch.bfloat16):
                    case = (pair_name, offset, rule, amax is not None, dtype)
                    args = (x.to(dtype), offset, pair, rule, amax, grad_y.to(dtype))
                    on_gpu = tuple(a.to(CUDA) if isinstance(a, torch.Tensor) else a for a in args)
                    set_compile_enabled(False)
                    cpu, eager = _continuous(*args), _continuous(*on_gpu)
                    set_compile_enabled(True)
                    fused = _continuous(*on_gpu)
                    for label, a, b, c in zip(("values", "dL/dx", "dL/dbeta per block"), cpu, eager, fused):
                        assert_bitwise_equal(c.cpu(), b.cpu(), message=f"{case} {label}: compiled vs eager CUDA")
                        if float(offset).is_integer():
                            assert_bitwise_equal(b.cpu(), a, message=f"{case} {label}: CUDA vs CPU")
                        elif label == "values":
                            torch.testing.assert_close(
                                b.cpu(),
                                a,
                                rtol=1e-6 if dtype == torch.float32 else 8e-3,
                                atol=0,
                                equal_nan=True,
                                msg=lambda details, case=case: f"{case} values: CUDA vs CPU: {details}",
                            )
    assert _values_kernel.rejected_variants == 0 and _gradients_kernel.rejected_variants == 0


def test_cuda_kernels_do_not_recompile_when_the_number_of_tokens_changes(compiled):
    fmt = get_format("mxfp8_e4m3")
    pair = get_format_pair("mxfp6-mxfp4")

    def run(batch: int, length: int) -> None:
        x = torch.randn(batch, length, 192, device=CUDA)
        assert_bitwise_equal(quantize_mx(x, fmt), cast_mx(x, fmt, 32, "ocp"))
        _continuous(x, 2.0, pair, "ocp", None, torch.randn_like(x))

    for batch, length in [(2, 7), (1, 7), (2, 1), (1, 1)]:
        run(batch, length)
    graphs, kernels = counters["stats"]["unique_graphs"], fused_cast_mx.compiled_variants
    for batch, length in [(2, 8), (3, 9), (4, 130), (1, 17), (2, 1)]:
        run(batch, length)
    assert counters["stats"]["unique_graphs"] == graphs and fused_cast_mx.compiled_variants == kernels


def _texts(n: int = 40) -> list[str]:
    rng = random.Random(0)
    return [words(rng.randrange(0, 100), 20) for _ in range(n)]


def test_a_later_process_loads_the_cuda_kernels_an_earlier_one_compiled(tmp_path):
    """Triton kernels are stored like the CPU's (`formats.compilation`): a second process with tracing made to fail
    loads the cast, packing and continuous quantizer's kernels, first-call checked, and gets the same bits."""
    script = textwrap.dedent("""
        import json, warnings
        import torch
        from optimum_dmx.continuous import quantize_mx_continuous_fused
        from optimum_dmx.formats import pack_mx, quantize_mx
        from optimum_dmx.formats.cast import fused_cast_mx
        warnings.simplefilter("error", RuntimeWarning)  # a failed compilation or a rejected kernel fails the test
        x = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)).cuda()
        beta = torch.tensor(2.0, device="cuda", requires_grad=True)
        y = quantize_mx_continuous_fused(x.clone().requires_grad_(), beta, "mxfp8-mxfp4")
        y.sum().backward()
        results = [quantize_mx(x, "mxfp8_e4m3"), pack_mx(x, "mxfp4_e2m1").codes, y.detach(), beta.grad]
        print(json.dumps({
            "loaded": all(kernel.loaded for kernel in fused_cast_mx._kernels.values()),
            "sums": [r.double().sum().item() for r in results],
        }))
    """)
    first, later = compiling_then_loading(script, tmp_path / "inductor")
    assert not first["loaded"] and later["loaded"] and later["sums"] == first["sums"]


def test_bf16_calibration_on_cuda_through_from_pretrained(compiled, tmp_path, tiny_llama_dir):
    """`from_pretrained(..., dtype=bfloat16, device_map="cuda", quantization_config=DMXConfig(...))` calibrates on
    the GPU, lands on the budget, saves, and reloads on the GPU to the same logits; `torch.compile` of the reload
    runs and agrees with it."""
    tokenizer = word_tokenizer()
    config = DMXConfig(
        target_bits=5.0, dataset=_texts(), tokenizer=tokenizer, num_samples=8, seq_len=16, batch_size=4, steps=4, seed=3
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.bfloat16, device_map="cuda", quantization_config=config
    )
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MXLinear)}
    assert layers and all(p.device.type == "cuda" for p in model.parameters())
    recorded = model.config.quantization_config
    assert recorded.achieved_bits["bits_weighted"] <= 5.0 + BUDGET_TOLERANCE, recorded.achieved_bits
    assert set(recorded.format_map.values()) <= {"mxfp4_e2m1", "mxfp8_e4m3"}, recorded.format_map
    ids = INPUT_IDS.to(CUDA)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()

    model.save_pretrained(tmp_path / "dmx")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx", device_map="cuda")
    assert reloaded.config.quantization_config.format_map == recorded.format_map
    with torch.no_grad():
        again = reloaded(ids).logits
        assert again.dtype == logits.dtype, (again.dtype, logits.dtype)
        assert torch.equal(again, logits), (again - logits).abs().max().item()
        compiled_logits = torch.compile(reloaded, fullgraph=True)(ids, use_cache=False).logits
    # the outer compilation fuses the activation casts with inductor's default GPU numerics: close, not equal
    difference = (compiled_logits.float() - logits.float()).abs().max().item()
    assert difference <= 0.05 * logits.float().abs().max().item(), difference


@pytest.mark.parametrize("method", ["dmx", "paper"])
def test_cuda_calibration_is_the_same_compiled_or_eager_and_with_checkpointing(method):
    """On the GPU in bfloat16, the same offsets, losses and format map from the compiled kernels, the eager ones,
    and the compiled ones with gradient checkpointing (transformers' layers recomputed in the backward pass)."""
    model, data = sensitive_llama_and_data()
    model = model.to(CUDA, torch.bfloat16)
    runs = []
    for compile_kernels, checkpointing in ((True, False), (False, False), (True, True)):
        settings = CalibrationSettings(
            method=method,
            target_bits=5.0,
            num_samples=len(data),
            seq_len=data.shape[1],
            batch_size=4,
            steps=3,
            gradient_checkpointing=checkpointing,
        )
        set_compile_enabled(compile_kernels)
        try:
            runs.append(calibrate(copy.deepcopy(model), data, settings, progress=False))
        finally:
            set_compile_enabled(None)
    first = runs[0]
    assert first.bits_weighted <= 5.0 + BUDGET_TOLERANCE
    for other in runs[1:]:
        assert other.format_map == first.format_map
        assert other.beta_hat == first.beta_hat
        assert [h["loss"] for h in other.history] == [h["loss"] for h in first.history]


def test_gptq_rounding_on_cuda_in_bfloat16_beats_round_to_nearest(compiled, tiny_llama_dir):
    """`weight_rounding="gptq"` with a given uniform MXFP4 map on a bfloat16 model on the GPU: every layer is rounded
    on the device (a singular Hessian would warn) and the logits are closer to the float model's than
    round-to-nearest's."""
    import warnings

    tokenizer, texts = word_tokenizer(), _texts()
    ids = INPUT_IDS.to(CUDA)
    float_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, device_map="cuda")
    names = [n for n, m in float_model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        reference = float_model(ids).logits.float()
    errors = {}
    for rounding in ("rtn", "gptq"):
        config = DMXConfig(
            format_map=dict.fromkeys(names, "mxfp4_e2m1"),
            weight_rounding=rounding,
            dataset=texts,
            tokenizer=tokenizer,
            num_samples=8,
            seq_len=16,
            batch_size=4,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            model = AutoModelForCausalLM.from_pretrained(
                tiny_llama_dir, dtype=torch.bfloat16, device_map="cuda", quantization_config=config
            )
        assert all(b.device.type == "cuda" for b in model.buffers())
        with torch.no_grad():
            errors[rounding] = (model(ids).logits.float() - reference).pow(2).mean().item()
    assert errors["gptq"] < errors["rtn"], errors
