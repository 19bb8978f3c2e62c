#!/usr/bin/env python
"""Study: is there a better grouped map at the same bits than the one the grouped knapsack picks?

`fused_groups.py` and `group_scan.py` found that the grouped knapsack reaches the same grouped map from a grouped or
an ungrouped calibration, and from summed or whole-unit scan values, and that this map has higher held-out perplexity
than the ungrouped map at equal bits. What they left open: whether some other grouped map at the same bits is better.
This study searches for one directly, on the quantity calibration minimises: the quantized model's own loss (mean
next-token cross-entropy) on calibration sequences, weights rounded to nearest.

Start: the cell's `grouped-after` map from `fused_groups.jsonl` (the grouped knapsack on an ungrouped calibration's
values). Each fused group (q/k/v, gate/up) and each other layer is a unit; units of equal cost (in the weighted
budget's bits) can trade places without changing the bits. The search:

1. toggles each unit alone (high to low, low to high) and measures the loss change on the search sequences;
2. pairs, within each cost, the low units whose raising helped most with the high units whose lowering hurt least,
   evaluates each swap whole, and keeps a swap when it lowers the loss; repeated while swaps help, up to a budget
   of evaluations.

The search's loss is measured on `--search-sequences` calibration sequences under bfloat16 autocast (for speed); a
round of toggles always runs whole, and no round starts after `--evaluations` evaluations. The start, the searched
map and the ungrouped map are then measured in float32 on the next, unseen calibration sequences, and on the quality
table's held-out windows, rounded to nearest; with `--gptq`, a second row has the three maps' held-out perplexities
with GPTQ rounding (on the cell's calibration sequences, as the quality table rounds them), all in the same run.
Rows are appended to `grouped_map_search.jsonl`; a finished row is skipped on rerun.

    python research/grouped_map_search.py --cell mxfp8-mxfp4:4.5 --seed 0 --threads 2 --gptq
    python research/grouped_map_search.py --report-only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quality import Runner  # noqa: E402
from fused_groups import RESULTS as FUSED_GROUPS_RESULTS  # noqa: E402
from fused_groups import evaluate_map, grouped_units_by_cost, sweep_for  # noqa: E402

from optimum_dmx.continuous import get_format_pair  # noqa: E402
from optimum_dmx.nn import emulate_format_map  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")


def cell_maps(pair: str, target: str, seed: int) -> dict[str, dict[str, str]]:
    """The cell's `ungrouped` and `grouped-after` maps (rounded-to-nearest rows) from `fused_groups.jsonl`."""
    rows = read_json_lines(FUSED_GROUPS_RESULTS)
    maps = {
        r["map"]: r["format_map"]
        for r in rows
        if (r["pair"], r["target"], r["seed"], r["rounding"]) == (pair, target, seed, "rtn")
    }
    if set(maps) != {"ungrouped", "grouped-after"}:
        cells = sorted({f"{r['pair']}:{r['target']} seed {r['seed']}" for r in rows})
        raise SystemExit(f"no maps of {pair}:{target} seed {seed} in {FUSED_GROUPS_RESULTS.name}; it has {cells}")
    return maps


def model_loss(runner: Runner, format_map: dict[str, str], sequences: torch.Tensor, bfloat16: bool) -> float:
    """Mean next-token cross-entropy of the model with `format_map` (weights rounded to nearest) on `sequences`."""
    total = 0.0
    with torch.no_grad(), emulate_format_map(runner.model, format_map):
        with torch.autocast("cpu", torch.bfloat16, enabled=bfloat16):
            for batch in sequences.split(8):
                total += runner.model(batch, labels=batch).loss.float().item() * len(batch)
    return total / len(sequences)


def with_unit(format_map: dict[str, str], unit: tuple[str, ...], fmt: str) -> dict[str, str]:
    return {**format_map, **dict.fromkeys(unit, fmt)}


def search(runner: Runner, start: dict[str, str], pair_name: str, sequences: torch.Tensor, evaluations: int) -> dict:
    """Toggle each unit, then keep the equal-cost swaps that lower the loss (module docstring)."""
    pair = get_format_pair(pair_name)
    high, low = pair.high.name, pair.low.name
    by_cost = grouped_units_by_cost({name: tuple(runner.targets[name].weight.shape) for name in start}, pair)
    current, count = dict(start), 0

    def loss(format_map: dict[str, str]) -> float:
        nonlocal count
        count += 1
        return model_loss(runner, format_map, sequences, bfloat16=True)

    current_loss = start_loss = loss(current)
    accepted = []
    while count < evaluations:
        delta = {}  # the loss change of toggling each unit alone
        for units in by_cost.values():
            for unit in units:
                delta[unit] = loss(with_unit(current, unit, low if current[unit[0]] == high else high)) - current_loss
        candidates = []
        for units in by_cost.values():
            raised = sorted((u for u in units if current[u[0]] == low), key=lambda u: delta[u])  # most helpful first
            lowered = sorted((u for u in units if current[u[0]] == high), key=lambda u: delta[u])  # least harmful first
            candidates += [
                (delta[r] + delta[d], r, d) for r in raised[:4] for d in lowered[:4] if delta[r] + delta[d] < 0
            ]
        improved = False
        for _, up, down in sorted(candidates, key=lambda c: c[0]):
            if count >= evaluations:
                break
            if current[up[0]] != low or current[down[0]] != high:
                continue  # a unit already moved by a swap kept in this round
            trial = with_unit(with_unit(current, up, high), down, low)
            trial_loss = loss(trial)
            if trial_loss < current_loss:
                accepted.append({"up": list(up), "down": list(down), "loss": round(trial_loss, 6)})
                current, current_loss, improved = trial, trial_loss, True
        if not improved:
            break
    return {
        "map": current,
        "search_loss_start": round(start_loss, 6),
        "search_loss_end": round(current_loss, 6),
        "swaps": accepted,
        "evaluations": count,
    }


MAPS = ("grouped-after", "searched", "ungrouped")


def run_cell(runner: Runner, pair: str, target: str, seed: int, args: argparse.Namespace) -> None:
    """Search the cell's grouped map (rounded to nearest), then, with `args.gptq`, evaluate the three maps rounded by
    GPTQ; each step skipped when its row is already in `RESULTS`."""
    cell = {"pair": pair, "target": target, "seed": seed}
    done = {r["rounding"]: r for r in read_json_lines(RESULTS) if {k: r[k] for k in cell} == cell}
    sequences = runner.calibration_ids(seed)
    if "rtn" not in done:
        maps = cell_maps(pair, target, seed)
        searched_on = sequences[: args.search_sequences]
        unseen = sequences[args.search_sequences : 2 * args.search_sequences]
        start = time.perf_counter()
        found = search(runner, maps["grouped-after"], pair, searched_on, args.evaluations)
        row = {**cell, "rounding": "rtn", "search_sequences": args.search_sequences, **found}
        row["search_seconds"] = round(time.perf_counter() - start, 1)
        row["map_changed_layers"] = sum(found["map"][n] != maps["grouped-after"][n] for n in found["map"])
        maps["searched"] = found["map"]
        for name in MAPS:
            row[f"unseen_loss_{name}"] = round(model_loss(runner, maps[name], unseen, bfloat16=False), 6)
            row.update(_held_out(runner, name, maps[name], sequences, "rtn"))
        append_json_line(RESULTS, done.setdefault("rtn", row))
    if args.gptq and "gptq" not in done:
        maps = {**cell_maps(pair, target, seed), "searched": done["rtn"]["map"]}
        row = {**cell, "rounding": "gptq"}
        for name in MAPS:
            row.update(_held_out(runner, name, maps[name], sequences, "gptq"))
        append_json_line(RESULTS, row)


def _held_out(runner: Runner, name: str, format_map: dict[str, str], sequences: torch.Tensor, rounding: str) -> dict:
    """The map's weighted bits and held-out perplexities, under `name`."""
    result = evaluate_map(runner, format_map, sequences, rounding)
    return {
        f"bits_{name}": result["bits_weighted"],
        f"ppl_{name}": {key[4:]: value for key, value in result.items() if key.startswith("ppl_")},
    }


def report(rows: list[dict]) -> str:
    """The search's losses, and each map's held-out perplexities (Moby Dick / Pride and Prejudice)."""
    lines = [
        "| pair, bits, seed | rounding | search loss: start -> searched (evaluations, swaps) | unseen loss: "
        "grouped-after / searched / ungrouped | grouped-after | searched | ungrouped |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        search = unseen = "-"
        if r["rounding"] == "rtn":
            search = (
                f"{r['search_loss_start']:.4f} -> {r['search_loss_end']:.4f} ({r['evaluations']}, {len(r['swaps'])})"
            )
            unseen = " / ".join(f"{r[f'unseen_loss_{m}']:.4f}" for m in MAPS)
        reference = r["ppl_grouped-after"]
        ppl = [
            " / ".join(
                f"{r[f'ppl_{m}'][text]:.2f}"
                + ("" if m == MAPS[0] else f" ({r[f'ppl_{m}'][text] / reference[text] - 1:+.1%})")
                for text in ("moby_dick", "pride_prejudice")
            )
            for m in MAPS
        ]
        lines.append(
            f"| {r['pair']} {r['target']} s{r['seed']} | {r['rounding']} | {search} | {unseen} | {' | '.join(ppl)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="mxfp8-mxfp4:4.5", help="PAIR:TARGET, a cell of fused_groups.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--search-sequences", type=int, default=32)
    parser.add_argument("--evaluations", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gptq", action="store_true", help="also evaluate the three maps rounded by GPTQ")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.report_only:
        pair, target = args.cell.split(":")
        run_cell(Runner(sweep_for(pair, target, args.seed, "none", "rtn")), pair, target, args.seed, args)
    print(report(read_json_lines(RESULTS)))


if __name__ == "__main__":
    main()
