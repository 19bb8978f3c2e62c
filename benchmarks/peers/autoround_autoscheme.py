#!/usr/bin/env python
"""Intel auto-round's AutoScheme: a per-layer choice between MX formats at an average bit budget, by its own code.

Runs in auto-round's environment (`requirements-autoround.txt`, created by `common.peer_python`), not in
optimum-dmx's: the quality benchmark starts it as a subprocess with the model folder, the calibration token ids it
gives dMX and the budget, and evaluates the map that comes back with its own evaluation (the same as every row's).

AutoScheme scores every layer in every option (`sum |dL/dW_q (W - W_q)| + sum |dL/dx_q (x - x_q)|` over the
calibration tokens) and solves a knapsack over parameter-weighted bits. Its budget is passed with
`ignore_scale_zp_bits=True`: element bits weighted by weight elements (MXFP4 = 4, MXFP8 = 8), this package's
`bit_average="weighted"` but for the activation's `in_features` that ours adds to each layer's weight (under 0.2%
of a layer here). AutoScheme takes calibration data as a text file only: each sequence is decoded, with a few
tokens of the next one so that re-tokenizing cannot fall short of `seq_len`, and AutoScheme cuts it back to
`seq_len` tokens. Writes, into `--output`:

* `format_map.json`: each scored linear's format, by module name, in this package's format names;
* `run.json`: the options, the budget, the wall time of AutoScheme's search and the library versions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from auto_round import AutoRound, AutoScheme
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

FORMATS = {"MXFP4": (4, "mxfp4_e2m1"), "MXFP6": (6, "mxfp6_e2m3"), "MXFP8": (8, "mxfp8_e4m3")}  # bits, our name
MARGIN_TOKENS = 8  # of the next sequence, decoded after each one


def calibration_file(tokenizer, input_ids: torch.Tensor, path: Path) -> None:
    """One JSON line of text per calibration sequence (AutoScheme's `local` dataset)."""
    with path.open("w", encoding="utf-8") as out:
        for i, ids in enumerate(input_ids):
            following = input_ids[(i + 1) % len(input_ids), :MARGIN_TOKENS]
            text = tokenizer.decode(torch.cat([ids, following]).tolist())
            out.write(json.dumps({"text": text}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="Hugging Face model folder (with its tokenizer)")
    p.add_argument("--tokens", type=Path, required=True, help="safetensors file holding `input_ids` [n, seq_len]")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--options", default="MXFP4,MXFP8", help=f"comma list of {', '.join(FORMATS)}")
    p.add_argument("--avg-bits", type=float, required=True, help="element bits weighted by weight elements")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    options = a.options.split(",")
    unknown = [o for o in options if o not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown options {unknown}; allowed: {', '.join(FORMATS)}")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    input_ids = load_file(a.tokens)["input_ids"]
    samples, seq_len = input_ids.shape
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "calibration.jsonl"
        calibration_file(tokenizer, input_ids, data)
        scheme = AutoScheme(
            avg_bits=a.avg_bits,
            options=tuple(options),
            ignore_scale_zp_bits=True,
            nsamples=samples,
            seqlen=seq_len,
            batch_size=a.batch_size,
        )
        start = time.perf_counter()
        rounder = AutoRound(
            model, tokenizer, scheme=scheme, iters=0, dataset=str(data), nsamples=samples, seqlen=seq_len
        )
        rounder.post_init()  # chooses the layer config; nothing is quantized yet
        seconds = time.perf_counter() - start
    by_bits = {FORMATS[o][0]: FORMATS[o][1] for o in options}
    format_map = {}
    for name, config in rounder.layer_config.items():
        bits = config.get("bits")
        if bits in by_bits and config.get("data_type", "").startswith("mx_fp"):
            format_map[name] = by_bits[bits]
        elif bits is not None and bits < 16:
            raise SystemExit(f"AutoScheme gave {name} {config}, which is none of {options}")
    a.output.mkdir(parents=True, exist_ok=True)
    (a.output / "format_map.json").write_text(json.dumps(format_map, indent=1))
    run = {
        "options": options,
        "avg_bits": a.avg_bits,
        "samples": samples,
        "seq_len": seq_len,
        "seconds": round(seconds, 1),
        "layers": len(format_map),
        "versions": {name: version(name) for name in ("auto-round", "transformers", "torch")},
    }
    (a.output / "run.json").write_text(json.dumps(run, indent=1))
    print(json.dumps(run))


if __name__ == "__main__":
    main()
