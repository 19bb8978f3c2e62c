"""DMXConfig validation, serialization and copying; registration with transformers."""

import copy
import importlib
import json

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    AutoQuantizationConfig,
)

import optimum_dmx
from optimum_dmx import DMXConfig
from optimum_dmx.calibration.settings import CalibrationSettings


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_defaults_come_from_calibration_settings_and_make_a_servable_model():
    config = DMXConfig()
    for name, value in vars(CalibrationSettings()).items():
        if name != "offset_groups":
            assert getattr(config, name) == value, name
    assert config.modules_to_not_convert == ["lm_head"]
    assert config.needs_calibration
    # a calibration by dMX or KL is servable by default; the paper's procedure and a given map change nothing
    for given, rotation, groups in [
        ({}, "auto", "fused"),
        ({"method": "kl"}, "auto", "fused"),
        ({"method": "paper"}, "none", "none"),
        ({"format_map": {"q": "mxfp4"}}, "none", "none"),
        ({"rotation": "none"}, "none", "fused"),
        ({"offset_groups": "none"}, "auto", "none"),
        ({"method": "paper", "rotation": "auto", "offset_groups": "fused"}, "auto", "fused"),
    ]:
        config = DMXConfig(**given)
        assert (config.rotation, config.offset_groups) == (rotation, groups), given


@pytest.mark.parametrize(
    ("pair", "bits"), [("mxfp8-mxfp4", 3.9), ("mxfp8-mxfp4", 8.5), ("mxfp6-mxfp4", 6.5), ("mxfp6-mxfp4", 3.0)]
)
def test_target_bits_outside_the_pairs_range_is_rejected(pair, bits):
    with pytest.raises(ValueError, match="target_bits"):
        DMXConfig(target_bits=bits, format_pair=pair)


@pytest.mark.parametrize(("pair", "bits"), [("mxfp8-mxfp4", 4.0), ("mxfp8-mxfp4", 8.0), ("mxfp6-mxfp4", 6.0)])
def test_target_bits_at_the_range_ends_is_accepted(pair, bits):
    assert DMXConfig(target_bits=bits, format_pair=pair).target_bits == bits


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("format_pair", "mxfp8-mxfp6", "'mxfp8-mxfp6'.*mxfp8-mxfp4, mxfp6-mxfp4"),
        ("method", "ste", "method='ste'.*'dmx', 'paper', 'kl'"),
        ("bit_average", "median", "bit_average='median'.*simple, weighted"),
        ("steps", 0, "steps=0"),
        ("batch_size", 4000, "batch_size=4000 is larger than num_samples=3200"),
    ],
)
def test_invalid_settings_are_rejected_naming_the_value_and_what_is_allowed(field, value, message):
    with pytest.raises(ValueError, match=message):
        DMXConfig(**{field: value})


def test_unknown_format_in_format_map_names_the_module_and_the_allowed_formats():
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj.*mxfp5.*mxfp4_e2m1"):
        DMXConfig(format_map={"model.layers.0.mlp.up_proj": "mxfp5"})


def test_format_map_aliases_are_stored_canonical():
    config = DMXConfig(format_map={"a": "mxfp4", "b": "mxfp8", "c": "mxfp6_e3m2"})
    assert config.format_map == {"a": "mxfp4_e2m1", "b": "mxfp8_e4m3", "c": "mxfp6_e3m2"}
    assert not config.needs_calibration


def _streaming_dataset():
    import datasets

    return datasets.IterableDataset.from_generator(lambda: ({"text": f"a b {i}"} for i in range(4)))


@pytest.mark.parametrize("make_dataset", [lambda: (t for t in ["a b", "b a"]), _streaming_dataset])
def test_deepcopy_shares_dataset_and_tokenizer(make_dataset):
    dataset, tokenizer = make_dataset(), _tokenizer()
    config = DMXConfig(target_bits=5.0, dataset=dataset, tokenizer=tokenizer)
    copied = copy.deepcopy(config)
    assert copied.dataset is dataset and copied.tokenizer is tokenizer
    assert copied.to_dict() == config.to_dict()
    copied.modules_to_not_convert.append("x")
    assert config.modules_to_not_convert == ["lm_head"]


def test_to_dict_never_holds_dataset_or_tokenizer():
    config = DMXConfig(dataset=["some calibration text"], tokenizer=_tokenizer())
    serialized = config.to_dict()
    assert "dataset" not in serialized and "tokenizer" not in serialized
    assert serialized["quant_method"] == "dmx"
    json.dumps(serialized)  # JSON-serializable
    assert "calibration text" not in repr(config)
    assert dict(config) == serialized


def test_from_dict_accepts_to_dict_output_and_refuses_unknown_keys():
    config = DMXConfig(
        target_bits=6.0, format_pair="mxfp6-mxfp4", format_map={"m": "mxfp6"}, achieved_bits={"bits_simple": 6.0}
    )
    assert DMXConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    assert AutoQuantizationConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    paper = DMXConfig(method="paper", paper={"lr": 20.0}, preset="cpu-bench")
    assert DMXConfig.from_dict(paper.to_dict()).to_dict() == paper.to_dict()
    with pytest.raises(TypeError, match=r"unknown fields \['a_future_key'\]"):
        DMXConfig.from_dict({**config.to_dict(), "a_future_key": {"x": 1}})


def test_with_result_records_the_map_without_runtime_inputs():
    config = DMXConfig(target_bits=5.5, dataset=["x"], tokenizer=_tokenizer(), steps=10)
    bits = {"bits_simple": 5.5, "bits_weighted": 5.2, "storage_bits": 5.45}
    result = config.with_result({"m": "mxfp8"}, achieved_bits=bits)
    assert result.dataset is None and result.tokenizer is None
    assert result.format_map == {"m": "mxfp8_e4m3"} and result.steps == 10 and result.target_bits == 5.5
    assert result.achieved_bits == bits


def test_importing_registers_dmx_idempotently():
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["dmx"] is DMXConfig
    assert AUTO_QUANTIZER_MAPPING["dmx"] is optimum_dmx.DMXHfQuantizer
    importlib.reload(optimum_dmx.integration.hf_quantizer)
    importlib.reload(optimum_dmx)
    # after a reload the registry holds the reloaded classes
    assert (
        AUTO_QUANTIZER_MAPPING["dmx"] is importlib.import_module("optimum_dmx.integration.hf_quantizer").DMXHfQuantizer
    )


def test_registration_refuses_to_override_another_package():
    from transformers.quantizers.base import HfQuantizer

    original = AUTO_QUANTIZER_MAPPING["dmx"]
    impostor = type("OtherQuantizer", (HfQuantizer,), {"__module__": "other_package"})
    AUTO_QUANTIZER_MAPPING["dmx"] = impostor
    try:
        with pytest.raises(ValueError, match="already registered by other_package.OtherQuantizer"):
            optimum_dmx.integration.hf_quantizer.register()
    finally:
        AUTO_QUANTIZER_MAPPING["dmx"] = original


def test_paper_hyper_parameters_belong_to_the_paper_method():
    with pytest.raises(ValueError, match="paper=.*sets the hyper-parameters of method='paper'; method='dmx'"):
        DMXConfig(paper={"lr": 3.0})
    with pytest.raises(TypeError, match="momentum"):
        DMXConfig(momentum=3.0)
    with pytest.raises(TypeError, match=r"unknown fields \['lr_typo'\]"):
        DMXConfig.from_dict({"lr_typo": 3.0})
    assert DMXConfig(method="paper", paper={"lr": 3.0}).paper.lr == 3.0


def test_a_preset_sets_the_sizes_and_explicit_fields_override_it():
    demo = DMXConfig(preset="cpu-demo")
    assert (demo.num_samples, demo.seq_len, demo.batch_size, demo.steps) == (160, 128, 4, 40)
    assert DMXConfig(preset="cpu-demo", steps=7).steps == 7
    assert DMXConfig(preset="gpu").gradient_checkpointing
    assert DMXConfig(method="paper", preset="cpu-bench").paper.lr == 20.0
    with pytest.raises(ValueError, match="preset='huge' is not a preset"):
        DMXConfig(preset="huge")
