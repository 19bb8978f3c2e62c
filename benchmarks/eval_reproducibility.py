#!/usr/bin/env python
"""How reproducible is a held-out perplexity of an MX-quantized model? The sweep's saved maps evaluated again.

Every map of `pareto.py` is evaluated once, on one machine. A quantized model is a chaotic function of its
floating-point rounding: a matrix product summed in another order (another CPU's kernels) moves an activation by one
unit in the last place, which now and then crosses an MX rounding boundary; that element then moves by a whole MX
step and the change spreads through the rest of the sequence. The float model's perplexity does not move (it is
continuous in its inputs); the quantized model's does. This script evaluates saved maps again on the machine it runs
on (the evaluation is otherwise the sweep's: the same tokens, windows and maps, one thread), and with another CPU's
code paths forced on this one (`ATEN_CPU_CAPABILITY`, `MKL_ENABLE_INSTRUCTIONS`), so that the sweep's CSV values
and each re-evaluation can be compared map by map, and the default recipe's wins against KL pre-selection counted
under each. `--threads` gives another column (the committed table has a 2-thread column for one cell: every digit
the same as with one thread).

It reads `pareto.py`'s CSV and saved runs, appends one line per map to `<out>/eval_reproducibility.jsonl` as it
finishes (one per machine, forced code path and thread count) and writes `<out>/eval_reproducibility.md`:

    python benchmarks/eval_reproducibility.py --threads 1
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \
        python benchmarks/eval_reproducibility.py --threads 1

(An inductor cache filled under another instruction set must not be reused: inductor does not key its kernels on
`ATEN_CPU_CAPABILITY`. The committed table has no forced column yet.)
"""

from __future__ import annotations

import os
import platform
import statistics

import torch

from common import append_json_line, read_json_lines
from pareto import Benchmark, Runner, _read_rows, cell_script_parser, parse_cells, sweep_perplexities

METHODS = ("kl", "dmx_kl")  # KL pre-selection and the default recipe
# ATen's vectorised kernels and MKL's matrix products pick their instruction set at run time; these force another.
DISPATCH_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
ALL_CELLS = ",".join(f"{pair}:{target}:{seed}" for seed in (0, 1)
                     for pair, targets in (("mxfp8-mxfp4", ("4.5", "5", "6")), ("mxfp6-mxfp4", ("4.5", "5", "5.5")))
                     for target in targets)


def machine() -> str:
    """The CPU model (what decides which matrix-product kernels run) and the torch version."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, torch {torch.__version__}"


def dispatch() -> str:
    """The kernel choices forced from the environment (another CPU's code paths on this one), or `default`."""
    forced = [f"{name}={os.environ[name]}" for name in DISPATCH_VARIABLES if os.environ.get(name)]
    return " ".join(forced) or "default"


def evaluation_key(record: dict) -> tuple:
    """What one evaluation of a map is: the map (method and cell) and where it ran (machine, code path, threads)."""
    return (record["method"], record["pair"], record["target"], record["seed"], record["machine"],
            record["dispatch"], record["threads"])


def report(records: list[dict], csv_rows: list[dict], command: str) -> str:
    texts = records[0]["texts"]
    machines = list(dict.fromkeys(r["machine"] for r in records))
    settings = sorted({evaluation_key(r)[4:] for r in records},
                      key=lambda s: (machines.index(s[0]), s[1] != "default", s[1], s[2]))
    cells = list(dict.fromkeys((r["pair"], r["target"], r["seed"]) for r in records))
    evaluated = {evaluation_key(r): r["perplexities"] for r in records}
    columns = [("sweep", None)] + [(f"machine {machines.index(s[0]) + 1}, {s[1]}, {s[2]} thr.", s) for s in settings]

    def values(method: str, cell: tuple, setting: tuple | None) -> list[float] | None:
        if setting is None:
            return sweep_perplexities(csv_rows, method, *cell, texts)
        return evaluated.get((method, *cell, *setting))

    lines = ["# Reproducibility of held-out perplexity: the sweep's maps evaluated again", "", f"Command: `{command}`",
             "", "`sweep`: the values in `pareto.csv` (the sweep's machine, one thread). Machines: "
             + "; ".join(f"{i + 1}: {m}" for i, m in enumerate(machines)) + ". Perplexity on "
             + " / ".join(texts) + " of the same saved map, same tokens and windows; `default` is the default "
             "recipe, in brackets against KL pre-selection in the same column.", "",
             "| pair | target | seed | " + " | ".join(f"KL, {c} | default, {c}" for c, _ in columns) + " |",
             "|---|---|---|" + "---|---|" * len(columns)]
    wins = {c: [0, 0] for c, _ in columns}
    spread = []
    for cell in cells:
        shown = []
        for column, setting in columns:
            kl, default = values("kl", cell, setting), values("dmx_kl", cell, setting)
            shown.append(" / ".join(f"{v:.2f}" for v in kl) if kl else "")
            if kl and default:
                shown.append(" / ".join(f"{d:.2f} ({d / k - 1:+.1%})" for d, k in zip(default, kl)))
                wins[column][0] += sum(d < k for d, k in zip(default, kl))
                wins[column][1] += len(texts)
            else:
                shown.append(" / ".join(f"{d:.2f}" for d in default) if default else "")
        for method in METHODS:
            measured = [v for _, s in columns if (v := values(method, cell, s))]
            for per_text in zip(*measured):
                spread.append(max(per_text) / min(per_text) - 1)
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | " + " | ".join(shown) + " |")
    lines += ["", "Default recipe lower than KL pre-selection: " + "; ".join(
        f"{c}: {w} of {n}" for c, (w, n) in wins.items() if n) + "."]
    if spread:
        lines.append(f"Spread of one map's perplexity over the columns (max / min - 1, per map and text, "
                     f"{len(spread)} of them): median {statistics.median(spread):.2%}, largest {max(spread):.2%}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = cell_script_parser(__doc__, default_cells=ALL_CELLS)
    a = p.parse_args()
    threads = a.threads or 1
    torch.set_num_threads(threads)
    cache = a.out / "eval_reproducibility.jsonl"
    records = read_json_lines(cache) if cache.exists() else []
    here, forced = machine(), dispatch()
    runner = None
    for pair, target, seed in parse_cells(a.cells):
        for method in METHODS:
            key = (method, pair, target, seed, here, forced, threads)
            if any(evaluation_key(r) == key for r in records):
                continue
            runner = runner or Runner(Benchmark(out=a.out))
            format_map = runner.saved_format_map({"method": method, "pair": pair, "target": target, "seed": seed})
            record = {"method": method, "pair": pair, "target": target, "seed": seed, "machine": here,
                      "dispatch": forced, "threads": threads, "texts": list(runner.texts),
                      "perplexities": list(runner.perplexities(format_map).values())}
            append_json_line(cache, record)
            records.append(record)
    if records:
        command = "; ".join(f"python benchmarks/eval_reproducibility.py --threads {n} --cells " + ",".join(
            dict.fromkeys(f"{r['pair']}:{r['target']}:{r['seed']}" for r in records if r["threads"] == n))
            for n in sorted({r["threads"] for r in records}))
        (a.out / "eval_reproducibility.md").write_text(report(records, _read_rows(a.out / "pareto.csv"), command))
        print((a.out / "eval_reproducibility.md").read_text())


if __name__ == "__main__":
    main()
