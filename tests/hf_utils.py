"""Helpers for the Hugging Face integration tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]


def linear_names(model: torch.nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in skip]


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (the repository importable); raise with its output if it fails."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TRANSFORMERS_VERBOSITY": "warning", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def last_json_line(proc: subprocess.CompletedProcess):
    return json.loads(proc.stdout.strip().splitlines()[-1])


FORMATS = ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3", "mxfp6_e3m2"]
INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 127, 0, 3, 42, 7, 11]])


def cycling_format_map(float_dir: Path) -> dict[str, str]:
    """Every quantizable linear, in formats cycling through all four."""
    config = AutoConfig.from_pretrained(float_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: FORMATS[i % len(FORMATS)] for i, name in enumerate(linear_names(model))}
