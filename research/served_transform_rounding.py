#!/usr/bin/env python
"""Study: why does the servable MXFP8 6-bit model score differently through compressed-tensors than as this
package's checkpoint (`benchmarks/results/served.md`: Moby Dick 50.24 against 50.27 at seed 0, 50.16 against 50.15
at seed 1), when the 4.5- and 5-bit cells and the tiny models' logits are bit-equal?

The cell's servable checkpoint (`online_block_hadamard`, fused groups, GPTQ, compressed-tensors' scale rule: as
`bench_served.py` makes it) is built and exported, and this package's bfloat16 model is run over the quality
table's held-out windows. At every linear with an online input transform, its input goes through this package's
32-block Hadamard transform (products and sums in a fixed order, then one division, rounded to bfloat16) and through
compressed-tensors' own `HadamardTransform` module from the exported model (one float32 matrix product with the +-1
matrix, then the division), the input's signs applied first as the export moves them into the preceding weights
(a sign flip: exact). Counted: transformed values that differ, and which of the two is nearer the exact value (the
same transform in float64). A linear sharing its input transform (q/k/v, gate/up) is counted once per linear.

    python research/served_transform_rounding.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_quality import RUNS, SKIPPED, Sweep  # noqa: E402
from bench_served import load_served, quality_runs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from optimum_dmx import DMXConfig  # noqa: E402
from optimum_dmx.export import export_checkpoint  # noqa: E402
from optimum_dmx.text import start_tokens, text_tokens, token_windows  # noqa: E402

from common import benchmark_model, benchmark_texts  # noqa: E402


def build(folder: Path, pair: str, target: str, seed: int) -> None:
    """The cell's servable dMX checkpoint (`folder / "dmx"`) and its compressed-tensors export (`folder / "served"`)."""
    cell = {
        "rotation": "online_block_hadamard",
        "offset_groups": "fused",
        "bit_average": "weighted",
        "pair": pair,
        "target": target,
        "seed": str(seed),
    }
    sweep = Sweep(methods=["dmx"], pairs=[pair], targets=[float(target)], seeds=[seed])
    source = quality_runs(RUNS, cell, sweep.key("dmx", "", "", 0)["model"])["rtn"]
    tokenizer = AutoTokenizer.from_pretrained(benchmark_model())
    config = DMXConfig(
        format_map=source["format_map"],
        rotation="online_block_hadamard",
        scale_rule="compressed-tensors",
        weight_rounding="gptq",
        dataset=[path.read_text(encoding="utf-8") for path in benchmark_texts().calibration],
        tokenizer=tokenizer,
        preset=source["preset"],
        seed=seed,
        modules_to_not_convert=list(SKIPPED),
    )
    model = AutoModelForCausalLM.from_pretrained(benchmark_model(), dtype=torch.float32, quantization_config=config)
    model.save_pretrained(folder / "dmx")
    export_checkpoint(folder / "dmx", folder / "served", "compressed-tensors")


class Counter:
    """Compares the two transforms on every transformed input of this package's model."""

    def __init__(self, loader_transform: torch.nn.Module):
        self.loader_transform = loader_transform
        self.values = self.differ = self.ours_nearer = self.loader_nearer = 0
        self.layers: set[str] = set()

    def __call__(self, name: str, module: torch.nn.Module, x: torch.Tensor) -> None:
        transform = module.input_transform
        ours = transform(x)
        signed = (x.float() * transform.signs().float()).to(x.dtype)
        theirs = self.loader_transform(signed)
        differ = ours != theirs
        self.values += x.numel()
        count = int(differ.sum())
        if count:
            exact = (x.double().reshape(-1, transform.size) @ transform.matrix()).view(x.shape)[differ]
            ours_error = (ours[differ].double() - exact).abs()
            their_error = (theirs[differ].double() - exact).abs()
            self.differ += count
            self.ours_nearer += int((ours_error < their_error).sum())
            self.loader_nearer += int((their_error < ours_error).sum())
            self.layers.add(name)


def count(folder: Path, text_name: str, eval_tokens: int, seq_len: int) -> Counter:
    tokenizer = AutoTokenizer.from_pretrained(benchmark_model())
    model = AutoModelForCausalLM.from_pretrained(folder / "dmx", dtype=torch.bfloat16).eval()
    served = load_served(folder / "served", "compressed-tensors")
    loader_transforms = [m for m in served.modules() if type(m).__name__ == "HadamardTransform"]
    sizes = {m.weight.shape[0] for m in loader_transforms}
    if sizes != {32}:
        raise SystemExit(f"expected the 32-block transforms of online_block_hadamard, found sizes {sorted(sizes)}")
    counter = Counter(loader_transforms[0])
    for name, module in model.named_modules():
        if getattr(module, "input_transform", None) is not None:
            module.register_forward_pre_hook(lambda mod, args, name=name: counter(name, mod, args[0]))
    text = benchmark_texts().evaluation[text_name].read_text(encoding="utf-8")
    text = text[int(len(text) * Sweep(methods=["dmx"]).eval_offset) :]
    windows = token_windows(text_tokens(tokenizer, text)[:eval_tokens], seq_len, start_tokens(tokenizer))
    with torch.no_grad():
        for batch in windows.split(4):
            model(input_ids=batch, use_cache=False)
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="mxfp8-mxfp4")
    parser.add_argument("--target", default="6")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sweep = Sweep(methods=["dmx"])
    lines = [
        f"Cell: {args.pair} {args.target} bits, seed {args.seed}, online_block_hadamard, fused, GPTQ, "
        f"compressed-tensors' scale rule; the first {sweep.eval_tokens} tokens from {sweep.eval_offset:.0%} into "
        f"each text, {sweep.eval_seq_len}-token windows, bfloat16.",
        "",
        "| text | transformed values | differ | one in | nearer the exact value: ours / loader's | layers with one |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="dmx-transform-rounding-") as folder:
        build(Path(folder), args.pair, args.target, args.seed)
        for text_name in benchmark_texts().evaluation:
            c = count(Path(folder), text_name, sweep.eval_tokens, sweep.eval_seq_len)
            one_in = f"{c.values / c.differ:,.0f}" if c.differ else "-"
            lines.append(
                f"| {text_name} | {c.values:,} | {c.differ} | {one_in} | {c.ours_nearer} / {c.loader_nearer} | "
                f"{len(c.layers)} |"
            )
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
