"""Which of a model's linears calibration must leave in float.

Quantizing a linear replaces it with an `MXLinear`, which computes `F.linear` of its quantized input and weight in its
forward pass and holds no `weight`. That stands in for the linear only where the model uses the linear by calling it
and the linear's forward pass is `F.linear` of its input. Two kinds of linears break this, found in transformers'
models:

* **weights used outside the forward pass**: Mamba's, Falcon-Mamba's and Jamba's mixers multiply by
  `dt_proj.weight` themselves (`self.dt_proj.weight @ x`); an `MXLinear` there would neither quantize that product
  nor run;
* **forward passes that are not a linear layer's**: `nn.Linear` subclasses such as PhiMoE's and Llama 4's routers
  return the top experts with the logits; an `MXLinear` there would return the logits alone.

A third kind could be replaced but not calibrated: linears **no calibration token reaches**, such as the vision
encoder and projector of an image-text model calibrated on text, or Mllama's cross-attention decoder layers, which
run only beside an image. Their offsets would get no gradient and the KL scan would find them harmless.

`linears_kept_in_float` finds all three by running the float model once and watching every torch operation and every
linear's output. Calibration keeps those linears in float (`integration.hf_quantizer`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .placement import input_device, is_resident
from .transforms import TransformedLinear

USED_OUTSIDE_FORWARD = "the model uses its weight outside its forward pass"
NOT_A_LINEAR_FORWARD = "its forward pass is not F.linear of its input"
NOT_REACHED = "no calibration token reaches it"
LINEAR_TOLERANCE = 1e-2  # relative norm of a forward pass's difference from F.linear still taken as a linear layer's


class _ParameterUses(TorchFunctionMode):
    """Records the linears whose parameters a torch operation receives while their forward pass is not running."""

    def __init__(self, owners: dict[int, tuple[str, torch.Tensor]]):
        super().__init__()
        # id of a weight or bias -> its linear's name, and the tensor: held, so that no other tensor takes its id
        # while the pass runs (accelerate replaces an offloaded linear's weight with the one it loads)
        self.owners = owners
        self.running: Counter[str] = Counter()  # linears whose forward pass is running (a count: calls may nest)
        self.used_outside: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                name, _ = self.owners.get(id(leaf), (None, None))
                if name is not None and not self.running[name]:
                    self.used_outside.add(name)
        return func(*args, **kwargs)


def computes_a_linear_map(linear: nn.Linear, inputs: tuple, output: Any) -> bool:
    """Whether `output`, what `linear`'s forward pass returned for `inputs`, is `F.linear` of its input (within
    `LINEAR_TOLERANCE`: a subclass may add the bias or order the sums otherwise, as Falcon's `FalconLinear` does)."""
    if type(linear).forward is nn.Linear.forward or isinstance(linear, TransformedLinear) or not is_resident(linear):
        # nn.Linear's own; an online rotation's layer, whose transform `MXLinear.from_linear` takes over; a weight
        # not held here to check against (offloaded, sharded)
        return True
    if not inputs or not isinstance(inputs[0], torch.Tensor) or not isinstance(output, torch.Tensor):
        return False
    expected = F.linear(inputs[0].to(linear.weight.dtype), linear.weight, linear.bias)
    if output.shape != expected.shape:
        return False
    difference = torch.linalg.vector_norm((output - expected).float())
    return bool(difference <= LINEAR_TOLERANCE * torch.linalg.vector_norm(expected.float()))


_EXPERT_INDEX = re.compile(r"\bexperts\.\d+(?=\.)")


def _kind(name: str) -> str:
    """`name` with its expert index replaced (`model.layers.3.mlp.experts.7.w1` -> `model.layers.3.mlp.experts.#.w1`):
    the same linear of every expert of a layer. Any other name is its own kind."""
    return _EXPERT_INDEX.sub("experts.#", name)


@torch.no_grad()
def linears_kept_in_float(model: nn.Module, input_ids: torch.Tensor, names: Sequence[str]) -> dict[str, str]:
    """The linears among `names` (full module names) that calibration must leave in float, in model order, each
    with the reason (`USED_OUTSIDE_FORWARD`, `NOT_A_LINEAR_FORWARD`, `NOT_REACHED`), from one forward pass of `model`
    on `input_ids`.

    A linear is `NOT_REACHED` when the pass neither calls nor reads it, nor, for an expert's linear, the same linear
    of another expert of its layer (`_kind`): an expert no token of this one sequence is routed to is not reported
    while one of its layer's is reached. A decoder layer that runs only beside an image (Mllama's cross-attention
    layers) is reported whole. A weight offloaded by accelerate or sharded by FSDP2 is computed with as a tensor
    loaded or gathered for the pass, not the one the module holds: the uses of that tensor are not seen, nor is that
    linear's forward pass checked."""
    linears = {name: model.get_submodule(name) for name in names}
    owners = {
        id(tensor): (name, tensor)
        for name, linear in linears.items()
        for tensor in (linear.weight, linear.bias)
        if tensor is not None
    }
    uses = _ParameterUses(owners)
    not_linear: set[str] = set()
    reached: set[str] = set()

    def started(name: str) -> None:
        uses.running.update([name])
        reached.add(name)

    def finished(name: str, linear: nn.Linear, inputs: tuple, output: Any) -> None:
        if output is not None and not computes_a_linear_map(linear, inputs, output):  # None: the pass raised
            not_linear.add(name)
        uses.running.subtract([name])

    handles = []
    for name, linear in linears.items():
        handles.append(linear.register_forward_pre_hook(lambda module, args, name=name: started(name)))
        handles.append(
            linear.register_forward_hook(
                lambda module, args, output, name=name: finished(name, module, args, output), always_call=True
            )
        )
    try:
        with uses:
            model(input_ids=input_ids.to(input_device(model)), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    kinds_reached = {_kind(name) for name in reached | uses.used_outside}
    reasons = {}
    for name in names:
        if name in uses.used_outside:
            reasons[name] = USED_OUTSIDE_FORWARD
        elif name in not_linear:
            reasons[name] = NOT_A_LINEAR_FORWARD
        elif _kind(name) not in kinds_reached:
            reasons[name] = NOT_REACHED
    return reasons
