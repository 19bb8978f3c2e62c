#!/usr/bin/env python
"""Served uniform MXFP4: dMX's rotation and GPTQ against llm-compressor's QuIP transforms and GPTQ, each written as
the compressed-tensors checkpoint its own code writes and evaluated through the same loader.

Every row quantizes the de-gridded SmolLM2-135M's linears (`lm_head` kept in float) to MXFP4 weights and input
activations, its weights rounded by GPTQ on the same calibration sequences (the preset's, from the five Austen novels,
for the seed). The checkpoint is then loaded by transformers with compressed-tensors in bfloat16, its online
transforms applied by compressed-tensors' code (`optimum_dmx.export.load_exported`), and evaluated with the quality
benchmark's evaluation (`bench_served.perplexities`: 16,384 tokens from 10% into each held-out text, 512-token
windows). Rows:

* `dmx`: `DMXConfig(format_map=every layer MXFP4, rotation=..., scale_rule="compressed-tensors",
  weight_rounding="gptq")`, saved and exported to compressed-tensors (`optimum_dmx.export`); `hadamard+learned`:
  `DMXConfig(target_bits=4, rotation="hadamard", learn_rotations=True, ...)`, whose calibration learns the merged
  rotations (the preset's steps) and puts every layer in MXFP4;
* `llmcompressor`: llm-compressor's `oneshot` with GPTQ in its `MXFP4` scheme, after its QuIP transforms
  (`quip`: "v" on each linear's input, "u" on its output, Hadamard blocks of 32; `quip-v`: "v" alone) or without
  (`none`), saved
  compressed by llm-compressor (`peers/llmcompressor_quip.py`, in its own environment: `common.peer_python`).

    python benchmarks/bench_served_peers.py --threads 2 --output benchmarks/results/served_peers.md

Each finished row is appended to `--runs` (default `results/served_peers_runs.jsonl`) and skipped when asked again;
the table, rebuilt from all of them, gives each row's perplexity over the llm-compressor QuIP row's of its seed, and
how many online transforms compressed-tensors attached to the loaded model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_quality import SKIPPED, Sweep, gptq_order
from bench_served import add_sweep_arguments, load_served, perplexities, sweep_from
from compressed_tensors.transform.factory.base import TransformBase
from safetensors.torch import save_file

from optimum_dmx import DMXConfig
from optimum_dmx.calibration import build_calibration_batches, get_preset, uniform_format_map
from optimum_dmx.export import export_checkpoint

from common import append_json_line, benchmark_model, benchmark_texts, peer_python, read_json_lines, write_report

RESULTS = Path(__file__).parent / "results"
ROWS = (  # method:transforms
    "dmx:none",
    "dmx:online_block_hadamard",
    "dmx:hadamard",
    "dmx:hadamard+learned",
    "llmcompressor:none",
    "llmcompressor:quip",
    "llmcompressor:quip-v",
)
REFERENCE = "llmcompressor:quip"
QUIP_ROTATIONS = {"quip": "v,u", "quip-v": "v", "none": ""}  # llm-compressor's `transforms`: QuIP's rotations


def dmx_checkpoint(
    folder: Path, model_dir: Path, rotation: str, calibration: list[str], tokenizer, preset: str, seed: int
) -> Path:
    """The model in uniform MXFP4 with `rotation` (`<rotation>+learned`: its merged rotations learned by a
    calibration at 4 bits, which puts every layer in MXFP4), GPTQ-rounded with compressed-tensors' scale rule, saved
    and exported to compressed-tensors under `folder`; returns the export."""
    from transformers import AutoModelForCausalLM

    rotation, learned, _ = rotation.partition("+learned")
    if learned:
        mapped = {"target_bits": 4.0, "format_pair": "mxfp8-mxfp4", "learn_rotations": True}
    else:
        float_model = AutoModelForCausalLM.from_pretrained(model_dir)
        mapped = {"format_map": uniform_format_map(float_model, "mxfp4_e2m1", SKIPPED)}
    config = DMXConfig(
        **mapped,
        rotation=rotation,
        scale_rule="compressed-tensors",
        weight_rounding="gptq",
        dataset=calibration,
        tokenizer=tokenizer,
        preset=preset,
        seed=seed,
        modules_to_not_convert=list(SKIPPED),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config)
    formats = set(model.config.quantization_config.format_map.values())
    if formats != {"mxfp4_e2m1"}:
        raise RuntimeError(f"the {rotation} model is not uniform MXFP4: its map holds {sorted(formats)}")
    model.save_pretrained(folder / "dmx")
    return export_checkpoint(folder / "dmx", folder / "served", "compressed-tensors")


def llmcompressor_checkpoint(
    folder: Path, model_dir: Path, transforms: str, sequences: torch.Tensor
) -> tuple[Path, dict]:
    """llm-compressor's GPTQ MXFP4 checkpoint of the model (after the QuIP rotations `QUIP_ROTATIONS[transforms]`)
    made by its own code on `sequences`, under `folder`; returns it and the peer's run record."""
    save_file({"input_ids": sequences.contiguous()}, folder / "tokens.safetensors")
    command = [str(peer_python("llmcompressor")), str(Path(__file__).parent / "peers" / "llmcompressor_quip.py")]
    command += ["--model", str(model_dir), "--tokens", str(folder / "tokens.safetensors")]
    command += ["--output", str(folder / "peer"), "--threads", str(torch.get_num_threads())]
    command += ["--rotations", QUIP_ROTATIONS[transforms]]
    subprocess.run(command, check=True)
    return folder / "peer" / "model", json.loads((folder / "peer" / "run.json").read_text())


def run(row: str, preset: str, seed: int, sweep: Sweep) -> dict:
    """Quantize the model as `row` says, load its checkpoint through compressed-tensors and evaluate it (`sweep`: the
    model, texts and evaluation sizes)."""
    from transformers import AutoTokenizer

    method, transforms = row.split(":")
    corpus = None if sweep.calibration and sweep.eval_texts else benchmark_texts()
    model_dir = sweep.model or benchmark_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calibration = [Path(path).read_text(encoding="utf-8") for path in sweep.calibration or corpus.calibration]
    texts = {}
    for name, path in (sweep.eval_texts or corpus.evaluation).items():
        text = Path(path).read_text(encoding="utf-8")
        texts[name] = text[int(len(text) * sweep.eval_offset) :]
    settings = get_preset(preset)
    result = {"row": row, "model": model_dir.name, "preset": preset, "seed": seed}
    if method == "dmx":
        result["gptq_order"] = "activation"  # the library's GPTQ (`calibration.gptq`); rows without it: columns
    with tempfile.TemporaryDirectory(prefix="dmx-served-peers-") as work:
        start = time.perf_counter()
        if method == "dmx":
            folder = dmx_checkpoint(Path(work), model_dir, transforms, calibration, tokenizer, preset, seed)
        else:
            sequences = build_calibration_batches(calibration, tokenizer, settings.seq_len, settings.num_samples, seed)
            folder, result["peer"] = llmcompressor_checkpoint(
                Path(work), model_dir, transforms, sequences[: settings.gptq_samples]
            )
        result["quantize_seconds"] = round(time.perf_counter() - start, 1)
        served = load_served(folder)
        result["online_transforms"] = sum(isinstance(module, TransformBase) for module in served.modules())
        result.update({f"ppl_{name}": value for name, value in perplexities(served, tokenizer, texts, sweep).items()})
    return result


def report(rows: list[dict]) -> str:
    if not rows:
        return "no results yet\n"
    texts = sorted(k.removeprefix("ppl_") for k in rows[0] if k.startswith("ppl_"))
    reference = {(r["model"], r["seed"]): r for r in rows if r["row"] == REFERENCE}
    head = ["model", "method", "transforms", "online transforms", "preset", "seed", "quantize s"]
    head += [f"{label} {t}" for t in texts for label in ("ppl", f"/ {REFERENCE}")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["model"], r["seed"], ROWS.index(r["row"]))):
        method, transforms = r["row"].split(":")
        if method == "dmx" and gptq_order(r) == "columns":
            method = "dmx (GPTQ in column order)"
        cells = [
            r["model"],
            method,
            transforms,
            r["online_transforms"],
            r["preset"],
            r["seed"],
            r["quantize_seconds"],
        ]
        for t in texts:
            ref = reference.get((r["model"], r["seed"]), {}).get(f"ppl_{t}")
            cells += [r[f"ppl_{t}"], f"{r[f'ppl_{t}'] / ref:.4f}" if ref else "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(p)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--preset", default="cpu-bench", help="the calibration sequences' sizes (GPTQ reads its share)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=Path, default=RESULTS / "served_peers_runs.jsonl")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--output", type=Path, default=None, help="also write the table (and command) here")
    a = p.parse_args(argv)
    rows = a.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; allowed: {', '.join(ROWS)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    sweep = sweep_from(a)
    model = (a.model or Path("smollm2-135m-degridded")).name
    done = {  # a dMX row of this package's GPTQ before activation order is not one of today's
        (r["row"], r["model"], r["preset"], r["seed"])
        for r in read_json_lines(a.runs)
        if not r["row"].startswith("dmx:") or gptq_order(r) == "activation"
    }
    for row in [] if a.report_only else rows:
        if (row, model, a.preset, a.seed) not in done:
            append_json_line(a.runs, run(row, a.preset, a.seed, sweep) | {"torch_threads": torch.get_num_threads()})
    header = (
        "Uniform MXFP4 weights and activations of the de-gridded SmolLM2-135M (lm_head float), GPTQ-rounded on the "
        "same calibration sequences, each checkpoint written by its own library's code and evaluated as transformers "
        "loads it with compressed-tensors (bfloat16, online transforms applied by compressed-tensors); the quality "
        "benchmark's evaluation (16384 tokens from 10% into each held-out text, 512-token windows). `quantize s`: the "
        "wall time from the float model to the checkpoint (dMX: quantizing, saving and exporting; llm-compressor: its "
        "process, installing excepted), on a machine that may have run other work. A row is added by "
        "`python benchmarks/bench_served_peers.py --rows ROW[,ROW] --threads 2`.\n\n"
    )
    write_report(header + report(read_json_lines(a.runs)), a.output, "Served peers: uniform MXFP4")


if __name__ == "__main__":
    sys.exit(main())
