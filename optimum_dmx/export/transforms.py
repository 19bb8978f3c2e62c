"""A rotated dMX checkpoint's online input transforms, as compressed-tensors' `transform_config`.

A dMX online transform is `T = D (I ⊗ H)` (`nn.transforms.RandomizedHadamard` without an odd factor): a random
sign per element, then the normalized Sylvester-Hadamard matrix `H` of order `b` on every `b` consecutive
elements. compressed-tensors' `"hadamard"` transform applies one such matrix to every block of `head_dim = b`
elements of a layer's input (its +-1 matrix, divided by `sqrt(b)`), and nothing per element. So the signs move into
the layer that produces the input: a gated MLP's `down_proj` reads `act(gate_proj(x)) * up_proj(x)`, and negating
`up_proj`'s output channel `i` negates element `i` of that product. `up_proj`'s weight rows (the sign bits of
their MX codes, exactly) and bias take `D`; the loader applies `I ⊗ H`. The product is the same function.

What this cannot carry is refused, naming the layer: a transform with an odd factor (the random orthogonal matrix
of `rotation="hadamard"` at an intermediate size that is not a power of two: no Hadamard matrix compressed-tensors
builds equals it), and a transform on any other layer than a gated MLP's `down_proj` (q/k/v and gate/up read one
input with different signs each; `o_proj`'s input comes out of attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..nn.transforms import RandomizedHadamard, sylvester_matrix

__all__ = ["TransformExport", "compressed_tensors_transforms"]

TRANSFORM_CONFIG_KEY = "transform_config"  # where compressed-tensors reads it, inside `quantization_config`
_CONSUMER, _PRODUCER = "mlp.down_proj", "mlp.up_proj"


@dataclass
class TransformExport:
    """What the export writes for a checkpoint's online transforms.

    Attributes:
        transform_config: compressed-tensors' `TransformConfig`, as `quantization_config["transform_config"]`.
        row_signs: per producing layer, the sign (+-1) its output rows (weight rows, bias) are multiplied by.
        tensors: per transformed layer, its transform's matrix by state-dict name, as compressed-tensors saves it
            (vLLM loads it from the checkpoint).
    """

    transform_config: dict[str, Any]
    row_signs: dict[str, torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def compressed_tensors_transforms(input_transforms: Mapping[str, dict], skeleton: nn.Module) -> TransformExport:
    """The compressed-tensors form of `input_transforms` (module name -> `RandomizedHadamard.to_dict()`) of the
    model `skeleton` (its modules, on any device); raise `ValueError` naming a transform it cannot carry."""
    schemes: dict[str, list[str]] = {}
    export = TransformExport(transform_config={})
    for module, spec in sorted(input_transforms.items()):
        transform = RandomizedHadamard.from_dict(spec)
        producer = _producer(module, transform, skeleton)
        scheme = f"dmx_hadamard_{transform.block_size}"
        schemes.setdefault(scheme, []).append(module)
        export.row_signs[producer] = transform.signs().float()
        export.tensors[module] = {f"{module}.{scheme}_input.weight": sylvester_matrix(transform.block_size).float()}
    export.transform_config = {
        "config_groups": {
            scheme: {
                "type": "hadamard",
                "apply": [{"targets": modules, "location": "input", "inverse": False, "ignore": []}],
                "randomize": False,
                "requires_grad": False,
                "head_dim": int(scheme.rpartition("_")[2]),
                "precision": "torch.float32",
            }
            for scheme, modules in sorted(schemes.items())
        }
    }
    return export


def _producer(module: str, transform: RandomizedHadamard, skeleton: nn.Module) -> str:
    """The layer whose output rows take `transform`'s signs (the `up_proj` beside a `down_proj`)."""
    if transform.odd != 1:
        raise ValueError(
            f"{module}'s online transform is a Hadamard matrix of order {transform.power} times a random orthogonal "
            f"matrix of order {transform.odd} (block size {transform.block_size}), which compressed-tensors' Hadamard "
            "transforms cannot express; calibrate with rotation='block_hadamard' (blocks of 32) to export"
        )
    parent, _, _ = module.rpartition(".mlp.")
    producer = f"{parent}.{_PRODUCER}"
    if not module.endswith(f".{_CONSUMER}") or not isinstance(_get(skeleton, producer), nn.Linear):
        raise ValueError(
            f"{module} has an online transform that compressed-tensors can carry only on a gated MLP's down_proj "
            "(its random signs move into up_proj's rows; other layers share their input or read attention's "
            "output); calibrate with rotation='block_hadamard' or 'hadamard' instead of 'online_block_hadamard'"
        )
    outputs = _get(skeleton, producer).out_features
    if outputs != transform.size:
        raise ValueError(f"{producer} has {outputs} outputs, but {module}'s transform is of size {transform.size}")
    return producer


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
