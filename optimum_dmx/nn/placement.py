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

A rotation rewrites weights: `write_parameters` puts new values where the old ones live (the offload storage, each
process's shard), and `replace_module` moves an offloading hook to the module that replaces its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "execution_device",
    "input_device",
    "is_offloaded",
    "is_resident",
    "is_sharded",
    "loaded_weights",
    "replace_module",
    "write_parameters",
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


@torch.no_grad()
def write_parameters(model: nn.Module, name: str, values: Mapping[str, torch.Tensor]) -> None:
    """Make `values` (parameter name, e.g. `"weight"`, -> its whole new tensor) the parameters of module `name`,
    where they live, each in its own dtype:

    * in memory: copied in place;
    * offloaded by accelerate: stored where its hook loads them from, the weights held in memory replaced, a weight
      read from a file written to a file of the hook's offload folder (a checkpoint file is never written to; the
      hook's index points to the new file);
    * sharded by FSDP2: each process copies its own rows into its shard. Every process passes the same tensors
      (as computed from `loaded_weights`), and all of them call together.
    """
    module = model.get_submodule(name)
    if is_offloaded(module):
        _store_offloaded(module, name, values)
        return
    for parameter_name, value in values.items():
        parameter = getattr(module, parameter_name)
        if isinstance(parameter, DTensor):  # this process's rows, cut from the whole tensor as FSDP2 cuts them
            local = distribute_tensor(
                value.to(parameter.dtype), parameter.device_mesh, parameter.placements, src_data_rank=None
            )
            parameter.to_local().copy_(local.to_local())
        elif parameter.is_meta:  # not a weight anything loads: writing to it would do nothing
            raise ValueError(f"module {name!r} has its {parameter_name} on the meta device, without a hook loading it")
        else:
            parameter.copy_(value)


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at `name` in `model`, in place of a module holding the same parameters; an accelerate hook on
    the old module (an offloaded one's, which loads the parameters by name) moves to the new one."""
    old = model.get_submodule(name)
    if is_sharded(old):
        raise ValueError(f"module {name!r} is sharded by FSDP2, which gathers its weight into it: it cannot be swapped")
    hook = getattr(old, "_hf_hook", None)
    if hook is not None:
        from accelerate.hooks import add_hook_to_module, remove_hook_from_module

        remove_hook_from_module(old)
        add_hook_to_module(module, hook)
    model.set_submodule(name, module)


def _store_offloaded(module: nn.Module, name: str, values: Mapping[str, torch.Tensor]) -> None:
    from accelerate.utils import OffloadedWeightsLoader, offload_weight

    hooks = getattr(module._hf_hook, "hooks", [module._hf_hook])
    weights_map = next((h.weights_map for h in hooks if getattr(h, "weights_map", None) is not None), None)
    if weights_map is None or not hasattr(weights_map, "prefix"):
        raise ValueError(f"module {name!r} is offloaded, but its accelerate hook has no weights map to write to")
    dataset = weights_map.dataset
    in_memory = dataset.state_dict if isinstance(dataset, OffloadedWeightsLoader) else dataset
    for parameter_name, value in values.items():
        key = weights_map.prefix + parameter_name
        if key in in_memory:
            held = in_memory[key]
            in_memory[key] = value.detach().to(held.device, held.dtype).clone()
        elif isinstance(dataset, OffloadedWeightsLoader) and dataset.save_folder is not None:
            # In the dtype the hook loaded it in (the value's): the index entry records it for the next load.
            offload_weight(value.detach().cpu(), key, dataset.save_folder, index=dataset.index)
        else:
            raise ValueError(
                f"module {name!r} is offloaded to files without an offload folder to write its new {parameter_name} "
                "to: load the model with offload_folder=..."
            )
