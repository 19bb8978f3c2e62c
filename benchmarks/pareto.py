#!/usr/bin/env python
"""Pareto benchmark: held-out perplexity against average bits for dMX and its baselines.

For one causal LM it runs, per format pair and target, dMX, KL pre-selection and ROUND+STE on the same
calibration tokens, plus float and uniform MXFP4 / MXFP6 (E2M3) / MXFP8 (E4M3), and evaluates every format
assignment (weights and input activations of each decoder linear MX-quantized, lm_head in float) on the
held-out texts. Each finished run is appended to `<out>/pareto.csv` at once, and a run already present
(same method, pair, target and settings) is skipped, so the table can be filled in pieces:

    python benchmarks/pareto.py --methods float,uniform
    python benchmarks/pareto.py --methods dmx --pairs mxfp8-mxfp4 --targets 4.5,5
    python benchmarks/pareto.py --report-only            # rebuild pareto.md and pareto.png from the CSV

Defaults reproduce the project's SmolLM2-135M benchmark: the de-gridded model, five Austen novels for
calibration, Pride and Prejudice and Moby Dick held out, all fetched and cached on first use (see
`common.py`); pass `--model`, `--calibration` and `--eval NAME=FILE` for any other model and texts.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optimum_dmx.calibration import (
    CalibrationSettings,
    build_calibration_batches,
    calibrate,
    calibrate_round_ste,
    kl_preselection,
    kl_sensitivities,
    uniform,
)
from optimum_dmx.continuous import FORMAT_PAIRS
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.nn import emulate_format_map

from common import benchmark_model, benchmark_texts, fwd_bwd_seconds

DEFAULT_TARGETS = {"mxfp8-mxfp4": [4.5, 5.0, 6.0], "mxfp6-mxfp4": [4.5, 5.0, 5.5]}
UNIFORM_FORMATS = ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3"]
METHODS = ["float", "uniform", "dmx", "kl", "round_ste"]
SETTING_COLUMNS = ["steps", "batch_size", "seq_len", "lr", "reg_lambda", "seed", "eval_tokens", "eval_seq_len"]


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
    # The committed table's CPU budget (benchmarks/results/README.md): a fifth of the paper's 400 steps, so
    # a larger learning rate than its 1.0 for the offsets to reach the targets before the anneal.
    steps: int = 80
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 20.0
    reg_lambda: float = 5.0
    seed: int = 0
    kl_samples: int = 4
    eval_tokens: int = 4096
    eval_seq_len: int = 512
    eval_offset: float = 0.1
    dtype: str = "float32"

    def resolve_inputs(self) -> None:
        """Fetch (once) and fill in the default model and texts for the fields left unset."""
        if self.model is None:
            self.model = benchmark_model()
        if self.calibration is None or self.eval_texts is None:
            texts = benchmark_texts()
            self.calibration = self.calibration or texts.calibration
            self.eval_texts = self.eval_texts or texts.evaluation

    def settings(self, pair: str, target: float) -> CalibrationSettings:
        return CalibrationSettings(
            target_bits=target,
            format_pair=pair,
            num_samples=self.steps * self.batch_size,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            steps=self.steps,
            lr=self.lr,
            reg_lambda=self.reg_lambda,
            seed=self.seed,
        )

    def setting_values(self) -> dict:
        return {c: getattr(self, c) for c in SETTING_COLUMNS}

    def runs(self) -> list[tuple[str, str, str]]:
        """(method, pair, target) of every requested run; uniform runs use the format name as target."""
        runs = []
        for method in self.methods:
            if method == "float":
                runs.append((method, "", ""))
            elif method == "uniform":
                runs.extend((method, "", fmt) for fmt in UNIFORM_FORMATS)
            else:
                for pair in self.pairs:
                    for target in self.targets or DEFAULT_TARGETS[pair]:
                        runs.append((method, pair, f"{target:g}"))
        return runs


def _key(method: str, pair: str, target: str, settings: dict) -> str:
    shared = {k: settings[k] for k in ("eval_tokens", "eval_seq_len")}
    relevant = {k: settings[k] for k in SETTING_COLUMNS} if method in ("dmx", "round_ste") else shared
    if method == "kl":
        relevant = {**shared, "seq_len": settings["seq_len"], "seed": settings["seed"]}
    return "|".join([method, pair, target, *(f"{k}={relevant[k]}" for k in sorted(relevant))])


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _append_row(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


class Runner:
    def __init__(self, bench: Benchmark):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        bench.resolve_inputs()
        self.bench = bench
        self.model = AutoModelForCausalLM.from_pretrained(bench.model, dtype=getattr(torch, bench.dtype)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(bench.model)
        self.texts = {}
        for name, path in bench.eval_texts.items():
            text = Path(path).read_text(encoding="utf-8")
            self.texts[name] = text[int(len(text) * bench.eval_offset) :]
        self.input_ids = build_calibration_batches(
            bench.calibration, self.tokenizer, bench.seq_len, bench.steps * bench.batch_size, bench.seed
        )
        self._fwd_bwd = None

    @property
    def fwd_bwd(self) -> float:
        if self._fwd_bwd is None:
            self._fwd_bwd = fwd_bwd_seconds(self.model, self.input_ids[: self.bench.batch_size])
        return self._fwd_bwd

    def sensitivities(self, settings: CalibrationSettings) -> tuple[dict[str, float], float]:
        """KL sensitivities to the (shared) low format and the seconds their scan took, cached on disk."""
        b = self.bench
        path = b.out / "runs" / f"kl_sensitivities_{b.model.name}_{b.kl_samples}x{b.seq_len}_seed{b.seed}.json"
        if not path.exists():
            start = time.perf_counter()
            values = kl_sensitivities(self.model, self.input_ids[: b.kl_samples], settings)
            path.write_text(json.dumps({"seconds": time.perf_counter() - start, "sensitivities": values}, indent=1))
        cached = json.loads(path.read_text())
        return cached["sensitivities"], cached["seconds"]

    def assign(self, method: str, pair: str, target: str):
        b = self.bench
        if method == "float":
            return None
        if method == "uniform":
            return uniform(self.model, target, b.settings("mxfp8-mxfp4", 5.0))
        settings = b.settings(pair, float(target))
        if method == "dmx":
            return calibrate(self.model, self.input_ids, settings)
        if method == "round_ste":
            return calibrate_round_ste(self.model, self.input_ids, settings)
        if method == "kl":
            sensitivities, scan_seconds = self.sensitivities(settings)
            result = kl_preselection(self.model, self.input_ids, settings, sensitivities=sensitivities)
            result.seconds += scan_seconds
            return result
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}.")

    def run(self, method: str, pair: str, target: str) -> dict:
        b = self.bench
        result = self.assign(method, pair, target)
        format_map = result.format_map if result else {}
        start = time.perf_counter()
        perplexities = {}
        with emulate_format_map(self.model, format_map):
            for name, text in self.texts.items():
                ppl = evaluate_perplexity(self.model, self.tokenizer, text, b.eval_seq_len, b.eval_tokens, batch_size=4)
                perplexities[f"ppl_{name}"] = round(ppl.perplexity, 4)
        eval_seconds = time.perf_counter() - start
        steps = len(result.history) if result else 0
        row = {
            "method": method,
            "pair": pair,
            "target": target,
            "bits_simple": round(result.bits_simple, 4) if result else "",
            "bits_weighted": round(result.bits_weighted, 4) if result else "",
            "storage_bits": round(result.storage_bits, 4) if result else "",
            **perplexities,
            "run_seconds": round(result.seconds, 1) if result else 0.0,
            "step_seconds": round(result.seconds / steps, 3) if steps else "",
            "fwd_bwd_step_seconds": round(self.fwd_bwd, 3) if steps else "",
            "eval_seconds": round(eval_seconds, 1),
            **b.setting_values(),
        }
        if result:
            name = "_".join(x for x in (method, pair, target) if x)
            if method in ("dmx", "round_ste"):
                name += f"_steps{b.steps}_bs{b.batch_size}_seq{b.seq_len}_lr{b.lr:g}_lambda{b.reg_lambda:g}_seed{b.seed}"
            result.to_json(b.out / "runs" / f"{name}.json")
        return row


def sweep(bench: Benchmark) -> None:
    """Run every requested run that the CSV does not hold yet, appending each as it finishes."""
    (bench.out / "runs").mkdir(parents=True, exist_ok=True)
    csv_path = bench.out / "pareto.csv"
    settings = {k: str(v) for k, v in bench.setting_values().items()}
    done = {_key(r["method"], r["pair"], r["target"], r) for r in _read_rows(csv_path)}
    todo = [r for r in bench.runs() if _key(*r, settings) not in done]
    print(f"{len(todo)} runs to do, {len(bench.runs()) - len(todo)} already in {csv_path}", flush=True)
    if not todo:
        return
    runner = Runner(bench)
    for method, pair, target in todo:
        print(f"== {method} {pair} {target}", flush=True)
        row = runner.run(method, pair, target)
        _append_row(csv_path, row)
        print(json.dumps(row), flush=True)


def _line_ppl(low: float, high: float, bits_low: float, bits_high: float, bits: float) -> float:
    """The straight line between two points of a log-y plot, at `bits`."""
    t = (bits - bits_low) / (bits_high - bits_low)
    return math.exp((1 - t) * math.log(low) + t * math.log(high))


def report(bench: Benchmark) -> None:
    """Write `pareto.md` (table, protocol, quality bars) and `pareto.png` from `pareto.csv`."""
    rows = _read_rows(bench.out / "pareto.csv")
    if not rows:
        print("no results yet")
        return
    texts = [c[len("ppl_") :] for c in rows[0] if c.startswith("ppl_")]
    lines = [
        "# Pareto benchmark: perplexity vs average bits",
        "",
        _protocol(bench, rows),
        "",
        "| method | pair | target | bits (simple) | bits (weighted) | storage bits | "
        + " | ".join(f"PPL {t}" for t in texts)
        + " | run s | step s | unquantized fwd+bwd s |",
        "|---|---|---|---|---|---|" + "---|" * len(texts) + "---|---|---|",
    ]
    order = {m: i for i, m in enumerate(METHODS)}
    rows.sort(key=lambda r: (r["pair"], order[r["method"]], r["target"]))
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['pair'] or '-'} | {r['target'] or '-'} | {r['bits_simple'] or '-'} | "
            f"{r['bits_weighted'] or '-'} | {r['storage_bits'] or '-'} | "
            + " | ".join(r[f"ppl_{t}"] for t in texts)
            + f" | {r['run_seconds']} | {r['step_seconds'] or '-'} | {r['fwd_bwd_step_seconds'] or '-'} |"
        )
    lines += ["", *_quality_bars(rows, texts)]
    (bench.out / "pareto.md").write_text("\n".join(lines) + "\n")
    _plot(rows, texts, bench.out / "pareto.png")
    print(f"wrote {bench.out / 'pareto.md'} and {bench.out / 'pareto.png'}")


def _protocol(bench: Benchmark, rows: list[dict]) -> str:
    trained = [r for r in rows if r["method"] in ("dmx", "round_ste")]
    r = trained[0] if trained else rows[0]  # float and uniform rows carry the settings of their invocation
    return (
        f"Model `{bench.model.name if bench.model else 'SmolLM2-135M-Instruct, de-gridded'}` ({bench.dtype}); "
        "weights and input activations of every decoder linear "
        f"MX-quantized (block 32), lm_head in float. Calibration: {r['steps']} steps x batch {r['batch_size']} x "
        f"{r['seq_len']} tokens from {', '.join(p.name for p in bench.calibration) if bench.calibration else 'five Austen novels'} (SGD lr {r['lr']}, "
        f"lambda {r['reg_lambda']}, target-aware regularizer on the simple average, seed {r['seed']}); KL "
        f"pre-selection on {bench.kl_samples} x {r['seq_len']} of those tokens. Evaluation: perplexity on the "
        f"first {r['eval_tokens']} tokens from {bench.eval_offset:.0%} into each held-out text, non-overlapping "
        f"{r['eval_seq_len']}-token windows. Times are wall-clock seconds on a shared 2-core CPU: `step s` is a "
        "calibration run's mean step, `unquantized fwd+bwd s` a plain training step (all weights trainable) on "
        "the same batch, measured in the same process."
    )


def _quality_bars(rows: list[dict], texts: list[str]) -> list[str]:
    lines = ["## Quality bars", ""]
    uniform_ppl = {r["target"]: r for r in rows if r["method"] == "uniform"}
    for pair in FORMAT_PAIRS:
        dmx = [r for r in rows if r["method"] == "dmx" and r["pair"] == pair]
        if not dmx:
            continue
        high = FORMAT_PAIRS[pair].high
        for r in dmx:
            target, bits = float(r["target"]), float(r["bits_simple"])
            ok = abs(bits - target) <= 0.15
            lines.append(f"- {pair} target {target:g}: dMX bits {bits:.3f} {'within' if ok else 'NOT within'} +-0.15.")
            for other in ("kl", "round_ste"):
                match = [o for o in rows if o["method"] == other and o["pair"] == pair and o["target"] == r["target"]]
                for o in match:
                    close = abs(float(o["bits_simple"]) - bits) <= 0.1
                    for t in texts:
                        better = float(r[f"ppl_{t}"]) < float(o[f"ppl_{t}"])
                        lines.append(
                            f"  - vs {other} ({float(o['bits_simple']):.3f} bits{'' if close else ', not within 0.1'}) "
                            f"on {t}: {r[f'ppl_{t}']} vs {o[f'ppl_{t}']} -> {'lower' if better else 'NOT lower'}"
                        )
            low_row, high_row = uniform_ppl.get("mxfp4_e2m1"), uniform_ppl.get(high.name)
            if low_row and high_row:
                for t in texts:
                    line = _line_ppl(
                        float(low_row[f"ppl_{t}"]), float(high_row[f"ppl_{t}"]), 4.0, float(high.bits), bits
                    )
                    below = float(r[f"ppl_{t}"]) < line
                    lines.append(
                        f"  - vs the MXFP4-{high.name} line (log-y) on {t}: {r[f'ppl_{t}']} vs {line:.2f} -> "
                        f"{'below' if below else 'NOT below'}"
                    )
    return lines


def _plot(rows: list[dict], texts: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(texts), figsize=(6.5 * len(texts), 4.8), squeeze=False)
    styles = {"dmx": ("o", "-"), "kl": ("s", "--"), "round_ste": ("^", ":")}
    colors = {"mxfp8-mxfp4": "tab:blue", "mxfp6-mxfp4": "tab:orange"}
    for ax, t in zip(axes[0], texts):
        for r in rows:
            if r["method"] == "float":
                ax.axhline(float(r[f"ppl_{t}"]), color="gray", lw=0.8, ls="-.", label="float")
        uni = sorted((float(r["bits_simple"]), float(r[f"ppl_{t}"]), r["target"]) for r in rows if r["method"] == "uniform")
        if uni:
            ax.scatter([u[0] for u in uni], [u[1] for u in uni], color="black", marker="x", label="uniform", zorder=3)
            for bits, ppl, name in uni:
                ax.annotate(name.split("_")[0].upper() + "-" + name.split("_")[1].upper(), (bits, ppl), fontsize=7)
            for pair, color in colors.items():
                hi = [u for u in uni if u[2] == FORMAT_PAIRS[pair].high.name]
                lo = [u for u in uni if u[2] == FORMAT_PAIRS[pair].low.name]
                if hi and lo:
                    ax.plot([lo[0][0], hi[0][0]], [lo[0][1], hi[0][1]], color=color, lw=0.6, alpha=0.5)
        for (method, pair), (marker, ls) in ((k, styles[k[0]]) for k in {(r["method"], r["pair"]) for r in rows} if k[0] in styles):
            pts = sorted((float(r["bits_simple"]), float(r[f"ppl_{t}"])) for r in rows if r["method"] == method and r["pair"] == pair)
            ax.plot(*zip(*pts), marker=marker, ls=ls, color=colors[pair], label=f"{method} {pair}")
        ax.set_yscale("log")
        ax.set_xlabel("average bits per element (simple, scales excluded)")
        ax.set_ylabel(f"perplexity ({t})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> tuple[Benchmark, bool]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Benchmark()
    p.add_argument("--model", type=Path, help="Hugging Face model folder or Hub id (default: the de-gridded SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="calibration text files (default: five Austen novels)")
    p.add_argument("--eval", nargs="+", help="NAME=FILE held-out texts (default: Pride and Prejudice, Moby Dick)")
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--methods", default=",".join(d.methods), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--pairs", default=",".join(d.pairs), help=f"comma list of {', '.join(FORMAT_PAIRS)}")
    p.add_argument("--targets", default=None, help="comma list of target bits (default: per pair, as in the paper)")
    for name in ("steps", "batch_size", "seq_len", "seed", "kl_samples", "eval_tokens", "eval_seq_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "reg_lambda", "eval_offset"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--report-only", action="store_true", help="only rebuild pareto.md and pareto.png")
    a = p.parse_args(argv)
    methods = a.methods.split(",")
    pairs = a.pairs.split(",")
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
        **{k: getattr(a, k) for k in ("steps", "batch_size", "seq_len", "lr", "reg_lambda", "seed", "kl_samples")},
        **{k: getattr(a, k) for k in ("eval_tokens", "eval_seq_len", "eval_offset", "dtype")},
    )
    return bench, a.report_only


def main(argv: list[str] | None = None) -> None:
    bench, report_only = parse_args(argv)
    if not report_only:
        sweep(bench)
    report(bench)


if __name__ == "__main__":
    sys.exit(main())
