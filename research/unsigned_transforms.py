"""Online transforms without random signs: what a model loses where no layer can take the signs.

`rotation="online_block_hadamard"` draws random signs for a linear's transform only where an exported checkpoint can
move them into the layer or norm producing its input (`optimum_dmx.nn.rotation.sign_carriers`); elsewhere (the
linears reading Gemma's `1 + weight` norms, Phi-3's fused projections, layouts other than Llama's) the transform is
a plain block Hadamard transform. SmolLM2-135M has a carrier for every linear, so this study measures the other case
on it: `--variant unsigned` runs `benchmarks/bench_quality.py` with no carriers at all (every transform unsigned),
`--variant signed` runs it as the library does; each variant's runs go to their own JSON-lines file here, and the
report sets them side by side (cells both ran). Every other argument goes to `bench_quality.py` (use one torch
thread per process when two run side by side).

    python research/unsigned_transforms.py --variant signed --methods uniform \
        --uniform-formats mxfp4_e2m1,mxfp6_e2m3 --rotation online_block_hadamard --threads 1
    python research/unsigned_transforms.py --variant unsigned --methods uniform \
        --uniform-formats mxfp4_e2m1,mxfp6_e2m3 --rotation online_block_hadamard --threads 1
    python research/unsigned_transforms.py --variant signed --methods dmx --pairs mxfp8-mxfp4 --targets 5 --seeds 0 \
        --rotation online_block_hadamard --offset-groups fused --bit-average weighted --weight-rounding gptq --threads 1
    (the same with --variant unsigned)
    python research/unsigned_transforms.py --report-only
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = HERE.parent / "benchmarks"
VARIANTS = ("signed", "unsigned")
CELL = ("method", "pair", "target", "seed", "offset_groups", "bit_average", "weight_rounding")


def runs_file(variant: str) -> Path:
    return HERE / f"unsigned_transforms_{variant}.jsonl"


def run(variant: str, bench_args: list[str]) -> None:
    if variant == "unsigned":
        from optimum_dmx.nn import rotation

        rotation.sign_carriers = lambda model, quantized: {}  # no layer takes signs: every transform unsigned
    sys.path.insert(0, str(BENCHMARKS))
    sys.argv = ["bench_quality.py", *bench_args, "--runs", str(runs_file(variant))]
    runpy.run_path(str(BENCHMARKS / "bench_quality.py"), run_name="__main__")


def report() -> str:
    """Per cell (method, pair, target, seed, groups, budget, rounding): the signed and unsigned transforms' held-out
    perplexity and their ratio, and the unrotated model's where a `--rotation none` run of the cell is in either
    file."""
    texts = ("ppl_pride_prejudice", "ppl_moby_dick")
    rows: dict[tuple, dict[str, dict]] = {}
    for variant in VARIANTS:
        path = runs_file(variant)
        for line in path.read_text().splitlines() if path.exists() else ():
            row = json.loads(line)
            column = variant if row["rotation"] == "online_block_hadamard" else f"rotation {row['rotation']}"
            rows.setdefault(tuple(row.get(k) for k in CELL), {})[column] = row

    def perplexities(row: dict | None) -> str:
        return "-" if row is None else " / ".join(f"{row[t]:.2f}" for t in texts)

    lines = [
        "| cell | signed (Pride and Prejudice / Moby Dick) | unsigned | unsigned / signed | unrotated |",
        "|---|---|---|---|---|",
    ]
    for cell, columns in sorted(rows.items(), key=str):
        signed, unsigned = columns.get("signed"), columns.get("unsigned")
        if signed is None or unsigned is None:
            continue
        ratios = " / ".join(f"{unsigned[t] / signed[t]:.3f}" for t in texts)
        name = " ".join(str(v) for v in cell if v not in (None, ""))
        unrotated = perplexities(columns.get("rotation none"))
        lines.append(f"| {name} | {perplexities(signed)} | {perplexities(unsigned)} | {ratios} | {unrotated} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--report-only", action="store_true")
    args, bench_args = parser.parse_known_args()
    if not args.report_only:
        if args.variant is None:
            parser.error("--variant is needed unless --report-only")
        run(args.variant, bench_args)
    print(report())


if __name__ == "__main__":
    main()
