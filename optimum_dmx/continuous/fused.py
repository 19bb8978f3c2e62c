"""Fused continuous MX quantizer: the forward values of :func:`~.reference.quantize_mx_continuous`, bit for
bit, with closed-form gradients instead of an autograd graph.

The reference builds a graph of about twenty element-wise nodes, each keeping its inputs for the backward
pass. Calibration needs two gradients, and both have closed forms (``docs/method.md``):

* with respect to ``beta`` (a scalar), the per-element derivative ``dy/dbeta`` is computed during the
  forward pass and reduced against the incoming gradient in the backward pass (one dot product);
* with respect to ``x`` (needed for activations, so that gradients reach earlier layers), the
  straight-through derivative is ``y/x`` in the normal range, 1 in the subnormal range and 0 where the
  value saturates.

Weights are frozen during calibration, so their block maxima can be computed once and passed back in
(``block_amax``), and no input gradient is computed for them. At a fixed offset (the endpoints the default
recipe probes) a frozen weight's whole quantization is constant: ``FrozenQuantization`` computes its values and
``dy/dbeta`` once and reuses them every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats.blocks import block_max, block_max_exponent, block_scale, floor_log2, from_blocks, shared_exponent
from ..formats.blocks import to_blocks
from ..formats.blocks import validate_input
from ..formats.spec import grid_exponent, validate_block_size, validate_scale_rule
from .pairs import FormatPair, get_format_pair

__all__ = ["FrozenQuantization", "quantize_mx_continuous_fused", "weight_block_max"]

_LN2 = math.log(2.0)


def _format_parameters(pair: FormatPair, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The pair's ``(e, m, e_min, qmax, scale offset)`` at ``beta`` (detached, computed exactly as the
    reference does) and the derivatives of ``e``, ``m`` and ``qmax`` with respect to ``beta``."""
    with torch.enable_grad():
        b = beta.detach().to(torch.float32).requires_grad_(True)
        e, m, qmax = pair.exponent_bits(b), pair.mantissa_bits(b), pair.max_normal(b)
        derivatives = [torch.autograd.grad(p, b, retain_graph=True)[0] for p in (e, m, qmax)]
        values = (e, m, pair.step_exponent_min(b), qmax, pair.scale_offset(b))
    return (*(v.detach() for v in values), *derivatives)


def _quantize(x, beta, pair, block_size, scale_rule, block_amax, want_x_grad, want_beta_grad):
    """Forward values ``y`` and, when asked for, the per-element derivatives ``dy/dx`` and ``dy/dbeta``."""
    e, m, e_min, qmax, scale_offset, de, dm, dqmax = _format_parameters(pair, beta)

    blocks = to_blocks(x, block_size)
    amax = block_amax if block_amax is not None else block_max(blocks)
    exponent = block_max_exponent(amax, pair.scale_rounding_bits(beta.detach().float(), scale_rule))
    scale = block_scale(shared_exponent(*exponent, scale_offset))
    v = blocks / scale

    normal_exponent = floor_log2(v).float()
    eta = grid_exponent(normal_exponent, m, e_min)
    subnormal = normal_exponent - m < e_min
    step = eta.exp2_()
    q = (v / step).round_().mul_(step)
    # Saturation exactly as the reference: strictly above qmax, or rounded onto qmax from above.
    magnitude = q.abs()
    clipped = (magnitude > qmax) | ((magnitude == qmax) & (v.abs() > qmax))
    y = torch.where(clipped, torch.copysign(qmax, v), q)

    d_x = d_beta = None
    if want_beta_grad:
        # dQ/dbeta: ln2 (v - Q) (dm/dbeta + [subnormal] 2^(e-1) ln2 de/dbeta), or +-dqmax/dbeta when saturated.
        per_element = torch.where(subnormal, (dm + de * scale_offset * _LN2) * _LN2, dm * _LN2)
        d_beta = (v - q).mul_(per_element)
        d_beta = from_blocks(torch.where(clipped, torch.copysign(dqmax, v), d_beta).mul_(scale), x.shape)
    if want_x_grad:
        d_x = from_blocks(torch.where(subnormal, 1.0, q / v).masked_fill_(clipped, 0.0), x.shape)
    return from_blocks(y.mul_(scale), x.shape).to(x.dtype), d_x, d_beta


class _FusedContinuousMX(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta, pair, block_size, scale_rule, block_amax):
        want_x_grad, want_beta_grad = ctx.needs_input_grad[:2]
        y, d_x, d_beta = _quantize(x, beta, pair, block_size, scale_rule, block_amax, want_x_grad, want_beta_grad)
        empty = torch.empty(0)
        ctx.save_for_backward(d_x if want_x_grad else empty, d_beta if want_beta_grad else empty)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        d_x, d_beta = ctx.saved_tensors
        want_x_grad, want_beta_grad = ctx.needs_input_grad[:2]
        grad = grad_y.float()
        grad_beta = _beta_gradient(grad, d_beta) if want_beta_grad else None
        grad_x = (grad * d_x).to(grad_y.dtype) if want_x_grad else None
        return grad_x, grad_beta, None, None, None, None


def _beta_gradient(grad_y: torch.Tensor, d_beta: torch.Tensor) -> torch.Tensor:
    """``dL/dbeta = sum(dL/dy * dy/dbeta)``: the chain rule for a scalar offset shared by every element."""
    return torch.dot(grad_y.reshape(-1), d_beta.reshape(-1))


class _PrecomputedContinuousMX(torch.autograd.Function):
    """Attaches precomputed values and ``dy/dbeta`` of a frozen tensor to the graph of ``beta``."""

    @staticmethod
    def forward(ctx, beta, values, d_beta):
        ctx.save_for_backward(d_beta)
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad_y):
        (d_beta,) = ctx.saved_tensors
        return _beta_gradient(grad_y.float(), d_beta), None, None


@dataclass(frozen=True)
class FrozenQuantization:
    """A frozen tensor's continuous quantization at one offset, computed once and reused.

    ``values`` equal ``quantize_mx_continuous_fused(x, beta, ...)`` bit for bit, and calling the object with a
    ``beta`` tensor of the same value returns them with the same gradient with respect to ``beta`` (from the stored
    ``d_beta``, kept only when built ``with_beta_grad``). It trades memory (one or two float32 copies of the
    tensor) for the quantizer's whole cost on every later use, which is what calibration wants for its frozen
    weights at the offsets it revisits.
    """

    offset: float
    values: torch.Tensor
    d_beta: torch.Tensor | None

    @classmethod
    def compute(
        cls, x: torch.Tensor, offset: float, pair: str | FormatPair, block_size: int = 32, scale_rule: str = "ocp",
        block_amax: torch.Tensor | None = None, with_beta_grad: bool = True,
    ) -> "FrozenQuantization":
        pair = get_format_pair(pair)
        beta = torch.tensor(float(offset), device=x.device)
        with torch.no_grad():
            values, _, d_beta = _quantize(x.detach(), beta, pair, block_size, scale_rule, block_amax, False, with_beta_grad)
        return cls(float(offset), values, d_beta)

    def __call__(self, beta: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and beta.requires_grad:
            if self.d_beta is None:
                raise RuntimeError("this FrozenQuantization was computed without dy/dbeta (with_beta_grad=False).")
            return _PrecomputedContinuousMX.apply(beta, self.values, self.d_beta)
        return self.values


def weight_block_max(weight: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """Per-block ``max|block|`` of a frozen tensor (float32), to pass as ``block_amax``."""
    return block_max(to_blocks(weight.detach(), block_size))


def quantize_mx_continuous_fused(
    x: torch.Tensor,
    beta: torch.Tensor,
    pair: str | FormatPair,
    block_size: int = 32,
    scale_rule: str = "ocp",
    block_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same values as ``quantize_mx_continuous(x, beta, pair, block_size, scale_rule)``, with fused closed-form
    gradients.

    Args:
        x: tensor to quantize along its last dimension (float32, bfloat16 or float16).
        beta: scalar format offset in [0, 2] (a 0-dim tensor, usually requiring grad).
        pair: format pair name or ``FormatPair``.
        block_size: elements per shared scale.
        scale_rule: block-scale rule (``formats.spec.SCALE_RULES``).
        block_amax: precomputed ``weight_block_max(x, block_size)`` for a frozen ``x``.
    """
    pair = get_format_pair(pair)
    block_size = validate_block_size(block_size)
    validate_scale_rule(scale_rule)
    validate_input(x)
    if not isinstance(beta, torch.Tensor) or beta.dim() != 0:
        raise ValueError(f"beta must be a 0-dim tensor, got {beta!r}.")
    if torch.is_grad_enabled() and (x.requires_grad or beta.requires_grad):
        return _FusedContinuousMX.apply(x, beta, pair, block_size, scale_rule, block_amax)
    return _quantize(x, beta, pair, block_size, scale_rule, block_amax, False, False)[0]
