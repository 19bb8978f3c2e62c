"""Randomized Hadamard transforms: the orthogonal rotations that spread outliers before MX quantization.

`RandomizedHadamard(size, block_size, seed)` is the orthogonal matrix `T = D (I ⊗ H ⊗ Q)` acting on the last
dimension of row vectors (`x -> x @ T`):

* `D`: a random diagonal of signs (one per element, from `seed`); with `sign_copies = (copies, run)`, each run of
  `run` drawn signs is used `copies` times in a row (the input of a grouped-query attention's `o_proj`, whose
  query heads of one group read one value head: signs equal across the group can move into `v_proj`'s rows); with
  `signed=False`, the identity (a plain block Hadamard transform: the rotations put the signs into the module
  producing the input where it can take them, `nn.rotation.sign_carriers`, and draw none elsewhere);
* `I ⊗ ...`: the same transform on every `block_size` consecutive elements (block-diagonal; `block_size = size`
  is the full-size transform);
* `H`: the normalized Walsh-Hadamard (Sylvester) matrix of the largest power of two dividing `block_size`, applied
  with `Q` (below) as a Kronecker product `S ⊗ (H_m ⊗ Q)` (`kronecker_split`): a matrix product with the last
  factor, then one with the Sylvester matrix `S` across the block's runs of its order, a few dozen multiply-adds per
  element instead of `block_size`. The factors hold +-1 and the result is divided by `sqrt` of the order once, at the
  end, as compressed-tensors applies its Hadamard transforms: sums of +-x are exact far more often than sums of
  `+-x / sqrt(n)`, so an exported model's transform computes the same bits as this one;
* `Q`: a random orthogonal matrix (from `seed`) for the odd factor of `block_size` that no Hadamard matrix of
  power-of-two order covers (hidden sizes such as 576 = 64 x 9); the identity when there is none.

A block size of 32 aligns the transform with the MX blocks: each block's values are mixed only among
themselves, so one outlier raises one block scale instead of all of them. The transform is rebuilt exactly from
`(size, block_size, seed)` (and `sign_copies`, `signed`), which is all a checkpoint records (`to_dict`); it holds no
trainable state and adds nothing to a state dict.

At inference (no gradient wanted) a 32-block transform (a 16 x 16 last factor and `S` of order 2, `KERNEL_MATRIX_ORDER`)
runs as one compiled kernel (`formats.compilation`): the signs if any, both products (`_signed_product_in_order`, then
one sum and one difference), the division, the rounding to the input's dtype and, through `quantize`, the MX cast that
follows, reading and writing the input's dtype; as separate operations each wrote a new buffer as large as the
activation. On a CPU, for an input not in float32, the signs come inside the factor, one copy of it per run of 16
elements (a product then loads a vector of the matrix instead of a sign and multiplies once less); the kernel divides
and rounds the sums before it stores them, so that the MX cast's two loops over them do not each do it again, and rounds
with `.to(dtype)` (rounded on the float32 bit pattern, which inductor read through scalar bit casts on an AMX Xeon, a
bfloat16 transform with its cast took 3.1x the cast's time there, against 1.9x: `research/inference_kernel_choices.py`
times each such choice beside what it replaced). Larger blocks (`hadamard`'s 512-blocks of SmolLM2's `down_proj` input)
take the product by the last factor as torch's matrix product, a chunk of rows at a time on a CPU
(`formats.cast.fill_row_chunks`: float32 temporaries small enough for the allocator to reuse); on a CPU the rest, the
product across the runs by the Sylvester factor, the division, the rounding and the MX cast, is one compiled kernel
(`_sylvester_kernel`; its transformed values stored once, where inductor would compute them again in each of the cast's
loops), which took 0.88x the time of that product, division and rounding as torch's operations followed by the cast's
kernel, for a bfloat16 1024 x 1536 input on 512-blocks (0.90x in float32; `research/inference_kernel_choices.py`), and
which stores its values straight into the chunk's rows of the output. Such a transform's signs are best kept out of it:
a rotation puts them into the layer producing the input where it can (`split_signs`), and a transform without signs
multiplies by none. On a GPU both products, the division and the rounding are torch's operations, then the cast's
kernel. Each kernel is checked bit for bit against the same steps run eagerly; that those give the bits of the eager
path's matrix products (products by +-1 are exact, and the sums run in the order a matrix product's inner loop adds
them) is tested.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..formats.cast import cast_mx_blocks, compiles, fill_row_chunks, map_row_chunks, quantize_mx
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


# The power of two in the last Kronecker factor: at least 16, at most 64 (a matrix product's cost grows with its order,
# and so does the product across the factor's runs when the factor is small).
MATRIX_FACTOR_ORDERS = (16, 64)


def sylvester_matrix(order: int) -> torch.Tensor:
    """The Sylvester-Hadamard matrix `H_2 ⊗ ... ⊗ H_2` of entries +-1 (symmetric, `H H = order I`), float64."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two order, got {order}")
    matrix = torch.ones(1, 1, dtype=torch.float64, device="cpu")
    while len(matrix) < order:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def kronecker_split(power: int, odd: torch.Tensor) -> tuple[int, torch.Tensor]:
    """`sylvester_matrix(power) ⊗ odd` as `sylvester_matrix(2**k) ⊗ M`: `k` and the float64 matrix
    `M = sylvester_matrix(m) ⊗ odd`, `m` the power of two at or above `sqrt(power)`, clamped to `MATRIX_FACTOR_ORDERS`
    (all of `power` below the lower bound). For a 32-block, `k = 1` (a 16 x 16 product, then one sum and one
    difference), all in one kernel at inference. For larger blocks two factors of about equal order cost least on a
    CPU: 512-blocks as a 32 x 32 product and one of order 16 (with the MX cast, 3.2 against 3.9 ms per 1024 x 1536
    float32 input for 64 x 64 and order 8, `research/inference_kernel_choices.py`); 1024-blocks as 32 and 32."""
    low, high = MATRIX_FACTOR_ORDERS
    order = min(power, max(low, min(high, 1 << (power.bit_length() // 2))))
    return (power // order).bit_length() - 1, torch.kron(sylvester_matrix(order), odd.contiguous())


def _sylvester_product(x: torch.Tensor, sylvester: torch.Tensor | None, last: int) -> torch.Tensor:
    """Rows `x`, each block seen as `len(sylvester)` runs of `last` elements, multiplied across the runs by the
    Sylvester matrix (`None`: order 1, nothing to do). Order 2 (32-blocks, the default rotation's, in every
    calibration step) is one sum and one difference, about 3x faster than a batch of 2 x 2 products with their
    gradient; larger orders are one matrix product."""
    if sylvester is None:
        return x
    if len(sylvester) == 2:
        return _sum_and_difference(x, last)
    return torch.matmul(sylvester, x.reshape(-1, len(sylvester), last)).view(x.shape)


def _sum_and_difference(
    x: torch.Tensor, last: int, then: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """Rows `x` multiplied across pairs of runs of `last` elements by the Sylvester matrix of order 2
    (`[[1, 1], [1, -1]]`): one sum and one difference, which also compile into the inference kernel. `then`, an
    element-wise function, is applied to both before they are put together: in the kernel the division and the
    rounding, which inductor then computes once and stores, where it otherwise computes them again in each of the MX
    cast's two loops over the stored sums."""
    rows, width = x.shape
    first, second = x.view(rows, -1, 2, last).unbind(2)
    total, difference = first + second, first - second
    if then is not None:
        total, difference = then(total), then(difference)
    return torch.stack((total, difference), 2).view(rows, width)


# The largest last Kronecker factor the inference kernel multiplies by itself (`order` products per element), when the
# Sylvester factor across its runs is of order 2 at most; else the products run as torch's matrix products.
KERNEL_MATRIX_ORDER = 16


def _signed_product_in_order(
    x: torch.Tensor, signs: torch.Tensor | None, matrices: torch.Tensor, order: int
) -> torch.Tensor:
    """Rows `x` times the signs, then each run of `order` elements times the last Kronecker factor (`order` x
    `order`), in float32, its `order` products added in the order of the factor's rows, one after the other, as a
    matrix product's inner loop adds them (and, the factor's entries being +-1, as a fused multiply-add rounds them).
    `matrices` holds the factor (flattened), or, with `signs` None for a signed transform, one copy of it per run with
    the run's signs in its rows (`RandomizedHadamard._signed_run_matrices`): the same products, as a sign flips a
    product exactly. Compiled, one pass over `x` with nothing stored between; a matrix product writes a buffer as
    large as `x`."""
    rows, width = x.shape
    signed = (x.float() if signs is None else x.float() * signs).view(rows, width // order, order)
    factor = matrices.view(-1, order, order)  # one matrix for every run, or one per run
    product = signed[..., :1] * factor[:, 0]
    for k in range(1, order):
        product = product + signed[..., k : k + 1] * factor[:, k]
    return product.view(rows, width)


# `emulate_precision_casts` keeps a float16 rounding between the transform and the cast, which inductor otherwise
# drops. The two thresholds keep the 16 x 16 product in one loop: by default inductor stores the sum of its first
# 13 terms in a buffer as large as the input and adds the rest in a second pass (2.9x against 2.3x the plain cast
# on a 1024 x 1536 input, `research/inference_kernel_choices.py`). The same operations in the same order: the same bits.
@functools.partial(
    CompiledKernel,
    options={
        "emulate_precision_casts": True,
        "realize_cpu_acc_reads_threshold": 100,
        "realize_cpu_opcount_threshold": 1000,
    },
)
def _transform_kernel(
    x: torch.Tensor,
    signs: torch.Tensor | None,
    matrices: torch.Tensor,
    pairs: bool,
    last: int,
    norm: float,
    dtype: torch.dtype,
    cast: tuple | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The transform of rows `x` (the signs, or none with one copy of the last factor per run in `matrices`; the
    product by the last factor, `last` x `last`, `_signed_product_in_order`; with `pairs`, the Sylvester factor of
    order 2, `_sum_and_difference`) divided by `norm`, rounded to `dtype` and, with `cast`
    (format, block size, scale rule), MX-quantized (the values and the block output of
    `formats.cast.cast_mx_blocks`)."""

    def finish(values: torch.Tensor) -> torch.Tensor:
        return (values / norm).to(dtype).float()

    product = _signed_product_in_order(x, signs, matrices, last)
    finished = _sum_and_difference(product, last, finish) if pairs else finish(product)
    if cast is None:
        return finished.to(dtype)
    values, block_output = cast_mx_blocks(finished, *cast, native_cast=False)
    return values.to(dtype), block_output


@functools.partial(CompiledKernel, options=_transform_kernel.options, writes_into="out")
def _sylvester_kernel(
    mixed: torch.Tensor,
    sylvester: torch.Tensor,
    out: torch.Tensor,
    last: int,
    norm: float,
    dtype: torch.dtype,
    cast: tuple | None,
) -> tuple[torch.Tensor, ...]:
    """The rest of a large block's transform after the product by its last factor (`mixed`: float32 rows, each block
    `order` runs of `last` elements): the product across each block's runs by the Sylvester matrix (`sylvester`,
    `order` x `order`, flattened), its `order` terms added one after the other as a matrix product's inner loop adds
    them (`_sylvester_product`'s bits), divided by `norm`, rounded to `dtype` and, with `cast` (format, block size,
    scale rule), MX-quantized, the values written into `out` (rows of `mixed`'s shape in `dtype`). Returns, with
    `cast`, the shared exponents and the transformed values, block outputs (`formats.compilation`): stored once, the
    transformed values are read by the cast's two loops over each block instead of computed again in each."""
    rows, width = mixed.shape
    order = math.isqrt(len(sylvester))
    runs = mixed.view(rows, width // (order * last), order, 1, last)
    columns = sylvester.view(order, order).t()
    product = runs[:, :, 0] * columns[0].view(order, 1)
    for k in range(1, order):
        product = product + runs[:, :, k] * columns[k].view(order, 1)
    finished = (product / norm).to(dtype).float()
    if cast is None:
        out.copy_(finished.view(rows, width))
        return ()
    # The cast on a view of whole blocks: read through the rows' flat layout, inductor computed the values in a
    # scalar loop, several times slower (measured once, while the kernel was written).
    values, block_output = cast_mx_blocks(finished.view(rows, -1, cast[1]), *cast, native_cast=False)
    out.copy_(values.view(rows, width))
    return block_output, finished


class RandomizedHadamard(nn.Module):
    """The orthogonal transform `x -> x @ T` of the last dimension described in the module docstring.

    Args:
        size: length of the transformed dimension.
        block_size: the transform is block-diagonal with blocks of this length (`size` for a full transform);
            must divide `size`.
        seed: seeds the signs and the odd-factor rotation; the same arguments always give the same matrix.
        sign_copies: `(copies, run)`: `size / copies` signs are drawn and each run of `run` of them is used `copies`
            times in a row; `(1, size)` (default) draws one per element.
        signed: False makes `D` the identity (no signs are drawn; `seed` still draws `Q`).
    """

    def __init__(
        self,
        size: int,
        block_size: int | None = None,
        seed: int = 0,
        sign_copies: tuple[int, int] | None = None,
        signed: bool = True,
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
        self.signed = bool(signed)
        signs = None  # unsigned: nothing to multiply by
        if self.signed:
            drawn = torch.randint(0, 2, (size // copies,), generator=generator, device="cpu").to(torch.float64) * 2 - 1
            signs = drawn.view(-1, run).repeat_interleave(copies, 0).flatten()
        odd = torch.linalg.qr(torch.randn(self.odd, self.odd, generator=generator, dtype=torch.float64, device="cpu"))[
            0
        ]
        # A block is indexed as a matrix of shape (2**k, len(last)): the transform multiplies its rows by the last
        # factor's matrix, then its columns by the Sylvester matrix of order 2**k.
        sylvester_power, last = kronecker_split(self.power, odd)
        # H = sylvester / _norm. `math.sqrt` is correctly rounded; torch 2.13's float64 sqrt on a CPU with AVX-512
        # returned sqrt(32) one unit in the last place low.
        self._norm = torch.tensor(math.sqrt(self.power), dtype=torch.float64, device="cpu")
        sylvester = sylvester_matrix(2**sylvester_power) if sylvester_power else None
        # Plain float64 tensors, not buffers: `model.to(torch.bfloat16)` must not round them (the merged weights
        # were computed with these exact values), and a state dict has nothing to hold.
        self._factors = {(torch.device("cpu"), torch.float64): (signs, last, sylvester)}
        self._last_order = len(last)
        self._signed_runs: torch.Tensor | None = None
        # The whole transform in the inference kernel: a small last factor and at most one sum and difference.
        self._whole_in_kernel = self._last_order <= KERNEL_MATRIX_ORDER and sylvester_power <= 1
        self._pairs = sylvester_power == 1  # the Sylvester factor is one sum and one difference
        self._across_runs = sylvester_power > 0  # a Sylvester factor across the last factor's runs

    def _factors_as(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
        """The signs (None when not `signed`), the last factor's matrix and the Sylvester one (or None) on `device`
        in `dtype` (converted once, then kept)."""
        key = (device, dtype)
        if key not in self._factors:
            factors = self._factors[(torch.device("cpu"), torch.float64)]
            self._factors[key] = tuple(None if f is None else f.to(device, dtype) for f in factors)
        return self._factors[key]

    def _products(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`rows @ T` times the norm (before the division), computed in `dtype` (float32 or float64): the signs
        `D`, each block's last factor, then the Sylvester factor, as matrix products (the product of a bfloat16
        `rows` and float32 signs is float32, one pass), in `dtype` under `torch.autocast` as well. `rows` may be
        strided (Mamba's `x_proj` reads a transposed view of one sequence's activations)."""
        sylvester = self._factors_as(rows.device, dtype)[2]
        with torch.autocast(rows.device.type, enabled=False):
            return _sylvester_product(self._last_factor_products(rows, dtype), sylvester, self._last_order)

    def _last_factor_products(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`rows` times the signs `D`, then each run of `_last_order` elements times the last Kronecker factor: the
        first of `_products`' two matrix products, in `dtype` (float32 or float64), outside `torch.autocast`."""
        signs, last, _ = self._factors_as(rows.device, dtype)
        with torch.autocast(rows.device.type, enabled=False):
            signed = rows.to(dtype) if signs is None else rows * signs
            return (signed.reshape(-1, len(last)) @ last).view(rows.shape)

    def _transform_rows(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x @ T` computed in `dtype` (float32 or float64), eagerly, rows of `x`'s last dimension."""
        return (self._products(x.reshape(-1, self.size), dtype) / self._norm).view(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ T`, computed in float32 (the MX quantizers' precision) and returned in `x`'s dtype."""
        return self._transformed(x, None)

    def quantize(self, x: torch.Tensor, fmt: MXFormat, block_size: int, scale_rule: str) -> torch.Tensor:
        """`formats.quantize_mx(self(x), fmt, block_size, scale_rule)`, the same bits, with the cast in the
        transform's compiled kernel."""
        return self._transformed(x, (fmt, block_size, scale_rule))

    def _transformed(self, x: torch.Tensor, cast: tuple[MXFormat, int, str] | None) -> torch.Tensor:
        self._check_size(x)
        fused = _transform_kernel.active and not (x.requires_grad and torch.is_grad_enabled())
        if fused and (cast is None or compiles(self.size, cast[1])):
            rows = x.reshape(-1, self.size)
            if self._whole_in_kernel:
                return self._kernel_values(rows, x.dtype, cast).view(x.shape)
            if rows.device.type == "cpu" and self._across_runs:
                fill = lambda chunk, out: self._sylvester_kernel_into(chunk, out, cast)  # noqa: E731
                return fill_row_chunks(fill, rows, x.dtype).view(x.shape)
            return map_row_chunks(lambda chunk: self._kernel_values(chunk, x.dtype, cast), rows, x.dtype).view(x.shape)
        transformed = self._transform_rows(x.float(), torch.float32).to(x.dtype)
        return transformed if cast is None else quantize_mx(transformed, *cast)

    def _check_size(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.size:
            raise ValueError(f"RandomizedHadamard of size {self.size} applied to a last dimension of {x.shape[-1]}")

    def _kernel_values(self, rows: torch.Tensor, dtype: torch.dtype, cast: tuple | None) -> torch.Tensor:
        """The transform of `rows` in `dtype`, MX-quantized with `cast`: the whole of it in `_transform_kernel`;
        elsewhere than in `_sylvester_kernel_into` (a CPU's larger blocks), both matrix products, the division and
        the rounding as torch's own operations, then the MX cast's kernel (`formats.quantize_mx`)."""
        if self._whole_in_kernel:
            kernel_input = rows, *self._kernel_factor(rows), self._pairs, self._last_order
            finished = _transform_kernel(*kernel_input, float(self._norm), dtype, cast)
            return finished if cast is None else finished[0]
        transformed = self._products(rows, torch.float32).div_(self._norm).to(dtype)
        return transformed if cast is None else quantize_mx(transformed, *cast)

    def _sylvester_kernel_into(self, rows: torch.Tensor, out: torch.Tensor, cast: tuple | None) -> None:
        """The transform of `rows`, MX-quantized with `cast`, written into `out` (in its dtype): the product by the
        last factor as torch's matrix product, then the rest in `_sylvester_kernel`. On a CPU, for a transform with a
        Sylvester factor that `_transform_kernel` does not compute whole (SmolLM2's 512-blocks)."""
        sylvester = self._factors_as(rows.device, torch.float32)[2]
        mixed = self._last_factor_products(rows, torch.float32)
        _sylvester_kernel(mixed, sylvester.view(-1), out, self._last_order, float(self._norm), out.dtype, cast)

    def _kernel_factor(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The signs and the last factor (flattened) that the inference kernel takes to compute the whole transform
        of `rows`: on a CPU, for rows not in float32, no signs and one copy of the factor per run with the signs in
        it (`_signed_run_matrices`); without signs (not `signed`), the factor alone."""
        signs, last, _ = self._factors_as(rows.device, torch.float32)
        if signs is not None and rows.device.type == "cpu" and rows.dtype != torch.float32:
            return None, self._signed_run_matrices().view(-1)
        return signs, last.view(-1)

    def _signed_run_matrices(self) -> torch.Tensor:
        """The last factor once per run of `_last_order` elements of the input, each copy with its run's signs in its
        rows (float32, on the CPU, `[size / order, order * order]`: `size * order` values, made on first use, then
        kept). The inference kernel's factor on a CPU for inputs not in float32, where a vector of the matrix costs
        less than a sign and one more multiplication per product; in float32 the signs apart cost less
        (`research/inference_kernel_choices.py` times both in bfloat16)."""
        if self._signed_runs is None:
            signs, last, _ = self._factors_as(torch.device("cpu"), torch.float32)
            order = self._last_order
            self._signed_runs = (signs.view(-1, order, 1) * last.view(1, order, order)).view(-1, order * order)
        return self._signed_runs

    @property
    def key(self) -> tuple[int, int, int, tuple[int, int], bool]:
        """`(size, block_size, seed, sign_copies, signed)`: equal keys, equal transforms (modules may share the
        results)."""
        return self.size, self.block_size, self.seed, self.sign_copies, self.signed

    def signs(self) -> torch.Tensor:
        """The diagonal of `D`: one sign (+-1, float64) per element of the transformed dimension (all +1 when not
        `signed`)."""
        signs = self._factors[(torch.device("cpu"), torch.float64)][0]
        return torch.ones(self.size, dtype=torch.float64) if signs is None else signs.clone()

    def split_signs(self) -> tuple[torch.Tensor, RandomizedHadamard]:
        """`T = D B`: the signs `D` (`signs()`) and `B`, this transform without them (`signed=False`, the same seed):
        an input whose producer takes the signs (`nn.rotation.sign_carriers`) needs only `B`, which costs the signs'
        pass over it less. Only for power-of-two blocks, whose transforms draw nothing but the signs (an odd factor's
        random matrix `Q` would be drawn anew without them)."""
        if self.odd != 1:
            raise ValueError(
                f"split_signs needs a power-of-two block_size, got {self.block_size} (odd factor {self.odd}): the "
                "transform without signs would draw another odd-factor rotation"
            )
        return self.signs(), RandomizedHadamard(self.size, self.block_size, self.seed, self.sign_copies, signed=False)

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """`T` itself, `[size, size]`, computed in float64 on the CPU (for merged rotations, which combine with others
        on a weight's two sides: `nn.rotation.merge_rotations`; an online transform merges by `apply`)."""
        return self._transform_rows(torch.eye(self.size, dtype=torch.float64, device="cpu"), torch.float64).to(dtype)

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """`x @ T`, or with `inverse` `x @ T^T` (`T^-1`: `T` is orthogonal), in float64, from the factors: how a weight
        takes the transform in (`W T`, the rotation's merge) and gives it back (`W' T^T`, the KL scan's float copies).
        At most a few dozen multiply-adds per element, where a product with the dense `matrix()` costs `size` of them
        and a `[size, size]` matrix (14,336 x 14,336 float64 values, 1.5 GiB, for an 8B model's `down_proj`)."""
        self._check_size(x)
        rows = x.reshape(-1, self.size).double().contiguous()  # a weight may be a strided view (an offloaded one)
        if not inverse:
            return self._transform_rows(rows, torch.float64).view(x.shape)
        # T = D B P / norm (signs, each block's last factor, the Sylvester factor across its runs): B and P commute
        # and P is symmetric, so T^T = B^T P D / norm.
        signs, last, sylvester = self._factors_as(rows.device, torch.float64)
        with torch.autocast(rows.device.type, enabled=False):
            mixed = _sylvester_product(rows, sylvester, len(last))
            unsigned = (mixed.view(-1, len(last)) @ last.T).view(rows.shape)
        signed = unsigned if signs is None else unsigned * signs
        return (signed / self._norm).view(x.shape)

    def to_dict(self) -> dict[str, Any]:
        """What rebuilds this transform exactly (`from_dict`): stored per module in config.json."""
        spec = {"type": "randomized_hadamard", "size": self.size, "block_size": self.block_size, "seed": self.seed}
        if self.sign_copies[0] > 1:
            spec["sign_copies"] = list(self.sign_copies)
        if not self.signed:  # absent (checkpoints of earlier versions too): signed
            spec["signed"] = False
        return spec

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> RandomizedHadamard:
        if not isinstance(spec, dict) or spec.get("type") != "randomized_hadamard":
            raise ValueError(f"unknown input transform {spec!r}; allowed: type 'randomized_hadamard'")
        signed = spec.get("signed", True)
        if not isinstance(signed, bool):
            raise ValueError(f"input transform {spec!r}: 'signed' must be true or false, got {signed!r}")
        return cls(int(spec["size"]), int(spec["block_size"]), int(spec["seed"]), spec.get("sign_copies"), signed)

    def extra_repr(self) -> str:
        copies = f", sign_copies={self.sign_copies}" if self.sign_copies[0] > 1 else ""
        unsigned = "" if self.signed else ", signed=False"
        return f"size={self.size}, block_size={self.block_size}, seed={self.seed}{copies}{unsigned}"


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
