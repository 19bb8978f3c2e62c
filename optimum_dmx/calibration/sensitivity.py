"""KL sensitivity: how much each layer alone in the pair's low format moves the model's next-token distribution.

KL pre-selection (`method="kl"`) ranks layers by it; the default method blends its ranking with the learned
offsets' (`budget.blended_priority`).

Layers that share a format (`offset_groups`: q/k/v, gate/up, a mixture of experts' experts) only ever go low
together, so the scan puts such a group low whole, in one pass, and gives each member an even share of the group's
divergence: the budget values a group at its members' sum, which is then the divergence of the decision it makes.
On SmolLM2-135M with `offset_groups="fused"` that is 120 passes instead of 210 (0.58x the time), ranking the
budget's units as the members scanned alone and summed do (Spearman 0.994), for the same held-out perplexity with
GPTQ rounding (0.9994x over six maps on two held-out texts; 1.006x rounded to nearest); on a mixture of experts it is
one pass per layer's experts instead of one per expert linear (`research/sensitivity_signals.md`,
`research/README.md`, "The additive value").

The scan reads the first half of the positions of each of its `KL_SAMPLES` sequences (`KL_POSITIONS`): a pass
costs about in proportion to the positions it reads. On SmolLM2-135M reading half ranks the budget's units as
reading the whole sequences does at Spearman 0.991, in 0.58x the time (`research/sensitivity_signals.md`), and
the default recipe's maps from the same learned offsets had the same held-out perplexity within the evaluation's
noise (1.0001x over ten comparisons, -0.8% to +1.5%; `research/README.md`, "The scan on the first half of each
sequence"). Within the half, a position's divergence weighs more the more context precedes it (`position_weights`:
`sqrt(p + 1)`), so that the later positions read stand in for the unread ones. Against the original scan (every layer
alone, float32, whole sequences and vocabulary) the half ranks the units at Spearman 0.99 or more on six of eight sets
of sequences; reading 9/16 of each does on all eight, but takes 1.1-1.3x the half's time, which put the scan at 11%
of the CLI's default run's steps against 9% (`research/sensitivity_signals.md`, "Eight sets of sequences").

The scan makes one pass per unit (a layer, or a group), and a layer's quantization cannot change what the decoder
layers before its own compute. So one float pass records every decoder layer's output, and each unit's pass replays
the outputs of the decoder layers before its own instead of computing them: on average it runs half of the decoder,
with the same result as a whole pass. A pass also stops before the output embedding: its divergence is computed from the
final hidden states on the vocabulary's most probable tokens, the rest to second order
(`calibration.vocabulary_head`), which takes the scan from a full pass's output embedding and log-softmax per
layer to a sixth of the embedding's rows (0.66x the scan's time on SmolLM2-135M, Spearman 0.9999 with the whole
vocabulary's ranking).

The units of one decoder layer (up to `KL_UNITS_PER_PASS`) share a pass: it runs over as many copies of the batch,
each unit low in its own copy only (`LowInOneCopy`), and each copy's divergence is that unit's, the value a pass of
its own gives (the same sums, tested). The decoder then multiplies larger matrices and runs its other operations a
quarter as often: on SmolLM2-135M (4 units per decoder layer with fused groups, 4 x 64 tokens) 0.80x the scan's
time (`research/sensitivity_signals.md`, "Units sharing passes"). Only divergences from final hidden states share
passes: the whole vocabulary's logits for every copy would cost as many batches of them. And only units whose linears
read the batch whole, copy after copy (`_WholeBatchReaders`, seen in the float pass): a mixture of experts' expert
reads the tokens routed to it in the router's order, so a layer's experts are scanned in passes of their own.

On a float32 model the passes' matrix products run in bfloat16 where the device multiplies it natively (a CUDA GPU,
a CPU with AMX or AVX-512 BF16): the float layers hold bfloat16 copies of their weights for the scan, a unit goes low
from its float32 weight, and the residual stream, normalisations, softmaxes and the divergence stay float32 but for
the divergence's product with the vocabulary head's rows (`calibration.vocabulary_head`; 0.90x the scan's time). On
SmolLM2-135M with AMX that is 0.54x the float32 scan's time, ranking the budget's units at Spearman 0.998
against it (`research/sensitivity_signals.md`; `research/README.md`, "The scan in bfloat16", for the maps).
`kl_sensitivities(..., matmul_dtype=torch.float32)` keeps float32. A scan of whole distributions (soft-capped or
scaled logits) takes each pass's logits the way the head's divergences take `dz`: the reference's float32 logits plus
the bfloat16 product of the final hidden states' shift (`_pass_logits`). Rounded to bfloat16 whole, the logits put a
floor of about 1e-3 nats per token under every divergence.

The copies of layers with an online input transform (`nn.transforms.TransformedLinear`, `y = (x T) W'^T`: the
`online_block_hadamard` rotation's layers, a `hadamard` rotation's `down_proj`) hold `W' T^T` (computed from the
transform's factors, `RandomizedHadamard.apply`) and compute no transform, the same function (`T` is orthogonal): only a
unit's own layers, low, transform their input. The transforms are compiled kernels, a small part of a pass: in the CLI's
default run (every layer transformed) the scan took 47 s against 49 s on an AMD EPYC without AMX, the same map
(`benchmarks/results/cli_default_run.md`). Without a copy (float32 products, or a model in bfloat16) the layers keep
their transforms: merging them would hold a second copy of their weights.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map
from tqdm.auto import tqdm

from ..continuous import get_format_pair
from ..nn.placement import input_device, is_resident, loaded_weights
from ..nn.surgery import emulate_format_map, linear_modules_to_quantize, mx_linears_from, swapped_modules
from .checkpointing import decoder_layers as find_decoder_layers
from .distributed import process_share, sum_across_processes, world
from .groups import offset_groups
from .settings import CalibrationSettings
from .vocabulary_head import HEAD_TOKENS, VocabularyHeadReference

MATMUL_DTYPES = ("auto", torch.float32, torch.bfloat16, torch.float16)  # `kl_sensitivities`' `matmul_dtype`
KL_SAMPLES = 4  # calibration sequences the scan reads (the first ones): its ranking is stable from 4 on
KL_POSITIONS = 0.5  # of each of those sequences' positions, the share the scan reads (from the start)
KL_POSITION_WEIGHTING = 0.5  # position p's divergence weighs (p + 1) ** this in a sequence's mean (`position_weights`)
KL_UNITS_PER_PASS = 4  # units of one decoder layer scanned in one pass, each low in its own copy of the batch
KL_BLOCK_ELEMENTS = 2**21  # log-probabilities per block of positions in `next_token_kl` (8 MiB of float32)


@torch.no_grad()
def kl_sensitivities(
    model: nn.Module,
    input_ids: torch.LongTensor,
    settings: CalibrationSettings,
    progress: bool = True,
    head_tokens: int | None = HEAD_TOKENS,
    groups: Sequence[Sequence[str]] | None = None,
    matmul_dtype: torch.dtype | str = "auto",
    positions: float = KL_POSITIONS,
    units_per_pass: int = KL_UNITS_PER_PASS,
    position_weighting: float = KL_POSITION_WEIGHTING,
) -> dict[str, float]:
    """Per-layer KL(float || only this layer, or its group, in the pair's low format), in nats per token.

    The scan reads the first `KL_SAMPLES` sequences of `input_ids`, each up to `positions` of its length (the
    first half by default, rounded up; `1.0` reads them whole): one float forward pass gives the reference
    distributions and the decoder layers' outputs, then passes from a decoder layer on, in batches of
    `settings.batch_size` sequences, each over `units_per_pass` copies of the batch for as many units of that
    decoder layer, one low in each copy (one unit per pass when the divergences need the whole vocabulary's
    logits: `head_tokens=None`, or logits soft-capped or scaled; and for a mixture of experts' experts). A unit is
    a group of layers that share a format, all of them low in its copy, each given `1 / len(group)` of its
    divergence, or a layer alone. Under several processes (`calibration.distributed`) the processes divide the
    passes (`ScanSplit`) and every process ends with every layer's result. The low format is the same for both
    pairs (MXFP4), so the result can be reused across pairs and targets with the same groups.

    `groups`: the groups scanned whole; `None` takes `settings.offset_groups`, `()` scans every layer alone.

    `head_tokens`: the divergence is computed exactly on that many of the vocabulary's most probable tokens and
    to second order on the rest (`calibration.vocabulary_head`); `None` computes it over the whole vocabulary,
    as does any model whose logits are not its output embedding's output (soft-capped or scaled logits).

    `matmul_dtype`: the dtype of the passes' matrix products (`torch.autocast`): `torch.bfloat16` or
    `torch.float16` on a model with wider weights; `torch.float32`, or the weights' own dtype, leaves the model as it
    is; `"auto"` is bfloat16 for a float32 model on a device that multiplies bfloat16 natively (`native_bfloat16`).

    `positions`: the share of each sequence's positions the scan reads, from its start (`KL_POSITIONS`, half, by
    default; `1.0` reads the sequences whole, the scan before that default); each pass costs in proportion.

    `units_per_pass`: the most units a pass scans (`KL_UNITS_PER_PASS`); the values do not depend on it, the time
    and the memory of a pass (its decoder activations, one layer at a time) do.

    `position_weighting`: in a scan of part of each sequence, each position's divergence counts
    `(p + 1) ** position_weighting` times in its sequence's mean (`position_weights`, `KL_POSITION_WEIGHTING` by
    default): the later positions of the part read stand in for the unread rest. `0` weighs every position alike, as
    does a scan of whole sequences (`positions=1.0`, the scan before these defaults).
    """
    read = _positions_read(input_ids.shape[-1], positions)
    weights = position_weights(read, position_weighting)
    if read == input_ids.shape[-1]:
        weights = None  # whole sequences: no unread positions for the later ones to stand in for
    input_ids = input_ids[:KL_SAMPLES, :read]
    if isinstance(units_per_pass, bool) or not isinstance(units_per_pass, int) or units_per_pass < 1:
        raise ValueError(f"units_per_pass={units_per_pass!r} is not a number of units; allowed: an integer >= 1")
    device = input_device(model)
    low = get_format_pair(settings.format_pair).low.name
    targets = linear_modules_to_quantize(model, settings.modules_to_not_convert)
    if groups is None:
        groups = offset_groups(settings.offset_groups, list(targets))
    decoder_layers = find_decoder_layers(model)  # none: each pass runs the whole model
    stages = _stages(scan_units(list(targets), groups), decoder_layers)
    rank, world_size = world(device)
    split = ScanSplit.choose(world_size, len(input_ids), [len(units) for units in stages])
    input_ids = process_share(input_ids, *split.sequence_group(rank))
    batches = [b.to(device) for b in input_ids.split(settings.batch_size)]

    head = _output_head(model, targets)  # skipped (a vocabulary head reference) or shifted (lowered products)
    weights_dtype = next((module.weight.dtype for module in targets.values()), torch.float32)
    lowered = _lower_matmul_dtype(matmul_dtype, weights_dtype, device)
    # frozen and in eval mode once for the whole scan, so that its passes' module swaps need not set them again
    with swapped_modules(model, {}), _scan_float_layers(targets, lowered, device) as own:
        with emulate_format_map(model, {}), _WholeBatchReaders(targets) as readers:
            references = []
            for b in batches:
                readers.expect(b)
                references.append(
                    _record(model, b, list(decoder_layers.values()), head, head_tokens, lowered, device.type)
                )
        # Each process's KL sums over its sequences for the layers it scans, zero elsewhere; summed across processes.
        sums = torch.zeros(len(targets), dtype=torch.float64)
        index = {name: i for i, name in enumerate(targets)}
        alone = {unit for stage in stages for unit, _ in stage if not set(unit) <= readers.names}
        passes = split.passes(rank, stages, units_per_pass if _from_hidden_states(references) else 1, alone)
        for units, round_names, replayed in tqdm(passes, desc="KL sensitivity", disable=not progress):
            names = [name for unit in units for name in unit]
            with ExitStack() as installed:  # low from its own weight and transform, not the copy
                for name in names:
                    installed.enter_context(own.get(name, _LayerState.of(targets[name])).installed_in(targets[name]))
                lows = mx_linears_from(
                    model,
                    dict.fromkeys(names, low),
                    settings.block_size,
                    settings.quantize_activations,
                    settings.scale_rule,
                    in_step_with=round_names,
                )
            copies = max(len(units), 1)  # no unit: a float pass that keeps the processes in step
            if copies > 1:
                lows = {
                    name: LowInOneCopy(targets[name], lows[name], copy, copies)
                    for copy, unit in enumerate(units)
                    for name in unit
                }
            kls = [0.0] * copies
            with swapped_modules(model, lows):
                for batch, (reference, outputs) in zip(batches, references):
                    logits = _pass_logits(model, head, reference, lowered, device.type)
                    with replaying(replayed, outputs, copies), logits:
                        divergences = _divergences(model, batch.repeat(copies, 1), reference, head, copies, weights)
                    kls = [kl + divergence for kl, divergence in zip(kls, divergences)]
            for unit, kl in zip(units, kls):
                for name in unit:
                    sums[index[name]] = kl / len(unit)
    # each layer's sums from the processes that scanned it, one per sequence group
    sums = sum_across_processes(sums.to(device), world_size).cpu()
    per_token = sums / (input_ids.numel() * split.sequence_groups)
    return dict(zip(targets, per_token.tolist()))


def _positions_read(length: int, share: float) -> int:
    """How many of a sequence's `length` positions the scan reads: `share` of them, rounded up."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"positions={share!r} is not a share of a sequence's positions; allowed: 0 < positions <= 1")
    return math.ceil(length * share)


def position_weights(length: int, power: float) -> torch.Tensor | None:
    """The weights of a sequence's first `length` positions in the scan's mean divergence: `(p + 1) ** power` at
    position `p`, scaled to a mean of 1 (float64, so that the values stay in nats per token); None for `power=0`
    (every position alike).

    The scan reads the first `KL_POSITIONS` of each sequence to estimate its whole mean divergence, and a layer's
    divergence at a position depends on how much context precedes it: the early positions, over-represented in a
    prefix, say less about the rest. On SmolLM2-135M (eight sets of 4 x 128 tokens, the first 64 read), weights
    growing as the square root make the default scan rank the budget's units closer to the original scan's (whole
    sequences, every position alike): Spearman 0.9859-0.9937, 0.9905 on average, against 0.9786-0.9927 and 0.9869
    with every position alike, at no measurable cost; the maps the default recipe made from the same learned offsets
    stayed within the evaluation's noise (`research/sensitivity_signals.md`, "Eight sets of sequences";
    `research/README.md`, "Weighted positions in the scan")."""
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not 0 <= power < math.inf:
        raise ValueError(
            f"position_weighting={power!r} is not a weighting of the positions; allowed: a number >= 0 (0: every "
            "position alike)"
        )
    if power == 0:
        return None
    weights = torch.arange(1, length + 1, dtype=torch.float64) ** power
    return weights / weights.mean()


def scan_units(names: Sequence[str], groups: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """`names` as the scan's units, in the order of their first layers: each of `groups` whole (its members in
    `names`' order), every other layer alone."""
    position = {name: i for i, name in enumerate(names)}
    units = [tuple(sorted(group, key=position.__getitem__)) for group in groups if group]
    grouped = {name for unit in units for name in unit}
    units += [(name,) for name in names if name not in grouped]
    return sorted(units, key=lambda unit: position[unit[0]])


@dataclass(frozen=True)
class ScanSplit:
    """How the processes of a calibration divide the scan's passes.

    The processes form `sequence_groups` groups, each scanning an equal share of the sequences; within a group,
    the layers of each decoder layer (a *stage*: their passes run the same decoder layers) are dealt out to the
    group's `layer_slots` processes in rounds, one layer per process and round. Every process runs a pass in every
    round (a float one when a round has fewer layers than slots) and gathers the weights of all of the round's
    layers in the same order: on a model sharded by FSDP2, whose weights are gathered collectively, every process
    makes the same collective calls.
    """

    sequence_groups: int = 1
    layer_slots: int = 1

    @classmethod
    def choose(cls, world_size: int, sequences: int, stage_sizes: Sequence[int]) -> ScanSplit:
        """The split with the fewest sequence passes per process, among those whose sequence groups divide both the
        processes and the sequences; at equal cost, the most sequence groups (the fewest float passes).
        `stage_sizes`: the number of units each decoder layer's stage scans.

        With the scan's 4 sequences and 7 units per decoder layer (a Llama layer's linears, ungrouped): 2 or 4
        processes share the sequences (14 or 7 sequence passes per decoder layer and process, against 28 for one
        process); 8 share the layers as well (4); 3 deal out the layers (12)."""

        def cost(groups: int) -> int:
            slots = world_size // groups
            return sum(-(-size // slots) for size in stage_sizes) * (sequences // groups)

        candidates = [g for g in range(1, world_size + 1) if world_size % g == 0 and sequences % g == 0]
        groups = min(candidates, key=lambda g: (cost(g), -g))
        return cls(groups, world_size // groups)

    def sequence_group(self, rank: int) -> tuple[int, int]:
        """`(index, count)` of `rank`'s sequence group, as `process_share` takes them."""
        return rank % self.sequence_groups, self.sequence_groups

    def passes(
        self,
        rank: int,
        stages: Sequence[Sequence[tuple[tuple[str, ...], list[nn.Module]]]],
        units_per_pass: int = 1,
        alone: Collection[tuple[str, ...]] = (),
    ) -> list[tuple[tuple[tuple[str, ...], ...], list[str], list[nn.Module]]]:
        """`rank`'s passes, in order: the units it scans in the pass (up to `units_per_pass`, one of `alone`; none:
        a float pass), the names of the layers the processes scan in the same round, and the decoder layers the pass
        replays. A round deals up to `layer_slots * units_per_pass` units of a stage to its processes in turn (the
        stage's units of `alone` last, `layer_slots` to a round)."""
        slot = rank // self.sequence_groups
        passes = []
        for stage in stages:
            sharing = [(unit, replayed) for unit, replayed in stage if unit not in alone]
            single = [(unit, replayed) for unit, replayed in stage if unit in alone]
            for run, per_pass in ((sharing, units_per_pass), (single, 1)):
                per_round = self.layer_slots * per_pass
                for start in range(0, len(run), per_round):
                    units = [unit for unit, _ in run[start : start + per_round]]
                    names = [name for unit in units for name in unit]
                    passes.append((tuple(units[slot :: self.layer_slots]), names, run[start][1]))
        return passes


def _stages(
    units: Sequence[tuple[str, ...]], decoder_layers: dict[str, nn.Module]
) -> list[list[tuple[tuple[str, ...], list[nn.Module]]]]:
    """`units` in order, grouped into runs whose passes replay the same decoder layers (those before every layer of
    the unit), each with them."""
    stages: list[list[tuple[tuple[str, ...], list[nn.Module]]]] = []
    for unit in units:
        replayed = min((_layers_before(name, decoder_layers) for name in unit), key=len)
        if stages and stages[-1][0][1] == replayed:
            stages[-1].append((unit, replayed))
        else:
            stages.append([(unit, replayed)])
    return stages


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware: a CUDA GPU that supports it, or a CPU with AMX
    or AVX-512 BF16 for oneDNN (elsewhere bfloat16 products are emulated, slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return torch.backends.mkldnn.is_available() and (
            torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
        )
    return False


def _lower_matmul_dtype(
    requested: torch.dtype | str, weights_dtype: torch.dtype, device: torch.device
) -> torch.dtype | None:
    """The dtype the scan's products run in for `kl_sensitivities`' `matmul_dtype` (`requested`) when it is lower
    than the weights' (None: the weights' own)."""
    if requested not in MATMUL_DTYPES:
        raise ValueError(
            f"matmul_dtype={requested!r} is not one of {', '.join(map(str, MATMUL_DTYPES))}: the scan's products "
            "run in a lower precision than the model's weights or in theirs"
        )
    if requested == "auto":
        requested = torch.bfloat16 if weights_dtype == torch.float32 and native_bfloat16(device) else weights_dtype
    return requested if torch.finfo(requested).bits < torch.finfo(weights_dtype).bits else None


@dataclass(frozen=True)
class _LayerState:
    """What a target linear computes with: its weight and, for a `TransformedLinear`, its online input transform."""

    weight: torch.Tensor
    transform: nn.Module | None = None

    @classmethod
    def of(cls, linear: nn.Module) -> _LayerState:
        return cls(linear.weight.data, getattr(linear, "input_transform", None))

    @contextmanager
    def installed_in(self, linear: nn.Module) -> Iterator[None]:
        """`linear` holding this state within the block, its own on exit."""
        own = _LayerState.of(linear)
        self._write(linear)
        try:
            yield
        finally:
            own._write(linear)

    def _write(self, linear: nn.Module) -> None:
        linear.weight.data = self.weight
        if self.transform is not None:
            linear.input_transform = self.transform


@contextmanager
def _scan_float_layers(
    targets: Mapping[str, nn.Module], dtype: torch.dtype | None, device: torch.device
) -> Iterator[dict[str, _LayerState]]:
    """Within the block the matrix products on `device` run in `dtype` (`torch.autocast`; nothing changes when it
    is None), and each of `targets` whose weight is resident holds a copy of it made for the float passes, once:

    * cast to `dtype`, instead of at every product (autocast keeps the residual stream, normalisations and softmaxes
      in float32; it would cast every weight at every product, as long as the products themselves on SmolLM2-135M
      with AMX);
    * with its online input transform merged in, for a `TransformedLinear` (`y = (x T) W'^T`): it holds `W' T^T`
      and no transform, the same function (`T` is orthogonal) without the transform's cost in every float layer of
      every pass.

    Yields the state each layer had, by name: a pass puts a layer low from its own weight and transform.
    """
    if dtype is None:
        yield {}
        return
    own = {name: _LayerState.of(module) for name, module in targets.items() if is_resident(module)}
    with ExitStack() as stack:
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
        for name, state in own.items():
            weight = state.weight
            if state.transform is not None:  # `W' T^T`, as the rotation merged `T` (`T^T = T^-1`), in float64
                weight = state.transform.apply(weight, inverse=True)
            scan_state = _LayerState(weight.to(dtype), None if state.transform is None else nn.Identity())
            stack.enter_context(scan_state.installed_in(targets[name]))
        yield own


def _from_hidden_states(references: Sequence[tuple[Any, list[Any]]]) -> bool:
    """Whether the passes' divergences come from final hidden states (vocabulary head references)."""
    return all(isinstance(reference, VocabularyHeadReference) for reference, _ in references)


class _WholeBatchReaders:
    """Within the block, which of `targets` read each batch whole: every call's input has the batch's sequences and
    positions as its leading sizes (`expect` names the batch of the next pass). A pass over copies of the batch can
    put such a linear low in one copy only (`LowInOneCopy`); a mixture of experts' expert reads the tokens routed to
    it instead, in the router's order, and is scanned in passes of its own."""

    def __init__(self, targets: Mapping[str, nn.Module]):
        self.targets = targets
        self.names = set(targets)
        self._batch_sizes: tuple[int, ...] = ()
        self._called: set[str] = set()

    def expect(self, batch: torch.Tensor) -> None:
        self._drop_uncalled()
        self._batch_sizes, self._called = tuple(batch.shape), set()

    def _drop_uncalled(self) -> None:
        if self._batch_sizes:
            self.names &= self._called

    def _read(self, name: str, args: tuple) -> None:
        self._called.add(name)
        x = args[0] if args else None
        if not torch.is_tensor(x) or tuple(x.shape[: len(self._batch_sizes)]) != self._batch_sizes:
            self.names.discard(name)

    def __enter__(self) -> _WholeBatchReaders:
        self._handles = [
            module.register_forward_pre_hook(lambda module, args, name=name: self._read(name, args))
            for name, module in self.targets.items()
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._drop_uncalled()


class LowInOneCopy(nn.Module):
    """A scanned unit's linear in a pass over `copies` copies of the batch (stacked along its first dimension): the
    low-format module `low` on copy `copy`, the float `linear` on the others, so that each copy sees one unit low.

    The float product covers every copy and the low one then replaces its rows: the float layer is one of many in a
    pass, and that is simpler than gathering the other copies' rows."""

    def __init__(self, linear: nn.Module, low: nn.Module, copy: int, copies: int):
        super().__init__()
        self.linear, self.low, self.copy, self.copies = linear, low, copy, copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = slice(self.copy * len(x) // self.copies, (self.copy + 1) * len(x) // self.copies)
        y = self.linear(x)
        y[rows] = self.low(x[rows]).to(y.dtype)
        return y


def _output_head(model: nn.Module, targets: Mapping[str, nn.Module]) -> str | None:
    """The name of `model`'s output embedding when the scan can compute divergences from its input: an
    `nn.Linear` that the scan does not quantize itself."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return None
    name = next(name for name, module in model.named_modules() if module is head)
    return None if name in targets else name


def _divergences(
    model: nn.Module,
    batch: torch.Tensor,
    reference: NextTokenReference | VocabularyHeadReference,
    head: str | None,
    copies: int = 1,
    weights: torch.Tensor | None = None,
) -> list[float]:
    """`sum KL(reference || model)` over the positions of each of the `copies` copies of the reference's sequences
    stacked in `batch`, each position's divergence times its `weights` (`position_weights`; None: 1): from the final
    hidden states for a vocabulary head reference (the output embedding skipped), else from the whole next-token
    distributions."""
    if weights is not None:  # one per position of the flattened (sequence, position) rows of a copy
        weights = weights.to(batch.device).repeat(len(batch) // copies)
    if isinstance(reference, VocabularyHeadReference):
        hidden = _final_hidden_states(model, batch, model.get_submodule(head))
        with torch.autocast(hidden.device.type, enabled=False):  # in float32 but for the reference's own products
            return [reference.kl(copy, weights).item() for copy in hidden.chunk(copies)]
    log_probs = next_token_log_probs(model, batch)
    return [next_token_kl(reference, copy, weights).item() for copy in log_probs.chunk(copies)]


def _final_hidden_states(model: nn.Module, batch: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """The input of `model`'s output embedding `head` for `batch`, which is not run (the model's logits are
    meaningless in this pass)."""
    hidden = []

    def keep(states: torch.Tensor) -> torch.Tensor:
        hidden.append(states)
        return states[..., :1]

    with _forward_replaced(head, keep):
        model(input_ids=batch, use_cache=False)
    return hidden[0]


def next_token_log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """`[batch, seq_len, vocab]` float32 log-probabilities of the next token at every position of `batch`."""
    return F.log_softmax(model(input_ids=batch, use_cache=False).logits.float(), dim=-1)


@dataclass(frozen=True)
class NextTokenReference:
    """Reference next-token distributions (`[batch, seq_len, vocab]`), as log-probabilities and probabilities: the
    KL divergence from them (`next_token_kl`) reads both, and the probabilities cost a pass to recompute.

    `embedding_input` and `embedding_output`: in a scan whose products are lowered, the output embedding's input and
    its float32 output in the reference pass, from which each pass's logits are shifted (`_pass_logits`; the output
    is as large as the log-probabilities); None otherwise."""

    log_probs: torch.Tensor
    probabilities: torch.Tensor
    embedding_input: torch.Tensor | None = None
    embedding_output: torch.Tensor | None = None

    @classmethod
    def from_log_probs(
        cls,
        log_probs: torch.Tensor,
        embedding_input: torch.Tensor | None = None,
        embedding_output: torch.Tensor | None = None,
    ) -> NextTokenReference:
        return cls(log_probs, log_probs.exp(), embedding_input, embedding_output)


def next_token_kl(
    reference: NextTokenReference, log_probs: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """`sum KL(p_reference || p)` over every position (float64), from log-probabilities (`next_token_log_probs`);
    with `weights` (float64, one per position, in the order of the flattened leading dimensions), each position's
    divergence times its weight.

    The element-wise sum `sum p_reference (log p_reference - log p)`: a few positions at a time, the differences
    (a block that stays in cache) and their dot products with the probabilities as one batched matrix product, in
    float32, the positions' sums in float64. The same value as `F.kl_div` (within 1e-4, tested), which exponentiates
    the reference and writes whole-batch temporaries at every call: the scan takes 0.89x its time with it
    (`research/sensitivity_signals.md`).
    """
    vocab = log_probs.shape[-1]
    references, probabilities = reference.log_probs.reshape(-1, vocab), reference.probabilities.reshape(-1, vocab)
    log_probs = log_probs.reshape(-1, vocab)
    rows = max(1, KL_BLOCK_ELEMENTS // vocab)
    total = torch.zeros((), dtype=torch.float64, device=log_probs.device)
    for start in range(0, len(log_probs), rows):
        differences = references[start : start + rows] - log_probs[start : start + rows]
        dots = (probabilities[start : start + rows].unsqueeze(1) @ differences.unsqueeze(2)).double().flatten()
        total += dots.sum() if weights is None else dots @ weights[start : start + rows]
    return total


@contextmanager
def replaying(layers: Sequence[nn.Module], outputs: Sequence[Any], copies: int = 1) -> Iterator[None]:
    """Within the block, each of `layers` returns its recorded output instead of computing it, repeated `copies`
    times along the batch (a pass over that many copies of the recorded batch).

    A forward that something else installed on the instance (accelerate's offload hooks) comes back on exit.
    """
    with ExitStack() as stack:
        for layer, output in zip(layers, outputs):
            stack.enter_context(_returning(layer, output, copies))
        yield


@contextmanager
def _returning(layer: nn.Module, output: Any, copies: int) -> Iterator[None]:
    def repeated(*args: Any, **kwargs: Any) -> Any:  # at the call: a copy lives until the next layer has read it
        return tree_map(lambda x: x.repeat(copies, *[1] * (x.dim() - 1)) if _batched(x) else x, output)

    with _forward_replaced(layer, repeated if copies > 1 else lambda *args, **kwargs: output):
        yield


def _batched(x: Any) -> bool:
    return torch.is_tensor(x) and x.dim() > 0


@contextmanager
def _forward_replaced(layer: nn.Module, forward: Any) -> Iterator[None]:
    """`layer` runs `forward` instead of its own within the block; an instance forward comes back on exit."""
    own_forward = layer.__dict__.get("forward")
    layer.forward = forward
    try:
        yield
    finally:
        if own_forward is None:
            del layer.forward
        else:
            layer.forward = own_forward


def _layers_before(name: str, decoder_layers: dict[str, nn.Module]) -> list[nn.Module]:
    """The decoder layers that run before the one holding module `name` (all that precede it in the model)."""
    before = []
    for layer_name, layer in decoder_layers.items():
        if name.startswith(layer_name + "."):
            return before
        before.append(layer)
    return []  # outside every decoder layer: nothing is known to run before it


def _record(
    model: nn.Module,
    batch: torch.Tensor,
    layers: Sequence[nn.Module],
    head: str | None,
    head_tokens: int | None,
    lowered: torch.dtype | None = None,
    device_type: str = "cpu",
) -> tuple[NextTokenReference | VocabularyHeadReference, list[Any]]:
    """The float next-token distributions of `batch` and the output of each of `layers`.

    With an output embedding `head`, whose output the model returns unchanged as its logits, and `head_tokens`, the
    distributions are kept as a vocabulary head reference, whose divergences multiply in `lowered` (float32 when
    None); else (no head, logits soft-capped or scaled after it, or `head_tokens` None) whole. Under `lowered`
    products (autocast on `device_type`) the output embedding multiplies in its weights' dtype, and a whole reference
    keeps its input and output for the passes (`_pass_logits`).
    """
    outputs: list[Any] = [None] * len(layers)
    head_io: list[torch.Tensor] = []

    def keep(index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs[index] = output

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    if head is not None:
        handles.append(
            model.get_submodule(head).register_forward_hook(
                lambda module, args, output: head_io.extend([*args[:1], output])
            )
        )
    unlowered = lowered is not None and head is not None
    try:
        with _autocast_paused(model.get_submodule(head), device_type) if unlowered else nullcontext():
            logits = model(input_ids=batch, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    one_call = len(head_io) == 2
    if head_tokens is not None and one_call and torch.equal(logits, head_io[1].to(logits.device)):
        with loaded_weights(model, head) as output_embedding, torch.autocast(logits.device.type, enabled=False):
            reference = VocabularyHeadReference.from_hidden(
                head_io[0], output_embedding.weight, output_embedding.bias, head_tokens, lowered or torch.float32
            )
        return reference, outputs
    log_probs = F.log_softmax(logits.float(), dim=-1)
    if unlowered and one_call:
        return NextTokenReference.from_log_probs(log_probs, head_io[0], head_io[1].float()), outputs
    return NextTokenReference.from_log_probs(log_probs), outputs


@contextmanager
def _pass_logits(
    model: nn.Module,
    head: str | None,
    reference: NextTokenReference | VocabularyHeadReference,
    lowered: torch.dtype | None,
    device_type: str,
) -> Iterator[None]:
    """Within the block, a pass's logits in a scan of whole distributions whose products are `lowered`: the
    reference's float32 logits plus the lowered product of the shift of the output embedding `head`'s input
    (`W h' = W h + W (h' - h)`), as the divergences on the vocabulary's head multiply `dz = W dh`
    (`calibration.vocabulary_head`); for an embedding with a bias, or a reference without its input, the embedding's
    whole product in its weights' dtype. Nothing changes without lowered products, or for divergences from final
    hidden states (a vocabulary head reference: the embedding does not run).

    Rounded to bfloat16 whole, the embedding's outputs, of magnitude 10 to 30 for a trained model's logits, are off by
    up to 1/16, rounded independently in the reference and in every pass: a floor of the order of 1e-3 nats per token
    under every divergence, which put the smallest unit's value in SmolLM2-135M's whole-vocabulary scan at 2.9x the
    float32 scan's (1.3x at most with the shift; `research/README.md`, "The scan's divergences")."""
    if lowered is None or head is None or isinstance(reference, VocabularyHeadReference):
        yield
        return
    embedding = model.get_submodule(head)
    if reference.embedding_input is None or embedding.bias is not None:
        with _autocast_paused(embedding, device_type):
            yield
        return

    def shift(module: nn.Module, args: tuple) -> tuple:
        return (args[0] - reference.embedding_input.to(args[0].device), *args[1:])

    def add_reference(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return reference.embedding_output.to(output.device) + output.float()

    handles = [embedding.register_forward_pre_hook(shift), embedding.register_forward_hook(add_reference)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _autocast_paused(module: nn.Module, device_type: str) -> Iterator[None]:
    """Within the block, `torch.autocast` on `device_type` is paused while `module` runs: its products in its own
    weights' dtype. Hooks, so that an accelerate or FSDP2 module still loads its weights its own way; the resuming one
    runs before the module's other forward hooks, so that a pause another hook made around this one ends after it."""
    paused: list[bool] = []

    def pause(module: nn.Module, args: tuple) -> None:
        paused.append(torch.is_autocast_enabled(device_type))
        torch.set_autocast_enabled(device_type, False)

    def resume(module: nn.Module, args: tuple, output: Any) -> None:
        torch.set_autocast_enabled(device_type, paused.pop())

    handles = [module.register_forward_pre_hook(pause), module.register_forward_hook(resume, prepend=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while paused:  # a forward that raised
            torch.set_autocast_enabled(device_type, paused.pop())
