import pytest

from optimum_dmx.calibration import PRESETS, CalibrationSettings, PaperRecipe, get_preset


def test_defaults_are_the_papers():
    s = CalibrationSettings()
    assert (s.method, s.target_bits, s.format_pair, s.batch_size, s.steps) == ("dmx", 5.0, "mxfp8-mxfp4", 8, 400)
    assert s.num_samples == 3200 and s.seq_len == 2048 and s.block_size == 32
    assert s.quantize_activations and s.modules_to_not_convert == ["lm_head"]
    assert CalibrationSettings().modules_to_not_convert is not s.modules_to_not_convert
    paper = s.paper
    assert (paper.lr, paper.regularizer, paper.reg_lambda, paper.discretization) == (1.0, "target", 5.0, "threshold")
    assert (paper.t_start, paper.t_end, paper.t_warmup_ratio) == (8.0, 400.0, 0.6)


def test_the_budget_is_weighted_by_size_but_the_papers_procedure_averages_per_layer():
    """A 5-bit model is the size of 5 bits per element; the paper's procedure keeps its own per-layer average."""
    assert CalibrationSettings().bit_average == "weighted"
    assert CalibrationSettings(method="kl").bit_average == "weighted"
    assert CalibrationSettings(method="paper").bit_average == "simple"
    assert CalibrationSettings(method="paper", bit_average="weighted").bit_average == "weighted"


def test_the_paper_preset_is_the_settings_default():
    preset = get_preset("paper")
    s = CalibrationSettings()
    assert (preset.num_samples, preset.seq_len, preset.batch_size, preset.steps) == (
        s.num_samples,
        s.seq_len,
        s.batch_size,
        s.steps,
    )
    assert get_preset("gpu").gradient_checkpointing and not preset.gradient_checkpointing
    with pytest.raises(ValueError, match="preset='fast' is not a preset; allowed: 'paper', 'gpu'"):
        get_preset("fast")
    for preset in PRESETS.values():
        CalibrationSettings(**preset.settings())  # every preset is valid settings


def test_discretization_follows_the_method():
    assert CalibrationSettings().discretization == "budget"
    assert CalibrationSettings(method="kl").discretization == "budget"
    assert CalibrationSettings(method="paper").discretization == "threshold"
    assert CalibrationSettings(method="paper", paper=PaperRecipe(discretization="budget")).discretization == "budget"


def test_to_dict_round_trips():
    s = CalibrationSettings(
        target_bits=5.5, format_pair="mxfp6-mxfp4", seed=3, method="paper", paper=PaperRecipe(lr=20.0)
    )
    assert CalibrationSettings(**s.to_dict()) == s
    assert PaperRecipe.from_dict(s.paper.to_dict()) == s.paper


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "ste"}, "method='ste' is not supported; allowed: 'dmx', 'paper', 'kl'"),
        ({"format_pair": "mxfp8-mxfp6"}, "mxfp8-mxfp6.*mxfp8-mxfp4, mxfp6-mxfp4"),
        ({"target_bits": 6.5, "format_pair": "mxfp6-mxfp4"}, "target_bits=6.5.*4.0 to 6.0"),
        ({"target_bits": 3.9}, "target_bits=3.9"),
        ({"steps": 0}, "steps=0"),
        ({"batch_size": 2.5}, "batch_size=2.5"),
        ({"seq_len": 1}, "seq_len=1"),
        ({"seed": -1}, "seed=-1 must be a non-negative integer"),
        ({"quantize_activations": "no"}, "quantize_activations='no' must be True or False"),
        ({"bit_average": "mean"}, "bit_average='mean'.*simple, weighted"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert='lm_head'"),
        ({"method": "kl", "learn_rotations": True}, "method='kl' trains nothing"),
        ({"paper": {"lr": 0.0}}, r"PaperRecipe.lr=0.0"),
        ({"paper": {"reg_lambda": -1.0}}, r"PaperRecipe.reg_lambda=-1.0"),
        ({"paper": {"regularizer": "l1"}}, r"PaperRecipe.regularizer='l1'.*target, simple"),
        ({"paper": {"t_start": 500.0}}, "t_start=500.0"),
        ({"paper": {"t_warmup_ratio": 1.5}}, r"PaperRecipe.t_warmup_ratio=1.5"),
        ({"paper": {"regularizer": "simple", "discretization": "budget"}}, "needs discretization='threshold'"),
    ],
)
def test_invalid_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CalibrationSettings(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_bits": "5"}, "target_bits='5' must be a number"),
        ({"paper": {"lr": "fast"}}, "PaperRecipe.lr='fast' must be a number"),
        ({"paper": {"momentum": 0.9}}, r"paper has unknown fields \['momentum'\]"),
        ({"paper": 3}, "paper=3 must be a PaperRecipe or a dict"),
    ],
)
def test_wrongly_typed_settings_name_the_field(kwargs, message):
    with pytest.raises(TypeError, match=message):
        CalibrationSettings(**kwargs)
