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
  weight holds the inverse. The transform's random signs `D` (`T = D B`) go into `up_proj`'s rows, which negates
  elements of `act(gate_proj(x)) * up_proj(x)` exactly, so the online transform is the plain block Hadamard `B`
  (`RandomizedHadamard.split_signs`): the same bits, without a pass over the activation for the signs (SmolLM2's
  512-blocks, a 1024 x 1536 float32 input on a Xeon without bfloat16 instructions: 3.62 ms with the MX cast against
  4.15 ms with the signs online, `benchmarks/results/inference_xeon_avx512.md`). The transform is returned, per
  module, to be recorded in config.json.

`rotation="hadamard"` uses full-size randomized Hadamard transforms for the merged rotations (hidden size, head
size) and, online, one on blocks of the largest power of two dividing the intermediate size (all of it when it is a
power of two: 512 of SmolLM2's 1536, 2048 of Llama-3.1-8B's 14336): a pure Hadamard transform per block, which
serving engines apply (`export.transforms`), where a full-size one would need a random orthogonal matrix for the
odd factor. `rotation="block_hadamard"` uses block-diagonal ones aligned to the MX blocks (`block_size`, normally
32), which mix values only within the blocks that share a scale.

`rotation="online_block_hadamard"` merges nothing into the residual stream: every quantized linear's input is
transformed block by block (inverse merged into its weight), after the RMSNorm scale; linears that read one input
(q/k/v, gate/up) share one transform. An attention's `o_proj` takes its input transformed from `v_proj`, whose
rows take the whole transform, where attention mixes values over tokens only (`whole_transform_carriers`: heads a
whole number of blocks, checked by probe passes of the model, `nn.sign_probe`; an attention output gated element
by element, as in AFMoE or Qwen3-Next, does not qualify): it needs no online transform, one of a decoder layer's
four fewer. Every other one is applied online. It draws random signs only where the module producing its input can
take them (`sign_carriers`: `up_proj` for a gated MLP's `down_proj`, `v_proj` for `o_proj`, with signs equal
across the query heads that read one value head, a decoder layer's RMSNorm scale for the linears reading it; each
checked by the probe), and the rotation puts them there, as for `down_proj` above: every online transform is a
plain block Hadamard transform, which is also what the loaders of exported checkpoints apply. Elsewhere (Gemma's
`1 + weight` norms, fused `qkv_proj`/`gate_up_proj` layers, MLPs that are not gated, other layouts) no signs are
drawn. Any architecture, tied embeddings stay tied, norms keep their scales (up to sign); the price is one fast
Hadamard transform of each quantized linear's input per call, `o_proj`'s excepted where `v_proj` computes it.

`rotation="auto"` (`resolve_rotation`) is `"online_block_hadamard"` where an exported checkpoint can carry it (every
quantized linear a plain, unsharded `nn.Linear` with whole MX blocks of inputs), else `"none"`, with a warning that
names the obstacle. It transforms no mixture-of-experts expert (`online_transform_targets`): no loader of an export
applies online transforms to a layer's fused experts.

All rotations are computed in float64 and written back in each weight's dtype, where the weight lives: in memory,
offloaded by accelerate or sharded by FSDP2 (`nn.placement.write_parameters`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .groups import expert_groups, fused_projection_groups
from .placement import is_resident, is_sharded, loaded_weights, replace_module, write_parameters
from .sign_probe import readers_receiving
from .transforms import RandomizedHadamard, TransformedLinear

Rotation = torch.Tensor | RandomizedHadamard  # an orthogonal matrix, or a transform applied from its factors

logger = logging.getLogger(__name__)

ROTATIONS = ("none", "hadamard", "block_hadamard", "online_block_hadamard")  # what `rotate_model` applies
AUTO_ROTATION = "auto"  # resolved per model by `resolve_rotation`
LEARNABLE_ROTATIONS = ("hadamard", "block_hadamard")  # the merged ones, which calibration can train further

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def validate_rotation(rotation: str) -> str:
    """Return `rotation` if it is `"auto"` or one of `ROTATIONS`; raise naming the allowed values otherwise."""
    if rotation != AUTO_ROTATION and rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is not supported; allowed: {', '.join((AUTO_ROTATION, *ROTATIONS))}.")
    return rotation


def resolve_rotation(model: nn.Module, rotation: str, quantized: Collection[str], block_size: int = 32) -> str:
    """The rotation `rotate_model` applies for `rotation`: `"auto"` becomes `"online_block_hadamard"` (on
    `online_transform_targets`) where `online_transform_obstacle` finds none, else `"none"` (with a warning naming the
    obstacle); any other rotation is returned as it is."""
    if validate_rotation(rotation) != AUTO_ROTATION:
        return rotation
    obstacle = online_transform_obstacle(model, online_transform_targets(rotation, quantized), block_size)
    if obstacle is None:
        return "online_block_hadamard"
    logger.warning("rotation='auto' leaves this model unrotated (rotation='none'): %s.", obstacle)
    return "none"


def online_transform_targets(rotation: str, quantized: Collection[str]) -> list[str]:
    """The linears `rotate_model` gives online transforms for the requested `rotation`: for `"auto"` the quantized
    ones but mixture-of-experts experts (no loader of an exported checkpoint applies online transforms to a layer's
    fused experts: vLLM applies them to linear layers only), so that an export carries every transform; for any other
    rotation all of `quantized`."""
    if validate_rotation(rotation) != AUTO_ROTATION:
        return list(quantized)
    experts = {name for group in expert_groups(quantized) for name in group}
    return [name for name in quantized if name not in experts]


def online_transform_obstacle(model: nn.Module, quantized: Collection[str], block_size: int = 32) -> str | None:
    """Why `rotation="online_block_hadamard"` does not suit `model` for serving, or None if it does: each quantized
    linear must be a plain, unsharded `nn.Linear` whose inputs are whole MX blocks."""
    if not quantized:
        return "no quantized linear (mixture-of-experts experts aside) would take an online transform"
    for name in quantized:
        linear = model.get_submodule(name)
        refusal = _online_transform_refusal(name, linear, block_size)
        if refusal is not None:
            return refusal
        if is_sharded(linear):
            return f"{name} is sharded by FSDP2 (rotate the model before fully_shard)"
    return None


def sign_carriers(model: nn.Module, quantized: Collection[str]) -> dict[str, str]:
    """For each of `quantized` whose online transform's random signs an exported checkpoint can carry, the module
    whose output takes them (negating an output element exactly negates that input element of the linear):

    * a gated MLP's `down_proj` reads `act(gate_proj(x)) * up_proj(x)`: `up_proj`'s rows;
    * an attention's `o_proj` reads, per query head, a mix over tokens of its value head's `v_proj` outputs:
      `v_proj`'s rows (the signs drawn equal across the query heads sharing a value head);
    * q/k/v and gate/up read a decoder layer's RMSNorm, its scale times the normalized input: the norm's scale,
      if every linear reading it is quantized (they share one transform) and the norm outputs its weight times
      the input (not Gemma's `1 + weight`).

    Names and shapes propose these pairs; probe passes of the model check them (`nn.sign_probe`): an MLP that is not
    gated (`down_proj(act(up_proj(x)))`, Nemotron's, Arcee's, MPT's) or a linear attention whose values pass a
    convolution and SiLU before `o_proj` (OLMo-Hybrid's) would not carry them, nor a norm whose output reaches more
    than the linears proposed as its readers. The linears left out get transforms without signs."""
    try:
        norm_readers = residual_norm_readers(model)
    except ValueError:  # not a Llama-style layout: no norm is known to feed a linear
        norm_readers = []
    proposed = {}
    for norm, readers in norm_readers:
        if all(reader in quantized for reader in readers) and negates_with_its_scale(model.get_submodule(norm)):
            proposed.update(dict.fromkeys(readers, norm))
    copies = {}
    for name in quantized:
        parent, _, leaf = name.rpartition(".")
        if leaf not in ("down_proj", "o_proj"):
            continue
        producer = "up_proj" if leaf == "down_proj" else "v_proj"
        sign_copies = _value_head_sign_copies(model, name)
        producer_module = getattr(model.get_submodule(parent), producer, None)
        inputs = model.get_submodule(name).in_features
        if isinstance(producer_module, nn.Linear) and producer_module.out_features * (sign_copies or (1,))[0] == inputs:
            proposed[name] = f"{parent}.{producer}"
            if sign_copies is not None:
                copies[name] = sign_copies
    received = readers_receiving(model, proposed, copies) if proposed else set()
    return {name: carrier for name, carrier in proposed.items() if name in received}


def whole_transform_carriers(model: nn.Module, carriers: Mapping[str, str], block_size: int) -> dict[str, str]:
    """For each attention `o_proj` of `carriers` (`sign_carriers`: its `v_proj` takes its transform's signs) whose
    whole online transform of `block_size` blocks `v_proj` can compute, that `v_proj`'s name: attention mixes
    `v_proj`'s outputs over tokens, never over features, so a transform within each head (`head_dim` a multiple of
    `block_size`) that is merged into `v_proj`'s rows reaches `o_proj`'s input as if applied there, and `o_proj` needs
    no online transform (one of a decoder layer's four fewer). Probe passes of the model check it (`nn.sign_probe`,
    a random transform of `block_size` blocks on `v_proj`'s output): an attention output gated element by element
    (AFMoE, Qwen3-Next, Qwen3.5) passes signs on, not a mix."""
    proposed, copies = {}, {}
    for name, carrier in carriers.items():
        parent, _, leaf = name.rpartition(".")
        head_dim = getattr(model.get_submodule(parent), "head_dim", None)
        if leaf == "o_proj" and isinstance(head_dim, int) and head_dim % block_size == 0:
            proposed[name] = carrier
            sign_copies = _value_head_sign_copies(model, name)
            if sign_copies is not None:
                copies[name] = sign_copies
    received = readers_receiving(model, proposed, copies, block_size) if proposed else set()
    return {name: carrier for name, carrier in proposed.items() if name in received}


def _online_transform_refusal(name: str, linear: nn.Module, block_size: int) -> str | None:
    """Why module `name` cannot take an online transform of blocks of `block_size` inputs, or None."""
    if not isinstance(linear, nn.Linear) or isinstance(linear, TransformedLinear):
        return f"{name} is a {type(linear).__name__}, not a plain nn.Linear"
    if linear.in_features % block_size:
        return f"{name} has {linear.in_features} inputs, not a whole number of MX blocks of {block_size}"
    return None


@torch.no_grad()
def negates_with_its_scale(norm: nn.Module) -> bool:
    """Whether negating `norm`'s weight negates its output exactly (tried on a float32 copy with random values):
    then a sign can move into its scale (not for Gemma's norms, which scale by `1 + weight`). The copy runs its
    class's forward: an offloaded norm's accelerate hook would load the stored weight over the probe's."""
    probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(probe.weight.shape, generator=generator)
    x = torch.randn(3, *probe.weight.shape, generator=generator)
    forward = type(probe).forward
    probe.weight.copy_(weight)
    output = forward(probe, x)
    probe.weight.copy_(-weight)
    return torch.equal(forward(probe, x), -output)


def rotate_model(
    model: nn.Module, rotation: str, quantized: Collection[str], block_size: int = 32, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """Rotate `model` in place (see the module docstring) and return its online input transforms by module name.

    Args:
        model: a Hugging Face decoder-only causal LM with Llama-style decoder layers (`self_attn.{q,k,v,o}_proj`,
            `mlp.{gate,up,down}_proj`, RMSNorms): Llama, Mistral, Qwen2/3, Gemma 3, SmolLM...
        rotation: one of `ROTATIONS` (`"auto"` is resolved first: `resolve_rotation`); `"none"` leaves the model
            alone.
        quantized: full names of the linears that will be MX-quantized: only those get an online transform
            (a float `down_proj` gains nothing from one).
        block_size: block of the `"block_hadamard"` transforms (the MX block size).
        seed: seeds every transform.

    Raises `ValueError`, naming what is missing, for a model whose layers do not have that structure.
    """
    if validate_rotation(rotation) == AUTO_ROTATION:
        raise ValueError("rotation='auto' depends on the model: resolve it with resolve_rotation first")
    if rotation == "none":
        return {}
    if rotation == "online_block_hadamard":
        _refuse_sharded(model, rotation, quantized)
        return _transform_every_input(model, quantized, block_size, seed)
    sites = rotation_sites(model)
    _refuse_sharded(model, rotation, [_down_proj(o) for _, o, _ in sites.heads if _down_proj(o) in quantized])
    seeds = iter(
        torch.randint(0, 2**31 - 1, (3 * len(sites.heads) + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    )

    def transform(size: int, online: bool = False) -> RandomizedHadamard:
        if rotation == "block_hadamard":
            block = min(block_size, size)
        else:
            block = size & -size if online else size  # online: the largest power of two dividing size
        return RandomizedHadamard(size, block, next(seeds))

    residual = transform(_text_config(model).hidden_size)
    per_layer = [
        (transform(head_dim), transform(model.get_submodule(_down_proj(o_proj)).in_features, online=True))
        for _, o_proj, head_dim in sites.heads
    ]
    if sites.residual:
        fold_norm_scales(model)
    merge_rotations(model, sites, residual if sites.residual else None, [head for head, _ in per_layer])
    carriers = sign_carriers(model, quantized)
    transforms = {}
    for (_, o_proj, _), (_, online) in zip(sites.heads, per_layer):
        name = _down_proj(o_proj)
        if name in quantized:
            _merge_input_side(model, name, online)  # W T: its TransformedLinear applies `T` online
            online = _carry_signs(model, carriers.get(name), online)  # T = D B: `up_proj`'s rows take D
            replace_module(model, name, TransformedLinear(model.get_submodule(name), online))
            transforms[name] = online.to_dict()
    return transforms


def _refuse_sharded(model: nn.Module, rotation: str, replaced: Collection[str]) -> None:
    """Raise, before anything is rotated, if a module the rotation replaces (by one with an online input transform)
    is sharded by FSDP2, which gathers a weight only into the module it sharded."""
    sharded = [name for name in replaced if is_sharded(model.get_submodule(name))]
    if sharded:
        raise ValueError(
            f"rotation={rotation!r} replaces {sharded[0]!r} by a module with an online input transform, but FSDP2 "
            "has sharded it and gathers its weight into the module it sharded: rotate the model before fully_shard "
            "(learned rotations then train and merge on the shards)"
        )


@dataclass(frozen=True)
class RotationSites:
    """Where the merged rotations of a Llama-style decoder act, by full module name.

    `readers` read the residual stream through an RMSNorm (q/k/v, gate/up, lm_head): the residual rotation goes
    on their input side; `writers` add into it (o_proj, down_proj): on their output side, as on the input
    embeddings' rows. `heads` holds each layer's `(v_proj, o_proj, head_dim)`: the per-head rotation goes on
    `v_proj`'s output and `o_proj`'s input. `residual` is False for models with post-block norms (Gemma 2/3),
    whose residual stream cannot be rotated (`rotate_model`).
    """

    readers: tuple[str, ...]
    writers: tuple[str, ...]
    heads: tuple[tuple[str, str, int], ...]
    residual: bool


def rotation_sites(model: nn.Module) -> RotationSites:
    """The `RotationSites` of `model`; raises `ValueError`, naming what is missing, for another structure."""
    layers = _decoder_layers(model)
    prefix = _layers_prefix(model, layers)
    config = _text_config(model)
    readers, writers, heads = [_module_name(model, _output_linear(model))], [], []
    for index, layer in enumerate(layers):
        name = f"{prefix}.{index}"
        readers += [f"{name}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
        readers += [f"{name}.mlp.{n}" for n in ("gate_proj", "up_proj")]
        writers += [f"{name}.self_attn.o_proj", f"{name}.mlp.down_proj"]
        head_dim = getattr(layer.self_attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads.append((f"{name}.self_attn.v_proj", f"{name}.self_attn.o_proj", head_dim))
    residual = not any(hasattr(layer, "post_feedforward_layernorm") for layer in layers)
    return RotationSites(tuple(readers), tuple(writers), tuple(heads), residual)


def has_unit_norm_scales(model: nn.Module) -> bool:
    """Whether every RMSNorm of `model`'s residual stream has an identity scale, as after `rotate_model`'s fold:
    only then does rotating the stream commute with the norms."""
    for norm_name, _ in residual_norm_readers(model):
        with loaded_weights(model, norm_name) as norm:
            if not bool((_norm_scale(norm) == 1).all()):
                return False
    return True


def residual_norm_readers(model: nn.Module) -> list[tuple[str, list[str]]]:
    """Every RMSNorm of the residual stream with the linears that read its output, by name: the final norm
    (`lm_head`), and per decoder layer the attention norm (q/k/v) and the MLP norm (gate/up)."""
    readers = [(_module_name(model, _final_norm(model)), [_module_name(model, _output_linear(model))])]
    layers = _decoder_layers(model)
    prefix = _layers_prefix(model, layers)
    for index, module in enumerate(layers):
        layer = f"{prefix}.{index}"
        # Gemma 2/3 norm the attention's output with post_attention_layernorm and the MLP's input with another
        mlp_norm = (
            "pre_feedforward_layernorm" if hasattr(module, "pre_feedforward_layernorm") else "post_attention_layernorm"
        )
        readers += [
            (f"{layer}.input_layernorm", [f"{layer}.self_attn.{n}_proj" for n in "qkv"]),
            (f"{layer}.{mlp_norm}", [f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"]),
        ]
    return readers


def _transform_every_input(
    model: nn.Module, quantized: Collection[str], block_size: int, seed: int
) -> dict[str, dict[str, Any]]:
    """A block-diagonal Hadamard transform of the input of every quantized linear (`T`, merged into its weight as
    `W T`), computed where it costs least: an attention's `o_proj` whose `v_proj` can compute the whole transform
    (`whole_transform_carriers`) takes its input transformed from `v_proj`, whose rows take `T` (`_merge_whole`); any
    other linear gets `T` online, its random signs (drawn where a module producing the input can carry them,
    `sign_carriers`) put into that module, so that what runs online is the plain block Hadamard transform
    (`_carry_signs`). The linears that read one input (q/k/v, gate/up: `nn.groups.fused_projection_groups`) share one
    transform, so that its result is computed once for them (`MXLinear.matmul_input`) and an engine that fuses them
    can apply it. Returns the online transforms by module name."""
    generator = torch.Generator().manual_seed(seed)
    shared_with = {name: group[0] for group in fused_projection_groups(quantized) for name in group}
    carriers = sign_carriers(model, quantized)
    whole_carriers = whole_transform_carriers(model, carriers, block_size)
    built: dict[str, tuple[RandomizedHadamard, RandomizedHadamard | None]] = {}  # owner: (merged, applied online)
    transforms = {}
    for name in quantized:
        linear = model.get_submodule(name)
        refusal = _online_transform_refusal(name, linear, block_size)
        if refusal is not None:
            raise ValueError(f"rotation='online_block_hadamard': {refusal}")
        owner = shared_with.get(name, name)
        if owner not in built:
            seed_of_owner = int(torch.randint(0, 2**31 - 1, (), generator=generator))
            copies = _value_head_sign_copies(model, name)
            signed = owner in carriers
            transform = RandomizedHadamard(linear.in_features, block_size, seed_of_owner, copies, signed)
            online = None if owner in whole_carriers else _carry_signs(model, carriers.get(owner), transform)
            built[owner] = transform, online
        merged, online = built[owner]
        _merge_input_side(model, name, merged)  # W T
        if online is None:  # its input comes transformed from v_proj
            _merge_whole(model, whole_carriers[name], merged)
            continue
        replace_module(model, name, TransformedLinear(linear, online))
        transforms[name] = online.to_dict()
    return transforms


def _merge_whole(model: nn.Module, carrier: str, transform: RandomizedHadamard) -> None:
    """Merge `transform` into the output side of `carrier`, a `v_proj` whose outputs its `o_proj` reads through
    attention (`whole_transform_carriers`): each value head's output comes out transformed, and with it each query
    head's input of `o_proj`. With `sign_copies`, the value heads take one copy of each run of signs, the transform
    of `size / copies` elements drawn from the same seed (the same signs, once each, and the same blocks)."""
    copies, _ = transform.sign_copies
    of_values = RandomizedHadamard(
        transform.size // copies, transform.block_size, transform.seed, signed=transform.signed
    )
    _merge_output_side(model, carrier, of_values)


def _carry_signs(model: nn.Module, carrier: str | None, transform: RandomizedHadamard) -> RandomizedHadamard:
    """What remains online of `transform` (`T = D B`) once module `carrier`, which produces its input, outputs each
    element multiplied by its sign in `D`: the plain block Hadamard transform `B` (`RandomizedHadamard.split_signs`).
    A transform without signs, or without a carrier, stays as it is.

    The same bits as `T` online: MX casts are sign-symmetric and a negated norm scale or weight row negates its
    output element exactly, so `B` receives `x D` as `T` would have computed it, without a pass over the input for
    the signs. With `sign_copies`, the carrier's output holds one run of signs per copy group (a value head read by
    several query heads): one copy of each run goes into it."""
    if carrier is None or not transform.signed:
        return transform
    signs, unsigned = transform.split_signs()
    copies, run = transform.sign_copies
    _negate_outputs(model, carrier, signs.view(-1, copies, run)[:, 0].flatten())
    return unsigned


def _value_head_sign_copies(model: nn.Module, name: str) -> tuple[int, int] | None:
    """For the `o_proj` of a grouped-query attention, `(query heads per value head, head_dim)`: its transform's signs
    are then equal across the query heads that read one value head, so that they can move into `v_proj`'s rows
    (`export.transforms`); None for any other linear."""
    parent, _, leaf = name.rpartition(".")
    attention = model.get_submodule(parent) if leaf == "o_proj" else None
    groups, head_dim = getattr(attention, "num_key_value_groups", 1), getattr(attention, "head_dim", None)
    if groups > 1 and head_dim and model.get_submodule(name).in_features % (groups * head_dim) == 0:
        return groups, head_dim
    return None


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(
            f"rotation needs a decoder-only model with `{getattr(model, 'base_model_prefix', 'model')}"
            f'.layers`; {type(model).__name__} has none ("online_block_hadamard" merges nothing into the model and '
            "needs no such structure)"
        )
    for index, layer in enumerate(layers):
        missing = [
            f"self_attn.{n}"
            for n in _ATTENTION
            if not isinstance(getattr(getattr(layer, "self_attn", None), n, None), nn.Linear)
        ]
        missing += [
            f"mlp.{n}" for n in _MLP if not isinstance(getattr(getattr(layer, "mlp", None), n, None), nn.Linear)
        ]
        missing += [
            n for n in ("input_layernorm", "post_attention_layernorm") if not _is_rms_norm(getattr(layer, n, None))
        ]
        if missing:
            raise ValueError(
                "rotation supports Llama-style decoder layers (RMSNorms, self_attn.q/k/v/o_proj, "
                "mlp.gate/up/down_proj); "
                f"layer {index} of {type(model).__name__} lacks {', '.join(missing)}"
            )
    return layers


def _text_config(model: nn.Module) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _output_linear(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, nn.Linear):
        raise ValueError(f"rotation needs the output embeddings (lm_head) of {type(model).__name__} as an nn.Linear")
    return head


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return _module_name(model, layers)


def _is_rms_norm(module: Any) -> bool:
    return isinstance(module, nn.Module) and type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight")


def _norm_scale(norm: nn.Module) -> torch.Tensor:
    """The per-feature scale an RMSNorm applies: `weight`, or `1 + weight` for Gemma's zero-centred norms."""
    weight = norm.weight.detach().double()
    return 1.0 + weight if "Gemma" in type(norm).__name__ else weight


def rotate_input_side(weight: torch.Tensor, matrix: Rotation) -> torch.Tensor:
    """`weight @ diag(matrix, ..., matrix)`: a layer holding the result expects its input rotated by `matrix`
    (applied to each consecutive group of `len(matrix)` input features). A `RandomizedHadamard` is applied from its
    factors (`apply`, float64): a few dozen multiply-adds per element instead of `len(matrix)`."""
    if isinstance(matrix, RandomizedHadamard):
        return matrix.apply(weight.unflatten(-1, (-1, matrix.size))).flatten(-2)
    size = matrix.shape[0]
    return (weight.unflatten(-1, (-1, size)) @ matrix).flatten(-2)


def rotate_output_side(weight: torch.Tensor, matrix: Rotation) -> torch.Tensor:
    """`diag(matrix, ..., matrix)^T @ weight` for a weight (`[out, in]`), `bias @ diag(...)` for a bias (`[out]`):
    the layer's output comes out rotated by `matrix` (each consecutive group of `len(matrix)` output features)."""
    if weight.dim() == 1:
        return rotate_input_side(weight, matrix)
    return rotate_input_side(weight.T, matrix).T


@torch.no_grad()
def _rewrite(
    model: nn.Module,
    name: str,
    rewrite: Callable[[torch.Tensor], torch.Tensor],
    parameters: Sequence[str] = ("weight",),
) -> None:
    """Replace each of `parameters` of module `name` (those it has) by `rewrite` of it, computed in float64 on its
    device and written back in its dtype, where it lives (`nn.placement.write_parameters`)."""
    with loaded_weights(model, name) as module:
        tensors = {p: getattr(module, p) for p in parameters if getattr(module, p, None) is not None}
        values = {p: rewrite(tensor.double()).to(tensor.dtype) for p, tensor in tensors.items()}
    write_parameters(model, name, values)


def _merge_input_side(model: nn.Module, name: str, matrix: Rotation) -> None:
    """`W <- W @ diag(matrix, ...)` for module `name`: a linear now expects inputs rotated by `matrix`, an
    embedding's rows come out rotated by it."""
    _rewrite(model, name, lambda weight: rotate_input_side(weight, _in_float64(matrix, weight.device)))


def _negate_outputs(model: nn.Module, name: str, signs: torch.Tensor) -> None:
    """`W <- diag(signs) W`, `b <- b * signs` for linear `name` (or the scale of a norm that outputs its weight times
    the normalized input, `negates_with_its_scale`): each output element comes out multiplied by its sign (+-1),
    exactly."""
    _rewrite(
        model,
        name,
        lambda tensor: tensor * signs.to(tensor.device).view(-1, *(1,) * (tensor.dim() - 1)),
        ("weight", "bias"),
    )


def _in_float64(matrix: Rotation, device: torch.device) -> Rotation:
    """A rotation matrix in float64 on `device`; a transform as it is (it computes in float64 where its input is)."""
    return matrix if isinstance(matrix, RandomizedHadamard) else matrix.to(device, torch.float64)


def _merge_output_side(model: nn.Module, name: str, matrix: Rotation) -> None:
    """`W <- diag(matrix, ...)^T @ W`, `b <- b @ diag(matrix, ...)` for linear `name`: it now outputs `y` rotated by
    `matrix`."""
    rotate = lambda tensor: rotate_output_side(tensor, _in_float64(matrix, tensor.device))  # noqa: E731
    _rewrite(model, name, rotate, ("weight", "bias"))


def _final_norm(model: nn.Module) -> nn.Module:
    final_norm = getattr(getattr(model, model.base_model_prefix), "norm", None)
    if not _is_rms_norm(final_norm):
        raise ValueError(f"rotation needs the final RMSNorm `{model.base_model_prefix}.norm` of {type(model).__name__}")
    return final_norm


@torch.no_grad()
def fold_norm_scales(model: nn.Module) -> None:
    """Fold every residual-stream RMSNorm's scale into the linears that read its output; the norm's scale becomes
    the identity. Tied input and output embeddings are untied first (the folded `lm_head` needs its own matrix)."""
    embeddings, head = model.get_input_embeddings(), _output_linear(model)
    if head.weight is embeddings.weight:
        if not (is_resident(embeddings) and is_resident(head)):
            raise ValueError(
                "rotation unties the tied input and output embeddings, which needs them in memory, but they are "
                "offloaded or sharded: keep the embeddings and lm_head on a device (device_map) to rotate this model"
            )
        head.weight = nn.Parameter(embeddings.weight.detach().clone(), requires_grad=embeddings.weight.requires_grad)
        for config in {id(c): c for c in (model.config, _text_config(model))}.values():
            config.tie_word_embeddings = False
    for norm_name, linear_names in residual_norm_readers(model):
        with loaded_weights(model, norm_name) as norm:
            scale, gemma = _norm_scale(norm), "Gemma" in type(norm).__name__
        for name in linear_names:
            _rewrite(model, name, lambda weight, scale=scale: weight * scale.to(weight.device))
        _rewrite(model, norm_name, torch.zeros_like if gemma else torch.ones_like)  # the identity scale


@torch.no_grad()
def merge_rotations(
    model: nn.Module, sites: RotationSites, residual: Rotation | None, heads: Sequence[Rotation]
) -> None:
    """Merge orthogonal rotations into `model`'s weights without changing its float function: the residual stream
    by `residual` (R1; None leaves it; the norms' scales must be folded already, `has_unit_norm_scales`) and
    each layer's value heads by its rotation of `heads` (R2, `[head_dim, head_dim]`, in the order of `sites.heads`).
    A rotation is a matrix (learned ones) or a `RandomizedHadamard`, merged from its factors."""
    if residual is not None:
        _merge_input_side(model, _module_name(model, model.get_input_embeddings()), residual)
        for name in sites.readers:
            _merge_input_side(model, name, residual)
        for name in sites.writers:
            _merge_output_side(model, name, residual)
    for (v_proj, o_proj, _), rotation in zip(sites.heads, heads, strict=True):
        _merge_output_side(model, v_proj, rotation)
        _merge_input_side(model, o_proj, rotation)


def _down_proj(o_proj: str) -> str:
    """The name of the `mlp.down_proj` in the decoder layer of `o_proj`."""
    return o_proj.replace("self_attn.o_proj", "mlp.down_proj")
