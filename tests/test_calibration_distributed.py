"""Data-parallel calibration: two real processes (torch.distributed, gloo) give the single-process result, with
every process holding the whole model or, sharded by FSDP2 (`fully_shard` on each decoder layer), half of it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from optimum_dmx.calibration import CalibrationSettings, calibrate, kl_sensitivities
from optimum_dmx.nn import linear_modules_to_quantize
from optimum_dmx.nn.rotation import rotate_model

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
if {rotated!r}:  # before sharding: the online transform of down_proj replaces the module, which FSDP2 must see
    from optimum_dmx.nn import linear_modules_to_quantize
    from optimum_dmx.nn.rotation import rotate_model
    rotate_model(model, "hadamard", list(linear_modules_to_quantize(model, ["lm_head"])))
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
weights = [m.weight.full_tensor() if isinstance(m.weight, DTensor) else m.weight for m in linears]  # every process
refusal = None
if {sharded!r} and {rotated!r}:  # a rotation that would replace a sharded module: refused before it changes anything
    try:
        rotate_model(model, "hadamard", list(linear_modules_to_quantize(model, ["lm_head"])))
    except ValueError as error:
        refusal = str(error)
maps = [None] * dist.get_world_size()
dist.all_gather_object(maps, result.format_map)
if is_main_process():
    print(json.dumps({{"world": dist.get_world_size(), "format_map": result.format_map, "beta_hat": result.beta_hat,
                      "same_on_every_rank": all(m == result.format_map for m in maps),
                      "kl": result.kl_sensitivities,
                      "sharded_after": [isinstance(m.weight, DTensor) for m in linears],
                      "local_rows": [m.weight.to_local().shape[0] if isinstance(m.weight, DTensor) else None
                                     for m in linears],
                      "losses": [h["loss"] for h in result.history],
                      "weights": [w.tolist() for w in weights], "refusal": refusal}}))
if {sharded!r}:  # the group this script made (see the launch below), torn down by both processes together as in
    dist.barrier()  # examples/calibrate_sharded.py (a precaution: one rank once aborted, SIGABRT, in a loaded run)
    dist.destroy_process_group()
"""


def _run_in_two_processes(script) -> str:
    """Run `script` in two processes (`torch.distributed.run`); what they print, once both succeeded."""
    launched = subprocess.run(
        # No restart: a worker that aborts at exit (a gloo group left to interpreter shutdown, SIGABRT after the
        # work has finished; `calibration.distributed` now destroys the group it created) must fail the test.
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=script.parent,
        # A worker that aborts prints every thread's Python stack: a sharded worker has aborted, rarely and on loaded
        # machines only, with "terminate called without an active exception", and where it was is not known yet.
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert launched.returncode == 0, f"stdout: {launched.stdout[-2000:]}\nstderr: {launched.stderr[-12000:]}"
    return launched.stdout


def _launch(folder, settings: dict, sharded: bool, rotated: bool = False) -> dict:
    """Run `SCRIPT` in two processes; what the main one reports."""
    script = folder / f"calibrate-{sharded}-{rotated}.py"
    script.write_text(
        SCRIPT.format(root=str(REPO_ROOT), settings=json.dumps(settings), sharded=sharded, rotated=rotated)
    )
    lines = [line for line in _run_in_two_processes(script).splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only the main process reports
    reported = json.loads(lines[0])
    assert reported["world"] == 2 and reported["same_on_every_rank"]
    return reported


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
    distributed = _launch(tmp_path, settings, sharded=sharded)

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
    # The weights the processes end with: the single process's, learned rotations merged (into the shards) or not.
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    for weight, linear in zip(distributed["weights"], linears, strict=True):
        torch.testing.assert_close(torch.tensor(weight), linear.weight, rtol=1e-4, atol=1e-5)


def test_learned_rotations_on_shards_give_the_whole_model_result_and_are_merged_into_the_shards(tmp_path):
    # Compared with two processes holding the whole model, not with one process: the Cayley steps (up to 1.0 in
    # Frobenius norm) turn the last-bit differences of a split gradient (1e-7 in the second step's loss) into
    # different rotations through the MX rounding (0.3% in the third step's loss, measured), whereas sharding
    # changes no float operation of the data-parallel run.
    settings = {"target_bits": 5.5, "steps": 6, "batch_size": 4, "seq_len": 16, "num_samples": 16}
    settings["learn_rotations"] = True
    whole = _launch(tmp_path, settings, sharded=False, rotated=True)
    sharded = _launch(tmp_path, settings, sharded=True, rotated=True)
    assert sharded["format_map"] == whole["format_map"] and len(set(whole["format_map"].values())) == 2
    assert sharded["losses"] == pytest.approx(whole["losses"], rel=1e-6)
    assert sharded["sharded_after"] == [True] * len(sharded["sharded_after"])
    assert "'model.layers.0.mlp.down_proj'" in sharded["refusal"] and "before fully_shard" in sharded["refusal"]
    float_model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=3)
    rotate_model(float_model, "hadamard", list(linear_modules_to_quantize(float_model, ["lm_head"])))
    linears = [m for m in float_model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    for merged, whole_weight, linear in zip(sharded["weights"], whole["weights"], linears, strict=True):
        merged = torch.tensor(merged)
        torch.testing.assert_close(merged, torch.tensor(whole_weight), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(merged, linear.weight, atol=1e-4)  # the learned rotations are in the shards


SCAN_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.helpers import tiny_llama
from optimum_dmx.calibration import CalibrationSettings, kl_sensitivities
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=3)
if {sharded!r}:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
passes = []
model.model.norm.register_forward_pre_hook(lambda module, args: passes.append(1))
ids = torch.randint(0, model.config.vocab_size, ({sequences}, 16), generator=torch.Generator().manual_seed(0))
kl = kl_sensitivities(model, ids, CalibrationSettings(batch_size=4, offset_groups={groups!r}), progress=False)
reports = [None] * dist.get_world_size()
dist.all_gather_object(reports, {{"kl": kl, "passes": len(passes)}})
if dist.get_rank() == 0:
    print(json.dumps(reports))
dist.barrier()  # as SCRIPT's ranks do before destroying their group (a precaution: see SCRIPT)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("sharded, groups", [(False, "none"), (True, "none"), (True, "fused")])
def test_two_processes_deal_out_the_scans_layers_when_they_cannot_share_its_sequences(sharded, groups, tmp_path):
    # 3 sequences: two processes cannot take equal shares of them, so each scans every sequence for half of each
    # decoder layer's units: one round per decoder layer of up to 2 x 4 units (7 linears: 4 and 3 in each process's
    # pass; the 4 units of fused groups, q/k/v, o_proj, gate/up, down_proj: 2 and 2), where one process scans them
    # in 2 passes of 4 units (4 and 3) or 1 (fused).
    script = tmp_path / "scan.py"
    script.write_text(SCAN_SCRIPT.format(root=str(REPO_ROOT), sharded=sharded, sequences=3, groups=groups))
    reports = json.loads(next(line for line in _run_in_two_processes(script).splitlines() if line.startswith("[")))

    torch.set_num_threads(1)
    model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=3)
    single_passes = []
    model.model.norm.register_forward_pre_hook(lambda module, args: single_passes.append(1))
    ids = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    single = kl_sensitivities(model, ids, CalibrationSettings(batch_size=4, offset_groups=groups), progress=False)
    units = 7 if groups == "none" else 4
    assert len(single_passes) == 1 + 3 * -(-units // 4)  # the reference pass and each decoder layer's passes
    for report in reports:
        assert report["kl"] == pytest.approx(single, rel=1e-6)
        assert report["passes"] == 1 + 3  # the reference pass and the round of each decoder layer
