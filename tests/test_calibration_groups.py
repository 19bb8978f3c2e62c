"""Offset groups: q/k/v and gate/up calibrated with one shared offset get one format, as serving engines need."""

import pytest
import torch

from optimum_dmx.calibration import (
    CalibrationSettings,
    PaperRecipe,
    calibrate,
)
from optimum_dmx.calibration.budget import BUDGET_TOLERANCE, budget_format_map
from optimum_dmx.calibration.groups import offset_groups
from optimum_dmx.continuous import FORMAT_PAIRS
from optimum_dmx.nn.groups import fused_projection_groups, mixed_groups

from .helpers import linear_names, tiny_llama


@pytest.fixture(scope="module")
def deep():
    model = tiny_llama(seed=0, initializer_range=0.2, num_hidden_layers=7)
    ids = torch.randint(0, model.config.vocab_size, (40, 16), generator=torch.Generator().manual_seed(0))
    return model, ids


def settings(**overrides):
    return CalibrationSettings(
        **{
            "target_bits": 5.5,
            "steps": 20,
            "batch_size": 2,
            "seq_len": 16,
            "num_samples": 40,
            "offset_groups": "fused",
            **overrides,
        }
    )


@pytest.mark.parametrize("method", ["dmx", "paper_budget", "paper_threshold", "kl"])
def test_every_method_gives_fused_projections_one_format(deep, method):
    model, ids = deep
    if method in ("dmx", "kl"):
        result = calibrate(model, ids, settings(method=method), progress=False)
    else:
        kind = method.split("_")[1]
        paper = PaperRecipe(discretization=kind, lr=200.0)
        result = calibrate(model, ids, settings(method="paper", paper=paper), progress=False)
    assert len(fused_projection_groups(result.format_map)) == 14  # 7 layers x (q/k/v, gate/up)
    assert mixed_groups(result.format_map) == []
    assert len(set(result.format_map.values())) == 2  # the budget is met with both formats, not by a corner
    if method != "paper_threshold":  # the paper's procedure averages per layer, the others by size
        achieved = result.bits_simple if method.startswith("paper") else result.bits_weighted
        assert abs(achieved - 5.5) <= BUDGET_TOLERANCE + 1e-9


def test_grouped_layers_share_one_learned_offset_in_the_papers_trainer(deep):
    model, ids = deep
    result = calibrate(model, ids, settings(method="paper", paper=PaperRecipe(lr=50.0)), progress=False)
    for group in fused_projection_groups(result.beta_hat):
        assert len({result.beta_hat[name] for name in group}) == 1
    assert len(set(result.beta_hat.values())) > 14  # the others keep their own


def test_budget_rule_moves_groups_whole_ranked_by_mean_priority():
    pair = FORMAT_PAIRS["mxfp8-mxfp4"]
    shapes = {name: (32, 32) for name in "abcdef"}
    priority = {"a": 5.0, "b": 0.0, "c": 0.0, "d": 4.0, "e": 3.0, "f": 1.0}
    # 6 layers at target 6 bits: three go high. The group (a, b, c) has mean priority 5/3 < d's and e's.
    chosen = budget_format_map(priority, shapes, pair, 6.0, groups=[("a", "b", "c")])
    assert [n for n, f in chosen.items() if f == pair.high.name] == ["d", "e", "f"]
    chosen = budget_format_map({**priority, "b": 9.0, "c": 9.0}, shapes, pair, 6.0, groups=[("a", "b", "c")])
    assert [n for n, f in chosen.items() if f == pair.high.name] == ["a", "b", "c"]


def test_explicit_groups_and_bad_settings():
    names = linear_names(tiny_llama(num_hidden_layers=1))
    assert offset_groups([[names[0], names[3]]], names) == [(names[0], names[3])]
    assert offset_groups("none", names) == []
    with pytest.raises(ValueError, match="not calibrated, e.g. \\['model.nope'\\]"):
        offset_groups([["model.nope", names[0]]], names)
    with pytest.raises(ValueError, match="offset_groups='qkv' is not supported; allowed: none, fused"):
        CalibrationSettings(offset_groups="qkv")
    with pytest.raises(ValueError, match="more than one group"):
        CalibrationSettings(offset_groups=[["a", "b"], ["b", "c"]])
