#!/usr/bin/env python
"""Ablation: each layer's effect measured by random maps at the budget (a zeroth-order estimate), not a derivative.

The learned offsets read the loss's derivative with respect to a layer's format in sampled contexts, and KL
pre-selection measures each layer alone with the rest in float: both are single-layer, first-order measurements,
and single-layer effects do not add up in this model (`in_context_swaps.py`). This script measures the effect that
choosing a map needs: the calibration loss of whole maps. It draws `--samples` maps at the cell's budget (each a
random order through the budget rule, so each has the target's bits), evaluates each on one of `--batches`
calibration batches of the seed (the same tokens as every other method; batch i serves maps i, i + batches, ...),
and fits, by ridge least squares with one intercept per batch,

    loss(map, batch) = a_batch + sum_j c_j [layer j takes the high format]

for two losses from the same forward passes: the cross-entropy of the calibration text (the task loss, what the
learned offsets read) and KL(float || quantized) of the next-token distributions (what KL pre-selection reads).
`c_j` is layer j's effect averaged over the contexts a map at this budget puts it in, interactions included only as
far as they average out. The layers with the most negative `c_j` go high (budget rule); each such ranking is also
blended with KL's as the default recipe blends the learned offsets (`kl_weight=0.5`). Reliability: the Spearman
correlation of the coefficients fitted on the even and on the odd samples.

It reads `pareto.py`'s cached KL scans and CSV (run those first), appends one line per cell to
`<out>/random_maps.jsonl` as it finishes, and writes `<out>/random_maps.md`:

    python benchmarks/random_maps.py --threads 1 --cells mxfp8-mxfp4:6:1,mxfp8-mxfp4:4.5:0
"""

from __future__ import annotations

import sys
import time

import torch

from common import append_json_line, read_json_lines
from in_context_swaps import MapDivergence
from optimum_dmx.calibration.budget import blended_priority, budget_format_map
from optimum_dmx.continuous import get_format_pair
from pareto import Benchmark, Runner, _read_rows, cell_script_parser, parse_cells, sweep_perplexities

LOSSES = ("cross_entropy", "kl")
RIDGE = 1.0  # in units of the design's Gram matrix, whose diagonal is samples * p * (1 - p) ~ 40-100 here
MAPS = ["cross_entropy", "kl", "cross_entropy+kl_scan", "kl+kl_scan"]


def effects(design: torch.Tensor, batch: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """Ridge least-squares `c` of `losses = a_batch + design @ c` (float64; one intercept per batch)."""
    z, y = design.double().clone(), losses.double().clone()
    for b in batch.unique():  # the batch intercepts, removed by centring within each batch
        rows = batch == b
        z[rows] -= z[rows].mean(0)
        y[rows] -= y[rows].mean()
    gram = z.T @ z + RIDGE * torch.eye(z.shape[1], dtype=z.dtype)
    return torch.linalg.solve(gram, z.T @ y)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ranks = [torch.argsort(torch.argsort(v)).double() for v in (a, b)]
    return float(torch.corrcoef(torch.stack(ranks))[0, 1])


def measure(runner: Runner, pair: str, target: str, seed: int, samples: int, n_batches: int) -> dict:
    bench = runner.bench
    settings = bench.settings("dmx", pair, float(target), seed)
    layers = list(runner.sensitivities(settings, seed)[0])
    shapes = {name: tuple(runner.model.get_submodule(name).weight.shape) for name in layers}
    formats = get_format_pair(pair)
    start = time.perf_counter()
    map_losses = MapDivergence(runner, layers, pair, runner.input_ids(seed)[: n_batches * bench.batch_size])
    generator = torch.Generator().manual_seed(seed)
    design, batch_of, measured = [], [], {loss: [] for loss in LOSSES}
    for i in range(samples):
        order = dict(zip(layers, torch.rand(len(layers), generator=generator).tolist()))
        format_map = budget_format_map(order, shapes, formats, settings.target_bits, settings.bit_average,
                                       settings.quantize_activations)
        design.append([float(format_map[name] == formats.high.name) for name in layers])
        batch_of.append(i % n_batches)
        for loss, value in map_losses.batch_losses(format_map, i % n_batches).items():
            measured[loss].append(value)
        if (i + 1) % 50 == 0:
            print(f"{pair} {target} seed {seed}: {i + 1} of {samples} maps, {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    z, batch = torch.tensor(design), torch.tensor(batch_of)
    record = {"pair": pair, "target": target, "seed": seed, "samples": samples, "batches": n_batches,
              "seconds": round(seconds, 1), "effects": {}, "split_half_spearman": {}}
    for loss in LOSSES:
        y = torch.tensor(measured[loss])
        record["effects"][loss] = dict(zip(layers, effects(z, batch, y).tolist()))
        halves = [effects(z[k::2], batch[k::2], y[k::2]) for k in (0, 1)]
        record["split_half_spearman"][loss] = round(spearman(*halves), 3)
    return record


def format_maps(runner: Runner, record: dict) -> dict[str, dict[str, str]]:
    """The budget-rule maps of the fitted effects, alone and blended with the KL scan's ranking."""
    settings = runner.bench.settings("dmx", record["pair"], float(record["target"]), record["seed"])
    sensitivities = runner.sensitivities(settings, record["seed"])[0]
    shapes = {name: tuple(runner.model.get_submodule(name).weight.shape) for name in sensitivities}
    maps = {}
    for loss in LOSSES:
        gain = {name: -c for name, c in record["effects"][loss].items()}  # promoting a layer lowers the loss by -c
        for name, priority in ((loss, gain), (f"{loss}+kl_scan", blended_priority(gain, sensitivities, 0.5))):
            maps[name] = budget_format_map(priority, shapes, get_format_pair(record["pair"]), settings.target_bits,
                                           settings.bit_average, settings.quantize_activations)
    return maps


def report(records: list[dict], csv_rows: list[dict], command: str) -> str:
    def reference(method: str, r: dict) -> list[float] | None:
        return sweep_perplexities(csv_rows, method, r["pair"], r["target"], r["seed"], r["texts"])

    def shown(values: list[float] | None, kl: list[float] | None) -> str:
        if values is None:
            return ""
        text = " / ".join(f"{v:.2f}" for v in values)
        return text + (" (" + " / ".join(f"{v / k - 1:+.1%}" for v, k in zip(values, kl)) + ")" if kl else "")

    lines = ["# Random maps at the budget: each layer's effect fitted from whole maps' losses", "",
             f"Command: `{command}`", "",
             "Perplexity on the held-out texts (" + ", ".join(records[0]["texts"]) + "), in brackets against KL "
             "pre-selection on the same tokens and bits. Split-half: Spearman correlation of the effects fitted on "
             "the even and the odd samples (cross-entropy / KL).", "",
             "| pair | target | seed | samples | seconds | split-half | KL pre-selection | default recipe (`dmx_kl`) | "
             + " | ".join(f"random maps: {m}" for m in MAPS) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(MAPS)]
    for r in records:
        kl = reference("kl", r)
        halves = " / ".join(f"{r['split_half_spearman'][loss]:.2f}" for loss in LOSSES)
        lines.append(f"| {r['pair']} | {r['target']} | {r['seed']} | {r['samples']} | {r['seconds']:.0f} | {halves} | "
                     f"{shown(kl, None)} | {shown(reference('dmx_kl', r), kl)} | "
                     + " | ".join(shown(r["perplexities"].get(m), kl) for m in MAPS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = cell_script_parser(__doc__, default_cells="mxfp8-mxfp4:6:1")
    p.add_argument("--samples", type=int, default=400, help="random maps per cell")
    p.add_argument("--batches", type=int, default=8, help="calibration batches the maps are spread over")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cache = a.out / "random_maps.jsonl"
    records = read_json_lines(cache) if cache.exists() else []
    runner = None
    for pair, target, seed in parse_cells(a.cells):
        key = (pair, target, seed, a.samples, a.batches)
        if any((r["pair"], r["target"], r["seed"], r["samples"], r["batches"]) == key for r in records):
            continue
        runner = runner or Runner(Benchmark(out=a.out))
        record = measure(runner, pair, target, seed, a.samples, a.batches)
        maps = format_maps(runner, record)
        record["perplexities"] = {name: list(runner.perplexities(m).values()) for name, m in maps.items()}
        record["texts"] = list(runner.texts)
        append_json_line(cache, record)
        records.append(record)
    if records:
        command = "python benchmarks/random_maps.py --threads 1 --cells " + a.cells
        (a.out / "random_maps.md").write_text(report(records, _read_rows(a.out / "pareto.csv"), command))
        print((a.out / "random_maps.md").read_text())


if __name__ == "__main__":
    main()
