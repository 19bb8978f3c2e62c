#!/usr/bin/env python
"""Study: why GPTQ rounding loses to round-to-nearest on Pride and Prejudice for the MXFP6-pair 5-bit map with
learned rotations (the quality table: +1.8% at both seeds, while it wins on Moby Dick and in 32 of 34 dMX cells).

For each seed, the cell's calibrated model (the learned rotation merged, kept in the benchmark cache by
`bench_quality.py --learn-rotations`) and its map (from `benchmarks/results/quality_runs.jsonl`) are rounded
several ways and evaluated on more text than the table reads:

* rounding: `rtn`; `gptq` (every layer, as the table's GPTQ row); `gptq-low` (GPTQ on the MXFP4 layers only,
  the E2M3 layers to nearest); `gptq-high` (the reverse);
* model: `learned` (the cell's learned rotation) or `random` (the same map on the random Hadamard rotation the
  learning started from, no learning): tells whether the loss comes with the learned rotation;
* texts: Pride and Prejudice and Moby Dick from 10% in (the table's windows) and from 50% in (other windows of the
  same books), and the first 64 calibration sequences GPTQ itself read (in-sample).

    python research/gptq_learned_rotation.py --seeds 0 --threads 1 &
    python research/gptq_learned_rotation.py --seeds 1 --threads 1 &
    python research/gptq_learned_rotation.py --report-only

Rows are appended to `research/gptq_learned_rotation.jsonl` as they finish; a finished row is skipped on rerun.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_quality import RUNS, SKIPPED, Runner, Sweep, _identity  # noqa: E402

from optimum_dmx.calibration import get_preset, round_weights_by_gptq  # noqa: E402
from optimum_dmx.evaluation import evaluate_perplexity  # noqa: E402
from optimum_dmx.nn import emulate_format_map, linear_modules_to_quantize  # noqa: E402

from common import append_json_line, benchmark_texts, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
PAIR, TARGET, LOW = "mxfp6-mxfp4", "5", "mxfp4_e2m1"
ROUNDINGS = ["rtn", "gptq", "gptq-low", "gptq-high"]
MODELS = ["learned", "random"]
OFFSETS = [0.1, 0.5]
IN_SAMPLE = 64  # calibration sequences read back for the in-sample perplexity


def sweep_for(seed: int) -> Sweep:
    return Sweep(
        methods=["dmx"],
        pairs=[PAIR],
        targets=[float(TARGET)],
        seeds=[seed],
        rotation="hadamard",
        learn_rotations=True,
        bit_average="weighted",
    )


def in_sample_perplexity(model: torch.nn.Module, sequences: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over `sequences` (every position predicted, as the calibration loss reads them)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in sequences.split(batch_size):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            positions = batch.numel() - len(batch)
            total, count = total + loss.item() * positions, count + positions
    return math.exp(total / count)


def run_seed(seed: int, done: set[tuple], models: list[str], roundings: list[str]) -> None:
    from safetensors.torch import load_model

    sweep = sweep_for(seed)
    runner = Runner(sweep)
    key = sweep.key("dmx", PAIR, TARGET, seed)
    known = [r for r in read_json_lines(RUNS) if _identity(r) == _identity(key)]
    if not known:
        raise SystemExit(f"no round-to-nearest run of the cell in {RUNS}: run bench_quality.py for it first")
    format_map = known[0]["format_map"]
    weights = runner.learned_weights("dmx", PAIR, TARGET, seed)
    if not weights.exists():
        raise SystemExit(f"the cell's learned model {weights} is not in the benchmark cache")
    sequences = runner.calibration_ids(seed)
    preset = get_preset(sweep.preset)
    texts = {}
    for name, path in benchmark_texts().evaluation.items():
        whole = Path(path).read_text(encoding="utf-8")
        for offset in OFFSETS:
            texts[f"{name}@{offset:g}"] = whole[int(len(whole) * offset) :]
    for model_kind in models:
        for rounding in roundings:
            if all((seed, model_kind, rounding, t) in done for t in [*texts, "in_sample"]):
                continue
            model = copy.deepcopy(runner.model)
            if model_kind == "learned":
                load_model(model, weights)
            float_linears = linear_modules_to_quantize(model, SKIPPED)
            with emulate_format_map(model, format_map):
                seconds = 0.0
                if rounding != "rtn":
                    chosen = {
                        name: float_linears[name]
                        for name, fmt in format_map.items()
                        if rounding == "gptq" or (fmt == LOW) == (rounding == "gptq-low")
                    }
                    start = time.perf_counter()
                    round_weights_by_gptq(model, chosen, sequences, preset.batch_size)
                    seconds = time.perf_counter() - start
                results = {}
                for name, text in texts.items():
                    results[name] = evaluate_perplexity(
                        model, runner.tokenizer, text, sweep.eval_seq_len, sweep.eval_tokens, batch_size=4
                    ).perplexity
                results["in_sample"] = in_sample_perplexity(model, sequences[:IN_SAMPLE])
            for text, perplexity in results.items():
                row = {"seed": seed, "model": model_kind, "rounding": rounding, "text": text}
                row.update(perplexity=round(perplexity, 4), gptq_seconds=round(seconds, 1))
                append_json_line(RESULTS, row)


def report(rows: list[dict]) -> str:
    texts = sorted({r["text"] for r in rows})
    lines = [
        "| seed | model | rounding | " + " | ".join(texts) + " |",
        "|---|---|---|" + "---|" * len(texts),
    ]
    table = {(r["seed"], r["model"], r["rounding"], r["text"]): r["perplexity"] for r in rows}
    for seed in sorted({r["seed"] for r in rows}):
        for model in MODELS:
            for rounding in ROUNDINGS:
                cells = [table.get((seed, model, rounding, t)) for t in texts]
                if all(c is None for c in cells):
                    continue
                rtn = [table.get((seed, model, "rtn", t)) for t in texts]
                shown = [_cell(c, None if rounding == "rtn" else r) for c, r in zip(cells, rtn)]
                lines.append(f"| {seed} | {model} | {rounding} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def _cell(perplexity: float | None, rtn: float | None) -> str:
    if perplexity is None:
        return "-"
    return f"{perplexity:.2f}" + ("" if rtn is None else f" ({perplexity / rtn - 1:+.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of learned, random")
    parser.add_argument("--roundings", default=",".join(ROUNDINGS), help=f"comma list of {', '.join(ROUNDINGS)}")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.report_only:
        done = {(r["seed"], r["model"], r["rounding"], r["text"]) for r in read_json_lines(RESULTS)}
        for seed in map(int, args.seeds.split(",")):
            run_seed(seed, done, args.models.split(","), args.roundings.split(","))
    print(report(read_json_lines(RESULTS)))


if __name__ == "__main__":
    main()
