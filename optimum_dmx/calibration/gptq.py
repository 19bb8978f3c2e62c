"""GPTQ rounding of MX weights: each weight rounded in its own MX format with second-order error feedback.

Round-to-nearest rounds every weight of a layer independently. GPTQ (Frantar et al., 2023) rounds the columns of
a weight (its input features) one after another and spreads each column's rounding error over the columns not yet
rounded, weighted by the inverse Hessian of the layer's squared output error, ``H = X^T X / n`` over the
calibration tokens' inputs ``X``; the layer's output on those inputs moves much less than with independent
rounding. The columns go in activation order, as llm-compressor's GPTQ takes them by default: the inputs with the
most energy (largest ``H_jj``) first, while the most columns remain to absorb their errors. In an MX format the
columns come in blocks of 32 that share one E8M0 scale; in activation order a block's columns are rounded at
scattered turns, so every block's scale is fixed before the loop, from the float weights, by the same rule as
round-to-nearest's scales (``scale_rule``). On inputs of unequal energy that halves a layer's output error against
the columns' own order (tested). On SmolLM2-135M it lowered the served uniform MXFP4 model's held-out perplexity by
0.7-2.6% unrotated and 0.4-2.1% with the default online rotation (two seeds), and moved the default configuration's
mixed maps by -1.1% to +0.6%, within the evaluation's noise (`research/README.md`, "GPTQ's column order").
`activation_order=False` rounds the columns in their own order, each block's scale from its weights as the earlier
columns' errors left them (this package's GPTQ before). The result is ordinary MX codes and scales, stored as they
are (``formats.packing.pack_blocks``): saving, loading and export read them like any other.

`round_weights_by_gptq` rounds a quantized model decoder layer by decoder layer, as sequential GPTQ does: each
layer's Hessians come from inputs computed by the layers before it already rounded, and quantized in the layer's
own format, as the served model quantizes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..formats.blocks import block_scale, pow2, to_blocks
from ..formats.cast import block_exponents
from ..formats.packing import ElementGrid, MXPackedTensor, pack_blocks
from ..formats.spec import SCALE_EXPONENT_MAX, MXFormat
from ..nn.mx_linear import MXLinear
from ..nn.placement import input_device, loaded_weights
from .checkpointing import decoder_layers as find_decoder_layers
from .sensitivity import replaying

GPTQ_DAMPING = 0.01  # of the Hessian's mean diagonal, added to its diagonal (GPTQ's default)
COLUMNS_PER_UPDATE = 128  # columns rounded between two updates of the remaining columns (GPTQ's lazy batch)
# Calibration tokens GPTQ reads at most (its first sequences): twice GPTQ's usual 128 x 2048. It keeps one hidden
# state per sequence, so this bounds that memory (4 GiB for a 4096-wide bfloat16 model) at any preset.
GPTQ_MAX_TOKENS = 2**19


class SingularHessianError(ValueError):
    """The dampened Hessian of a layer has no Cholesky factor: its inputs are degenerate."""


@dataclass(frozen=True)
class InverseHessian:
    """What GPTQ needs of a layer's Hessian: the order its columns are rounded in, the upper Cholesky factor of its
    dampened inverse in that order, padded to whole MX blocks, and the input features never active (zero diagonal).
    Linears that read the same input (q/k/v, gate/up) share one, computed once."""

    factor: torch.Tensor
    dead: torch.Tensor
    order: torch.Tensor | None = None  # the columns by rounding turn (activation order); None: their own order

    @classmethod
    def of(
        cls,
        hessian: torch.Tensor,
        block_size: int = 32,
        damping: float = GPTQ_DAMPING,
        activation_order: bool = True,
    ) -> InverseHessian:
        """With `activation_order`, the columns are rounded in descending order of the Hessian's diagonal (the
        inputs with the most energy first, the inputs never active last). Raises `SingularHessianError` when the
        dampened Hessian is not positive definite."""
        in_features = hessian.shape[0]
        padded = -(-in_features // block_size) * block_size
        h = torch.zeros(padded, padded, dtype=torch.float32, device=hessian.device)
        h[:in_features, :in_features] = hessian.float()
        dead = h.diagonal() == 0
        order = torch.argsort(h.diagonal(), descending=True, stable=True) if activation_order else None
        h[dead, dead] = 1.0
        h.diagonal().add_(damping * h.diagonal().mean())
        if order is not None:
            h = h[order][:, order]
        factor, info = torch.linalg.cholesky_ex(h)
        if info.item() == 0:
            factor, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(factor), upper=True)
        if info.item() != 0:
            raise SingularHessianError("the dampened Hessian is not positive definite")
        return cls(factor, dead, order)


def gptq_pack(
    weight: torch.Tensor,
    hessian: torch.Tensor | InverseHessian,
    fmt: MXFormat,
    block_size: int = 32,
    scale_rule: str = "ocp",
    damping: float = GPTQ_DAMPING,
    activation_order: bool = True,
) -> MXPackedTensor:
    """``weight`` (``[out, in]``) rounded to ``fmt`` by GPTQ with ``hessian`` (``[in, in]``, or its
    `InverseHessian` for ``block_size``, which ``damping`` and ``activation_order`` then do not change), in storage
    form.

    Input features whose Hessian diagonal is zero (never active on the calibration data) get weight zero, as in
    GPTQ. Raises `SingularHessianError` when the dampened Hessian is not positive definite.
    """
    if not isinstance(hessian, InverseHessian):
        hessian = InverseHessian.of(hessian, block_size, damping, activation_order)
    out_features = weight.shape[0]
    rows = to_blocks(weight.detach(), block_size).reshape(out_features, -1)  # float32, zero-padded
    if hessian.factor.shape[0] != rows.shape[1]:
        raise ValueError(
            f"the inverse Hessian covers {hessian.factor.shape[0]} input features, the weight {weight.shape[1]} "
            f"padded to blocks of {block_size}: {rows.shape[1]}"
        )
    elements, exponents = _round_columns(rows, hessian, fmt, block_size, scale_rule)
    return pack_blocks(elements.view(out_features, -1, block_size), exponents.unsqueeze(-1), fmt, weight.shape)


def _round_columns(
    rows: torch.Tensor, hessian: InverseHessian, fmt: MXFormat, block_size: int, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's column loop on ``rows`` (``[out, in]``, left unchanged): the elements (in units of their block's
    ``2^k``) and the blocks' exponents ``k``; the columns of inputs never active start at zero.

    In the columns' own order a block's scale is fixed when its first column is reached, from the block's weights as
    the earlier columns' errors left them. In activation order (`hessian.order`) a block's columns are rounded at
    scattered turns, so every block's scale comes from the float weights before any rounding, as llm-compressor's
    GPTQ takes them.

    The loop works on a transposed copy, so that each column it rounds and updates is contiguous, and rounds by
    table lookup (`ElementGrid`): a dozen small operations per column, the loop's whole cost at these sizes."""
    inverse_factor = hessian.factor  # upper Cholesky factor of the dampened inverse Hessian, in rounding order
    columns = rows.T.contiguous()  # [in, out]: column i is columns[i]
    columns[hessian.dead] = 0.0
    width, out_features = columns.shape
    elements = torch.empty_like(columns)
    exponents = torch.empty(width // block_size, out_features, dtype=torch.int32, device=rows.device)
    order = hessian.order
    if order is not None:  # static scales, then the columns in rounding order: turn i rounds column order[i]
        exponents.copy_(block_exponents(columns.T.reshape(out_features, -1, block_size), fmt, scale_rule)[..., 0].T)
        block_scales = list(zip(block_scale(exponents).unbind(0), pow2(-exponents.clamp(max=SCALE_EXPONENT_MAX - 1))))
        turn_scales = [block_scales[block] for block in (order // block_size).tolist()]
        columns = columns[order]
    grid = ElementGrid.of(fmt, rows.device)
    step = max(block_size, COLUMNS_PER_UPDATE // block_size * block_size)
    for start in range(0, width, step):
        end = min(start + step, width)
        chunk = columns[start:end]  # a view: updates within the chunk land in `columns`
        errors = torch.empty_like(chunk)
        u = inverse_factor[start:end, start:end]
        # Views taken once per chunk: indexing a tensor costs about as much as one of the loop's small operations.
        chunk_columns, error_columns = chunk.unbind(0), errors.unbind(0)
        element_columns = elements[start:end].unbind(0)
        u_columns, u_diagonal = u.unsqueeze(-1), u.diagonal().tolist()  # u_columns[i, i:]: u[i, i:] as a column
        for i, column in enumerate(chunk_columns):
            if order is not None:
                scale, inverse_scale = turn_scales[start + i]
            elif (start + i) % block_size == 0:
                k = block_exponents(chunk[i : i + block_size].T.unsqueeze(1), fmt, scale_rule).view(-1)
                exponents[(start + i) // block_size] = k
                scale, inverse_scale = block_scale(k), pow2(-k.clamp(max=SCALE_EXPONENT_MAX - 1))
            element = grid.round(column * inverse_scale)
            element_columns[i].copy_(element)
            error = torch.sub(column, element * scale, out=error_columns[i]).div_(u_diagonal[i])
            chunk[i:].sub_(u_columns[i, i:] * error)  # not addr_: its fused multiply-add rounds once
        columns[end:].sub_(inverse_factor[start:end, end:].T @ errors)
    if order is not None:
        elements = torch.empty_like(elements).index_copy_(0, order, elements)
    return elements.T.contiguous(), exponents.T.contiguous()


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the layers of interest have run."""


@torch.no_grad()
def round_weights_by_gptq(
    model: nn.Module,
    float_linears: Mapping[str, nn.Linear],
    input_ids: torch.LongTensor,
    batch_size: int,
    damping: float = GPTQ_DAMPING,
    progress: bool = True,
    activation_order: bool = True,
) -> list[str]:
    """Re-round, in place, the weights of the `MXLinear`s named in `float_linears` by GPTQ from the float weights
    of those linears (the modules the `MXLinear`s replaced; an offloaded weight is loaded when its turn comes).

    `model` holds the `MXLinear`s (round-to-nearest weights, as `replace_with_mx_linear` or `emulate_format_map`
    left them). Decoder layer by decoder layer, one pass over `input_ids` (in batches of `batch_size`) gathers the
    Hessians of the layer's linears from their quantized inputs, their weights are rounded, and a second pass
    records the rounded layer's output, which the next layer's passes start from (the decoder layers before a
    layer are replayed, not recomputed). The linears of one decoder layer are rounded together, from inputs that
    the layer's round-to-nearest weights computed. Linears outside every decoder layer are rounded last, from whole
    passes.

    At most `GPTQ_MAX_TOKENS` tokens are read: the first sequences of `input_ids` that fit. `activation_order`: each
    weight's columns are rounded in descending order of their inputs' energy, every block's scale from the float
    weights (`InverseHessian.of`, `_round_columns`); `False` rounds them in their own order, each block's scale from
    its weights as the earlier columns' errors left them (this package's GPTQ before it).

    Returns the names of the layers whose Hessian was singular, or that no calibration token reached: they keep
    round-to-nearest (one warning names them).
    """
    modules = {name: model.get_submodule(name) for name in float_linears}
    for name, module in modules.items():
        if not isinstance(module, MXLinear):
            raise TypeError(f"GPTQ rounds MXLinear modules; {name!r} is a {type(module).__name__}")
    decoder_layers = find_decoder_layers(model)
    groups = _groups(list(modules), decoder_layers)
    device = input_device(model)
    input_ids = input_ids[: max(1, GPTQ_MAX_TOKENS // input_ids.shape[1])]
    batches = [b.to(device) for b in input_ids.split(batch_size)]
    recorded: list[Any] = [None] * len(batches)  # each batch's output of the last decoder layer rounded so far
    done: list[nn.Module] = []
    singular = []
    for layer_name, names in tqdm(groups, desc="GPTQ", disable=not progress):
        layer = decoder_layers.get(layer_name)
        hessians = _hessians(model, {n: modules[n] for n in names}, batches, done, recorded, layer)
        inverses: dict[tuple[int, int], InverseHessian | None] = {}  # by (Hessian, block size): shared inputs once
        for name in names:
            module = modules[name]
            if name not in hessians:  # never called on the calibration data
                singular.append(name)
                continue
            key = (id(hessians[name]), module.block_size)
            if key not in inverses:
                try:
                    inverses[key] = InverseHessian.of(hessians[name], module.block_size, damping, activation_order)
                except SingularHessianError:
                    inverses[key] = None
            if inverses[key] is None:
                singular.append(name)
                continue
            with loaded_weights(float_linears[name]) as linear:
                weight = linear.weight.to(hessians[name].device)
            packed = gptq_pack(weight, inverses[key], module.fmt, module.block_size, module.scale_rule)
            module.weight_packed.copy_(packed.codes)
            module.weight_scale.copy_(packed.scales)
        if layer is not None and hessians:  # a layer none of whose linears ran (a vision encoder's): not replayed
            recorded = [_output_of(model, layer, batch, done, out) for batch, out in zip(batches, recorded)]
            done.append(layer)
    if singular:
        warnings.warn(
            f"optimum-dmx: GPTQ kept round-to-nearest for {len(singular)} layer(s) that the calibration data never "
            f"reached or whose inputs give a singular Hessian even after dampening: {', '.join(singular)}",
            RuntimeWarning,
            stacklevel=2,
        )
    return singular


def _groups(names: list[str], decoder_layers: dict[str, nn.Module]) -> list[tuple[str | None, list[str]]]:
    """The linears by decoder layer, in model order, then those outside every decoder layer (layer `None`)."""
    groups: dict[str | None, list[str]] = {layer_name: [] for layer_name in decoder_layers}
    groups[None] = []
    for name in names:
        owner = next((layer_name for layer_name in decoder_layers if name.startswith(layer_name + ".")), None)
        groups[owner].append(name)
    return [(layer_name, members) for layer_name, members in groups.items() if members]


def _hessians(
    model: nn.Module,
    modules: dict[str, MXLinear],
    batches: list[torch.Tensor],
    replayed: list[nn.Module],
    recorded: list[Any],
    layer: nn.Module | None,
) -> dict[str, torch.Tensor]:
    """``X^T X / n`` of each module's matmul input (transformed and quantized as its forward does) over
    `batches`; the pass ends once every module has been reached (before the last one's matmul: a module called
    twice in one pass counts its first call), or after `layer` (the whole model when it is `None`).

    Modules that read the same input tensor and transform and quantize it alike (q/k/v, gate/up in one format)
    get the same matrix, computed and stored once. A module the pass never reached has none."""
    sums: dict[str, torch.Tensor] = {}  # by the name of the first module whose input it sums
    counts: dict[str, int] = {}
    owners: dict[str, str] = {}  # module name -> the name its Hessian is summed under
    inputs: list[tuple[torch.Tensor, tuple, str]] = []  # the current batch's inputs: (tensor, how read, owner)
    reached: set[str] = set()  # the modules the current batch's pass has reached

    def gather(name: str):
        def hook(module: MXLinear, args: tuple) -> None:
            x = args[0]
            how = module.matmul_input_key
            owner = next((o for seen, h, o in inputs if seen is x and h == how), name)
            if owners.setdefault(name, owner) != owner:
                raise RuntimeError(f"GPTQ: {name!r} shared its input differently from one batch to the next")
            if owner == name:
                inputs.append((x, how, name))  # kept alive until the batch ends, so `is` cannot meet a reused id
                accumulate(module, x, name)
            reached.add(name)
            if len(reached) == len(modules):
                raise _Stop  # every input gathered: the rest of the pass, this module's matmul included, is unused

        return hook

    def accumulate(module: MXLinear, x: torch.Tensor, name: str) -> None:
        x = module.matmul_input(x).reshape(-1, x.shape[-1]).float()
        if name not in sums:
            sums[name] = torch.zeros(x.shape[-1], x.shape[-1], device=x.device)
            counts[name] = 0
        sums[name].addmm_(x.T, x)
        counts[name] += x.shape[0]

    handles = [module.register_forward_pre_hook(gather(name)) for name, module in modules.items()]
    try:
        for batch, output in zip(batches, recorded):
            _run(model, batch, replayed, output, layer)
            inputs.clear()
            reached.clear()
    finally:
        for handle in handles:
            handle.remove()
    means = {owner: sums[owner] / counts[owner] for owner in sums}
    return {name: means[owner] for name, owner in owners.items()}  # shared inputs: one tensor


def _output_of(model: nn.Module, layer: nn.Module, batch: torch.Tensor, replayed: list[nn.Module], output: Any) -> Any:
    """`layer`'s output on `batch`, the decoder layers before it replayed."""
    kept: list[Any] = []
    handle = layer.register_forward_hook(lambda module, args, out: kept.append(out))
    try:
        _run(model, batch, replayed, output, layer)
    finally:
        handle.remove()
    return kept[0]


def _run(model: nn.Module, batch: torch.Tensor, replayed: list[nn.Module], output: Any, stop: nn.Module | None) -> None:
    """A forward pass of `batch` in which the `replayed` layers return `output` and which ends after `stop`."""

    def end(module: nn.Module, args: Any, out: Any) -> None:
        raise _Stop

    handle = stop.register_forward_hook(end) if stop is not None else None
    try:
        with replaying(replayed, [output] * len(replayed)):
            model(input_ids=batch, use_cache=False)
    except _Stop:
        pass
    finally:
        if handle is not None:
            handle.remove()
