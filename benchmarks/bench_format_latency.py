#!/usr/bin/env python
"""Latency of each quantized linear shape of a model in each MX format: a `cost_table` for a latency budget.

    python benchmarks/bench_format_latency.py --shape llama-3.1-8b --device cuda --dtype bfloat16 --tokens 2048 \
        --output benchmarks/results/format_latency.md --cost-table cost_table.json

For every distinct weight shape of the model's decoder layer (built from transformers' own Llama layer on the meta
device: no weights), times on ``--tokens`` rows the forward of `nn.Linear` (the reference, same dtype and device)
and of `MXLinear` in each MX format two ways: with its dequantized weight cached (this package's default when a
checkpoint is loaded: a float matmul plus the activation cast) and packed-only (`cache_weight=False`: the weight
dequantized on every call, the format's own cost in this package's emulation). These are this package's kernels,
not a serving engine's: vLLM's MX kernels cost differently, and a cost table measured there replaces this one.

``--cost-table FILE`` writes the packed-only times in milliseconds as ``{format: {"OUTxIN": ms}}``, the table that
``DMXConfig(cost_table=...)`` and ``optimum-dmx quantize --cost-table FILE`` take to cap the model's latency instead
of its bits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

from optimum_dmx import MXLinear
from optimum_dmx.calibration.budget import shape_key
from optimum_dmx.formats import MX_FORMATS

from common import MODEL_DTYPES, MODEL_SHAPES, device_description, kernel_benchmark_parser, median_seconds, write_report


def decoder_linear_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """The weight shape ``(out, in)`` of each linear of one decoder layer of a ``MODEL_SHAPES`` Llama, by name,
    read off transformers' own layer built on the meta device."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        layer = LlamaDecoderLayer(LlamaConfig(**MODEL_SHAPES[shape]), layer_idx=0)
    return {name: tuple(m.weight.shape) for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def measure(
    shapes: dict[str, tuple[int, int]], tokens: int, dtype: torch.dtype, device: str, repeats: int, calls: int
) -> tuple[list[list[str]], dict[str, dict[str, float]]]:
    """The table's rows and the packed-only cost table, each distinct shape timed once."""
    names_by_key: dict[str, list[str]] = {}
    for name, weight_shape in shapes.items():
        names_by_key.setdefault(shape_key(weight_shape), []).append(name)
    rows, cost_table = [], {fmt: {} for fmt in MX_FORMATS}
    clock = time.perf_counter if torch.device(device).type == "cuda" else time.process_time
    for key, names in names_by_key.items():
        out_features, in_features = shapes[names[0]]
        torch.manual_seed(0)
        linear = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
        x = torch.randn(1, tokens, in_features, device=device, dtype=dtype)
        modules = []
        for fmt in MX_FORMATS:
            cached = MXLinear.from_linear(linear, fmt)
            packed = MXLinear.from_linear(linear, fmt)
            packed.cache_weight = False
            modules += [cached, packed]
        with torch.inference_mode():
            seconds = median_seconds(
                [lambda m=m: m(x) for m in [linear, *modules]], repeats, clock, device=device, calls=calls
            )
        reference, timed = seconds[0], iter(seconds[1:])
        cells = []
        for fmt in MX_FORMATS:
            cached, packed = next(timed), next(timed)
            cost_table[fmt][key] = round(packed * 1e3, 6)
            cells += [
                f"{cached * 1e3:.3f} ({cached / reference:.2f}x)",
                f"{packed * 1e3:.3f} ({packed / reference:.2f}x)",
            ]
        rows.append([key, ", ".join(names), f"{reference * 1e3:.3f}", *cells])
    return rows, cost_table


def main() -> None:
    p = kernel_benchmark_parser(__doc__)
    p.add_argument("--shape", choices=MODEL_SHAPES, default="llama-3.1-8b", help="the model whose shapes are timed")
    p.add_argument("--tokens", type=int, default=2048, help="rows of each forward (a prefill's tokens)")
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="bfloat16")
    p.add_argument("--calls", type=int, default=10, help="calls in a row per timed sample")
    p.add_argument("--cost-table", type=Path, default=None, help="write the packed-only times here as JSON")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = MODEL_DTYPES[args.dtype]
    rows, cost_table = measure(
        decoder_linear_shapes(args.shape), args.tokens, dtype, args.device, args.repeats, args.calls
    )
    header = ["OUTxIN", "linears", "nn.Linear ms"]
    for fmt in MX_FORMATS:
        header += [f"{fmt} cached ms", f"{fmt} packed ms"]
    lines = [
        f"Linear shapes of `{args.shape}`, 1 x {args.tokens} tokens, {args.dtype}, {device_description(args.device)}, "
        f"torch {torch.__version__}; median of {args.repeats} samples of {args.calls} calls in a row; in brackets "
        "the ratio to `nn.Linear` in the same run.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    write_report("\n".join(lines) + "\n", args.output, "MX format latency per linear shape")
    if args.cost_table:
        args.cost_table.write_text(json.dumps(cost_table, indent=1) + "\n")


if __name__ == "__main__":
    main()
