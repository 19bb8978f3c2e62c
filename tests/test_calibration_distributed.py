"""Data-parallel calibration: two real processes (torch.distributed, gloo) give the single-process result, with
every process holding the whole model or, sharded by FSDP2 (`fully_shard` on each decoder layer), half of it."""

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
from torch.distributed.tensor import DTensor
torch.set_num_threads(1)
model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=3)
if {sharded!r}:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
# the decoder layers' (FSDP2 leaves the root's own parameters, here lm_head's, gathered after a forward pass)
linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
ids = torch.randint(0, model.config.vocab_size, (16, 16), generator=torch.Generator().manual_seed(0))
settings = CalibrationSettings(**json.loads({settings!r}))
result = calibrate(model, ids, settings, progress=False)
maps = [None] * dist.get_world_size()
dist.all_gather_object(maps, result.format_map)
if is_main_process():
    print(json.dumps({{"world": dist.get_world_size(), "format_map": result.format_map, "beta_hat": result.beta_hat,
                      "same_on_every_rank": all(m == result.format_map for m in maps),
                      "kl": result.kl_sensitivities,
                      "sharded_after": [isinstance(m.weight, DTensor) for m in linears],
                      "local_rows": [m.weight.to_local().shape[0] if isinstance(m.weight, DTensor) else None
                                     for m in linears],
                      "losses": [h["loss"] for h in result.history]}}))
if {sharded!r}:
    dist.destroy_process_group()  # the group this script made (see the launch below)
"""


@pytest.mark.parametrize(
    "method, sharded",
    [
        ("dmx", False),
        ("dmx", True),
        pytest.param("paper", False, marks=pytest.mark.slow),  # the same reduction
        pytest.param("paper", True, marks=pytest.mark.slow),
    ],
)
def test_two_processes_give_the_single_process_map(method, sharded, tmp_path):
    # The paper's method at a moderate learning rate: at large ones (50 here) its SGD path is chaotic, and the
    # last-bit differences of a split loss reduction grow into different offsets.
    settings = {"method": method, "target_bits": 5.5, "steps": 6, "batch_size": 4, "seq_len": 16, "num_samples": 16}
    if method == "paper":
        settings["paper"] = {"lr": 10.0}
    script = tmp_path / "calibrate.py"
    script.write_text(SCRIPT.format(root=str(REPO_ROOT), settings=json.dumps(settings), sharded=sharded))
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
    if method == "dmx":
        assert distributed["kl"] == pytest.approx(single.kl_sensitivities, rel=1e-5)
    # Sharded: after the calibration each process still holds half of every decoder weight's rows.
    assert distributed["sharded_after"] == [sharded] * len(distributed["sharded_after"])
    if sharded:
        full_rows = [m.weight.shape[0] for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
        assert distributed["local_rows"] == [rows // 2 for rows in full_rows]
