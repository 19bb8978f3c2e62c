"""Mixture-of-experts layers as `nn.Linear`s: transformers' packed experts, one module per expert.

transformers (5.x) keeps a mixture-of-experts layer's experts as one 3-D tensor per projection: `gate_up_proj`
(experts x 2 * intermediate x hidden: each expert's gate rows, then its up rows) and `down_proj` (experts x hidden x
intermediate), multiplied in the module's own loop over the experts the router picked. dMX quantizes `nn.Linear`
layers, so `linearize_experts` replaces such a module by `LinearExperts`: the same function, with expert `e`'s
projections as `nn.Linear`s named `{e}.gate_proj`, `{e}.up_proj` and `{e}.down_proj` under the module, the names of
the per-expert checkpoints transformers converts from. Formats, offsets, GPTQ and saving then treat them as any
other linear. Only the layout of Qwen3-MoE and Mixtral is taken (a gate, no bias, gate and up concatenated, not
transposed, no norm after the experts); `packed_weight_modules` finds the rest, which stay refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from .surgery import is_skipped, per_layer_pattern

__all__ = ["ExpertMLP", "LinearExperts", "linearizable_experts", "linearize_experts", "packed_weight_modules"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's linears, as `ExpertMLP` names them

# transformers' `use_experts_implementation` flags of the one layout `LinearExperts` computes, with their defaults.
SUPPORTED_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "has_post_expert_norm": False,
    "is_transposed": False,
    "is_concatenated": True,
}


class ExpertMLP(nn.Module):
    """One expert: `down_proj(act(gate_proj(x)) * up_proj(x))`."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act_fn: Callable):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LinearExperts(nn.ModuleList):
    """The experts of one mixture-of-experts layer, expert `e` at index `e`, called as transformers calls its packed
    experts module: `(hidden_states, top_k_index, top_k_weights)`, tokens as rows. Each expert reads the tokens routed
    to it, in the order transformers' eager loop gathers them, and adds its output times the routing weight."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # One more class than experts, as transformers' loop counts: expert parallelism routes tokens that no
            # local expert takes to index `len(self)`, which no expert reads.
            routed = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = routed[: len(self)].sum(dim=(1, 2)).nonzero().flatten().tolist()  # one sync, not one per expert
        for index in hit:
            top_k_position, token_index = torch.where(routed[index])
            output = self[index](hidden_states[token_index]) * top_k_weights[token_index, top_k_position, None]
            final.index_add_(0, token_index, output.to(final.dtype))
        return final

    @classmethod
    def from_packed(cls, packed: nn.Module) -> LinearExperts:
        """The experts of `packed` (a module `is_linearizable` accepts) as `nn.Linear`s holding copies of its
        weights (on the meta device for a skeleton)."""
        gate_up, down = packed.gate_up_proj, packed.down_proj
        intermediate = down.shape[2]

        def linear(weight: torch.Tensor) -> nn.Linear:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
            layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=gate_up.requires_grad)
            return layer

        return cls(
            ExpertMLP(
                linear(gate_up[e, :intermediate]),
                linear(gate_up[e, intermediate:]),
                linear(down[e]),
                packed.act_fn,
            )
            for e in range(gate_up.shape[0])
        )


def is_linearizable(module: nn.Module) -> bool:
    """`module` holds packed experts in the layout `LinearExperts` computes."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
        and callable(getattr(module, "act_fn", None))
        and all(getattr(module, flag, default) == default for flag, default in SUPPORTED_LAYOUT.items())
    )


def packed_weight_modules(
    model: nn.Module, modules_to_not_convert: Sequence[str] | None
) -> dict[str, dict[str, tuple[int, ...]]]:
    """Modules outside `modules_to_not_convert` that hold floating-point weights of three or more dimensions longer
    than one (stacks of matrices: a tensor such as Kimi-Linear's `A_log`, `(1, 1, heads, 1)`, is a vector), are no
    convolution and cannot be linearized, by full name, with those weights' shapes by parameter name: weights dMX
    would leave in float."""
    patterns = list(modules_to_not_convert or [])
    found = {}
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.modules.conv._ConvNd)
            or is_linearizable(module)
            or any(is_skipped(name, p) for p in patterns)
        ):
            continue
        shapes = {
            parameter_name: tuple(parameter.shape)
            for parameter_name, parameter in module.named_parameters(recurse=False)
            if sum(length > 1 for length in parameter.shape) >= 3 and parameter.is_floating_point()
        }
        if shapes:
            found[name] = shapes
    return found


def linearizable_experts(
    model: nn.Module, modules_to_not_convert: Sequence[str] | None, format_map: Mapping[str, str] | None = None
) -> list[str]:
    """The packed experts modules of `model` that dMX quantizes: those `linearize_experts` takes, outside
    `modules_to_not_convert` and, with a `format_map`, those it names layers of.

    A layer's experts are quantized all together or not at all: raises, naming the module, when the patterns or the
    map leave some of its experts' linears out (they would be saved as float per-expert weights, which transformers
    merges back into the packed tensors on loading, where no packed tensor is left)."""
    patterns = list(modules_to_not_convert or [])
    names = []
    for name, module in model.named_modules():
        if not is_linearizable(module) or any(is_skipped(name, p) for p in patterns):
            continue
        linears = [f"{name}.{e}.{projection}" for e in range(len(module.gate_up_proj)) for projection in PROJECTIONS]
        if format_map is not None and not any(linear in format_map for linear in linears):
            continue
        left_out = [
            linear
            for linear in linears
            if any(is_skipped(linear, p) for p in patterns) or (format_map is not None and linear not in format_map)
        ]
        if left_out:
            raise ValueError(
                f"{len(left_out)} of the {len(linears)} expert linears of {name} would stay float (e.g. "
                f"{left_out[0]}): dMX quantizes a mixture-of-experts layer's experts all together or not at all; "
                f"name {name} itself in modules_to_not_convert to keep them all float"
            )
        names.append(name)
    return names


def linearize_experts(model: nn.Module, names: Sequence[str], *, skeleton: bool = False) -> None:
    """Replace the packed experts modules `names` of `model` by `LinearExperts` (the same function and weights).

    `skeleton`: `model` is built on the meta device to receive a checkpoint's tensors, and its experts hold no weights
    yet. Otherwise experts whose weights are on the meta device (offloaded by `device_map`) are refused: the copies
    into the linears need them in memory."""
    offloaded = [name for name in names if model.get_submodule(name).gate_up_proj.is_meta]
    if offloaded and not skeleton:
        raise ValueError(
            f"the mixture-of-experts layers {offloaded[:3]}{' ...' if len(offloaded) > 3 else ''} are offloaded by "
            "device_map: dMX quantizes experts held in memory only; load the model without offloading, or keep "
            f"the experts in float with modules_to_not_convert={sorted({per_layer_pattern(n) for n in offloaded})}"
        )
    for name in names:
        packed = model.get_submodule(name)
        if not is_linearizable(packed):
            raise ValueError(f"{name} ({type(packed).__name__}) holds no packed experts in a layout dMX takes")
        model.set_submodule(name, LinearExperts.from_packed(packed))
