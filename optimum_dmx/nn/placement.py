"""Weights that are not all in one device's memory: sharded by FSDP2 or offloaded by accelerate.

A model too large for one device is calibrated with its frozen weights in one of two places:

* **sharded** across processes by `torch.distributed.fsdp.fully_shard` on its decoder layers: each process keeps
  a shard of every weight (a `DTensor`); a decoder layer's forward pass gathers its full weights and frees them
  afterwards, and its backward pass gathers them again;
* **offloaded** by accelerate's `device_map` (to CPU memory or to disk): the weight sits on the meta device
  between forward passes, and a hook on its linear (`module._hf_hook`, with `offload=True`) loads it before the
  linear's forward pass and drops it after.

Inside a decoder layer's forward pass a sharded weight is an ordinary tensor; an offloaded one is only loaded by
its own linear's hook, which a module standing in for that linear must call itself. `loaded_weights` gives both
as ordinary tensors for the length of a block, anywhere. Nothing derived from such a weight may be kept across
forward passes: it would put the whole model back into one device's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = [
    "execution_device",
    "input_device",
    "is_offloaded",
    "is_resident",
    "is_sharded",
    "loaded_weights",
    "not_resident",
]


def is_sharded(module: nn.Module) -> bool:
    """Whether `module`'s weight is an FSDP2 shard (a `DTensor`) right now."""
    return isinstance(getattr(module, "weight", None), DTensor)


def is_offloaded(module: nn.Module) -> bool:
    """Whether `module`'s weight is offloaded by accelerate: on the meta device, with a hook that loads it."""
    weight = getattr(module, "weight", None)
    return weight is not None and weight.is_meta and getattr(module, "_hf_hook", None) is not None


def is_resident(module: nn.Module) -> bool:
    """Whether `module`'s weight is an ordinary tensor on a device, to be read at any time."""
    return not (is_sharded(module) or is_offloaded(module))


def not_resident(model: nn.Module) -> list[str]:
    """Names of `model`'s modules whose weights are sharded or offloaded (what cannot be rewritten in place)."""
    return [name for name, module in model.named_modules() if hasattr(module, "weight") and not is_resident(module)]


def execution_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: its hook's for an offloaded weight, else its weight's (a shard's local
    device for a sharded one)."""
    if is_offloaded(module):
        hooks = getattr(module._hf_hook, "hooks", [module._hf_hook])  # accelerate's `SequentialHook` holds several
        devices = [hook.execution_device for hook in hooks if getattr(hook, "execution_device", None) is not None]
        if not devices:
            raise ValueError(f"{type(module).__name__}'s weight is offloaded, but its hook names no execution device")
        return torch.device(devices[0])
    weight = module.weight
    return weight.to_local().device if isinstance(weight, DTensor) else weight.device


def input_device(model: nn.Module) -> torch.device:
    """The device a model's input ids go to: where its input embeddings compute (their first parameter's device for
    a model without `get_input_embeddings`)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return execution_device(embeddings) if embeddings is not None else next(model.parameters()).device


@contextmanager
def loaded_weights(model: nn.Module, name: str = "") -> Iterator[nn.Module]:
    """Module `name` of `model` (`model` itself by default) with its weight and bias as ordinary tensors within
    the block: an offloaded one loaded by its accelerate hook, a sharded one gathered by the FSDP2 module that
    shards it (all processes must enter together, as for a forward pass). Both go back on exit."""
    module = model.get_submodule(name)
    if is_offloaded(module):
        module._hf_hook.pre_forward(module)
        try:
            yield module
        finally:
            module._hf_hook.post_forward(module, None)
    elif is_sharded(module):
        owner = _sharding_owner(model, name)
        owner.unshard()
        try:
            yield module
        finally:
            owner.reshard()
    else:
        yield module


def _sharding_owner(model: nn.Module, name: str) -> FSDPModule:
    """The innermost FSDP2 module holding module `name` (the one whose parameter group shards its weight)."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        candidate = model.get_submodule(".".join(parts[:depth]))
        if isinstance(candidate, FSDPModule):
            return candidate
    raise ValueError(
        f"module {name!r} holds an FSDP2 shard, but no FSDP2 module above it within {type(model).__name__} can "
        "gather it: pass the sharded model itself"
    )
