"""Whether a transform put on one module's output reaches another module's input unchanged, checked on the model.

An online transform `T = D B` (random signs, then a block Hadamard transform: `nn.transforms.RandomizedHadamard`) can
leave its signs `D`, or all of itself, to the module that produces its input (`nn.rotation.sign_carriers`,
`nn.rotation.whole_transform_carriers`: a rotation puts them there, an export writes the signs there for loaders
that apply plain Hadamard transforms) only if transforming the producer's output transforms exactly the reader's input
and nothing else. Module names do not say when that holds: `down_proj(act(gate_proj(x)) * up_proj(x))` passes
`up_proj`'s signs on, but not a mix of its elements; `down_proj(relu(up_proj(x)) ** 2)` (Nemotron, Arcee) or a GELU
MLP's (MPT) passes neither; softmax attention passes a mix of `v_proj`'s outputs within a head on (it mixes tokens,
not features), an attention output gated element by element (AFMoE, Qwen3-Next) passes its signs and not a mix, a
gated delta net whose values go through a convolution and SiLU before its `o_proj` (OLMo-Hybrid's linear attention)
neither. So the model runs `PROBE_TOKENS` random tokens three times: once as it is, recording each reader's input and
the logits; then with each producer's output transformed by a random `RandomizedHadamard` of the probed block size
(1: signs alone), comparing each reader's input with its recorded one transformed as it should have been, and
handing the reader its recorded input, so that a producer whose transform does not pass on changes nothing
downstream and every pair is judged on its own. A producer keeps its transform for all of its readers (the linears
reading one norm share one transform) or for none. The third pass transforms only the producers kept and hands only
their readers their recorded inputs: the logits must be the first pass's, or some kept producer's output also
reaches a module that is not its reader (a block whose attention and MLP both read one norm, under Llama's module
names), and then nothing moves at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .placement import input_device
from .transforms import RandomizedHadamard

logger = logging.getLogger(__name__)

__all__ = ["PROBE_TOKENS", "readers_receiving"]

PROBE_TOKENS = 8  # a few positions: attention mixes tokens, a convolution over positions shows
_TOLERANCE = 1e-3  # of the largest value compared: signs that pass on are exact, those that do not are off by O(1)


@torch.no_grad()
def readers_receiving(
    model: nn.Module,
    producers: Mapping[str, str],
    copies: Mapping[str, tuple[int, int]] | None = None,
    block_size: int = 1,
) -> set[str]:
    """The readers (module names, keys of `producers`) that can leave the random signs (`block_size=1`), or a whole
    block transform of their input (`block_size` elements a block), to their producer (`producers[reader]`), checked
    in forward passes of `model` (a causal LM) on random tokens in eval mode: when the producer's output goes through
    a random `RandomizedHadamard(out_features, block_size)`, the input of each of the producer's readers comes out
    through the same transform, and nothing else in the model changes. `copies[reader] = (repeats, run)`: each run of
    `run` of the producer's output elements reaches `repeats` runs of the reader's input in a row (the query heads of
    a grouped-query attention reading one value head), and the reader's input comes out through the transform with
    those sign copies; otherwise the reader's input has the producer's output size. Empty, with a warning naming the
    producers, if the transforms of the producers whose readers all receive them reach something else too."""
    copies = copies or {}
    generator = torch.Generator().manual_seed(0)
    vocabulary = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocabulary, (1, PROBE_TOKENS), generator=generator).to(input_device(model))
    recorded = {reader: [] for reader in producers}
    logits = _run(model, ids, {reader: _recording(recorded[reader]) for reader in producers}, {})
    seeds = {p: int(torch.randint(0, 2**31 - 1, (), generator=generator)) for p in dict.fromkeys(producers.values())}
    sizes: dict[str, int] = {}  # each producer's output size, as its transformed pass saw it
    expected = {
        reader: _expected(sizes, producer, seeds[producer], block_size, copies.get(reader))
        for reader, producer in producers.items()
    }

    def transformed_pass(pairs: Mapping[str, str]) -> tuple[set[str], torch.Tensor]:
        """The readers of `pairs` receiving their producer's transform, and the logits, with those producers'
        outputs transformed."""
        received = dict.fromkeys(pairs, True)
        readers = {r: _comparing(recorded[r], expected[r], received, r, block_size) for r in pairs}
        transforming = {p: _transforming(sizes, p, seeds[p], block_size) for p in dict.fromkeys(pairs.values())}
        transformed_logits = _run(model, ids, readers, transforming)
        return {reader for reader, passed in received.items() if passed and recorded[reader]}, transformed_logits

    passed, _ = transformed_pass(producers)
    refused = {producer for reader, producer in producers.items() if reader not in passed}
    kept = {reader: producer for reader, producer in producers.items() if producer not in refused}
    if not kept:
        return set()
    passed, transformed_logits = transformed_pass(kept)  # the kept pairs alone: nothing but their readers may change
    if passed != set(kept) or not _close(transformed_logits, logits):
        logger.warning(
            "the online transforms of this model leave %s to no other module: %s put on the output of one of %s "
            "reached more than the modules that read it as the model's names say (the logits changed although those "
            "were handed their untransformed inputs)",
            "their signs" if block_size == 1 else "nothing",
            "a sign" if block_size == 1 else f"a transform of blocks of {block_size}",
            sorted(set(kept.values())),
        )
        return set()
    return set(kept)


def _run(model: nn.Module, ids: torch.Tensor, pre_hooks: Mapping[str, Any], hooks: Mapping[str, Any]) -> torch.Tensor:
    """The logits of one forward pass of `model` on `ids` in eval mode, with `pre_hooks` and `hooks` on the modules
    they name."""
    training = {module: module.training for module in model.modules()}
    with ExitStack() as stack:
        for name, hook in pre_hooks.items():
            stack.callback(model.get_submodule(name).register_forward_pre_hook(hook).remove)
        for name, hook in hooks.items():
            stack.callback(model.get_submodule(name).register_forward_hook(hook).remove)
        model.eval()
        try:
            return model(input_ids=ids, use_cache=False).logits
        finally:
            for module, mode in training.items():
                module.training = mode


def _close(values: torch.Tensor, reference: torch.Tensor, tolerance: float = _TOLERANCE) -> bool:
    """Whether `values` equal `reference` to `tolerance` of its largest magnitude (both passes compute the same
    operations on the same inputs; the tolerance absorbs nondeterministic kernels, and `_tolerance` the rounding of a
    block transform's sums)."""
    scale = reference.double().abs().max()
    return bool((values.double() - reference.double()).abs().max() <= tolerance * scale)


def _tolerance(dtype: torch.dtype, block_size: int) -> float:
    """How closely a reader's input must match its expected value: signs pass on exactly (`_TOLERANCE`); a block
    transform's sums are rounded to the model's dtype where they enter the producer's output, and the reader's input
    is computed from them in that dtype, so four of its epsilons more (bfloat16: 0.031; on the test suite's tiny
    models of 46 families, attention that passes a mix on matched to at most 0.006 in bfloat16 and 1e-7 in float32,
    attention gated element by element missed by 0.13 or more)."""
    return _TOLERANCE if block_size == 1 else _TOLERANCE + 4 * torch.finfo(dtype).eps


def _recording(inputs: list[torch.Tensor | None]):
    """A pre-hook that keeps a copy of each call's input."""

    def record(module: nn.Module, args: tuple) -> None:
        inputs.append(args[0].detach().clone() if args else None)

    return record


def _transforming(sizes: dict[str, int], producer: str, seed: int, block_size: int):
    """A forward hook that passes the output through `RandomizedHadamard(its size, block_size, seed)`, rounded back
    to the output's dtype (a transform of `block_size` 1 multiplies by its signs alone, exactly), and notes the size
    in `sizes[producer]`."""

    def transform(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        size = sizes[producer] = output.shape[-1]
        if size % block_size:
            return output  # no such transform: its readers fail their comparison
        return RandomizedHadamard(size, block_size, seed).apply(output).to(output.dtype)

    return transform


def _expected(
    sizes: Mapping[str, int], producer: str, seed: int, block_size: int, copies: tuple[int, int] | None
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """What a reader's recorded input should become when its producer's output goes through the transform of
    `seed` (`_transforming`): the same transform, with its signs copied as the reader receives them (float64); None
    when the input is not the producer's output size (times the copies) or has no such transform."""

    def expected(reference: torch.Tensor) -> torch.Tensor | None:
        size, repeats = reference.shape[-1], (copies or (1,))[0]
        if size != sizes.get(producer, 0) * repeats or size % block_size:
            return None
        return RandomizedHadamard(size, block_size, seed, copies).apply(reference)

    return expected


def _comparing(
    recorded: list[torch.Tensor | None],
    expected: Callable[[torch.Tensor], torch.Tensor | None],
    received: dict[str, bool],
    reader: str,
    block_size: int,
):
    """A pre-hook that compares each call's input with the recorded one transformed as expected (into
    `received[reader]`, to `_tolerance`), then hands the reader the recorded input."""
    calls = iter(range(len(recorded)))

    def compare(module: nn.Module, args: tuple) -> tuple | None:
        index = next(calls, None)
        if index is None or not args or recorded[index] is None:
            received[reader] = False
            return None
        reference = recorded[index]
        wanted = expected(reference) if args[0].shape == reference.shape else None
        received[reader] &= wanted is not None and _close(args[0], wanted, _tolerance(args[0].dtype, block_size))
        return (reference, *args[1:])  # downstream as in the first pass: each reader judged on its own

    return compare
