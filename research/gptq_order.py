#!/usr/bin/env python
"""Study: GPTQ's column order. Is the rest of llm-compressor QuIP's lead over dMX's `online_block_hadamard` (served
uniform MXFP4, `benchmarks/results/served_peers.md`) the two GPTQs' column order and scales, and what does
activation order do to dMX's own maps?

`served_quip_gap.py` ruled out QuIP's output rotation; the next suspect was the weights' side. llm-compressor 0.14's
`GPTQModifier` (its default `actorder="static"`, an alias of `"weight"`) rounds a layer's columns in descending
order of the Hessian's diagonal (activation order) and takes every block's scale from the float weights before any
rounding (static scales). dMX's GPTQ rounded the columns in their own order and fixed a block's scale when its first
column was reached, from the block's weights as the earlier columns' errors left them. Both damp the Hessian by 1%
of its mean diagonal and update lazily over 128 columns. Orders (`ORDERS`):

* `columns`: dMX's GPTQ before (`round_weights_by_gptq(..., activation_order=False)`);
* `act-static`: activation order, static scales: llm-compressor's rule, and the library's GPTQ since this study;
* `act-first`: activation order, a block's scale fixed when the first of its columns is reached, from its weights as
  the earlier columns' errors left them (dMX's scale rule in the new order; `round_columns_first_touch`).

Served (`--variants ORDER:TRANSFORMS`): the benchmark's `dmx:online_block_hadamard` row (`bench_served_peers.run`:
its calibration sequences, export and served evaluation) with dMX's signed transforms (`signed`) or plain block
Hadamard transforms as QuIP's (`unsigned`, `served_quip_gap.transforms_as`), or its unrotated `dmx:none` row
(`none`); rows to `gptq_order.jsonl`.

Quality (`--quality ORDERS`): the quality table's GPTQ cells of the default method in a configuration
(`--configuration`: `default`, the library's online rotation with fused groups, or `unrotated`), their maps
(`benchmarks/results/quality_runs.jsonl`) rounded again in each order and evaluated as the table evaluates them;
rows to `gptq_order_quality.jsonl`, with the table's own perplexities (its GPTQ: `columns`).

A finished row is skipped when asked again; `--report-only` prints both tables.

    python research/gptq_order.py --threads 2 --variants act-static:unsigned,act-first:unsigned,act-first:signed
    python research/gptq_order.py --threads 2 --variants act-static:signed,act-static:none
    python research/gptq_order.py --threads 2 --seed 1 --variants act-static:signed
    python research/gptq_order.py --threads 1 --quality act-static
    python research/gptq_order.py --threads 1 --quality act-static --seed 1
    python research/gptq_order.py --threads 1 --quality act-static --configuration unrotated --targets 5
    python research/gptq_order.py --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_served_peers  # noqa: E402
from bench_quality import RUNS as QUALITY_RUNS  # noqa: E402
from bench_quality import Runner, Sweep  # noqa: E402
from served_quip_gap import RUNS as SIGN_RUNS  # noqa: E402
from served_quip_gap import transforms_as  # noqa: E402

from optimum_dmx.calibration import gptq  # noqa: E402
from optimum_dmx.formats.blocks import block_scale, pow2  # noqa: E402
from optimum_dmx.formats.cast import block_exponents  # noqa: E402
from optimum_dmx.formats.packing import ElementGrid  # noqa: E402
from optimum_dmx.formats.spec import SCALE_EXPONENT_MAX  # noqa: E402
from optimum_dmx.nn import rotation  # noqa: E402

from common import read_json_lines  # noqa: E402

RUNS = Path(__file__).with_name("gptq_order.jsonl")
QUALITY = Path(__file__).with_name("gptq_order_quality.jsonl")
CONFIGURATIONS = {  # the quality table's GPTQ-rounded rows of the default method: (rotation, offset groups)
    "default": ("online_block_hadamard", "fused"),  # the library's default configuration
    "unrotated": ("none", "none"),  # the default before it
}
ORDERS = ("columns", "act-static", "act-first")  # `act-static`: the library's GPTQ


def round_columns_first_touch(rows, hessian, fmt, block_size, scale_rule):
    """`gptq._round_columns` in activation order (`hessian.order`) with each block's scale fixed when the first of
    its columns is reached, from its weights as the earlier columns' errors left them (the `act-first` variant)."""
    order = hessian.order
    inverse_factor = hessian.factor  # of the permuted Hessian
    columns = rows.T.contiguous()
    columns[hessian.dead] = 0.0
    width, out_features = columns.shape
    blocks = width // block_size
    exponents = torch.empty(blocks, out_features, dtype=torch.int32, device=rows.device)
    scales = torch.empty(blocks, out_features, dtype=torch.float32, device=rows.device)
    inverse_scales = torch.empty_like(scales)
    columns = columns[order]  # position i holds column order[i]
    position = torch.argsort(order)  # column j is at position[j]
    block_of = (order // block_size).tolist()
    fixed = [False] * blocks
    elements = torch.empty_like(columns)
    grid = ElementGrid.of(fmt, rows.device)
    step = max(block_size, gptq.COLUMNS_PER_UPDATE // block_size * block_size)
    for start in range(0, width, step):
        end = min(start + step, width)
        chunk = columns[start:end]
        errors = torch.zeros_like(chunk)
        u = inverse_factor[start:end, start:end]
        for i in range(end - start):
            block = block_of[start + i]
            if not fixed[block]:  # its columns as the errors so far left them (those past the chunk: updated here)
                at = position[block * block_size : (block + 1) * block_size]
                values = columns[at].clone()
                later = at >= end
                if later.any() and i:
                    values[later] -= inverse_factor[start : start + i, at[later]].T @ errors[:i]
                k = block_exponents(values.T.unsqueeze(1), fmt, scale_rule).view(-1)
                exponents[block], scales[block] = k, block_scale(k)
                inverse_scales[block] = pow2(-k.clamp(max=SCALE_EXPONENT_MAX - 1))
                fixed[block] = True
            column = chunk[i]
            element = grid.round(column * inverse_scales[block])
            elements[start + i] = element
            error = (column - element * scales[block]) / u[i, i]
            errors[i] = error
            chunk[i:].sub_(u[i, i:, None] * error)
        columns[end:].sub_(inverse_factor[start:end, end:].T @ errors)
    unpermuted = torch.empty_like(elements)
    unpermuted[order] = elements
    return unpermuted.T.contiguous(), exponents.T.contiguous()


@contextmanager
def gptq_in_order(order: str):
    """dMX's GPTQ with its columns in `order` within the block (`ORDERS`)."""
    own_of, own_round = gptq.InverseHessian.of, gptq._round_columns

    def columns_in_their_order(hessian, block_size=32, damping=gptq.GPTQ_DAMPING, activation_order=True):
        return own_of(hessian, block_size, damping, activation_order=False)

    if order == "columns":
        gptq.InverseHessian.of = staticmethod(columns_in_their_order)
    elif order == "act-first":
        gptq._round_columns = round_columns_first_touch
    try:
        yield
    finally:
        gptq.InverseHessian.of, gptq._round_columns = own_of, own_round


def quality(orders: list[str], configuration: str, seeds: list[int], targets: list[str], threads: int) -> None:
    """The quality table's GPTQ cells of the default method in `configuration` (`CONFIGURATIONS`), those of `seeds`
    and `targets` (empty: all) of both pairs, their maps rounded by GPTQ in each of `orders` and evaluated as the
    table evaluates them; rows appended to `QUALITY`."""
    rotation, groups = CONFIGURATIONS[configuration]
    wanted = dict(method="dmx", rotation=rotation, offset_groups=groups, bit_average="weighted", weight_rounding="gptq")
    cells = [
        r
        for r in read_json_lines(QUALITY_RUNS)
        if all(r.get(k) == v for k, v in wanted.items())
        and not r.get("learn_rotations")
        and not r.get("sensitivity_rounding")
        and "gptq_order" not in r  # the table's GPTQ rows in column order
        and r["seed"] in seeds
        and (not targets or r["target"] in targets)
    ]
    done = {_quality_key(r) for r in read_json_lines(QUALITY)} if QUALITY.exists() else set()
    runner = Runner(Sweep(rotation=rotation, offset_groups=groups, weight_rounding="gptq"))
    for order in orders:
        for cell in cells:
            if _quality_key({**cell, "order": order}) in done:
                continue
            with gptq_in_order(order):
                row = runner.run("dmx", cell["pair"], cell["target"], cell["seed"], known=cell)
            keys = ("rotation", "offset_groups", "pair", "target", "seed", "gptq_seconds")
            result = {k: row[k] for k in keys} | {"order": order}
            for text in ("moby_dick", "pride_prejudice"):
                result.update({f"ppl_{text}": row[f"ppl_{text}"], f"table_{text}": cell[f"ppl_{text}"]})
            with QUALITY.open("a") as runs:
                runs.write(json.dumps({**result, "torch_threads": threads}) + "\n")
            print(json.dumps(result), flush=True)


def _quality_key(row: dict) -> tuple:
    return tuple(str(row[k]) for k in ("order", "rotation", "pair", "target", "seed"))


def report() -> str:
    """The served variants against the same rows in column order (the benchmark's and `served_quip_gap`'s) and
    llm-compressor's, then the quality cells against the table."""
    peers = [
        r for r in read_json_lines(bench_served_peers.RESULTS / "served_peers_runs.jsonl") if r["preset"] == "cpu-bench"
    ]
    signs = read_json_lines(SIGN_RUNS) if SIGN_RUNS.exists() else []

    def served(row: str, seed: int, transforms: str) -> dict | None:
        """The benchmark's row in column order (`unsigned`: served_quip_gap's variant)."""
        if transforms == "unsigned":
            return next((r for r in signs if r["variant"] == "unsigned" and r["seed"] == seed), None)
        return next((r for r in peers if r["row"] == row and r["seed"] == seed and "gptq_order" not in r), None)

    texts = ("moby_dick", "pride_prejudice")
    lines = [
        "| seed | transforms | order | " + " | ".join(f"{t} | / columns | / llm-compressor" for t in texts) + " |",
        "|---|---|---|" + "---|---|---|" * len(texts),
    ]
    for r in read_json_lines(RUNS) if RUNS.exists() else []:
        order, transforms = r["variant"].split(":")
        columns = served(r["row"], r["seed"], transforms)
        peer_row = "llmcompressor:none" if transforms == "none" else "llmcompressor:quip-v"
        peer = next((p for p in peers if p["row"] == peer_row and p["seed"] == r["seed"]), None)
        cells = [str(r["seed"]), transforms, order]
        for t in texts:
            cells.append(f"{r[f'ppl_{t}']:.2f}")
            cells += [f"{r[f'ppl_{t}'] / ref[f'ppl_{t}']:.4f}" if ref else "-" for ref in (columns, peer)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| rotation | pair | target | seed | order | " + " | ".join(f"{t} | / table" for t in texts) + " |"]
    lines.append("|---|---|---|---|---|" + "---|---|" * len(texts))
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in read_json_lines(QUALITY) if QUALITY.exists() else []:
        cells = [r["rotation"], r["pair"], r["target"], str(r["seed"]), r["order"]]
        for t in texts:
            ratio = r[f"ppl_{t}"] / r[f"table_{t}"]
            ratios.setdefault((r["rotation"], r["order"]), []).append(ratio)
            cells += [f"{r[f'ppl_{t}']:.2f}", f"{ratio:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for (rotation_name, order), values in ratios.items():
        mean = math.exp(sum(map(math.log, values)) / len(values))
        lower = sum(v < 1 for v in values)
        lines.append(
            f"- {rotation_name}, {order}: geometric mean {mean:.4f} of the table's, lower in {lower} of {len(values)}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="", help="ORDER:TRANSFORMS, comma-separated: served rows")
    p.add_argument("--quality", default="", help="ORDERS, comma-separated: the quality cells")
    p.add_argument("--configuration", default="default", choices=sorted(CONFIGURATIONS), help="of the quality cells")
    p.add_argument("--targets", default="", help="comma list: the quality cells' targets (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not a.report_only:
        if a.quality:
            targets = [t for t in a.targets.split(",") if t]
            quality(a.quality.split(","), a.configuration, [a.seed], targets, a.threads)
        served_variants(a.variants, a.seed, a.threads)
    print(report())


def served_variants(variants: str, seed: int, threads: int) -> None:
    """The served rows of `variants` (`ORDER:TRANSFORMS`, comma-separated) at `seed`, appended to `RUNS`."""
    done = {(r["variant"], r["seed"]) for r in read_json_lines(RUNS)} if RUNS.exists() else set()
    own_transforms = rotation.RandomizedHadamard
    for variant in filter(None, variants.split(",")):
        order, transforms = variant.split(":")
        if order not in ORDERS or transforms not in ("signed", "unsigned", "none"):
            raise SystemExit(f"unknown variant {variant!r}: ORDER in {ORDERS}, TRANSFORMS signed, unsigned or none")
        if (variant, seed) in done:
            continue
        rotation.RandomizedHadamard = transforms_as("unsigned") if transforms == "unsigned" else own_transforms
        row = "dmx:none" if transforms == "none" else "dmx:online_block_hadamard"
        try:
            with gptq_in_order(order):
                result = bench_served_peers.run(row, "cpu-bench", seed, Sweep())
        finally:
            rotation.RandomizedHadamard = own_transforms
        result.pop("gptq_order")  # the variant names it
        with RUNS.open("a") as runs:
            runs.write(json.dumps({"variant": variant, **result, "torch_threads": threads}) + "\n")


if __name__ == "__main__":
    main()
