"""`DMXLinear`: the calibration-time module of dMX, a frozen linear quantized at a learnable format offset.

Where the offset comes from is a strategy object given at construction:

* `RelaxedOffset` (the paper's method): `beta = F(beta_hat, T)`, the temperature shared by every layer and set by
  the trainer once per step;
* `EndpointProbe` (the default method): each step the layer runs at one end of its format path, and at its low
  end the loss's derivative with respect to the offset is read there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..continuous import (
    MAX_OFFSET,
    ContinuousQuantization,
    FormatPair,
    FrozenWeightQuantization,
    get_format_pair,
    quantize_mx_continuous_fused,
    weight_block_max,
)
from ..formats import MXFormat
from ..nn import InputCache
from ..nn.placement import execution_device, is_offloaded, is_resident, loaded_weights
from ..nn.rotation import rotate_input_side, rotate_output_side
from ..nn.transforms import RandomizedHadamard
from .schedule import T_START, discrete_offset, temperature_sigmoid

ENDPOINTS = (0.0, MAX_OFFSET)  # the offsets at which quantizations are reused (the default method's probes)


class SharedInputs:
    """Input transforms and quantizations shared by the layers that read the same input tensor within a step.

    q/k/v read one normalized hidden state, gate/up another. With online input transforms they share one transform
    (`nn.rotation`), so the first layer transforms the input and the others take the same tensor; when they are
    probed at the same endpoint their input quantizations are identical too, so the first layer computes it and the
    others attach the same values (`ContinuousQuantization`; each layer's backward pass recomputes the derivatives
    from the input). Entries live as long as their input tensor (`nn.InputCache`: activation checkpointing frees a
    layer's entries with its activations); `clear()` after each step's backward pass drops the rest.
    """

    def __init__(self) -> None:
        self._cache = InputCache()

    def transform(self, x: torch.Tensor, transform: RandomizedHadamard) -> torch.Tensor:
        """``x`` through the online ``transform``, computed once per transform (`RandomizedHadamard.key`)."""
        return self._cache.get(x, ("transform", transform.key), lambda: transform(x))

    def quantize(self, x: torch.Tensor, beta: torch.Tensor, key: tuple) -> torch.Tensor:
        """``x`` quantized at ``beta`` (whose value, pair and block settings ``key`` names), computed once per key."""
        offset, pair, block_size, scale_rule = key
        quantization = self._cache.get(
            x, key, lambda: ContinuousQuantization.compute(x, offset, pair, block_size, scale_rule)
        )
        return quantization.attach(x, beta)

    def clear(self) -> None:
        self._cache.clear()


class RelaxedOffset:
    """The paper's offset: `beta = F(beta_hat, T)`. One instance serves every layer of a run; the trainer sets
    `temperature` once per step."""

    shared_inputs: SharedInputs | None = None

    def __init__(self, temperature: float = T_START):
        self.temperature = float(temperature)

    def beta(self, beta_hat: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """The offset, differentiable with respect to `beta_hat`, and no reusable value."""
        return temperature_sigmoid(beta_hat, self.temperature), None


class EndpointProbe:
    """The default method's offset: each step the trainer puts the layer at one end of its format path
    (`set(offset, measure=...)`); with `measure=True` the offset requires grad and `gain()` reads `-dL/dbeta` there
    after the backward pass. At an endpoint, the frozen weight's quantization is computed once and reused, and an
    input other layers quantize at the same endpoint is quantized once (`shared_inputs`)."""

    def __init__(self, shared_inputs: SharedInputs | None = None):
        self.shared_inputs = shared_inputs
        self._offset: torch.Tensor | None = None
        self._value: float | None = None

    def set(self, offset: float, device: torch.device, measure: bool) -> None:
        self._value = float(offset)
        self._offset = torch.tensor(self._value, device=device, requires_grad=measure)

    def beta(self, beta_hat: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        if self._offset is None:
            raise RuntimeError("EndpointProbe.set() must put the layer at an endpoint before its forward pass")
        return self._offset, self._value

    def gain(self) -> torch.Tensor:
        """`-dL/dbeta` at the measured endpoint (zero when the loss did not reach this layer)."""
        grad = self._offset.grad
        return -grad if grad is not None else torch.zeros((), device=self._offset.device)

    def reset(self) -> None:
        self._offset = self._value = None


OffsetStrategy = RelaxedOffset | EndpointProbe


class DMXLinear(nn.Module):
    """A frozen linear layer whose weight and input are quantized at a learnable format offset.

    The module shares (does not copy) the wrapped linear's `weight` and `bias`, read from it at each call, so that
    a weight sharded by FSDP2 or offloaded by accelerate is used where it is (`nn.placement`). Its only trainable
    state is `beta_hat` (a scalar, initialised to 0: the pair's low format). Its `offset` strategy maps it to the offset
    `beta` in [0, 2] the forward pass uses; the weight and (dynamically, when `quantize_activations`) the input
    activation are quantized along `in_features` in blocks of `block_size` with the pair's continuous quantizer at
    `beta`, block scales by `scale_rule`. The computation runs in float32 and returns the input's dtype, so fp32 and
    bf16 models both work.

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
        offset: OffsetStrategy | None = None,
    ):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"DMXLinear wraps an nn.Linear, got {type(linear).__name__}.")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Not registered as a submodule: the wrapped linear's parameters stay the model's, counted once, and are read
        # from it at each call, where FSDP2 puts a gathered weight and accelerate's hook an offloaded one.
        self.__dict__["source"] = linear
        self.pair = get_format_pair(format_pair)
        self.block_size = block_size
        self.quantize_activations = quantize_activations
        self.scale_rule = scale_rule
        self.offset = offset if offset is not None else RelaxedOffset()
        self.beta_hat = nn.Parameter(torch.zeros((), dtype=torch.float32, device=execution_device(linear)))
        # What is computed once from a frozen weight is kept only when the weight itself is (`nn.placement`).
        self.keeps_weight_quantizations = is_resident(linear)
        self._offloaded = is_offloaded(linear)  # decided once: the per-call path stays as it was for the rest
        self._frozen_weights: dict[float, FrozenWeightQuantization] = {}
        self.input_transform = getattr(linear, "input_transform", None)  # a `TransformedLinear`'s online rotation
        self.input_rotation: torch.Tensor | None = None
        self.output_rotation: torch.Tensor | None = None
        # The weight is frozen: its per-block maxima are constant, so compute them once.
        block_max = weight_block_max(linear.weight, block_size) if self.keeps_weight_quantizations else None
        self.register_buffer("_weight_block_max", block_max, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The wrapped linear's weight, as it is now."""
        return self.source.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.source.bias

    def beta(self) -> torch.Tensor:
        """The offset the quantizer uses now."""
        return self.offset.beta(self.beta_hat)[0]

    def element_bits(self) -> torch.Tensor:
        """Element bits at the current offset (`4 + 2 beta` or `4 + beta`), differentiable."""
        return self.pair.element_bits(self.beta())

    @property
    def discrete_format(self) -> MXFormat:
        """The format this layer gets when discretized by its own offset (`discrete_offset`)."""
        return self.pair.high if discrete_offset(self.beta_hat).item() > 0 else self.pair.low

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

    def frozen_weight(self, offset: float | None) -> FrozenWeightQuantization | None:
        """The weight's quantization at an endpoint `offset`, computed once and reused; None elsewhere."""
        if offset not in ENDPOINTS or self.rotated or not self.keeps_weight_quantizations:
            return None  # off the endpoints, learned rotations (a new weight every step), or a weight not kept
        frozen = self._frozen_weights.get(offset)
        if frozen is None:
            frozen = FrozenWeightQuantization.compute(
                self.weight, offset, self.pair, self.block_size, self.scale_rule, self._weight_block_max
            )
            self._frozen_weights[offset] = frozen
        return frozen

    def quantized_weight(self, beta: torch.Tensor) -> torch.Tensor:
        """The weight quantized at `beta`, computed afresh (off the endpoints, or with learned rotations)."""
        if self.rotated:
            return quantize_mx_continuous_fused(
                self.rotated_weight(), beta, self.pair, self.block_size, self.scale_rule
            )
        return quantize_mx_continuous_fused(
            self.weight, beta, self.pair, self.block_size, self.scale_rule, self._weight_block_max
        )

    def quantized_input(self, x: torch.Tensor, beta: torch.Tensor, offset: float | None) -> torch.Tensor:
        """The input quantized at `beta`; shared with the other layers reading `x` at the same endpoint."""
        shared = self.offset.shared_inputs
        if offset not in ENDPOINTS or shared is None:
            return quantize_mx_continuous_fused(x, beta, self.pair, self.block_size, self.scale_rule)
        return shared.quantize(x, beta, (offset, self.pair.name, self.block_size, self.scale_rule))

    def transformed_input(self, x: torch.Tensor) -> torch.Tensor:
        """`x` through the online input transform; computed once for the layers that read `x` through the same
        transform (q/k/v, gate/up) when the offsets share inputs."""
        shared = self.offset.shared_inputs
        if shared is None:
            return self.input_transform(x)
        return shared.transform(x, self.input_transform)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._offloaded:
            return self._quantized_forward(x)
        with loaded_weights(self.source):  # loaded for this call by its linear's accelerate hook
            return self._quantized_forward(x)

    def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_transform is not None:
            x = self.transformed_input(x)
        beta, offset = self.offset.beta(self.beta_hat)
        if self.quantize_activations:
            x = self.quantized_input(x, beta, offset)
        frozen = self.frozen_weight(offset)
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
            f"quantize_activations={self.quantize_activations}, scale_rule={self.scale_rule}, "
            f"offset={type(self.offset).__name__}"
        )
