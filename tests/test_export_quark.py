"""Export to AMD Quark, read back by transformers + amd-quark's own code (no mocks)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig
from optimum_dmx.export import ExportError, export_checkpoint
from optimum_dmx.formats import quantize_mx

from .helpers import INPUT_IDS

LAYER = "model.layers.{}.{}"
# MXFP4 and both MXFP6 formats, fused groups (q/k/v, gate/up) sharing one format.
FORMAT_MAP = {
    **{LAYER.format(0, p): "mxfp4_e2m1" for p in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]},
    LAYER.format(0, "self_attn.o_proj"): "mxfp6_e3m2",
    **{LAYER.format(0, p): "mxfp6_e2m3" for p in ["mlp.gate_proj", "mlp.up_proj"]},
    LAYER.format(0, "mlp.down_proj"): "mxfp4_e2m1",
    **{LAYER.format(1, p): "mxfp6_e2m3" for p in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]},
    LAYER.format(1, "mlp.down_proj"): "mxfp6_e3m2",
}


def save_dmx(float_dir, out, format_map, scale_rule="quark"):
    config = DMXConfig(format_map=format_map, scale_rule=scale_rule)
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def exported(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quark")
    source = save_dmx(tiny_llama_dir, root / "dmx", FORMAT_MAP)
    return source, export_checkpoint(source, root / "quark", "quark")


def test_weights_activations_and_logits_match_under_quarks_scale_rule(exported):
    source, out = exported
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for name, fmt in FORMAT_MAP.items():
        theirs, mine = loaded.get_submodule(name), ours.get_submodule(name)
        assert type(theirs).__name__ == "QParamsLinear"
        assert torch.equal(
            theirs.weight_quantizer(theirs.weight.data).bfloat16(), mine.dequantized_weight(torch.bfloat16)
        )
        x = (torch.randn(3, mine.in_features, generator=g) * torch.logspace(-2, 2, mine.in_features)).bfloat16()
        assert torch.equal(theirs.input_quantizer(x), quantize_mx(x, fmt, scale_rule="quark")), name
    with torch.no_grad():
        assert torch.equal(loaded(INPUT_IDS).logits, ours(INPUT_IDS).logits)
    # not in the map: in Quark's `exclude`, a plain linear in the model's dtype (not a float32 QParamsLinear)
    for name in (LAYER.format(1, "self_attn.o_proj"), "lm_head"):
        float_layer = loaded.get_submodule(name)
        assert type(float_layer) is torch.nn.Linear and float_layer.weight.dtype == torch.bfloat16, name


def test_config_names_every_layer_and_files_are_the_packed_size(exported):
    source, out = exported
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "quark"
    layers = quantization["layer_quant_config"]
    assert {name: spec["weight"]["dtype"] for name, spec in layers.items()} == {
        name: {"mxfp4_e2m1": "fp4", "mxfp6_e2m3": "fp6_e2m3", "mxfp6_e3m2": "fp6_e3m2"}[fmt]
        for name, fmt in FORMAT_MAP.items()
    }
    assert all(
        spec["input_tensors"]["is_dynamic"] and spec["weight"]["scale_format"] == "e8m0" for spec in layers.values()
    )
    size = lambda folder: sum(p.stat().st_size for p in folder.glob("*.safetensors"))  # noqa: E731
    assert abs(size(out) - size(source)) <= 0.02 * size(source)


def test_mxfp8_is_refused_with_the_alternative(tiny_llama_dir, tmp_path):
    source = save_dmx(tiny_llama_dir, tmp_path / "fp8", {LAYER.format(0, "mlp.down_proj"): "mxfp8_e4m3"})
    with pytest.raises(ExportError, match="quark cannot store mxfp8_e4m3.*export to 'compressed-tensors' instead"):
        export_checkpoint(source, tmp_path / "out", "quark", force=True)


def test_layers_subclassing_linear_are_named_in_a_warning_and_the_model_card(tmp_path, caplog):
    """amd-quark builds its quantized layers for modules of class `nn.Linear` exactly: Falcon's `FalconLinear`
    subclasses it, so transformers stops on mismatched sizes loading the export. The export says so, and names the
    target transformers loads (a Llama's export, all `nn.Linear`, carries no such note: the tests above)."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    FalconForCausalLM(config).save_pretrained(tmp_path / "float")
    format_map = {f"transformer.h.{i}.mlp.dense_h_to_4h": "mxfp4_e2m1" for i in range(2)}
    source = save_dmx(tmp_path / "float", tmp_path / "dmx", format_map)
    with caplog.at_level("WARNING", logger="optimum_dmx"):
        exported = export_checkpoint(source, tmp_path / "quark", "quark")
    assert "2 quantized layers are subclasses (FalconLinear, e.g. transformer.h.0.mlp.dense_h_to_4h)" in caplog.text
    card = (exported / "README.md").read_text()
    assert "`FalconLinear` subclass it" in card and "--to compressed-tensors" in card
    import quark  # noqa: F401  (transformers loads Quark checkpoints through it)

    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
