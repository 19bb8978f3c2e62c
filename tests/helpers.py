"""Test helpers, in one place: tiny real models and tokenizers built in-process, tensors on the edges the MX
specification defines, and running code in a fresh interpreter. Fixtures live in conftest.py."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from optimum_dmx.formats import packing

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- tiny models, tokenizers and texts ------------------------------------------------------------------


def tiny_llama(
    seed: int = 0,
    initializer_range: float = 0.02,
    dtype: torch.dtype = torch.float32,
    num_hidden_layers: int = 2,
    vocab_size: int = 128,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with 7 decoder linears per layer (hidden 64; vocab 128 and 2 layers by
    default)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        initializer_range=initializer_range,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_decoder(kind: str, tied: bool, dtype: torch.dtype = torch.float32, **config: Any) -> torch.nn.Module:
    """A randomly initialised Llama, Qwen2 (biased q/k/v), Qwen3 or Gemma 3 (`kind`), hidden 96, head 32, 2 layers,
    its norms' scales moved away from the identity and its biases from 0; `config` overrides the configuration."""
    common = (
        dict(
            vocab_size=256,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=tied,
        )
        | config
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=8))
    with torch.no_grad():  # norms away from their initial identity, biases from 0, so that rotating them is tested
        for name, parameter in model.named_parameters():
            if "norm" in name or "bias" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.to(dtype).eval()


def sensitive_llama_and_data(num_samples: int = 16, seq_len: int = 32):
    """A tiny Llama with large weights and its own greedy continuations as data.

    The float model predicts this data well and quantization hurts it, so the task loss prefers more bits.
    """
    model = tiny_llama(seed=0, initializer_range=0.2)
    start = torch.randint(0, model.config.vocab_size, (num_samples, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids = model.generate(
            start, max_new_tokens=seq_len - 1, min_new_tokens=seq_len - 1, do_sample=False, pad_token_id=0
        )
    return model, ids


def word_tokenizer(num_words: int = 120, bos: bool = False) -> PreTrainedTokenizerFast:
    """A whitespace word tokenizer over the words `w0 .. w{num_words-1}`: one token per word.

    With `bos`, it starts every text with `<s>` (id `num_words + 1`), as Llama 3 and Gemma tokenizers do.
    """
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(num_words)}}
    if bos:
        vocab["<s>"] = num_words + 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", num_words + 1)]
        )
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def words(start: int, count: int, num_words: int = 120) -> str:
    """`count` consecutive words of the `word_tokenizer` vocabulary, cycling, as one line."""
    return " ".join(f"w{(start + i) % num_words}" for i in range(count))


# --- Hugging Face checkpoints and fresh interpreters ------------------------------------------------------


def linear_names(model: torch.nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in skip]


def held_out(texts, name: str) -> str:
    """Held-out text `name` of the benchmark texts (`benchmarks/common.py`) from 10% in, as the benchmarks read it."""
    text = texts.evaluation[name].read_text()
    return text[len(text) // 10 :]


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (the repository importable); raise with its output if it fails.

    The interpreter runs torch on one thread, like the tests (conftest's `single_thread`): the float reduction
    order, and so the last bit of a matmul, depends on the thread count, and tests compare results exactly."""
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "TRANSFORMERS_VERBOSITY": "warning",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def installed_script(name: str) -> str | None:
    """The path of the console script `name` that this interpreter's environment installed (its scripts folder), or
    None: a script of the same name earlier on `PATH` (another environment's, a version manager's shim) is not the
    one under test."""
    return shutil.which(name, path=sysconfig.get_path("scripts"))


def last_json_line(proc: subprocess.CompletedProcess):
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compiling_then_loading(script: str, inductor_dir: Path, env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """`script`'s last JSON line from two fresh processes sharing the empty inductor folder `inductor_dir` (kernels
    stored in its default place): the first compiles and stores its kernels; in the second tracing raises
    (`formats.compilation._compile`), so every kernel it runs must be one the first stored."""
    no_tracing = textwrap.dedent("""
        import os
        from optimum_dmx.formats import compilation
        if os.environ["MODE"] == "load":
            def no_tracing(*args):
                raise AssertionError("traced")
            compilation._compile = no_tracing
    """)
    # the default folder (the suite turns storing off: conftest)
    shared = {"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "OPTIMUM_DMX_COMPILE": "1", "OPTIMUM_DMX_KERNEL_CACHE": ""}
    return tuple(
        last_json_line(run_python(no_tracing + script, env={**shared, **(env or {}), "MODE": mode}))
        for mode in ("compile", "load")
    )


FORMATS = ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3", "mxfp6_e3m2"]
INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 127, 0, 3, 42, 7, 11]])


def cycling_format_map(float_dir: Path) -> dict[str, str]:
    """Every quantizable linear, in formats cycling through all four."""
    config = AutoConfig.from_pretrained(float_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: FORMATS[i % len(FORMATS)] for i, name in enumerate(linear_names(model))}


# --- tensors for the format tests --------------------------------------------------------------------------


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, message: str = "") -> None:
    """Equal bit patterns: distinguishes -0.0 from 0.0 and compares NaNs as equal only if both are NaN. ``message``
    says which case failed."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, message
    int_dtype = {4: torch.int32, 2: torch.int16}[actual.element_size()]
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    mismatch = (actual.view(int_dtype) != expected.view(int_dtype)) & ~both_nan
    assert not mismatch.any(), (
        f"{message}: {int(mismatch.sum())} mismatches, first at {mismatch.nonzero()[0].tolist()}: "
        f"{actual[mismatch][:4].tolist()} vs {expected[mismatch][:4].tolist()}"
    )


def wide_range(shape, seed: int, dtype=torch.float32, decades: float = 8.0) -> torch.Tensor:
    """Gaussian values times a per-block log-uniform magnitude spanning about 10^+-decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    magnitude = torch.exp((torch.rand(*shape[:-1], shape[-1] // 32, 1, generator=g) * 2 - 1) * decades * math.log(10))
    return (x.reshape(*shape[:-1], -1, 32) * magnitude).reshape(shape).to(dtype)


def awkward_tensor(rows: int = 24, cols: int = 128) -> torch.Tensor:
    """Values across float32's range (tiny, subnormal, huge), a NaN, an Inf and a zero row."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=generator)
    x = x * torch.exp2(torch.randint(-140, 127, (rows, 1), generator=generator).float())
    x[0, 3], x[1, 5], x[3, 7] = float("nan"), float("inf"), 3e38
    x[2] = 0.0
    x[4, 1:9] = 1e-42
    return x


def adversarial_blocks(fmt) -> torch.Tensor:
    """Rows of 32 values that sit on the edges the specification defines."""
    mn, step = fmt.max_normal, 2.0 ** (fmt.emax - fmt.mbits)  # step of the top binade (scale 1)
    top = 2.0**fmt.emax
    grid = packing.code_values(fmt)[1 : 2 ** (fmt.bits - 1) - (fmt.name == "mxfp8_e4m3")]
    ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints between neighbouring grid values
    rows = [
        # block max exactly 2^emax (scale 1): ties between all neighbouring grid values, both signs
        torch.cat([ties, -ties, torch.tensor([top])]),
        # at, just below and just past max normal (these saturate), and past the top binade
        torch.tensor(
            [mn, mn - step / 4, mn + step / 4, mn + step / 2, (mn + top * 2) / 2, top * 1.999, -mn, -top * 1.999]
        ),
        # subnormal-range elements next to a block max of 2^emax
        torch.tensor([top, *(fmt.min_subnormal * torch.tensor([0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 3.5])).tolist()]),
        # one block spanning 2^-120 .. 2^100
        torch.tensor([2.0**100, -(2.0**-120), 2.0**-60, 1.0, -(2.0**99) * 1.5, 2.0**-126, 3.0 * 2.0**97]),
        # the top of the float32 range
        torch.tensor([3.3e38, -3.0e38, 1.0e38, 2.0**127]),  # finite in bfloat16 too
        torch.zeros(32),
        -torch.zeros(32),
    ]
    return torch.stack([torch.nn.functional.pad(r, (0, 32 * math.ceil(len(r) / 32) - len(r)))[:32] for r in rows])


def file_bytes(folder: Path) -> dict[str, bytes]:
    """Every file directly in `folder`, by name: what a test compares to show nothing in it was written."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


@contextmanager
def transformers_warnings() -> Iterator[list[str]]:
    """The messages transformers' loggers emit at warning level while the block runs (its load report among them)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    hf_logging.get_logger().addHandler(handler)
    try:
        yield messages
    finally:
        hf_logging.get_logger().removeHandler(handler)


@contextmanager
def transforms_kept_online(signs: bool = False) -> Iterator[None]:
    """Rotations inside the block apply every online transform online, as earlier versions did: `o_proj`'s too
    (not merged into `v_proj`'s rows), and with `signs` each transform's random signs in the transform (not moved
    into the module producing its input): how a test makes the checkpoints those versions wrote, or compares the
    bits of a moved sign with one kept online."""
    import pytest

    from optimum_dmx.nn import rotation

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rotation, "whole_transform_carriers", lambda model, carriers, block_size: {})
        if signs:
            patch.setattr(rotation, "_carry_signs", lambda model, carrier, transform: transform)
        yield
