#!/usr/bin/env python
"""Ablation: can the blend weight be chosen per run by the loss on held-out calibration sequences?

The default recipe ranks layers by the mean of the learned offsets' rank and KL pre-selection's rank
(`kl_weight=0.5`). This script asks whether a run could pick the weight itself, the way a user would validate a
hyper-parameter: for every cell of the Pareto benchmark it blends the saved `dmx` offsets with the cached KL scan
at each weight of `--weights`, meets the budget with the same rule, and measures the model's cross-entropy on
`--validation` calibration sequences that no method trained on (the seed's draw continued past the trained
ones, same five Austen novels). It then reports the weight that loss selects and the held-out perplexity of that
map (from `pareto.csv` where the sweep measured it: weight 0 is the `dmx` row, 0.5 `dmx_kl`, 1 `kl`; measured
here, with the sweep's protocol, otherwise), against KL's. With `--every-weight` it measures every candidate's map
on the held-out texts too and adds a robustness table: how the blend compares with KL at each weight, no
selection involved.

It reads the saved runs of `pareto.py` (run those first) and keeps one line per cell in
`<out>/runs/blend_selection_V<validation>_seed<seed>.jsonl`, rewritten as cells finish, so an interrupted run
resumes and seeds can run in separate processes:

    python benchmarks/blend_selection.py --threads 1 --seeds 0 --every-weight     # and --seeds 1 beside it
    python benchmarks/blend_selection.py --threads 1 --every-weight               # the report, from the caches
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import time
from pathlib import Path

import torch

from optimum_dmx.calibration import CalibrationResult, build_calibration_batches
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.nn.surgery import emulate_format_map
from pareto import DEFAULT_TARGETS, FORMAT_PAIRS, Benchmark, Runner

PARETO_METHOD_AT_WEIGHT = {0.0: "dmx", 0.5: "dmx_kl", 1.0: "kl"}


@torch.no_grad()
def validation_loss(model: torch.nn.Module, format_map: dict[str, str], ids: torch.Tensor, batch_size: int) -> float:
    """Mean cross-entropy of `model` quantized to `format_map` on the rows of `ids` (equal-length rows)."""
    with emulate_format_map(model, format_map):
        losses = [model(input_ids=b, labels=b, use_cache=False).loss.item() for b in ids.split(batch_size)]
    return sum(losses) / len(losses)


def selected_weight(losses: dict[str, float]) -> str:
    """The candidate below 1 (1 is KL pre-selection itself) with the lowest validation loss."""
    candidates = {w: loss for w, loss in losses.items() if float(w) < 1}
    return min(candidates, key=candidates.get)


def measure(runner: Runner, weights: list[float], validation: int, seed: int, every_weight: bool,
            cache: Path) -> list[dict]:
    """One record per cell of `seed`: validation losses per weight, and held-out perplexities of the maps that
    pareto.csv lacks (the selected one, or with `every_weight` all of them). Resumes from `cache`."""
    bench, model = runner.bench, runner.model
    records = {(r["pair"], r["target"]): r for r in map(json.loads, cache.read_text().splitlines())} \
        if cache.exists() else {}
    trained = bench.steps * bench.batch_size
    ids = build_calibration_batches(bench.calibration, runner.tokenizer, bench.seq_len, trained + validation, seed)
    if not torch.equal(ids[:trained], runner.input_ids(seed)):
        raise RuntimeError("the longer draw must start with the trained sequences")
    held_out = ids[trained:]
    for pair in FORMAT_PAIRS:
        for target in (f"{t:g}" for t in DEFAULT_TARGETS[pair]):
            record = records.setdefault((pair, target), {"pair": pair, "target": target, "seed": seed, "losses": {},
                                                         "ppl": {}})
            learned = CalibrationResult(**json.loads(runner.run_file("dmx", pair, target, seed).read_text()))
            settings = bench.settings("dmx_kl", pair, float(target), seed)
            maps = {f"{w:g}": runner.blend_learned_offsets(learned, dataclasses.replace(settings, kl_weight=w),
                                                           seed).format_map for w in weights}
            for weight, format_map in maps.items():
                if weight not in record["losses"]:
                    start = time.perf_counter()
                    record["losses"][weight] = validation_loss(model, format_map, held_out, 2 * bench.batch_size)
                    print(f"{pair} {target} seed {seed} weight {weight}: {record['losses'][weight]:.4f} "
                          f"({time.perf_counter() - start:.0f} s)", flush=True)
            wanted = maps if every_weight else [selected_weight(record["losses"])]
            for weight in wanted:
                if float(weight) in PARETO_METHOD_AT_WEIGHT or weight in record["ppl"]:
                    continue
                with emulate_format_map(model, maps[weight]):
                    record["ppl"][weight] = [
                        evaluate_perplexity(model, runner.tokenizer, text, bench.eval_seq_len, bench.eval_tokens,
                                            batch_size=4).perplexity
                        for text in runner.texts.values()
                    ]
                print(f"{pair} {target} seed {seed} weight {weight}: held-out {record['ppl'][weight]}", flush=True)
            cache.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    return list(records.values())


def report(records: list[dict], pareto_csv: Path, validation: int, seq_len: int) -> list[str]:
    rows = [r for r in csv.DictReader(pareto_csv.open()) if r["rotation"] == "none"]
    texts = [c[len("ppl_"):] for c in rows[0] if c.startswith("ppl_")]

    def held_out(record: dict, weight: str) -> list[float] | None:
        """The map's held-out perplexities: measured here, or the pareto.csv row of that weight's method."""
        if weight in record["ppl"]:
            return record["ppl"][weight]
        method = PARETO_METHOD_AT_WEIGHT.get(float(weight))
        for r in rows:
            if (r["method"], r["pair"], r["target"], r["seed"]) == (method, record["pair"], record["target"],
                                                                     str(record["seed"])):
                return [float(r[f"ppl_{t}"]) for t in texts]
        return None

    def shown(values: list[float] | None) -> str:
        return " / ".join(f"{v:.2f}" for v in values) if values else "not measured"

    def versus(values: list[float] | None, kl: list[float] | None) -> str:
        return " / ".join(f"{100 * (a / b - 1):+.1f}%" for a, b in zip(values, kl)) if values and kl else "-"

    weights = list(records[0]["losses"])
    lines = [
        f"Validation: cross-entropy on {validation} x {seq_len} calibration tokens no method trained on. Candidates: "
        f"kl_weight < 1 (1 is KL pre-selection itself, shown for reference). Held-out perplexity ({' / '.join(texts)}).",
        "",
        "| pair | target | seed | " + " | ".join(f"loss w={w}" for w in weights)
        + " | selected | selected PPL | KL PPL | selected vs KL | default (w=0.5) vs KL |",
        "|---" * (8 + len(weights)) + "|",
    ]
    for r in records:
        selected = selected_weight(r["losses"])
        kl = held_out(r, "1")
        lines.append(
            f"| {r['pair']} | {r['target']} | {r['seed']} | "
            + " | ".join(f"**{loss:.4f}**" if w == selected else f"{loss:.4f}" for w, loss in r["losses"].items())
            + f" | {selected} | {shown(held_out(r, selected))} | {shown(kl)} | {versus(held_out(r, selected), kl)} | "
            + f"{versus(held_out(r, '0.5'), kl)} |"
        )
    candidates = [w for w in weights if float(w) < 1]
    if all(held_out(r, w) for r in records for w in candidates):
        lines += ["", "Robustness: every candidate's map against KL on the held-out texts (no selection).", "",
                  "| pair | target | seed | " + " | ".join(f"w={w} vs KL" for w in candidates) + " |",
                  "|---" * (3 + len(candidates)) + "|"]
        for r in records:
            kl = held_out(r, "1")
            lines.append(f"| {r['pair']} | {r['target']} | {r['seed']} | "
                         + " | ".join(versus(held_out(r, w), kl) for w in candidates) + " |")
        wins = {w: sum(a < b for r in records for a, b in zip(held_out(r, w), held_out(r, "1"))) for w in candidates}
        total = len(records) * len(texts)
        lines += ["", "Lower than KL: " + ", ".join(f"w={w} {n} of {total}" for w, n in wins.items()) + "."]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--weights", default="0,0.25,0.5,0.75,1", help="comma list of kl_weight candidates")
    p.add_argument("--validation", type=int, default=32, help="held-out calibration sequences")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--every-weight", action="store_true",
                   help="also measure the held-out perplexity of every candidate's map (a robustness table)")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    bench = Benchmark(out=a.out)
    runner = Runner(bench)
    records = [
        record
        for seed in (int(s) for s in a.seeds.split(","))
        for record in measure(runner, [float(w) for w in a.weights.split(",")], a.validation, seed, a.every_weight,
                              a.out / "runs" / f"blend_selection_V{a.validation}_seed{seed}.jsonl")
    ]
    lines = report(records, a.out / "pareto.csv", a.validation, bench.seq_len)
    (a.out / "blend_selection.md").write_text(
        "# Choosing the blend weight by held-out calibration loss\n\nCommand: `python benchmarks/blend_selection.py "
        f"--threads 1 --seeds {a.seeds}{' --every-weight' if a.every_weight else ''}`\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
