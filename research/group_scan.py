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
every unit by the same full pass; each group's members are also scanned alone that way, for `additivity`). Maps
from the same learned offsets:

* `fused`: the blend and knapsack with the library's scan of each member alone, summed per group
  (`kl_sensitivities(..., groups=())`): the library's rule until the scan took groups whole;
* `group-scan`: the same blend and knapsack with each unit's divergence scanned whole by full passes (split evenly
  among a group's members: only a unit's sum enters the grouped knapsack and the blend's scale);
* `library`: the calibration's own map, now that the library's scan takes each group whole (`group-scan`'s rule,
  with the library's passes: the decoder layers before a unit replayed, the divergence on the vocabulary's head).

Each map is evaluated rounded to nearest and by GPTQ on the quality table's held-out windows. The rows also keep,
per group, the whole group's divergence against its members' sum (`additivity`). A cell whose `fused` and
`group-scan` rows exist is calibrated again for its `library` rows only; its `fused` map is rebuilt and compared with
the stored one (`fused_map_as_stored`: the calibration reproduced).

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
    kl_sensitivities,
    next_token_kl,
    next_token_log_probs,
)
from optimum_dmx.calibration.trainer import blended_format_map  # noqa: E402
from optimum_dmx.continuous import get_format_pair  # noqa: E402
from optimum_dmx.nn import emulate_format_map  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
ROTATION = "online_block_hadamard"
MAPS = ["fused", "group-scan", "library"]
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


def run_cell(runner: Runner, pair: str, target: str, seed: int, rows: list[dict]) -> None:
    stored = {(r["map"], r["rounding"]): r for r in rows if (r["pair"], r["target"], r["seed"]) == (pair, target, seed)}
    if all((m, r) in stored for m in MAPS for r in ROUNDINGS):
        return
    settings = cell_settings(runner, pair, target, seed, "fused")
    sequences = runner.calibration_ids(seed)
    result = calibrate(runner.model, sequences, settings)
    names = list(result.format_map)
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in names}
    start = time.perf_counter()
    members_alone = kl_sensitivities(runner.model, sequences, settings, groups=())
    members_scan_seconds = time.perf_counter() - start
    maps = {
        "fused": blended_format_map(result.beta_hat, members_alone, shapes, settings),
        "library": result.format_map,
    }
    common = {
        "calibration_seconds": round(result.seconds, 1),
        "library_scan_seconds": round(result.scan_seconds, 1),
        "members_scan_seconds": round(members_scan_seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }
    if ("fused", "rtn") in stored:
        common["fused_map_as_stored"] = stored[("fused", "rtn")]["format_map"] == maps["fused"]
        print(f"{pair} {target} s{seed}: fused map as stored: {common['fused_map_as_stored']}", flush=True)
    if any(("group-scan", r) not in stored for r in ROUNDINGS):
        groups = offset_groups("fused", names)
        units = groups + [(name,) for name in names if not any(name in group for group in groups)]
        start = time.perf_counter()
        whole = unit_divergences(runner.model, sequences, units, settings)
        common["unit_scan_seconds"] = round(time.perf_counter() - start, 1)
        alone = unit_divergences(runner.model, sequences, [(name,) for group in groups for name in group], settings)
        split = {name: whole[unit] / len(unit) for unit in units for name in unit}
        maps["group-scan"] = blended_format_map(result.beta_hat, split, shapes, settings)
        common["additivity"] = {
            ",".join(group): {
                "group": round(whole[group], 6),
                "members_alone": round(sum(alone[(n,)] for n in group), 6),
            }
            for group in groups
        }
        common["singles_whole_pass"] = {
            name: round(whole[(name,)], 6) for unit in units if len(unit) == 1 for name in unit
        }
    for map_name, format_map in maps.items():
        for rounding in ROUNDINGS:
            if (map_name, rounding) in stored:
                continue
            row = {"pair": pair, "target": target, "seed": seed, "map": map_name, "rounding": rounding}
            row.update(evaluate_map(runner, format_map, sequences, rounding))
            row["layers_differing_from_fused"] = sum(format_map[n] != maps["fused"][n] for n in names)
            row.update(common, format_map=format_map)
            append_json_line(RESULTS, row)


TEXTS = ["moby_dick", "pride_prejudice"]


def _against(row: dict | None, fused: dict) -> str:
    """`row`'s perplexities with their change from `fused`'s, and the layers it changed ("-": not measured)."""
    if row is None:
        return "-"
    change = " / ".join(f"{row[f'ppl_{t}']:.2f} ({row[f'ppl_{t}'] / fused[f'ppl_{t}'] - 1:+.1%})" for t in TEXTS)
    return f"{change} [{row['layers_differing_from_fused']}]"


def report(rows: list[dict]) -> str:
    texts = TEXTS
    lines = [
        "Held-out perplexity, Moby Dick / Pride and Prejudice (`group-scan` and `library` against `fused`, the same "
        "calibration; layers differing from `fused` in brackets):",
        "",
        "| pair, bits, seed | rounding | fused | group-scan | library |",
        "|---|---|---|---|---|",
    ]
    cells = sorted({(r["pair"], r["target"], r["seed"]) for r in rows})
    for cell in cells:
        for rounding in ROUNDINGS:
            found = {
                r["map"]: r for r in rows if (r["pair"], r["target"], r["seed"], r["rounding"]) == (*cell, rounding)
            }
            if "fused" not in found:
                continue
            fused = found["fused"]
            ppl = " / ".join(f"{fused[f'ppl_{t}']:.2f}" for t in texts)
            measured = " | ".join(_against(found.get(name), fused) for name in MAPS[1:])
            lines.append(f"| {cell[0]} {cell[1]} s{cell[2]} | {rounding} | {ppl} | {measured} |")
    for name in MAPS[1:]:
        for roundings in (ROUNDINGS, ["gptq"], ["rtn"]):
            ratios = [
                r[f"ppl_{t}"] / f[f"ppl_{t}"]
                for r in rows
                if r["map"] == name and r["rounding"] in roundings
                for f in rows
                if f["map"] == "fused" and all(f[k] == r[k] for k in ("pair", "target", "seed", "rounding"))
                for t in texts
            ]
            if ratios:
                mean = statistics.geometric_mean(ratios)
                lines.append(
                    f"{'' if len(roundings) == 1 else chr(10)}`{name}` against `fused`, {' and '.join(roundings)}: "
                    f"geometric mean {mean:.4f} over {len(ratios)} comparisons, lower in "
                    f"{sum(ratio < 1 for ratio in ratios)}."
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
        rows = read_json_lines(RESULTS)
        runner = None
        for seed in map(int, a.seeds.split(",")):
            for cell in a.cells.split(","):
                pair, target = cell.split(":")
                if runner is None:
                    sweep = Sweep(methods=["dmx"], rotation=ROTATION, offset_groups="fused", bit_average="weighted")
                    runner = Runner(dataclasses.replace(sweep, pairs=[pair]))
                run_cell(runner, pair, target, seed, rows)
    print(report(read_json_lines(RESULTS)))


if __name__ == "__main__":
    main()
