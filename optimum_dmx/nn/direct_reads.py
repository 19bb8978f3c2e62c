"""Which linears a model computes with outside their own forward pass.

An `MXLinear` quantizes in its forward pass and holds no `weight`: a model that multiplies by a linear's weight
itself (Mamba's and Jamba's `dt_proj`: `self.dt_proj.weight @ x`) or reads its bias or its weight's dtype would
neither quantize that product nor run once the linear is replaced. `linears_read_directly` finds such linears by
running the float model once and watching every torch operation: a weight or bias that an operation receives
while its own linear's forward pass is not running is read directly. Calibration keeps those linears in float
(`integration.hf_quantizer`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .placement import input_device


class _ParameterUses(TorchFunctionMode):
    """Records the linears whose parameters a torch operation receives while their forward pass is not running."""

    def __init__(self, owners: dict[int, tuple[str, torch.Tensor]]):
        super().__init__()
        # id of a weight or bias -> its linear's name, and the tensor: held, so that no other tensor takes its id
        # while the pass runs (accelerate replaces an offloaded linear's weight with the one it loads)
        self.owners = owners
        self.running: Counter[str] = Counter()  # linears whose forward pass is running (a count: calls may nest)
        self.read_directly: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                name, _ = self.owners.get(id(leaf), (None, None))
                if name is not None and not self.running[name]:
                    self.read_directly.add(name)
        return func(*args, **kwargs)


@torch.no_grad()
def linears_read_directly(model: nn.Module, input_ids: torch.Tensor, names: Sequence[str]) -> list[str]:
    """The linears among `names` (full module names) whose weight or bias `model` uses outside their own forward pass
    in one forward pass on `input_ids`, in model order.

    A linear the pass does not reach at all (an expert no token is routed to) is not reported: only a use outside
    the forward pass is. A weight offloaded by accelerate or sharded by FSDP2 is computed with as a tensor loaded or
    gathered for the pass, not the one the module holds: the uses of that tensor are not seen."""
    linears = {name: model.get_submodule(name) for name in names}
    owners = {
        id(tensor): (name, tensor)
        for name, linear in linears.items()
        for tensor in (linear.weight, linear.bias)
        if tensor is not None
    }
    uses = _ParameterUses(owners)
    handles = []
    for name, linear in linears.items():
        handles.append(linear.register_forward_pre_hook(lambda module, args, name=name: uses.running.update([name])))
        handles.append(
            linear.register_forward_hook(
                lambda module, args, output, name=name: uses.running.subtract([name]), always_call=True
            )
        )
    try:
        with uses:
            model(input_ids=input_ids.to(input_device(model)), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [name for name in names if name in uses.read_directly]
