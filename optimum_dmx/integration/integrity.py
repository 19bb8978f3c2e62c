"""The checkpoint's integrity record: a SHA-256 digest of every packed tensor and of the format map.

safetensors carries no checksum, and a flipped byte in `weight_packed`, a scale set to 0xFF (NaN) or a format
renamed in config.json (same tensor shapes) would load without a word and compute something else. `save_pretrained`
writes `dmx_checksums.json` beside the weights; loading verifies it before any weight is read into the model and
refuses a mismatch, naming the tensor. Hashing costs about 0.1 s per 100 MB. `OPTIMUM_DMX_SKIP_INTEGRITY_CHECK=1`
skips the check, for checkpoints edited on purpose; a checkpoint without a record (written before it existed) loads
with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..nn import MXLinear

CHECKSUMS_NAME = "dmx_checksums.json"
SKIP_VARIABLE = "OPTIMUM_DMX_SKIP_INTEGRITY_CHECK"
ALGORITHM = "sha256"

logger = logging.getLogger(__name__)


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def format_map_digest(format_map: Mapping[str, str]) -> str:
    """SHA-256 of the format map, independent of key order."""
    return hashlib.sha256(json.dumps(dict(format_map), sort_keys=True).encode()).hexdigest()


def integrity_record(model: nn.Module, format_map: Mapping[str, str]) -> dict:
    """The record of `model`'s packed tensors (`<module>.weight_packed`, `<module>.weight_scale`) and its map."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, MXLinear):
            for leaf in ("weight_packed", "weight_scale"):
                tensors[f"{name}.{leaf}"] = tensor_digest(getattr(module, leaf))
    return {"algorithm": ALGORITHM, "format_map": format_map_digest(format_map), "tensors": tensors}


def write_integrity_record(folder: str | os.PathLike, model: nn.Module, format_map: Mapping[str, str]) -> Path:
    path = Path(folder) / CHECKSUMS_NAME
    path.write_text(json.dumps(integrity_record(model, format_map), indent=1, sort_keys=True) + "\n")
    return path


def verify_integrity(
    record_path: Path | None,
    checkpoint_files: Sequence[str | os.PathLike],
    format_map: Mapping[str, str],
    module_name: Callable[[str], str] = str,
) -> None:
    """Raise `ValueError` naming the first tensor (or the map) that differs from the record at `record_path`; warn
    once when there is none. Does nothing with `OPTIMUM_DMX_SKIP_INTEGRITY_CHECK=1`.

    The record names tensors as the model does; `module_name` maps a checkpoint key to that name (transformers saves
    some models' keys under their original checkpoints' names, e.g. Mixtral's `block_sparse_moe` for `mlp`)."""
    if os.environ.get(SKIP_VARIABLE) == "1":
        return
    if record_path is None or not Path(record_path).is_file():
        logger.warning(
            "This dMX checkpoint has no %s (it was written before integrity records existed): its packed "
            "tensors are loaded unverified.",
            CHECKSUMS_NAME,
        )
        return
    try:
        record = json.loads(record_path.read_text())
        expected, map_digest = dict(record["tensors"]), record["format_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{record_path} is not a readable integrity record ({error}); set {SKIP_VARIABLE}=1 to load "
            "without checking"
        ) from None
    if format_map_digest(format_map) != map_digest:
        raise ValueError(
            f"config.json's format_map differs from the one the checkpoint was saved with ({CHECKSUMS_NAME}"
            f"): a format was changed after saving. Set {SKIP_VARIABLE}=1 to load it anyway."
        )
    for file in checkpoint_files:
        if not str(file).endswith(".safetensors"):
            continue
        with safe_open(file, framework="pt") as reader:
            for key in reader.keys():
                name = module_name(key)
                if name in expected and tensor_digest(reader.get_tensor(key)) != expected.pop(name):
                    raise ValueError(
                        f"tensor {key!r} in {Path(file).name} differs from the one saved ({CHECKSUMS_NAME}): the "
                        f"checkpoint is damaged. Set {SKIP_VARIABLE}=1 to load it anyway."
                    )
    if expected:
        raise ValueError(f"the checkpoint lacks {len(expected)} recorded tensors, e.g. {sorted(expected)[0]!r}")
