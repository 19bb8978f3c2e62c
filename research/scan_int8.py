#!/usr/bin/env python
"""Study: can the KL scan's float layers multiply in int8 on a CPU without bfloat16 instructions?

On a CPU that multiplies bfloat16 natively the scan's products run in bfloat16 (`calibration.sensitivity`,
`matmul_dtype="auto"`); elsewhere they stay float32, and the scan is 20-24% of the CLI's default run's steps against
issue 41's 10% (`scan_arithmetic.py`: the scan is its products). Many such CPUs have AVX-512 VNNI, whose int8 products
(`torch._int_mm`, oneDNN) run several times faster than float32 ones. Would the scan rank the budget's units the same
with its float layers in int8?

Each float layer of the scan's passes (and of its reference pass) multiplies as W8A8: its weight (the online transform
merged in, as the bfloat16 copies do) rounded to int8 with one scale per output channel, its input rounded to int8
with one scale per token (absolute maximum / 127), the int32 product rescaled to float32; a unit's own layers stay
the MX emulation, as in the library's scan. Everything else (the residual stream, normalisations, attention, the
divergences) is unchanged. The model and tokens are the CLI's default run's: the de-gridded SmolLM2-135M rotated
`online_block_hadamard`, fused groups, the first `KL_SAMPLES` of the `cpu-demo` preset's Austen sequences. Printed:
the products of one decoder linear's shape (the scan's 4 copies of 4 x 64 tokens by `up_proj`) in float32 and int8,
then the scan in float32 against the scan with its float layers in int8 (all of them, or all but the named ones):
seconds (one run each, after an untimed float32 scan) and the Spearman correlation of the units' values.

    python research/scan_int8.py --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from sensitivity_signals import spearman  # noqa: E402

from optimum_dmx.calibration import CalibrationSettings, get_preset, sensitivity  # noqa: E402
from optimum_dmx.calibration.groups import offset_groups  # noqa: E402
from optimum_dmx.nn import linear_modules_to_quantize  # noqa: E402
from optimum_dmx.nn.rotation import rotate_model  # noqa: E402

from common import load_model_and_calibration, processor_description  # noqa: E402

PRESET = "cpu-demo"
VARIANTS = {  # label: the linears (by name's end) left in float32
    "every float layer in int8": (),
    "all but `down_proj` in int8": ("down_proj",),
    "all but `down_proj` and `o_proj` in int8": ("down_proj", "o_proj"),
}


def int8_forward(linear: nn.Linear, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear`'s forward as a W8A8 product: `weight` (float, `[out, in]`) rounded to int8 per output channel, the
    input per token; the int32 product rescaled to float32, plus the bias."""
    weight_scale = weight.float().abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    codes = torch.round(weight.float() / weight_scale[:, None]).to(torch.int8).t().contiguous()

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        product = torch._int_mm(torch.round(rows / scale).to(torch.int8), codes).float() * scale * weight_scale
        if linear.bias is not None:
            product = product + linear.bias
        return product.view(*x.shape[:-1], -1)

    return forward


def int8_float_layers(float32: Sequence[str]):
    """A stand-in for `sensitivity._scan_float_layers`: every resident target but those whose names end with one of
    `float32` multiplies as W8A8 (`int8_forward`, its online transform merged into the weight) for the scan."""

    @contextlib.contextmanager
    def scan_float_layers(targets: Mapping[str, nn.Module], dtype, device) -> Iterator[dict]:
        own = {name: sensitivity._LayerState.of(module) for name, module in targets.items()}
        with contextlib.ExitStack() as stack:
            for name, state in own.items():
                if name.endswith(tuple(float32)):
                    continue
                linear, weight = targets[name], state.weight
                if state.transform is not None:
                    weight = state.transform.apply(weight, inverse=True)
                merged = sensitivity._LayerState(weight, None if state.transform is None else nn.Identity())
                stack.enter_context(merged.installed_in(linear))
                linear.forward = int8_forward(linear, weight)
                stack.callback(lambda linear=linear: linear.__dict__.pop("forward"))
            yield own

    return scan_float_layers


def seconds_of(call: Callable[[], object], repeats: int = 5) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    preset = get_preset(PRESET)
    model, _, ids = load_model_and_calibration(None, None, preset.seq_len, preset.num_samples)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    settings = CalibrationSettings(format_pair="mxfp8-mxfp4", **preset.settings(), offset_groups="fused")
    names = list(linear_modules_to_quantize(model, settings.modules_to_not_convert))
    rotate_model(model, "online_block_hadamard", names)
    units = sensitivity.scan_units(names, offset_groups("fused", names))

    rows = sensitivity.KL_UNITS_PER_PASS * sensitivity.KL_SAMPLES * round(preset.seq_len * sensitivity.KL_POSITIONS)
    up_proj = model.get_submodule(next(name for name in names if name.endswith("up_proj")))
    x, weight = torch.randn(rows, up_proj.in_features), up_proj.weight.float()
    x8 = torch.randint(-127, 128, x.shape, dtype=torch.int8)
    w8 = torch.randint(-127, 128, weight.t().shape, dtype=torch.int8)
    f32_ms = seconds_of(lambda: x @ weight.t()) * 1e3
    int8_ms = seconds_of(lambda: torch._int_mm(x8, w8)) * 1e3

    def scan(float_layers) -> tuple[list[float], float]:
        original = sensitivity._scan_float_layers
        sensitivity._scan_float_layers = float_layers
        try:
            start = time.perf_counter()
            values = sensitivity.kl_sensitivities(model, ids, settings, progress=False, matmul_dtype=torch.float32)
            return [sum(values[name] for name in unit) for unit in units], time.perf_counter() - start
        finally:
            sensitivity._scan_float_layers = original

    scan(sensitivity._scan_float_layers)  # every kernel ready
    reference, reference_seconds = scan(sensitivity._scan_float_layers)
    print(f"Machine: {processor_description()}, {a.threads} torch threads, torch {torch.__version__}")
    print()
    print(f"| product ({rows} x {up_proj.in_features} by {up_proj.in_features} x {up_proj.out_features}) | ms |")
    print("|---|---|")
    print(f"| float32 | {f32_ms:.2f} |")
    print(f"| int8 (`torch._int_mm`), codes only | {int8_ms:.2f} ({int8_ms / f32_ms:.2f}x) |")
    print()
    print(f"| scan ({len(units)} units) | seconds | x the float32 scan | Spearman vs the float32 scan |")
    print("|---|---|---|---|")
    print(f"| float32 (the library's on this CPU) | {reference_seconds:.1f} | 1.00x | 1.0000 |")
    for label, float32 in VARIANTS.items():
        values, seconds = scan(int8_float_layers(float32))
        print(f"| {label} | {seconds:.1f} | {seconds / reference_seconds:.2f}x | {spearman(reference, values):.4f} |")


if __name__ == "__main__":
    main()
