"""A rotated dMX checkpoint's online input transforms, as the export targets' loaders apply them.

A dMX online transform is `T = D (I ⊗ H)` (`nn.transforms.RandomizedHadamard` without an odd factor): a random
sign per element, then the normalized Sylvester-Hadamard matrix `H` of order `b` on every `b` consecutive
elements. The loaders apply such a block-diagonal Hadamard transform to a layer's input and nothing per element:
compressed-tensors' `"hadamard"` transform (`transform_config`, one matrix per block of `head_dim = b` elements),
and AMD Quark's online rotation (`algo_config`'s rotation with `rotation_size = b`, a +-1 `input_rotation` per
layer). So the signs move into the layer that produces the input: a gated MLP's `down_proj` reads
`act(gate_proj(x)) * up_proj(x)`, and negating `up_proj`'s output channel `i` negates element `i` of that product.
`up_proj`'s weight rows (the sign bits of their MX codes, exactly) and bias take `D`; the loader applies `I ⊗ H`.
The product is the same function.

What this cannot carry is refused, naming the layer: a transform with an odd factor (the random orthogonal matrix
of `rotation="hadamard"` at an intermediate size that is not a power of two: no Hadamard matrix the loaders build
equals it), a transform on any other layer than a gated MLP's `down_proj` (q/k/v and gate/up read a norm's
output, with no linear's rows for the signs; `o_proj`'s input comes out of attention), and, for Quark, transforms
of different block sizes in one model (its rotation has one `rotation_size`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..nn.transforms import RandomizedHadamard, sylvester_matrix

__all__ = ["TransformExport", "compressed_tensors_transforms", "quark_transforms"]

_CONSUMER, _PRODUCER = "mlp.down_proj", "mlp.up_proj"


@dataclass
class TransformExport:
    """What the export writes for a checkpoint's online transforms.

    Attributes:
        quantization_config: entries of the exported `quantization_config` that describe the transforms
            (compressed-tensors' `transform_config`, Quark's `algo_config`).
        row_signs: per producing layer, the sign (+-1) its output rows (weight rows, bias) are multiplied by.
        tensors: per transformed layer, its transform's matrix by state-dict name, as the loader saves it (vLLM
            loads it from the checkpoint).
    """

    quantization_config: dict[str, Any]
    row_signs: dict[str, torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def compressed_tensors_transforms(input_transforms: Mapping[str, dict], skeleton: nn.Module) -> TransformExport:
    """The compressed-tensors form of `input_transforms` (module name -> `RandomizedHadamard.to_dict()`) of the
    model `skeleton` (its modules, on any device); raise `ValueError` naming a transform it cannot carry."""
    schemes: dict[str, list[str]] = {}
    export = TransformExport(quantization_config={})
    for module, transform in _transforms(input_transforms, skeleton, export, "compressed-tensors"):
        scheme = f"dmx_hadamard_{transform.block_size}"
        schemes.setdefault(scheme, []).append(module)
        export.tensors[module] = {f"{module}.{scheme}_input.weight": sylvester_matrix(transform.block_size).float()}
    export.quantization_config["transform_config"] = {
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


def quark_transforms(input_transforms: Mapping[str, dict], skeleton: nn.Module) -> TransformExport:
    """The AMD Quark form of `input_transforms` (module name -> `RandomizedHadamard.to_dict()`) of the model
    `skeleton`: an online rotation (Quark 0.13's `RotationConfig`, no merged rotations, `rotation_size` the blocks'
    size) on exactly the transformed layers, each storing its +-1 `input_rotation` (int8, as Quark serializes an
    untrained Hadamard rotation); raise `ValueError` naming a transform it cannot carry."""
    export = TransformExport(quantization_config={})
    sizes: dict[int, list[str]] = {}
    for module, transform in _transforms(input_transforms, skeleton, export, "quark"):
        sizes.setdefault(transform.block_size, []).append(module)
        export.tensors[module] = {f"{module}.input_rotation": sylvester_matrix(transform.block_size).to(torch.int8)}
    if len(sizes) > 1:
        examples = ", ".join(f"{modules[0]} blocks of {size}" for size, modules in sorted(sizes.items()))
        raise ValueError(f"Quark's rotation has one rotation_size, and these transforms differ: {examples}")
    ((size, modules),) = sizes.items()
    online = {"shared_parallel": False, "online_rotation_layers": modules, "use_input_prescale": False}
    export.quantization_config["algo_config"] = [
        {
            "name": "rotation",
            "scaling_layers": {},
            "r1": False,  # the merged rotations are inside the weights already
            "r2": False,
            "r3": False,
            "r4": True,  # the online down_proj rotation
            "rotation_size": size,
            "random_r1": False,
            "random_r2": False,
            "online_r1_rotation": None,
            "online_config": online,
            "trainable": False,
            "train_smooth": None,
            "smooth_positions": None,
        }
    ]
    return export


def _transforms(
    input_transforms: Mapping[str, dict], skeleton: nn.Module, export: TransformExport, target: str
) -> list[tuple[str, RandomizedHadamard]]:
    """The transforms by module, sorted, their signs put into `export.row_signs` of their producing layers."""
    transforms = []
    for module, spec in sorted(input_transforms.items()):
        transform = RandomizedHadamard.from_dict(spec)
        export.row_signs[_producer(module, transform, skeleton, target)] = transform.signs().float()
        transforms.append((module, transform))
    return transforms


def _producer(module: str, transform: RandomizedHadamard, skeleton: nn.Module, target: str) -> str:
    """The layer whose output rows take `transform`'s signs (the `up_proj` beside a `down_proj`)."""
    if transform.odd != 1:
        raise ValueError(
            f"{module}'s online transform is a Hadamard matrix of order {transform.power} times a random orthogonal "
            f"matrix of order {transform.odd} (block size {transform.block_size}), which {target}'s Hadamard "
            "transforms cannot express; calibrate with rotation='block_hadamard' (blocks of 32) to export"
        )
    parent, _, _ = module.rpartition(".mlp.")
    producer = f"{parent}.{_PRODUCER}"
    if not module.endswith(f".{_CONSUMER}") or not isinstance(_get(skeleton, producer), nn.Linear):
        raise ValueError(
            f"{module} has an online transform that {target} can carry only on a gated MLP's down_proj "
            "(its random signs move into up_proj's rows; other layers read a norm's or attention's output); "
            "calibrate with rotation='block_hadamard' or 'hadamard' instead of 'online_block_hadamard'"
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
