"""Image-text models calibrated on text: the language model is quantized, what no text token reaches stays float.

Calibration learns from the language-modelling loss on text, which never runs a vision encoder, its projector, or
Mllama's cross-attention layers. Those linears stay in float (a warning names them, `modules_to_not_convert` records
them), so an image still goes through the float model's vision path; the checkpoint reloads and exports like a text
model's. Tiny randomly initialised Llava and Qwen2-VL models, built here."""

import json
import logging
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, LlavaForConditionalGeneration

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.export import export_checkpoint
from optimum_dmx.export.loading import load_exported
from optimum_dmx.integration.model_classes import generating_model_class
from optimum_dmx.nn.replaceable import NOT_REACHED, linears_kept_in_float
from optimum_dmx.nn.surgery import subtree_prefixes

from .helpers import transformers_warnings, word_tokenizer, words

TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=200,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32)
IMAGE_TOKEN = 150
CONFIGS = {
    "llava": dict(
        text_config=dict(model_type="llama", **TEXT),
        vision_config=dict(model_type="clip_vision_model", patch_size=8, **VISION),
        image_token_index=IMAGE_TOKEN,
    ),
    "qwen2_vl": dict(
        text_config=dict(**TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_start_token_id=IMAGE_TOKEN + 2,
    ),
}
FLOAT_PARTS = {"llava": ["model.multi_modal_projector", "model.vision_tower"], "qwen2_vl": ["model.visual"]}
CALIBRATION = dict(steps=4, seq_len=16, batch_size=2, num_samples=8)
# a Llava prompt: one image (32 / 8 = 4 x 4 patches, one token each) and five words
PROMPT = torch.tensor([[1, *[IMAGE_TOKEN] * 16, 5, 6, 7, 8, 9]])


def _float_folder(family: str, folder):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(family, **CONFIGS[family])).eval()
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return model


def _config(**overrides) -> DMXConfig:
    texts = [words(7 * i, 40) for i in range(20)]
    return DMXConfig(target_bits=5, dataset=texts, tokenizer=word_tokenizer(), **CALIBRATION, **overrides)


def _linears(model: nn.Module, under: list[str]) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, MXLinear)) and any(name.startswith(prefix + ".") for prefix in under)
    }


@pytest.fixture(scope="module")
def float_llava(tmp_path_factory):
    """A float Llava and its folder."""
    folder = tmp_path_factory.mktemp("llava") / "float"
    return _float_folder("llava", folder), folder


@pytest.fixture(scope="module")
def llava(float_llava, tmp_path_factory):
    """The float Llava, and its dMX model calibrated on text with the defaults and saved, and that folder."""
    float_model, folder = float_llava
    model = AutoModelForImageTextToText.from_pretrained(folder, quantization_config=_config())
    saved = tmp_path_factory.mktemp("llava") / "dmx"
    model.save_pretrained(saved)
    return float_model, model, saved


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_calibration_on_text_keeps_what_no_token_reaches_in_float_and_says_so(tmp_path, caplog, family):
    float_model = _float_folder(family, tmp_path / "float")
    with caplog.at_level(logging.WARNING, logger="optimum_dmx.integration.hf_quantizer"):
        model = AutoModelForImageTextToText.from_pretrained(tmp_path / "float", quantization_config=_config())
    parts = FLOAT_PARTS[family]
    kept = _linears(model, parts)
    assert kept and all(type(module) is nn.Linear for module in kept.values())
    assert f"linear(s) that no calibration token reaches ({', '.join(parts)})" in caplog.text
    assert f"{len(kept)} linear(s) that no calibration token reaches" in caplog.text
    recorded = model.config.quantization_config
    assert set(parts) <= set(recorded.modules_to_not_convert)
    assert not set(kept) & set(recorded.format_map)
    language_linears = [n for n, m in model.named_modules() if isinstance(m, MXLinear)]
    assert sorted(language_linears) == sorted(recorded.format_map) and len(language_linears) == 2 * 7
    for name, module in kept.items():  # the float weights, untouched
        assert torch.equal(module.weight, float_model.get_submodule(name).weight), name
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "dmx")
    assert "model = AutoModelForImageTextToText.from_pretrained(" in (tmp_path / "dmx" / "README.md").read_text()
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "dmx")
    assert all(type(module) is nn.Linear for module in _linears(reloaded, parts).values())
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, logits)


def test_mllama_keeps_its_cross_attention_decoder_layer_float_whole(tmp_path, recwarn):
    """Mllama's text model skips its cross-attention decoder layers where there is no image: such a layer, its MLP
    included, stays float with the vision model, and GPTQ finds nothing it cannot round."""
    config = AutoConfig.for_model(
        "mllama",
        text_config=dict(**{k: v for k, v in TEXT.items() if k != "head_dim"}, cross_attention_layers=[1]),
        vision_config=dict(
            num_global_layers=1, patch_size=8, vision_output_dim=128, intermediate_layers_indices=[0], **VISION
        ),
    )
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path, quantization_config=_config())
    recorded = model.config.quantization_config
    float_parts = ["model.language_model.layers.1", "model.multi_modal_projector", "model.vision_model"]
    assert set(float_parts) <= set(recorded.modules_to_not_convert)
    assert sorted(recorded.format_map) == sorted(n for n, m in model.named_modules() if isinstance(m, MXLinear))
    assert all(name.startswith("model.language_model.layers.") for name in recorded.format_map)
    assert not any(name.startswith("model.language_model.layers.1.") for name in recorded.format_map)
    assert len(recorded.format_map) == 7  # the other decoder layer's
    assert not [w for w in recwarn if "GPTQ kept round-to-nearest" in str(w.message)]


def test_an_image_goes_through_the_float_vision_path_and_reloads_exactly(llava):
    float_model, model, folder = llava
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=pixels)
        reference = float_model.model.get_image_features(pixel_values=pixels)
        assert torch.equal(torch.cat(list(features.pooler_output)), torch.cat(list(reference.pooler_output)))
        logits = model(input_ids=PROMPT, pixel_values=pixels).logits
        reloaded = AutoModelForImageTextToText.from_pretrained(folder)
        assert torch.equal(reloaded(input_ids=PROMPT, pixel_values=pixels).logits, logits)


@pytest.mark.parametrize(
    "target, pair",
    [("compressed-tensors", "mxfp8-mxfp4"), pytest.param("quark", "mxfp6-mxfp4", marks=pytest.mark.slow)],  # 17 s
)
def test_an_image_text_checkpoint_exports_and_loads_with_its_vision_path_in_float(float_llava, tmp_path, target, pair):
    """The export quantizes the language model's linears, named one by one, not the vision encoder's or the
    projector's; transformers builds the model with `AutoModelForImageTextToText` and the loader library, and the
    logits of a prompt with an image equal those of this package's checkpoint, both in bfloat16 (calibrated with
    the target's block-scale rule, so that the loader computes exactly what this package does)."""
    _, folder = float_llava
    config = _config(format_pair=pair, scale_rule=target)
    model = AutoModelForImageTextToText.from_pretrained(folder, quantization_config=config)
    model.save_pretrained(tmp_path / "dmx")
    exported = export_checkpoint(tmp_path / "dmx", tmp_path / target, target)
    quantization = json.loads((exported / "config.json").read_text())["quantization_config"]
    if target == "compressed-tensors":
        targets = [name for group in quantization["config_groups"].values() for name in group["targets"]]
    else:
        targets = list(quantization["layer_quant_config"])
    assert sorted(targets) == sorted(model.config.quantization_config.format_map)
    assert "AutoModelForImageTextToText.from_pretrained" in (exported / "README.md").read_text()
    with transformers_warnings() as loading:
        loaded = load_exported(exported, dtype=torch.bfloat16)
    # the default rotation's transforms (compressed-tensors: matrices stored under the checkpoint's names,
    # `language_model.model.layers...`, checked against those applied, not reported as unexpected)
    assert ("transform_config" if target == "compressed-tensors" else "algo_config") in quantization
    assert not [message for message in loading if "LOAD REPORT" in message]
    ours = AutoModelForImageTextToText.from_pretrained(tmp_path / "dmx", dtype=torch.bfloat16)
    assert isinstance(loaded, LlavaForConditionalGeneration)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=PROMPT, pixel_values=pixels).logits, ours(input_ids=PROMPT, pixel_values=pixels).logits
        )


def test_a_given_map_quantizing_the_vision_encoder_keeps_round_to_nearest_there_under_gptq(float_llava):
    """A map that names linears no calibration token reaches is applied as given: GPTQ, which learns its rounding
    from calibration text, rounds the language model's linears and leaves those to nearest, with a warning."""
    model, folder = float_llava
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    format_map = {name: "mxfp8_e4m3" for name in names}
    with pytest.warns(RuntimeWarning, match=r"GPTQ kept round-to-nearest for 14 layer\(s\).*model.vision_tower"):
        quantized = AutoModelForImageTextToText.from_pretrained(
            folder, quantization_config=_config(format_map=format_map, weight_rounding="gptq")
        )
    assert sorted(quantized.config.quantization_config.format_map) == sorted(names)
    assert all(isinstance(quantized.get_submodule(name), MXLinear) for name in names)


def test_the_generating_model_class_of_a_configuration():
    image_text = [AutoConfig.for_model(family) for family in ("llava", "qwen2_vl", "idefics3")]
    assert {generating_model_class(config).__name__ for config in image_text} == {"AutoModelForImageTextToText"}
    # Gemma 3 has a causal-LM class; a text model and an encoder get AutoModelForCausalLM (its error names the rest)
    causal = [AutoConfig.for_model(family) for family in ("gemma3", "llama", "bert", "t5")]
    assert {generating_model_class(config).__name__ for config in causal} == {"AutoModelForCausalLM"}
    # a decoder with an audio encoder, which transformers lists among its sequence-to-sequence models
    assert generating_model_class(AutoConfig.for_model("qwen2_audio")).__name__ == "AutoModelForSeq2SeqLM"


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 8)

    def forward(self, x):
        return self.w1(x)


class _Layer(nn.Module):
    """A decoder layer with two experts, of which the tokens' route reaches the first only, and a cross-attention
    projection that runs only beside an image (as Mllama's layers' do)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(_Expert() for _ in range(2))
        self.cross_attn = nn.Linear(8, 8)

    def forward(self, x, image=None):
        x = self.experts[0](x)
        return x if image is None else x + self.cross_attn(image)


class _ImageTextModel(nn.Module):
    """A vision tower, two decoder layers, and a third that runs only beside an image (Mllama's cross-attention
    decoder layers are skipped on text)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.vision = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.layers = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_linears_no_token_reaches_are_found_but_an_unrouted_expert_of_a_reached_layer_is_not():
    model = _ImageTextModel()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = linears_kept_in_float(model, torch.tensor([[1, 2, 3]]), names)
    # `layers.0.experts.1.w1` is of the same kind as the routed `layers.0.experts.0.w1`: not reported; in the layer
    # that never runs, both experts are
    expected = [n for n in names if n.startswith(("vision.", "layers.2.")) or n.endswith("cross_attn")]
    assert found == dict.fromkeys(expected, NOT_REACHED)
    assert found.keys().isdisjoint(["layers.0.experts.1.w1", "layers.1.experts.1.w1"])
    assert subtree_prefixes(list(found), names) == ["layers.0.cross_attn", "layers.1.cross_attn", "layers.2", "vision"]


def test_subtree_prefixes_cover_the_found_names_and_no_other():
    names = ["a.b.x", "a.b.y", "a.c.x", "d.x", "e"]
    assert subtree_prefixes(["a.b.x", "a.b.y", "d.x"], names) == ["a.b", "d"]
    assert subtree_prefixes(["a.b.x"], names) == ["a.b.x"]
    assert subtree_prefixes(["e"], names) == ["e"]
    assert subtree_prefixes([], names) == []


@pytest.mark.parametrize("rotation", ["hadamard", "block_hadamard"])
def test_rotations_merged_into_the_residual_stream_are_refused_beside_a_float_vision_path(float_llava, rotation):
    """The projector writes image features into the residual stream: rotating the stream and not them would give
    another model on every image, and text alone would not show it."""
    _, folder = float_llava
    with pytest.raises(ValueError, match=rf"rotation='{rotation}' rotates the residual stream.*model.vision_tower"):
        AutoModelForImageTextToText.from_pretrained(folder, quantization_config=_config(rotation=rotation))


@pytest.mark.slow
def test_the_command_line_quantizes_exports_and_evaluates_an_image_text_model(float_llava, tmp_path):
    """`optimum-dmx quantize`, `export` and `eval` on a Llava folder, as real subprocesses: each builds the model with
    `AutoModelForImageTextToText` (`AutoModelForCausalLM` has no Llava class), and the export evaluates as the
    checkpoint does."""
    _, folder = float_llava
    text = tmp_path / "text.txt"
    text.write_text("\n".join(words(7 * i, 40) for i in range(200)))
    fast = ["--steps", "4", "--seq-len", "16", "--batch-size", "2", "--num-samples", "8"]

    def cli(*args) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "optimum_dmx", *map(str, args)], capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    log = cli("quantize", folder, "--dataset", text, "--output", tmp_path / "dmx", *fast)
    assert "linear(s) that no calibration token reaches (model.multi_modal_projector, model.vision_tower)" in log
    cli("export", tmp_path / "dmx", "--to", "compressed-tensors", "--output", tmp_path / "ct")
    perplexities = [
        float(re.search(r"perplexity (\S+)", cli("eval", model, "--text", text)).group(1))
        for model in (tmp_path / "dmx", tmp_path / "ct")
    ]
    assert perplexities[1] == pytest.approx(perplexities[0], rel=0.01)  # bfloat16 export, OCP-rule checkpoint
