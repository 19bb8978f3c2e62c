#!/usr/bin/env python
"""Calibration cost: a step, the KL scan and a whole run, in time and memory, against an unquantized training step.

Regenerate `results/calibration_cost.md` (about 35 minutes on 2 CPU cores):

    python benchmarks/bench_calibration_cost.py --threads 2 --batch-sizes 4 --repeats 1 --memory \
        --output benchmarks/results/calibration_cost.md

Everything is measured in one run on the same model and batch, so the ratios compare like with like:

* **Step** (per batch size, medians over `--repeats` alternated repeats): the reference is a forward + backward
  pass of the float model with every weight trainable. A dMX step is a step of the real trainer (`calibrate`): each
  repeat is one run of `1 + --steps` steps, and the trainer's own per-step times (`step_seconds`) after the first
  are the samples; the first step pays the kernels' compilation ("first step s"). Columns: the default method, the
  same with activation checkpointing, the paper's method, and the servable configuration (`offset_groups="fused"`
  on a copy of the model rotated with `online_block_hadamard`: what a vLLM user calibrates).
* **Run**: one whole calibration at `--preset` sizes by the default method and one by the servable configuration,
  each split into its steps, its KL scan (what `method="kl"` costs) and its setup, in seconds (the default's also in
  units of unquantized steps of the preset's batch); then the GPTQ rounding of its map on the preset's sequences
  (what `weight_rounding="gptq"` adds); and the servable whole run over the default's.
* **Memory** (`--memory`): peak resident memory (CPU, Linux) or allocated GPU memory of one unquantized step and
  of `--steps` dMX steps, each in a process of its own with glibc's `MALLOC_MMAP_THRESHOLD_=65536` (freed buffers
  go back to the system, so the resident set follows the live tensors), after an untimed warm-up. Besides the
  model in memory, with activation checkpointing: "offloaded", the second half of the decoder layers offloaded by
  accelerate's `device_map` (to disk on a CPU, to CPU memory beside a GPU); "sharded", every decoder layer and the
  model sharded by FSDP2 across 2 processes (`torch.distributed.run`; the peak of either; not on one GPU). Each dMX
  row also gives the bytes of the frozen weight quantizations its run kept (one per layer and endpoint drawn), the
  part of the memory model in `results/sizing.md` that depends on the steps' draws.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from optimum_dmx.calibration import (
    CalibrationSettings,
    DMXLinear,
    Preset,
    calibrate,
    get_preset,
    round_weights_by_gptq,
)
from optimum_dmx.nn import emulate_format_map, linear_modules_to_quantize
from optimum_dmx.nn.rotation import rotate_model

from common import (
    MODEL_DTYPES,
    calibration_benchmark_parser,
    calibration_ids,
    device_description,
    fwd_bwd_seconds,
    load_model_and_calibration,
    random_ids,
    random_model,
    write_report,
)

# name -> the settings that differ from the default method's ("dMX servable": what a vLLM user calibrates)
TRAINERS = {
    "dMX": {},
    "dMX checkpointed": {"gradient_checkpointing": True},
    "dMX paper": {"method": "paper"},
    "dMX servable": {"offset_groups": "fused"},
}
# trainers that calibrate a rotated copy of the model: name -> its rotation (`DMXConfig(rotation=...)`)
TRAINER_ROTATIONS = {"dMX servable": "online_block_hadamard"}
# the whole runs of the run table: the default method and the servable configuration
RUN_TRAINERS = ("dMX", "dMX servable")
# Memory workloads: name -> the calibration settings that differ from the default method's (None: a training step)
MEMORY_WORKLOADS = {
    "unquantized": None,
    "dMX": {},
    "dMX checkpointed": {"gradient_checkpointing": True},
    "dMX offloaded": {"gradient_checkpointing": True},
    "dMX sharded": {"gradient_checkpointing": True},
}
SHARDING_PROCESSES = 2


def load(a: argparse.Namespace, seq_len: int, count: int) -> tuple[torch.nn.Module, str, torch.Tensor]:
    """The benchmark's model (`--model`, `--shape` or the default), its description and `count` sequences."""
    dtype = MODEL_DTYPES[a.dtype]
    if a.shape:
        return (
            random_model(a.shape, a.device, dtype),
            f"randomly initialised `{a.shape}`",
            random_ids(a.shape, seq_len, count),
        )
    model, model_dir, ids = load_model_and_calibration(
        a.model, a.calibration, seq_len, count, device=a.device, dtype=dtype
    )
    return model, f"`{model_dir.name}`", ids


def preset_ids(a: argparse.Namespace, preset: Preset) -> torch.Tensor:
    """Calibration sequences of the preset's sizes (random ones for `--shape`)."""
    if a.shape:
        return random_ids(a.shape, preset.seq_len, preset.num_samples)
    return calibration_ids(a.model, a.calibration, preset.seq_len, preset.num_samples)


def step_seconds(name: str, model: torch.nn.Module, batch: torch.Tensor, pair: str, steps: int) -> list[float]:
    """Wall time of each of `1 + steps` steps of trainer `name` on `batch`, from one run (`step_seconds` of its
    result); the first step pays the kernels' compilation, if any. A trainer of `TRAINER_ROTATIONS` calibrates a
    copy of `model` rotated as `DMXConfig(rotation=...)` rotates it."""
    if name in TRAINER_ROTATIONS:
        model = copy.deepcopy(model)
        rotate_model(model, TRAINER_ROTATIONS[name], linear_modules_to_quantize(model, ["lm_head"]))
    settings = CalibrationSettings(
        target_bits=5.0,
        format_pair=pair,
        num_samples=len(batch),
        seq_len=batch.shape[1],
        batch_size=len(batch),
        steps=1 + steps,
        **TRAINERS[name],
    )
    return calibrate(model, batch, settings, progress=False).step_seconds


def step_table(model: torch.nn.Module, ids: torch.Tensor, a: argparse.Namespace) -> list[str]:
    lines = [
        "## Step",
        "",
        "| batch x seq | unquantized fwd+bwd ms | "
        + " | ".join(f"{name} step ms | {name} / unquantized" for name in TRAINERS)
        + " | "
        + " | ".join(f"{name} first step s" for name in TRAINERS)
        + " |",
        "|---|---|" + "---|---|" * len(TRAINERS) + "---|" * len(TRAINERS),
    ]
    for batch_size in [int(b) for b in a.batch_sizes.split(",")]:
        batch = ids[:batch_size]
        first_step = {}
        times: dict[str, list[float]] = {"unquantized": [], **{name: [] for name in TRAINERS}}
        for _ in range(a.repeats):
            times["unquantized"].append(fwd_bwd_seconds(model, batch, repeats=1))
            for name in TRAINERS:
                seconds = step_seconds(name, model, batch, a.pair, a.steps)
                first_step.setdefault(name, seconds[0])
                times[name] += seconds[1:]
        t = {name: statistics.median(values) for name, values in times.items()}
        reference = t["unquantized"]
        cells = " | ".join(f"{t[name] * 1e3:.1f} | {t[name] / reference:.2f}x" for name in TRAINERS)
        cells += " | " + " | ".join(f"{first_step[name]:.1f}" for name in TRAINERS)
        lines.append(f"| {batch_size} x {batch.shape[1]} | {reference * 1e3:.1f} | {cells} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def whole_run(name: str, model: torch.nn.Module, ids: torch.Tensor, preset: Preset, pair: str) -> dict[str, float]:
    """Seconds of each part of one whole calibration by trainer `name` at `preset`'s sizes, then GPTQ rounding of
    its map (what `weight_rounding="gptq"` adds). A trainer of `TRAINER_ROTATIONS` calibrates a rotated copy of
    `model`; its rotation counts as setup, as it does in `DMXConfig(rotation=...)`."""
    rotation = 0.0
    if name in TRAINER_ROTATIONS:
        model = copy.deepcopy(model)
        start = time.perf_counter()
        rotate_model(model, TRAINER_ROTATIONS[name], linear_modules_to_quantize(model, ["lm_head"]))
        rotation = time.perf_counter() - start
    settings = CalibrationSettings(format_pair=pair, **preset.settings(), **TRAINERS[name])
    result = calibrate(model, ids, settings, progress=False)
    steps = sum(result.step_seconds)
    gptq = gptq_seconds(model, result.format_map, ids[: preset.gptq_samples], preset.batch_size)
    return {
        "steps": steps,
        "scan": result.scan_seconds,
        "setup": result.seconds - steps - result.scan_seconds + rotation,
        "calibration": result.seconds + rotation,
        "gptq": gptq,
        "total": result.seconds + rotation + gptq,
    }


def run_table(model: torch.nn.Module, a: argparse.Namespace) -> list[str]:
    preset = get_preset(a.preset)
    ids = preset_ids(a, preset)
    reference = fwd_bwd_seconds(model, ids[: preset.batch_size], repeats=3)
    runs = {name: whole_run(name, model, ids, preset, a.pair) for name in RUN_TRAINERS}
    default, servable = (runs[name] for name in RUN_TRAINERS)
    gptq_count = len(ids[: preset.gptq_samples])
    lines = [
        "## Run",
        "",
        f"Preset `{a.preset}`: {preset.steps} steps of {preset.batch_size} x {preset.seq_len} tokens, then GPTQ "
        f"rounding of the map on {gptq_count} sequences; one unquantized step of that batch takes "
        f"{reference * 1e3:.1f} ms. Columns: the default method, and the servable configuration (rotated with "
        f"`{TRAINER_ROTATIONS['dMX servable']}`, grouped), each in one run.",
        "",
        "| what | dMX s | dMX unquantized steps | dMX share | dMX servable s | servable / dMX |",
        "|---|---|---|---|---|---|",
    ]
    for what, part in [
        (f"{preset.steps} steps", "steps"),
        ('KL scan (all that `method="kl"` runs)', "scan"),
        ("setup (model surgery, rotations)", "setup"),
        ('calibration (`weight_rounding="nearest"`)', "calibration"),
        (f'GPTQ rounding of the map (`weight_rounding="gptq"`, {gptq_count} sequences)', "gptq"),
        ("whole run with GPTQ", "total"),
    ]:
        ratio = f"{servable[part] / default[part]:.2f}x" if default[part] > 0.05 else "-"
        lines.append(
            f"| {what} | {default[part]:.1f} | {default[part] / reference:.0f} | "
            f"{default[part] / default['total']:.0%} | {servable[part]:.1f} | {ratio} |"
        )
    lines.append("")
    lines.append(
        f"The KL scan costs {default['scan'] / default['steps']:.0%} of the default's steps' time "
        f"({default['scan'] / (default['steps'] / preset.steps):.1f} steps); GPTQ rounding costs "
        f"{default['gptq'] / default['scan']:.2f}x the KL scan. The servable configuration's whole run takes "
        f"{servable['total'] / default['total']:.2f}x the default's."
    )
    print("\n".join(lines[-10:]), file=sys.stderr, flush=True)
    return lines


def gptq_seconds(model: torch.nn.Module, format_map: dict[str, str], ids: torch.Tensor, batch_size: int) -> float:
    """Seconds to round `format_map`'s weights by GPTQ on `ids`, the map installed as a saved model has it."""
    float_linears = {name: model.get_submodule(name) for name in format_map}
    with emulate_format_map(model, format_map):
        start = time.perf_counter()
        round_weights_by_gptq(model, float_linears, ids, batch_size, progress=False)
        return time.perf_counter() - start


def resident_kib(field: str) -> int:
    """A `/proc/self/status` memory field (`VmRSS`, `VmHWM`) in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field: the memory table needs Linux.")


def offloaded(model: torch.nn.Module, a: argparse.Namespace, folder: str) -> torch.nn.Module:
    """`model` saved to `folder` and loaded again with the second half of its decoder layers offloaded by accelerate
    (to disk on a CPU, to CPU memory beside a GPU)."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(folder)
    layers = model.config.num_hidden_layers
    target = "cpu" if torch.device(a.device).type == "cuda" else "disk"
    device_map = {name: a.device for name in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
    device_map.update({f"model.layers.{i}": a.device if i < layers // 2 else target for i in range(layers)})
    del model
    return AutoModelForCausalLM.from_pretrained(
        folder, device_map=device_map, offload_folder=f"{folder}/offload", dtype=MODEL_DTYPES[a.dtype]
    ).eval()


def sharded(model: torch.nn.Module, a: argparse.Namespace) -> torch.nn.Module:
    """`model` with every decoder layer and itself sharded by FSDP2 across the processes `torch.distributed.run`
    started (the process group made here: gloo on a CPU, NCCL on GPUs, one per process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        model.to(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextmanager
def frozen_quantization_bytes() -> Iterator[dict[tuple[int, float], int]]:
    """Within the block, the bytes of each frozen weight quantization a calibration keeps (`DMXLinear.frozen_weight`:
    one per layer and endpoint drawn, held for the rest of its run), by layer and endpoint: the largest item of
    the memory model in `results/sizing.md`, which depends on how many layers the steps drew at both endpoints."""
    kept: dict[tuple[int, float], int] = {}
    frozen_weight = DMXLinear.frozen_weight

    def counted(layer: DMXLinear, offset: float | None):
        frozen = frozen_weight(layer, offset)
        if frozen is not None:
            kept[(id(layer), offset)] = frozen.values.nbytes
        return frozen

    DMXLinear.frozen_weight = counted
    try:
        yield kept
    finally:
        DMXLinear.frozen_weight = frozen_weight


def measure_memory(workload: str, a: argparse.Namespace) -> dict[str, float]:
    """Peak and peak-over-baseline memory (MiB) of `workload`, measured in this process."""
    import tempfile

    model, _, ids = load(a, a.seq_len, a.batch_size)
    folder = tempfile.TemporaryDirectory()
    if workload == "dMX offloaded":
        model = offloaded(model, a, folder.name)
    elif workload == "dMX sharded":
        model = sharded(model, a)
    ids = ids.to(a.device if workload != "dMX sharded" else next(model.parameters()).device)
    if workload == "unquantized":
        for p in model.parameters():
            p.requires_grad_(True)

        def work() -> None:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        settings = CalibrationSettings(
            target_bits=5.0,
            format_pair=a.pair,
            num_samples=len(ids),
            seq_len=a.seq_len,
            batch_size=a.batch_size,
            steps=a.steps,
            **MEMORY_WORKLOADS[workload],
        )

        def work() -> None:
            calibrate(model, ids, settings, progress=False)

    work()  # warm-up: compilation, allocator pools
    with frozen_quantization_bytes() as frozen:
        if torch.device(a.device).type == "cuda":
            torch.cuda.synchronize(a.device)
            baseline = torch.cuda.memory_allocated(a.device) / 1024
            torch.cuda.reset_peak_memory_stats(a.device)
            work()
            torch.cuda.synchronize(a.device)
            peak = torch.cuda.max_memory_allocated(a.device) / 1024
        else:
            baseline = resident_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # reset VmHWM to the current resident set
            work()
            peak = resident_kib("VmHWM")
    folder.cleanup()
    if workload == "dMX sharded":
        torch.distributed.destroy_process_group()  # a gloo group left to interpreter shutdown can abort the process
    return {
        "peak_mib": peak / 1024,
        "over_baseline_mib": (peak - baseline) / 1024,
        "frozen_mib": sum(frozen.values()) / 2**20,
    }


def memory_table(a: argparse.Namespace) -> list[str]:
    memory = "allocated GPU memory" if torch.device(a.device).type == "cuda" else "resident memory"
    lines = [
        "## Memory",
        "",
        f"{memory}, one process per measurement (sharded: the largest of {SHARDING_PROCESSES}, each with half of "
        f"every batch); dMX rows: {a.steps} steps; offloaded and sharded: with activation checkpointing. Frozen "
        "quantizations: the weights' quantized values the run kept, one per layer and endpoint drawn (none where a "
        "weight is not resident: offloaded, sharded).",
        "",
        "| batch x seq | workload | peak MiB | over baseline MiB | / unquantized | frozen quantizations MiB |",
        "|---|---|---|---|---|---|",
    ]
    for batch_size in [int(b) for b in a.batch_sizes.split(",")]:
        results = {}
        for workload in ["unquantized", *(w for w in a.memory_workloads.split(",") if w != "unquantized")]:
            launcher = [sys.executable]
            if workload == "dMX sharded":
                one_gpu = torch.device(a.device).type == "cuda" and torch.cuda.device_count() < SHARDING_PROCESSES
                if one_gpu or batch_size % SHARDING_PROCESSES:  # each process takes an equal share of the batch
                    continue
                launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(SHARDING_PROCESSES)]
            command = [
                *launcher,
                __file__,
                "--measure-memory",
                workload,
                "--batch-size",
                str(batch_size),
                "--seq-len",
                str(a.seq_len),
                "--steps",
                str(a.steps),
                "--threads",
                str(a.threads),
                "--device",
                a.device,
                "--dtype",
                a.dtype,
                "--pair",
                a.pair,
            ]
            if a.model:
                command += ["--model", str(a.model)]
            if a.shape:
                command += ["--shape", a.shape]
            if a.calibration:
                command += ["--calibration", *map(str, a.calibration)]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
            if out.returncode:
                raise SystemExit(f"measuring {workload} failed:\n{out.stderr[-3000:]}")
            processes = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            results[workload] = {key: max(p[key] for p in processes) for key in processes[0]}  # the largest process
        reference = results["unquantized"]["over_baseline_mib"]
        for workload, r in results.items():
            ratio = f"{r['over_baseline_mib'] / reference:.2f}x" if reference > 0 else "-"
            frozen = f"{r['frozen_mib']:.2f}" if workload != "unquantized" else "-"
            lines.append(
                f"| {batch_size} x {a.seq_len} | {workload} | {r['peak_mib']:.0f} | "
                f"{r['over_baseline_mib']:.0f} | {ratio} | {frozen} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main() -> None:
    p = calibration_benchmark_parser(__doc__)
    p.add_argument("--pair", default="mxfp8-mxfp4")
    p.add_argument(
        "--steps", type=int, default=4, help="timed steps after the first, per repeat (and the memory steps)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", default="cpu-demo", help="sizes of the whole run (optimum_dmx.calibration.presets)")
    p.add_argument("--memory", action="store_true", help="add the memory table")
    p.add_argument(
        "--memory-workloads",
        default=",".join(MEMORY_WORKLOADS),
        help=f"comma list of the memory table's rows, among: {', '.join(MEMORY_WORKLOADS)}",
    )
    p.add_argument("--no-steps", action="store_true", help="leave out the step table")
    p.add_argument("--no-run", action="store_true", help="leave out the whole run")
    p.add_argument("--measure-memory", choices=MEMORY_WORKLOADS, help=argparse.SUPPRESS)  # internal: one process
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    unknown = set(a.memory_workloads.split(",")) - set(MEMORY_WORKLOADS)
    if unknown:
        p.error(f"--memory-workloads: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(MEMORY_WORKLOADS)}")
    torch.set_num_threads(a.threads)
    if a.measure_memory:
        # One write per line: the sharded workload's processes share this pipe, and `print` writes the line and its
        # end apart, so two processes' lines could interleave into one that is not JSON.
        sys.stdout.write(json.dumps(measure_memory(a.measure_memory, a)) + "\n")
        sys.stdout.flush()
        return

    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    model, description, ids = load(a, a.seq_len, max(batch_sizes))
    lines = [
        f"Model {description} ({a.dtype}), pair {a.pair}, {device_description(a.device)}, torch {torch.__version__}.",
    ]
    if not a.no_steps:
        lines += ["", *step_table(model, ids, a)]
    if not a.no_run:
        lines += ["", *run_table(model, a)]
    if a.memory:
        lines += ["", *memory_table(a)]
    write_report("\n".join(lines) + "\n", a.output, "Calibration cost")


if __name__ == "__main__":
    main()
