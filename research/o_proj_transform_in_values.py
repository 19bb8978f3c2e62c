#!/usr/bin/env python
"""Study: can `online_block_hadamard` drop `o_proj`'s online transform by merging it into `v_proj`'s rows?

Adopted: the library now merges it where the model's probe passes (`nn.rotation.whole_transform_carriers`); the
script compares that with the transform kept online as before (`variant`). The committed rows were measured with
the study's own merge, before the adoption.

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

`--forward-times ROUNDS` instead times the bfloat16 forwards of the unrotated dMX model and of both variants (the
inference benchmark's map and shapes, one thread: `forward_costs`); `--calibrated PRESET` instead calibrates the
default recipe at 5 bits with both variants per seed (`calibrated_rows`):

    python research/o_proj_transform_in_values.py --threads 1 --forward-times 5
    python research/o_proj_transform_in_values.py --threads 1 --forward-times 9
    python research/o_proj_transform_in_values.py --threads 2 --calibrated cpu-demo --seeds 0 1

`--probe-families BLOCK` instead checks, on the test suite's tiny models of every family, whether a mix within blocks
of `BLOCK` put on `v_proj`'s output reaches `o_proj`'s input as signs do (`probe_rows`):

    python research/o_proj_transform_in_values.py --threads 2 --probe-families 8
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.test_transformers_families

from bench_inference import SHAPES, mixed_format_map  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from optimum_dmx import DMXConfig  # noqa: E402
from optimum_dmx.evaluation import evaluate_perplexity  # noqa: E402
from optimum_dmx.formats import quantize_mx  # noqa: E402
from optimum_dmx.nn import rotation  # noqa: E402
from optimum_dmx.nn.sign_probe import readers_receiving  # noqa: E402

from common import (  # noqa: E402
    append_json_line,
    benchmark_model,
    benchmark_texts,
    fixed_malloc_thresholds,
    median_seconds,
)

EVAL_TOKENS, SEQ_LEN = 16384, 512


def v_proj_errors(model_dir: Path) -> dict:
    """Relative MXFP4 rounding error of `v_proj`'s weight (`||Q(W) - W|| / ||W||`, float32, rounded to nearest) in
    each decoder layer of the rotated float models, today's and merged, and the spread of its rows' norms (largest
    over smallest): MX blocks run along a row, so a row's blocks are scaled to its own magnitude until rows mix."""
    errors, spreads = {}, {}
    for merged in (False, True):
        weights = [
            m.weight.detach().float() for n, m in load(model_dir, None, merged).named_modules() if n.endswith(".v_proj")
        ]
        errors[merged] = [((quantize_mx(w, "mxfp4_e2m1") - w).norm() / w.norm()).item() for w in weights]
        spreads[merged] = sorted((w.norm(dim=1).max() / w.norm(dim=1).min()).item() for w in weights)
    summary = {}
    for merged, key in ((False, "online"), (True, "in v_proj")):
        mine, other = errors[merged], errors[not merged]
        summary[key] = {
            "mean relative error": round(sum(mine) / len(mine), 5),
            "layers with the larger error": sum(a > b for a, b in zip(mine, other)),
            "row norm spread (median over layers)": round(spreads[merged][len(mine) // 2], 2),
        }
    return {"v_proj MXFP4 weight error": summary, "layers": len(errors[False])}


def variant(merged: bool) -> contextlib.AbstractContextManager:
    """Within it `online_block_hadamard` rotates as the library does since this study (`merged`: `o_proj`'s transform
    in `v_proj`'s rows where the probe lets it, `nn.rotation.whole_transform_carriers`), or as it did before
    (`o_proj`'s transform online)."""
    if merged:
        return contextlib.nullcontext()
    return mock.patch.object(rotation, "whole_transform_carriers", lambda model, carriers, block_size: {})


def load(
    model_dir: Path, format_map: dict | None, merged: bool, seed: int = 0, rotation_name: str = "online_block_hadamard"
) -> nn.Module:
    """The float model rotated by the variant (float32; `format_map` None), or the dMX model of `format_map` with
    `rotation_name` (bfloat16, rounded to nearest)."""
    with variant(merged):
        if format_map is not None:
            config = DMXConfig(format_map=format_map, rotation=rotation_name, seed=seed)
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, quantization_config=config)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        quantized = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
        with torch.no_grad():
            rotation.rotate_model(model, "online_block_hadamard", quantized, seed=seed)
        return model


def forward_costs(model_dir: Path, rounds: int, repeats: int) -> list[dict]:
    """Each variant's bfloat16 forward time over the unrotated dMX model's (the inference benchmark's map, cached
    weights, 1 x 512 and 8 x 128 tokens, glibc's thresholds fixed as the benchmark fixes them): `rounds` rounds, each
    on the three models loaded anew from saved checkpoints (the merged one records no transform for `o_proj`), their
    forwards timed in turn (`repeats` each, median CPU time); the median of the rounds' ratios and their range."""
    fixed_malloc_thresholds()
    format_map = mixed_format_map(AutoModelForCausalLM.from_pretrained(model_dir))
    variants = {"unrotated": ("none", False), "online": ("online_block_hadamard", False), "in v_proj": (None, True)}
    ratios: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, (rotation_name, merged) in variants.items():
            folders[name] = Path(tmp) / name.replace(" ", "_")
            load(model_dir, format_map, merged, rotation_name=rotation_name or "online_block_hadamard").save_pretrained(
                folders[name]
            )
        for _ in range(rounds):
            models = [AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.bfloat16) for name in variants]
            for shape in SHAPES:
                ids = torch.randint(0, models[0].config.vocab_size, shape, generator=torch.Generator().manual_seed(0))
                with torch.inference_mode():
                    base, *others = median_seconds(
                        [lambda m=m, ids=ids: m(ids) for m in models], repeats, time.process_time
                    )
                for name, seconds in zip(list(variants)[1:], others):
                    ratios.setdefault((name, shape), []).append(seconds / base)
            del models
    return [
        {
            "forward": "x".join(map(str, shape)),
            "o_proj transform": name,
            "cost over unrotated": f"{statistics.median(values) - 1:+.1%}",
            "rounds": [round(v - 1, 4) for v in values],
        }
        for (name, shape), values in ratios.items()
    ]


def calibrated_rows(model_dir: Path, tokenizer, texts: dict, seeds: list[int], preset: str) -> Iterator[dict]:
    """The default recipe (`DMXConfig(target_bits=5)`: the learned map, fused groups, `online_block_hadamard`, GPTQ)
    calibrated at `preset`'s sizes on the five Austen calibration novels, float32, per seed with `o_proj`'s transform
    online and merged into `v_proj` (the same rotation's signs, the same calibration sequences), and its held-out
    perplexity, one row at a time."""
    dataset = [path.read_text(encoding="utf-8") for path in benchmark_texts().calibration]
    for seed, merged in itertools.product(seeds, (False, True)):
        config = DMXConfig(target_bits=5, dataset=dataset, tokenizer=tokenizer, preset=preset, seed=seed)
        with variant(merged):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config)
        row = {"recipe": f"default, target_bits=5, preset {preset}", "seed": seed}
        row["o_proj transform"] = "in v_proj" if merged else "online"
        row["weighted bits"] = round(model.config.quantization_config.achieved_bits["bits_weighted"], 4)
        row.update(held_out_perplexities(model, tokenizer, texts))
        yield row


def probe_rows(block: int) -> Iterator[dict]:
    """For each family of `tests/test_transformers_families.py` (tiny random models whose heads are 16 wide) with
    `v_proj` and `o_proj` linears in its attention: whether signs on every `v_proj`'s output reach its `o_proj`'s
    input as they are and whether a random transform of blocks of `block` does, each by the library's own probe
    (`nn.sign_probe.readers_receiving`, as `nn.rotation.sign_carriers` and `whole_transform_carriers` call it)."""
    from tests.test_transformers_families import QUANTIZED, _family_config

    for family in ["llama", "mistral", "qwen3", *QUANTIZED]:
        try:
            config = _family_config(family)
        except pytest.skip.Exception:
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        attentions = [
            name
            for name, module in model.named_modules()
            if isinstance(getattr(module, "v_proj", None), nn.Linear)
            and isinstance(getattr(module, "o_proj", None), nn.Linear)
        ]
        if not attentions:
            continue
        pairs = {f"{attention}.o_proj": f"{attention}.v_proj" for attention in attentions}
        copies = {o_proj: rotation._value_head_sign_copies(model, o_proj) for o_proj in pairs}
        copies = {o_proj: run for o_proj, run in copies.items() if run is not None}
        signs = readers_receiving(model, pairs, copies) == set(pairs)
        mixed = readers_receiving(model, pairs, copies, block) == set(pairs)
        yield {"family": family, "v_proj -> o_proj": {"signs": signs, f"signs and {block}-blocks mixed": mixed}}


def held_out_perplexities(model: nn.Module, tokenizer, texts: dict[str, str]) -> dict[str, float]:
    """`ppl_<text>` of `model` on each held-out text's first `EVAL_TOKENS` tokens in `SEQ_LEN`-token windows."""
    return {
        f"ppl_{name}": round(
            evaluate_perplexity(model, tokenizer, text, SEQ_LEN, EVAL_TOKENS, batch_size=4).perplexity, 4
        )
        for name, text in texts.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="rotation seeds")
    parser.add_argument(
        "--forward-times", type=int, metavar="ROUNDS", help="only time the forwards (forward_costs), in ROUNDS rounds"
    )
    parser.add_argument(
        "--calibrated", metavar="PRESET", help="only the default recipe calibrated at PRESET's sizes (calibrated_rows)"
    )
    parser.add_argument(
        "--probe-families",
        type=int,
        metavar="BLOCK",
        help="only probe the test suite's tiny families: does a mix within BLOCK-blocks pass v_proj -> o_proj?",
    )
    parser.add_argument("--repeats", type=int, default=5, help="forwards timed per model per round")
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("o_proj_transform_in_values.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe_families:
        for row in probe_rows(args.probe_families):
            append_json_line(args.output, row)
        return
    model_dir = benchmark_model()
    if args.forward_times:
        for row in forward_costs(model_dir, args.forward_times, args.repeats):
            append_json_line(args.output, row)
        return
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = {name: path.read_text(encoding="utf-8") for name, path in benchmark_texts().evaluation.items()}
    texts = {name: text[len(text) // 10 :] for name, text in texts.items()}
    if args.calibrated:
        for row in calibrated_rows(model_dir, tokenizer, texts, args.seeds, args.calibrated):
            append_json_line(args.output, row)
        return

    window = tokenizer(texts["pride_prejudice"], return_tensors="pt").input_ids[:, :SEQ_LEN]
    with torch.no_grad():
        logits = [load(model_dir, None, merged).float()(window).logits for merged in (False, True)]
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(window).logits
    print(
        f"float, rotated: max |logit difference| today vs merged {(logits[0] - logits[1]).abs().max():.2e}, "
        f"vs unrotated {(logits[0] - plain).abs().max():.2e}"
    )
    append_json_line(args.output, v_proj_errors(model_dir))

    names = [
        n
        for n, m in AutoModelForCausalLM.from_pretrained(model_dir).named_modules()
        if isinstance(m, nn.Linear) and n != "lm_head"
    ]
    maps = {
        "uniform MXFP4": dict.fromkeys(names, "mxfp4_e2m1"),
        "every fifth unit MXFP8": mixed_format_map(AutoModelForCausalLM.from_pretrained(model_dir)),
    }
    for seed, (map_name, format_map), merged in itertools.product(args.seeds, maps.items(), (False, True)):
        model = load(model_dir, format_map, merged, seed)
        row = {"map": map_name, "seed": seed, "o_proj transform": "in v_proj" if merged else "online"}
        row.update(held_out_perplexities(model, tokenizer, texts))
        append_json_line(args.output, row)


if __name__ == "__main__":
    main()
