import pytest

from optimum_dmx.calibration import CalibrationSettings


def test_defaults_are_the_papers():
    s = CalibrationSettings()
    assert (s.target_bits, s.format_pair, s.batch_size, s.steps, s.lr) == (5.0, "mxfp8-mxfp4", 8, 400, 1.0)
    assert (s.regularizer, s.reg_lambda, s.bit_average) == ("target", 5.0, "simple")
    assert (s.t_start, s.t_end, s.t_warmup_ratio, s.block_size) == (8.0, 400.0, 0.6, 32)
    assert s.num_samples == 3200 and s.quantize_activations and s.modules_to_not_convert == ["lm_head"]
    assert CalibrationSettings().modules_to_not_convert is not s.modules_to_not_convert


def test_to_dict_round_trips():
    s = CalibrationSettings(target_bits=5.5, format_pair="mxfp6-mxfp4", seed=3)
    assert CalibrationSettings(**s.to_dict()) == s


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"format_pair": "mxfp8-mxfp6"}, "mxfp8-mxfp6.*mxfp8-mxfp4, mxfp6-mxfp4"),
        ({"target_bits": 6.5, "format_pair": "mxfp6-mxfp4"}, "target_bits=6.5.*4.0 to 6.0"),
        ({"target_bits": 3.9}, "target_bits=3.9"),
        ({"steps": 0}, "steps=0"),
        ({"batch_size": 2.5}, "batch_size=2.5"),
        ({"seq_len": 1}, "seq_len=1"),
        ({"lr": 0.0}, "lr=0.0"),
        ({"reg_lambda": -1.0}, "reg_lambda=-1.0"),
        ({"regularizer": "l1"}, "regularizer='l1'.*target, simple"),
        ({"bit_average": "mean"}, "bit_average='mean'.*simple, weighted"),
        ({"t_start": 500.0}, "t_start=500.0"),
        ({"t_warmup_ratio": 1.5}, "t_warmup_ratio=1.5"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert='lm_head'"),
        ({"offset_probe": "middle"}, "offset_probe='middle'.*low, path, swap"),
        ({"loss": "mse"}, "loss='mse'.*cross_entropy, distillation"),
    ],
)
def test_invalid_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CalibrationSettings(**kwargs)
