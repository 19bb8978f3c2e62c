#!/usr/bin/env python
"""llm-compressor's QuIP transforms with GPTQ in one of its preset schemes (default `MXFP4`), run by its own `oneshot`
entry point and saved as the compressed-tensors checkpoint it writes.

Runs in llm-compressor's environment (`requirements-llmcompressor.txt`, created by `common.peer_python`), not in
optimum-dmx's: the served-quality benchmark starts it as a subprocess with the model folder and the calibration token
ids dMX's GPTQ reads, then loads what it saved with transformers and compressed-tensors (its online transforms applied
by compressed-tensors' code, `optimum_dmx.export.load_exported`) and evaluates it as it evaluates dMX's exports. The
recipe is llm-compressor's QuIP-with-GPTQ example's: `QuIPModifier(rotations=["v", "u"], transform_type=...,
transform_block_size=...)` then `GPTQModifier(targets="Linear", scheme=..., ignore=["lm_head"])` (`--rotations ""`:
GPTQ alone). Writes, into
`--output`:

* `model/`: the checkpoint (`save_pretrained(..., save_compressed=True)`) and the model folder's tokenizer;
* `run.json`: the recipe's settings, the wall time of `oneshot` and the library versions.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from llmcompressor.modifiers.quantization import GPTQModifier
from llmcompressor.modifiers.transform import QuIPModifier
from llmcompressor_oneshot import library_versions, oneshot_on_tokens
from transformers import AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="Hugging Face model folder")
    p.add_argument("--tokens", type=Path, required=True, help="safetensors file holding `input_ids` [n, seq_len]")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--scheme", default="MXFP4", help="a compressed-tensors preset scheme")
    p.add_argument("--transform-type", default="hadamard", choices=("hadamard", "random-hadamard", "random-matrix"))
    p.add_argument("--transform-block-size", type=int, default=32, help="the transforms' block size")
    p.add_argument("--rotations", default="v,u", help="QuIP's rotations, comma-separated ('': GPTQ alone)")
    p.add_argument("--threads", type=int)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rotations = [rotation for rotation in a.rotations.split(",") if rotation]
    quip = QuIPModifier(
        rotations=rotations, transform_type=a.transform_type, transform_block_size=a.transform_block_size
    )
    recipe = [quip] if rotations else []
    recipe.append(GPTQModifier(targets="Linear", scheme=a.scheme, ignore=["lm_head"]))
    seconds = oneshot_on_tokens(model, a.tokens, recipe)
    model.save_pretrained(a.output / "model", save_compressed=True)
    for name in TOKENIZER_FILES:
        if (a.model / name).exists():
            shutil.copy(a.model / name, a.output / "model" / name)
    run = {
        "scheme": a.scheme,
        "rotations": rotations,
        "transform_type": a.transform_type,
        "transform_block_size": a.transform_block_size,
        "seconds": round(seconds, 1),
        "versions": library_versions(),
    }
    (a.output / "run.json").write_text(json.dumps(run, indent=1))
    print(json.dumps(run))


if __name__ == "__main__":
    main()
