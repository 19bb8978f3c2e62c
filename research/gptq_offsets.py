#!/usr/bin/env python
"""Study: should the default method learn its offsets from GPTQ-rounded weights when the map is served by GPTQ?

The default recipe learns each layer's offset from the derivative of the task loss at its low format, in sampled
maps whose layers run at their low or high format rounded to nearest; the map is then rounded by GPTQ. The model
it ships computes with GPTQ's weights, whose errors are smaller and shaped differently, so a layer's gain measured
around round-to-nearest weights may be the wrong one. GPTQ's codes lie on no continuous path in the offset, so the
derivative cannot be taken along GPTQ itself; this study borrows it: every step runs the sampled map with each
layer's weight rounded by GPTQ at its endpoint (all layers in the low format, sequential GPTQ on the calibration
sequences; the same in the high format), and the derivative of the loss with respect to the offset is read along
round-to-nearest's path at that weight (the library's `dW_q/dbeta`, recomputed from the float weight). The
activations are quantized as before. The KL scan, the blend and the budget rule are unchanged.

Two maps per cell, one process and thread count, evaluated the same way (the final map rounded by GPTQ on the
preset's GPTQ sequences, the quality table's held-out windows):

* `default`: the library's calibration as it is (servable recipe: `online_block_hadamard`, fused groups, weighted
  budget);
* `gptq-offsets`: the same calibration with every endpoint weight replaced by its GPTQ rounding.

    python research/gptq_offsets.py --cells mxfp8-mxfp4:4.5,mxfp8-mxfp4:5,mxfp8-mxfp4:6 --seeds 0 --threads 1
    python research/gptq_offsets.py --report-only

Rows are appended to `research/gptq_offsets.jsonl` as they finish; a finished row is skipped on rerun.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_quality import Runner, Sweep  # noqa: E402
from fused_groups import cell_settings, evaluate_map  # noqa: E402

from optimum_dmx.calibration import calibrate  # noqa: E402
from optimum_dmx.calibration.dmx_linear import DMXLinear  # noqa: E402
from optimum_dmx.continuous import MAX_OFFSET, get_format_pair  # noqa: E402
from optimum_dmx.formats import quantize_mx  # noqa: E402

from common import append_json_line, read_json_lines  # noqa: E402

RESULTS = Path(__file__).with_suffix(".jsonl")
ROTATION = "online_block_hadamard"
VARIANTS = ["default", "gptq-offsets"]


@contextlib.contextmanager
def endpoint_weights(values: dict[int, dict[float, torch.Tensor]]) -> Iterator[None]:
    """While open, a `DMXLinear` whose weight is a key of `values` (by `id`) computes at an endpoint offset with
    the given weight values instead of its round-to-nearest quantization; `dL/dbeta` is still recomputed from the
    float weight along round-to-nearest's path (`FrozenWeightQuantization.beta_gradient`)."""
    original = DMXLinear.frozen_weight

    def frozen_weight(self: DMXLinear, offset: float | None):
        frozen = original(self, offset)
        replacement = values.get(id(self.weight), {}).get(offset)
        if frozen is None or replacement is None or frozen.values is replacement:
            return frozen
        frozen = dataclasses.replace(frozen, values=replacement)
        self._frozen_weights[offset] = frozen
        return frozen

    DMXLinear.frozen_weight = frozen_weight
    try:
        yield
    finally:
        DMXLinear.frozen_weight = original


def gptq_endpoints(runner: Runner, pair: str, seed: int) -> tuple[dict[int, dict[float, torch.Tensor]], dict]:
    """Every layer's weight rounded by GPTQ in the pair's low and in its high format (each with all layers in
    that format), keyed as `endpoint_weights` reads them, and what it cost and changed."""
    formats = get_format_pair(pair)
    values: dict[int, dict[float, torch.Tensor]] = {id(linear.weight): {} for linear in runner.targets.values()}
    info = {}
    for offset, fmt in ((0.0, formats.low.name), (float(MAX_OFFSET), formats.high.name)):
        start = time.perf_counter()
        weights = runner.gptq_weights(runner.model, fmt, seed)
        info[f"gptq_{fmt}_seconds"] = round(time.perf_counter() - start, 1)
        ratios = []
        for name, weight in weights.items():
            linear = runner.targets[name]
            nearest = quantize_mx(linear.weight.detach(), fmt)
            ratios.append((weight - linear.weight).norm().item() / max((nearest - linear.weight).norm().item(), 1e-30))
            compact = weight.to(torch.bfloat16)
            values[id(linear.weight)][offset] = compact if torch.equal(compact.float(), weight) else weight
        # Weight error of GPTQ over round-to-nearest's, per layer (GPTQ lowers the output error, not this one):
        info[f"weight_error_ratio_{fmt}"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 4)
    return values, info


def run_cell(runner: Runner, pair: str, target: str, seed: int, done: set[tuple], endpoints: dict) -> None:
    settings = cell_settings(runner, pair, target, seed, "fused")
    sequences = runner.calibration_ids(seed)
    if (pair, target, seed, "gptq-offsets") not in done and (pair, seed) not in endpoints:
        endpoints[(pair, seed)] = gptq_endpoints(runner, pair, seed)
        print(f"== GPTQ endpoints of {pair} s{seed}: {endpoints[(pair, seed)][1]}", flush=True)
    for variant in VARIANTS:
        if (pair, target, seed, variant) in done:
            continue
        context = endpoint_weights(endpoints[(pair, seed)][0]) if variant != "default" else contextlib.nullcontext()
        with context:
            result = calibrate(runner.model, sequences, settings)
        row = {"pair": pair, "target": target, "seed": seed, "variant": variant}
        row.update(evaluate_map(runner, result.format_map, sequences, "gptq"))
        row["calibration_seconds"] = round(result.seconds, 1)
        row["torch_threads"] = torch.get_num_threads()
        if variant != "default":
            row.update(endpoints[(pair, seed)][1])
        row["offsets"] = {name: round(value, 6) for name, value in result.beta_hat.items()}
        row["format_map"] = result.format_map
        append_json_line(RESULTS, row)
        ppl = f"{row['ppl_moby_dick']} / {row['ppl_pride_prejudice']}"
        print(f"== {pair} {target} s{seed} {variant}: {ppl}", flush=True)


def report(rows: list[dict]) -> str:
    lines = [
        "Held-out perplexity (GPTQ-rounded maps), Moby Dick / Pride and Prejudice:",
        "",
        "| pair, bits, seed | threads | default | gptq-offsets | layers differing | weighted bits |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    cells = sorted({(r["pair"], float(r["target"]), r["seed"]) for r in rows})
    for pair, target, seed in cells:
        found = {r["variant"]: r for r in rows if (r["pair"], float(r["target"]), r["seed"]) == (pair, target, seed)}
        base, new = found.get("default"), found.get("gptq-offsets")
        if base is None or new is None:
            continue
        shown = []
        for text in ("moby_dick", "pride_prejudice"):
            ratio = new[f"ppl_{text}"] / base[f"ppl_{text}"]
            ratios.append(ratio)
            shown.append(f"{new[f'ppl_{text}']:.2f} ({ratio - 1:+.1%})")
        base_ppl = " / ".join(f"{base[f'ppl_{t}']:.2f}" for t in ("moby_dick", "pride_prejudice"))
        differing = sum(base["format_map"][n] != new["format_map"][n] for n in base["format_map"])
        lines.append(
            f"| {pair} {target:g} s{seed} | {base['torch_threads']} | {base_ppl} | {' / '.join(shown)} | "
            f"{differing} | {base['bits_weighted']:.4f} / {new['bits_weighted']:.4f} |"
        )
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lower = sum(r < 1 for r in ratios)
        summary = f"geometric mean {geo:.4f} over {len(ratios)} comparisons, lower in {lower}"
        lines += ["", f"gptq-offsets over default: {summary}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="mxfp8-mxfp4:5", help="comma list of PAIR:TARGET")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.report_only:
        done = {(r["pair"], r["target"], r["seed"], r["variant"]) for r in read_json_lines(RESULTS)}
        sweep = Sweep(methods=["dmx"], rotation=ROTATION, offset_groups="fused", bit_average="weighted")
        runner = Runner(dataclasses.replace(sweep, weight_rounding="gptq"))
        endpoints: dict = {}
        for seed in map(int, args.seeds.split(",")):
            for cell in args.cells.split(","):
                pair, target = cell.split(":")
                run_cell(runner, pair, target, seed, done, endpoints)
    print(report(read_json_lines(RESULTS)))


if __name__ == "__main__":
    main()
