#!/usr/bin/env python
"""Where learned maps and KL pre-selection disagree: a table from the Pareto benchmark's saved runs.

For every run in `<results>/runs/` of a learned method and of KL pre-selection at the same pair, target, seed and
rotation, it prints the number of layers in the high format per projection type (q/k/v/o, gate/up/down) and per
third of the depth, the overlap of the high sets with KL's, and the Spearman rank correlation of the learned
offsets with the KL sensitivities. No model is loaded: it reads the JSON files `pareto.py` writes.

    python benchmarks/analyze_maps.py                       # table on stdout
    python benchmarks/analyze_maps.py --out benchmarks/results/map_analysis.md
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from pathlib import Path

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUN_NAME = re.compile(r"^(?P<method>[a-z_]+?)_(?P<pair>mxfp\d-mxfp4)_(?P<target>[\d.]+)(?:_(?P<rotation>[a-z_]+))?_seed(?P<seed>\d+)$")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb))


def high_layers(format_map: dict[str, str]) -> set[str]:
    return {name for name, fmt in format_map.items() if fmt != "mxfp4_e2m1"}


def analyze(runs: Path) -> list[str]:
    files = {}
    for path in sorted(runs.glob("*.json")):
        match = RUN_NAME.match(path.stem)
        if match:
            files[(match["method"], match["pair"], match["target"], match["rotation"] or "none", match["seed"])] = path
    depth = 1 + max(int(n.split(".")[2]) for path in files.values()
                    for n in json.loads(path.read_text())["format_map"] if n.startswith("model.layers."))
    thirds = [f"layers {i * depth // 3}-{(i + 1) * depth // 3 - 1}" for i in range(3)]
    header = ("| pair | target | seed | rotation | method | high layers | " + " | ".join(p.split("_")[0] for p in PROJECTIONS)
              + " | " + " | ".join(thirds) + " | overlap with KL | Spearman vs KL |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for (method, pair, target, rotation, seed), path in sorted(files.items(), key=lambda kv: (kv[0][1], float(kv[0][2]), kv[0][4], kv[0][3], kv[0][0] != "kl", kv[0][0])):
        kl = files.get(("kl", pair, target, rotation, seed))
        if kl is None or method in ("uniform",):
            continue
        run = json.loads(path.read_text())
        high = high_layers(run["format_map"])
        kl_high = high_layers(json.loads(kl.read_text())["format_map"])
        by_projection = Counter(name.rsplit(".", 1)[1] for name in high)
        by_third = Counter(min(2, 3 * int(name.split(".")[2]) // depth) for name in high)
        correlation = ""
        scan = runs / f"kl_sensitivities_4x128{'' if rotation == 'none' else '_' + rotation}_seed{seed}.json"
        offsets = run.get("beta_hat") or {}
        if offsets and scan.exists():
            sensitivities = json.loads(scan.read_text())["sensitivities"]
            names = [n for n in offsets if math.isfinite(offsets[n]) and n in sensitivities]
            correlation = f"{spearman([offsets[n] for n in names], [sensitivities[n] for n in names]):.2f}"
        lines.append(
            f"| {pair} | {target} | {seed} | {rotation} | {method} | {len(high)} | "
            + " | ".join(str(by_projection[p]) for p in PROJECTIONS) + " | "
            + " | ".join(str(by_third[i]) for i in range(3))
            + f" | {len(high & kl_high)} | {correlation} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    lines = analyze(args.results / "runs")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
