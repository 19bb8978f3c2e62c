"""Randomized Hadamard transforms: the orthogonal rotations that spread outliers before MX quantization.

`RandomizedHadamard(size, block_size, seed)` is the orthogonal matrix `T = D (I ⊗ H ⊗ Q)` acting on the last
dimension of row vectors (`x -> x @ T`):

* `D`: a random diagonal of signs (one per element, from `seed`); with `sign_copies = (copies, run)`, each run of
  `run` drawn signs is used `copies` times in a row (the input of a grouped-query attention's `o_proj`, whose
  query heads of one group read one value head: signs equal across the group can move into `v_proj`'s rows);
* `I ⊗ ...`: the same transform on every `block_size` consecutive elements (block-diagonal; `block_size = size`
  is the full-size transform);
* `H`: the normalized Walsh-Hadamard (Sylvester) matrix of the largest power of two dividing `block_size`, applied
  with `Q` (below) as a Kronecker product `H_2 ⊗ ... ⊗ H_2 ⊗ (H_16 ⊗ Q)` (`kronecker_split`): a matrix product
  with the last factor, then one butterfly of sums and differences per `H_2`, a few dozen additions per element
  instead of `block_size`. The factors hold +-1 and the result is divided by `sqrt` of the order once, at the end, as
  compressed-tensors applies its Hadamard transforms: sums of +-x are exact far more often than sums of
  `+-x / sqrt(n)`, so an exported model's transform computes the same bits as this one;
* `Q`: a random orthogonal matrix (from `seed`) for the odd factor of `block_size` that no Hadamard matrix of
  power-of-two order covers (hidden sizes such as 576 = 64 x 9); the identity when there is none.

A block size of 32 aligns the transform with the MX blocks: each block's values are mixed only among
themselves, so one outlier raises one block scale instead of all of them. The transform is rebuilt exactly from
`(size, block_size, seed)`, which is all a checkpoint records (`to_dict`); it holds no trainable state and adds
nothing to a state dict.

At inference (no gradient wanted) the transform runs as one compiled kernel (`formats.compilation`) with the
butterflies, the division, the rounding to the input's dtype and, through `quantize`, the MX cast that follows; for
32-blocks (a 16 x 16 last factor, `KERNEL_MATRIX_ORDER`) the kernel also applies the signs and the matrix product
(`_signed_product_in_order`), which ran as two operations before it, each writing a new buffer as large as the
activation (on a CPU, fresh buffers that large also cost page faults). A larger last factor (a full-size
transform's) is a matrix product before the kernel. The kernel is checked bit for bit against the same steps run
eagerly; that those give the bits of the eager path's matrix product (products by +-1 are exact, and the sums run in
the order a matrix product's inner loop adds them) is tested.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..formats.blocks import round_to_bfloat16
from ..formats.cast import cast_mx_blocks, compiles, quantize_mx
from ..formats.compilation import CompiledKernel
from ..formats.spec import MXFormat


def _split_power_of_two(n: int) -> tuple[int, int]:
    """`n = 2**k * m` with `m` odd: returns `(2**k, m)`."""
    power = n & -n
    return power, n // power


def _checked_sign_copies(sign_copies: Any, size: int) -> tuple[int, int]:
    """`sign_copies` as `(copies, run)` (`(1, size)` for None or one copy); raises naming what is allowed."""
    if sign_copies is None:
        return 1, size
    pair = tuple(sign_copies) if isinstance(sign_copies, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(n, int) and n >= 1 for n in pair) or size % (pair[0] * pair[1]):
        raise ValueError(
            f"RandomizedHadamard needs sign_copies (copies, run), two positive integers with copies * run dividing "
            f"size={size}; got {sign_copies!r}"
        )
    return (1, size) if pair[0] == 1 else pair


# The power of two in the one Kronecker factor applied as a matrix product: at least 16, at most 64, large enough
# that at most 3 butterflies follow up to blocks of 512 (each is a pass over memory when a gradient is wanted).
MATRIX_FACTOR_ORDERS = (16, 64)


def sylvester_matrix(order: int) -> torch.Tensor:
    """The Sylvester-Hadamard matrix `H_2 ⊗ ... ⊗ H_2` of entries +-1 (symmetric, `H H = order I`), float64."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two order, got {order}")
    matrix = torch.ones(1, 1, dtype=torch.float64, device="cpu")
    while len(matrix) < order:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def hadamard_matrix(order: int) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix `sylvester_matrix(order) / sqrt(order)` (orthogonal), float64."""
    return sylvester_matrix(order) / order**0.5


def kronecker_split(power: int, odd: torch.Tensor) -> tuple[int, torch.Tensor]:
    """`sylvester_matrix(power) ⊗ odd` as `H_2 ⊗ ... ⊗ H_2 ⊗ M`: the number of `H_2` factors (each a butterfly of
    sums and differences) and the float64 matrix `M = sylvester_matrix(m) ⊗ odd` (one matrix product), `m` between
    `MATRIX_FACTOR_ORDERS` (`power / 8` where that falls between them; all of `power` below the lower one). Of the
    splits of a 32-block, a product with a 16 x 16 matrix and one butterfly measured fastest on a CPU at inference
    (a matrix product's cost grows with its order; inductor inlines the butterflies into the kernel that follows);
    eagerly, with a gradient, each butterfly is a pass over the activation, so larger blocks take a larger matrix."""
    low, high = MATRIX_FACTOR_ORDERS
    order = min(power, max(low, min(high, power // 8)))
    return (power // order).bit_length() - 1, torch.kron(sylvester_matrix(order), odd.contiguous())


def _finish_blocks(x: torch.Tensor, butterflies: int, last: int, norm: float | torch.Tensor) -> torch.Tensor:
    """Rows `x` whose blocks were multiplied by their last Kronecker factor (of order `last`), multiplied by the
    others, `Sylvester(2) ⊗ ... ⊗ Sylvester(2)` (`butterflies` of them), as sums and differences, then divided by
    `norm`."""
    rows, width = x.shape
    x = x.reshape(rows, -1, *(2,) * butterflies, last)
    for axis in range(2, 2 + butterflies):
        first, second = x.unbind(axis)
        x = torch.stack((first + second, first - second), axis)
    return x.reshape(rows, width) / norm


# The largest last Kronecker factor the inference kernel multiplies by itself (`order` products per element); a larger
# one is a matrix product run before the kernel.
KERNEL_MATRIX_ORDER = 16


def _signed_product_in_order(x: torch.Tensor, signs: torch.Tensor, matrix: torch.Tensor, order: int) -> torch.Tensor:
    """Rows `x` times the signs, then each block's last Kronecker factor (`matrix`, `order` x `order`, flattened),
    in float32, its `order` products added in the order of the factor's rows, one after the other, as a matrix
    product's inner loop adds them (and, the factor's entries being +-1, as a fused multiply-add rounds them). Compiled,
    one pass over `x` with nothing stored between; a matrix product writes a buffer as large as `x`."""
    rows, width = x.shape
    signed = (x.float() * signs).view(rows, width // order, order)
    product = signed[..., :1] * matrix[:order]
    for k in range(1, order):
        product = product + signed[..., k : k + 1] * matrix[k * order : (k + 1) * order]
    return product.view(rows, width)


# Keeps a float16 rounding between the transform and the cast, which inductor otherwise drops.
@functools.partial(CompiledKernel, options={"emulate_precision_casts": True})
def _transform_kernel(
    x: torch.Tensor,
    signs: torch.Tensor | None,
    matrix: torch.Tensor | None,
    butterflies: int,
    last: int,
    norm: float,
    dtype: torch.dtype,
    cast: tuple | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The transform of rows `x` from the product with its last Kronecker factor on: with `signs` and `matrix` (the
    factor flattened, `_signed_product_in_order`), `x` is the input and the kernel computes that product too;
    without, `x` is the product. Then `_finish_blocks`, rounded to `dtype` (returned as float32) and, with `cast`
    (format, block size, scale rule), MX-quantized (the values and the block output of
    `formats.cast.cast_mx_blocks`)."""
    if signs is not None:
        x = _signed_product_in_order(x, signs, matrix, last)
    finished = _finish_blocks(x, butterflies, last, norm)
    finished = round_to_bfloat16(finished) if dtype == torch.bfloat16 else finished.to(dtype).float()
    return finished if cast is None else cast_mx_blocks(finished, *cast, native_cast=False)


class RandomizedHadamard(nn.Module):
    """The orthogonal transform `x -> x @ T` of the last dimension described in the module docstring.

    Args:
        size: length of the transformed dimension.
        block_size: the transform is block-diagonal with blocks of this length (`size` for a full transform);
            must divide `size`.
        seed: seeds the signs and the odd-factor rotation; the same arguments always give the same matrix.
        sign_copies: `(copies, run)`: `size / copies` signs are drawn and each run of `run` of them is used `copies`
            times in a row; `(1, size)` (default) draws one per element.
    """

    def __init__(
        self, size: int, block_size: int | None = None, seed: int = 0, sign_copies: tuple[int, int] | None = None
    ):
        super().__init__()
        block_size = size if block_size is None else block_size
        if not (
            isinstance(size, int) and isinstance(block_size, int) and 0 < block_size <= size and size % block_size == 0
        ):
            raise ValueError(
                f"RandomizedHadamard needs a block_size dividing size; got size={size!r}, block_size={block_size!r}"
            )
        self.size, self.block_size, self.seed = size, block_size, int(seed)
        self.sign_copies = copies, run = _checked_sign_copies(sign_copies, size)
        self.power, self.odd = _split_power_of_two(block_size)
        generator = torch.Generator().manual_seed(self.seed)
        # Explicitly on the CPU: transformers builds checkpoints' modules under a meta-device context.
        drawn = torch.randint(0, 2, (size // copies,), generator=generator, device="cpu").to(torch.float64) * 2 - 1
        signs = drawn.view(-1, run).repeat_interleave(copies, 0).flatten()
        odd = torch.linalg.qr(torch.randn(self.odd, self.odd, generator=generator, dtype=torch.float64, device="cpu"))[
            0
        ]
        # A block is indexed as a tensor of shape (2, ..., 2, len(last)), one axis per Kronecker factor of `H ⊗ Q`:
        # the transform multiplies each axis by its factor's matrix (a butterfly for each axis of 2).
        self._butterflies, last = kronecker_split(self.power, odd)
        self._norm = torch.tensor(self.power, dtype=torch.float64, device="cpu").sqrt()  # H = sylvester / _norm
        # Plain float64 tensors, not buffers: `model.to(torch.bfloat16)` must not round them (the merged weights
        # were computed with these exact values), and a state dict has nothing to hold.
        self._factors = {(torch.device("cpu"), torch.float64): (signs, last)}
        self._last_order = len(last)

    def _factors_as(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The signs and the last factor's matrix on `device` in `dtype` (converted once, then kept)."""
        key = (device, dtype)
        if key not in self._factors:
            signs, last = self._factors[(torch.device("cpu"), torch.float64)]
            self._factors[key] = (signs.to(device, dtype), last.to(device, dtype))
        return self._factors[key]

    def _mixed_last_axis(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x` (rows) times the signs `D`, then each block's last Kronecker factor, as a `dtype` matrix product: the
        product of a bfloat16 `x` and float32 signs is float32, one pass."""
        signs, last = self._factors_as(x.device, dtype)
        return ((x * signs).view(-1, len(last)) @ last).view(x.shape)

    def _transform_rows(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x @ T` computed in `dtype` (float32 or float64), eagerly, rows of `x`'s last dimension."""
        rows = x.reshape(-1, self.size)
        mixed = _finish_blocks(self._mixed_last_axis(rows, dtype), self._butterflies, self._last_order, self._norm)
        return mixed.view(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ T`, computed in float32 (the MX quantizers' precision) and returned in `x`'s dtype."""
        return self._transformed(x, None)

    def quantize(self, x: torch.Tensor, fmt: MXFormat, block_size: int, scale_rule: str) -> torch.Tensor:
        """`formats.quantize_mx(self(x), fmt, block_size, scale_rule)`, the same bits, with the cast in the
        transform's compiled kernel."""
        return self._transformed(x, (fmt, block_size, scale_rule))

    def _transformed(self, x: torch.Tensor, cast: tuple[MXFormat, int, str] | None) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"RandomizedHadamard of size {self.size} applied to a last dimension of {x.shape[-1]}")
        fused = _transform_kernel.active and not (x.requires_grad and torch.is_grad_enabled())
        if fused and (cast is None or compiles(self.size, cast[1])):
            rows = x.reshape(-1, self.size)
            signs, last = self._factors_as(x.device, torch.float32)
            if self._last_order <= KERNEL_MATRIX_ORDER:  # the whole transform in the kernel
                inputs = rows, signs, last.view(-1)
            else:
                inputs = self._mixed_last_axis(rows, torch.float32), None, None
            finished = _transform_kernel(*inputs, self._butterflies, self._last_order, float(self._norm), x.dtype, cast)
            return (finished if cast is None else finished[0]).to(x.dtype).view(x.shape)
        transformed = self._transform_rows(x.float(), torch.float32).to(x.dtype)
        return transformed if cast is None else quantize_mx(transformed, *cast)

    @property
    def key(self) -> tuple[int, int, int, tuple[int, int]]:
        """`(size, block_size, seed, sign_copies)`: equal keys, equal transforms (modules may share the results)."""
        return self.size, self.block_size, self.seed, self.sign_copies

    def signs(self) -> torch.Tensor:
        """The diagonal of `D`: one sign (+-1, float64) per element of the transformed dimension."""
        return self._factors[(torch.device("cpu"), torch.float64)][0].clone()

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """`T` itself, `[size, size]`, computed in float64 on the CPU (for merging the transform into weights)."""
        return self._transform_rows(torch.eye(self.size, dtype=torch.float64, device="cpu"), torch.float64).to(dtype)

    def to_dict(self) -> dict[str, Any]:
        """What rebuilds this transform exactly (`from_dict`): stored per module in config.json."""
        spec = {"type": "randomized_hadamard", "size": self.size, "block_size": self.block_size, "seed": self.seed}
        if self.sign_copies[0] > 1:
            spec["sign_copies"] = list(self.sign_copies)
        return spec

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> RandomizedHadamard:
        if not isinstance(spec, dict) or spec.get("type") != "randomized_hadamard":
            raise ValueError(f"unknown input transform {spec!r}; allowed: type 'randomized_hadamard'")
        return cls(int(spec["size"]), int(spec["block_size"]), int(spec["seed"]), spec.get("sign_copies"))

    def extra_repr(self) -> str:
        copies = f", sign_copies={self.sign_copies}" if self.sign_copies[0] > 1 else ""
        return f"size={self.size}, block_size={self.block_size}, seed={self.seed}{copies}"


class TransformedLinear(nn.Linear):
    """An `nn.Linear` that applies an online `input_transform` to its input: `y = (x @ T) W'^T + b`.

    The rotation pass merges `T`'s inverse into the weight (`W' = W T`), so the float layer computes what the
    original did; quantizing it (`MXLinear`, `DMXLinear`) quantizes the transformed input, whose outliers the
    transform has spread.
    """

    def __init__(self, linear: nn.Linear, input_transform: RandomizedHadamard):
        super().__init__(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        self.weight, self.bias = linear.weight, linear.bias
        self.input_transform = input_transform

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.input_transform(x), self.weight, self.bias)
