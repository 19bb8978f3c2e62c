"""Linear modules that run in MX formats, and the model surgery that installs them.

`DMXLinear` is the calibration-time module of dMX: it quantizes its weight and input activation to a
continuous format between the two formats of a pair, controlled by one learnable offset per layer.
`MXLinear` is the inference module: its weight is stored packed in one fixed MX format, and
`replace_with_mx_linear` swaps `nn.Linear`s for it following a per-layer format map.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from .calibration.fused import quantize_mx_continuous_fused, weight_block_exponent
from .calibration.schedule import temperature_sigmoid
from .continuous import FormatPair, get_format_pair
from .formats import MXFormat, MXPackedTensor, get_format, pack_mx, packed_shapes, quantize_mx, unpack_mx


class DMXLinear(nn.Module):
    """A frozen linear layer whose weight and input are quantized at a learnable format offset.

    The module shares (does not copy) the wrapped linear's `weight` and `bias`. Its only trainable state is
    `beta_hat` (a scalar, initialised to 0: the pair's low format). The forward pass maps it to
    `beta = F(beta_hat, temperature)` in [0, 2] and quantizes, along `in_features` in blocks of
    `block_size`, the weight and (dynamically, when `quantize_activations`) the input activation with the
    pair's continuous quantizer at `beta`. The computation runs in float32 and returns the input's dtype, so
    fp32 and bf16 models both work.

    `temperature` is a plain attribute that the calibration loop updates every step. With
    `straight_through`, the forward pass uses the discrete choice (`beta = 0` below `beta_hat = 1`, else 2)
    while gradients flow as if it were `F(beta_hat, temperature)` (the ROUND+STE baseline).
    """

    def __init__(
        self,
        linear: nn.Linear,
        format_pair: str | FormatPair = "mxfp8-mxfp4",
        *,
        block_size: int = 32,
        quantize_activations: bool = True,
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
        self.temperature = float(temperature)
        self.straight_through = straight_through
        self.beta_hat = nn.Parameter(torch.zeros((), dtype=torch.float32, device=linear.weight.device))
        # The weight is frozen: its per-block exponents are constant, so compute them once.
        floor_log2, finite = weight_block_exponent(linear.weight, block_size)
        self.register_buffer("_weight_floor_log2", floor_log2, persistent=False)
        self.register_buffer("_weight_finite", finite, persistent=False)

    def beta(self) -> torch.Tensor:
        """The offset the quantizer uses now (differentiable with respect to `beta_hat`)."""
        relaxed = temperature_sigmoid(self.beta_hat, self.temperature)
        if not self.straight_through:
            return relaxed
        hard = torch.where(self.beta_hat >= 1, 2.0, 0.0)
        return hard + (relaxed - relaxed.detach())

    def element_bits(self) -> torch.Tensor:
        """Element bits at the current offset (`4 + 2 beta` or `4 + beta`), differentiable."""
        return self.pair.element_bits(self.beta())

    @property
    def discrete_format(self) -> MXFormat:
        """The format this layer gets after calibration: the high format iff `beta_hat >= 1`."""
        return self.pair.high if self.beta_hat.item() >= 1 else self.pair.low

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beta = self.beta()
        weight = quantize_mx_continuous_fused(
            self.weight, beta, self.pair, self.block_size, (self._weight_floor_log2, self._weight_finite)
        )
        if self.quantize_activations:
            x = quantize_mx_continuous_fused(x, beta, self.pair, self.block_size)
        return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format_pair={self.pair.name}, block_size={self.block_size}, "
            f"quantize_activations={self.quantize_activations}, temperature={self.temperature:g}, "
            f"straight_through={self.straight_through}"
        )


class MXLinear(nn.Module):
    """A linear layer whose weight is stored packed in one MX format.

    State (what a checkpoint holds): `weight_packed` (uint8 element codes) and `weight_scale` (uint8 E8M0
    block exponents, `[out_features, ceil(in_features / block_size)]`), plus the float `bias`. The format
    itself is a plain attribute: a checkpoint's `config.json` names it per module, so the module can be
    rebuilt before the tensors are loaded.

    The forward pass quantizes the input activations to the same format along the last dimension
    (when `quantize_activations`), dequantizes the weight to the input's dtype and runs a dense matmul in
    that dtype. With `cache_weight` (the default) the dequantized weight is kept between calls and rebuilt
    only when the packed tensors, the dtype or the device change; without it only the packed form is kept
    (about 1/4 to 1/2 of the bf16 weight memory) and the weight is dequantized on every call.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        fmt: str | MXFormat = "mxfp4_e2m1",
        *,
        block_size: int = 32,
        quantize_activations: bool = True,
        cache_weight: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = get_format(fmt)
        self.block_size = block_size
        self.quantize_activations = quantize_activations
        self.cache_weight = cache_weight
        codes_shape, scales_shape = packed_shapes((out_features, in_features), self.fmt, block_size)
        self.register_buffer("weight_packed", torch.zeros(codes_shape, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(scales_shape, dtype=torch.uint8, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._weight_cache: torch.Tensor | None = None
        self._weight_cache_key: tuple | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fmt: str | MXFormat,
        *,
        block_size: int = 32,
        quantize_activations: bool = True,
    ) -> MXLinear:
        """An `MXLinear` holding `linear`'s weight quantized to `fmt`.

        A `linear` on the meta device (a model skeleton before its checkpoint is loaded) gives an empty
        module of the right shapes on the meta device.
        """
        weight = linear.weight
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            fmt=fmt,
            block_size=block_size,
            quantize_activations=quantize_activations,
            device=weight.device,
            dtype=weight.dtype,
        )
        if weight.is_meta:
            return module
        with torch.no_grad():
            packed = pack_mx(weight.detach(), module.fmt, block_size)
            module.weight_packed.copy_(packed.codes)
            module.weight_scale.copy_(packed.scales)
            if linear.bias is not None:
                module.bias.copy_(linear.bias)
        return module

    def packed_weight(self) -> MXPackedTensor:
        """The weight as an `MXPackedTensor` view of the stored buffers."""
        shape = torch.Size((self.out_features, self.in_features))
        return MXPackedTensor(self.weight_packed, self.weight_scale, self.fmt, shape, self.block_size)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's MX values in `dtype` (cached when `cache_weight`)."""
        if not self.cache_weight:
            self._weight_cache = self._weight_cache_key = None
            return unpack_mx(self.packed_weight(), dtype)
        # Loading and `.to()` replace the buffers, in-place edits (`load_state_dict`) bump their version:
        # compare identity and version. (Tensors made under `torch.inference_mode` have no version.)
        packed, scale = self.weight_packed, self.weight_scale
        key = (dtype, _version(packed), _version(scale))
        cached = self._weight_cache_key
        if cached is None or cached[0] is not packed or cached[1] is not scale or cached[2] != key:
            self._weight_cache = unpack_mx(self.packed_weight(), dtype)
            self._weight_cache_key = (packed, scale, key)
        return self._weight_cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dequantized_weight(x.dtype)
        if self.quantize_activations:
            x = quantize_mx(x, self.fmt, self.block_size)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fmt={self.fmt.name}, block_size={self.block_size}, quantize_activations={self.quantize_activations}"
        )


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def replace_with_mx_linear(
    model: nn.Module,
    format_map: Mapping[str, str],
    *,
    block_size: int = 32,
    quantize_activations: bool = True,
) -> nn.Module:
    """Replace, in place, every `nn.Linear` named in `format_map` by an `MXLinear` in its format.

    Weights are packed from the float linears; on a meta-device skeleton the new modules are empty and
    wait for a packed checkpoint. Raises `ValueError` naming the module when `format_map` names a module
    the model lacks, a module that is not an `nn.Linear`, or one that is already an `MXLinear` (the model
    was already quantized: quantizing twice would compound the error).
    """
    for name, fmt in format_map.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"format_map names module {name!r}, which {type(model).__name__} does not have") from None
        if isinstance(module, MXLinear):
            raise ValueError(
                f"module {name!r} is already an MXLinear ({module.fmt.name}): the model is already dMX-quantized"
            )
        if not isinstance(module, nn.Linear):
            kind = type(module).__name__
            raise ValueError(f"format_map names module {name!r}, a {kind}; only nn.Linear can be quantized")
        new = MXLinear.from_linear(module, fmt, block_size=block_size, quantize_activations=quantize_activations)
        model.set_submodule(name, new)
    return model
