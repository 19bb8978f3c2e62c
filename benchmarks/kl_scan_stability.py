#!/usr/bin/env python
"""Ablation: is KL pre-selection's ranking limited by its tokens? The scan again, on the seed's next batches.

KL pre-selection (and the KL half of the default recipe's blend) ranks layers by a scan on the first
`kl_samples` calibration sequences (4 x 128 tokens), where the learned offsets read 80 batches. If the scan's ranking
moved much with its tokens, a longer scan would be a lever. This script runs the same scan on the next `kl_samples`
sequences of the seed (disjoint tokens, the same draw) and compares it with the cached scan of `pareto.py`: the
Spearman correlation of the two sensitivity vectors and how many of the top layers at each target's budget (the
simple average: 12.5%, 25% and 50% of the layers high for 4.5, 5 and 6 bits on the MXFP8 pair) they share.

Appends one line per seed to `<out>/kl_scan_stability.jsonl` and writes `<out>/kl_scan_stability.md`:

    python benchmarks/kl_scan_stability.py --threads 1 --seeds 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common import append_json_line, read_json_lines
from optimum_dmx.calibration import kl_sensitivities
from pareto import Benchmark, Runner
from random_maps import spearman

HIGH_FRACTIONS = {"4.5": 0.125, "5": 0.25, "6": 0.5}  # MXFP8 pair, simple average: (target - 4) / 4 of the layers


def top(sensitivities: dict[str, float], count: int) -> set[str]:
    return set(sorted(sensitivities, key=sensitivities.get, reverse=True)[:count])


def learned_shared(runs: Path, seed: int) -> list[str]:
    """Per target, how many of the KL map's high layers the learned ranking alone (`dmx`) also raises, from the
    sweep's saved maps (empty where a map is missing)."""
    shared = []
    for target in HIGH_FRACTIONS:
        paths = [runs / f"{method}_mxfp8-mxfp4_{target}_seed{seed}.json" for method in ("kl", "dmx")]
        if not all(path.exists() for path in paths):
            shared.append("")
            continue
        kl, learned = ({n for n, f in json.loads(p.read_text())["format_map"].items() if f == "mxfp8_e4m3"}
                       for p in paths)
        shared.append(f"{len(kl & learned)} of {len(kl)}")
    return shared


def measure(runner: Runner, seed: int) -> dict:
    bench = runner.bench
    settings = bench.settings("kl", "mxfp8-mxfp4", 5.0, seed)
    cached = runner.sensitivities(settings, seed)[0]
    start = time.perf_counter()
    ids = runner.input_ids(seed)[bench.kl_samples : 2 * bench.kl_samples]
    again = kl_sensitivities(runner.model, ids, settings)
    names = list(cached)
    record = {"seed": seed, "kl_samples": bench.kl_samples, "seq_len": bench.seq_len,
              "seconds": round(time.perf_counter() - start, 1),
              "spearman": round(spearman(torch.tensor([cached[n] for n in names]),
                                         torch.tensor([again[n] for n in names])), 4),
              "top_shared": {}}
    for target, fraction in HIGH_FRACTIONS.items():
        count = round(fraction * len(names))
        record["top_shared"][target] = [len(top(cached, count) & top(again, count)), count]
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1", help="comma list of calibration seeds")
    p.add_argument("--out", type=Path, default=Benchmark().out)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cache = a.out / "kl_scan_stability.jsonl"
    records = read_json_lines(cache)
    runner = None
    for seed in (int(s) for s in a.seeds.split(",")):
        if any(r["seed"] == seed for r in records):
            continue
        runner = runner or Runner(Benchmark(out=a.out))
        record = measure(runner, seed)
        append_json_line(cache, record)
        records.append(record)
    lines = ["# KL pre-selection's scan on two disjoint sets of calibration tokens", "",
             f"Command: `python benchmarks/kl_scan_stability.py --threads 1 --seeds {a.seeds}`", "",
             "The cached scan (`runs/kl_sensitivities_*`, the seed's first sequences) against the same scan on the "
             "seed's next sequences. Top layers shared: of the layers a map at each target raises (MXFP8 pair, "
             "simple average), and for comparison how many of the KL map's high layers the learned ranking alone "
             "(`dmx`, saved maps in `runs/`) raises too.", "",
             "| seed | tokens per scan | seconds | Spearman | top shared, 4.5 bits | top shared, 5 bits | top shared, 6 bits "
             "| KL map vs learned map, 4.5 / 5 / 6 bits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        shared = " | ".join(f"{s} of {n}" for s, n in r["top_shared"].values())
        learned = " / ".join(learned_shared(a.out / "runs", r["seed"]))
        lines.append(f"| {r['seed']} | {r['kl_samples']} x {r['seq_len']} | {r['seconds']:.0f} | {r['spearman']:.3f} | "
                     f"{shared} | {learned} |")
    (a.out / "kl_scan_stability.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
