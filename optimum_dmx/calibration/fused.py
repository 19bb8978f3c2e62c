"""Fused continuous MX quantizer for calibration: the forward values of `quantize_mx_continuous`, bit for bit,
with closed-form gradients instead of an autograd graph.

`optimum_dmx.continuous.quantize_mx_continuous` builds a graph of about twenty element-wise nodes, each
keeping its inputs for the backward pass. Calibration only needs two gradients, and both have closed forms
(DESIGN section 2):

* with respect to `beta` (a scalar), the per-element derivative `dy/dbeta` is computed during the forward
  pass and reduced against the incoming gradient in the backward pass (one dot product);
* with respect to `x` (needed for activations, so that gradients reach earlier layers), the straight-through
  derivative is `y/x` in the normal range, 1 in the subnormal range and 0 where the value saturates.

Weights are frozen during calibration, so their block exponents can be computed once and passed back in
(`block_exponent`), and no input gradient is computed for them.
"""

from __future__ import annotations

import math

import torch

from ..continuous import FormatPair, get_format_pair
from ..formats import block_max_exponent, to_blocks, validate_block_size, validate_input


_LN2 = math.log(2.0)
_FP32_MANTISSA_BITS = 23


def _format_parameters(pair: FormatPair, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`(e, m, qmax)` at `beta` (detached, computed exactly as the reference does) and their derivatives."""
    with torch.enable_grad():
        b = beta.detach().to(torch.float32).requires_grad_(True)
        params = (pair.exponent_bits(b), pair.mantissa_bits(b), pair.max_normal(b))
        derivatives = [torch.autograd.grad(p, b, retain_graph=True)[0] for p in params]
    return (*(p.detach() for p in params), *derivatives)


def _quantize(x, beta, pair, block_size, block_exponent, want_x_grad, want_beta_grad):
    """Forward values `y` and, when asked for, the per-element derivatives `dy/dx` and `dy/dbeta`."""
    e, m, qmax, de, dm, dqmax = _format_parameters(pair, beta)
    half_range = torch.exp2(e - 1)  # 2^(e-1): the scale offset and, minus one, the exponent bias
    e_min = 1 - (half_range - 1) - m

    blocks = to_blocks(x, block_size)
    floor_log2, finite = block_exponent if block_exponent is not None else block_max_exponent(blocks)
    scale = torch.exp2((floor_log2 - half_range).clamp(-127, 127)).masked_fill_(~finite, math.nan)
    v = blocks / scale

    # Element exponent floor(log2|v|) from the float32 exponent field, then the grid step 2^eta.
    exponent = ((v.view(torch.int32) >> _FP32_MANTISSA_BITS) & 0xFF).sub_(127).float().sub_(m)
    subnormal = exponent < e_min
    step = torch.maximum(exponent, e_min).exp2_()
    q = (v / step).round_().mul_(step)
    # Saturation exactly as the reference: strictly above qmax, or rounded onto qmax from above.
    magnitude = q.abs()
    clipped = (magnitude > qmax) | ((magnitude == qmax) & (v.abs() > qmax))
    y = torch.where(clipped, torch.copysign(qmax, v), q)

    d_x = d_beta = None
    if want_beta_grad:
        # dQ/dbeta: ln2 (v - Q) (dm/dbeta + [subnormal] 2^(e-1) ln2 de/dbeta), or +-dqmax/dbeta when saturated.
        per_element = torch.where(subnormal, (dm + de * half_range * _LN2) * _LN2, dm * _LN2)
        d_beta = (v - q).mul_(per_element)
        d_beta = _unblock(torch.where(clipped, torch.copysign(dqmax, v), d_beta).mul_(scale), x.shape)
    if want_x_grad:
        d_x = _unblock(torch.where(subnormal, 1.0, q / v).masked_fill_(clipped, 0.0), x.shape)
    return _unblock(y.mul_(scale), x.shape).to(x.dtype), d_x, d_beta


class _FusedContinuousMX(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta, pair, block_size, block_exponent):
        want_x_grad, want_beta_grad = ctx.needs_input_grad[:2]
        y, d_x, d_beta = _quantize(x, beta, pair, block_size, block_exponent, want_x_grad, want_beta_grad)
        empty = torch.empty(0)
        ctx.save_for_backward(d_x if want_x_grad else empty, d_beta if want_beta_grad else empty)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        d_x, d_beta = ctx.saved_tensors
        want_x_grad, want_beta_grad = ctx.needs_input_grad[:2]
        grad = grad_y.float()
        grad_beta = torch.dot(grad.reshape(-1), d_beta.reshape(-1)) if want_beta_grad else None
        grad_x = (grad * d_x).to(grad_y.dtype) if want_x_grad else None
        return grad_x, grad_beta, None, None, None


def _unblock(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Undo `to_blocks`: `[*leading, n_blocks, block_size]` -> `shape` (contiguous)."""
    flat = blocks.reshape(*shape[:-1], -1)
    return flat if flat.shape[-1] == shape[-1] else flat[..., : shape[-1]].contiguous()


def weight_block_exponent(weight: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block `floor(log2 max|block|)` and finiteness of a frozen tensor, to pass as `block_exponent`."""
    return block_max_exponent(to_blocks(weight.detach(), block_size))


def quantize_mx_continuous_fused(
    x: torch.Tensor,
    beta: torch.Tensor,
    pair: str | FormatPair,
    block_size: int = 32,
    block_exponent: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Same values as `quantize_mx_continuous(x, beta, pair, block_size)`, with fused closed-form gradients.

    Args:
        x: tensor to quantize along its last dimension (float32, bfloat16 or float16).
        beta: scalar format offset in [0, 2] (a 0-dim tensor, usually requiring grad).
        pair: format pair name or `FormatPair`.
        block_size: elements per shared scale.
        block_exponent: precomputed `weight_block_exponent(x, block_size)` for a frozen `x`.
    """
    pair = get_format_pair(pair)
    block_size = validate_block_size(block_size)
    validate_input(x)
    if not isinstance(beta, torch.Tensor) or beta.dim() != 0:
        raise ValueError(f"beta must be a 0-dim tensor, got {beta!r}.")
    if torch.is_grad_enabled() and (x.requires_grad or beta.requires_grad):
        return _FusedContinuousMX.apply(x, beta, pair, block_size, block_exponent)
    return _quantize(x, beta, pair, block_size, block_exponent, False, False)[0]
