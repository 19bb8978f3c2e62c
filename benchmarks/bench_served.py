#!/usr/bin/env python
"""Served quality: a quality-table map exported to a serving format and evaluated through the loader's own code.

For a `dmx` run of the quality benchmark (`bench_quality.py`: its rotation, offset groups, budget, pair, target and
seed), its format map becomes a dMX checkpoint with the export target's activation scale rule
(`DMXConfig(format_map=..., rotation=..., scale_rule=TARGET, weight_rounding=...)`, the same calibration sequences
for GPTQ), which is exported (`optimum_dmx.export`), loaded by transformers with the loader library installed
(compressed-tensors or amd-quark), its online transforms applied by that library, and evaluated with the quality
benchmark's evaluation in bfloat16 (the dtype the loaders compute in). The dMX checkpoint itself, loaded in
bfloat16, is evaluated beside it: `served / dMX` is what the export changes, and the quality row's perplexity
(float32, the OCP scale rule) is shown for reference. What a vLLM user runs:

    python benchmarks/bench_served.py --rotation online_block_hadamard --offset-groups fused --pair mxfp8-mxfp4 \
        --target 5 --to compressed-tensors --output benchmarks/results/served.md

Each finished run is appended to `--runs` (default `results/served_runs.jsonl`) with the commit it ran at, and
skipped when asked again unless `--again` (a row beside the earlier ones, e.g. after the library changed); the table is
rebuilt from all of them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_quality import SKIPPED, Sweep, gptq_order, rounding_label

from optimum_dmx import DMXConfig
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.export import export_checkpoint, load_exported

from common import (
    append_json_line,
    benchmark_model,
    benchmark_texts,
    read_json_lines,
    source_commit,
    write_report,
)

RESULTS = Path(__file__).parent / "results"
CELL = ("rotation", "offset_groups", "bit_average", "pair", "target", "seed")


def quality_runs(runs: Path, cell: dict, model: str) -> dict[str, dict]:
    """The `dmx` runs of `cell` on `model` in the quality runs, by weight rounding (GPTQ's: in the library's column
    order, activation order); the round-to-nearest one, whose map every rounding shares, must be there."""
    found = {
        row.get("weight_rounding", "rtn"): row
        for row in read_json_lines(runs)
        if row.get("method") == "dmx"
        and row.get("model") == model
        and all(str(row.get(key)) == str(value) for key, value in cell.items())
        and not row.get("learn_rotations")
        and not row.get("gptq_samples")
        and (row.get("weight_rounding", "rtn") == "rtn" or gptq_order(row) == "activation")
    }
    if not found.get("rtn", {}).get("format_map"):
        raise SystemExit(f"{runs} has no dmx run with a format map for {cell}: run bench_quality.py for it first")
    return found


def load_served(folder: Path) -> torch.nn.Module:
    """The exported checkpoint loaded by transformers in bfloat16, its online transforms applied by the loader."""
    return load_exported(folder, dtype=torch.bfloat16).eval()


def perplexities(model: torch.nn.Module, tokenizer, texts: dict[str, str], sweep: Sweep) -> dict[str, float]:
    with torch.no_grad():
        return {
            name: round(
                evaluate_perplexity(model, tokenizer, text, sweep.eval_seq_len, sweep.eval_tokens, 4).perplexity, 4
            )
            for name, text in texts.items()
        }


def run(cell: dict, target: str, rounding: str, runs: Path, sweep: Sweep) -> dict:
    """Quantize, save, export and evaluate `cell`'s map (`sweep`: the model, texts and evaluation sizes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    found = quality_runs(runs, cell, sweep.key("dmx", "", "", 0)["model"])
    source, reference = found["rtn"], found.get(rounding, {})
    corpus = None if sweep.calibration and sweep.eval_texts else benchmark_texts()
    model_dir = sweep.model or benchmark_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = {}
    for name, path in (sweep.eval_texts or corpus.evaluation).items():
        text = Path(path).read_text(encoding="utf-8")
        texts[name] = text[int(len(text) * sweep.eval_offset) :]
    config = DMXConfig(
        format_map=source["format_map"],
        rotation=cell["rotation"],
        scale_rule=target,
        weight_rounding=rounding,
        dataset=[Path(path).read_text(encoding="utf-8") for path in sweep.calibration or corpus.calibration],
        tokenizer=tokenizer,
        preset=source["preset"],
        seed=int(cell["seed"]),
        modules_to_not_convert=list(SKIPPED),
    )
    row = {**cell, "to": target, "weight_rounding": rounding, "preset": source["preset"], "commit": source_commit()}
    if rounding == "gptq":
        row["gptq_order"] = "activation"  # the library's (`calibration.gptq`); rows without it: columns
    row.update({k: source[k] for k in ("bits_simple", "bits_weighted", "storage_bits")})
    row.update({f"quality_ppl_{name}": reference.get(f"ppl_{name}", "-") for name in texts})
    with tempfile.TemporaryDirectory(prefix="dmx-served-") as folder:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config)
        model.save_pretrained(Path(folder) / "dmx")
        row["quantize_seconds"] = round(time.perf_counter() - start, 1)
        del model
        # transformers' loaders read any map; vLLM only maps whose fused projections share a format (groups fused)
        export_checkpoint(Path(folder) / "dmx", Path(folder) / "served", target, force=cell["offset_groups"] != "fused")
        dmx = AutoModelForCausalLM.from_pretrained(Path(folder) / "dmx", dtype=torch.bfloat16).eval()
        row.update({f"dmx_ppl_{k}": v for k, v in perplexities(dmx, tokenizer, texts, sweep).items()})
        del dmx
        served = load_served(Path(folder) / "served")
        row.update({f"served_ppl_{k}": v for k, v in perplexities(served, tokenizer, texts, sweep).items()})
    return row


def report(rows: list[dict]) -> str:
    if not rows:
        return "no results yet\n"
    texts = sorted(k.removeprefix("served_ppl_") for k in rows[0] if k.startswith("served_ppl_"))
    head = ["rotation", "groups", "budget", "pair", "target", "seed", "to", "rounding", "bits (weighted)"]
    head += [f"{label} {t}" for t in texts for label in ("quality row", "dMX bf16", "served", "served / dMX")]
    head.append("commit")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: tuple(str(r[k]) for k in (*CELL, "to", "weight_rounding"))):
        cells = [r["rotation"], r["offset_groups"], r["bit_average"], r["pair"], r["target"], r["seed"], r["to"]]
        cells += [rounding_label(r), r["bits_weighted"]]
        for t in texts:
            cells += [r[f"quality_ppl_{t}"], r[f"dmx_ppl_{t}"], r[f"served_ppl_{t}"]]
            cells.append(f"{r[f'served_ppl_{t}'] / r[f'dmx_ppl_{t}']:.4f}")
        cells.append(r.get("commit", "-"))
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The options naming the model, the calibration and held-out texts and the evaluation's sizes (`sweep_from`)."""
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the de-gridded SmolLM2-135M)")
    p.add_argument("--calibration", type=Path, nargs="+", help="calibration text files (default: five Austen novels)")
    p.add_argument("--eval", nargs="+", help="NAME=FILE held-out texts (default: Pride and Prejudice, Moby Dick)")
    p.add_argument("--eval-tokens", type=int, default=Sweep.eval_tokens)
    p.add_argument("--eval-seq-len", type=int, default=Sweep.eval_seq_len)


def sweep_from(a: argparse.Namespace) -> Sweep:
    """The `Sweep` of the options `add_sweep_arguments` added (None where left to the default model and texts)."""
    return Sweep(
        model=a.model,
        calibration=a.calibration,
        eval_texts=dict(item.split("=", 1) for item in a.eval) if a.eval else None,
        eval_tokens=a.eval_tokens,
        eval_seq_len=a.eval_seq_len,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(p)
    p.add_argument("--rotation", default="none")
    p.add_argument("--offset-groups", default="fused")
    p.add_argument("--bit-average", default="weighted")
    p.add_argument("--pair", default="mxfp8-mxfp4")
    p.add_argument("--target", default="5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--to", choices=("compressed-tensors", "quark"), default="compressed-tensors")
    p.add_argument("--weight-rounding", choices=("rtn", "gptq"), default="gptq")
    p.add_argument("--quality-runs", type=Path, default=RESULTS / "quality_runs.jsonl")
    p.add_argument("--runs", type=Path, default=RESULTS / "served_runs.jsonl")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--again", action="store_true", help="run the cell even if --runs holds it (a row beside)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--output", type=Path, default=None, help="also write the table (and command) here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    values = (a.rotation, a.offset_groups, a.bit_average, a.pair, a.target, a.seed)
    cell = dict(zip(CELL, map(str, values), strict=True)) | {"seed": a.seed}
    done = any(
        all(str(r.get(k)) == str(v) for k, v in cell.items())
        and (r["to"], r["weight_rounding"]) == (a.to, a.weight_rounding)
        and (a.weight_rounding == "rtn" or gptq_order(r) == "activation")
        for r in read_json_lines(a.runs)
    )
    if not a.report_only and (a.again or not done):
        row = run(cell, a.to, a.weight_rounding, a.quality_runs, sweep_from(a))
        append_json_line(a.runs, row | {"torch_threads": torch.get_num_threads()})
    header = (
        "Each row: a `dmx` map of the quality benchmark (`quality row`: the same map and rounding's perplexity there, "
        "float32, OCP scale rule; `-` where it did not run) "
        "quantized with the target's scale rule and rounding, saved, exported, and evaluated in bfloat16 as this "
        "package loads the dMX checkpoint (`dMX bf16`) and as transformers loads the export with the loader library "
        "applying its transforms (`served`); the quality benchmark's evaluation (16384 tokens from 10% into each "
        "held-out text, 512-token windows). Rows with groups `none` are exported with `--force` (vLLM fuses q/k/v and "
        "gate/up and would refuse their maps; transformers' loaders read them). A row is added by "
        "`python benchmarks/bench_served.py --rotation R --offset-groups G --bit-average B --pair P --target T "
        "--seed S --to X --weight-rounding W` with its columns' values (the quality row must have run first). "
        "`commit`: the repository's commit the row ran at (`+`: with uncommitted changes to the package's source; "
        "`-`: not recorded, rows run before `bd260cd`, which moved `online_block_hadamard`'s `o_proj` transform into "
        "`v_proj`'s rows); `--again` adds a row of a cell beside its earlier ones.\n\n"
    )
    write_report(header + report(read_json_lines(a.runs)), a.output, "Served quality: exported checkpoints")


if __name__ == "__main__":
    sys.exit(main())
