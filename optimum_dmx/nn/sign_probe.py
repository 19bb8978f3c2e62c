"""Whether a sign put on one module's output reaches another module's input unchanged, checked on the model itself.

An online transform's random signs `D` (`T = D B`) can leave the transform for the module that produces its
input (`nn.rotation.sign_carriers`: a rotation puts them there, an export writes them there for loaders that apply
plain Hadamard transforms) only if negating an element of the producer's output negates exactly that element of
the reader's input and nothing else. Module names do not say when that holds: `down_proj(act(gate_proj(x)) *
up_proj(x))` passes `up_proj`'s signs on, `down_proj(relu(up_proj(x)) ** 2)` (Nemotron, Arcee) or a GELU MLP's
(MPT) does not; softmax attention passes `v_proj`'s on, a gated delta net whose values go through a convolution and
SiLU before its `o_proj` (OLMo-Hybrid's linear attention) does not. So the model runs `PROBE_TOKENS` random tokens
three times: once as it is, recording each reader's input and the logits; then with each producer's output
multiplied by random signs, comparing each reader's input with its recorded one times the signs it should have
received, and handing the reader its recorded input, so that a producer whose signs do not pass on changes nothing
downstream and every pair is judged on its own. A producer keeps its signs for all of its readers (the linears
reading one norm share one transform) or for none. The third pass signs only the producers kept and hands only their
readers their recorded inputs: the logits must be the first pass's, or some kept producer's output also reaches a
module that is not its reader (a block whose attention and MLP both read one norm, under Llama's module names), and
then no signs move at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .placement import input_device

logger = logging.getLogger(__name__)

__all__ = ["PROBE_TOKENS", "readers_receiving_signs"]

PROBE_TOKENS = 8  # a few positions: attention mixes tokens, a convolution over positions shows
_TOLERANCE = 1e-3  # of the largest value compared: a sign that passes on is exact, one that does not is off by O(1)


@torch.no_grad()
def readers_receiving_signs(
    model: nn.Module, producers: Mapping[str, str], copies: Mapping[str, tuple[int, int]] | None = None
) -> set[str]:
    """The readers (module names, keys of `producers`) that can leave their online transform's signs to their
    producer (`producers[reader]`), checked in forward passes of `model` (a causal LM) on random tokens in eval mode:
    when the producer's output is multiplied by random signs, the input of each of the producer's readers comes out
    multiplied by them element by element, and nothing else in the model changes. `copies[reader] = (repeats, run)`:
    each run of `run` of the producer's output elements reaches `repeats` runs of the reader's input in a row (the
    query heads of a grouped-query attention reading one value head); otherwise the reader's input has the
    producer's output size. Empty, with a warning naming the producers, if the signs of the producers whose readers
    all receive them reach something else too."""
    copies = copies or {}
    generator = torch.Generator().manual_seed(0)
    vocabulary = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocabulary, (1, PROBE_TOKENS), generator=generator).to(input_device(model))
    recorded = {reader: [] for reader in producers}
    logits = _run(model, ids, {reader: _recording(recorded[reader]) for reader in producers}, {})
    signs: dict[str, torch.Tensor] = {}  # per producer, drawn at its first signed call
    expected = {reader: _expected_signs(signs, producer, copies.get(reader)) for reader, producer in producers.items()}

    def signed_pass(pairs: Mapping[str, str]) -> tuple[set[str], torch.Tensor]:
        """The readers of `pairs` receiving their producer's signs, and the logits, with those producers signed."""
        received = dict.fromkeys(pairs, True)
        readers = {reader: _comparing(recorded[reader], expected[reader], received, reader) for reader in pairs}
        signing = {producer: _signing(signs, producer, generator) for producer in dict.fromkeys(pairs.values())}
        signed_logits = _run(model, ids, readers, signing)
        return {reader for reader, passed in received.items() if passed and recorded[reader]}, signed_logits

    passed, _ = signed_pass(producers)
    refused = {producer for reader, producer in producers.items() if reader not in passed}
    kept = {reader: producer for reader, producer in producers.items() if producer not in refused}
    if not kept:
        return set()
    passed, signed_logits = signed_pass(kept)  # the kept pairs alone: nothing but their readers may change
    if passed != set(kept) or not _close(signed_logits, logits):
        logger.warning(
            "the online transforms of this model draw no random signs: a sign put on the output of one of %s reached "
            "more than the modules that read it as the model's names say (the logits changed although those were "
            "handed their unsigned inputs)",
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


def _close(values: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether `values` equal `reference` to `_TOLERANCE` of its largest magnitude (both passes compute the same
    operations on the same inputs; the tolerance only absorbs nondeterministic kernels)."""
    scale = reference.double().abs().max()
    return bool((values.double() - reference.double()).abs().max() <= _TOLERANCE * scale)


def _recording(inputs: list[torch.Tensor | None]):
    """A pre-hook that keeps a copy of each call's input."""

    def record(module: nn.Module, args: tuple) -> None:
        inputs.append(args[0].detach().clone() if args else None)

    return record


def _signing(signs: dict[str, torch.Tensor], producer: str, generator: torch.Generator):
    """A forward hook that multiplies the output by random signs, drawn at the first call into `signs[producer]`."""

    def multiply(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if producer not in signs:
            signs[producer] = torch.randint(0, 2, (output.shape[-1],), generator=generator).to(output) * 2 - 1
        return output * signs[producer]

    return multiply


def _expected_signs(
    signs: Mapping[str, torch.Tensor], producer: str, copies: tuple[int, int] | None
) -> Callable[[], torch.Tensor | None]:
    """The signs a reader's input should carry, from its producer's once the pass has drawn them (None before)."""

    def expected() -> torch.Tensor | None:
        produced = signs.get(producer)
        if produced is None or copies is None:
            return produced
        repeats, run = copies
        return produced.view(-1, run).repeat_interleave(repeats, 0).flatten()

    return expected


def _comparing(
    recorded: list[torch.Tensor | None],
    expected: Callable[[], torch.Tensor | None],
    received: dict[str, bool],
    reader: str,
):
    """A pre-hook that compares each call's input with the recorded one times the expected signs (into
    `received[reader]`), then hands the reader the recorded input."""
    calls = iter(range(len(recorded)))

    def compare(module: nn.Module, args: tuple) -> tuple | None:
        index = next(calls, None)
        if index is None or not args or recorded[index] is None:
            received[reader] = False
            return None
        reference, signs = recorded[index], expected()
        if signs is None or signs.shape[-1] != reference.shape[-1] or args[0].shape != reference.shape:
            received[reader] = False
        else:
            received[reader] &= _close(args[0], reference.double() * signs.double())
        return (reference, *args[1:])  # downstream as in the first pass: each reader judged on its own

    return compare
