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
(``block_amax``), and no input gradient is computed for them. The values and both derivatives are computed once
(``ContinuousQuantization``) and attached to the graph by a small autograd function, so work that does not change
between uses (an input several layers quantize alike) can be done once and attached many times. A frozen weight
at an offset revisited every step keeps only its values, in bfloat16 where that is exact, for the whole run
(``FrozenWeightQuantization``): its linear layer recomputes ``dy/dbeta`` in the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..formats.blocks import block_max, block_max_exponent, block_scale, floor_log2, from_blocks, shared_exponent
from ..formats.blocks import to_blocks
from ..formats.blocks import validate_input
from ..formats.cast import compiles
from ..formats.compilation import CompiledKernel
from ..formats.spec import grid_exponent, validate_block_size, validate_scale_rule
from .pairs import FormatPair, get_format_pair

__all__ = ["ContinuousQuantization", "FrozenWeightQuantization", "quantize_mx_continuous_fused", "weight_block_max"]

_LN2 = math.log(2.0)


def _format_parameters(pair: FormatPair, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The pair's ``(e, m, e_min, qmax, scale offset)`` at ``beta`` (detached, computed exactly as the
    reference does) and the derivatives of ``e``, ``m`` and ``qmax`` with respect to ``beta``."""
    # Own saved-tensor hooks: this small graph keeps its tensors even inside an activation-checkpointed layer, whose
    # hooks would otherwise recompute the whole layer when `autograd.grad` unpacks them. They keep detached aliases:
    # a hook that kept an output saved by its own node would make a cycle the garbage collector cannot see.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, lambda t: t):
        b = beta.detach().to(torch.float32).requires_grad_(True)
        e, m, qmax = pair.exponent_bits(b), pair.mantissa_bits(b), pair.max_normal(b)
        derivatives = [torch.autograd.grad(p, b, retain_graph=True)[0] for p in (e, m, qmax)]
        values = (e, m, pair.step_exponent_min(b), qmax, pair.scale_offset(b))
    return (*(v.detach() for v in values), *derivatives)


def _quantize(x, beta, pair, block_size, scale_rule, block_amax, want_x_grad, want_beta_grad):
    """Forward values ``y`` and, when asked for, the per-element derivatives ``dy/dx`` and ``dy/dbeta``."""
    _, m, e_min, qmax, scale_offset, de, dm, dqmax = _format_parameters(pair, beta)
    rounding_bits = pair.scale_rounding_bits(beta.detach().float(), scale_rule)
    # Compiled exp2 / pow differ from eager ones in the last bit for fractional exponents: only the pair's exact
    # formats (integer offsets, the default recipe's probes) run the compiled kernel, so results never depend on it.
    if not (compiles(x.shape[-1], block_size) and float(beta).is_integer()):
        return _quantize_elements.fn(x, block_amax, m, e_min, qmax, scale_offset, de, dm, dqmax, rounding_bits,
                                     block_size, want_x_grad, want_beta_grad)
    # As a matrix of rows: one kernel serves every number of rows (tokens) of a width.
    rows = x.reshape(-1, x.shape[-1])
    amax = None if block_amax is None else block_amax.reshape(rows.shape[0], -1, 1)
    outputs = _quantize_elements(rows, amax, m, e_min, qmax, scale_offset, de, dm, dqmax, rounding_bits, block_size,
                                 want_x_grad, want_beta_grad)
    return tuple(None if t is None else t.view(x.shape) for t in outputs)


@CompiledKernel
def _quantize_elements(x, block_amax, m, e_min, qmax, scale_offset, de, dm, dqmax, rounding_bits, block_size,
                       want_x_grad, want_beta_grad):
    """The element-wise part of ``_quantize`` at given format parameters (0-dim tensors): one fused kernel when
    compiled (``formats.compilation``), the same bits eagerly."""
    blocks = to_blocks(x, block_size)
    amax = block_amax if block_amax is not None else block_max(blocks)
    scale = block_scale(shared_exponent(*block_max_exponent(amax, rounding_bits), scale_offset))
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


def _beta_gradient(grad_y: torch.Tensor, d_beta: torch.Tensor) -> torch.Tensor:
    """``dL/dbeta = sum(dL/dy * dy/dbeta)``: the chain rule for a scalar offset shared by every element."""
    return torch.dot(grad_y.reshape(-1), d_beta.reshape(-1))


class _AttachContinuousMX(torch.autograd.Function):
    """Returns precomputed quantized values, attached to the graphs of ``x`` and ``beta`` by their stored
    derivatives ``dy/dx`` and ``dy/dbeta`` (elementwise): the backward pass is one product and one dot product."""

    @staticmethod
    def forward(ctx, x, beta, values, d_x, d_beta):
        want_x_grad, want_beta_grad = ctx.needs_input_grad[:2]
        empty = values.new_empty(0)
        ctx.save_for_backward(d_x if want_x_grad else empty, d_beta if want_beta_grad else empty)
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad_y):
        d_x, d_beta = ctx.saved_tensors
        want_x_grad, want_beta_grad = ctx.needs_input_grad[:2]
        grad = grad_y.float()
        grad_x = (grad * d_x).to(grad_y.dtype) if want_x_grad else None
        grad_beta = _beta_gradient(grad, d_beta) if want_beta_grad else None
        return grad_x, grad_beta, None, None, None


@dataclass(frozen=True)
class ContinuousQuantization:
    """One tensor's continuous quantization at one offset, computed once and attachable to the graph many times.

    ``values`` equal ``quantize_mx_continuous_fused(x, beta, ...)`` bit for bit, and ``attach(x, beta)`` returns them
    with the same gradients with respect to ``x`` and ``beta`` (from the stored ``d_x`` and ``d_beta``, kept only
    when computed ``with_x_grad`` / ``with_beta_grad``). Calibration uses it for work that does not change between
    uses: a frozen weight at an offset it revisits every step, and one input read by several layers (q/k/v,
    gate/up) at the same offset.
    """

    values: torch.Tensor
    d_x: torch.Tensor | None
    d_beta: torch.Tensor | None

    @classmethod
    def compute(
        cls, x: torch.Tensor, beta: torch.Tensor | float, pair: str | FormatPair, block_size: int = 32,
        scale_rule: str = "ocp", block_amax: torch.Tensor | None = None, with_x_grad: bool = False,
        with_beta_grad: bool = True,
    ) -> "ContinuousQuantization":
        pair = get_format_pair(pair)
        beta = torch.as_tensor(beta, dtype=torch.float32, device=x.device)
        with torch.no_grad():
            values, d_x, d_beta = _quantize(x.detach(), beta.detach(), pair, block_size, scale_rule, block_amax,
                                            with_x_grad, with_beta_grad)
        return cls(values, d_x, d_beta)

    def attach(self, x: torch.Tensor | None, beta: torch.Tensor) -> torch.Tensor:
        """The values, in the autograd graph of ``x`` (None: a frozen tensor) and ``beta`` where they need grad."""
        want_x_grad = x is not None and x.requires_grad and torch.is_grad_enabled()
        want_beta_grad = beta.requires_grad and torch.is_grad_enabled()
        for wanted, stored, name in ((want_x_grad, self.d_x, "with_x_grad"), (want_beta_grad, self.d_beta, "with_beta_grad")):
            if wanted and stored is None:
                raise RuntimeError(f"this ContinuousQuantization was computed without that derivative ({name}=False).")
        if not (want_x_grad or want_beta_grad):
            return self.values
        return _AttachContinuousMX.apply(x if want_x_grad else None, beta, self.values, self.d_x, self.d_beta)


class _FrozenWeightLinear(torch.autograd.Function):
    """``F.linear(x, W_q, bias)`` with ``W_q`` a frozen weight's quantization (``FrozenWeightQuantization``) at
    ``beta``. Only ``x`` is saved: the backward pass rebuilds ``W_q`` for ``dL/dx`` and ``dW_q/dbeta`` for
    ``dL/dbeta`` instead of every layer keeping them until then. The products are the calls autograd's own linear
    backward makes (``grad.mm(W)``, ``grad^T.mm(x)`` on the flattened rows), so the gradients are the same bits."""

    @staticmethod
    def forward(ctx, x, beta, bias, quantization):
        ctx.quantization = quantization
        ctx.save_for_backward(x)
        return F.linear(x, quantization.dequantized(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        want_x_grad, want_beta_grad, want_bias_grad = ctx.needs_input_grad[:3]
        quantization = ctx.quantization
        grad_rows = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_beta = grad_bias = None
        if want_x_grad:
            grad_x = grad_rows.mm(quantization.dequantized(grad_y.dtype)).view(x.shape)
        if want_beta_grad:
            grad_weight = grad_rows.t().mm(x.reshape(-1, x.shape[-1]))
            grad_beta = _beta_gradient(grad_weight.float(), quantization.beta_derivative())
        if want_bias_grad:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_beta, grad_bias, None


@dataclass(frozen=True)
class FrozenWeightQuantization:
    """A frozen weight's quantization at one offset, reused by every step of a calibration run and kept small.

    MX values have at most three mantissa bits, so bfloat16 holds them exactly: ``values`` are kept in bfloat16
    (in float32 for a weight where that would not be exact, e.g. values below bfloat16's subnormal range).
    ``dy/dbeta`` is not kept: the backward pass recomputes it from the weight (one kernel call per layer and step).
    A run then holds half a float32 copy of the weight per offset instead of up to two float32 copies, and
    ``linear`` gives the same outputs and gradients, bit for bit, as ``F.linear`` with the float32 values attached
    by ``ContinuousQuantization``.
    """

    weight: torch.Tensor
    offset: float
    pair: FormatPair
    block_size: int
    scale_rule: str
    block_amax: torch.Tensor | None
    values: torch.Tensor

    @classmethod
    def compute(
        cls, weight: torch.Tensor, offset: float, pair: str | FormatPair, block_size: int = 32,
        scale_rule: str = "ocp", block_amax: torch.Tensor | None = None,
    ) -> "FrozenWeightQuantization":
        pair = get_format_pair(pair)
        values = ContinuousQuantization.compute(weight, offset, pair, block_size, scale_rule, block_amax,
                                                with_beta_grad=False).values
        compact = values.to(torch.bfloat16)
        if torch.equal(compact.float(), values):
            values = compact
        return cls(weight, float(offset), pair, block_size, scale_rule, block_amax, values)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The quantized weight in ``dtype`` (the stored tensor itself when it already has that dtype)."""
        return self.values.to(dtype)

    def beta_derivative(self) -> torch.Tensor:
        """``dy/dbeta`` at the offset, per element (float32), computed afresh."""
        offset = torch.tensor(self.offset, dtype=torch.float32, device=self.weight.device)
        with torch.no_grad():
            return _quantize(self.weight.detach(), offset, self.pair, self.block_size, self.scale_rule,
                             self.block_amax, False, True)[2]

    def linear(self, x: torch.Tensor, beta: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, W_q, bias)``, in the autograd graphs of ``x`` and ``beta`` (``beta`` holds the offset's
        value: the derivative with respect to it is taken at the stored offset)."""
        return _FrozenWeightLinear.apply(x, beta, bias, self)


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
    want_x_grad = torch.is_grad_enabled() and x.requires_grad
    want_beta_grad = torch.is_grad_enabled() and beta.requires_grad
    return ContinuousQuantization.compute(x, beta, pair, block_size, scale_rule, block_amax, want_x_grad,
                                          want_beta_grad).attach(x, beta)
