"""Continuous quantizer: exact at the integer endpoints, closed-form gradients, finite gradients, pairs."""

import math

import pytest
import torch

from optimum_dmx.continuous import FORMAT_PAIRS, float_quantize, get_format_pair, quantize_mx_continuous
from optimum_dmx.formats import MX_FORMATS, SCALE_RULES, quantize_mx

from .helpers import adversarial_blocks, assert_bitwise_equal, wide_range

LN2 = math.log(2)
ENDPOINTS = [
    ("mxfp8-mxfp4", 0, "mxfp4_e2m1"),
    ("mxfp8-mxfp4", 1, "mxfp6_e3m2"),
    ("mxfp8-mxfp4", 2, "mxfp8_e4m3"),
    ("mxfp6-mxfp4", 0, "mxfp4_e2m1"),
    ("mxfp6-mxfp4", 2, "mxfp6_e2m3"),
]


# --- the pairs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair, beta, fmt", ENDPOINTS)
def test_pair_endpoints_are_mx_formats(pair, beta, fmt):
    p = FORMAT_PAIRS[pair]
    assert p.format_at(beta) is MX_FORMATS[fmt]
    assert p.element_bits(beta) == MX_FORMATS[fmt].bits
    assert p.max_normal(torch.tensor(float(beta))).item() == MX_FORMATS[fmt].max_normal


def test_pair_bit_ranges_and_maps():
    fp8, fp6 = FORMAT_PAIRS["mxfp8-mxfp4"], FORMAT_PAIRS["mxfp6-mxfp4"]
    assert (fp8.min_bits, fp8.max_bits, fp6.min_bits, fp6.max_bits) == (4.0, 8.0, 4.0, 6.0)
    assert (fp8.exponent_bits(0.5), fp8.mantissa_bits(0.5), fp8.element_bits(0.5)) == (2.5, 1.5, 5.0)
    assert (fp6.exponent_bits(0.5), fp6.mantissa_bits(0.5), fp6.element_bits(0.5)) == (2, 1.5, 4.5)
    with pytest.raises(ValueError, match="E2M2, which is not an MX format"):
        fp6.format_at(1)


def test_max_normal_is_continuous_and_increasing_along_the_fp8_path():
    betas = torch.linspace(0, 2, 201)
    qmax = torch.stack([FORMAT_PAIRS["mxfp8-mxfp4"].max_normal(b) for b in betas])
    assert bool((qmax[1:] > qmax[:-1]).all())
    assert (qmax[1:] / qmax[:-1]).max() < 1.05  # no jump, e.g. none at beta = 1 where the E4M3 correction starts


def test_unknown_pair_and_bad_beta():
    allowed = "allowed: mxfp8-mxfp4, mxfp6-mxfp4"
    with pytest.raises(ValueError, match=f"format_pair='mxfp8-mxfp6' is not supported; {allowed}"):
        get_format_pair("mxfp8-mxfp6")
    with pytest.raises(ValueError, match="beta must be a scalar"):
        quantize_mx_continuous(torch.randn(32), torch.zeros(2), "mxfp8-mxfp4")
    with pytest.raises(TypeError, match="got dtype torch.int64"):
        quantize_mx_continuous(torch.ones(32, dtype=torch.long), 0.0, "mxfp8-mxfp4")


# --- exactness at the endpoints -----------------------------------------------------------------------


@pytest.mark.parametrize("pair, beta, fmt", ENDPOINTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_endpoints_equal_exact_mx_bit_for_bit(pair, beta, fmt, dtype, scale_rule):
    x = torch.cat([wide_range((64, 512), seed=beta, decades=10).reshape(-1, 32), adversarial_blocks(MX_FORMATS[fmt])])
    x = x.to(dtype)
    exact = quantize_mx(x, fmt, scale_rule=scale_rule)
    assert_bitwise_equal(quantize_mx_continuous(x, float(beta), pair, scale_rule=scale_rule), exact)


@pytest.mark.parametrize("pair, beta, fmt", ENDPOINTS)
def test_endpoints_exact_with_nan_blocks_and_padding(pair, beta, fmt):
    x = wide_range((3, 96), seed=7, decades=3)[:, :70].contiguous()
    x[1, 40] = math.nan
    x[2, 3] = -math.inf
    assert_bitwise_equal(quantize_mx_continuous(x, torch.tensor(float(beta)), pair), quantize_mx(x, fmt))


def test_intermediate_beta_lies_between_neighbouring_grids():
    """Quantization error shrinks as the format widens along the MXFP8 path (on Gaussian data)."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    errors = [(quantize_mx_continuous(x, b, "mxfp8-mxfp4") - x).pow(2).mean().item() for b in (0.0, 0.5, 1.0, 1.5, 2.0)]
    assert errors == sorted(errors, reverse=True)


# --- closed-form gradients (docs/method.md) --------------------------------------------------------------


def dense_grid() -> torch.Tensor:
    """Inputs over the subnormal (|x| < 1), normal (1 <= |x| <= 7) and clipped ranges of E2M2, both signs."""
    x = torch.linspace(0.003, 12.0, 4001, dtype=torch.float64).float()
    return torch.cat([x, -x])


def inner_gradients(x, e, m, qmax=None):
    """Per-element autograd dQ/de and dQ/dm of the inner quantizer (e and m broadcast to x's shape)."""
    e = torch.full_like(x, e, requires_grad=True)
    m = torch.full_like(x, m, requires_grad=True)
    q = float_quantize(x, e, m, qmax)
    q.sum().backward()
    return q.detach(), e.grad, m.grad


def regimes(x, e, m):
    b = 2 ** (e - 1) - 1
    qmax = (2 - 2**-m) * 2 ** (2**e - b - 1)
    clipped = x.abs() > qmax
    subnormal = torch.floor(torch.log2(x.abs().double())) < 1 - b
    return subnormal & ~clipped, ~subnormal & ~clipped, clipped, qmax


def test_inner_quantizer_values_at_e2_m2():
    x = dense_grid()
    q, _, _ = inner_gradients(x, 2.0, 2.0)
    grid = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7])  # E2M2 magnitudes
    assert torch.isin(q.abs(), grid).all()
    assert (q.abs() - x.abs()).abs()[x.abs() <= 7].max() <= 0.5


def test_gradient_wrt_m_matches_closed_form():
    e, m = 2.0, 2.0
    x = dense_grid()
    q, _, grad_m = inner_gradients(x, e, m)
    subnormal, normal, clipped, qmax = regimes(x, e, m)
    assert subnormal.sum() > 100 and normal.sum() > 100 and clipped.sum() > 100
    unclipped = subnormal | normal
    torch.testing.assert_close(grad_m[unclipped], LN2 * (x - q)[unclipped], rtol=1e-5, atol=1e-6)
    expected_clipped = torch.sign(x) * LN2 / (2 ** (m + 1) - 1) * qmax
    torch.testing.assert_close(grad_m[clipped], expected_clipped[clipped], rtol=1e-5, atol=1e-6)


def test_gradient_wrt_e_matches_closed_form():
    e, m = 2.0, 2.0
    x = dense_grid()
    q, grad_e, _ = inner_gradients(x, e, m)
    subnormal, normal, clipped, qmax = regimes(x, e, m)
    torch.testing.assert_close(grad_e[subnormal], 2 ** (e - 1) * LN2**2 * (x - q)[subnormal], rtol=1e-5, atol=1e-6)
    assert bool((grad_e[normal] == 0).all())
    expected_clipped = torch.sign(x) * LN2**2 * 2 ** (e - 1) * qmax
    torch.testing.assert_close(grad_e[clipped], expected_clipped[clipped], rtol=1e-5, atol=1e-6)
    assert (grad_e[subnormal] != 0).sum() > 100  # the subnormal form is exercised, not only its zeros


def beta_gradient(x, pair, beta):
    beta_t = torch.full_like(x, beta, requires_grad=True)
    q = float_quantize(x, pair.exponent_bits(beta_t), pair.mantissa_bits(beta_t), pair.max_normal(beta_t))
    q.sum().backward()
    return q.detach(), beta_t.grad


def test_gradient_wrt_beta_on_the_mxfp6_pair_at_e2_m2():
    """On the MXFP6 pair e is fixed and m = 1 + beta, so dQ/dbeta = dQ/dm; beta = 1 is E2M2."""
    x = dense_grid()
    pair = FORMAT_PAIRS["mxfp6-mxfp4"]
    _, grad_beta = beta_gradient(x, pair, 1.0)
    _, _, grad_m = inner_gradients(x, 2.0, 2.0)
    torch.testing.assert_close(grad_beta, grad_m, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.5, 1.5])
def test_gradient_wrt_beta_on_the_mxfp8_pair(beta):
    """e = 2 + beta and m = 1 + beta: dQ/dbeta = dQ/de + dQ/dm, plus the E4M3 saturation correction above beta = 1."""
    pair = FORMAT_PAIRS["mxfp8-mxfp4"]
    e, m = pair.exponent_bits(beta), pair.mantissa_bits(beta)
    qmax = pair.max_normal(torch.tensor(beta)).item()
    magnitudes = torch.logspace(-9, math.log2(qmax * 1.5), 3001, base=2)
    x = torch.cat([magnitudes, -magnitudes])
    q, grad_beta = beta_gradient(x, pair, beta)
    b = 2 ** (e - 1) - 1
    # Off the integer endpoints qmax is not on the grid, so Q = clip(ss * round(x / ss)) sits at qmax exactly
    # when the clip is active: an input just below qmax can round above it, one just above can round below.
    clipped = q.abs() == qmax
    subnormal = (torch.floor(torch.log2(x.abs().double())) < 1 - b) & ~clipped
    normal = ~subnormal & ~clipped
    expected = torch.zeros_like(x)
    expected[normal] = LN2 * (x - q)[normal]
    expected[subnormal] = (LN2 + 2 ** (e - 1) * LN2**2) * (x - q)[subnormal]
    lost = 1 + max(0.0, beta - 1)
    emax = 2 ** (e - 1)
    d_mantissa_factor = LN2 * 2**-m * lost - 2**-m * (beta > 1)
    d_qmax = d_mantissa_factor * 2**emax + (2 - 2**-m * lost) * 2**emax * LN2**2 * emax
    expected[clipped] = torch.sign(x[clipped]) * d_qmax
    assert subnormal.sum() > 50 and normal.sum() > 50 and clipped.sum() > 50
    torch.testing.assert_close(grad_beta, expected, rtol=1e-4, atol=1e-5)


# --- finite gradients through the block-scaled quantizer ----------------------------------------------


@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0, 1.7, 2.0])
def test_gradients_finite_for_finite_input(pair, beta):
    x = torch.cat([wide_range((4, 128), seed=3, decades=20).reshape(-1), torch.zeros(32), -torch.zeros(32)])
    x[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1e30, -1e30, 2.0**-126, 1.0])
    x[64:68] = torch.tensor([3e38, -3e38, 3.4e38, 1.0])  # per-element gradients stay finite at the top of fp32
    x = x.reshape(-1, 32).requires_grad_()
    beta_t = torch.tensor(beta, requires_grad=True)
    y = quantize_mx_continuous(x, beta_t, pair)
    weights = torch.randn_like(y)
    weights[2] = 0  # the loss itself would overflow on the 3e38 block; its input gradient is checked below
    (y * weights).sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(beta_t.grad) and beta_t.grad != 0
    x.grad = None
    quantize_mx_continuous(x, beta_t, pair).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_gradient_flows_to_beta_and_input_in_bfloat16():
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    beta = torch.tensor(0.4, requires_grad=True)
    y = quantize_mx_continuous(x, beta, "mxfp8-mxfp4")
    ((y.float() - x.detach().float()) ** 2).sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert beta.grad < 0  # more bits, less error


def test_block_scale_is_constant_for_the_gradient():
    """With the scale detached, d y / d x is the inner quantizer's Q(v)/v (STE round and floor)."""
    x = torch.tensor([[3.0, 0.7, -1.3, 0.0] + [0.1] * 28], requires_grad=True)
    quantize_mx_continuous(x, 1.0, "mxfp8-mxfp4").sum().backward()
    y = quantize_mx_continuous(x.detach(), 1.0, "mxfp8-mxfp4")
    nonzero = x.detach() != 0
    torch.testing.assert_close(x.grad[nonzero], (y / x.detach())[nonzero])
