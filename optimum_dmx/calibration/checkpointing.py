"""Activation checkpointing during calibration: each decoder layer's activations are recomputed in the backward
pass instead of kept, for transformers models whose decoder layers support it (`GradientCheckpointingLayer`).

transformers checkpoints a decoder layer only while that layer is in training mode, and calibration runs the
model in eval mode (no dropout). So only the decoder layers' own `training` flags are set: their submodules
(attention, dropout) stay in eval mode, and the recomputed forward pass is the same computation as the first.
The non-reentrant implementation of `torch.utils.checkpoint` is used: it supports inputs that need no gradient
(the frozen embeddings' output) and parameters (the format offsets) inside the checkpointed layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer


def decoder_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's decoder layers (transformers' `GradientCheckpointingLayer`s) by full name, in model order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, GradientCheckpointingLayer)}


@contextmanager
def activation_checkpointing(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, recompute each decoder layer's activations in the backward pass (when `enabled`).

    The model's checkpointing setting and its layers' training flags are restored on exit. Raises a clear error
    for a model without checkpointable decoder layers.
    """
    if not enabled:
        yield
        return
    layers = list(decoder_layers(model).values())
    if not layers or not hasattr(model, "activation_checkpointing_enable"):
        raise ValueError(
            f"gradient_checkpointing=True needs a transformers model whose decoder layers support activation "
            f"checkpointing; {type(model).__name__} has none. Calibrate it with gradient_checkpointing=False."
        )
    was_enabled = model.is_activation_checkpointing
    flags = [(layer, layer.training) for layer in layers]
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        for layer in layers:
            layer.training = True  # the layer only: `checkpoint` runs when it trains, its dropout stays off
        yield
    finally:
        for layer, flag in flags:
            layer.training = flag
        if not was_enabled:
            model.activation_checkpointing_disable()
