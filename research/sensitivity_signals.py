#!/usr/bin/env python
"""Sensitivity signals: the KL scan behind the default recipe against cheaper estimates of it, in time and ranking.

The default recipe blends its learned offsets with KL sensitivities: per layer, KL(float || only this layer in the
pair's low format), one pass per layer (`calibration.sensitivity`). That scan is the larger part of a default run on
a CPU. Can a cheaper signal rank the layers the same way? Rows, each against the scan on `KL_SAMPLES` sequences over
the whole vocabulary (`head_tokens=None`):

* `kl, element-wise`: the same scan with each pass's KL divergence computed by `F.kl_div`, as it was before
  `calibration.sensitivity.next_token_kl` took it as one dot product per position: the time that saves, and that
  the values stay the same;
* `kl`: the same scan on fewer sequences;
* `kl, head K`: the scan as the library runs it, each divergence computed from the final hidden states, exactly on
  the `K` most probable tokens and to second order on the rest (`calibration.vocabulary_head`);
* `kl, head K, fused groups`: the same with the servable default's `offset_groups="fused"`, each group (q/k/v,
  gate/up) low whole in one pass; compared per unit of the grouped budget (a group, or a layer alone) against the
  reference's values summed over each unit's members, which is how the budget valued a group before;
* `..., bfloat16`: the same scan with its matrix products in bfloat16 (`--bfloat16`; what the library's
  `matmul_dtype="auto"` picks for a float32 model where the device multiplies bfloat16 natively), also ranked
  against the same scan in float32 (the column `vs float32`); every other row is float32;
* `fisher`: a second-order estimate from one forward pass and `S` backward passes, every layer at once. A layer's
  low-format quantization moves its output by `delta` (computed in the forward pass); with `g_s` the gradient of the
  log-likelihood of tokens sampled from the model's own next-token distributions with respect to that output,
  `KL ~ 1/2 E_s[(g_s . delta)^2]` (the Fisher information's quadratic form). `token` sums the products per token
  (ignoring how one token's perturbation moves another's log-probability: lower variance), `sequence` per
  sequence (exact in expectation, noisier).

Every scan of that table reads its sequences whole (`positions=1.0`). With `--positions SHARES`, a second table
puts the library's default scan (fused groups, the vocabulary's head, bfloat16 products where the device multiplies
them natively), which reads the first half of each sequence (`KL_POSITIONS`), against the same scan of whole
sequences: its time and its ranking of the budget's units, for each share of the positions read (`--positions-only`
runs that table alone).

With `--default-scan`, a table of the library's default scan (`kl_sensitivities` as calibration calls it: fused
groups, the vocabulary's head, bfloat16 products where native, the first half of each sequence with its later
positions weighing more, units sharing passes; all of the changes above at once) against the original scan (the
reference: layer by layer, float32, whole sequences and vocabulary, every position alike), on `--scan-sets` (2) sets
of `KL_SAMPLES` sequences: the ranking of the budget's units on the same tokens (also with every position of the
half weighed alike, the default before, and reading 9/16 of each sequence) and on the next set's, which is how far
the reference itself moves with its tokens (`--default-scan-only` runs that table alone).

With `--passes`, a table of what the library's default scan costs against the scan before its units shared passes
and before its vocabulary head multiplied in bfloat16 (each change alone, and both undone), and against the scan
of whole sequences: seconds (the least of two runs of each, the scans alternating) and ranking of the budget's
units. `--rotation` rotates the model first, as calibration does (`online_block_hadamard`: the CLI's default on
SmolLM2-135M); `--passes-only` runs that table alone.

    python research/sensitivity_signals.py --output research/sensitivity_signals.md

Pass `--model` and `--calibration` for any other model and texts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from optimum_dmx.calibration import CalibrationSettings, sensitivity
from optimum_dmx.calibration.groups import offset_groups
from optimum_dmx.calibration.sensitivity import (
    HEAD_TOKENS,
    KL_POSITION_WEIGHTING,
    KL_POSITIONS,
    KL_SAMPLES,
    KL_UNITS_PER_PASS,
    kl_sensitivities,
    scan_units,
)
from optimum_dmx.calibration.vocabulary_head import VocabularyHeadReference
from optimum_dmx.continuous import get_format_pair
from optimum_dmx.formats import quantize_mx
from optimum_dmx.nn.rotation import ROTATIONS, rotate_model
from optimum_dmx.nn.surgery import linear_modules_to_quantize

from common import calibration_benchmark_parser, device_description, load_model_and_calibration, write_report


def fisher_sensitivities(
    model: nn.Module, input_ids: torch.Tensor, settings: CalibrationSettings, samples: int, seed: int = 0
) -> tuple[dict[str, float], dict[str, float]]:
    """Per-layer `1/2 E_s[(g_s . delta)^2]` per token, summed per token and per sequence (see the module docstring)."""
    low = get_format_pair(settings.format_pair).low.name
    targets = linear_modules_to_quantize(model, settings.modules_to_not_convert)
    per_token = dict.fromkeys(targets, 0.0)
    per_sequence = dict.fromkeys(targets, 0.0)
    generator = torch.Generator().manual_seed(seed)
    for batch in input_ids.split(settings.batch_size):
        deltas: dict[str, torch.Tensor] = {}
        outputs: dict[str, torch.Tensor] = {}

        def record(name: str):
            def hook(module: nn.Linear, args: tuple, output: torch.Tensor) -> None:
                with torch.no_grad():
                    weight = quantize_mx(module.weight, low, settings.block_size, settings.scale_rule)
                    x = quantize_mx(args[0], low, settings.block_size, settings.scale_rule)
                    deltas[name] = F.linear(x, weight, module.bias) - output
                output.retain_grad()
                outputs[name] = output

            return hook

        handles = [module.register_forward_hook(record(name)) for name, module in targets.items()]
        try:  # gradients reach the layers' outputs through the embeddings; no weight gradient is computed
            embeddings = model.get_input_embeddings()(batch).detach().requires_grad_(True)
            log_probs = model(inputs_embeds=embeddings, use_cache=False).logits.float().log_softmax(-1)
        finally:
            for handle in handles:
                handle.remove()
        probabilities = log_probs.detach().exp().flatten(0, 1)
        for s in range(samples):
            tokens = torch.multinomial(probabilities, 1, generator=generator).view(log_probs.shape[:-1])
            for output in outputs.values():
                output.grad = None
            log_probs.gather(-1, tokens[..., None]).sum().backward(retain_graph=s < samples - 1)
            for name, output in outputs.items():
                products = (output.grad * deltas[name]).sum(-1)  # [sequences, tokens]
                per_token[name] += float(products.square().sum()) / samples
                per_sequence[name] += float(products.sum(-1).square().sum()) / samples
    count = input_ids.numel()
    return {n: v / (2 * count) for n, v in per_token.items()}, {n: v / (2 * count) for n, v in per_sequence.items()}


@contextmanager
def elementwise_kl() -> Iterator[None]:
    """Within the block, the scan sums each pass's KL divergence element by element, with `F.kl_div`."""
    own = sensitivity.next_token_kl

    def kl_div(
        reference: sensitivity.NextTokenReference, log_probs: torch.Tensor, weights: None = None
    ) -> torch.Tensor:
        assert weights is None, "the element-wise KL sums every position alike"
        return F.kl_div(log_probs, reference.log_probs, log_target=True, reduction="sum")

    sensitivity.next_token_kl = kl_div
    try:
        yield
    finally:
        sensitivity.next_token_kl = own


@contextmanager
def float32_head() -> Iterator[None]:
    """Within the block, the scan's divergences multiply by the vocabulary head's rows in float32 (as before they
    took the dtype of the scan's other products)."""
    own, bound = VocabularyHeadReference.__dict__["from_hidden"], VocabularyHeadReference.from_hidden
    VocabularyHeadReference.from_hidden = staticmethod(
        lambda hidden, weight, bias, head_tokens, product_dtype=None: bound(hidden, weight, bias, head_tokens)
    )
    try:
        yield
    finally:
        VocabularyHeadReference.from_hidden = own


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two sequences without ties."""
    ranks = [torch.tensor(v).argsort().argsort().double() for v in (a, b)]
    ra, rb = (r - r.mean() for r in ranks)
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main() -> None:
    p = calibration_benchmark_parser(__doc__)
    p.add_argument("--pair", default="mxfp8-mxfp4")
    p.add_argument("--kl-sequences", default="1,2", help="comma list: sequences of the cheaper KL scans")
    p.add_argument("--head-tokens", default="2048,8192", help="comma list: vocabulary heads of the library's scan")
    p.add_argument("--kl-only", action="store_true", help="only the KL scans (no Fisher estimates)")
    p.add_argument("--skip-elementwise", action="store_true", help="no `kl, element-wise` row")
    p.add_argument("--fused-groups", action="store_true", help="a row for the scan of fused groups, unit by unit")
    p.add_argument("--bfloat16", action="store_true", help="the library's scans again with bfloat16 products")
    p.add_argument("--positions", default="", help="comma list of shares of the positions read: a table each")
    p.add_argument("--positions-only", action="store_true", help="only the table of `--positions`")
    p.add_argument("--default-scan", action="store_true", help="the table of the library's default scan")
    p.add_argument("--default-scan-only", action="store_true", help="only the table of `--default-scan`")
    p.add_argument("--scan-sets", type=int, default=2, help="sets of sequences of `--default-scan`'s table")
    p.add_argument("--passes", action="store_true", help="the table of the default scan's passes")
    p.add_argument("--passes-only", action="store_true", help="only the table of `--passes`")
    p.add_argument("--rotation", default="none", choices=ROTATIONS, help="rotate the model first")
    p.add_argument(
        "--fisher", default="4:1,4:4,4:16,16:1,16:4", help="comma list of SEQUENCES:SAMPLES of the Fisher estimates"
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    fisher_runs = [] if a.kl_only else [tuple(map(int, run.split(":"))) for run in a.fisher.split(",")]
    sets = a.scan_sets if a.default_scan or a.default_scan_only else 1
    count = max([KL_SAMPLES * sets, *(n for n, _ in fisher_runs)])
    model, model_dir, ids = load_model_and_calibration(a.model, a.calibration, a.seq_len, count)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    batch_size = int(a.batch_sizes.split(",")[-1])
    settings = CalibrationSettings(
        target_bits=5.0, format_pair=a.pair, num_samples=count, seq_len=a.seq_len, batch_size=batch_size
    )
    rotate_model(model, a.rotation, list(linear_modules_to_quantize(model, settings.modules_to_not_convert)))
    if a.passes_only:
        write_report(passes_table(model, ids, settings, a.rotation), a.output, "Sensitivity signals")
        return

    if a.default_scan_only:
        write_report(default_scan_table(model, ids, settings, a.rotation, sets), a.output, "Sensitivity signals")
        return
    shares = [float(share) for share in a.positions.split(",") if share]
    if a.positions_only:
        write_report(positions_table(model, ids, settings, shares), a.output, "Sensitivity signals")
        return
    float32 = dict(progress=False, matmul_dtype=torch.float32, positions=1.0)
    start = time.perf_counter()
    reference = kl_sensitivities(model, ids, settings, head_tokens=None, **float32)
    reference_seconds = time.perf_counter() - start
    names = list(reference)

    def row(
        signal: str,
        sequences: int,
        samples: str,
        seconds: float,
        values: dict[str, float],
        units: list[tuple[str, ...]] | None = None,
        in_float32: dict[str, float] | None = None,
    ) -> str:
        """The table's row for `values`, compared layer by layer or, with `units`, by their members' sums; with
        `in_float32`, also ranked against those values of the same scan in float32."""
        units = units or [(name,) for name in names]
        measured, wanted = ([sum(v[n] for n in unit) for unit in units] for v in (values, reference))
        ratio = statistics.median(m / w for m, w in zip(measured, wanted) if w > 0)
        same = "-"
        if in_float32 is not None:
            same = f"{spearman([sum(in_float32[n] for n in unit) for unit in units], measured):.4f}"
        return (
            f"| {signal} | {sequences} | {samples} | {seconds:.1f} | {seconds / reference_seconds:.1%} | "
            f"{spearman(wanted, measured):.4f} | {ratio:.3f} | {same} |"
        )

    lines = [
        f"Model `{model_dir.name}`, {len(names)} layers, pair {a.pair}, sequences of {a.seq_len} tokens in batches of "
        f"{batch_size}, {device_description('cpu')}, torch {torch.__version__}. Reference: the KL scan on "
        f"{KL_SAMPLES} sequences, {reference_seconds:.1f} s.",
        "",
        "| signal | sequences | samples | seconds | / KL scan | Spearman vs KL scan | median ratio to KL "
        "| vs float32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    heads = [int(n) for n in a.head_tokens.split(",") if n]
    library_scans = [(f"kl, head {n}", settings, n, None) for n in heads]  # signal, settings, head, units
    if a.fused_groups:
        units = scan_units(names, offset_groups("fused", names))
        grouped = dataclasses.replace(settings, offset_groups="fused")
        library_scans.append((f"kl, head {HEAD_TOKENS}, fused groups", grouped, HEAD_TOKENS, units))
    in_float32 = {}
    for dtype in [torch.float32, torch.bfloat16] if a.bfloat16 else [torch.float32]:
        for signal, scan_settings, head_tokens, units in library_scans:
            start = time.perf_counter()
            values = kl_sensitivities(
                model,
                ids,
                scan_settings,
                progress=False,
                head_tokens=head_tokens,
                matmul_dtype=dtype,
                positions=1.0,
            )
            seconds = time.perf_counter() - start
            if dtype == torch.float32:
                in_float32[signal] = values
                lines.append(row(signal, KL_SAMPLES, "-", seconds, values, units))
            else:
                lines.append(row(f"{signal}, bfloat16", KL_SAMPLES, "-", seconds, values, units, in_float32[signal]))
            print(lines[-1], f"({len(units or names)} units)", flush=True)
    if not a.skip_elementwise:
        start = time.perf_counter()
        with elementwise_kl():
            values = kl_sensitivities(model, ids, settings, head_tokens=None, **float32)
        lines.append(row("kl, element-wise", KL_SAMPLES, "-", time.perf_counter() - start, values))
        print(lines[-1], flush=True)
    for sequences in [int(n) for n in a.kl_sequences.split(",") if n]:
        start = time.perf_counter()
        values = kl_sensitivities(model, ids[:sequences], settings, head_tokens=None, **float32)
        lines.append(row("kl", sequences, "-", time.perf_counter() - start, values))
        print(lines[-1], flush=True)
    for sequences, samples in fisher_runs:
        start = time.perf_counter()
        per_token, per_sequence = fisher_sensitivities(model, ids[:sequences], settings, samples)
        seconds = time.perf_counter() - start
        lines.append(row("fisher, token", sequences, str(samples), seconds, per_token))
        lines.append(row("fisher, sequence", sequences, str(samples), seconds, per_sequence))
        print(*lines[-2:], sep="\n", flush=True)
    if shares:
        lines += ["", positions_table(model, ids, settings, shares)]
    if a.default_scan:
        lines += ["", default_scan_table(model, ids, settings, a.rotation, sets)]
    if a.passes:
        lines += ["", passes_table(model, ids, settings, a.rotation)]
    write_report("\n".join(lines) + "\n", a.output, "Sensitivity signals")


def positions_table(model: nn.Module, ids: torch.Tensor, settings: CalibrationSettings, shares: list[float]) -> str:
    """The library's default scan reading each share of its sequences' positions against the same scan reading them
    whole: seconds, and the budget's units (a fused group, or a layer alone) ranked by their summed values."""
    grouped = dataclasses.replace(settings, offset_groups="fused")
    names = list(linear_modules_to_quantize(model, settings.modules_to_not_convert))
    units = scan_units(names, offset_groups("fused", names))

    def scan(share: float) -> tuple[list[float], float]:
        start = time.perf_counter()
        values = kl_sensitivities(model, ids, grouped, progress=False, positions=share)
        return [sum(values[n] for n in unit) for unit in units], time.perf_counter() - start

    whole, whole_seconds = scan(1.0)
    lines = [
        f'The library\'s default scan (fused groups, {len(units)} units, head {HEAD_TOKENS}, `matmul_dtype="auto"`) '
        f"on {KL_SAMPLES} sequences of {ids.shape[1]} tokens read whole: {whole_seconds:.1f} s. The library reads "
        f"{KL_POSITIONS} of each sequence's positions, position p weighing (p + 1) ** {KL_POSITION_WEIGHTING} (a "
        "share read weighs its positions so; whole sequences weigh them alike).",
        "",
        "| positions read | tokens per sequence | seconds | / whole sequences | Spearman vs whole sequences, units "
        "| median ratio |",
        "|---|---|---|---|---|---|",
    ]
    for share in shares:
        values, seconds = scan(share)
        ratio = statistics.median(v / w for v, w in zip(values, whole) if w > 0)
        lines.append(
            f"| {share} | {math.ceil(ids.shape[1] * share)} | {seconds:.1f} | {seconds / whole_seconds:.1%} | "
            f"{spearman(whole, values):.4f} | {ratio:.3f} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def default_scan_table(
    model: nn.Module, ids: torch.Tensor, settings: CalibrationSettings, rotation: str, sets: int = 2
) -> str:
    """The library's default scan against the reference scan (layer by layer, float32, whole sequences and
    vocabulary, every position alike) on `sets` sets of `KL_SAMPLES` sequences (`ids`' first, second, ... ones):
    seconds, and the budget's units (a fused group, or a layer alone) ranked by their summed values on the same tokens
    and on the next set's; also the default scan with every position of its half weighed alike (`position_weighting=0`,
    the default before `KL_POSITION_WEIGHTING`) and reading 9/16 of each sequence instead of half (`positions=0.5625`,
    the least share whose ranking reached 0.99 on eight sets of SmolLM2-135M's, in a one-off simulation from whole
    sequences' divergences per position). The library's scans are timed after one untimed default scan, so that none of
    them is the first after the reference's long float32 passes."""
    grouped = dataclasses.replace(settings, offset_groups="fused")
    names = list(linear_modules_to_quantize(model, settings.modules_to_not_convert))
    units = scan_units(names, offset_groups("fused", names))
    scans = {  # name: the scan's arguments
        "reference": dict(
            groups=(),
            head_tokens=None,
            matmul_dtype=torch.float32,
            positions=1.0,
            units_per_pass=1,
        ),
        "9/16": dict(positions=0.5625),
        "default": {},
        "alike": dict(position_weighting=0),
    }
    values = {name: [] for name in scans}
    seconds = {name: [] for name in scans}
    for first in range(0, sets * KL_SAMPLES, KL_SAMPLES):
        sequences = ids[first : first + KL_SAMPLES]
        for name, kwargs in scans.items():
            start = time.perf_counter()
            scanned = kl_sensitivities(model, sequences, grouped, progress=False, **kwargs)
            seconds[name].append(time.perf_counter() - start)
            values[name].append([sum(scanned[n] for n in unit) for unit in units])
            if name == "reference":  # untimed: see the docstring
                kl_sensitivities(model, sequences, grouped, progress=False)
        timed = ", ".join(f"{name} {times[-1]:.1f} s" for name, times in seconds.items())
        print(f"sequences {first}-{first + KL_SAMPLES - 1}: {timed}", flush=True)
    lines = [
        f"The model rotated `{rotation}`, {len(units)} units (fused groups), {KL_SAMPLES} sequences of {ids.shape[1]} "
        f"tokens per set, {torch.get_num_threads()} torch threads.",
        "",
        "| sequences | reference s | default s | default / reference | Spearman, default vs reference, same tokens "
        "| the same, positions alike | the same, 9/16 of each sequence | 9/16 s / default s | Spearman, default vs "
        "reference on the next set | Spearman, reference vs reference on the next set |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    reference, default = values["reference"], values["default"]
    for i in range(sets):
        following = (i + 1) % sets
        span = f"{i * KL_SAMPLES}-{(i + 1) * KL_SAMPLES - 1}"
        reference_s, default_s = seconds["reference"][i], seconds["default"][i]
        lines.append(
            f"| {span} | {reference_s:.1f} | {default_s:.1f} | {default_s / reference_s:.1%} | "
            f"{spearman(reference[i], default[i]):.4f} | {spearman(reference[i], values['alike'][i]):.4f} | "
            f"{spearman(reference[i], values['9/16'][i]):.4f} | {seconds['9/16'][i] / default_s:.2f} | "
            f"{spearman(reference[following], default[i]):.4f} | {spearman(reference[following], reference[i]):.4f} |"
        )
    return "\n".join(lines) + "\n"


def passes_table(model: nn.Module, ids: torch.Tensor, settings: CalibrationSettings, rotation: str) -> str:
    """The library's default scan against itself with one unit per pass, with the vocabulary head's products in
    float32, with both (the scan before either), and reading whole sequences as well: the least of two runs of each
    (alternating), and the budget's units ranked against the scan before and against whole sequences."""
    grouped = dataclasses.replace(settings, offset_groups="fused")
    names = list(linear_modules_to_quantize(model, settings.modules_to_not_convert))
    units = scan_units(names, offset_groups("fused", names))
    scans = {  # label: (units per pass, head products in float32, positions)
        "one unit per pass, head in float32 (the scan before)": (1, True, KL_POSITIONS),
        "one unit per pass": (1, False, KL_POSITIONS),
        f"{KL_UNITS_PER_PASS} units per pass, head in float32": (KL_UNITS_PER_PASS, True, KL_POSITIONS),
        f"{KL_UNITS_PER_PASS} units per pass (the library's)": (KL_UNITS_PER_PASS, False, KL_POSITIONS),
        "whole sequences, one unit per pass, head in float32": (1, True, 1.0),
    }
    seconds: dict[str, float] = {}
    values: dict[str, list[float]] = {}
    for _ in range(2):
        for label, (units_per_pass, head_in_float32, positions) in scans.items():
            start = time.perf_counter()
            with float32_head() if head_in_float32 else contextlib.nullcontext():
                scanned = kl_sensitivities(
                    model, ids, grouped, progress=False, positions=positions, units_per_pass=units_per_pass
                )
            seconds[label] = min(seconds.get(label, math.inf), time.perf_counter() - start)
            values[label] = [sum(scanned[n] for n in unit) for unit in units]
            print(f"{label}: {time.perf_counter() - start:.1f} s", flush=True)
    before, whole = (values[label] for label in (next(iter(scans)), list(scans)[-1]))
    lines = [
        f'The library\'s default scan (fused groups, {len(units)} units, head {HEAD_TOKENS}, `matmul_dtype="auto"`, '
        f"{KL_POSITIONS} of each of {KL_SAMPLES} sequences of {ids.shape[1]} tokens), the model rotated "
        f"`{rotation}`, {torch.get_num_threads()} torch threads. Seconds: the least of two runs.",
        "",
        "| scan | seconds | / the scan before | Spearman vs the scan before | Spearman vs whole sequences |",
        "|---|---|---|---|---|",
    ]
    reference_seconds = seconds[next(iter(scans))]
    for label in scans:
        lines.append(
            f"| {label} | {seconds[label]:.1f} | {seconds[label] / reference_seconds:.1%} | "
            f"{spearman(before, values[label]):.4f} | {spearman(whole, values[label]):.4f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
