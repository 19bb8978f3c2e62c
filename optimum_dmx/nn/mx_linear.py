"""`MXLinear`: the inference module of dMX, a linear layer whose weight is stored packed in one MX format."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..formats import MXFormat, MXPackedTensor, get_format, pack_mx, packed_shapes, quantize_mx, unpack_mx
from ..formats.spec import validate_scale_rule
from .input_cache import InputCache, tensor_version
from .transforms import RandomizedHadamard


class MXLinear(nn.Module):
    """A linear layer whose weight is stored packed in one MX format.

    State (what a checkpoint holds): `weight_packed` (uint8 element codes) and `weight_scale` (uint8 E8M0
    block exponents, `[out_features, ceil(in_features / block_size)]`), plus the float `bias`. The format
    itself is a plain attribute: a checkpoint's `config.json` names it per module, so the module can be
    rebuilt before the tensors are loaded.

    The forward pass quantizes the input activations to the same format along the last dimension
    (when `quantize_activations`, with block scales by `scale_rule`: see `formats.spec.SCALE_RULES`), dequantizes the
    weight to the input's dtype and runs a dense matmul in that dtype. With `cache_weight` (the default) the
    dequantized weight is kept between calls and rebuilt only when the packed tensors, the dtype or the device
    change; without it only the packed form is kept
    (about 1/4 to 1/2 of the bf16 weight memory) and the weight is dequantized on every call.

    An `input_transform` (an online rotation, `nn.transforms`) is applied to the input before its quantization (in
    one compiled kernel with it at inference); the stored weight already holds its inverse. Like the format, it is
    rebuilt from config.json.

    `input_casts`, when set (`replace_with_mx_linear` gives all the modules of a model one), is an `InputCache`
    shared with the other modules: linears that read the same input tensor with the same transform and format
    (q/k/v, gate/up) transform and quantize it once per forward pass. The results are the same bits either way.
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
        scale_rule: str = "ocp",
        cache_weight: bool = True,
        input_transform: RandomizedHadamard | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = get_format(fmt)
        self.block_size = block_size
        self.quantize_activations = quantize_activations
        self.scale_rule = validate_scale_rule(scale_rule)
        self.cache_weight = cache_weight
        self.input_transform = input_transform
        codes_shape, scales_shape = packed_shapes((out_features, in_features), self.fmt, block_size)
        self.register_buffer("weight_packed", torch.zeros(codes_shape, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(scales_shape, dtype=torch.uint8, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._weight_cache: torch.Tensor | None = None
        self._weight_cache_key: tuple | None = None
        self.input_casts: InputCache | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fmt: str | MXFormat,
        *,
        block_size: int = 32,
        quantize_activations: bool = True,
        scale_rule: str = "ocp",
        input_transform: RandomizedHadamard | None = None,
    ) -> MXLinear:
        """An `MXLinear` holding `linear`'s weight quantized to `fmt` (block scales by `scale_rule`).

        The input transform is `input_transform`, else that of a `TransformedLinear` `linear`.

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
            scale_rule=scale_rule,
            input_transform=input_transform
            if input_transform is not None
            else getattr(linear, "input_transform", None),
            device=weight.device,
            dtype=weight.dtype,
        )
        if weight.is_meta:
            return module
        with torch.no_grad():
            packed = pack_mx(weight.detach(), module.fmt, block_size, scale_rule)
            module.weight_packed.copy_(packed.codes)
            module.weight_scale.copy_(packed.scales)
            if linear.bias is not None:
                module.bias.copy_(linear.bias)
        return module

    def __getattr__(self, name: str) -> object:
        # Every read of a buffer or parameter passes here, forward passes included: one comparison before nn.Module's
        # lookup (about 0.1 us a read; a `try` around it cost twice that). Never called for the stand-in weight a
        # checkpoint's loading sets in the instance's __dict__ (`integration.hf_quantizer`).
        if name == "weight":
            raise AttributeError(
                f"MXLinear has no weight: it stores it packed in {self.fmt.name} (weight_packed, weight_scale; "
                "dequantized_weight(dtype) gives its values) and quantizes in its forward pass, so code that uses a "
                "quantized linear's weight itself cannot run on it: keep that linear in float with "
                "modules_to_not_convert"
            )
        return nn.Module.__getattr__(self, name)

    @property
    def weight_shape(self) -> torch.Size:
        """Shape of the (unpacked) weight, `(out_features, in_features)`."""
        return torch.Size((self.out_features, self.in_features))

    def packed_weight(self) -> MXPackedTensor:
        """The weight as an `MXPackedTensor` view of the stored buffers."""
        return MXPackedTensor(self.weight_packed, self.weight_scale, self.fmt, self.weight_shape, self.block_size)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's MX values in `dtype` (cached when `cache_weight`, except inside `torch.compile`, which traces
        the unpacking into its graph: the cache's bookkeeping would break the graph at every linear)."""
        if torch.compiler.is_compiling():
            return unpack_mx(self.packed_weight(), dtype)
        if not self.cache_weight:
            self._weight_cache = self._weight_cache_key = None
            return unpack_mx(self.packed_weight(), dtype)
        # Loading and `.to()` replace the buffers, in-place edits (`load_state_dict`) bump their version:
        # compare identity and version. (Tensors made under `torch.inference_mode` have no version.)
        packed, scale = self.weight_packed, self.weight_scale
        key = (dtype, tensor_version(packed), tensor_version(scale))
        cached = self._weight_cache_key
        if cached is None or cached[0] is not packed or cached[1] is not scale or cached[2] != key:
            self._weight_cache = unpack_mx(self.packed_weight(), dtype)
            self._weight_cache_key = (packed, scale, key)
        return self._weight_cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dequantized_weight(x.dtype)
        x = self.matmul_input(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def matmul_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the matmul multiplies: `x` transformed by `input_transform` and quantized to the module's format
        (each when the module has it), computed once per input tensor among the modules sharing `input_casts` (not
        inside `torch.compile`, which traces the steps themselves)."""
        transform = self.input_transform
        if transform is None and not self.quantize_activations:
            return x

        def compute() -> torch.Tensor:
            if not self.quantize_activations:
                return transform(x)
            if transform is None:
                return quantize_mx(x, self.fmt, self.block_size, self.scale_rule)
            return transform.quantize(x, self.fmt, self.block_size, self.scale_rule)

        if self.input_casts is None or torch.compiler.is_compiling():
            return compute()
        return self.input_casts.get(x, self.matmul_input_key, compute)

    @property
    def matmul_input_key(self) -> tuple:
        """Equal keys, equal `matmul_input` of the same tensor: the transform, and the format when quantized."""
        transform = None if self.input_transform is None else self.input_transform.key
        quantized = (self.fmt.name, self.block_size, self.scale_rule) if self.quantize_activations else None
        return transform, quantized

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fmt={self.fmt.name}, block_size={self.block_size}, quantize_activations={self.quantize_activations}, "
            f"scale_rule={self.scale_rule}"
        )
