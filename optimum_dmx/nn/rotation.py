"""Function-preserving rotations of a decoder-only transformer before MX quantization (QuaRot / SpinQuant style).

`rotate_model(model, rotation, ...)` changes the weights, never the function (up to float rounding):

* **Residual stream (R1).** Every RMSNorm's scale is folded into the linears that read its output (its weight
  becomes the identity), then the residual stream is rotated by an orthogonal `Q`: the embedding rows and the
  linears writing into the stream (`o_proj`, `down_proj`) by `Q`, the linears reading it (`q/k/v`, `gate/up`,
  `lm_head`) by `Q^T` on their input side. RMSNorm without scale commutes with `Q`. Tied input and output
  embeddings are untied (the rotated `lm_head` needs its own copy of the matrix). Models with post-block norms
  (Gemma 2/3: `post_attention_layernorm` and `post_feedforward_layernorm` scale the block output before the
  residual add) cannot be rotated this way; they keep their residual stream and get the other two rotations.
* **Values and attention outputs per head (R2).** `v_proj`'s output and `o_proj`'s input are rotated head by head
  with one orthogonal matrix per decoder layer (attention mixes tokens, not features, so it commutes).
* **Online input transform of `down_proj` (R4).** The input of `down_proj` (after the gated activation) cannot be
  reached by a merged rotation: it becomes a `TransformedLinear` whose input is transformed on the fly and whose
  weight holds the inverse. The transform is returned, per module, to be recorded in config.json.

`rotation="hadamard"` uses full-size randomized Hadamard transforms (hidden size, head size, intermediate size);
`rotation="block_hadamard"` uses block-diagonal ones aligned to the MX blocks (`block_size`, normally 32), which
mix values only within the blocks that share a scale.

`rotation="online_block_hadamard"` merges nothing into the residual stream: every quantized linear gets its own
online block-diagonal transform of its input (inverse merged into its weight), applied after the RMSNorm scale.
Any architecture, tied embeddings stay tied, norms keep their scales; the price is one fast Hadamard transform of
each quantized linear's input per call.

All rotations are computed in float64 and written back in each weight's dtype.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from .transforms import RandomizedHadamard, TransformedLinear

ROTATIONS = ("none", "hadamard", "block_hadamard", "online_block_hadamard")

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def validate_rotation(rotation: str) -> str:
    """Return `rotation` if it is one of `ROTATIONS`; raise naming the allowed values otherwise."""
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is not supported; allowed: {', '.join(ROTATIONS)}.")
    return rotation


def rotate_model(
    model: nn.Module, rotation: str, quantized: Collection[str], block_size: int = 32, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """Rotate `model` in place (see the module docstring) and return its online input transforms by module name.

    Args:
        model: a Hugging Face decoder-only causal LM with Llama-style decoder layers (`self_attn.{q,k,v,o}_proj`,
            `mlp.{gate,up,down}_proj`, RMSNorms): Llama, Mistral, Qwen2/3, Gemma 3, SmolLM...
        rotation: one of `ROTATIONS`; `"none"` leaves the model alone.
        quantized: full names of the linears that will be MX-quantized: only those get an online transform
            (a float `down_proj` gains nothing from one).
        block_size: block of the `"block_hadamard"` transforms (the MX block size).
        seed: seeds every transform.

    Raises `ValueError`, naming what is missing, for a model whose layers do not have that structure.
    """
    if validate_rotation(rotation) == "none":
        return {}
    if rotation == "online_block_hadamard":
        return _transform_every_input(model, quantized, block_size, seed)
    layers = _decoder_layers(model)
    seeds = iter(torch.randint(0, 2**31 - 1, (3 * len(layers) + 1,), generator=torch.Generator().manual_seed(seed)).tolist())

    def transform(size: int) -> RandomizedHadamard:
        return RandomizedHadamard(size, size if rotation == "hadamard" else min(block_size, size), next(seeds))

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    residual = transform(config.hidden_size)
    if not any(hasattr(layer, "post_feedforward_layernorm") for layer in layers):
        _rotate_residual_stream(model, layers, residual.matrix())
    transforms = {}
    prefix = _layers_prefix(model, layers)
    for index, layer in enumerate(layers):
        attention, mlp = layer.self_attn, layer.mlp
        head_dim = getattr(attention, "head_dim", None) or config.hidden_size // config.num_attention_heads
        _rotate_heads(attention.v_proj, attention.o_proj, transform(head_dim).matrix(), head_dim)
        name = f"{prefix}.{index}.mlp.down_proj"
        online = transform(mlp.down_proj.in_features)
        if name in quantized:
            _merge_input_side(mlp.down_proj, online.matrix())
            mlp.down_proj = TransformedLinear(mlp.down_proj, online)
            transforms[name] = online.to_dict()
    return transforms


def _transform_every_input(model: nn.Module, quantized: Collection[str], block_size: int, seed: int) -> dict[str, dict[str, Any]]:
    """An online block-diagonal randomized Hadamard transform on the input of every quantized linear."""
    generator = torch.Generator().manual_seed(seed)
    transforms = {}
    for name in quantized:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear) or isinstance(linear, TransformedLinear):
            raise ValueError(f"rotation='online_block_hadamard' needs {name!r} to be a plain nn.Linear")
        if linear.in_features % block_size:
            raise ValueError(f"rotation='online_block_hadamard' needs in_features divisible by {block_size}; "
                             f"{name!r} has {linear.in_features}")
        transform = RandomizedHadamard(linear.in_features, block_size, int(torch.randint(0, 2**31 - 1, (), generator=generator)))
        _merge_input_side(linear, transform.matrix())
        model.set_submodule(name, TransformedLinear(linear, transform))
        transforms[name] = transform.to_dict()
    return transforms


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"rotation needs a decoder-only model with `{getattr(model, 'base_model_prefix', 'model')}"
                         f".layers`; {type(model).__name__} has none")
    for index, layer in enumerate(layers):
        missing = [f"self_attn.{n}" for n in _ATTENTION if not isinstance(getattr(getattr(layer, "self_attn", None), n, None), nn.Linear)]
        missing += [f"mlp.{n}" for n in _MLP if not isinstance(getattr(getattr(layer, "mlp", None), n, None), nn.Linear)]
        missing += [n for n in ("input_layernorm", "post_attention_layernorm") if not _is_rms_norm(getattr(layer, n, None))]
        if missing:
            raise ValueError(
                f"rotation supports Llama-style decoder layers (RMSNorms, self_attn.q/k/v/o_proj, mlp.gate/up/down_proj); "
                f"layer {index} of {type(model).__name__} lacks {', '.join(missing)}"
            )
    return layers


def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, module in model.named_modules() if module is layers)


def _is_rms_norm(module: Any) -> bool:
    return isinstance(module, nn.Module) and type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight")


def _norm_scale(norm: nn.Module) -> torch.Tensor:
    """The per-feature scale an RMSNorm applies: `weight`, or `1 + weight` for Gemma's zero-centred norms."""
    weight = norm.weight.detach().double()
    return 1.0 + weight if "Gemma" in type(norm).__name__ else weight


@torch.no_grad()
def _set_identity_scale(norm: nn.Module) -> None:
    norm.weight.fill_(0.0 if "Gemma" in type(norm).__name__ else 1.0)


@torch.no_grad()
def _merge_input_side(linear: nn.Linear, matrix: torch.Tensor) -> None:
    """`W <- W @ matrix`: the layer now expects inputs `x @ matrix`."""
    linear.weight.copy_((linear.weight.double() @ matrix.to(linear.weight.device)).to(linear.weight.dtype))


@torch.no_grad()
def _merge_output_side(linear: nn.Linear, matrix: torch.Tensor) -> None:
    """`W <- matrix^T @ W`, `b <- b @ matrix`: the layer now outputs `y @ matrix`."""
    matrix = matrix.to(linear.weight.device)
    linear.weight.copy_((matrix.T @ linear.weight.double()).to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_((linear.bias.double() @ matrix).to(linear.bias.dtype))


@torch.no_grad()
def _rotate_residual_stream(model: nn.Module, layers: nn.ModuleList, rotation: torch.Tensor) -> None:
    """R1: fold every RMSNorm scale into its readers, then rotate the stream by `rotation`."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or not isinstance(head, nn.Linear):
        raise ValueError(f"rotation needs the output embeddings (lm_head) of {type(model).__name__} as an nn.Linear")
    if head.weight is embeddings.weight:  # tied: the rotated head needs its own matrix
        head.weight = nn.Parameter(embeddings.weight.detach().clone(), requires_grad=embeddings.weight.requires_grad)
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    final_norm = getattr(getattr(model, model.base_model_prefix), "norm", None)
    if not _is_rms_norm(final_norm):
        raise ValueError(f"rotation needs the final RMSNorm `{model.base_model_prefix}.norm` of {type(model).__name__}")
    readers = [(final_norm, [head])]
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        readers += [(layer.input_layernorm, [attention.q_proj, attention.k_proj, attention.v_proj]),
                    (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])]
    for norm, linears in readers:
        scale = _norm_scale(norm)
        for linear in linears:
            linear.weight.copy_((linear.weight.double() * scale.to(linear.weight.device)).to(linear.weight.dtype))
            _merge_input_side(linear, rotation)
        _set_identity_scale(norm)
    weight = embeddings.weight
    weight.copy_((weight.double() @ rotation.to(weight.device)).to(weight.dtype))
    for layer in layers:
        _merge_output_side(layer.self_attn.o_proj, rotation)
        _merge_output_side(layer.mlp.down_proj, rotation)


@torch.no_grad()
def _rotate_heads(v_proj: nn.Linear, o_proj: nn.Linear, rotation: torch.Tensor, head_dim: int) -> None:
    """R2: every value head's output by `rotation`, and every attention head's slice of `o_proj`'s input."""
    per_head = torch.block_diag(*[rotation] * (v_proj.out_features // head_dim))
    _merge_output_side(v_proj, per_head)
    _merge_input_side(o_proj, torch.block_diag(*[rotation] * (o_proj.in_features // head_dim)))
