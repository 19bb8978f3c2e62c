#!/usr/bin/env python
"""Ablation: do single-layer format swaps, measured in the context of a finished map, add up?

A refinement the default recipe could add after ranking: take its map, flip one layer at a time (high to low, low
to high) with every other layer in its mapped format, and measure what each flip changes in
`KL(float || quantized)` on the KL scan's calibration sequences (one forward pass per layer, as the scan). Then
exchange layers at equal bits where a flip's measured gain exceeds another's measured cost: with the simple
average, the cheapest demotions against the most profitable promotions, while the gain is larger. If single-flip
effects added up, the exchanged map would be better; this script measures whether it is, on the held-out texts.

It reads the saved runs of `pareto.py` (run those first) and appends one line per cell to
`<out>/in_context_swaps.jsonl`, then writes `<out>/in_context_swaps.md`:

    python benchmarks/in_context_swaps.py --threads 1 --cells mxfp8-mxfp4:6:1
"""

from __future__ import annotations

import json
import time

import torch

from optimum_dmx.calibration.losses import next_token_kl, next_token_log_probs
from optimum_dmx.continuous import get_format_pair
from optimum_dmx.nn import MXLinear
from optimum_dmx.nn.surgery import swapped_modules
from pareto import Benchmark, Runner, cell_script_parser, parse_cells


class MapDivergence:
    """KL(float || the model under a format map) per token on fixed sequences (and, one batch at a time, with the
    cross-entropy of the text); each layer's modules in both formats of the pair are built once, so a map (or a map
    with one layer flipped) costs one forward pass per batch."""

    def __init__(self, runner: Runner, layers: list[str], pair: str, ids: torch.Tensor):
        self.model, self.formats = runner.model, get_format_pair(pair)
        self.batches = ids.split(runner.bench.batch_size)
        self.tokens = ids.numel()
        with torch.no_grad():
            self.reference = [next_token_log_probs(self.model, b) for b in self.batches]
        self.modules = {name: {fmt: MXLinear.from_linear(self.model.get_submodule(name), fmt)
                               for fmt in (self.formats.low.name, self.formats.high.name)} for name in layers}

    @torch.no_grad()
    def __call__(self, format_map: dict[str, str]) -> float:
        with swapped_modules(self.model, {name: self.modules[name][fmt] for name, fmt in format_map.items()}):
            return sum(next_token_kl(r, next_token_log_probs(self.model, b)).item()
                       for b, r in zip(self.batches, self.reference)) / self.tokens

    @torch.no_grad()
    def batch_losses(self, format_map: dict[str, str], batch: int) -> dict[str, float]:
        """Cross-entropy of the text and KL(float || quantized), per token, of one batch under `format_map`."""
        ids = self.batches[batch]
        with swapped_modules(self.model, {name: self.modules[name][fmt] for name, fmt in format_map.items()}):
            log_probs = next_token_log_probs(self.model, ids)
        cross_entropy = -log_probs[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        kl = next_token_kl(self.reference[batch], log_probs) / ids.numel()
        return {"cross_entropy": cross_entropy.item(), "kl": kl.item()}

    def flip_effects(self, format_map: dict[str, str], base: float) -> dict[str, float]:
        """The change of the divergence (`base` under `format_map`) when each layer alone takes the other format."""
        other = {self.formats.low.name: self.formats.high.name, self.formats.high.name: self.formats.low.name}
        return {name: self({**format_map, name: other[fmt]}) - base for name, fmt in format_map.items()}


def exchanged(format_map: dict[str, str], pair: str, effects: dict[str, float]) -> tuple[dict[str, str], int]:
    """`format_map` with the high/low exchanges whose measured gain beats their measured cost (equal bits)."""
    formats = get_format_pair(pair)
    high = sorted((n for n, f in format_map.items() if f == formats.high.name), key=effects.get)  # cheapest first
    low = sorted((n for n, f in format_map.items() if f == formats.low.name), key=effects.get)  # best gain first
    result, swaps = dict(format_map), 0
    for demoted, promoted in zip(high, low):
        if -effects[promoted] <= effects[demoted]:
            break
        result[demoted], result[promoted] = formats.low.name, formats.high.name
        swaps += 1
    return result, swaps


def main() -> None:
    p = cell_script_parser(__doc__, default_cells="mxfp8-mxfp4:6:1")
    p.add_argument("--method", default="dmx_kl", help="the pareto.py method whose map is refined")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cache = a.out / "in_context_swaps.jsonl"
    records = [json.loads(line) for line in cache.read_text().splitlines()] if cache.exists() else []
    runner = None
    for pair, target, seed in parse_cells(a.cells):
        if any((r["pair"], r["target"], r["seed"], r["method"]) == (pair, target, seed, a.method) for r in records):
            continue
        runner = runner or Runner(Benchmark(out=a.out))
        start = time.perf_counter()
        base_map = runner.assign(a.method, pair, target, seed).format_map
        ids = runner.input_ids(seed)[: runner.bench.kl_samples]
        divergence = MapDivergence(runner, list(base_map), pair, ids)
        base = divergence(base_map)
        effects = divergence.flip_effects(base_map, base)
        refined, swaps = exchanged(base_map, pair, effects)
        after = divergence(refined)
        seconds = time.perf_counter() - start
        record = {"method": a.method, "pair": pair, "target": target, "seed": seed, "swaps": swaps,
                  "scan_seconds": round(seconds, 1), "kl_base": base,
                  "kl_predicted": base + sum(effects[n] for n in refined if refined[n] != base_map[n]),
                  "kl_after": after,
                  "base": runner.perplexities(base_map), "exchanged": runner.perplexities(refined)}
        with open(cache, "a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
        print(json.dumps(record), flush=True)
    lines = ["# Single-layer flips measured in a finished map's context, exchanged at equal bits", "",
             "Command: `python benchmarks/in_context_swaps.py --threads 1 --cells " + a.cells + "`", "",
             "| map | pair | target | seed | exchanges | KL of the map (scan tokens) | KL after, predicted by the "
             "single flips | KL after, measured | perplexity before | perplexity after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        texts = list(r["base"])
        lines.append(f"| {r['method']} | {r['pair']} | {r['target']} | {r['seed']} | {r['swaps']} | "
                     f"{r['kl_base']:.4f} | {r['kl_predicted']:.4f} | {r['kl_after']:.4f} | "
                     + " / ".join(f"{r['base'][t]:.2f}" for t in texts) + " | "
                     + " / ".join(f"{r['exchanged'][t]:.2f}" for t in texts) + " |")
    (a.out / "in_context_swaps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
