#!/usr/bin/env python
"""Study: is a fused group worth its members' summed KL sensitivity, and does scanning the group whole make a better
servable map?

With `offset_groups="fused"` (one format per q/k/v and per gate/up, as vLLM's fused matmuls need) the budget values
a group as its members' summed values, the KL part of which comes from scanning each member alone in the low format
(`calibration.sensitivity`). The group only ever goes low whole, so the divergence that matters is that of all its
members low together. `fused_groups.py` showed that the learning is not what makes grouped maps worse than
ungrouped ones; this study measures the additive value itself.

Each cell is calibrated grouped (the quality table's servable row: `online_block_hadamard`, weighted budget, the
default recipe) and, on the scan's own sequences, every unit of the grouped knapsack (a fused group, or a layer
alone) is put in the low format and its divergence from the float model measured (whole next-token distributions,
every unit by the same full pass; each group's members are also scanned alone that way, for `additivity`). Two
maps from the same learned offsets:

* `fused`: the calibration's own map (its scan, each member alone, summed per group);
* `group-scan`: the same blend and knapsack with each unit's divergence scanned whole (split evenly among a
  group's members: only a unit's sum enters the grouped knapsack and the blend's scale).

Each map is evaluated rounded to nearest and by GPTQ on the quality table's held-out windows. The rows also keep,
per group, the whole group's divergence against its members' sum (`additivity`).

    python research/group_scan.py --cells mxfp8-mxfp4:4.5,mxfp8-mxfp4:5,mxfp6-mxfp4:4.5 --threads 2
    python research/group_scan.py --report-only

Rows are appended to `research/group_scan.jsonl` as they finish; a finished row is skipped on rerun.
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

from optimum_dmx.calibration import CalibrationSettings, calibrate  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.calibration.sensitivity import (  # noqa: E402
    KL_SAMPLES,
    NextTokenReference,
    next_token_kl,
    next_token_log_probs,
)
from optimum_dmx.calibration.trainer import blended_format_map  # noqa: E402
from optimum_dmx.continuous import get_format_pair  # noqa: E402
from optimum_dmx.nn import emulate_format_map  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
ROTATION = "online_block_hadamard"
MAPS = ["fused", "group-scan"]
ROUNDINGS = ["rtn", "gptq"]


@torch.no_grad()
def unit_divergences(
    model: torch.nn.Module, input_ids: torch.Tensor, units: list[tuple[str, ...]], settings: CalibrationSettings
) -> dict[tuple[str, ...], float]:
    """KL(float || the unit's layers in the low format, every other layer float), nats per token, for each unit,
    over the scan's sequences (the first `KL_SAMPLES`) by whole passes."""
    low = get_format_pair(settings.format_pair).low.name
    batches = input_ids[:KL_SAMPLES].split(settings.batch_size)
    with emulate_format_map(model, {}):
        references = [NextTokenReference.from_log_probs(next_token_log_probs(model, b)) for b in batches]
    divergences = {}
    tokens = input_ids[:KL_SAMPLES].numel()
    for unit in units:
        with emulate_format_map(
            model, dict.fromkeys(unit, low), settings.block_size, settings.quantize_activations, settings.scale_rule
        ):
            total = sum(next_token_kl(r, next_token_log_probs(model, b)).item() for r, b in zip(references, batches))
        divergences[unit] = total / tokens
    return divergences


def run_cell(runner: Runner, pair: str, target: str, seed: int, done: set[tuple]) -> None:
    if all((pair, target, seed, m, r) in done for m in MAPS for r in ROUNDINGS):
        return
    settings = cell_settings(runner, pair, target, seed, "fused")
    sequences = runner.calibration_ids(seed)
    result = calibrate(runner.model, sequences, settings)
    names = list(result.format_map)
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in names}
    groups = offset_groups("fused", names)
    units = groups + [(name,) for name in names if not any(name in group for group in groups)]
    start = time.perf_counter()
    whole = unit_divergences(runner.model, sequences, units, settings)
    scan_seconds = time.perf_counter() - start
    alone = unit_divergences(runner.model, sequences, [(name,) for group in groups for name in group], settings)
    split = {name: whole[unit] / len(unit) for unit in units for name in unit}
    maps = {
        "fused": result.format_map,
        "group-scan": blended_format_map(result.beta_hat, split, shapes, settings),
    }
    additivity = {
        ",".join(group): {
            "group": round(whole[group], 6),
            "members_alone": round(sum(alone[(n,)] for n in group), 6),
        }
        for group in groups
    }
    singles = {name: round(whole[(name,)], 6) for unit in units if len(unit) == 1 for name in unit}
    for map_name, format_map in maps.items():
        for rounding in ROUNDINGS:
            if (pair, target, seed, map_name, rounding) in done:
                continue
            row = {"pair": pair, "target": target, "seed": seed, "map": map_name, "rounding": rounding}
            row.update(evaluate_map(runner, format_map, sequences, rounding))
            row["layers_differing_from_fused"] = sum(format_map[n] != maps["fused"][n] for n in names)
            row.update(
                calibration_seconds=round(result.seconds, 1),
                library_scan_seconds=round(result.scan_seconds, 1),
                unit_scan_seconds=round(scan_seconds, 1),
                torch_threads=torch.get_num_threads(),
                additivity=additivity,
                singles_whole_pass=singles,
                format_map=format_map,
            )
            append_json_line(RESULTS, row)


def report(rows: list[dict]) -> str:
    texts = ["moby_dick", "pride_prejudice"]
    lines = [
        "Held-out perplexity, Moby Dick / Pride and Prejudice (`group-scan` against `fused`, the same calibration):",
        "",
        "| pair, bits, seed | rounding | fused | group-scan | layers differing | weighted bits: fused / group-scan |",
        "|---|---|---|---|---|---|",
    ]
    cells = sorted({(r["pair"], r["target"], r["seed"]) for r in rows})
    for cell in cells:
        for rounding in ROUNDINGS:
            found = {
                r["map"]: r for r in rows if (r["pair"], r["target"], r["seed"], r["rounding"]) == (*cell, rounding)
            }
            if set(found) != set(MAPS):
                continue
            fused, scanned = found["fused"], found["group-scan"]
            ppl = " / ".join(f"{fused[f'ppl_{t}']:.2f}" for t in texts)
            moved = " / ".join(
                f"{scanned[f'ppl_{t}']:.2f} ({scanned[f'ppl_{t}'] / fused[f'ppl_{t}'] - 1:+.1%})" for t in texts
            )
            lines.append(
                f"| {cell[0]} {cell[1]} s{cell[2]} | {rounding} | {ppl} | {moved} | "
                f"{scanned['layers_differing_from_fused']} | {fused['bits_weighted']} / {scanned['bits_weighted']} |"
            )
    lines += [
        "",
        "A group's divergence scanned whole against its members' summed divergences scanned alone (ratio; median and "
        "range over the model's 30 groups of each kind). The scan reads only the low format and the seed's sequences, "
        "so the cells of a seed that agree share a line:",
        "",
        "| cells | q/k/v | gate/up |",
        "|---|---|---|",
    ]
    by_scan: dict[str, list[str]] = {}
    for cell in cells:
        row = next(r for r in rows if (r["pair"], r["target"], r["seed"]) == cell)
        ratios: dict[str, list[float]] = {"q_proj": [], "gate_proj": []}
        for group, values in row["additivity"].items():
            kind = "q_proj" if "q_proj" in group else "gate_proj"
            ratios[kind].append(values["group"] / values["members_alone"])
        summary = " | ".join(
            f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})" for r in (ratios["q_proj"], ratios["gate_proj"])
        )
        by_scan.setdefault(summary, []).append(f"{cell[0]} {cell[1]} s{cell[2]}")
    lines += [f"| {', '.join(names)} | {summary} |" for summary, names in by_scan.items()]
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
        done = {(r["pair"], r["target"], r["seed"], r["map"], r["rounding"]) for r in read_json_lines(RESULTS)}
        runner = None
        for seed in map(int, a.seeds.split(",")):
            for cell in a.cells.split(","):
                pair, target = cell.split(":")
                if runner is None:
                    sweep = Sweep(methods=["dmx"], rotation=ROTATION, offset_groups="fused", bit_average="weighted")
                    runner = Runner(dataclasses.replace(sweep, pairs=[pair]))
                run_cell(runner, pair, target, seed, done)
    print(report(read_json_lines(RESULTS)))


if __name__ == "__main__":
    main()
