"""A rotated dMX checkpoint's online input transforms, as the export targets' loaders apply them.

A dMX online transform is `T = D (I ⊗ H)` (`nn.transforms.RandomizedHadamard` without an odd factor): a random
sign per element (or none, `signed=False`), then the normalized Sylvester-Hadamard matrix `H` of order `b` on every
`b` consecutive elements. The loaders apply such a block-diagonal Hadamard transform to a layer's input and nothing
per element: compressed-tensors' `"hadamard"` transform (`transform_config`, one matrix per block of
`head_dim = b` elements), and AMD Quark's online rotation (`algo_config`'s rotation with `rotation_size = b`, a +-1
`input_rotation` per layer). So the signs move into whatever produces the layer's input, element by element, where
negating an output is exact (MX codes are sign-magnitude: a row's sign bits):

* a gated MLP's `down_proj` reads `act(gate_proj(x)) * up_proj(x)`: `up_proj`'s output rows and bias;
* an attention's `o_proj` reads, per query head, a mix over tokens of its value head's `v_proj` outputs:
  `v_proj`'s rows, when the signs are equal across the query heads sharing a value head (as `nn.rotation` draws
  them for `rotation="online_block_hadamard"`);
* q/k/v and gate/up read an RMSNorm's output, the norm's scale times the normalized input, and share one transform:
  the norm's scale (`weight`).

The loader applies `I ⊗ H`; the product is the same function. Every rotation of this version already puts its
transforms' signs there when it rotates (`nn.rotation.sign_carriers`, drawing signs only where they can move), so
its transforms have none (`"signed": false`) and need nothing from another layer; checkpoints of earlier versions
carry them in the transform, and the export moves them.

What this cannot carry is refused, naming the layer: a transform with an odd factor (the random orthogonal matrix
of `rotation="hadamard"` at an intermediate size that is not a power of two, in checkpoints of earlier versions: no
Hadamard matrix the loaders build equals it), signs that differ within a query-head group (`online_block_hadamard`
checkpoints of earlier versions), signs on a layer whose input no layer can take them for (a norm that scales by
something else than its weight, such as Gemma's `1 + weight`, or a `down_proj` whose MLP is not gated, in
checkpoints of earlier versions), linears reading one norm with different transforms, and, for Quark, transforms of
different block sizes in one model (its rotation has one `rotation_size`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..nn.rotation import negates_with_its_scale, residual_norm_readers
from ..nn.transforms import RandomizedHadamard, sylvester_matrix

__all__ = ["TransformExport", "compressed_tensors_transforms", "quark_transforms"]


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
    size) on exactly the transformed layers (listed by name: any linear), each storing its +-1 `input_rotation`
    (int8, as Quark serializes an untrained Hadamard rotation); raise `ValueError` naming a transform it cannot
    carry."""
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
            "r4": True,  # online rotations, on the layers listed
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
    """The transforms by module, sorted, their signs put into `export.row_signs` of the layers producing their
    inputs."""
    transforms = {module: RandomizedHadamard.from_dict(spec) for module, spec in sorted(input_transforms.items())}
    norms: dict[str, tuple[str, list[str]]] | None = None
    for module, transform in transforms.items():
        if transform.odd != 1:
            raise ValueError(
                f"{module}'s online transform is a Hadamard matrix of order {transform.power} times a random "
                f"orthogonal matrix of order {transform.odd} (block size {transform.block_size}), which {target}'s "
                "Hadamard transforms cannot express; calibrate with rotation='block_hadamard' (blocks of 32) to export"
            )
        if not transform.signed:
            continue  # a plain Hadamard transform: what the loaders apply
        parent, _, leaf = module.rpartition(".")
        if leaf == "down_proj":
            producer, signs = _up_proj_signs(module, transform, skeleton)
        elif leaf == "o_proj":
            producer, signs = _v_proj_signs(module, transform, skeleton)
        else:
            if norms is None:  # the norms feeding each reader, found once
                norms = {r: (norm, readers) for norm, readers in residual_norm_readers(skeleton) for r in readers}
            producer, signs = _norm_signs(module, transforms, norms, skeleton, target)
        export.row_signs[producer] = signs
    return list(transforms.items())


def _up_proj_signs(module: str, transform: RandomizedHadamard, skeleton: nn.Module) -> tuple[str, torch.Tensor]:
    """A gated MLP's `down_proj` reads `act(gate_proj(x)) * up_proj(x)`: `up_proj`'s output rows take the signs. An
    MLP without `gate_proj` reads `act(up_proj(x))`, which does not pass `up_proj`'s signs on: refused (earlier
    versions drew signs there; this one's probe, `nn.rotation.sign_carriers`, does not)."""
    mlp = module.rpartition(".")[0]
    if not isinstance(getattr(skeleton.get_submodule(mlp), "gate_proj", None), nn.Linear):
        raise ValueError(
            f"{module}'s online transform has random signs, and {mlp} is not a gated MLP (no gate_proj): its "
            "activation does not pass a sign of up_proj's output on to down_proj's input, so the loaders' plain "
            "Hadamard transform cannot stand in for it; this version draws no signs there: calibrate again to export"
        )
    producer = f"{mlp}.up_proj"
    _check_outputs(producer, skeleton, transform.size, module)
    return producer, transform.signs().float()


def _v_proj_signs(module: str, transform: RandomizedHadamard, skeleton: nn.Module) -> tuple[str, torch.Tensor]:
    """Attention mixes `v_proj`'s outputs over tokens, never over features: element `(head, i)` of `o_proj`'s input
    comes from element `(value head of head, i)` of `v_proj`'s output, so `v_proj`'s rows take the signs if they are
    equal across the query heads that read one value head (`nn.rotation` draws them so)."""
    attention = skeleton.get_submodule(module.rpartition(".")[0])
    producer = f"{module.rpartition('.')[0]}.v_proj"
    groups = int(getattr(attention, "num_key_value_groups", 1))
    head_dim = int(getattr(attention, "head_dim", transform.size // groups))
    by_head = transform.signs().float().view(-1, groups, head_dim)
    if not torch.equal(by_head, by_head[:, :1].expand_as(by_head)):
        raise ValueError(
            f"{module}'s online transform has different signs for query heads that read one value head ({groups} "
            "per value head), which no sign of v_proj's rows can carry; this version draws them equal: calibrate "
            "again with rotation='online_block_hadamard' to export"
        )
    _check_outputs(producer, skeleton, transform.size // groups, module)
    return producer, by_head[:, 0].flatten()


def _norm_signs(
    module: str,
    transforms: Mapping[str, RandomizedHadamard],
    norms: Mapping[str, tuple[str, list[str]]],
    skeleton: nn.Module,
    target: str,
) -> tuple[str, torch.Tensor]:
    """Linears reading an RMSNorm (q/k/v, gate/up) share one transform, whose signs the norm's scale takes: its output
    is the scale times the normalized input, so a negated scale element negates that output element exactly."""
    if module not in norms:
        raise ValueError(
            f"{module} has an online transform, and {target} applies only Hadamard transforms: its random signs "
            "must move into the layer producing its input, which is known for a gated MLP's down_proj (up_proj), "
            "an attention's o_proj (v_proj) and the linears reading a decoder layer's RMSNorm (the norm)"
        )
    norm, readers = norms[module]
    transform = transforms[module]
    others = [r for r in readers if r not in transforms or transforms[r].key != transform.key]
    if others:
        raise ValueError(
            f"{module} reads {norm} with an online transform whose signs would move into the norm, but {others[0]} "
            "reads it too with another transform or none"
        )
    if not negates_with_its_scale(skeleton.get_submodule(norm)):
        raise ValueError(
            f"{norm} ({type(skeleton.get_submodule(norm)).__name__}) does not output its weight times the normalized "
            f"input (Gemma's norms scale by 1 + weight), so the signs of {module}'s online transform cannot move "
            "into it; calibrate with rotation='block_hadamard' or 'hadamard' to export this model"
        )
    return norm, transform.signs().float()


def _check_outputs(producer: str, skeleton: nn.Module, outputs: int, module: str) -> None:
    layer = _get(skeleton, producer)
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"{module}'s online transform needs {producer} as a linear layer to take its signs")
    if layer.out_features != outputs:
        raise ValueError(f"{producer} has {layer.out_features} outputs, but {module}'s transform needs {outputs}")


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
