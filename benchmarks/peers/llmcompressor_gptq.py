#!/usr/bin/env python
"""llm-compressor's GPTQ with one of its preset schemes (default `MXFP4`), run by its own `oneshot` entry point.

Runs in llm-compressor's environment (`requirements-llmcompressor.txt`, created by `common.peer_python`), not in
optimum-dmx's: the quality benchmark starts it as a subprocess, hands it the model folder and the calibration token
ids it gives dMX, and evaluates what comes back with its own evaluation. Writes, into `--output`:

* `weights.safetensors`: each quantized linear's weight as llm-compressor left it (its quantized values times its
  scales, in float32), by module name;
* `run.json`: the scheme, the wall time of `oneshot` and the library versions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from llmcompressor.modifiers.quantization import GPTQModifier
from llmcompressor_oneshot import library_versions, oneshot_on_tokens
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="Hugging Face model folder")
    p.add_argument("--tokens", type=Path, required=True, help="safetensors file holding `input_ids` [n, seq_len]")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--scheme", default="MXFP4", help="a compressed-tensors preset scheme")
    p.add_argument("--threads", type=int)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    seconds = oneshot_on_tokens(model, a.tokens, GPTQModifier(targets="Linear", scheme=a.scheme, ignore=["lm_head"]))
    weights = {
        name: module.weight.detach().float().contiguous()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and hasattr(module, "weight_scale")
    }
    a.output.mkdir(parents=True, exist_ok=True)
    save_file(weights, a.output / "weights.safetensors")
    run = {
        "scheme": a.scheme,
        "seconds": round(seconds, 1),
        "layers": len(weights),
        "versions": library_versions(),
    }
    (a.output / "run.json").write_text(json.dumps(run, indent=1))
    print(json.dumps(run))


if __name__ == "__main__":
    main()
