#!/usr/bin/env python
"""Study: can `online_block_hadamard` drop `o_proj`'s online transform by merging it into `v_proj`'s rows?

`o_proj` reads, per query head, a mix over tokens of its value head's `v_proj` outputs. Attention mixes tokens, not
features, so a block-diagonal transform `B` of `o_proj`'s input whose blocks lie within a head (block size dividing
`head_dim`, the same matrix on every block) can be computed by `v_proj` instead: `v_proj`'s rows become `B^T W_v`
(its bias `b_v B`), and `o_proj`, whose weight already holds `W_o B`, reads its input as it comes. One of the four
online transforms of each decoder layer goes, the function stays (the rotation's random signs already go into
`v_proj`'s rows). But the quantized model changes: `v_proj`'s weight rows are now mixtures of 32 rows, and their MX
blocks (along its inputs) round differently; `o_proj`'s input is the same value computed in another order.

Measured: the de-gridded SmolLM2-135M, `rotation="online_block_hadamard"`, round to nearest, two format maps (uniform
MXFP4; the inference benchmark's map, MXFP8 on every fifth unit, fused groups) and three rotation seeds (`--seeds`:
the random signs the rotation draws), each quantized with `o_proj`'s transform online (today's rotation) and merged
into `v_proj`; held-out perplexity of the first 16,384 tokens from 10% into Pride and Prejudice and Moby Dick,
512-token windows, bfloat16. Besides: the float (unquantized) rotated models' logits on the first window (printed),
to check that the merge keeps the function, and `v_proj`'s MXFP4 weight rounding error in both (the first row of the
results), to see whether mixing its rows makes its weight harder to quantize.

    python research/o_proj_transform_in_values.py --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_inference import mixed_format_map  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from optimum_dmx import DMXConfig  # noqa: E402
from optimum_dmx.evaluation import evaluate_perplexity  # noqa: E402
from optimum_dmx.formats import quantize_mx  # noqa: E402
from optimum_dmx.nn import rotation  # noqa: E402
from optimum_dmx.nn.placement import replace_module  # noqa: E402
from optimum_dmx.nn.transforms import RandomizedHadamard  # noqa: E402

from common import benchmark_model, benchmark_texts  # noqa: E402

EVAL_TOKENS, SEQ_LEN = 16384, 512
every_input = rotation._transform_every_input


def o_proj_transform_in_values(model: nn.Module, quantized, block_size: int, seed: int) -> dict:
    """`online_block_hadamard` as today, then each `o_proj`'s online transform merged into its `v_proj`'s rows."""
    transforms = every_input(model, quantized, block_size, seed)
    for name in [n for n in transforms if n.endswith(".o_proj")]:
        parent = name.rpartition(".")[0]
        o_proj, v_proj = model.get_submodule(name), model.get_submodule(parent + ".v_proj")
        online = o_proj.input_transform
        head_dim = model.get_submodule(parent).head_dim
        if online.signed or online.odd != 1 or head_dim % online.block_size:
            raise ValueError(f"{name}: its transform cannot move into v_proj ({online!r}, head_dim {head_dim})")
        # Unsigned power-of-two blocks: the same Hadamard matrix on every block, whatever the seed.
        rotation._merge_output_side(
            model, parent + ".v_proj", RandomizedHadamard(v_proj.out_features, online.block_size, 0, signed=False)
        )
        plain = nn.Linear(o_proj.in_features, o_proj.out_features, bias=o_proj.bias is not None, device="meta")
        plain.weight, plain.bias = o_proj.weight, o_proj.bias
        replace_module(model, name, plain)
        del transforms[name]
    return transforms


def v_proj_errors(model_dir: Path) -> dict:
    """Relative MXFP4 rounding error of `v_proj`'s weight (`||Q(W) - W|| / ||W||`, float32, rounded to nearest) in
    each decoder layer of the rotated float models, today's and merged, and the spread of its rows' norms (largest
    over smallest): MX blocks run along a row, so a row's blocks are scaled to its own magnitude until rows mix."""
    errors = {}
    for merged in (False, True):
        model = load(model_dir, None, merged)
        layer_errors, spreads = [], []
        for name, module in model.named_modules():
            if name.endswith(".v_proj"):
                weight = module.weight.detach().float()
                error = (quantize_mx(weight, "mxfp4_e2m1") - weight).norm() / weight.norm()
                layer_errors.append(error.item())
                norms = weight.norm(dim=1)
                spreads.append((norms.max() / norms.min()).item())
        key = "in v_proj" if merged else "online"
        errors[key] = {
            "mean relative error": round(sum(layer_errors) / len(layer_errors), 5),
            "layers with the larger error": None,
            "row norm spread (median over layers)": round(sorted(spreads)[len(spreads) // 2], 2),
        }
        errors[key]["_per_layer"] = layer_errors
    online, merged = errors["online"].pop("_per_layer"), errors["in v_proj"].pop("_per_layer")
    errors["in v_proj"]["layers with the larger error"] = sum(m > o for o, m in zip(online, merged))
    errors["online"]["layers with the larger error"] = sum(o > m for o, m in zip(online, merged))
    return {"v_proj MXFP4 weight error": errors, "layers": len(online)}


def load(model_dir: Path, format_map: dict | None, merged: bool, seed: int = 0) -> nn.Module:
    config = None
    if format_map is not None:
        config = DMXConfig(format_map=format_map, rotation="online_block_hadamard", seed=seed)
    patch = (
        mock.patch.object(rotation, "_transform_every_input", o_proj_transform_in_values)
        if merged
        else mock.patch.object(rotation, "_transform_every_input", every_input)
    )
    with patch:
        if config is None:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            quantized = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
            with torch.no_grad():
                rotation.rotate_model(model, "online_block_hadamard", quantized, seed=seed)
            return model
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, quantization_config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="rotation seeds")
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("o_proj_transform_in_values.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = benchmark_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = {name: path.read_text(encoding="utf-8") for name, path in benchmark_texts().evaluation.items()}
    texts = {name: text[len(text) // 10 :] for name, text in texts.items()}

    window = tokenizer(texts["pride_prejudice"], return_tensors="pt").input_ids[:, :SEQ_LEN]
    with torch.no_grad():
        logits = [load(model_dir, None, merged).float()(window).logits for merged in (False, True)]
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(window).logits
    print(
        f"float, rotated: max |logit difference| today vs merged {(logits[0] - logits[1]).abs().max():.2e}, "
        f"vs unrotated {(logits[0] - plain).abs().max():.2e}"
    )
    rows = [v_proj_errors(model_dir)]

    names = [
        n
        for n, m in AutoModelForCausalLM.from_pretrained(model_dir).named_modules()
        if isinstance(m, nn.Linear) and n != "lm_head"
    ]
    maps = {
        "uniform MXFP4": dict.fromkeys(names, "mxfp4_e2m1"),
        "every fifth unit MXFP8": mixed_format_map(AutoModelForCausalLM.from_pretrained(model_dir)),
    }
    for row in rows:
        print(json.dumps(row), flush=True)
        with args.output.open("a") as out:
            out.write(json.dumps(row) + "\n")
    for seed, (map_name, format_map), merged in itertools.product(args.seeds, maps.items(), (False, True)):
        model = load(model_dir, format_map, merged, seed)
        row = {"map": map_name, "seed": seed, "o_proj transform": "in v_proj" if merged else "online"}
        for text_name, text in texts.items():
            result = evaluate_perplexity(model, tokenizer, text, SEQ_LEN, EVAL_TOKENS, batch_size=4)
            row[f"ppl_{text_name}"] = round(result.perplexity, 4)
        print(json.dumps(row), flush=True)
        with args.output.open("a") as out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
