"""Checkpoints written by optimum-dmx 0.1.0.dev0 still load.

The fixtures are the `quantization_config` that release wrote into config.json for the tiny Llama of
`helpers.tiny_llama(seed=0)`, rotated by `online_block_hadamard` and calibrated on `words(7 i, 40)` lines: once with
its default recipe (a mixed map), once with `recipe="paper", lr=20`. Their top-level `recipe`, `lr`, `bits_*` and
the default recipe's internal settings are read into this version's fields."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig, MXLinear

from .helpers import INPUT_IDS, tiny_llama

FIXTURES = Path(__file__).parent / "fixtures"


def legacy(name: str) -> dict:
    return json.loads((FIXTURES / f"quantization_config_0.1.0.dev0_{name}.json").read_text())


def test_legacy_keys_are_read_into_the_current_fields():
    old = legacy("dmx")
    config = DMXConfig.from_dict(old)
    assert config.method == "dmx" and config.rotation == "online_block_hadamard"
    assert config.achieved_bits == {k: old[k] for k in ("bits_simple", "bits_weighted", "storage_bits")}
    assert config.format_map == old["format_map"] and config.input_transforms == old["input_transforms"]
    assert (config.steps, config.seq_len, config.batch_size, config.num_samples) == (4, 16, 2, 8)
    paper = DMXConfig.from_dict(legacy("paper"))
    assert paper.method == "paper" and paper.paper.lr == 20.0 and paper.paper.discretization == "threshold"
    recorded = paper.to_dict()
    assert recorded["paper"]["lr"] == 20.0 and "lr" not in recorded and "recipe" not in recorded
    assert DMXConfig.from_dict(recorded).to_dict() == recorded  # the new record reads back as itself


def test_a_legacy_block_size_other_than_32_is_refused_by_name():
    with pytest.raises(ValueError, match="block_size=16"):
        DMXConfig.from_dict({**legacy("dmx"), "block_size": 16})


def test_a_legacy_checkpoint_loads_and_computes_what_this_version_computes(tmp_path):
    old = legacy("dmx")
    tiny_llama(seed=0).save_pretrained(tmp_path / "float")
    config = DMXConfig(format_map=old["format_map"], rotation=old["rotation"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    # This version gives q/k/v and gate/up one online transform each (0.1.0.dev0 drew one per linear): the same
    # modules and blocks, other seeds. The checkpoint is described with this version's transforms (which its
    # weights hold) and every other key as 0.1.0.dev0 wrote it.
    transforms = model.config.quantization_config.input_transforms
    assert {name: spec["block_size"] for name, spec in transforms.items()} == {
        name: spec["block_size"] for name, spec in old["input_transforms"].items()
    }
    old = {**old, "input_transforms": transforms}
    model.save_pretrained(tmp_path / "dmx")
    saved = json.loads((tmp_path / "dmx" / "config.json").read_text())
    saved["quantization_config"] = old  # the checkpoint as 0.1.0.dev0 described it (but for the transforms)
    (tmp_path / "dmx" / "config.json").write_text(json.dumps(saved))

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")
    formats = {n: m.fmt.name for n, m in reloaded.named_modules() if isinstance(m, MXLinear)}
    assert formats == old["format_map"]
    with torch.no_grad():
        assert torch.equal(reloaded(INPUT_IDS).logits, model(INPUT_IDS).logits)
