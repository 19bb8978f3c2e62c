#!/usr/bin/env python
"""Quality: held-out perplexity against average bits for dMX, the paper's procedure, KL pre-selection and uniform
formats, on the same model, calibration tokens and evaluation.

Regenerate `results/quality.md` (the de-gridded SmolLM2-135M, five Austen novels for calibration, Pride and
Prejudice and Moby Dick held out, all fetched and cached on first use by `common.py`; days on 2 CPU cores):

    python benchmarks/bench_quality.py --seeds 0,1 --output benchmarks/results/quality.md

Rows, for every format pair, target and seed:

* `float`, `uniform` (MXFP4, MXFP6 E2M3, MXFP8 E4M3): references;
* `dmx`: the default method (`DMXConfig()`'s; its default rotation and groups are `--rotation online_block_hadamard
  --offset-groups fused`, this script's defaults are none);
* `paper`: the dMX paper's procedure (`method="paper"`, the preset's `PaperRecipe`);
* `kl`: KL pre-selection (`method="kl"`), the cheap baseline;
* `llmcompressor`: a peer, llm-compressor's GPTQ with its `MXFP4` scheme (uniform MXFP4 W4A4), run by its own
  `oneshot` in its own environment (`peers/`, created under the benchmark cache on first use) on the seed's
  calibration sequences; its weights are evaluated by this benchmark's evaluation, like every other row:

    python benchmarks/bench_quality.py --methods llmcompressor

* `autoscheme`: a peer, auto-round's AutoScheme choosing between the pair's two formats at the target, in
  parameter-weighted element bits (this benchmark's `--bit-average weighted`, which it requires), by its own code
  in its own environment; its map is evaluated like every other (`--peer-samples N`: it reads only the first N
  calibration sequences, its search being slow on a CPU):

    python benchmarks/bench_quality.py --methods dmx,kl,autoscheme --bit-average weighted --peer-samples 80

With `--weight-rounding gptq` every map's weights are rounded by GPTQ in their formats (`calibration.gptq`, on the
seed's calibration sequences at the preset's sizes) instead of to nearest; a GPTQ row takes the map of the same
cell's round-to-nearest row when `--runs` holds it, and the report compares the two:

    python benchmarks/bench_quality.py --methods uniform --uniform-formats mxfp4_e2m1 --weight-rounding gptq
    python benchmarks/bench_quality.py --methods dmx --seeds 0,1 --weight-rounding gptq

GPTQ rounds each weight's columns in activation order, as the library does (rows record `gptq_order`, labelled
`gptq (act order)`); `--gptq-order columns` runs the library's GPTQ before it, in the columns' own order, which
every GPTQ row without `gptq_order` ran.

Rows labelled `(GPTQ scan)` come from a study, not adopted, whose KL scan put each layer in the low format rounded
by GPTQ instead of to nearest (`research/README.md`; its option, `--sensitivity-rounding gptq`, is in this script at
commit `2909300`); the report still compares the default with them.

With `--learn-rotations` (and `--rotation hadamard` or `block_hadamard`) the calibrated methods train the merged
rotations with the offsets (`learn_rotations=True`); each cell calibrates a copy of the rotated model, whose learned
weights are kept under the benchmark cache so that the cell's GPTQ row rounds the same model. Uniform MXFP4 with the
learned rotation is the `dmx` map at 4 bits (every layer low):

    python benchmarks/bench_quality.py --methods dmx --pairs mxfp8-mxfp4 --targets 4 --rotation hadamard \
        --learn-rotations
    python benchmarks/bench_quality.py --methods dmx --pairs mxfp8-mxfp4 --targets 4 --rotation hadamard \
        --learn-rotations --weight-rounding gptq

Every method calibrates at the `--preset` sizes (default `cpu-bench`: 80 steps of 4 x 128 tokens) on the seed's
sequences, with the same `--rotation`, `--offset-groups` and `--bit-average`; every map is evaluated with weights
and input activations of each decoder linear MX-quantized, lm_head in float. Each finished run is appended at once
to `--runs` (JSON lines, default `results/quality_runs.jsonl`, committed with the table it makes), and a run
already there (same method, cell and settings) is skipped, so a sweep can be filled in pieces and resumed; the
table is rebuilt from all of them:

    python benchmarks/bench_quality.py --methods float,uniform
    python benchmarks/bench_quality.py --methods dmx,kl --pairs mxfp8-mxfp4 --targets 5 --seeds 0,1
    python benchmarks/bench_quality.py --report-only --output benchmarks/results/quality.md

Pass `--model`, `--calibration` and `--eval NAME=FILE` for any other model and texts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optimum_dmx.calibration import (
    CalibrationSettings,
    build_calibration_batches,
    calibrate,
    get_preset,
    kl_preselection,
    kl_sensitivities,
    round_weights_by_gptq,
    uniform_format_map,
)
from optimum_dmx.continuous import FORMAT_PAIRS, get_format_pair
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.formats import quantize_mx
from optimum_dmx.nn import emulate_format_map, format_map_bits, linear_modules_to_quantize
from optimum_dmx.nn.rotation import ROTATIONS, rotate_model

from common import (
    append_json_line,
    benchmark_model,
    benchmark_texts,
    cache_dir,
    peer_python,
    read_json_lines,
    write_report,
)

DEFAULT_TARGETS = {"mxfp8-mxfp4": [4.5, 5.0, 6.0], "mxfp6-mxfp4": [4.5, 5.0, 5.5]}
UNIFORM_FORMATS = ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3"]
CALIBRATED = ["dmx", "paper", "kl"]
WEIGHT_PEERS = {"llmcompressor": ("mxfp4_e2m1", "MXFP4")}  # peer: (the uniform format it makes, its scheme's name)
MAP_PEERS = {"autoscheme": {"mxfp8-mxfp4": "MXFP4,MXFP8", "mxfp6-mxfp4": "MXFP4,MXFP6"}}  # peer: options per pair
PEER_SCRIPTS = {  # peer: (its environment, `peers/requirements-<environment>.txt`; its script in `peers/`)
    "llmcompressor": ("llmcompressor", "llmcompressor_gptq.py"),
    "autoscheme": ("autoround", "autoround_autoscheme.py"),
}
METHODS = ["float", "uniform", *CALIBRATED, *WEIGHT_PEERS, *MAP_PEERS]
SKIPPED = ["lm_head"]  # kept in float by every method, as DMXConfig does
# Every finished run, committed beside the table made from it. Runs from before it was kept here were recovered from
# that table (`recovered_from`): they have no format map, so a GPTQ row of their cell calibrates again.
RUNS = Path(__file__).parent / "results" / "quality_runs.jsonl"


@dataclass
class Sweep:
    """What a sweep runs and how it evaluates."""

    model: Path | None = None  # None: the de-gridded SmolLM2-135M (common.benchmark_model)
    calibration: list[Path] | None = None  # None: five Austen novels
    eval_texts: dict[str, Path] | None = None  # None: Pride and Prejudice, Moby Dick
    methods: list[str] = field(default_factory=lambda: [m for m in METHODS if m not in MAP_PEERS])
    uniform_formats: list[str] = field(default_factory=lambda: list(UNIFORM_FORMATS))
    pairs: list[str] = field(default_factory=lambda: list(FORMAT_PAIRS))
    targets: list[float] | None = None  # None: DEFAULT_TARGETS per pair
    seeds: list[int] = field(default_factory=lambda: [0])
    preset: str = "cpu-bench"
    rotation: str = "none"
    offset_groups: str = "none"
    bit_average: str = "weighted"  # the library's default; "simple": per layer, the paper's own average
    weight_rounding: str = "rtn"
    learn_rotations: bool = False
    gptq_samples: int | None = None  # None: every calibration sequence of the preset
    gptq_order: str = "activation"  # GPTQ's column order (`round_weights_by_gptq`): "activation" or "columns"
    peer_samples: int | None = None  # None: map peers read every calibration sequence of the preset
    eval_tokens: int = 16384
    eval_seq_len: int = 512
    eval_offset: float = 0.1

    def cells(self) -> list[tuple[str, str, str, int]]:
        """(method, pair, target, seed) of every requested run; uniform runs name their format as the target."""
        cells = []
        for method in self.methods:
            if method == "float":
                cells.append((method, "", "", 0))
            elif method == "uniform":
                cells.extend((method, "", fmt, 0) for fmt in self.uniform_formats)
            elif method in WEIGHT_PEERS:
                cells.append((method, "", WEIGHT_PEERS[method][0], 0))
            else:
                for seed in self.seeds:
                    for pair in self.pairs:
                        cells.extend((method, pair, f"{t:g}", seed) for t in self.targets or DEFAULT_TARGETS[pair])
        return cells

    def key(self, method: str, pair: str, target: str, seed: int) -> dict:
        """What identifies a run in the results: its cell, the model and data, and the settings it depends on."""
        key = {
            "method": method,
            "pair": pair,
            "target": target,
            "seed": seed,
            "rotation": self.rotation,
            "model": self.model.name if self.model else "smollm2-135m-degridded",
            "eval": f"{self.eval_tokens}x{self.eval_seq_len}@{self.eval_offset:g}",
        }
        if method in CALIBRATED or method in MAP_PEERS:
            key.update(preset=self.preset, offset_groups=self.offset_groups, bit_average=self.bit_average)
        if method in CALIBRATED and self.learn_rotations:
            key.update(learn_rotations=True)
        if method in MAP_PEERS and self.peer_samples is not None:
            key.update(peer_samples=self.peer_samples)
        if self.weight_rounding != "rtn" and method != "float":
            key.update(weight_rounding=self.weight_rounding, preset=self.preset)  # GPTQ reads the preset's tokens
            if self.gptq_samples is not None:
                key.update(gptq_samples=self.gptq_samples)
        if method not in (*WEIGHT_PEERS, "float") and self.weight_rounding == "gptq":
            if self.gptq_order != "columns":  # rows without it: columns, this package's only GPTQ before `gptq_order`
                key.update(gptq_order=self.gptq_order)
        if method in WEIGHT_PEERS:
            key.update(weight_rounding="gptq", preset=self.preset)
        return key


class Runner:
    """The model (rotated as asked), its tokenizer and texts, loaded once for every run of a sweep."""

    def __init__(self, sweep: Sweep):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.sweep = sweep
        model_dir = sweep.model or benchmark_model()
        texts = None if sweep.calibration and sweep.eval_texts else benchmark_texts()
        self.calibration = sweep.calibration or texts.calibration
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.targets = linear_modules_to_quantize(self.model, SKIPPED)
        rotate_model(self.model, sweep.rotation, self.targets, seed=0)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.scans: dict[tuple[str, str, int], tuple[dict[str, float], float]] = {}
        self.texts = {}
        for name, path in (sweep.eval_texts or texts.evaluation).items():
            text = Path(path).read_text(encoding="utf-8")
            self.texts[name] = text[int(len(text) * sweep.eval_offset) :]

    def calibration_ids(self, seed: int) -> torch.Tensor:
        """The seed's calibration sequences at the preset's sizes (the calibration's, and GPTQ's)."""
        preset = get_preset(self.sweep.preset)
        return build_calibration_batches(self.calibration, self.tokenizer, preset.seq_len, preset.num_samples, seed)

    def format_map(
        self, model: torch.nn.Module, method: str, pair: str, target: str, seed: int
    ) -> tuple[dict[str, str], float]:
        """The method's format map for the cell (calibrated on `model`), and the seconds it took."""
        if method == "float":
            return {}, 0.0
        if method == "uniform" or method in WEIGHT_PEERS:
            return uniform_format_map(model, target, SKIPPED), 0.0
        if method in MAP_PEERS:
            return self.peer_format_map(method, pair, target, seed)
        s = self.sweep
        settings = CalibrationSettings(
            method=method,
            format_pair=pair,
            target_bits=float(target),
            seed=seed,
            offset_groups=s.offset_groups,
            bit_average=s.bit_average,
            learn_rotations=s.learn_rotations,
            **get_preset(s.preset).settings(),
        )
        if method == "kl":
            sensitivities, seconds = self.sensitivities(model, get_format_pair(pair).low.name, seed, settings)
            result = kl_preselection(model, self.calibration_ids(seed), settings, sensitivities=sensitivities)
            return result.format_map, seconds + result.seconds
        result = calibrate(model, self.calibration_ids(seed), settings)
        return result.format_map, result.seconds

    def sensitivities(
        self, model: torch.nn.Module, low: str, seed: int, settings: CalibrationSettings
    ) -> tuple[dict[str, float], float]:
        """KL pre-selection's scan of every layer (or offset group) in the `low` format and the seconds it took: the
        same for every pair with that low format and every target, so scanned once."""
        key = (low, seed, repr(settings.offset_groups))
        if key not in self.scans:
            start = time.perf_counter()
            scan = kl_sensitivities(model, self.calibration_ids(seed), settings)
            self.scans[key] = scan, time.perf_counter() - start
        return self.scans[key]

    @contextlib.contextmanager
    def peer_run(self, method: str, seed: int, *args: str | float) -> Iterator[Path]:
        """Run the peer's script in its own environment on this sweep's model (saved as a folder, rotated as the
        sweep asks, like every other row's model) and the seed's calibration sequences (the first
        `--peer-samples` of them, if given); yields the folder holding what it wrote."""
        import subprocess
        import tempfile

        from safetensors.torch import save_file

        if self.sweep.rotation not in ("none", "hadamard", "block_hadamard"):
            raise ValueError(f"peers get the model as a folder: --rotation {self.sweep.rotation} is not merged")
        environment, script = PEER_SCRIPTS[method]
        sequences = self.calibration_ids(seed)
        if method in MAP_PEERS and self.sweep.peer_samples is not None:
            sequences = sequences[: self.sweep.peer_samples]
        with tempfile.TemporaryDirectory() as work:
            work = Path(work)
            self.model.save_pretrained(work / "model")
            self.tokenizer.save_pretrained(work / "model")  # the peers read text or want a processor
            save_file({"input_ids": sequences.contiguous()}, work / "tokens.safetensors")
            command = [str(peer_python(environment)), str(Path(__file__).parent / "peers" / script)]
            command += ["--model", str(work / "model"), "--tokens", str(work / "tokens.safetensors")]
            command += ["--output", str(work / "out"), "--threads", str(torch.get_num_threads()), *map(str, args)]
            subprocess.run(command, check=True)
            yield work / "out"

    def peer_model(self, method: str, seed: int) -> tuple[torch.nn.Module, float]:
        """A copy of the model holding the weights the peer made on the seed's calibration sequences, and the
        seconds the peer's own entry point took."""
        from safetensors.torch import load_file

        fmt, scheme = WEIGHT_PEERS[method]
        with self.peer_run(method, seed, "--scheme", scheme) as out:
            weights = load_file(out / "weights.safetensors")
            seconds = json.loads((out / "run.json").read_text())["seconds"]
        model = copy.deepcopy(self.model)
        linears = linear_modules_to_quantize(model, SKIPPED)
        if set(weights) != set(linears):
            raise RuntimeError(f"{method} quantized {sorted(set(weights) ^ set(linears))} differently from dMX")
        for name, weight in weights.items():
            if not torch.equal(quantize_mx(weight, fmt), weight):  # so that our evaluation keeps its rounding
                raise RuntimeError(f"{method}'s {name} is not on the {fmt} grid of the OCP scale rule")
            linears[name].weight.data.copy_(weight)
        return model, seconds

    def peer_format_map(self, method: str, pair: str, target: str, seed: int) -> tuple[dict[str, str], float]:
        """The format map the peer chose for the cell's pair and budget on the seed's calibration sequences, and the
        seconds its search took (evaluated like every calibrated method's map)."""
        options = MAP_PEERS[method][pair]
        with self.peer_run(method, seed, "--options", options, "--avg-bits", float(target)) as out:
            format_map = json.loads((out / "format_map.json").read_text())
            seconds = json.loads((out / "run.json").read_text())["seconds"]
        differing = sorted(set(format_map) ^ set(self.targets))
        if differing:
            raise RuntimeError(f"{method} and dMX quantize different layers, e.g. {differing[:3]}")
        return format_map, seconds

    def learned_weights(self, method: str, pair: str, target: str, seed: int) -> Path:
        """Where the cell's model with its learned rotations is kept (one file per cell, rounding aside)."""
        key = dataclasses.replace(self.sweep, weight_rounding="rtn").key(method, pair, target, seed)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return cache_dir() / "learned_rotations" / f"{digest}.safetensors"

    def run(self, method: str, pair: str, target: str, seed: int, known: dict | None = None) -> dict:
        """Evaluate the cell's map: `known`'s (a finished run of the same cell rounded to nearest) when given,
        else the method's, computed now."""
        from safetensors.torch import load_model, save_model

        model = self.model
        peer_seconds = None
        if method in WEIGHT_PEERS:
            model, peer_seconds = self.peer_model(method, seed)
        learned = self.sweep.learn_rotations and method in CALIBRATED
        if learned:  # the rotations are learned on (or loaded into) a copy: the next cell starts from the same model
            model = copy.deepcopy(self.model)
            weights = self.learned_weights(method, pair, target, seed)
            if known is not None and not weights.exists():
                known = None  # the map's learned weights are gone: calibrate again
        if known is not None:
            format_map, seconds = known["format_map"], known["calibration_seconds"]
            if learned:
                load_model(model, weights)
        else:
            format_map, seconds = self.format_map(model, method, pair, target, seed)
            if learned:
                weights.parent.mkdir(parents=True, exist_ok=True)
                save_model(model, weights)
        row = {**self.sweep.key(method, pair, target, seed), "calibration_seconds": round(seconds, 1)}
        if format_map:
            shapes = {name: tuple(self.targets[name].weight.shape) for name in format_map}
            row.update({k: round(v, 4) for k, v in format_map_bits(format_map, shapes).items()})
        float_linears = self.targets if model is self.model else linear_modules_to_quantize(model, SKIPPED)
        if peer_seconds is not None:
            row["gptq_seconds"] = peer_seconds
        with emulate_format_map(model, format_map):
            if format_map and self.sweep.weight_rounding == "gptq" and method not in WEIGHT_PEERS:
                start = time.perf_counter()
                gptq_linears = {name: float_linears[name] for name in format_map}
                preset = get_preset(self.sweep.preset)
                batch_size = preset.batch_size
                sequences = self.calibration_ids(seed)[: self.sweep.gptq_samples or preset.gptq_samples]
                activation_order = self.sweep.gptq_order == "activation"
                round_weights_by_gptq(model, gptq_linears, sequences, batch_size, activation_order=activation_order)
                row["gptq_seconds"] = round(time.perf_counter() - start, 1)
            for name, text in self.texts.items():
                result = evaluate_perplexity(
                    model, self.tokenizer, text, self.sweep.eval_seq_len, self.sweep.eval_tokens, batch_size=4
                )
                row[f"ppl_{name}"] = round(result.perplexity, 4)
        row["format_map"] = format_map
        return row


def run_sweep(sweep: Sweep, runs: Path) -> None:
    """Run every requested cell that `runs` does not hold yet, appending each as it finishes."""
    done = [_identity(r) for r in read_json_lines(runs)]
    todo = [cell for cell in sweep.cells() if _identity(sweep.key(*cell)) not in done]
    print(f"{len(todo)} runs to do, {len(sweep.cells()) - len(todo)} already in {runs}", flush=True)
    if not todo:
        return
    runs.parent.mkdir(parents=True, exist_ok=True)
    runner = Runner(sweep)
    # A GPTQ row evaluates the map of the same cell's round-to-nearest row when there is one (the map does not
    # depend on the rounding), instead of calibrating again.
    rtn_sweep = dataclasses.replace(sweep, weight_rounding="rtn")
    finished = {_identity(r): r for r in read_json_lines(runs)}
    for cell in todo:
        print(f"== {' '.join(map(str, cell))}", flush=True)
        start = time.perf_counter()
        known = finished.get(_identity(rtn_sweep.key(*cell))) if sweep.weight_rounding != "rtn" else None
        if known is not None and "format_map" not in known:
            known = None  # recovered from the table: its map was not kept
        row = runner.run(*cell, known=known)
        row["seconds_total"] = round(time.perf_counter() - start, 1)
        row["torch_threads"] = torch.get_num_threads()  # a map can depend on it (float reduction order)
        append_json_line(runs, row)


def _identity(row: dict) -> tuple:
    keys = (
        "method",
        "pair",
        "target",
        "seed",
        "rotation",
        "model",
        "eval",
        "preset",
        "offset_groups",
        "bit_average",
        "weight_rounding",
        "learn_rotations",
        "gptq_samples",
        "gptq_order",
        "sensitivity_rounding",
        "peer_samples",
    )
    return tuple(str(row.get(k, "")) for k in keys)


def gptq_order(row: dict) -> str:
    """The column order of a row's GPTQ (`Sweep.gptq_order`): rows without one ran this package's GPTQ before
    activation order, which rounded the columns in their own order."""
    return row.get("gptq_order", "columns")


def rounding_label(row: dict) -> str:
    """The row's weight rounding, with the number of sequences GPTQ read when it was limited."""
    rounding = row.get("weight_rounding", "rtn")
    if rounding == "gptq" and row.get("method") not in WEIGHT_PEERS and gptq_order(row) == "activation":
        rounding = "gptq (act order)"
    return f"{rounding} ({row['gptq_samples']} seq)" if row.get("gptq_samples") else rounding


def method_label(row: dict) -> str:
    """The row's method, marked when its KL scan rounded by GPTQ or a peer read fewer calibration sequences."""
    if row.get("sensitivity_rounding") == "gptq":
        return f"{row['method']} (GPTQ scan)"
    if row.get("peer_samples"):
        return f"{row['method']} ({row['peer_samples']} seq)"
    return row["method"]


def rotation_label(row: dict) -> str:
    """The row's rotation, marked when the calibration learned it."""
    return f"{row['rotation']} (learned)" if row.get("learn_rotations") else row["rotation"]


def report(rows: list[dict]) -> str:
    """The table (every run, sorted), and per cell the default method's perplexity against each other method's."""
    if not rows:
        return "no results yet\n"
    texts = sorted({k[len("ppl_") :] for r in rows for k in r if k.startswith("ppl_")})
    order = {m: i for i, m in enumerate(METHODS)}
    rows = sorted(
        rows,
        key=lambda r: (
            r["model"],
            rotation_label(r),
            r.get("offset_groups", ""),
            r.get("bit_average", ""),
            rounding_label(r),
            r["pair"],
            float(r["target"]) if r["pair"] else 0,
            order.get(r["method"], 99),
            r["seed"],
        ),
    )
    lines = [
        "| model | rotation | groups | budget | rounding | method | pair | target | seed | bits (simple) "
        "| bits (weighted) | storage bits | " + " | ".join(f"PPL {t}" for t in texts) + " | calibration s | GPTQ s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(texts) + "---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {rotation_label(r)} | {r.get('offset_groups', '-')} | {r.get('bit_average', '-')} | "
            f"{rounding_label(r)} | {method_label(r)} | {r['pair'] or '-'} | "
            f"{r['target'] or '-'} | {r['seed'] if r['pair'] else '-'} | {r.get('bits_simple', '-')} | "
            f"{r.get('bits_weighted', '-')} | {r.get('storage_bits', '-')} | "
            + " | ".join(str(r.get(f"ppl_{t}", "-")) for t in texts)
            + f" | {r['calibration_seconds']} | {r.get('gptq_seconds', '-')} |"
        )
    sections = [
        comparison(rows, texts),
        budget_comparison(rows, texts),
        rounding_comparison(rows, texts),
        setting_comparison(rows, texts, "offset_groups", "fused", "none"),
        setting_comparison(rows, texts, "rotation", None, "none"),
        servable_comparison(rows, texts),
        peer_comparison(rows, texts),
    ]
    return "\n".join(lines) + "\n\n" + "\n\n".join("\n".join(s) for s in sections if s) + "\n"


def comparison(rows: list[dict], texts: list[str]) -> list[str]:
    """How often the default method's held-out perplexity is below each other calibrated method's, same cell."""
    by_cell = {
        (
            r["model"],
            rotation_label(r),
            (r.get("offset_groups"), r.get("bit_average"), rounding_label(r)),
            r["pair"],
            r["target"],
            r["seed"],
            method_label(r),
        ): r
        for r in rows
        if r["pair"]
    }
    counts: dict[str, list[float]] = {}
    others = {other for (*_, other) in by_cell} - {"dmx"}  # the other methods and their variants
    others = sorted(others, key=lambda m: (METHODS.index(m.split(" ")[0]), m))
    for (model, rotation, groups, pair, target, seed, method), ours in by_cell.items():
        if method != "dmx":
            continue
        for other in others:
            theirs = by_cell.get((model, rotation, groups, pair, target, seed, other))
            for t in texts if theirs else []:
                ratio = ours[f"ppl_{t}"] / theirs[f"ppl_{t}"]
                counts.setdefault(other, []).append(ratio)
    lines = [
        "Default method (`dmx`) against the others, same model, rotation, groups, budget, rounding, pair, target and "
        "seed, on each held-out text:",
        "",
    ]
    for other, ratios in counts.items():
        lower = sum(r < 1 for r in ratios)
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines.append(
            f"- vs `{other}`: lower in {lower} of {len(ratios)} comparisons; geometric mean perplexity ratio {mean:.3f}"
        )
    return lines


def budget_comparison(rows: list[dict], texts: list[str]) -> list[str]:
    """Each method's map at the weighted budget against its map at the simple budget of the same target (same cell,
    settings and seed): the weighted one is smaller (the simple average lets large layers go high)."""

    def cell(r: dict) -> tuple:
        keys = ("method", "pair", "target", "seed", "rotation", "model", "eval", "offset_groups", "preset")
        return (*(str(r.get(k, "")) for k in keys), rounding_label(r), rotation_label(r), method_label(r))

    def between_ends(r: dict) -> bool:
        """At its pair's end bits every layer takes one format whatever the average: no budget to compare."""
        pair = get_format_pair(r["pair"])
        return pair.low.bits < float(r["target"]) < pair.high.bits

    simple = {cell(r): r for r in rows if r.get("bit_average") == "simple"}
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    for r in rows:
        if r.get("bit_average") == "weighted" and cell(r) in simple and between_ends(r):
            pairs.setdefault(f"`{method_label(r)}`, {rounding_label(r)}", []).append((r, simple[cell(r)]))
    if not pairs:
        return []
    lines = ["Weighted budget against simple, the same method, cell and seed, on each held-out text:", ""]
    for method, matched in pairs.items():
        ratios = [w[f"ppl_{t}"] / s[f"ppl_{t}"] for w, s in matched for t in texts]
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        extra = sum(s["bits_weighted"] - w["bits_weighted"] for w, s in matched) / len(matched)
        lines.append(
            f"- {method}: weighted lower in {sum(v < 1 for v in ratios)} of {len(ratios)} comparisons; geometric "
            f"mean perplexity ratio {mean:.3f}, with {extra:.3f} fewer weighted bits on average"
        )
    return lines


def rounding_comparison(rows: list[dict], texts: list[str]) -> list[str]:
    """GPTQ against round-to-nearest on the same map (same cell, settings and seed), per method and held-out text."""

    def cell(r: dict) -> tuple:
        return tuple(
            str(r.get(k, ""))
            for k in (
                "method",
                "pair",
                "target",
                "seed",
                "rotation",
                "learn_rotations",
                "sensitivity_rounding",
                "model",
                "eval",
                "offset_groups",
                "bit_average",
            )
        )

    rtn = {cell(r): r for r in rows if r.get("weight_rounding", "rtn") == "rtn"}
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if r.get("weight_rounding") == "gptq" and cell(r) in rtn:
            for t in texts:
                ratios.setdefault(f"`{method_label(r)}`, {rounding_label(r)}", []).append(
                    r[f"ppl_{t}"] / rtn[cell(r)][f"ppl_{t}"]
                )
    if not ratios:
        return []
    lines = ["GPTQ against round-to-nearest, the same map (same cell and seed), on each held-out text:", ""]
    for method, values in ratios.items():
        mean = math.exp(sum(map(math.log, values)) / len(values))
        lines.append(
            f"- {method}: GPTQ lower in {sum(v < 1 for v in values)} of {len(values)} comparisons; geometric mean "
            f"perplexity ratio {mean:.3f}"
        )
    return lines


def setting_comparison(
    rows: list[dict], texts: list[str], setting: str, variant: str | None, reference: str
) -> list[str]:
    """Rows with `setting` = `variant` (None: any value but `reference`) against the row with `reference`, everything
    else equal (method, cell, seed, the other settings, rounding), per method, variant and rounding, on each held-out
    text: what the setting costs or gains on the same budget."""
    keys = ("method", "pair", "target", "seed", "rotation", "learn_rotations", "sensitivity_rounding", "model")
    keys += ("eval", "offset_groups", "bit_average", "weight_rounding", "gptq_samples", "peer_samples", "preset")

    def cell(r: dict, value: str) -> tuple:
        return tuple(
            str(value if k == setting else r.get(k, ""))
            for k in keys
            if k != "learn_rotations" or setting != "rotation"
        )

    references = {cell(r, reference): r for r in rows if r["pair"] and str(r.get(setting)) == reference}
    ratios: dict[str, list[float]] = {}
    for r in rows:
        value = str(r.get(setting))
        if not r["pair"] or value == reference or (variant is not None and value != variant):
            continue
        match = references.get(cell(r, reference))
        label = rotation_label(r) if setting == "rotation" else value
        for t in texts if match else []:
            name = f"`{method_label(r)}`, {label}, {rounding_label(r)}"
            ratios.setdefault(name, []).append(r[f"ppl_{t}"] / match[f"ppl_{t}"])
    if not ratios:
        return []
    lines = [
        f"`{setting}` against `{reference}`, the same method, cell, seed and other settings, on each held-out text:",
        "",
    ]
    for name, values in ratios.items():
        mean = math.exp(sum(map(math.log, values)) / len(values))
        lines.append(
            f"- {name}: lower in {sum(v < 1 for v in values)} of {len(values)} comparisons; geometric mean perplexity "
            f"ratio {mean:.3f} (from {min(values):.3f} to {max(values):.3f})"
        )
    return lines


# The configuration a vLLM user can serve (online transforms on every quantized input, which the exports carry;
# q/k/v and gate/up fused, as vLLM runs them: `DMXConfig`'s default, where the model allows it) and the unrotated,
# ungrouped one (the default before it, and the paper's), as rows' settings.
SERVABLE = {"rotation": "online_block_hadamard", "offset_groups": "fused"}
UNROTATED = {"rotation": "none", "offset_groups": "none"}


def servable_comparison(rows: list[dict], texts: list[str]) -> list[str]:
    """Per cell, the servable configuration (`SERVABLE`) against the unrotated, ungrouped one (`UNROTATED`), the same
    method, pair, target, seed, budget, rounding and evaluation: what a vLLM user gains or pays on each held-out text,
    and what the calibration took."""
    keys = ("method", "sensitivity_rounding", "model", "eval", "pair", "target", "seed", "bit_average")
    keys += ("weight_rounding", "gptq_samples")

    def has(r: dict, settings: dict[str, str]) -> bool:
        return bool(r["pair"]) and not r.get("learn_rotations") and all(r.get(k) == v for k, v in settings.items())

    def cell(r: dict) -> tuple:
        return tuple(str(r.get(k, "")) for k in keys + ("preset",))

    unrotated = {cell(r): r for r in rows if has(r, UNROTATED)}
    lines = []
    for r in rows:
        base = unrotated.get(cell(r)) if has(r, SERVABLE) else None
        if base is None:
            continue
        ratios = [r[f"ppl_{t}"] / base[f"ppl_{t}"] for t in texts]
        per_text = ", ".join(
            f"{t} {r[f'ppl_{t}']} vs {base[f'ppl_{t}']} ({ratio:.3f})" for t, ratio in zip(texts, ratios)
        )
        seconds = [row["calibration_seconds"] + (row.get("gptq_seconds") or 0) for row in (r, base)]
        verdict = "lower on every text" if max(ratios) < 1 else "NOT lower on every text"
        lines.append(
            f"- `{method_label(r)}`, {r['pair']} {r['target']}, seed {r['seed']}, {r.get('bit_average')}, "
            f"{rounding_label(r)}: {per_text}; {verdict}; calibration and rounding {seconds[0]:.0f} s vs "
            f"{seconds[1]:.0f} s"
        )
    if not lines:
        return []
    return [
        "The servable configuration (online_block_hadamard, fused groups: the library's default since it was measured "
        "here) against no rotation and no groups (the default before), the same method, cell, seed, budget and "
        "rounding: held-out perplexity (servable vs unrotated, ratio) and seconds (one process among others: a rough "
        "guide):",
        "",
        *lines,
    ]


def peer_comparison(rows: list[dict], texts: list[str]) -> list[str]:
    """Each peer's row against this package's uniform rows of the same format, rotation and rounding (GPTQ: each
    column order this package's rows ran)."""

    def cell(r: dict) -> tuple:
        return (
            r["model"],
            rotation_label(r),
            r["target"],
            r.get("weight_rounding", "rtn"),
            r.get("gptq_samples"),
            r["eval"],
        )

    ours: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["method"] == "uniform":
            ours.setdefault(cell(r), []).append(r)
    lines = []
    for r in rows:
        for mine in ours.get(cell(r), []) if r["method"] in WEIGHT_PEERS else []:
            ratios = ", ".join(f"{t} {mine[f'ppl_{t}'] / r[f'ppl_{t}']:.3f}" for t in texts)
            lines.append(
                f"- `{r['method']}` ({rotation_label(r)}, {r['target']}, {rounding_label(mine)}): this package's "
                f"perplexity over the peer's: {ratios}; {r.get('gptq_seconds', '-')} s the peer, "
                f"{mine.get('gptq_seconds', '-')} s ours"
            )
    if not lines:
        return []
    return ["Peers against this package, the same uniform format, rotation and rounding:", "", *lines]


def parse_args(argv: list[str] | None = None) -> tuple[Sweep, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Sweep()
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the de-gridded SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="calibration text files (default: five Austen novels)")
    p.add_argument("--eval", nargs="+", help="NAME=FILE held-out texts (default: Pride and Prejudice, Moby Dick)")
    p.add_argument("--methods", default=",".join(d.methods), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--uniform-formats", default=",".join(d.uniform_formats), help="formats of the uniform rows")
    p.add_argument("--pairs", default=",".join(d.pairs), help=f"comma list of {', '.join(FORMAT_PAIRS)}")
    p.add_argument("--targets", help="comma list of target bits (default: per pair, as in the paper)")
    p.add_argument("--seeds", default="0", help="comma list of seeds (calibration sample and order)")
    p.add_argument("--preset", default=d.preset, help="calibration sizes (optimum_dmx.calibration.presets)")
    p.add_argument("--rotation", default=d.rotation, choices=list(ROTATIONS), help="rotate the model first")
    p.add_argument(
        "--learn-rotations",
        action="store_true",
        help="calibrated methods train the merged rotations with the offsets (needs --rotation hadamard or "
        "block_hadamard)",
    )
    p.add_argument("--offset-groups", default=d.offset_groups, choices=["none", "fused"])
    p.add_argument("--bit-average", default=d.bit_average, choices=["simple", "weighted"])
    p.add_argument(
        "--weight-rounding",
        default=d.weight_rounding,
        choices=["rtn", "gptq"],
        help="how each map's weights are rounded",
    )
    p.add_argument("--gptq-samples", type=int, help="GPTQ reads only the first N calibration sequences")
    p.add_argument(
        "--gptq-order",
        default=d.gptq_order,
        choices=["activation", "columns"],
        help="GPTQ rounds each weight's columns in activation order (the library's) or in their own order (its "
        "GPTQ before; rows without `gptq_order` ran it)",
    )
    p.add_argument(
        "--peer-samples", type=int, help="map peers (autoscheme) read only the first N calibration sequences"
    )
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens)
    p.add_argument("--eval-seq-len", type=int, default=d.eval_seq_len)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--runs", type=Path, default=RUNS, help="JSON-lines run results (default: the committed ones)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the table from --runs")
    p.add_argument("--output", type=Path, help="also write the table (and command) here")
    a = p.parse_args(argv)
    methods, pairs = a.methods.split(","), a.pairs.split(",")
    checks = ((methods, METHODS, "method"), (pairs, list(FORMAT_PAIRS), "pair"))
    checks += ((a.uniform_formats.split(","), UNIFORM_FORMATS, "uniform format"),)
    for value, allowed, what in checks:
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"unknown {what} {bad}; allowed: {', '.join(allowed)}")
    get_preset(a.preset)
    if any(m in MAP_PEERS for m in methods) and (a.bit_average, a.offset_groups) != ("weighted", "none"):
        p.error(
            "autoscheme keeps a budget weighted by parameters and chooses each layer alone: pass --bit-average "
            f"weighted and --offset-groups none (got {a.bit_average}, {a.offset_groups})"
        )
    if a.learn_rotations and a.rotation not in ("hadamard", "block_hadamard"):
        p.error(
            f"--learn-rotations trains merged rotations; --rotation {a.rotation} has none (use hadamard or "
            "block_hadamard)"
        )
    sweep = Sweep(
        model=a.model,
        calibration=a.calibration,
        eval_texts=dict(item.split("=", 1) for item in a.eval) if a.eval else None,
        methods=methods,
        uniform_formats=a.uniform_formats.split(","),
        pairs=pairs,
        targets=[float(t) for t in a.targets.split(",")] if a.targets else None,
        seeds=[int(s) for s in a.seeds.split(",")],
        preset=a.preset,
        rotation=a.rotation,
        offset_groups=a.offset_groups,
        bit_average=a.bit_average,
        weight_rounding=a.weight_rounding,
        learn_rotations=a.learn_rotations,
        gptq_samples=a.gptq_samples,
        gptq_order=a.gptq_order,
        peer_samples=a.peer_samples,
        eval_tokens=a.eval_tokens,
        eval_seq_len=a.eval_seq_len,
    )
    return sweep, a


def main(argv: list[str] | None = None) -> None:
    sweep, a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.report_only:
        run_sweep(sweep, a.runs)
    preset = get_preset(sweep.preset)
    header = (
        f"Calibration at preset sizes (`{sweep.preset}`: {preset.steps} steps of {preset.batch_size} x "
        f"{preset.seq_len} tokens, paper lr {preset.paper.lr:g}); evaluation: the first {sweep.eval_tokens} "
        f"tokens from {sweep.eval_offset:.0%} into each held-out text, non-overlapping {sweep.eval_seq_len}-token "
        "windows, exp(mean NLL); weights and input activations of every decoder linear MX-quantized (block 32), "
        "lm_head in float. Times: wall-clock seconds on the machine that ran the row (`GPTQ s`: the rounding, "
        "`rounding` gptq rows, on the calibration sequences at the preset's sizes).\n\n"
        "Rows are added by `python benchmarks/bench_quality.py --seeds 0,1` (float, uniform, dmx, paper, kl and the "
        "llmcompressor peer, at the default weighted budget; `--bit-average simple` for the per-layer one) and the "
        "AutoScheme peer's rows by `python benchmarks/bench_quality.py --methods autoscheme --seeds 0,1 --peer-samples "
        "80`; GPTQ, rotation and grouping rows by the commands at the top of `benchmarks/bench_quality.py`.\n\n"
    )
    write_report(header + report(read_json_lines(a.runs)), a.output, "Quality: held-out perplexity against bits")


if __name__ == "__main__":
    sys.exit(main())
