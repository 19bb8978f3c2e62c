"""The fused calibration quantizer against the autograd reference `quantize_mx_continuous`."""

import pytest
import torch
from torch.nn import functional as F

from optimum_dmx.calibration import DMXLinear, EndpointProbe, RelaxedOffset
from optimum_dmx.continuous import (
    FORMAT_PAIRS,
    ContinuousQuantization,
    FrozenWeightQuantization,
    quantize_mx_continuous,
    quantize_mx_continuous_fused,
    weight_block_max,
)
from optimum_dmx.continuous.fused import _pairwise_sum
from optimum_dmx.formats import SCALE_RULES, quantize_mx

BETAS = [0.0, 0.2, 0.5, 0.999, 1.0, 1.37, 1.8, 2.0]


def sample(shape, dtype, seed=0):
    """Gaussian blocks with per-row magnitudes over 8 decades, exact zeros and a tie-heavy row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[0]).unsqueeze(-1)
    x[0, : shape[1] // 3] = 0.0
    x[1] = torch.randint(-12, 13, (shape[1],), generator=g) * 0.25
    return x.to(dtype)


def both(x, beta, pair, block_size=32, scale_rule="ocp"):
    """Values and gradients (w.r.t. x and beta) of the reference and of the fused quantizer."""
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    results = []
    for fn in (quantize_mx_continuous, quantize_mx_continuous_fused):
        xi = x.clone().requires_grad_(True)
        b = torch.tensor(beta, requires_grad=True)
        y = fn(xi, b, pair, block_size, scale_rule)
        (y.float() * grad_out.float()).sum().backward()
        results.append((y.detach(), xi.grad, b.grad))
    return results, grad_out


@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_values_bit_identical_and_gradients_close(pair, dtype, beta, scale_rule):
    x = sample((24, 96), dtype)
    ((ref_y, ref_gx, ref_gb), (fused_y, fused_gx, fused_gb)), grad_out = both(x, beta, pair, scale_rule=scale_rule)
    assert fused_y.dtype == x.dtype
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(fused_y.view(bits), ref_y.view(bits))
    torch.testing.assert_close(fused_gx, ref_gx, rtol=1e-4, atol=1e-5)
    # beta's gradient is a sum of many signed terms: compare relative to the sum of their magnitudes.
    scale = (grad_out.float().abs() * (x.float().abs() + 1e-30)).sum().item()
    assert abs(fused_gb.item() - ref_gb.item()) <= 1e-5 * scale
    assert fused_gb.item() != 0.0


@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_integer_endpoints_equal_the_exact_mx_quantizer(pair, scale_rule):
    x = sample((16, 64), torch.float32)
    p = FORMAT_PAIRS[pair]
    for beta, fmt in ((0.0, p.low), (2.0, p.high)):
        fused = quantize_mx_continuous_fused(x, torch.tensor(beta), pair, scale_rule=scale_rule)
        assert torch.equal(fused, quantize_mx(x, fmt, scale_rule=scale_rule))


@pytest.mark.parametrize("last_dim", [40, 70])
def test_padded_last_block_and_leading_dims(last_dim):
    x = sample((12, last_dim), torch.float32).view(3, 4, last_dim)
    ((ref_y, ref_gx, ref_gb), (fused_y, fused_gx, fused_gb)), _ = both(x, 0.7, "mxfp8-mxfp4")
    assert torch.equal(fused_y, ref_y) and fused_y.shape == x.shape
    torch.testing.assert_close(fused_gx, ref_gx, rtol=1e-4, atol=1e-5)
    assert fused_gb.item() == pytest.approx(ref_gb.item(), rel=1e-4)


@pytest.mark.parametrize("block_size", [1, 2, 5, 16, 32, 33, 47])
def test_the_gradient_kernels_block_sums_add_every_element_once(block_size):
    """`dL/dbeta` is reduced per block in a fixed pairwise order (`_pairwise_sum`), odd lengths included: on
    integers, which add exactly in any order, it equals a plain sum."""
    t = torch.randint(-1000, 1000, (3, 4, block_size), generator=torch.Generator().manual_seed(0)).float()
    assert torch.equal(_pairwise_sum(t), t.sum(-1))


@pytest.mark.parametrize("block_size", [16, 24, 32])
def test_block_sizes_other_than_32_get_the_same_gradients(block_size):
    x = sample((6, 96), torch.float32)
    ((ref_y, ref_gx, ref_gb), (fused_y, fused_gx, fused_gb)), _ = both(x, 2.0, "mxfp8-mxfp4", block_size=block_size)
    assert torch.equal(fused_y, ref_y)
    torch.testing.assert_close(fused_gx, ref_gx, rtol=1e-4, atol=1e-5)
    assert fused_gb.item() == pytest.approx(ref_gb.item(), rel=1e-4)


def test_cached_block_exponent_and_no_grad_path_give_the_same_values():
    w = sample((32, 64), torch.float32)
    beta = torch.tensor(1.3)
    reference = quantize_mx_continuous(w, beta, "mxfp8-mxfp4")
    cached = quantize_mx_continuous_fused(w, beta, "mxfp8-mxfp4", block_amax=weight_block_max(w))
    with torch.no_grad():
        no_grad = quantize_mx_continuous_fused(w, beta.requires_grad_(True), "mxfp8-mxfp4")
    assert torch.equal(cached, reference) and torch.equal(no_grad, reference)


def test_frozen_input_gets_no_gradient_but_beta_does():
    w = sample((8, 64), torch.float32)
    beta = torch.tensor(0.4, requires_grad=True)
    quantize_mx_continuous_fused(w, beta, "mxfp6-mxfp4").sum().backward()
    assert w.grad is None and beta.grad is not None


def test_nan_block_stays_nan():
    x = sample((4, 64), torch.float32)
    x[2, 5] = float("nan")
    y = quantize_mx_continuous_fused(x, torch.tensor(0.6), "mxfp8-mxfp4")
    assert y[2, :32].isnan().all() and not y[2, 32:].isnan().any() and not y[[0, 1, 3]].isnan().any()


def test_beta_must_be_a_scalar_tensor():
    with pytest.raises(ValueError, match="0-dim"):
        quantize_mx_continuous_fused(torch.ones(4, 32), torch.ones(2), "mxfp8-mxfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
def test_dmx_linear_matches_the_reference_layer(dtype, pair):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(dtype)
    layer = DMXLinear(linear, pair, offset=RelaxedOffset(8.0))
    assert layer.weight is linear.weight and layer.bias is linear.bias
    layer.beta_hat.data.fill_(0.9)
    x = torch.randn(5, 7, 64, dtype=dtype, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()

    beta_hat = torch.tensor(0.9, requires_grad=True)
    beta = 2 * torch.sigmoid(8.0 * (beta_hat / 2 - 0.5))
    x_ref = x.detach().clone().requires_grad_(True)
    w = quantize_mx_continuous(linear.weight.detach(), beta, pair)
    y_ref = F.linear(quantize_mx_continuous(x_ref, beta, pair), w, linear.bias.detach())
    y_ref.float().square().sum().backward()

    assert y.dtype == dtype and torch.equal(y, y_ref)
    assert layer.beta_hat.grad.item() == pytest.approx(beta_hat.grad.item(), rel=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-3, atol=1e-5)


def test_dmx_linear_discrete_format_and_relaxed_offset():
    layer = DMXLinear(torch.nn.Linear(32, 8), "mxfp6-mxfp4")
    assert layer.discrete_format.name == "mxfp4_e2m1"
    layer.beta_hat.data.fill_(1.0)
    assert layer.discrete_format.name == "mxfp6_e2m3" and layer.beta().item() == 1.0  # F(1, T) = 1
    assert layer.element_bits().item() == 5.0
    layer.element_bits().backward()
    assert layer.beta_hat.grad.item() == pytest.approx(8.0 / 4)  # dF/dbeta_hat at 1 is T / 4 (T = 8)


@pytest.mark.parametrize("endpoint, fmt", [(0.0, "mxfp4_e2m1"), (2.0, "mxfp6_e2m3")])
def test_an_endpoint_probe_runs_the_exact_format_and_reads_the_offsets_derivative(endpoint, fmt):
    torch.manual_seed(0)
    probe = EndpointProbe()
    layer = DMXLinear(torch.nn.Linear(32, 8), "mxfp6-mxfp4", offset=probe)
    with pytest.raises(RuntimeError, match="set"):
        layer(torch.randn(3, 32))
    probe.set(endpoint, torch.device("cpu"), measure=True)
    x = torch.randn(3, 32)
    y = layer(x)
    torch.testing.assert_close(
        y, F.linear(quantize_mx(x, fmt), quantize_mx(layer.weight, fmt), layer.bias), rtol=0, atol=1e-6
    )
    y.square().sum().backward()
    beta = torch.tensor(endpoint, requires_grad=True)
    y_ref = F.linear(
        quantize_mx_continuous(x, beta, "mxfp6-mxfp4"),
        quantize_mx_continuous(layer.weight.detach(), beta, "mxfp6-mxfp4"),
        layer.bias.detach(),
    )
    y_ref.square().sum().backward()
    assert probe.gain().item() == pytest.approx(-beta.grad.item(), rel=1e-4)


@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 0.7, 2.0])
def test_a_computed_quantization_attaches_the_same_values_and_gradients(pair, dtype, offset):
    """`ContinuousQuantization` computed once and attached twice gives what the fused quantizer gives each time:
    the same values, `dL/dx` and `dL/dbeta`, bit for bit (an activation: gradients to both; a frozen weight:
    to `beta` only), and the values alone where no gradient is wanted."""
    x = sample((16, 96), dtype)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)

    def values_and_grads(quantize, x_needs_grad=True):
        xi, beta = x.clone().requires_grad_(x_needs_grad), torch.tensor(offset, requires_grad=True)
        y = quantize(xi, beta)
        return (y.detach(), *torch.autograd.grad((y * grad_out).sum(), (xi, beta) if x_needs_grad else (beta,)))

    for frozen in (False, True):
        amax = weight_block_max(x) if frozen else None
        expected = values_and_grads(
            lambda xi, beta: quantize_mx_continuous_fused(xi, beta, pair, block_amax=amax), not frozen
        )
        once = ContinuousQuantization.compute(x, offset, pair, block_amax=amax)
        for _ in range(2):
            got = values_and_grads(once.attach, not frozen)
            assert all(torch.equal(g, e) for g, e in zip(got, expected)) and got[0].dtype == dtype
        assert once.attach(x, torch.tensor(offset)) is once.values  # nothing needs a gradient: no graph


@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 2.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_frozen_weight_quantization_gives_the_linear_layer_bit_for_bit(pair, dtype, offset, with_bias):
    """`FrozenWeightQuantization.linear` (bfloat16 values, `dy/dbeta` recomputed in the backward pass) against
    `F.linear` with the float32 quantization attached: the same output, `dL/dx` and `dL/dbeta`, bit for bit."""
    weight = sample((48, 96), torch.float32, seed=4)
    bias = torch.randn(48).to(dtype) if with_bias else None
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(5)).to(dtype)
    grad_out = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(6)).to(dtype)
    amax = weight_block_max(weight)

    def output_and_grads(linear):
        xi, beta = x.clone().requires_grad_(True), torch.tensor(offset, requires_grad=True)
        y = linear(xi, beta)
        return (y.detach(), *torch.autograd.grad((y * grad_out).sum(), (xi, beta)))

    attached = ContinuousQuantization.compute(weight, offset, pair, block_amax=amax)
    expected = output_and_grads(lambda xi, beta: F.linear(xi, attached.attach(weight, beta).to(dtype), bias))
    frozen = FrozenWeightQuantization.compute(weight, offset, pair, block_amax=amax)
    assert frozen.values.dtype == torch.bfloat16  # MX values are exact in bfloat16: half the memory
    for _ in range(2):
        got = output_and_grads(lambda xi, beta: frozen.linear(xi, beta, bias))
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), pair


def test_a_frozen_weight_keeps_float32_values_where_bfloat16_would_round_them():
    """MXFP8 values of a block of tiny weights (scale 2^-127, steps down to 2^-136) are below bfloat16's subnormal
    steps (2^-133): not exact in bfloat16, so kept in float32. MXFP4's steps never go below 2^-128."""
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    weight[2] = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 2.0**-122
    weight[2, :4] = 3 * 2.0**-136  # an E4M3 subnormal at that scale: a float32 subnormal, not a bfloat16 one
    for offset, kept in ((2.0, torch.float32), (0.0, torch.bfloat16)):
        frozen = FrozenWeightQuantization.compute(weight, offset, "mxfp8-mxfp4")
        assert frozen.values.dtype == kept
        expected = quantize_mx_continuous_fused(weight, torch.tensor(offset), "mxfp8-mxfp4")
        assert torch.equal(frozen.values.float(), expected)


def test_a_quantization_attaches_only_to_the_tensor_it_was_computed_from():
    quantization = ContinuousQuantization.compute(sample((4, 64), torch.float32), 2.0, "mxfp8-mxfp4")
    with pytest.raises(ValueError, match=r"computed from, of shape \(4, 64\); got shape \(4, 32\)"):
        quantization.attach(torch.zeros(4, 32, requires_grad=True), torch.tensor(2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_activation_keeps_only_its_input_for_the_backward_pass(dtype):
    """The derivatives are recomputed in the backward pass: the graph holds `x` (already alive as the layer's
    input), not two float32 tensors of its size (`dy/dx`, `dy/dbeta`)."""
    x = sample((8, 96), dtype).requires_grad_(True)
    beta = torch.tensor(2.0, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = quantize_mx_continuous_fused(x, beta, "mxfp8-mxfp4")
    assert [t.numel() for t in saved if t.numel() > 1] == [x.numel()] and saved[0].data_ptr() == x.data_ptr()
    y.sum().backward()
    assert x.grad is not None and beta.grad is not None
