"""The package's layering and style: the import contracts and ruff hold, and the inference path stays light."""

import json
import shutil
import subprocess

import pytest
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig

from .helpers import REPO_ROOT, cycling_format_map, run_python


def test_import_contracts_hold():
    """`lint-imports` checks the one-way layers, acyclic packages and the light inference modules."""
    lint = shutil.which("lint-imports") or pytest.fail("import-linter is a test dependency: pip install -e '.[dev]'")
    proc = subprocess.run([lint, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_tree_passes_ruff(command):
    """ruff (pyproject.toml's settings: line length 120, pycodestyle, pyflakes, import order, bugbear, pyupgrade)."""
    ruff = shutil.which("ruff") or pytest.fail("ruff is a test dependency: pip install -e '.[dev]'")
    proc = subprocess.run([ruff, *command, "--no-cache", "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_loading_a_dmx_checkpoint_imports_no_calibration_machinery(tmp_path, tiny_llama_dir):
    config = DMXConfig(format_map=cycling_format_map(tiny_llama_dir))
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config).save_pretrained(tmp_path)
    # Baseline: what transformers itself imports to load a float model (its progress bars import tqdm).
    code = f"""
import json, sys
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({str(tiny_llama_dir)!r})
before = set(sys.modules)
import optimum_dmx
from optimum_dmx.nn import MXLinear
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
assert isinstance(model.model.layers[0].self_attn.q_proj, MXLinear)
print(json.dumps(sorted(set(sys.modules) - before)))
"""
    added = json.loads(run_python(code, env={"OPTIMUM_DMX_NO_AUTOREGISTER": "1"}).stdout.strip().splitlines()[-1])
    heavy = [
        m
        for m in added
        if m.split(".")[0] in ("datasets", "tqdm", "pyarrow")
        or m.startswith(("optimum_dmx.calibration.trainer", "optimum_dmx.calibration.baselines"))
    ]
    assert heavy == [], heavy
    assert "optimum_dmx.nn.mx_linear" in added  # the check above looked at the right import
