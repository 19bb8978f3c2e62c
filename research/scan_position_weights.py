#!/usr/bin/env python
"""Study: do the KL scan's weighted positions make maps at least as good as its plain mean over the first half?

The default recipe's KL scan (`calibration.sensitivity`) reads the first half of each of its 4 sequences and, since
`KL_POSITION_WEIGHTING`, weighs position `p`'s divergence by `sqrt(p + 1)` (`position_weights`): the later
positions of the half stand in for the unread rest. On SmolLM2-135M that ranks the budget's units closer to the
scan of whole sequences (`benchmarks/results/sensitivity.md`, "Weighted positions"). This study measures what it
does to the maps the default recipe makes from the same learned offsets.

Each cell is calibrated in the servable configuration (`online_block_hadamard`, fused groups, weighted budget, the
default recipe, whose map is the weighted scan's: `weighted`); the scan then runs again on the same sequences with
every position alike (`plain`, the default before) and on whole sequences with every position alike (`whole`, what
the half estimates), and a map is built from the same learned offsets with each. The maps are evaluated with their
weights rounded by GPTQ (the default rounding) on the quality table's held-out windows; equal maps share one
evaluation.

    python research/scan_position_weights.py --cells mxfp8-mxfp4:5,mxfp8-mxfp4:4.5,mxfp6-mxfp4:4.5 --seeds 0 --threads 2
    python research/scan_position_weights.py --report-only

Rows are appended to `research/scan_position_weights.jsonl` as they finish; a finished cell is skipped on rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_quality import Runner, Sweep  # noqa: E402
from bench_sensitivity import spearman  # noqa: E402
from fused_groups import cell_settings, evaluate_map  # noqa: E402
from group_scan import ROTATION, TEXTS  # noqa: E402

from optimum_dmx.calibration import calibrate, kl_sensitivities  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.calibration.sensitivity import scan_units  # noqa: E402
from optimum_dmx.calibration.trainer import blended_format_map  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
ROUNDING = "gptq"
SCANS = {  # map name: the scan's arguments
    "weighted": {},  # the library's default
    "plain": {"position_weighting": 0},
    "whole": {"positions": 1.0},  # every position alike
}


def run_cell(runner: Runner, pair: str, target: str, seed: int, rows: list[dict]) -> None:
    if any((r["pair"], r["target"], r["seed"]) == (pair, target, seed) for r in rows):
        return
    settings = cell_settings(runner, pair, target, seed, "fused")
    sequences = runner.calibration_ids(seed)
    result = calibrate(runner.model, sequences, settings)
    names = list(result.format_map)
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in names}
    units = scan_units(names, offset_groups(settings.offset_groups, names))
    values = {
        name: kl_sensitivities(runner.model, sequences, settings, progress=False, **kw) for name, kw in SCANS.items()
    }
    maps = {name: blended_format_map(result.beta_hat, v, shapes, settings) for name, v in values.items()}
    summed = {name: [sum(v[n] for n in unit) for unit in units] for name, v in values.items()}
    row = {
        "pair": pair,
        "target": target,
        "seed": seed,
        "rounding": ROUNDING,
        "calibration_map_is_weighted": maps["weighted"] == result.format_map,
        "layers_differing": {
            name: sum(maps[name][n] != maps["weighted"][n] for n in names) for name in ("plain", "whole")
        },
        "spearman_vs_whole": {
            name: round(spearman(summed["whole"], summed[name]), 5) for name in ("weighted", "plain")
        },
        "calibration_seconds": round(result.seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{pair} {target} s{seed}: {row}", flush=True)
    evaluated: list[tuple[dict, dict]] = []
    for name, format_map in maps.items():
        measured = next((m for other, m in evaluated if other == format_map), None)
        if measured is None:
            measured = evaluate_map(runner, format_map, sequences, ROUNDING)
            evaluated.append((format_map, measured))
        row.update({f"{name}_ppl_{text}": measured[f"ppl_{text}"] for text in TEXTS})
    append_json_line(RESULTS, {**row, "maps": maps})


def report(rows: list[dict]) -> str:
    lines = [
        "Held-out perplexity (GPTQ), Moby Dick / Pride and Prejudice, of the maps made from the same learned offsets "
        "with the scan's weighted positions (the default), its plain mean over the same first halves and its plain "
        "mean over whole sequences (layers whose format differs from the weighted map's in brackets; Spearman of the "
        "units' values against whole sequences):",
        "",
        "| pair, bits, seed | weighted (default) | plain (before) | whole sequences | Spearman weighted / plain |",
        "|---|---|---|---|---|",
    ]
    ratios = {"plain": [], "whole": []}
    for r in sorted(rows, key=lambda r: (r["pair"], r["target"], r["seed"])):
        weighted = " / ".join(f"{r[f'weighted_ppl_{t}']:.2f}" for t in TEXTS)
        cells = []
        for name in ("plain", "whole"):
            cells.append(
                " / ".join(
                    f"{r[f'{name}_ppl_{t}']:.2f} ({r[f'{name}_ppl_{t}'] / r[f'weighted_ppl_{t}'] - 1:+.1%})"
                    for t in TEXTS
                )
                + f" [{r['layers_differing'][name]}]"
            )
            ratios[name] += [r[f"weighted_ppl_{t}"] / r[f"{name}_ppl_{t}"] for t in TEXTS]
        spearmans = " / ".join(f"{r['spearman_vs_whole'][n]:.4f}" for n in ("weighted", "plain"))
        lines.append(f"| {r['pair']} {r['target']} s{r['seed']} | {weighted} | {' | '.join(cells)} | {spearmans} |")
    for name, against in ratios.items():
        if against:
            lines.append(
                f"\nWeighted against {name}: geometric mean {statistics.geometric_mean(against):.4f} over "
                f"{len(against)} comparisons, lower in {sum(x < 1 for x in against)}, higher in "
                f"{sum(x > 1 for x in against)}, from {min(against) - 1:+.1%} to {max(against) - 1:+.1%}."
            )
    lines.append(
        f"\nThe calibration's own map was the weighted scan's in {sum(r['calibration_map_is_weighted'] for r in rows)} "
        f"of {len(rows)} cells."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="mxfp8-mxfp4:5,mxfp8-mxfp4:4.5,mxfp6-mxfp4:4.5", help="pair:target list")
    p.add_argument("--seeds", default="0")
    p.add_argument("--threads", type=int)
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.report_only:
        runner = None
        for seed in map(int, a.seeds.split(",")):
            for cell in a.cells.split(","):
                pair, target = cell.split(":")
                if runner is None:
                    sweep = Sweep(methods=["dmx"], rotation=ROTATION, offset_groups="fused", bit_average="weighted")
                    runner = Runner(dataclasses.replace(sweep, pairs=[pair]))
                run_cell(runner, pair, target, seed, read_json_lines(RESULTS))
    print(report(read_json_lines(RESULTS)))


if __name__ == "__main__":
    main()
