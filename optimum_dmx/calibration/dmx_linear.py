"""`DMXLinear`: the calibration-time module of dMX, a frozen linear quantized at a learnable format offset."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from ..continuous import MAX_OFFSET, ContinuousQuantization, FormatPair, FrozenWeightQuantization, get_format_pair
from ..continuous import quantize_mx_continuous_fused, weight_block_max
from ..formats import MXFormat, quantize_mx
from ..nn import InputCache
from ..nn.rotation import rotate_input_side, rotate_output_side
from .schedule import discrete_offset, temperature_sigmoid

ENDPOINTS = (0.0, MAX_OFFSET)  # the offsets at which quantizations are reused (the probes of the default recipe)


class SharedInputs:
    """Input quantizations shared by the layers that read the same input tensor at the same offset within a step.

    q/k/v read one normalized hidden state, gate/up another: when they are probed at the same endpoint their
    input quantizations are identical, so the first layer computes it and the others attach the same values
    (`ContinuousQuantization`; each layer's backward pass recomputes the derivatives from the input). Entries live
    as long as their input tensor (`nn.InputCache`: activation checkpointing frees a layer's quantizations with
    its activations); `clear()` after each step's backward pass drops the rest.
    """

    def __init__(self) -> None:
        self._quantizations = InputCache()

    def quantize(self, x: torch.Tensor, beta: torch.Tensor, key: tuple) -> torch.Tensor:
        """``x`` quantized at ``beta`` (whose value, pair and block settings ``key`` names), computed once per key."""
        offset, pair, block_size, scale_rule = key
        quantization = self._quantizations.get(
            x, key, lambda: ContinuousQuantization.compute(x, offset, pair, block_size, scale_rule)
        )
        return quantization.attach(x, beta)

    def clear(self) -> None:
        self._quantizations.clear()


class DMXLinear(nn.Module):
    """A frozen linear layer whose weight and input are quantized at a learnable format offset.

    The module shares (does not copy) the wrapped linear's `weight` and `bias`. Its only trainable state is
    `beta_hat` (a scalar, initialised to 0: the pair's low format). The forward pass maps it to
    `beta = F(beta_hat, temperature)` in [0, 2] and quantizes, along `in_features` in blocks of
    `block_size`, the weight and (dynamically, when `quantize_activations`) the input activation with the
    pair's continuous quantizer at `beta`, with block scales by `scale_rule`. The computation runs in float32 and returns the input's dtype, so
    fp32 and bf16 models both work.

    `temperature` is a plain attribute that the calibration loop updates every step. With
    `straight_through`, the forward pass uses the discrete choice (`discrete_offset(beta_hat)`)
    while gradients flow as if it were `F(beta_hat, temperature)` (the ROUND+STE baseline).

    `probe`, when set, replaces `beta` altogether: the sampling estimator sets it to a format endpoint each step
    (a 0-dim tensor, requiring grad when the loss's derivative there is wanted) and reads that derivative.
    `probe_offset` is the probe's value as a Python number, when the caller knows it: at an endpoint (0 or 2) the
    frozen weight's quantized values are then computed once and reused every later step
    (`FrozenWeightQuantization`: a bfloat16 copy of the weight per endpoint, freed with the module; `dy/dbeta` is
    recomputed in the backward pass), and, with `shared_inputs` set, an input that other layers quantize at the
    same endpoint is quantized once per step.

    `drawn_high`, when set (`True`/`False`), runs the layer in that discrete format of the pair instead (exact MX
    casts, straight-through for the input) and records in `swap` its output `y` (in the autograd graph) and
    `y_other - y`, the change of output the other format would make: the swap estimator's first-order
    estimate of what swapping the format changes in the loss is `<dL/dy, y_other - y>`.

    `bypass`, when `True`, runs the float layer (after the input transform, if any): the reference pass of the
    distillation loss (`unquantized`).

    `input_rotation` / `output_rotation`, when set, are orthogonal matrices being learned with the offsets
    (`calibration.rotations`): the layer then computes with its weight rotated by them (`W R`, `R^T W`, repeated
    block-diagonally when smaller than the side, as `nn.rotation` merges them) and quantizes that weight afresh
    every forward pass, with the straight-through gradient reaching the matrices.
    """

    def __init__(
        self,
        linear: nn.Linear,
        format_pair: str | FormatPair = "mxfp8-mxfp4",
        *,
        block_size: int = 32,
        quantize_activations: bool = True,
        scale_rule: str = "ocp",
        temperature: float = 8.0,
        straight_through: bool = False,
    ):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"DMXLinear wraps an nn.Linear, got {type(linear).__name__}.")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.pair = get_format_pair(format_pair)
        self.block_size = block_size
        self.quantize_activations = quantize_activations
        self.scale_rule = scale_rule
        self.temperature = float(temperature)
        self.straight_through = straight_through
        self.beta_hat = nn.Parameter(torch.zeros((), dtype=torch.float32, device=linear.weight.device))
        self.probe: torch.Tensor | None = None
        self.probe_offset: float | None = None
        self.shared_inputs: SharedInputs | None = None
        self._frozen_weights: dict[float, FrozenWeightQuantization] = {}
        self.drawn_high: bool | None = None
        self.swap: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bypass = False
        self._discrete_weights: dict[str, torch.Tensor] = {}
        self.input_transform = getattr(linear, "input_transform", None)  # a `TransformedLinear`'s online rotation
        self.input_rotation: torch.Tensor | None = None
        self.output_rotation: torch.Tensor | None = None
        # The weight is frozen: its per-block maxima are constant, so compute them once.
        self.register_buffer("_weight_block_max", weight_block_max(linear.weight, block_size), persistent=False)

    def beta(self) -> torch.Tensor:
        """The offset the quantizer uses now (differentiable with respect to `beta_hat`, or the `probe`)."""
        if self.probe is not None:
            return self.probe
        relaxed = temperature_sigmoid(self.beta_hat, self.temperature)
        if not self.straight_through:
            return relaxed
        return discrete_offset(self.beta_hat) + (relaxed - relaxed.detach())

    def element_bits(self) -> torch.Tensor:
        """Element bits at the current offset (`4 + 2 beta` or `4 + beta`), differentiable."""
        return self.pair.element_bits(self.beta())

    @property
    def discrete_format(self) -> MXFormat:
        """The format this layer gets when discretized by its own offset (`discrete_offset`)."""
        return self.pair.high if discrete_offset(self.beta_hat).item() > 0 else self.pair.low

    def discrete_weight(self, fmt: MXFormat) -> torch.Tensor:
        """The weight cast to `fmt` (float32), cached: the weight is frozen during calibration."""
        if fmt.name not in self._discrete_weights:
            self._discrete_weights[fmt.name] = quantize_mx(self.weight.detach().float(), fmt, self.block_size,
                                                           self.scale_rule)
        return self._discrete_weights[fmt.name]

    @property
    def rotated(self) -> bool:
        """Whether learned rotations act on the weight (which then changes every step)."""
        return self.input_rotation is not None or self.output_rotation is not None

    def rotated_weight(self) -> torch.Tensor:
        """The weight the layer computes with: its own, or rotated by the learned matrices (float32)."""
        if not self.rotated:
            return self.weight
        weight = self.weight.float()
        if self.input_rotation is not None:
            weight = rotate_input_side(weight, self.input_rotation.float())
        if self.output_rotation is not None:
            weight = rotate_output_side(weight, self.output_rotation.float())
        return weight

    def rotated_bias(self) -> torch.Tensor | None:
        """The bias the layer adds: its own, or rotated with the output side."""
        if self.bias is None or self.output_rotation is None:
            return self.bias
        return rotate_output_side(self.bias.float(), self.output_rotation.float())

    def _reusable_offset(self) -> float | None:
        """The probe's value when it is an endpoint, whose quantizations can be reused; else None."""
        offset = self.probe_offset if self.probe is not None else None
        return offset if offset in ENDPOINTS else None

    def frozen_weight(self) -> FrozenWeightQuantization | None:
        """The weight's quantization at the probe's endpoint, computed once and reused; None when not at one."""
        offset = self._reusable_offset()
        if offset is None or self.rotated:  # learned rotations give a new weight every step: nothing to reuse
            return None
        frozen = self._frozen_weights.get(offset)
        if frozen is None:
            frozen = FrozenWeightQuantization.compute(self.weight, offset, self.pair, self.block_size,
                                                      self.scale_rule, self._weight_block_max)
            self._frozen_weights[offset] = frozen
        return frozen

    def quantized_weight(self, beta: torch.Tensor) -> torch.Tensor:
        """The weight quantized at `beta`, computed afresh (off the endpoints, or with learned rotations)."""
        if self.rotated:
            return quantize_mx_continuous_fused(self.rotated_weight(), beta, self.pair, self.block_size, self.scale_rule)
        return quantize_mx_continuous_fused(self.weight, beta, self.pair, self.block_size, self.scale_rule,
                                            self._weight_block_max)

    def quantized_input(self, x: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The input quantized at `beta`; shared with the other layers reading `x` at the same endpoint."""
        offset = self._reusable_offset()
        if offset is None or self.shared_inputs is None:
            return quantize_mx_continuous_fused(x, beta, self.pair, self.block_size, self.scale_rule)
        return self.shared_inputs.quantize(x, beta, (offset, self.pair.name, self.block_size, self.scale_rule))

    def _forward_swap(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotated:
            raise RuntimeError("the swap estimator casts the frozen weight once; it cannot run with learned rotations")
        fmt, other = (self.pair.high, self.pair.low) if self.drawn_high else (self.pair.low, self.pair.high)
        bias = None if self.bias is None else self.bias.float()
        x = x.float()
        quantized = quantize_mx(x.detach(), fmt, self.block_size, self.scale_rule) if self.quantize_activations else x
        y = F.linear(x + (quantized - x).detach(), self.discrete_weight(fmt), bias)
        if not y.requires_grad:  # nothing upstream needs a gradient: start the graph here
            y.requires_grad_(True)
        with torch.no_grad():
            x_other = quantize_mx(x, other, self.block_size, self.scale_rule) if self.quantize_activations else x
            self.swap = (y, F.linear(x_other, self.discrete_weight(other), bias) - y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.bypass:
            return F.linear(x, self.rotated_weight().to(x.dtype), self._bias_in(x.dtype))
        if self.drawn_high is not None:
            return self._forward_swap(x).to(x.dtype)
        beta = self.beta()
        if self.quantize_activations:
            x = self.quantized_input(x, beta)
        frozen = self.frozen_weight()
        if frozen is not None:
            return frozen.linear(x, beta, self._bias_in(x.dtype))
        return F.linear(x, self.quantized_weight(beta).to(x.dtype), self._bias_in(x.dtype))

    def _bias_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        bias = self.rotated_bias()
        return None if bias is None else bias.to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format_pair={self.pair.name}, block_size={self.block_size}, "
            f"quantize_activations={self.quantize_activations}, scale_rule={self.scale_rule}, temperature={self.temperature:g}, "
            f"straight_through={self.straight_through}"
        )


@contextmanager
def unquantized(layers: Iterable[DMXLinear]) -> Iterator[None]:
    """Run `layers` as the float layers they wrap inside the block (the model's float reference)."""
    previous = {layer: layer.bypass for layer in layers}
    for layer in previous:
        layer.bypass = True
    try:
        yield
    finally:
        for layer, bypass in previous.items():
            layer.bypass = bypass
