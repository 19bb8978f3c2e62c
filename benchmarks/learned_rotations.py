#!/usr/bin/env python
"""What learning the merged rotations adds over random Hadamard ones (`learn_rotations=True`), at the CPU budget.

Each run rotates the model (`--rotation`, seed 0, as `pareto.py`), calibrates a copy of it with the default recipe
(`kl_weight=0.5`, so the KL scan runs on the calibrated model) with or without learned rotations, and evaluates on
the held-out texts, on that copy (whose weights hold the learned rotations, if any), the maps that the run gives:

* `dmx_kl`: the default recipe's map; `dmx`: the learned offsets' ranking alone; `kl`: KL pre-selection on the
  run's own scan;
* `uniform_mxfp4`: every targeted linear in MXFP4 (what the rotation alone does).

With `--target 4` every drawn map is all-MXFP4, so the rotation learns for uniform MXFP4 (SpinQuant's W4A4 setting)
and only `uniform_mxfp4` is evaluated. Rows are appended to `--out` (JSON lines) as each finishes; a run already
there is skipped. `--report` prints the markdown table.

    python benchmarks/learned_rotations.py --threads 1 --target 5 --learn
    python benchmarks/learned_rotations.py --threads 1 --target 5            # the random-Hadamard baseline
    python benchmarks/learned_rotations.py --threads 1 --target 4 --learn
    python benchmarks/learned_rotations.py --report
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

from common import append_json_line, read_json_lines, run_or_report
from pareto import Benchmark, Runner

from optimum_dmx.calibration import calibrate, kl_preselection
from optimum_dmx.calibration.baselines import uniform_format_map
from optimum_dmx.calibration.budget import budget_format_map
from optimum_dmx.continuous import FORMAT_PAIRS, get_format_pair
from optimum_dmx.nn.bits import format_map_bits
from optimum_dmx.nn.rotation import LEARNABLE_ROTATIONS

OUT = Path(__file__).parent / "results" / "learned_rotations.jsonl"


def run(bench: Benchmark, pair: str, target: float, seed: int, learn: bool, out: Path) -> None:
    key = {"rotation": bench.rotation, "learn_rotations": learn, "pair": pair, "target": target, "seed": seed,
           "steps": bench.steps, "model": Path(bench.model).name}
    if any(all(row.get(k) == v for k, v in key.items()) for row in read_json_lines(out)):
        print(f"skipping {key}: already in {out}")
        return
    runner = Runner(bench)
    settings = dataclasses.replace(bench.settings("dmx_kl", pair, target, seed), learn_rotations=learn)
    if target == get_format_pair(pair).min_bits:
        settings = dataclasses.replace(settings, kl_weight=0.0)  # every map is all-low: nothing to rank
    runner.model = copy.deepcopy(runner.model)  # calibration merges the learned rotations into this copy
    ids = runner.input_ids(seed)
    result = calibrate(runner.model, ids, settings)
    maps = {"uniform_mxfp4": uniform_format_map(runner.model, "mxfp4_e2m1", settings.modules_to_not_convert)}
    if settings.kl_weight > 0:
        shapes = {name: tuple(runner.model.get_submodule(name).weight.shape) for name in result.beta_hat}
        maps["dmx_kl"] = result.format_map
        maps["dmx"] = budget_format_map(result.beta_hat, shapes, get_format_pair(pair), target, settings.bit_average,
                                        settings.quantize_activations)
        maps["kl"] = kl_preselection(runner.model, ids, settings, sensitivities=result.kl_sensitivities).format_map
    for name, format_map in maps.items():
        start = time.perf_counter()
        shapes = {n: runner.model.get_submodule(n).weight.shape for n in format_map}
        bits = format_map_bits(format_map, shapes, settings.quantize_activations, settings.block_size)
        append_json_line(out, {**key, "map": name, "bits_simple": round(bits["bits_simple"], 4),
                               **runner.perplexities(format_map), "calibration_seconds": round(result.seconds, 1),
                               "eval_seconds": round(time.perf_counter() - start, 1)})


def report(out: Path) -> str:
    rows = read_json_lines(out)
    texts = [k for k in rows[0] if k.startswith("ppl_")]
    lines = [f"| rotation | learned | pair | target | seed | map | bits | {' | '.join(t[4:] for t in texts)} | calibration s |",
             "|---" * (8 + len(texts)) + "|"]
    for r in sorted(rows, key=lambda r: (r["pair"], r["target"], r["map"], r["seed"], r["learn_rotations"])):
        lines.append(f"| {r['rotation']} | {'yes' if r['learn_rotations'] else 'no'} | {r['pair']} | {r['target']:g} | "
                     f"{r['seed']} | {r['map']} | {r['bits_simple']:.3f} | {' | '.join(f'{r[t]:.2f}' for t in texts)} | "
                     f"{r['calibration_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rotation", default="hadamard", choices=list(LEARNABLE_ROTATIONS))
    p.add_argument("--pair", default="mxfp8-mxfp4", choices=list(FORMAT_PAIRS))
    p.add_argument("--target", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=Benchmark.steps)
    p.add_argument("--learn", action="store_true", help="learn the rotations with the offsets")
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the de-gridded SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="calibration text files (default: five Austen novels)")
    p.add_argument("--eval", nargs="+", help="NAME=FILE held-out texts (default: Pride and Prejudice, Moby Dick)")
    for name in ("batch_size", "seq_len", "kl_samples", "eval_tokens", "eval_seq_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(Benchmark, name))
    a = run_or_report(p, argv, report, OUT)
    if a is None:
        return
    bench = Benchmark(model=a.model, calibration=a.calibration,
                      eval_texts=dict(item.split("=", 1) for item in a.eval) if a.eval else None,
                      rotation=a.rotation, steps=a.steps, pairs=[a.pair], seeds=[a.seed],
                      **{k: getattr(a, k) for k in ("batch_size", "seq_len", "kl_samples", "eval_tokens", "eval_seq_len")})
    bench.resolve_inputs()
    run(bench, a.pair, a.target, a.seed, a.learn, a.out)


if __name__ == "__main__":
    sys.exit(main())
