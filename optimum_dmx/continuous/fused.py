"""Fused continuous MX quantizer: the forward values of :func:`~.reference.quantize_mx_continuous`, bit for
bit, with closed-form gradients instead of an autograd graph.

The reference builds a graph of about twenty element-wise nodes, each keeping its inputs for the backward
pass. Calibration needs two gradients, and both have closed forms (``docs/method.md``):

* with respect to ``beta`` (a scalar), the per-element derivative ``dy/dbeta``, reduced against the incoming
  gradient: ``sum(dL/dy * dy/dbeta)``;
* with respect to ``x`` (needed for activations, so that gradients reach earlier layers), the
  straight-through derivative: ``y/x`` in the normal range, 1 in the subnormal range and 0 where the
  value saturates.

The forward pass computes the values only and keeps ``x``; the backward pass recomputes the derivatives from it
in one kernel that also applies the incoming gradient and sums ``dL/dy * dy/dbeta`` per block, in an order fixed
element-wise so that compiled and eager kernels give the same bits. Compiled, that extra read of ``x`` costs less
than writing two float32 tensors of its size in the forward pass, keeping them until the backward pass and reading
them again; neither derivative is ever written at ``x``'s size.
Weights are frozen during calibration, so their block maxima can be computed once and passed back in
(``block_amax``), and no input gradient is computed for them. The values are computed once
(``ContinuousQuantization``) and attached to the graph by a small autograd function, so work that does not change
between uses (an input several layers quantize alike) can be done once and attached many times. A frozen weight
at an offset revisited every step keeps only its values, in bfloat16 where that is exact, for the whole run
(``FrozenWeightQuantization``): its linear layer recomputes ``dy/dbeta`` in the backward pass.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn import functional as F

from ..formats.blocks import (
    block_max,
    block_max_exponent,
    block_scale,
    floor_log2,
    from_blocks,
    pow2,
    shared_exponent,
    to_blocks,
    validate_input,
)
from ..formats.cast import compiles
from ..formats.compilation import CompiledKernel
from ..formats.spec import grid_exponent, validate_block_size, validate_scale_rule
from .pairs import FormatPair, get_format_pair

__all__ = ["ContinuousQuantization", "FrozenWeightQuantization", "quantize_mx_continuous_fused", "weight_block_max"]

_LN2 = math.log(2.0)


class _FormatParameters(NamedTuple):
    """A pair's format at one offset, as the kernels read it (0-dim tensors, detached), with the derivatives of
    the exponent bits, mantissa bits and largest normal with respect to the offset (float32).

    At an integer offset the mantissa bits, step exponent and scale offset are integers and are passed as int32:
    the kernels then build every power of two from its bit pattern (``formats.blocks.pow2``, as the cast does)
    instead of calling ``exp2`` and ``ldexp`` per element and per block. Same bits: both are exact there.
    """

    m: torch.Tensor
    e_min: torch.Tensor
    qmax: torch.Tensor
    scale_offset: torch.Tensor
    rounding_bits: torch.Tensor | None  # None: the OCP scale rule
    de: torch.Tensor
    dm: torch.Tensor
    dqmax: torch.Tensor


@functools.lru_cache(maxsize=256)
def _format_parameters(pair: FormatPair, offset: float, scale_rule: str, device: torch.device) -> _FormatParameters:
    """The pair's format parameters at ``offset``, computed exactly as the reference does, and their derivatives.

    Kept for the offsets last used (a few hundred microseconds of small tensor operations and three
    ``autograd.grad`` calls each, against a kernel's tens of microseconds on a small activation): a calibration step
    quantizes every layer at one of a few offsets. The kernels never modify them.

    They are computed on the CPU for every device and copied: at a fractional offset they come from ``exp2`` and
    ``pow``, whose last bits differ between devices (measured on an H200: ``e_min`` and ``qmax`` two float32 units
    apart), and every element's rounding depends on them.
    """
    if device.type != "cpu":
        on_cpu = _format_parameters(pair, offset, scale_rule, torch.device("cpu"))
        return _FormatParameters(*(None if t is None else t.to(device) for t in on_cpu))
    beta = torch.tensor(offset, dtype=torch.float32)
    # Own saved-tensor hooks: this small graph keeps its tensors even inside an activation-checkpointed layer, whose
    # hooks would otherwise recompute the whole layer when `autograd.grad` unpacks them. They keep detached aliases:
    # a hook that kept an output saved by its own node would make a cycle the garbage collector cannot see.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, lambda t: t):
        b = beta.requires_grad_(True)
        e, m, qmax = pair.exponent_bits(b), pair.mantissa_bits(b), pair.max_normal(b)
        de, dm, dqmax = (torch.autograd.grad(p, b, retain_graph=True)[0] for p in (e, m, qmax))
        e_min, scale_offset = pair.step_exponent_min(b), pair.scale_offset(b)
    rounding_bits = pair.scale_rounding_bits(b.detach(), scale_rule)
    m, e_min, scale_offset = (t.detach() for t in (m, e_min, scale_offset))
    if offset.is_integer():
        m, e_min, scale_offset = (t.to(torch.int32) for t in (m, e_min, scale_offset))
    return _FormatParameters(m, e_min, qmax.detach(), scale_offset, rounding_bits, de, dm, dqmax)


@dataclass(frozen=True, eq=False)
class _Quantizer:
    """A pair at one offset with its block settings: the format parameters, computed once, and which kernel runs."""

    block_size: int
    block_amax: torch.Tensor | None
    parameters: _FormatParameters
    compiled: bool

    @classmethod
    def at(
        cls,
        offset: float,
        device: torch.device,
        pair: FormatPair,
        width: int,
        block_size: int,
        scale_rule: str,
        block_amax: torch.Tensor | None,
    ) -> _Quantizer:
        # Compiled exp2 / pow differ from eager ones in the last bit for fractional exponents: only the pair's exact
        # formats (integer offsets, the default recipe's probes) run the compiled kernels, so results never depend
        # on them.
        compiled = compiles(width, block_size) and offset.is_integer()
        return cls(block_size, block_amax, _format_parameters(pair, offset, scale_rule, device), compiled)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` quantized, in its dtype."""
        p = self.parameters
        return self._run(_values_kernel, (x,), p.m, p.e_min, p.qmax, p.scale_offset, p.rounding_bits, self.block_size)[
            0
        ].view(x.shape)

    def gradients(self, x: torch.Tensor, grad_y: torch.Tensor, want_x_grad: bool, want_beta_grad: bool):
        """``dL/dx = dL/dy * dy/dx`` (None unless ``want_x_grad``) and the per-block sums of ``dL/dy * dy/dbeta``
        (float32, ``[*x.shape[:-1], n_blocks]``; None unless ``want_beta_grad``), the derivatives recomputed from
        ``x``. ``_beta_gradient`` adds the sums up."""
        p = self.parameters
        grad_x, beta_block_sums = self._run(
            _gradients_kernel,
            (x, grad_y),
            p.m,
            p.e_min,
            p.qmax,
            p.scale_offset,
            p.rounding_bits,
            p.de,
            p.dm,
            p.dqmax,
            self.block_size,
            want_x_grad,
            want_beta_grad,
        )
        return (
            None if grad_x is None else grad_x.view(x.shape),
            None if beta_block_sums is None else beta_block_sums.view(*x.shape[:-1], -1),
        )

    def _run(self, kernel: CompiledKernel, inputs: tuple[torch.Tensor, ...], *constants) -> tuple:
        """``kernel(*inputs, block_amax, *constants)`` without its block output (the scales, last), where ``inputs``
        are ``x`` and tensors of its shape; outputs of ``x``'s size come back as matrices of rows when compiled."""
        if not self.compiled:
            return kernel.fn(*inputs, self.block_amax, *constants)[:-1]
        # As matrices of rows: one kernel serves every number of rows (tokens) of a width.
        width = inputs[0].shape[-1]
        rows = tuple(t.reshape(-1, width) for t in inputs)
        amax = None if self.block_amax is None else self.block_amax.reshape(rows[0].shape[0], -1, 1)
        return kernel(*rows, amax, *constants)[:-1]


def _offset_value(beta: torch.Tensor | float) -> float:
    """The offset as a Python float at float32 precision (the kernels' format parameters are float32). A number
    costs nothing; a tensor on a GPU costs a device-to-host copy that waits for the queued work, so the calibration
    loop passes its endpoint probes as numbers."""
    if isinstance(beta, torch.Tensor):
        return float(beta.detach().float())
    return struct.unpack("f", struct.pack("f", beta))[0]  # rounded to float32, without making a tensor


def _on_grid(x, block_amax, m, e_min, qmax, scale_offset, rounding_bits, block_size):
    """What the values and both derivatives are computed from: ``x``'s blocks divided by their scales (``v``), the
    scales, ``v`` rounded onto the format's grid (``q``, before saturation) and the subnormal and saturation masks."""
    blocks = to_blocks(x, block_size)
    amax = block_amax if block_amax is not None else block_max(blocks)
    scale = block_scale(shared_exponent(*block_max_exponent(amax, rounding_bits), scale_offset))
    v = blocks / scale

    normal_exponent = floor_log2(v)
    if m.is_floating_point():
        normal_exponent = normal_exponent.float()
    eta = grid_exponent(normal_exponent, m, e_min)
    subnormal = normal_exponent - m < e_min
    step = eta.exp2_() if eta.is_floating_point() else pow2(eta)  # integer eta: in [e_min, 127], a normal float32
    q = (v / step).round_().mul_(step)
    # Saturation exactly as the reference: strictly above qmax, or rounded onto qmax from above.
    magnitude = q.abs()
    clipped = (magnitude > qmax) | ((magnitude == qmax) & (v.abs() > qmax))
    return scale, v, q, subnormal, clipped


@CompiledKernel
def _values_kernel(x, block_amax, m, e_min, qmax, scale_offset, rounding_bits, block_size):
    """The quantized values of ``x`` at given format parameters (0-dim tensors), in ``x``'s dtype, and the block
    scales (a block output, ``formats.compilation``): one fused kernel when compiled, the same bits eagerly."""
    scale, v, q, _, clipped = _on_grid(x, block_amax, m, e_min, qmax, scale_offset, rounding_bits, block_size)
    y = torch.where(clipped, torch.copysign(qmax, v), q)
    return from_blocks(y.mul_(scale), x.shape).to(x.dtype), scale


def _pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in one fixed pairwise order (halves added element-wise until one is left).

    Element-wise additions round alike eagerly and in every compiled kernel, where a reduction's order is the
    backend's choice: this keeps a kernel's sums bit-identical to its eager reference."""
    while t.shape[-1] > 1:
        half = t.shape[-1] // 2
        head = t[..., :half] + t[..., half : 2 * half]
        t = torch.cat((head, t[..., 2 * half :]), dim=-1) if t.shape[-1] % 2 else head
    return t[..., 0]


@CompiledKernel
def _gradients_kernel(
    x,
    grad_y,
    block_amax,
    m,
    e_min,
    qmax,
    scale_offset,
    rounding_bits,
    de,
    dm,
    dqmax,
    block_size,
    want_x_grad,
    want_beta_grad,
):
    """``dL/dx`` from ``dL/dy`` (when wanted), the per-block sums of ``dL/dy * dy/dbeta`` (when wanted; float32,
    ``[*leading, n_blocks]``), the derivatives recomputed from ``x``, and the block scales (a block output,
    ``formats.compilation``). Reducing ``dy/dbeta`` inside the kernel, per block, spares writing it as a float32
    tensor of ``x``'s size and reading it back for a dot product."""
    scale, v, q, subnormal, clipped = _on_grid(x, block_amax, m, e_min, qmax, scale_offset, rounding_bits, block_size)
    grad_blocks = to_blocks(grad_y, block_size)
    grad_x = beta_block_sums = None
    if want_beta_grad:
        # dQ/dbeta: ln2 (v - Q) (dm/dbeta + [subnormal] 2^(e-1) ln2 de/dbeta), or +-dqmax/dbeta when saturated.
        per_element = torch.where(subnormal, (dm + de * scale_offset * _LN2) * _LN2, dm * _LN2)
        d_beta = (v - q).mul_(per_element)
        d_beta = torch.where(clipped, torch.copysign(dqmax, v), d_beta).mul_(scale)
        beta_block_sums = _pairwise_sum(grad_blocks * d_beta)  # the padding's dL/dy is 0
    if want_x_grad:
        # Straight through: y / x in the normal range, 1 in the subnormal range, 0 where saturated.
        d_x = torch.where(subnormal, 1.0, q / v).masked_fill_(clipped, 0.0)
        grad_x = from_blocks(grad_blocks * d_x, x.shape).to(grad_y.dtype)
    return grad_x, beta_block_sums, scale


def _beta_gradient(beta_block_sums: torch.Tensor) -> torch.Tensor:
    """``dL/dbeta = sum(dL/dy * dy/dbeta)``, the chain rule for a scalar offset shared by every element, from the
    gradient kernel's per-block sums."""
    return beta_block_sums.sum()


class _AttachContinuousMX(torch.autograd.Function):
    """Returns precomputed quantized values of ``x``, attached to the graphs of ``x`` and ``beta``. Only ``x`` is
    saved: the backward pass recomputes the derivatives from it instead of the forward pass keeping two float32
    tensors of ``x``'s size until then, in one kernel that gives ``dL/dx`` and the per-block sums of
    ``dL/dy * dy/dbeta``."""

    @staticmethod
    def forward(ctx, x, beta, values, quantizer):
        ctx.quantizer = quantizer
        ctx.save_for_backward(x)
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        want_x_grad, want_beta_grad = ctx.needs_input_grad[:2]
        grad_x, beta_block_sums = ctx.quantizer.gradients(x, grad_y, want_x_grad, want_beta_grad)
        return grad_x, None if beta_block_sums is None else _beta_gradient(beta_block_sums), None, None


@dataclass(frozen=True)
class ContinuousQuantization:
    """One tensor's continuous quantization at one offset, computed once and attachable to the graph many times.

    ``values`` equal ``quantize_mx_continuous_fused(x, beta, ...)`` bit for bit, and ``attach(x, beta)`` returns them
    with the same gradients with respect to ``x`` and ``beta``: the backward pass recomputes the derivatives from
    ``x`` (cheaper, compiled, than keeping two float32 tensors of its size from the forward pass to the backward
    pass). Calibration uses it for work that does not change between uses: one input read by several layers
    (q/k/v, gate/up) at the same offset.
    """

    values: torch.Tensor
    quantizer: _Quantizer

    @classmethod
    def compute(
        cls,
        x: torch.Tensor,
        beta: torch.Tensor | float,
        pair: str | FormatPair,
        block_size: int = 32,
        scale_rule: str = "ocp",
        block_amax: torch.Tensor | None = None,
    ) -> ContinuousQuantization:
        pair = get_format_pair(pair)
        quantizer = _Quantizer.at(_offset_value(beta), x.device, pair, x.shape[-1], block_size, scale_rule, block_amax)
        with torch.no_grad():
            return cls(quantizer.values(x.detach()), quantizer)

    def attach(self, x: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The values, in the autograd graphs of ``x`` (the tensor they were computed from) and ``beta`` where
        those need grad (``beta`` holds the offset's value: derivatives are taken at the computed offset)."""
        if x.shape != self.values.shape:
            raise ValueError(
                f"attach takes the tensor the quantization was computed from, of shape "
                f"{tuple(self.values.shape)}; got shape {tuple(x.shape)}."
            )
        if not torch.is_grad_enabled() or not (x.requires_grad or beta.requires_grad):
            return self.values
        return _AttachContinuousMX.apply(x, beta, self.values, self.quantizer)


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
            grad_beta = quantization.beta_gradient(grad_weight)
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
    values: torch.Tensor
    quantizer: _Quantizer

    @classmethod
    def compute(
        cls,
        weight: torch.Tensor,
        offset: float,
        pair: str | FormatPair,
        block_size: int = 32,
        scale_rule: str = "ocp",
        block_amax: torch.Tensor | None = None,
    ) -> FrozenWeightQuantization:
        quantization = ContinuousQuantization.compute(weight, offset, pair, block_size, scale_rule, block_amax)
        values = quantization.values
        compact = values.to(torch.bfloat16)
        if torch.equal(compact.float(), values):
            values = compact
        return cls(weight, values, quantization.quantizer)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The quantized weight in ``dtype`` (the stored tensor itself when it already has that dtype)."""
        return self.values.to(dtype)

    def beta_gradient(self, grad_values: torch.Tensor) -> torch.Tensor:
        """``dL/dbeta = sum(dL/dW_q * dW_q/dbeta)`` at the offset, ``dW_q/dbeta`` recomputed from the weight."""
        with torch.no_grad():
            return _beta_gradient(self.quantizer.gradients(self.weight.detach(), grad_values, False, True)[1])

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
    return ContinuousQuantization.compute(x, beta, pair, block_size, scale_rule, block_amax).attach(x, beta)
