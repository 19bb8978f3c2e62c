#!/usr/bin/env python
"""Study: why is llm-compressor's QuIP 1.5-1.8% lower than dMX's `online_block_hadamard` served at uniform MXFP4
(`benchmarks/results/served_peers.md`)? QuIP's "u" rotation (each weight's output rows, undone online), or the
random signs dMX's 32-block transforms carry where QuIP's `"hadamard"` ones carry none?

The "u" rotation is settled by the benchmark's own `llmcompressor:quip-v` row (QuIP's input rotation alone). This
script measures the signs: it makes the benchmark's `dmx:online_block_hadamard` row (the same calibration sequences,
GPTQ, export and served evaluation) with every transform unsigned (`RandomizedHadamard(..., signed=False)`: plain
block Hadamard transforms, as QuIP's), and with the signs drawn from other seeds (the transform seeds offset by
`--sign-seeds`; the calibration sequences stay those of seed 0), to show how far a draw alone moves the result.
Each finished variant is appended to `served_quip_gap.jsonl` and skipped when asked again.

    python research/served_quip_gap.py --threads 2 --variants unsigned,1000,2000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_served_peers  # noqa: E402
from bench_quality import Sweep  # noqa: E402

from optimum_dmx.nn import rotation, transforms  # noqa: E402

RUNS = Path(__file__).with_name("served_quip_gap.jsonl")


def transforms_as(variant: str) -> type[transforms.RandomizedHadamard]:
    """`RandomizedHadamard` as the rotation builds it for `variant`: `"unsigned"` (no signs), or the integer added to
    every transform's seed (other signs)."""

    class Variant(transforms.RandomizedHadamard):
        def __init__(self, size, block_size=None, seed=0, sign_copies=None, signed=True):
            if variant == "unsigned":
                signed = False
            else:
                seed += int(variant)
            super().__init__(size, block_size, seed, sign_copies, signed)

    return Variant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="unsigned,1000,2000", help="'unsigned', or seed offsets of the signs")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    done = {json.loads(line)["variant"] for line in RUNS.read_text().splitlines()} if RUNS.exists() else set()
    for variant in a.variants.split(","):
        if variant in done:
            continue
        rotation.RandomizedHadamard = transforms_as(variant)  # what `rotate_model` builds its transforms with
        result = bench_served_peers.run("dmx:online_block_hadamard", "cpu-bench", 0, Sweep())
        with RUNS.open("a") as runs:
            runs.write(json.dumps({"variant": variant, **result, "torch_threads": a.threads}) + "\n")
    for line in RUNS.read_text().splitlines():
        row = json.loads(line)
        moby_dick, pride_prejudice = row["ppl_moby_dick"], row["ppl_pride_prejudice"]
        print(f"{row['variant']:>9}  moby_dick {moby_dick:.4f}  pride_prejudice {pride_prejudice:.4f}")


if __name__ == "__main__":
    main()
