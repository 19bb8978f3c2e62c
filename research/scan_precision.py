#!/usr/bin/env python
"""Study: does the KL scan in bfloat16 make the maps the scan in float32 makes?

The library's scan (`calibration.sensitivity`) runs its matrix products in bfloat16 on a float32 model where the
device multiplies bfloat16 natively (`matmul_dtype="auto"`): 0.46x its time on SmolLM2-135M with AMX, ranking the
budget's units as float32 does at Spearman 0.997 (`benchmarks/results/sensitivity.md`). This study measures what
that does to the maps the default recipe makes from the same learned offsets.

Each cell is calibrated as `group_scan.py`'s `library` rows were (the servable configuration:
`online_block_hadamard`, fused groups, weighted budget, the default recipe), now with the scan in bfloat16
(`bfloat16`: the calibration's own map). The scan then runs again on the same sequences in float32 and the map is
rebuilt from the same offsets with its values (`float32`: the library's map before this change); that map must equal
`group_scan.jsonl`'s stored `library` map of the cell (`float32_map_as_stored`: the calibration reproduced), whose
perplexities are then the float32 map's. Where the two maps differ, the bfloat16 map is evaluated rounded to
nearest and by GPTQ on the quality table's held-out windows.

    python research/scan_precision.py --cells mxfp8-mxfp4:4.5,mxfp8-mxfp4:5,mxfp6-mxfp4:4.5 --seeds 0 --threads 2
    python research/scan_precision.py --report-only

Rows are appended to `research/scan_precision.jsonl` as they finish; a finished cell is skipped on rerun.
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
from group_scan import ROTATION, ROUNDINGS, TEXTS  # noqa: E402

from optimum_dmx.calibration import calibrate, kl_sensitivities  # noqa: E402
from optimum_dmx.calibration.trainer import blended_format_map  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
STORED = Path(__file__).with_name("group_scan.jsonl")


def run_cell(runner: Runner, pair: str, target: str, seed: int, rows: list[dict]) -> None:
    cell = (pair, target, seed)
    if any((r["pair"], r["target"], r["seed"]) == cell for r in rows):
        return
    stored = {
        r["rounding"]: r
        for r in read_json_lines(STORED)
        if (r["pair"], r["target"], r["seed"], r["map"]) == (*cell, "library")
    }
    settings = cell_settings(runner, pair, target, seed, "fused")
    sequences = runner.calibration_ids(seed)
    result = calibrate(runner.model, sequences, settings)
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in result.format_map}
    start = time.perf_counter()
    in_float32 = kl_sensitivities(runner.model, sequences, settings, progress=False, matmul_dtype=torch.float32)
    float32_seconds = time.perf_counter() - start
    float32_map = blended_format_map(result.beta_hat, in_float32, shapes, settings)
    differing = sum(result.format_map[n] != float32_map[n] for n in float32_map)
    common = {
        "pair": pair,
        "target": target,
        "seed": seed,
        "layers_differing": differing,
        "float32_map_as_stored": bool(stored) and all(r["format_map"] == float32_map for r in stored.values()),
        "bfloat16_scan_seconds": round(result.scan_seconds, 1),
        "float32_scan_seconds": round(float32_seconds, 1),
        "calibration_seconds": round(result.seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{pair} {target} s{seed}: {differing} layers differ; {common}", flush=True)
    for rounding in ROUNDINGS:
        row = {**common, "rounding": rounding}
        for text in TEXTS:
            row[f"float32_ppl_{text}"] = stored[rounding][f"ppl_{text}"] if rounding in stored else None
        if differing:
            measured = evaluate_map(runner, result.format_map, sequences, rounding)
            row.update({f"bfloat16_ppl_{text}": measured[f"ppl_{text}"] for text in TEXTS})
        else:
            row.update({f"bfloat16_ppl_{text}": row[f"float32_ppl_{text}"] for text in TEXTS})
        append_json_line(RESULTS, {**row, "format_map": result.format_map})


def report(rows: list[dict]) -> str:
    lines = [
        "Held-out perplexity, Moby Dick / Pride and Prejudice, of the maps made from the same learned offsets with the "
        "scan in float32 and in bfloat16 (layers whose format differs in brackets):",
        "",
        "| pair, bits, seed | rounding | float32 scan | bfloat16 scan | scan seconds, float32 / bfloat16 |",
        "|---|---|---|---|---|",
    ]
    ratios = []
    for r in sorted(rows, key=lambda r: (r["pair"], r["target"], r["seed"], r["rounding"])):
        single = " / ".join(f"{r[f'float32_ppl_{t}']:.2f}" for t in TEXTS)
        half = " / ".join(
            f"{r[f'bfloat16_ppl_{t}']:.2f} ({r[f'bfloat16_ppl_{t}'] / r[f'float32_ppl_{t}'] - 1:+.1%})" for t in TEXTS
        )
        seconds = f"{r['float32_scan_seconds']} / {r['bfloat16_scan_seconds']}"
        lines.append(
            f"| {r['pair']} {r['target']} s{r['seed']} | {r['rounding']} | {single} | {half} "
            f"[{r['layers_differing']}] | {seconds} |"
        )
        ratios += [r[f"bfloat16_ppl_{t}"] / r[f"float32_ppl_{t}"] for t in TEXTS]
    if ratios:
        lines += [
            "",
            f"bfloat16 against float32: geometric mean {statistics.geometric_mean(ratios):.4f} over {len(ratios)} "
            f"comparisons, lower in {sum(x < 1 for x in ratios)}, higher in {sum(x > 1 for x in ratios)}; the float32 "
            f"map equals the stored `library` map of `group_scan.jsonl` in "
            f"{sum(r['float32_map_as_stored'] for r in rows if r['rounding'] == 'gptq')} of "
            f"{sum(r['rounding'] == 'gptq' for r in rows)} cells.",
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
