#!/usr/bin/env python
"""Pareto benchmark: held-out perplexity against average bits for dMX, its baselines and its ablations.

For one causal LM it runs, per format pair, target and seed, the requested methods on the same calibration
tokens, and evaluates every format map (weights and input activations of each decoder linear MX-quantized,
lm_head in float) on the held-out texts. Methods:

* `float`, `uniform` (MXFP4, MXFP6 E2M3, MXFP8 E4M3): references;
* `kl`: KL pre-selection (its scan on the first `--kl-samples` calibration sequences, timed with it);
* `dmx`: the default recipe's learned offsets alone (`recipe="dmx"`, `kl_weight=0`: sampled format maps at the
  budget, the highest offsets kept);
* `dmx_kl`: the default recipe (`kl_weight=0.5`: final ranking: the mean of the learned offsets' rank and
  the KL scan's rank). Its offsets are those of `dmx` (the blend only changes the ranking at the end), so when the
  `dmx` run of the same settings is in `runs/` its offsets are blended with the cached scan instead of being
  learned again; the time is the `dmx` run's plus the scan's either way;
* `dmx_path`: the default recipe reading each low layer's derivative at a random point of its format path
  (`offset_probe="path"`) instead of at the low format;
* `dmx_swap`: the default recipe estimating each layer's whole format swap to first order from both ends
  (`offset_probe="swap"`);
* `dmx_distill`, `dmx_distill_kl`: `dmx` and `dmx_kl` learning from the distillation loss
  (`loss="distillation"`: KL from the float model's next-token distributions) instead of cross-entropy;
* `dmx_paper`: the dMX paper's procedure (`recipe="paper"`: relaxed offsets, SGD at `--lr`, `beta_hat >= 1`);
* `dmx_paper_budget`: the paper's procedure with the budget discretization;
* `dmx_uniform_context`: the default recipe without its sharpening phase (`t_warmup_ratio=1`: every map drawn
  uniformly at the budget);
* `round_ste`: ROUND+STE (the paper's trainer with discrete formats in the forward pass), budget discretization;
* `dmx_fused`, `kl_fused`: `dmx` and `kl` with `offset_groups="fused"` (q/k/v and gate/up of each decoder layer
  share one format, as vLLM needs): what servable maps cost.

Each finished run is appended to `<out>/pareto.csv` at once, and a run already there (same method, pair,
target, seed and settings) is skipped, so the table can be filled in pieces:

    python benchmarks/pareto.py --methods float,uniform
    python benchmarks/pareto.py --methods dmx --pairs mxfp8-mxfp4 --targets 4.5,5 --seeds 0,1
    python benchmarks/pareto.py --report-only            # rebuild pareto.md and pareto.png from the CSV

Defaults reproduce the project's SmolLM2-135M benchmark: the de-gridded model, five Austen novels for
calibration, Pride and Prejudice and Moby Dick held out, all fetched and cached on first use (see
`common.py`); pass `--model`, `--calibration` and `--eval NAME=FILE` for any other model and texts.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import benchmark_model, benchmark_texts, fwd_bwd_seconds

from optimum_dmx.calibration import (
    CalibrationResult,
    CalibrationSettings,
    build_calibration_batches,
    calibrate,
    calibrate_round_ste,
    kl_preselection,
    kl_sensitivities,
    result_from_format_map,
    uniform,
)
from optimum_dmx.calibration.budget import blended_priority, budget_format_map
from optimum_dmx.calibration.settings import DEFAULT_KL_WEIGHT
from optimum_dmx.continuous import FORMAT_PAIRS, get_format_pair
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.nn import emulate_format_map, linear_modules_to_quantize
from optimum_dmx.nn.rotation import ROTATIONS, rotate_model

DEFAULT_TARGETS = {"mxfp8-mxfp4": [4.5, 5.0, 6.0], "mxfp6-mxfp4": [4.5, 5.0, 5.5]}
UNIFORM_FORMATS = ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3"]
LEARNED = ["dmx", "dmx_kl", "dmx_distill", "dmx_distill_kl", "dmx_path", "dmx_swap", "dmx_paper", "dmx_paper_budget",
           "dmx_uniform_context", "round_ste", "dmx_fused"]
METHODS = ["float", "uniform", "kl", "kl_fused", *LEARNED]
# The default recipe and its variants, compared with the baselines in the report.
OURS = ["dmx", "dmx_kl", "dmx_distill", "dmx_distill_kl", "dmx_path", "dmx_swap"]
# Settings that change a learned run (and so its CSV key); KL depends on the scan's tokens only, every method on
# the evaluation and the rotation. Rows written before a column existed hold its default.
SETTING_COLUMNS = ["steps", "batch_size", "seq_len", "lr", "reg_lambda", "kl_samples", "eval_tokens", "eval_seq_len",
                   "rotation"]
COLUMN_DEFAULTS = {"rotation": "none"}
BLENDED = {"dmx_kl": "dmx", "dmx_distill_kl": "dmx_distill"}  # blended method -> the method whose offsets it blends


@dataclass
class Benchmark:
    """Everything a sweep needs; built from the command line or by another script."""

    model: Path | None = None  # None: the de-gridded SmolLM2-135M (common.benchmark_model)
    calibration: list[Path] | None = None  # None: the five Austen novels (common.benchmark_texts)
    eval_texts: dict[str, Path] | None = None  # None: Pride and Prejudice and Moby Dick
    out: Path = Path(__file__).parent / "results"
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    pairs: list[str] = field(default_factory=lambda: list(FORMAT_PAIRS))
    targets: list[float] | None = None  # None: DEFAULT_TARGETS per pair
    seeds: list[int] = field(default_factory=lambda: [0])
    # A CPU budget (benchmarks/results/README.md): a fifth of the paper's 400 steps of 8 x 2048 tokens.
    steps: int = 80
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 20.0  # the paper recipe's SGD rate at this budget (its 1.0 barely moves the offsets in 80 steps)
    reg_lambda: float = 5.0
    kl_samples: int = 4
    eval_tokens: int = 16384
    eval_seq_len: int = 512
    eval_offset: float = 0.1
    dtype: str = "float32"
    rotation: str = "none"  # rotate the model first (`optimum_dmx.nn.rotation`): every method runs on the rotated model

    def resolve_inputs(self) -> None:
        """Fetch (once) and fill in the default model and texts for the fields left unset."""
        if self.model is None:
            self.model = benchmark_model()
        if self.calibration is None or self.eval_texts is None:
            texts = benchmark_texts()
            self.calibration = self.calibration or texts.calibration
            self.eval_texts = self.eval_texts or texts.evaluation

    def settings(self, method: str, pair: str, target: float, seed: int) -> CalibrationSettings:
        recipe = "paper" if method.startswith("dmx_paper") else "dmx"
        discretization = "threshold" if method == "dmx_paper" else "budget"
        return CalibrationSettings(
            recipe=recipe,
            discretization=discretization,
            target_bits=target,
            format_pair=pair,
            num_samples=self.steps * self.batch_size,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            steps=self.steps,
            lr=self.lr,
            reg_lambda=self.reg_lambda,
            t_warmup_ratio=1.0 if method == "dmx_uniform_context" else CalibrationSettings.t_warmup_ratio,
            offset_groups="fused" if method.endswith("_fused") else "none",
            offset_probe={"dmx_path": "path", "dmx_swap": "swap"}.get(method, CalibrationSettings.offset_probe),
            loss="distillation" if method.startswith("dmx_distill") else CalibrationSettings.loss,
            kl_weight=DEFAULT_KL_WEIGHT if method in BLENDED else 0.0,
            kl_samples=self.kl_samples,
            seed=seed,
        )

    def runs(self) -> list[tuple[str, str, str, int]]:
        """(method, pair, target, seed) of every requested run; uniform runs use the format name as target."""
        runs = []
        for method in self.methods:
            if method == "float":
                runs.append((method, "", "", 0))
            elif method == "uniform":
                runs.extend((method, "", fmt, 0) for fmt in UNIFORM_FORMATS)
            else:
                for seed in self.seeds:
                    for pair in self.pairs:
                        for target in self.targets or DEFAULT_TARGETS[pair]:
                            runs.append((method, pair, f"{target:g}", seed))
        return runs

    def key(self, method: str, pair: str, target: str, seed: int | str) -> str:
        values = {c: str(getattr(self, c)) for c in SETTING_COLUMNS}
        return _key(method, pair, target, seed, values)


def _key(method: str, pair: str, target: str, seed, values: dict) -> str:
    relevant = ["eval_tokens", "eval_seq_len", "rotation"]
    if method in ("kl", "kl_fused"):
        relevant += ["seq_len", "kl_samples"]
    elif method in LEARNED:
        relevant = SETTING_COLUMNS
    return "|".join([method, pair, target, str(seed), *(f"{k}={_setting(values, k)}" for k in sorted(relevant))])


def _setting(row: dict, column: str):
    """The row's value in `column`, or the column's default for rows written before it existed."""
    value = row.get(column)
    return COLUMN_DEFAULTS.get(column, "") if value is None or value == "" else value


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def sweep_perplexities(csv_rows: list[dict], method: str, pair: str, target: str, seed: int,
                       texts: list[str]) -> list[float] | None:
    """The held-out perplexities (one per text) of the unrotated sweep row of that run in `csv_rows`, if any."""
    for row in csv_rows:
        if (row["method"], row["pair"], row["target"], str(row["seed"]), row.get("rotation", "none")) == (
                method, pair, target, str(seed), "none"):
            return [float(row[f"ppl_{t}"]) for t in texts]
    return None


def _append_row(path: Path, row: dict) -> None:
    """Append `row`; when it brings a new column, rewrite the file with it (older rows hold its default)."""
    rows = _read_rows(path)
    columns = list(rows[0]) if rows else []
    if rows and set(row) <= set(columns):
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=columns).writerow(row)
        return
    _write_rows(path, [*rows, row], columns + [c for c in row if c not in columns])


def _write_rows(path: Path, rows: list[dict], columns: list[str]) -> None:
    """Write `rows` with `columns` (a row lacking a column holds its default)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _setting(row, c) for c in columns})


class Runner:
    def __init__(self, bench: Benchmark):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        bench.resolve_inputs()
        self.bench = bench
        self.model = AutoModelForCausalLM.from_pretrained(bench.model, dtype=getattr(torch, bench.dtype)).eval()
        quantized = linear_modules_to_quantize(self.model, CalibrationSettings().modules_to_not_convert)
        rotate_model(self.model, bench.rotation, quantized, seed=0)
        self.tokenizer = AutoTokenizer.from_pretrained(bench.model)
        self.texts = {}
        for name, path in bench.eval_texts.items():
            text = Path(path).read_text(encoding="utf-8")
            self.texts[name] = text[int(len(text) * bench.eval_offset) :]
        self._ids: dict[int, torch.Tensor] = {}
        self._fwd_bwd: float | None = None

    def input_ids(self, seed: int) -> torch.Tensor:
        """The seed's calibration sequences (the same for every method)."""
        if seed not in self._ids:
            b = self.bench
            self._ids[seed] = build_calibration_batches(b.calibration, self.tokenizer, b.seq_len, b.steps * b.batch_size, seed)
        return self._ids[seed]

    def fwd_bwd(self) -> float:
        if self._fwd_bwd is None:
            self._fwd_bwd = fwd_bwd_seconds(self.model, self.input_ids(0)[: self.bench.batch_size])
        return self._fwd_bwd

    def sensitivities(self, settings: CalibrationSettings, seed: int) -> tuple[dict[str, float], float]:
        """KL sensitivities to the (shared) low format and the seconds their scan took, cached on disk."""
        b = self.bench
        rotated = "" if b.rotation == "none" else f"_{b.rotation}"
        path = b.out / "runs" / f"kl_sensitivities_{b.kl_samples}x{b.seq_len}{rotated}_seed{seed}.json"
        if not path.exists():
            start = time.perf_counter()
            values = kl_sensitivities(self.model, self.input_ids(seed)[: b.kl_samples], settings)
            path.write_text(json.dumps({"seconds": time.perf_counter() - start, "sensitivities": values}, indent=1))
        cached = json.loads(path.read_text())
        return cached["sensitivities"], cached["seconds"]

    def assign(self, method: str, pair: str, target: str, seed: int) -> CalibrationResult | None:
        b = self.bench
        if method == "float":
            return None
        if method == "uniform":
            return uniform(self.model, target, b.settings("dmx", "mxfp8-mxfp4", 5.0, seed))
        settings = b.settings(method, pair, float(target), seed)
        ids = self.input_ids(seed)
        if method in ("kl", "kl_fused"):
            sensitivities, scan_seconds = self.sensitivities(settings, seed)
            result = kl_preselection(self.model, ids, settings, sensitivities=sensitivities)
            return dataclasses.replace(result, seconds=result.seconds + scan_seconds)
        if method == "round_ste":
            return calibrate_round_ste(self.model, ids, settings)
        if method in BLENDED:
            learned = self.run_file(BLENDED[method], pair, target, seed)
            if learned.exists():
                return self.blend_learned_offsets(CalibrationResult(**json.loads(learned.read_text())), settings, seed)
        return calibrate(self.model, ids, settings)

    def run_file(self, method: str, pair: str, target: str, seed: int) -> Path:
        rotated = "" if self.bench.rotation == "none" else self.bench.rotation
        return self.bench.out / "runs" / ("_".join(x for x in (method, pair, target, rotated) if x) + f"_seed{seed}.json")

    def blend_learned_offsets(self, learned: CalibrationResult, settings: CalibrationSettings, seed: int) -> CalibrationResult:
        """What `calibrate` with `settings.kl_weight` returns, from a run with the same offsets and the cached scan."""
        sensitivities, scan_seconds = self.sensitivities(settings, seed)
        priority = blended_priority(learned.beta_hat, sensitivities, settings.kl_weight)
        shapes = {name: tuple(self.model.get_submodule(name).weight.shape) for name in priority}
        format_map = budget_format_map(priority, shapes, get_format_pair(settings.format_pair), settings.target_bits,
                                       settings.bit_average, settings.quantize_activations)
        linears = {name: self.model.get_submodule(name) for name in format_map}
        return result_from_format_map(format_map, linears, settings, history=learned.history,
                                      beta_hat=learned.beta_hat, kl_sensitivities=sensitivities,
                                      seconds=learned.seconds + scan_seconds)

    def perplexities(self, format_map: dict[str, str]) -> dict[str, float]:
        """`ppl_<text>` of the model with `format_map` applied, on every held-out text."""
        b = self.bench
        perplexities = {}
        with emulate_format_map(self.model, format_map):
            for name, text in self.texts.items():
                ppl = evaluate_perplexity(self.model, self.tokenizer, text, b.eval_seq_len, b.eval_tokens, batch_size=4)
                perplexities[f"ppl_{name}"] = round(ppl.perplexity, 4)
        return perplexities

    def saved_format_map(self, row: dict) -> dict[str, str]:
        """The format map a CSV row was evaluated with: none (float), the uniform one, or its run file's."""
        if row["method"] in ("float", "uniform"):  # nothing learned: rebuilt as the sweep built it
            result = self.assign(row["method"], row["pair"], row["target"], 0)
            return result.format_map if result else {}
        path = self.run_file(row["method"], row["pair"], row["target"], int(row["seed"]))
        return json.loads(path.read_text())["format_map"]

    def run(self, method: str, pair: str, target: str, seed: int) -> dict:
        b = self.bench
        result = self.assign(method, pair, target, seed)
        start = time.perf_counter()
        perplexities = self.perplexities(result.format_map if result else {})
        steps = len(result.history) if result else 0
        row = {
            "method": method, "pair": pair, "target": target, "seed": seed,
            "bits_simple": round(result.bits_simple, 4) if result else "",
            "bits_weighted": round(result.bits_weighted, 4) if result else "",
            "storage_bits": round(result.storage_bits, 4) if result else "",
            **perplexities,
            "calibration_seconds": round(result.seconds, 1) if result else 0.0,
            "step_seconds": round(result.seconds / steps, 3) if steps else "",
            "fwd_bwd_step_seconds": round(self.fwd_bwd(), 3) if steps else "",
            "eval_seconds": round(time.perf_counter() - start, 1),
            **{c: getattr(b, c) for c in SETTING_COLUMNS},
        }
        if result:
            result.to_json(self.run_file(method, pair, target, seed))
        return row


def sweep(bench: Benchmark) -> None:
    """Run every requested run that the CSV does not hold yet, appending each as it finishes."""
    (bench.out / "runs").mkdir(parents=True, exist_ok=True)
    csv_path = bench.out / "pareto.csv"
    done = {_key(r["method"], r["pair"], r["target"], r["seed"], r) for r in _read_rows(csv_path)}
    todo = [r for r in bench.runs() if bench.key(*r) not in done]
    print(f"{len(todo)} runs to do, {len(bench.runs()) - len(todo)} already in {csv_path}", flush=True)
    if not todo:
        return
    runner = Runner(bench)
    for method, pair, target, seed in todo:
        print(f"== {method} {pair} {target} seed {seed}", flush=True)
        row = runner.run(method, pair, target, seed)
        _append_row(csv_path, row)
        print(json.dumps(row), flush=True)


def reevaluate(bench: Benchmark) -> None:
    """Evaluate the saved format maps of the CSV's selected rows again with the current code, and replace their
    perplexities, so that every row of the table is measured by the same evaluation. Progress is kept in
    `<out>/reevaluation.jsonl`: an interrupted call resumes, and calls with different selections can run side by
    side (each skips the rows another has finished); each rewrites the CSV once, at its end."""
    csv_path, progress = bench.out / "pareto.csv", bench.out / "reevaluation.jsonl"

    def finished() -> dict[str, dict]:
        lines = progress.read_text().splitlines() if progress.exists() else []
        return {e["key"]: e["perplexities"] for e in map(json.loads, lines)}

    selected = {
        _key(r["method"], r["pair"], r["target"], r["seed"], r): r for r in _read_rows(csv_path)
        if r["method"] in bench.methods and _setting(r, "rotation") == bench.rotation
        and (not r["pair"] or (r["pair"] in bench.pairs and int(r["seed"]) in bench.seeds))
    }
    print(f"{len(set(selected) - set(finished()))} rows to evaluate again, {len(set(selected) & set(finished()))} done",
          flush=True)
    runner, done = None, {}
    for key, row in selected.items():
        if key in finished():
            continue
        runner = runner or Runner(bench)
        done[key] = runner.perplexities(runner.saved_format_map(row))
        print(key, done[key], flush=True)
        with open(progress, "a") as f:
            f.write(json.dumps({"key": key, "perplexities": done[key]}) + "\n")
    done = {**finished(), **done}
    rows = _read_rows(csv_path)
    for row in rows:
        row.update(done.get(_key(row["method"], row["pair"], row["target"], row["seed"], row), {}))
    _write_rows(csv_path, rows, list(rows[0]))
    progress.unlink(missing_ok=True)


# --- the report ----------------------------------------------------------------------------------------


def report(bench: Benchmark) -> None:
    """Write `pareto.md` (table, protocol, the bars) and `pareto.png` from `pareto.csv`."""
    rows = _read_rows(bench.out / "pareto.csv")
    if not rows:
        print("no results yet")
        return
    texts = [c[len("ppl_") :] for c in rows[0] if c.startswith("ppl_")]
    order = {m: i for i, m in enumerate(METHODS)}
    rows.sort(key=lambda r: (_setting(r, "rotation"), r["pair"], float(r["target"]) if r["pair"] else 0,
                             order[r["method"]], r["seed"]))
    lines = [
        "# Pareto benchmark: perplexity vs average bits",
        "",
        _protocol(bench, rows),
        "",
        "| rotation | method | pair | target | seed | bits (simple) | bits (weighted) | storage bits | "
        + " | ".join(f"PPL {t}" for t in texts) + " | calibration s | step s | unquantized fwd+bwd s |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(texts) + "---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {_setting(r, 'rotation')} | {r['method']} | {r['pair'] or '-'} | {r['target'] or '-'} | {r['seed'] if r['pair'] else '-'} | "
            f"{r['bits_simple'] or '-'} | {r['bits_weighted'] or '-'} | {r['storage_bits'] or '-'} | "
            + " | ".join(r[f"ppl_{t}"] for t in texts)
            + f" | {r['calibration_seconds']} | {r['step_seconds'] or '-'} | {r['fwd_bwd_step_seconds'] or '-'} |"
        )
    lines += ["", *_bars(rows, texts)]
    (bench.out / "pareto.md").write_text("\n".join(lines) + "\n")
    _plot(rows, texts, bench.out / "pareto.png")
    print(f"wrote {bench.out / 'pareto.md'} and {bench.out / 'pareto.png'}")


def _protocol(bench: Benchmark, rows: list[dict]) -> str:
    r = next((r for r in rows if r["method"] in LEARNED), rows[0])
    model = bench.model.name if bench.model else "SmolLM2-135M-Instruct, de-gridded"
    calibration = ", ".join(p.name for p in bench.calibration) if bench.calibration else "five Austen novels"
    return (
        f"Model `{model}` ({bench.dtype}); weights and input activations of every decoder linear MX-quantized "
        f"(block 32), lm_head in float. Calibration: {r['steps']} steps x batch {r['batch_size']} x {r['seq_len']} "
        f"tokens drawn (per seed) from {calibration}; the learned methods see all of them, KL pre-selection "
        f"scores each layer on the first {r['kl_samples']} of those sequences (its scan is part of its time). "
        f"The paper recipe runs SGD at lr {r['lr']}, lambda {r['reg_lambda']}; the default recipe has no learning "
        f"rate. Evaluation: perplexity on the first {r['eval_tokens']} tokens from {bench.eval_offset:.0%} into "
        f"each held-out text, non-overlapping {r['eval_seq_len']}-token windows. Times are wall-clock seconds on "
        "a shared 2-core CPU; `unquantized fwd+bwd s` is a plain training step (all weights trainable) on one "
        "calibration batch, measured in the same process."
    )


def _bars(rows: list[dict], texts: list[str]) -> list[str]:
    """The issue's bars: budget kept; dMX below KL and ROUND+STE on every text, target and seed; time vs KL."""
    lines = ["## Bars", ""]
    by = {(r["method"], r["pair"], r["target"], r["seed"], _setting(r, "rotation")): r for r in rows if r["pair"]}
    counts: dict[tuple[str, str, str], list[int]] = {}  # (method, baseline, rotation) -> [lower, compared]
    for (method, pair, target, seed, rotation), r in sorted(by.items()):
        if method not in OURS:
            continue
        bits = float(r["bits_simple"])
        rotated = "" if rotation == "none" else f" (rotation {rotation})"
        lines.append(f"- {pair} target {target} seed {seed}{rotated}: {method} {bits:.3f} bits "
                     f"({'within' if abs(bits - float(target)) <= 0.05 + 1e-9 else 'NOT within'} 0.05)")
        for other in ("kl", "round_ste"):
            o = by.get((other, pair, target, seed, rotation))
            if o is None:
                continue
            for t in texts:
                ours, theirs = float(r[f"ppl_{t}"]), float(o[f"ppl_{t}"])
                count = counts.setdefault((method, other, rotation), [0, 0])
                count[0] += ours < theirs
                count[1] += 1
                lines.append(f"  - vs {other} ({float(o['bits_simple']):.3f} bits) on {t}: {ours:.2f} vs {theirs:.2f} "
                             f"({100 * (ours / theirs - 1):+.1f}%) -> {'lower' if ours < theirs else 'NOT lower'}")
        kl = by.get(("kl", pair, target, seed, rotation))
        if kl is not None:
            ratio = float(r["calibration_seconds"]) / float(kl["calibration_seconds"])
            lines.append(f"  - calibration time {float(r['calibration_seconds']):.0f} s vs KL "
                         f"{float(kl['calibration_seconds']):.0f} s (scan included): {ratio:.2f}x")
    summary = [f"- `{method}` lower than `{other}` in {lower} of {compared} comparisons (text x target x seed)"
               + ("" if rotation == "none" else f", rotation {rotation}")
               for (method, other, rotation), (lower, compared) in sorted(counts.items())]
    lines[2:2] = [*summary, ""]
    return lines


def _plot(rows: list[dict], texts: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(texts), figsize=(6.5 * len(texts), 4.8), squeeze=False)
    styles = {"dmx": ("o", "-"), "dmx_path": ("D", "-"), "dmx_swap": ("P", "-"), "kl": ("s", "--"), "round_ste": ("^", ":"), "dmx_paper": ("v", "-.")}
    colors = {"mxfp8-mxfp4": "tab:blue", "mxfp6-mxfp4": "tab:orange"}
    for ax, t in zip(axes[0], texts):
        rows = [r for r in rows if _setting(r, "rotation") == "none"]  # rotated rows: in the table only
        for r in rows:
            if r["method"] == "float":
                ax.axhline(float(r[f"ppl_{t}"]), color="gray", lw=0.8, ls="-.", label="float")
        uni = sorted((float(r["bits_simple"]), float(r[f"ppl_{t}"]), r["target"]) for r in rows if r["method"] == "uniform")
        if uni:
            ax.scatter([u[0] for u in uni], [u[1] for u in uni], color="black", marker="x", label="uniform", zorder=3)
        for method, (marker, ls) in styles.items():
            for pair, color in colors.items():
                points: dict[float, list[tuple[float, float]]] = {}
                for r in rows:
                    if r["method"] == method and r["pair"] == pair:
                        points.setdefault(float(r["target"]), []).append((float(r["bits_simple"]), float(r[f"ppl_{t}"])))
                if points:  # the mean over seeds
                    pts = sorted((sum(b for b, _ in v) / len(v), math.exp(sum(math.log(p) for _, p in v) / len(v)))
                                 for v in points.values())
                    ax.plot(*zip(*pts), marker=marker, ls=ls, color=color, label=f"{method} {pair}")
        ax.set_yscale("log")
        ax.set_xlabel("average bits per element (simple, scales excluded)")
        ax.set_ylabel(f"perplexity ({t})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cell_script_parser(doc: str, default_cells: str) -> argparse.ArgumentParser:
    """The options of the ablation scripts that revisit this sweep's cells: `--cells PAIR:TARGET:SEED,...`, its
    results folder (`--out`, whose saved runs and KL scans they read) and `--threads`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=default_cells, help="comma list of PAIR:TARGET:SEED")
    p.add_argument("--out", type=Path, default=Benchmark().out)
    p.add_argument("--threads", type=int, default=None)
    return p


def parse_cells(cells: str) -> list[tuple[str, str, int]]:
    """`PAIR:TARGET:SEED,...` as (pair, target, seed) tuples, the target as written (the CSV's key)."""
    return [(pair, target, int(seed)) for pair, target, seed in (cell.split(":") for cell in cells.split(","))]


def parse_args(argv: list[str] | None = None) -> tuple[Benchmark, bool, bool]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Benchmark()
    p.add_argument("--model", type=Path, help="Hugging Face model folder or Hub id (default: the de-gridded SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="calibration text files (default: five Austen novels)")
    p.add_argument("--eval", nargs="+", help="NAME=FILE held-out texts (default: Pride and Prejudice, Moby Dick)")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--methods", default=",".join(d.methods), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--pairs", default=",".join(d.pairs), help=f"comma list of {', '.join(FORMAT_PAIRS)}")
    p.add_argument("--targets", default=None, help="comma list of target bits (default: per pair, as in the paper)")
    p.add_argument("--seeds", default="0", help="comma list of seeds (calibration sample and order)")
    for name in ("steps", "batch_size", "seq_len", "kl_samples", "eval_tokens", "eval_seq_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "reg_lambda", "eval_offset"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"])
    p.add_argument("--rotation", default=d.rotation, choices=list(ROTATIONS), help="rotate the model first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--report-only", action="store_true", help="only rebuild pareto.md and pareto.png")
    p.add_argument("--reevaluate", action="store_true",
                   help="evaluate the saved maps of the selected rows again with the current code (no calibration)")
    a = p.parse_args(argv)
    methods, pairs = a.methods.split(","), a.pairs.split(",")
    for value, allowed, what in ((methods, METHODS, "method"), (pairs, list(FORMAT_PAIRS), "pair")):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"unknown {what} {bad}; allowed: {', '.join(allowed)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    bench = Benchmark(
        model=a.model,
        calibration=a.calibration,
        eval_texts=dict(item.split("=", 1) for item in a.eval) if a.eval else None,
        out=a.out,
        methods=methods,
        pairs=pairs,
        targets=[float(t) for t in a.targets.split(",")] if a.targets else None,
        seeds=[int(s) for s in a.seeds.split(",")],
        **{k: getattr(a, k) for k in ("steps", "batch_size", "seq_len", "lr", "reg_lambda", "kl_samples")},
        **{k: getattr(a, k) for k in ("eval_tokens", "eval_seq_len", "eval_offset", "dtype", "rotation")},
    )
    return bench, a.report_only, a.reevaluate


def main(argv: list[str] | None = None) -> None:
    bench, report_only, again = parse_args(argv)
    if again:
        reevaluate(bench)
    elif not report_only:
        sweep(bench)
    report(bench)


if __name__ == "__main__":
    sys.exit(main())
