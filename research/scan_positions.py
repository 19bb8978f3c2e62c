#!/usr/bin/env python
"""Study: does the KL scan on the first half of each of its sequences make the maps the whole sequences make?

The default recipe's KL scan (`calibration.sensitivity`) reads the first `KL_SAMPLES` (4) calibration sequences,
whole: in the CLI's default run it takes 20% of the calibration steps' time (`benchmarks/results/cli_default_run.md`),
where the issue asks for 10%. Each pass of the scan costs in proportion to the positions it reads; reading the first
half of each sequence (4 x 64 tokens at the `cpu-bench` preset) takes 0.58x the scan's time on SmolLM2-135M and
ranks the budget's units as the whole sequences do at Spearman 0.991 (`benchmarks/results/sensitivity.md`). This
study measures what that does to the maps the default recipe makes from the same learned offsets.

Each cell is calibrated in the servable configuration (`online_block_hadamard`, fused groups, weighted budget, the
default recipe); the scan then runs again on the same sequences, whole and their first half, and a map is built from
the same learned offsets with each (`whole`, `half`); one of them must be the calibration's own map (the scan
reproduced: `whole` until the library read half, `half` since). Both maps are evaluated with their weights rounded
by GPTQ (the default rounding) on the quality table's held-out windows; where the maps are equal, one evaluation
serves both. The scan does not depend on the pair or the target: the cells of one seed share it (the same
sequences), so each seed measures one scan's ranking.

    python research/scan_positions.py --cells mxfp8-mxfp4:4.5,mxfp8-mxfp4:5,mxfp6-mxfp4:4.5 --seeds 0 --threads 2
    python research/scan_positions.py --report-only

Rows are appended to `research/scan_positions.jsonl` as they finish; a finished cell is skipped on rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_quality import Runner, Sweep  # noqa: E402
from fused_groups import cell_settings, evaluate_map  # noqa: E402
from group_scan import ROTATION, TEXTS  # noqa: E402

from optimum_dmx.calibration import calibrate, kl_sensitivities  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.calibration.sensitivity import scan_units  # noqa: E402
from optimum_dmx.calibration.trainer import blended_format_map  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
ROUNDING = "gptq"


def spearman(a: list[float], b: list[float]) -> float:
    ranks = [torch.tensor(v, dtype=torch.float64).argsort().argsort().double() for v in (a, b)]
    return torch.corrcoef(torch.stack(ranks))[0, 1].item()


def run_cell(runner: Runner, pair: str, target: str, seed: int, rows: list[dict]) -> None:
    if any((r["pair"], r["target"], r["seed"]) == (pair, target, seed) for r in rows):
        return
    settings = cell_settings(runner, pair, target, seed, "fused")
    sequences = runner.calibration_ids(seed)
    result = calibrate(runner.model, sequences, settings)
    names = list(result.format_map)
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in names}
    start = time.perf_counter()
    whole = kl_sensitivities(runner.model, sequences, settings, progress=False, positions=1.0)
    whole_seconds = time.perf_counter() - start
    start = time.perf_counter()
    half = kl_sensitivities(runner.model, sequences, settings, progress=False, positions=0.5)
    half_seconds = time.perf_counter() - start
    maps = {
        share: blended_format_map(result.beta_hat, values, shapes, settings)
        for share, values in [(1.0, whole), (0.5, half)]
    }
    whole_map, half_map = maps[1.0], maps[0.5]
    units = scan_units(names, offset_groups(settings.offset_groups, names))
    row = {
        "pair": pair,
        "target": target,
        "seed": seed,
        "rounding": ROUNDING,
        # the calibration's own map is one of the two: whichever share the library's scan read (the scan reproduced)
        "calibration_map": next((f"positions {share}" for share, m in maps.items() if m == result.format_map), None),
        "layers_differing": sum(whole_map[n] != half_map[n] for n in names),
        "spearman_units": round(
            spearman([sum(whole[n] for n in u) for u in units], [sum(half[n] for n in u) for u in units]), 5
        ),
        "whole_scan_seconds": round(whole_seconds, 1),
        "half_scan_seconds": round(half_seconds, 1),
        "calibration_seconds": round(result.seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{pair} {target} s{seed}: {row}", flush=True)
    measured = evaluate_map(runner, whole_map, sequences, ROUNDING)
    row.update({f"whole_ppl_{text}": measured[f"ppl_{text}"] for text in TEXTS})
    if row["layers_differing"]:
        measured = evaluate_map(runner, half_map, sequences, ROUNDING)
    row.update({f"half_ppl_{text}": measured[f"ppl_{text}"] for text in TEXTS})
    append_json_line(RESULTS, {**row, "whole_map": whole_map, "half_map": half_map})


def report(rows: list[dict]) -> str:
    lines = [
        "Held-out perplexity (GPTQ), Moby Dick / Pride and Prejudice, of the maps made from the same learned offsets "
        "with the scan on whole sequences and on their first half (layers whose format differs in brackets):",
        "",
        "| pair, bits, seed | whole sequences | first halves | Spearman, units | scan seconds, whole / half |",
        "|---|---|---|---|---|",
    ]
    ratios = []
    for r in sorted(rows, key=lambda r: (r["pair"], r["target"], r["seed"])):
        whole = " / ".join(f"{r[f'whole_ppl_{t}']:.2f}" for t in TEXTS)
        half = " / ".join(
            f"{r[f'half_ppl_{t}']:.2f} ({r[f'half_ppl_{t}'] / r[f'whole_ppl_{t}'] - 1:+.1%})" for t in TEXTS
        )
        lines.append(
            f"| {r['pair']} {r['target']} s{r['seed']} | {whole} | {half} [{r['layers_differing']}] | "
            f"{r['spearman_units']:.4f} | {r['whole_scan_seconds']} / {r['half_scan_seconds']} |"
        )
        ratios += [r[f"half_ppl_{t}"] / r[f"whole_ppl_{t}"] for t in TEXTS]
    if ratios:
        lines += [
            "",
            f"First halves against whole sequences: geometric mean {statistics.geometric_mean(ratios):.4f} over "
            f"{len(ratios)} comparisons, lower in {sum(x < 1 for x in ratios)}, higher in "
            f"{sum(x > 1 for x in ratios)}, "
            f"from {min(ratios) - 1:+.1%} to {max(ratios) - 1:+.1%}; the calibration's own map was one of the two "
            f"in {sum(r['calibration_map'] is not None for r in rows)} of {len(rows)} cells.",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="mxfp8-mxfp4:4.5,mxfp8-mxfp4:5,mxfp6-mxfp4:4.5", help="pair:target list")
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
