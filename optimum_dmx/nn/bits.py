"""Bit accounting of a per-layer MX format assignment.

Per-layer element bits `b_i` apply to the layer's weight and, when activations are quantized, to its
input activation (one format per layer covers both). Two model-level averages exist:

* simple: `mean_i b_i`;
* weighted: `sum_i n_i b_i / sum_i n_i`, where `n_i` counts the layer's quantized tensor elements
  (weight numel, plus `in_features` for the activation: its per-token size).

Averages exclude the E8M0 block scales (MXFP4 = 4.0 bits); `storage_bits` includes them, and the padding
of rows that are not a whole number of blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..formats.spec import get_format, packed_bits

__all__ = ["BIT_AVERAGES", "tensor_sizes", "average_bits", "storage_bits", "bit_summary", "format_map_bits"]

BIT_AVERAGES = ("simple", "weighted")


def tensor_sizes(weight_shapes: Sequence[tuple[int, int]], quantize_activations: bool = True) -> torch.Tensor:
    """`n_i` of the weighted average for linears with weights of shape `(out_features, in_features)`."""
    sizes = [out_f * in_f + (in_f if quantize_activations else 0) for out_f, in_f in weight_shapes]
    return torch.tensor(sizes, dtype=torch.float64)


def average_bits(bits: torch.Tensor, kind: str = "simple", sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Model-level average of the per-layer bits `bits` (a 1-D tensor, differentiable).

    `kind` is `"simple"` or `"weighted"`; the weighted average needs the `sizes` from `tensor_sizes`.
    """
    if kind == "simple":
        return bits.mean()
    if kind == "weighted":
        if sizes is None:
            raise ValueError("average_bits(kind='weighted') needs the per-layer tensor sizes.")
        sizes = sizes.to(bits.device, bits.dtype)  # the bits of layers on a GPU, the sizes from tensor_sizes
        return (bits * sizes).sum() / sizes.sum()
    raise ValueError(f"bit average {kind!r} is not supported; allowed: {', '.join(BIT_AVERAGES)}.")


def storage_bits(element_bits: Sequence[int], weight_shapes: Sequence[tuple[int, int]], block_size: int = 32) -> float:
    """Stored bits per weight element: padded codes plus one 8-bit E8M0 scale per block of each row."""
    if len(element_bits) != len(weight_shapes):
        raise ValueError(f"got {len(element_bits)} bit widths for {len(weight_shapes)} weights.")
    total_bits = sum(packed_bits(shape, bits, block_size) for bits, shape in zip(element_bits, weight_shapes))
    return total_bits / sum(out_f * in_f for out_f, in_f in weight_shapes)


def bit_summary(
    element_bits: Sequence[int],
    weight_shapes: Sequence[tuple[int, int]],
    quantize_activations: bool = True,
    block_size: int = 32,
) -> dict[str, float]:
    """Both averages and the storage bits of a format assignment (one element-bit value per layer)."""
    bits = torch.tensor(element_bits, dtype=torch.float64)
    return {
        "bits_simple": average_bits(bits, "simple").item(),
        "bits_weighted": average_bits(bits, "weighted", tensor_sizes(weight_shapes, quantize_activations)).item(),
        "storage_bits": storage_bits(element_bits, weight_shapes, block_size),
    }


def format_map_bits(
    format_map: Mapping[str, str],
    weight_shapes: Mapping[str, Sequence[int]],
    quantize_activations: bool = True,
    block_size: int = 32,
) -> dict[str, float]:
    """`bit_summary` of a format map, given the `(out_features, in_features)` weight shape of each module."""
    names = list(format_map)
    return bit_summary(
        [get_format(format_map[n]).bits for n in names],
        [tuple(weight_shapes[n]) for n in names],
        quantize_activations,
        block_size,
    )
