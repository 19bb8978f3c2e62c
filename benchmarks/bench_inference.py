#!/usr/bin/env python
"""Inference cost of dMX checkpoints: MXLinear vs nn.Linear, load time and checkpoint size.

Regenerate `results/inference.md` (about 30 minutes on one CPU core):

    python benchmarks/bench_inference.py --repeats 7 --model-bf16 \
        --rotation hadamard,block_hadamard,online_block_hadamard --output benchmarks/results/inference.md

Measures, in one run:

1. one SmolLM2-135M-sized decoder linear (mlp.up_proj, 576 -> 1536) at batch x seq 1 x 512 and 8 x 128:
   `nn.Linear` vs `MXLinear` with its cached dequantized weight vs `MXLinear` packed-only (dequantized
   on every call), in each of the four MX formats; the time per call on one row and on 64 (`bench_per_call`);
   and an online transform with its cast against the cast alone, on that model's input widths (`bench_transforms`;
   how those kernels came to be, each beside what it replaced, is `research/inference_kernel_choices.py`);
2. unless `--skip-model`, the whole model (by default the de-gridded SmolLM2-135M, fetched and built once, see
   `common.py`): forward time of the float model vs the dMX model (cached and packed-only), greedy generation's
   time per token (32 tokens after a 16-token prompt: one row per step, where a cast's per-call cost counts more
   than its throughput), `from_pretrained`
   time and checkpoint bytes, float vs dMX, and the cached dMX model with every linear casting its own input
   (`input_casts=None`: no cast shared by q/k/v or gate/up), the cost of that sharing's absence. The dMX model uses
   a fixed mixed map applied without calibration, with one format per fused group as the default
   `offset_groups="fused"` gives every calibrated map: of the units of one format (q/k/v, o_proj, gate/up,
   down_proj, layer after layer) every fifth is MXFP8, the rest MXFP4 (4.8 average bits). With
   `--rotation NAME[,NAME...]` one more dMX model per rotation, rotated by `DMXConfig(rotation=NAME)` with the same
   map, is timed beside them (the cost of the online transforms: `down_proj`'s input for `hadamard` /
   `block_hadamard`, every quantized input but `o_proj`'s, which `v_proj` computes, for `online_block_hadamard`),
   with a row per shape of each rotation's cost over the cached dMX model in percent. With `--rounds N` the forwards
   are timed N times, each time on all the models loaded anew: the cells are the medians of the rounds (one load of
   a model can run several percent faster or slower than another, as one process can). A rotation's cost compares each
   of its forwards with the cached dMX model's forward of the same repeat (the models run in turn), and is the median of
   those pairs over every repeat of every round, with the range of the rounds' own medians: the two forwards of a pair
   share the machine's faster and slower spells, which on a shared VM moved single forwards by several percent.

With `--fresh-processes`, instead of all of the above: the whole model in bfloat16 (float, the cached dMX model, each
rotation), each model timed in a process of its own, started for it, as a user's process runs it (whether float32
temporaries are fresh pages on every call depends on the allocator's state, so on what the process did before), three
times per model in turn:

    python benchmarks/bench_inference.py --fresh-processes --repeats 7 \
        --rotation hadamard,block_hadamard,online_block_hadamard --output benchmarks/results/inference_processes.md

Times are median CPU times (one torch thread by default) over `--repeats` runs after a warm-up: the
linear in bf16 (the checkpoint's dtype) and fp32, the whole model in fp32 and, with `--model-bf16`, in bf16 too.
The process (and each fresh one) runs with glibc's allocator thresholds fixed (`common.fixed_malloc_thresholds`;
`--malloc default` keeps the system's): with the defaults, how many of a forward's activations are fresh pages, faulted
in and zeroed on every call, depends on what the process allocated before, in this benchmark on the other models timed
beside it, so that the ratios measured the allocator's history as much as the models. The whole-model table counts
each model's minor page faults in one forward.
Prints a Markdown table and, with `--output`, writes it with the command line that produced it.

usage: python benchmarks/bench_inference.py [--model DIR | --skip-model] [--model-bf16] [--rotation NAME[,NAME]]
                                           [--fresh-processes] [--malloc fixed|default] [--repeats N] [--rounds N]
                                           [--threads N] [--output FILE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.formats import MX_FORMATS, get_format, quantize_mx
from optimum_dmx.integration.model_card import checkpoint_bytes
from optimum_dmx.nn import transforms
from optimum_dmx.nn.groups import fused_projection_groups
from optimum_dmx.nn.rotation import ROTATIONS

from common import (
    benchmark_model,
    fixed_malloc_thresholds,
    median_seconds,
    minor_page_faults,
    processor_description,
    timed_samples,
    write_report,
)

SHAPES = [(1, 512), (8, 128)]
PROMPT_TOKENS, GENERATED_TOKENS = 16, 32
DTYPES = [torch.bfloat16, torch.float32]
# Whole-model forwards run in fp32, and in bf16 with --model-bf16: CPUs without native bf16 matmul take ~10x longer
# in bf16, so it is opt-in.


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_linear(repeats: int) -> list[list[str]]:
    rows = []
    for dtype in DTYPES:
        torch.manual_seed(0)
        linear = nn.Linear(576, 1536, bias=False).to(dtype)
        for batch, seq in SHAPES:
            x = torch.randn(batch, seq, 576, dtype=dtype)
            with torch.inference_mode():
                for fmt in MX_FORMATS:
                    cached_module = MXLinear.from_linear(linear, fmt)
                    packed_module = MXLinear.from_linear(linear, fmt)
                    packed_module.cache_weight = False
                    base, cached, packed = median_seconds(
                        [lambda: linear(x), lambda: cached_module(x), lambda: packed_module(x)],
                        repeats,
                        time.process_time,
                    )
                    log(f"linear {dtype} {batch}x{seq} {fmt}: {base:.4f} / {cached:.4f} / {packed:.4f} s")
                    rows.append(
                        [
                            "up_proj 576->1536",
                            str(dtype).removeprefix("torch."),
                            f"{batch}x{seq}",
                            fmt,
                            f"{base * 1e3:.2f}",
                            f"{cached * 1e3:.2f} ({cached / base:.2f}x)",
                            f"{packed * 1e3:.2f} ({packed / base:.2f}x)",
                        ]
                    )
    return rows


def bench_per_call(repeats: int, calls: int = 1000) -> list[list[str]]:
    """Time per call on one row (a generated token's input to a 576 -> 576 linear, float32) and on 64 rows (a short
    prompt's): the linear, its `MXLinear` and the MX cast of its input alone (`quantize_mx`), where a cast's fixed
    cost per call counts more than its throughput. (`research/inference_kernel_choices.py` times the cast's compiled
    kernel against the same function through `torch.compile`, as it ran before.)"""
    torch.manual_seed(0)
    linear = nn.Linear(576, 576, bias=False)
    module = MXLinear.from_linear(linear, "mxfp4_e2m1")
    fmt = get_format("mxfp4_e2m1")
    table = []
    for count in (1, 64):
        x = torch.randn(1, count, 576)
        candidates = {
            "nn.Linear": lambda: linear(x),
            "MXLinear cached": lambda: module(x),
            "quantize_mx": lambda: quantize_mx(x, fmt),
        }
        table += timed_per_call_rows(candidates, count, repeats, calls)
    return table


def timed_per_call_rows(
    candidates: dict[str, Callable[[], object]], count: int, repeats: int, calls: int
) -> list[list[str]]:
    """Rows of the per-call table: each of `candidates` (calls on `count` rows) timed per call, wall time, median of
    `repeats` x `calls` calls, with its ratio to the first."""
    with torch.inference_mode():
        seconds = median_seconds(list(candidates.values()), repeats, time.perf_counter, calls=calls)
    rows = []
    for name, per_call in zip(candidates, seconds):
        log(f"{count} row(s), {name}: {per_call * 1e6:.1f} us per call")
        rows.append([str(count), name, f"{per_call * 1e6:.1f}", f"{per_call / seconds[0]:.2f}x"])
    return rows


def bench_transforms(repeats: int, tokens: int = 1024) -> list[list[str]]:
    """Time per call of an online transform with its MX cast (`RandomizedHadamard.quantize`, `tokens` rows: 8 x 128)
    against the plain cast of the same input, in float32 and bfloat16: 32-blocks on SmolLM2's two input widths (576:
    q/k/v, o_proj, gate/up; 1536: down_proj) and `hadamard`'s 512-blocks of `down_proj`'s input, without signs (the
    rotations move them into the modules producing the inputs) and with them applied online (a transform whose
    input's producer cannot take them). `research/inference_kernel_choices.py` times the ways these kernels ran
    before beside them."""
    fmt = get_format("mxfp4_e2m1")
    table = []
    for x, block, transform, signed in transform_inputs(tokens):
        candidates = {
            "MX cast alone (quantize_mx)": lambda: quantize_mx(x, fmt),
            "transform and cast": lambda: transform.quantize(x, fmt, 32, "ocp"),
            "transform and cast, signs applied online": lambda: signed.quantize(x, fmt, 32, "ocp"),
        }
        table += timed_transform_rows(candidates, x, block, repeats)
    return table


def transform_inputs(
    tokens: int,
) -> Iterator[tuple[torch.Tensor, int, transforms.RandomizedHadamard, transforms.RandomizedHadamard]]:
    """The online transforms' table's cases: a random input of `tokens` rows, in float32 then bfloat16, on SmolLM2's
    input widths and blocks (576 and 1536 on 32-blocks, 1536 on `hadamard`'s 512-blocks), with the transform without
    signs and the same one signed."""
    for dtype in (torch.float32, torch.bfloat16):
        for width, block in ((576, 32), (1536, 32), (1536, 512)):
            x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0)).to(dtype)
            unsigned = transforms.RandomizedHadamard(width, block, seed=0, signed=False)
            yield x, block, unsigned, transforms.RandomizedHadamard(width, block, seed=0)


def timed_transform_rows(
    candidates: dict[str, Callable[[], object]], x: torch.Tensor, block: int, repeats: int
) -> list[list[str]]:
    """Rows of the online transforms' table: each of `candidates` (calls on the input `x`, the first one the cast
    alone) timed per call, CPU time, median of `repeats` x 20 calls, with its ratio to the first."""
    with torch.inference_mode():
        seconds = median_seconds(list(candidates.values()), repeats, time.process_time, calls=20)
    rows, width, dtype = [], x.shape[-1], str(x.dtype).removeprefix("torch.")
    for name, per_call in zip(candidates, seconds):
        log(f"{dtype}, {width} wide, {block}-blocks, {name}: {per_call * 1e3:.2f} ms per call")
        shares = f"{per_call * 1e3:.2f}", f"{per_call / seconds[0]:.2f}x"
        rows.append([f"{len(x)} x {width}", dtype, str(block), name, *shares])
    return rows


def mixed_format_map(model: nn.Module) -> dict[str, str]:
    """MXFP8 for every fifth unit of one format (a fused group or a single linear, in module order), else MXFP4."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    group_of = {name: group for group in fused_projection_groups(names) for name in group}
    units = list(dict.fromkeys(group_of.get(name, (name,)) for name in names))
    return {name: "mxfp8_e4m3" if i % 5 == 0 else "mxfp4_e2m1" for i, unit in enumerate(units) for name in unit}


def generate(model: nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    """Greedy generation of exactly ``GENERATED_TOKENS`` tokens after ``prompt`` (one row per step: the casts'
    per-call cost, not their throughput)."""
    return model.generate(prompt, max_new_tokens=GENERATED_TOKENS, min_new_tokens=GENERATED_TOKENS, do_sample=False)


def save_dmx_models(model_dir: Path, into: Path, rotations: tuple[str, ...]) -> list[Path]:
    """Folders of the dMX model (`mixed_format_map`, bf16) and of the same map with each rotation, under `into`."""
    from transformers import AutoModelForCausalLM

    format_map = mixed_format_map(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16))
    folders = [into / "dmx", *(into / f"rotated-{rotation}" for rotation in rotations)]
    for rotation, folder in zip(("none", *rotations), folders):
        config = DMXConfig(format_map=format_map, rotation=rotation)
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, quantization_config=config
        ).save_pretrained(folder)
    return folders


def forward_seconds(model_dir: str, shape: tuple[int, int], repeats: int, threads: int) -> float:
    """Median CPU time of the bf16 forward of the model in `model_dir` on `shape` tokens, in this process."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return median_seconds([lambda: model(ids)], repeats, time.process_time)[0]


# Run by `bench_fresh_processes` in a new interpreter: prints one model's `forward_seconds`.
FORWARD_IN_A_NEW_PROCESS = """
import sys
sys.path.insert(0, {benchmarks!r})
from bench_inference import forward_seconds
from common import fixed_malloc_thresholds
if {fixed_malloc!r}:
    fixed_malloc_thresholds()
print(forward_seconds({model!r}, {shape!r}, {repeats!r}, {threads!r}))
"""


def bench_fresh_processes(
    model_dir: Path, repeats: int, threads: int, rotations: tuple[str, ...], fixed_malloc: bool, rounds: int = 3
) -> list[list[str]]:
    """Rows per shape: the bf16 forward of float, dMX and each rotated dMX model, each timed
    in a new Python process that loads only that model, as a user's does; the models in turn, `rounds` times; the
    median of the rounds (processes of the same model differ by several percent, as their allocators' states do)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dmx_dir, *rotated_dirs = save_dmx_models(model_dir, Path(tmp), rotations)
        models = [model_dir, dmx_dir, *rotated_dirs]
        for shape in SHAPES:
            samples: list[list[float]] = [[] for _ in models]
            for _ in range(rounds):
                for path, times in zip(models, samples):
                    code = FORWARD_IN_A_NEW_PROCESS.format(
                        benchmarks=str(Path(__file__).parent),
                        model=str(path),
                        shape=shape,
                        repeats=repeats,
                        threads=threads,
                        fixed_malloc=fixed_malloc,
                    )
                    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                    times.append(float(result.stdout.split()[-1]))
            base, *others = (statistics.median(times) for times in samples)
            log(f"fresh processes {shape}: " + " / ".join(f"{t:.3f}" for t in (base, *others)) + " s")
            cells = compared(others, base, 1e3, "{:.0f}", against_dmx_from=1)
            rows.append(["SmolLM2-135M forward", "bfloat16", "x".join(map(str, shape)), f"{base * 1e3:.0f}", *cells])
    return rows


def load_models(model_dir: Path, dmx_dir: Path, rotated_dirs: list[Path], dtype: torch.dtype) -> list[nn.Module]:
    """The whole-model table's models in `dtype`, in its column order: float, dMX cached, dMX packed-only, dMX cached
    with no input cast shared, then one cached dMX model per rotated folder."""
    from transformers import AutoModelForCausalLM

    models = [
        AutoModelForCausalLM.from_pretrained(path, dtype=dtype) for path in (model_dir, dmx_dir, dmx_dir, dmx_dir)
    ]
    for module in models[2].modules():
        if isinstance(module, MXLinear):
            module.cache_weight = False
    for module in models[3].modules():
        if isinstance(module, MXLinear):
            module.input_casts = None
    return models + [AutoModelForCausalLM.from_pretrained(path, dtype=dtype) for path in rotated_dirs]


def cost_over_rounds(samples: list[list[list[float]]], column: int) -> str:
    """The cell of a rotated model (`column` of each round's samples, `timed_samples`; the cached dMX model's is 1): its
    cost over the cached dMX model as a percentage to a tenth (the +5% bar of the online transforms). Each repeat's
    forward is compared with the cached dMX model's forward of the same repeat (the models run in turn): the cell is the
    median of those paired costs over every repeat of every round and, of several rounds, the range of the rounds'
    own medians. A pair shares the machine's slower and faster spells, which moved single forwards of one model by
    several percent on a shared VM (the ratio of two models' medians, each over its own forwards, carried that
    noise)."""
    per_round = [[100 * (t / base - 1) for t, base in zip(times[column], times[1])] for times in samples]
    pooled = statistics.median(cost for costs in per_round for cost in costs)
    medians = sorted(statistics.median(costs) for costs in per_round)
    spread = f" ({medians[0]:+.1f}% to {medians[-1]:+.1f}%)" if len(medians) > 1 else ""
    return f"{pooled:+.1f}%{spread}"


def bench_model(
    model_dir: Path,
    repeats: int,
    rotations: tuple[str, ...] = (),
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    rounds: int = 1,
) -> tuple[list[list[str]], list[str]]:
    """The whole-model table's rows and notes. The forwards are timed in `rounds` rounds, each on models loaded anew
    (two loads of one model differed by several percent, as separate processes do), each cell the median of the
    rounds; with rotations, a row per shape gives each rotation's cost over the cached dMX model (`cost_over_rounds`:
    the median of every repeat's paired cost, and the range of the rounds' medians). Page faults and generation are
    measured on the last round's models."""
    from transformers import AutoModelForCausalLM

    rows, notes = [], []
    float_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    format_map = mixed_format_map(float_model)
    with tempfile.TemporaryDirectory() as tmp:
        dmx_dir, *rotated_dirs = save_dmx_models(model_dir, Path(tmp), rotations)

        load_float, load_dmx = median_seconds(
            [lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16) for path in (model_dir, dmx_dir)],
            repeats,
            time.perf_counter,
        )
        float_bytes, dmx_bytes = checkpoint_bytes(model_dir), checkpoint_bytes(dmx_dir)

        linears = dict(float_model.named_modules())
        numel = {name: linears[name].weight.numel() for name in format_map}
        storage_bits = sum(numel[n] * get_format(f).storage_bits() for n, f in format_map.items()) / sum(numel.values())
        bits_simple = statistics.mean(get_format(f).bits for f in format_map.values())
        linear_float_bytes = 2 * sum(numel.values())
        rest_bytes = float_bytes - linear_float_bytes  # embeddings, norms: stored as before
        notes += [
            f"format map: {len(format_map)} decoder linears, {bits_simple:.2f} average element bits, "
            f"{storage_bits:.4f} storage bits per weight (E8M0 scales included)",
            f"checkpoint: float {float_bytes / 2**20:.1f} MiB, dMX {dmx_bytes / 2**20:.1f} MiB, "
            f"ratio {dmx_bytes / float_bytes:.3f} (storage_bits/16 = {storage_bits / 16:.3f}; the "
            f"{rest_bytes / 2**20:.1f} MiB of embeddings and norms stay bf16, so the expected ratio is "
            f"{(rest_bytes + linear_float_bytes * storage_bits / 16) / float_bytes:.3f})",
        ]
        load_ratio, size_ratio = load_dmx / load_float, dmx_bytes / float_bytes
        extra = [""] * (2 + len(rotations))
        rows.append(
            [
                "load time (from_pretrained, wall)",
                "bf16",
                "",
                f"{load_float:.2f} s",
                f"{load_dmx:.2f} s ({load_ratio:.2f}x)",
                "",
                *extra,
            ]
        )
        rows.append(
            [
                "checkpoint bytes",
                "bf16",
                "",
                f"{float_bytes / 2**20:.1f} MiB",
                f"{dmx_bytes / 2**20:.1f} MiB ({size_ratio:.3f}x)",
                "",
                *extra,
            ]
        )

        vocab_size = float_model.config.vocab_size
        inputs = {
            shape: torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(0)) for shape in SHAPES
        }
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            per_round: dict[tuple[int, int], list[list[list[float]]]] = {shape: [] for shape in SHAPES}
            for _ in range(rounds):
                models = None  # the last round's models are freed before the next round loads its own
                models = load_models(model_dir, dmx_dir, rotated_dirs, dtype)
                for shape, samples in per_round.items():
                    forwards = [lambda m=m, ids=inputs[shape]: m(ids) for m in models]
                    with torch.inference_mode():
                        samples.append(timed_samples(forwards, repeats, time.process_time))
                    medians = [statistics.median(model_samples) for model_samples in samples[-1]]
                    log(f"model {dtype} {shape}: " + " / ".join(f"{t:.2f}" for t in medians) + " s")
            first_rotated = len(models) - len(rotations)
            for (batch, seq), samples in per_round.items():
                times = [[statistics.median(model) for model in round_samples] for round_samples in samples]
                base, *others = (statistics.median(model_times) for model_times in zip(*times))
                shape = f"{batch}x{seq}"
                rows.append(
                    ["SmolLM2-135M forward", name, shape, f"{base * 1e3:.0f}", *compared(others, base, 1e3, "{:.0f}")]
                )
                if rotations:
                    costs = [cost_over_rounds(samples, column) for column in range(first_rotated, len(models))]
                    blank = [""] * first_rotated
                    rows.append(["SmolLM2-135M forward, rotation's cost over dMX cached", name, shape, *blank, *costs])
                with torch.inference_mode():
                    faults = [page_faults_of(lambda m=m: m(inputs[batch, seq])) for m in models]
                rows.append(["SmolLM2-135M forward, minor page faults (one call)", name, shape, *map(str, faults)])
            prompt = torch.randint(0, vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                base, *others = (
                    t / GENERATED_TOKENS
                    for t in median_seconds(
                        [lambda m=m: generate(m, prompt) for m in models], repeats, time.process_time
                    )
                )
            log(f"generation {dtype}: " + " / ".join(f"{t * 1e3:.1f}" for t in (base, *others)) + " ms per token")
            rows.append(
                [
                    "SmolLM2-135M generation, ms per token",
                    str(dtype).removeprefix("torch."),
                    f"1x{PROMPT_TOKENS} + {GENERATED_TOKENS}",
                    f"{base * 1e3:.1f}",
                    *compared(others, base, 1e3, "{:.1f}"),
                ]
            )
    return rows, notes


def page_faults_of(call: Callable[[], object]) -> int:
    """Minor page faults of one `call`: fresh pages the kernel handed the process and zeroed for it."""
    before = minor_page_faults()
    call()
    return minor_page_faults() - before


def compared(
    times: list[float | None], float_time: float, unit: float, number: str, against_dmx_from: int = 3
) -> list[str]:
    """Cells for the dMX models' `times` (the cached model first; None: not timed): each with its ratio to float, and
    from index `against_dmx_from` on (the whole-model table's rotations) also with its ratio to
    the cached dMX model."""
    cells = ["" if t is None else f"{number.format(t * unit)} ({t / float_time:.2f}x)" for t in times]
    start = against_dmx_from
    cells[start:] = [cell and f"{cell[:-1]}; {t / times[0]:.2f}x dMX)" for cell, t in zip(cells[start:], times[start:])]
    return cells


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the de-gridded SmolLM2-135M, fetched once)")
    parser.add_argument("--skip-model", action="store_true", help="only the single-linear part")
    parser.add_argument(
        "--rotation",
        default="none",
        help=f"comma list of rotations ({', '.join(ROTATIONS)}): also time a dMX model with each (same map)",
    )
    parser.add_argument("--model-bf16", action="store_true", help="also time the whole model in bfloat16")
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="only the whole model in bfloat16, each model timed in a process of its own",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="whole-model forwards: rounds of timing, each on models loaded anew (the cells: medians of the rounds)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU time is summed over them)")
    parser.add_argument(
        "--malloc",
        choices=("fixed", "default"),
        default="fixed",
        help="glibc's allocator thresholds: fixed (common.fixed_malloc_thresholds, the default: times without the "
        "page faults that the process's history decides) or the system's default",
    )
    parser.add_argument("--output", type=Path, help="also write the results as Markdown here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    rotations = tuple(r for r in args.rotation.split(",") if r != "none")
    unknown = [r for r in rotations if r not in ROTATIONS]
    if unknown:
        parser.error(f"unknown rotation {unknown}; allowed: {', '.join(ROTATIONS)}")
    torch.set_num_threads(args.threads)
    allocator = fixed_malloc_thresholds() if args.malloc == "fixed" else "allocator: the system's defaults"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    machine = (
        f"Machine: {processor_description()}, {args.threads} torch threads, "
        f"torch {torch.__version__}; {allocator}; times are median CPU times of {args.repeats} runs, in ms unless "
        "marked"
    )
    if args.rounds > 1 and not args.fresh_processes:
        machine += f"; whole-model forwards: the median of {args.rounds} rounds, each on the models loaded anew"
    if rotations and not args.fresh_processes:
        machine += (
            "; a rotation's cost: the median, over every repeat of every round, of its forward over the cached dMX "
            "model's forward of the same repeat (in brackets: the range of the rounds' medians)"
        )
    if args.fresh_processes:
        header = ["measure", "dtype", "batch x seq", "float", "dMX cached (vs float)"]
        header += [f"dMX cached, rotation {rotation} (vs float; vs dMX cached)" for rotation in rotations]
        rows = bench_fresh_processes(
            args.model or benchmark_model(), args.repeats, args.threads, rotations, args.malloc == "fixed"
        )
        text = (
            f"{machine}; each model in a new process that loads only it, three times in turn: the median of the "
            "three\n\n" + table(header, rows)
        )
        write_report(text + "\n", args.output, "Inference, each model in a fresh process")
        return
    parts = [
        machine,
        "",
        "### One decoder linear",
        table(
            ["layer", "dtype", "batch x seq", "format", "nn.Linear", "MXLinear cached", "MXLinear packed-only"],
            bench_linear(args.repeats),
        ),
        "",
        f"### Per call: one row (a generated token) and 64 (a short prompt), wall time in us (median of "
        f"{args.repeats} x 1000 calls)",
        table(["rows", "call", "us per call", "x nn.Linear"], bench_per_call(args.repeats)),
        "",
        f"### Online transforms with their MX cast, per call (CPU time in ms, median of {args.repeats} x 20 calls)",
        table(["input", "dtype", "block", "call", "ms per call", "x the cast alone"], bench_transforms(args.repeats)),
    ]
    if not args.skip_model:
        dtypes = (torch.float32, torch.bfloat16) if args.model_bf16 else (torch.float32,)
        rows, notes = bench_model(args.model or benchmark_model(), args.repeats, rotations, dtypes, args.rounds)
        header = [
            "measure",
            "dtype",
            "batch x seq",
            "float",
            "dMX cached",
            "dMX packed-only",
            "dMX cached, input casts not shared",
        ]
        header += [f"dMX cached, rotation {rotation} (vs float; vs dMX cached)" for rotation in rotations]
        parts += ["", "### Whole model (SmolLM2-135M)", table(header, rows), ""]
        parts += [f"- {note}" for note in notes]
    write_report("\n".join(parts) + "\n", args.output, "Inference")


if __name__ == "__main__":
    main()
