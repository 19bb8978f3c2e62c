#!/usr/bin/env python
"""Study: does grouping q/k/v and gate/up cost quality through the learning or through the constraint itself?

With the online rotation, the servable map (`offset_groups="fused"`: one format per fused matmul, as vLLM needs)
has 0.3-3.2% higher held-out perplexity than the ungrouped map of the same cell with GPTQ rounding (the quality
table, seed 0). Two things differ between the two: the calibration (grouped, the sampled maps move each group as
one, so every member's gain is measured in contexts where its group's other members share its format) and the
final knapsack (grouped, a group takes the high format whole, worth its members' summed value per summed bit).

Each cell is calibrated here ungrouped (as the table's ungrouped row: same settings, seed and thread count) and two
maps are made from that one calibration's values (learned offsets blended with the KL scan):

* `ungrouped`: the ungrouped knapsack (the table's ungrouped map; checked equal to it);
* `grouped-after`: the grouped knapsack on the same values (servable).

Set beside the table's `fused` row (grouped calibration and knapsack), `grouped-after` answers the question: close
to `fused`, the learning is not what costs, the constraint is; close to `ungrouped`, learning ungrouped and
grouping at the end is the better servable recipe. Each map is evaluated rounded to nearest and by GPTQ, on the
table's held-out windows.

    python research/fused_groups.py --cells mxfp8-mxfp4:5,mxfp8-mxfp4:4.5 --threads 1
    python research/fused_groups.py --report-only

Rows are appended to `research/fused_groups.jsonl` as they finish; a finished row is skipped on rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_quality import RUNS, Runner, Sweep, _identity  # noqa: E402

from optimum_dmx.calibration import CalibrationSettings, calibrate, get_preset, round_weights_by_gptq  # noqa: E402
from optimum_dmx.calibration.budget import blended_value, budget_limit, layer_costs  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.calibration.trainer import KL_WEIGHT, blended_format_map  # noqa: E402
from optimum_dmx.continuous import get_format_pair  # noqa: E402
from optimum_dmx.evaluation import evaluate_perplexity  # noqa: E402
from optimum_dmx.nn import emulate_format_map, format_map_bits  # noqa: E402

from common import append_json_line, benchmark_model, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
ROTATION = "online_block_hadamard"
MAPS = ["ungrouped", "grouped-after"]
ROUNDINGS = ["rtn", "gptq"]


def sweep_for(pair: str, target: str, seed: int, groups: str, rounding: str) -> Sweep:
    return Sweep(
        methods=["dmx"],
        pairs=[pair],
        targets=[float(target)],
        seeds=[seed],
        rotation=ROTATION,
        offset_groups=groups,
        bit_average="weighted",
        weight_rounding=rounding,
    )


def table_row(pair: str, target: str, seed: int, groups: str, rounding: str) -> dict | None:
    """The quality table's run of the cell with these groups and rounding, if it has one."""
    key = sweep_for(pair, target, seed, groups, rounding).key("dmx", pair, target, seed)
    rows = [r for r in read_json_lines(RUNS) if _identity(r) == _identity(key)]
    return rows[0] if rows else None


def cell_settings(runner: Runner, pair: str, target: str, seed: int, offset_groups: str) -> CalibrationSettings:
    """The default recipe's settings for the cell at the sweep's preset sizes, weighted budget."""
    return CalibrationSettings(
        method="dmx",
        format_pair=pair,
        target_bits=float(target),
        seed=seed,
        offset_groups=offset_groups,
        bit_average="weighted",
        **get_preset(runner.sweep.preset).settings(),
    )


def evaluate_map(runner: Runner, format_map: dict[str, str], sequences: torch.Tensor, rounding: str) -> dict:
    """The map's bits and held-out perplexities on the table's windows, its weights rounded to nearest or by GPTQ
    (on `sequences` at the preset's sizes; then also the seconds GPTQ took)."""
    preset = get_preset(runner.sweep.preset)
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in format_map}
    row = {k: round(v, 4) for k, v in format_map_bits(format_map, shapes).items()}
    with emulate_format_map(runner.model, format_map):
        if rounding == "gptq":
            start = time.perf_counter()
            linears = {name: runner.targets[name] for name in format_map}
            round_weights_by_gptq(runner.model, linears, sequences[: preset.gptq_samples], preset.batch_size)
            row["gptq_seconds"] = round(time.perf_counter() - start, 1)
        for name, text in runner.texts.items():
            result = evaluate_perplexity(
                runner.model, runner.tokenizer, text, runner.sweep.eval_seq_len, runner.sweep.eval_tokens, batch_size=4
            )
            row[f"ppl_{name}"] = round(result.perplexity, 4)
    return row


def run_cell(runner: Runner, pair: str, target: str, seed: int, done: set[tuple]) -> None:
    if all((pair, target, seed, m, r) in done for m in MAPS for r in ROUNDINGS):
        return
    settings = cell_settings(runner, pair, target, seed, "none")
    sequences = runner.calibration_ids(seed)
    result = calibrate(runner.model, sequences, settings)
    shapes = {name: tuple(runner.targets[name].weight.shape) for name in result.format_map}
    values = blended_value(result.beta_hat, result.kl_sensitivities, KL_WEIGHT)
    grouped = dataclasses.replace(settings, offset_groups="fused")
    maps = {
        "ungrouped": result.format_map,
        "grouped-after": blended_format_map(result.beta_hat, result.kl_sensitivities, shapes, grouped),
    }
    committed = table_row(pair, target, seed, "none", "rtn")
    same_as_table = committed is not None and committed["format_map"] == result.format_map
    for map_name, format_map in maps.items():
        for rounding in ROUNDINGS:
            if (pair, target, seed, map_name, rounding) in done:
                continue
            row = {"pair": pair, "target": target, "seed": seed, "map": map_name, "rounding": rounding}
            row.update(evaluate_map(runner, format_map, sequences, rounding))
            row["calibration_seconds"] = round(result.seconds, 1)
            row["values"] = {name: round(value, 6) for name, value in values.items()}  # maps can be re-derived
            row["ungrouped_map_as_table"] = same_as_table
            row["format_map"] = format_map
            append_json_line(RESULTS, row)


def report(rows: list[dict]) -> str:
    lines = [
        "Held-out perplexity, Moby Dick / Pride and Prejudice (each over the table's `fused` row of the cell):",
        "",
        "| pair, bits, seed | rounding | fused (table) | grouped-after | ungrouped | high layers: fused / after / "
        "ungrouped |",
        "|---|---|---|---|---|---|",
    ]
    texts = ["moby_dick", "pride_prejudice"]
    for pair, target, seed in sorted({(r["pair"], r["target"], r["seed"]) for r in rows}):
        for rounding in ROUNDINGS:
            fused = table_row(pair, target, seed, "fused", rounding)
            found = {
                r["map"]: r
                for r in rows
                if (r["pair"], r["target"], r["seed"], r["rounding"]) == (pair, target, seed, rounding)
            }
            if not found:
                continue
            cells = [_cell(fused, None, texts)]
            cells += [_cell(found.get(m), fused, texts) for m in ("grouped-after", "ungrouped")]
            counts = [_high_layers(r) for r in (fused, found.get("grouped-after"), found.get("ungrouped"))]
            lines.append(
                f"| {pair} {target} s{seed} | {rounding} | " + " | ".join(cells) + " | " + " / ".join(counts) + " |"
            )
    same = {r["ungrouped_map_as_table"] for r in rows}
    lines += ["", f"Ungrouped map equal to the table's ungrouped row: {', '.join(sorted(map(str, same)))}."]
    exact = [
        f"{r['pair']} {r['target']} s{r['seed']}: {exact_grouped_map(r) == r['format_map']}"
        for r in rows
        if r["map"] == "grouped-after" and r["rounding"] == "rtn" and "values" in r
    ]
    if exact:
        lines.append(f"Exact grouped knapsack on the same values picks the greedy's map: {'; '.join(exact)}.")
    return "\n".join(lines)


def grouped_units_by_cost(shapes: dict[str, tuple[int, ...]], pair) -> dict[float, list[tuple[str, ...]]]:
    """The grouped budget's units (fused groups, then layers alone; `shapes` by layer name), by their cost in the
    weighted budget (`calibration.budget.layer_costs`): units of equal cost can trade places without changing the
    bits."""
    names = list(shapes)
    low, high = layer_costs(list(shapes.values()), pair, "weighted")
    index = {name: i for i, name in enumerate(names)}
    grouped = [tuple(group) for group in offset_groups("fused", names)]
    units = grouped + [(name,) for name in names if not any(name in group for group in grouped)]
    by_cost: dict[float, list[tuple[str, ...]]] = {}
    for unit in units:
        by_cost.setdefault(round(sum((high[index[n]] - low[index[n]]).item() for n in unit), 9), []).append(unit)
    return by_cost


def exact_grouped_map(row: dict) -> dict[str, str]:
    """The grouped map of greatest summed value within the row's budget, by enumeration: units of equal cost are
    interchangeable but for their values, so the best map takes, for some count per cost, the units of that cost
    with the highest values; every combination of counts is tried (SmolLM2: 4 costs of 30 units each)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(benchmark_model()))
    values = row["values"]
    names = list(values)
    shapes = {name: tuple(model.get_submodule(name).weight.shape) for name in names}
    pair = get_format_pair(row["pair"])
    low, high = layer_costs(list(shapes.values()), pair, "weighted")
    room = budget_limit(low, high, pair, float(row["target"])) - low.sum().item()
    by_cost = {
        cost: [(sum(values[n] for n in unit), unit) for unit in units]
        for cost, units in grouped_units_by_cost(shapes, pair).items()
    }
    costs = sorted(by_cost)
    for cost in costs:
        by_cost[cost].sort(key=lambda item: -item[0])
    best, best_counts = -float("inf"), None
    for counts in itertools.product(*(range(len(by_cost[c]) + 1) for c in costs)):
        if sum(n * c for n, c in zip(counts, costs)) > room + 1e-6:
            continue
        value = sum(v for n, c in zip(counts, costs) for v, _ in by_cost[c][:n])
        if value > best:
            best, best_counts = value, counts
    raised = {name for n, c in zip(best_counts, costs) for _, unit in by_cost[c][:n] for name in unit}
    return {name: (pair.high if name in raised else pair.low).name for name in names}


def _cell(row: dict | None, reference: dict | None, texts: list[str]) -> str:
    if row is None:
        return "-"
    shown = []
    for text in texts:
        value = row[f"ppl_{text}"]
        ratio = "" if reference is None else f" ({value / reference[f'ppl_{text}'] - 1:+.1%})"
        shown.append(f"{value:.2f}{ratio}")
    return " / ".join(shown)


def _high_layers(row: dict | None) -> str:
    if row is None:
        return "-"
    low = get_format_pair(row["pair"]).low.name
    return str(sum(fmt != low for fmt in row["format_map"].values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="mxfp8-mxfp4:5", help="comma list of PAIR:TARGET")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.report_only:
        done = {(r["pair"], r["target"], r["seed"], r["map"], r["rounding"]) for r in read_json_lines(RESULTS)}
        runner = Runner(sweep_for("mxfp8-mxfp4", "5", 0, "none", "rtn"))
        for seed in map(int, args.seeds.split(",")):
            for cell in args.cells.split(","):
                pair, target = cell.split(":")
                run_cell(runner, pair, target, seed, done)
    print(report(read_json_lines(RESULTS)))


if __name__ == "__main__":
    main()
