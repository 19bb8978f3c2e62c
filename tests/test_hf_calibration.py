"""Calibrating while loading: from_pretrained(float, quantization_config=DMXConfig(dataset=..., tokenizer=...))."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from optimum_dmx import DMXConfig, DMXQuantizer, MXLinear

from .helpers import INPUT_IDS, cycling_format_map, file_bytes

CALIBRATION = {"num_samples": 8, "seq_len": 16, "batch_size": 4, "steps": 3, "seed": 3}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def _texts(n: int = 40) -> list[str]:
    rng = random.Random(0)
    return [" ".join(f"w{rng.randrange(1, 128)}" for _ in range(20)) for _ in range(n)]


def test_from_pretrained_calibrates_and_records_the_result(tmp_path, tiny_llama_dir, tokenizer):
    # from_pretrained deep-copies its arguments: the config must share the dataset (a generator cannot be copied)
    config = DMXConfig(target_bits=5.0, dataset=(text for text in _texts()), tokenizer=tokenizer, **CALIBRATION)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)

    expected_modules = set(cycling_format_map(tiny_llama_dir))
    formats = {n: m.fmt.name for n, m in model.named_modules() if isinstance(m, MXLinear)}
    assert set(formats) == expected_modules
    assert set(formats.values()) <= {"mxfp4_e2m1", "mxfp8_e4m3"}  # the pair's two endpoints

    recorded = model.config.quantization_config
    assert recorded.format_map == formats
    assert recorded.dataset is None and recorded.tokenizer is None
    bits = {n: 8 if f == "mxfp8_e4m3" else 4 for n, f in formats.items()}
    shapes = {n: model.get_submodule(n).weight_shape for n in formats}
    numel = {n: shapes[n][0] * shapes[n][1] for n in formats}
    achieved = recorded.achieved_bits
    assert achieved["bits_simple"] == pytest.approx(sum(bits.values()) / len(bits))
    sizes = {n: numel[n] + shapes[n][1] for n in formats}  # weight elements + the activation's in_features
    assert achieved["bits_weighted"] == pytest.approx(sum(bits[n] * sizes[n] for n in formats) / sum(sizes.values()))
    # storage: the codes plus one 8-bit scale per 32 weights (every in_features here is a multiple of 32)
    assert achieved["storage_bits"] == pytest.approx(
        sum(numel[n] * (bits[n] + 8 / 32) for n in formats) / sum(numel.values())
    )

    model.save_pretrained(tmp_path / "dmx")
    saved = json.loads((tmp_path / "dmx" / "config.json").read_text())["quantization_config"]
    for key, value in {**CALIBRATION, "target_bits": 5.0, "format_pair": "mxfp8-mxfp4", "format_map": formats}.items():
        assert saved[key] == value, key
    assert saved["achieved_bits"] == achieved and saved["method"] == "dmx" and saved["preset"] == "paper"
    assert "paper" not in saved and "gradient_checkpointing" not in saved  # nothing the map does not depend on
    # by default servable: the rotation `"auto"` resolved to online transforms on every quantized linear (recorded,
    # rebuilt on load), and q/k/v and gate/up of a layer in one format
    assert saved["rotation"] == "online_block_hadamard" and set(saved["input_transforms"]) == set(formats)
    assert saved["offset_groups"] == "fused"
    for layer in {name.rsplit(".", 2)[0] for name in formats}:
        assert (
            formats[f"{layer}.self_attn.q_proj"]
            == formats[f"{layer}.self_attn.k_proj"]
            == formats[f"{layer}.self_attn.v_proj"]
        )
        assert formats[f"{layer}.mlp.gate_proj"] == formats[f"{layer}.mlp.up_proj"]

    # the reload has no dataset: it can only succeed without calibrating
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        assert torch.equal(reloaded(INPUT_IDS).logits, model(INPUT_IDS).logits)


def test_dmx_quantizer_calibrates_with_the_given_tokenizer(tiny_qwen3_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    config = DMXConfig(target_bits=5.0, format_pair="mxfp6-mxfp4", dataset=_texts(), **CALIBRATION)
    DMXQuantizer(config).quantize_model(model, tokenizer)
    formats = model.config.quantization_config.format_map
    assert set(formats) == set(cycling_format_map(tiny_qwen3_dir))
    assert set(formats.values()) <= {"mxfp4_e2m1", "mxfp6_e2m3"}
    assert all(isinstance(model.get_submodule(name), MXLinear) for name in formats)


def _calibrating_config(tokenizer) -> DMXConfig:
    return DMXConfig(target_bits=5.0, dataset=_texts(), tokenizer=tokenizer, **CALIBRATION)


def test_device_map_auto_calibrates_like_a_plain_load(tiny_llama_dir, tokenizer):
    # On this CPU-only machine accelerate places every module on the CPU: what is tested is that a dispatched
    # load calibrates and ends with the same map and logits as a plain one (several devices are not available)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=_calibrating_config(tokenizer))
    dispatched = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=_calibrating_config(tokenizer), device_map="auto"
    )
    assert dispatched.config.quantization_config.format_map == plain.config.quantization_config.format_map
    with torch.no_grad():
        assert torch.equal(dispatched(INPUT_IDS).logits, plain(INPUT_IDS).logits)


def _offloaded_load(folder, offload_folder, **kwargs):
    """`from_pretrained` with the decoder layers' weights offloaded to disk by accelerate (too little CPU memory)."""
    return AutoModelForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": "20KB"}, offload_folder=str(offload_folder), **kwargs
    )


def test_an_offloaded_float_model_quantizes_like_a_plain_load(tmp_path, tiny_llama_dir, tokenizer):
    # Calibration, GPTQ and packing read each offloaded weight when they need it (loaded by accelerate's hook).
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=_calibrating_config(tokenizer))
    float_model = _offloaded_load(tiny_llama_dir, tmp_path / "float-offload")
    assert any(p.is_meta for p in float_model.parameters())  # the load this test means: weights on disk
    offloaded = _offloaded_load(
        tiny_llama_dir, tmp_path / "offload", quantization_config=_calibrating_config(tokenizer)
    )
    assert offloaded.config.quantization_config.weight_rounding == "gptq"
    # the default rotation resolves alike with the norms' weights on disk (their accelerate hooks left out of it)
    assert offloaded.config.quantization_config.rotation == "online_block_hadamard"
    assert offloaded.config.quantization_config.format_map == plain.config.quantization_config.format_map
    with torch.no_grad():
        expected = plain(INPUT_IDS).logits
        assert torch.equal(offloaded(INPUT_IDS).logits, expected)
    offloaded.save_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")(INPUT_IDS).logits, expected)


def test_an_offloaded_float_model_rotated_and_learning_its_rotations_quantizes_like_a_plain_load(
    tmp_path, tiny_llama_dir, tokenizer
):
    # The rotation and the learned rotations write every rotated weight into the offload folder (never into the
    # checkpoint); GPTQ and packing then read them from there.
    def config():
        return DMXConfig(
            target_bits=5.0,
            dataset=_texts(),
            tokenizer=tokenizer,
            rotation="hadamard",
            learn_rotations=True,
            gradient_checkpointing=True,
            **CALIBRATION,
        )

    checkpoint = file_bytes(tiny_llama_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config())
    offloaded = _offloaded_load(tiny_llama_dir, tmp_path / "offload", quantization_config=config())
    assert any(p.is_meta for p in offloaded.parameters())  # the embeddings and norms are still on disk
    assert offloaded.config.quantization_config.format_map == plain.config.quantization_config.format_map
    assert offloaded.config.quantization_config.input_transforms == plain.config.quantization_config.input_transforms
    with torch.no_grad():
        expected = plain(INPUT_IDS).logits
        torch.testing.assert_close(offloaded(INPUT_IDS).logits, expected, rtol=0, atol=1e-5)
    assert file_bytes(tiny_llama_dir) == checkpoint
    offloaded.save_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")(INPUT_IDS).logits
        torch.testing.assert_close(reloaded, expected, rtol=0, atol=1e-5)


def test_a_saved_checkpoint_loads_with_offloaded_weights(tmp_path, tiny_llama_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=_calibrating_config(tokenizer))
    model.save_pretrained(tmp_path / "dmx")
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "dmx", device_map="auto", max_memory={"cpu": "60KB"}, offload_folder=str(tmp_path / "offload")
    )
    assert "disk" in offloaded.hf_device_map.values()
    with torch.no_grad():
        assert torch.equal(offloaded(INPUT_IDS).logits, model(INPUT_IDS).logits)


def test_a_model_without_nn_linear_layers_is_refused_before_its_weights_load(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128)).save_pretrained(tmp_path)
    config = DMXConfig(target_bits=5.0, dataset=_texts(), tokenizer=tokenizer, **CALIBRATION)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no nn.Linear layer to quantize .*\['Conv1D'\]") as err:
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    assert "_process_model_before_weight_loading" in [entry.name for entry in err.traceback]
