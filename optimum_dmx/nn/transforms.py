"""Randomized Hadamard transforms: the orthogonal rotations that spread outliers before MX quantization.

`RandomizedHadamard(size, block_size, seed)` is the orthogonal matrix `T = D (I ⊗ H ⊗ Q)` acting on the last
dimension of row vectors (`x -> x @ T`):

* `D`: a random diagonal of signs (one per element, from `seed`);
* `I ⊗ ...`: the same transform on every `block_size` consecutive elements (block-diagonal; `block_size = size`
  is the full-size transform);
* `H`: the normalized Walsh-Hadamard matrix of the largest power of two dividing `block_size`, applied with the
  fast transform (`log2` butterfly stages, no matrix);
* `Q`: a random orthogonal matrix (from `seed`) for the odd factor of `block_size` that no Hadamard matrix of
  power-of-two order covers (hidden sizes such as 576 = 64 x 9); the identity when there is none.

A block size of 32 aligns the transform with the MX blocks: each block's values are mixed only among
themselves, so one outlier raises one block scale instead of all of them. The transform is rebuilt exactly from
`(size, block_size, seed)`, which is all a checkpoint records (`to_dict`); it holds no trainable state and adds
nothing to a state dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def _split_power_of_two(n: int) -> tuple[int, int]:
    """`n = 2**k * m` with `m` odd: returns `(2**k, m)`."""
    power = n & -n
    return power, n // power


def fast_hadamard(x: torch.Tensor) -> torch.Tensor:
    """`x @ H / sqrt(n)` along the last dimension (`n`, a power of two), by the butterfly (`n log n` additions)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fast_hadamard needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        x = torch.stack((pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]), dim=-2)
        h *= 2
    return x.reshape(*lead, n) / n**0.5


class RandomizedHadamard(nn.Module):
    """The orthogonal transform `x -> x @ T` of the last dimension described in the module docstring.

    Args:
        size: length of the transformed dimension.
        block_size: the transform is block-diagonal with blocks of this length (`size` for a full transform);
            must divide `size`.
        seed: seeds the signs and the odd-factor rotation; the same arguments always give the same matrix.
    """

    def __init__(self, size: int, block_size: int | None = None, seed: int = 0):
        super().__init__()
        block_size = size if block_size is None else block_size
        if not (
            isinstance(size, int) and isinstance(block_size, int) and 0 < block_size <= size and size % block_size == 0
        ):
            raise ValueError(
                f"RandomizedHadamard needs a block_size dividing size; got size={size!r}, block_size={block_size!r}"
            )
        self.size, self.block_size, self.seed = size, block_size, int(seed)
        self.power, self.odd = _split_power_of_two(block_size)
        generator = torch.Generator().manual_seed(self.seed)
        # Explicitly on the CPU: transformers builds checkpoints' modules under a meta-device context.
        signs = torch.randint(0, 2, (size,), generator=generator, device="cpu").to(torch.float64) * 2 - 1
        odd = torch.linalg.qr(torch.randn(self.odd, self.odd, generator=generator, dtype=torch.float64, device="cpu"))[
            0
        ]
        # Plain float64 tensors, not buffers: `model.to(torch.bfloat16)` must not round them (the merged weights
        # were computed with these exact values), and a state dict has nothing to hold.
        self._factors = {torch.device("cpu"): (signs, odd)}

    def _factors_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._factors:
            self._factors[device] = tuple(t.to(device) for t in self._factors[torch.device("cpu")])
        return self._factors[device]

    def _apply_float(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ T` in `x`'s (floating) dtype."""
        signs, odd = (t.to(x.dtype) for t in self._factors_on(x.device))
        lead = x.shape[:-1]
        y = (x * signs).reshape(*lead, self.size // self.block_size, self.power, self.odd)
        if self.odd > 1:
            y = y @ odd
        y = fast_hadamard(y.transpose(-1, -2)).transpose(-1, -2)
        return y.reshape(*lead, self.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ T`, computed in float32 (the MX quantizers' precision) and returned in `x`'s dtype."""
        if x.shape[-1] != self.size:
            raise ValueError(f"RandomizedHadamard of size {self.size} applied to a last dimension of {x.shape[-1]}")
        return self._apply_float(x.float()).to(x.dtype)

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """`T` itself, `[size, size]`, computed in float64 on the CPU (for merging the transform into weights)."""
        return self._apply_float(torch.eye(self.size, dtype=torch.float64, device="cpu")).to(dtype)

    def to_dict(self) -> dict[str, Any]:
        """What rebuilds this transform exactly (`from_dict`): stored per module in config.json."""
        return {"type": "randomized_hadamard", "size": self.size, "block_size": self.block_size, "seed": self.seed}

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> RandomizedHadamard:
        if not isinstance(spec, dict) or spec.get("type") != "randomized_hadamard":
            raise ValueError(f"unknown input transform {spec!r}; allowed: type 'randomized_hadamard'")
        return cls(int(spec["size"]), int(spec["block_size"]), int(spec["seed"]))

    def extra_repr(self) -> str:
        return f"size={self.size}, block_size={self.block_size}, seed={self.seed}"


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
