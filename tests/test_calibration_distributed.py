"""Data-parallel calibration: two real processes (torch.distributed, gloo) give the single-process result."""

import json
import subprocess
import sys

import pytest
import torch

from optimum_dmx.calibration import CalibrationSettings, calibrate

from .helpers import REPO_ROOT, tiny_llama

SCRIPT = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.helpers import tiny_llama
from optimum_dmx.calibration import CalibrationSettings, calibrate
from optimum_dmx.calibration.distributed import is_main_process
import torch.distributed as dist
torch.set_num_threads(1)
model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=3)
ids = torch.randint(0, model.config.vocab_size, (16, 16), generator=torch.Generator().manual_seed(0))
settings = CalibrationSettings(**json.loads({settings!r}))
result = calibrate(model, ids, settings, progress=False)
maps = [None] * dist.get_world_size()
dist.all_gather_object(maps, result.format_map)
if is_main_process():
    print(json.dumps({{"world": dist.get_world_size(), "format_map": result.format_map, "beta_hat": result.beta_hat,
                      "same_on_every_rank": all(m == result.format_map for m in maps),
                      "losses": [h["loss"] for h in result.history]}}))
"""


@pytest.mark.parametrize("method", ["dmx", pytest.param("paper", marks=pytest.mark.slow)])  # the same reduction
def test_two_processes_give_the_single_process_map(method, tmp_path):
    # The paper's method at a moderate learning rate: at large ones (50 here) its SGD path is chaotic, and the
    # last-bit differences of a split loss reduction grow into different offsets.
    settings = {"method": method, "target_bits": 5.5, "steps": 6, "batch_size": 4, "seq_len": 16, "num_samples": 16}
    if method == "paper":
        settings["paper"] = {"lr": 10.0}
    script = tmp_path / "calibrate.py"
    script.write_text(SCRIPT.format(root=str(REPO_ROOT), settings=json.dumps(settings)))
    launched = subprocess.run(
        # No restart: a worker that aborts at exit (a gloo group left to interpreter shutdown, SIGABRT after the
        # work has finished; `calibration.distributed` now destroys the group it created) must fail the test.
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    lines = [line for line in launched.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only the main process reports
    distributed = json.loads(lines[0])
    assert distributed["world"] == 2 and distributed["same_on_every_rank"]

    torch.set_num_threads(1)
    model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=3)
    ids = torch.randint(0, model.config.vocab_size, (16, 16), generator=torch.Generator().manual_seed(0))
    single = calibrate(model, ids, CalibrationSettings(**settings), progress=False)
    assert distributed["format_map"] == single.format_map
    assert len(set(single.format_map.values())) == 2  # a real map, not all one format
    assert distributed["beta_hat"] == pytest.approx(single.beta_hat, rel=1e-4, abs=1e-6)
    assert distributed["losses"] == pytest.approx([h["loss"] for h in single.history], rel=1e-5)
