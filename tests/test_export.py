"""Export to compressed-tensors, read back by transformers + compressed-tensors' own code (no mocks)."""

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.export import ExportError, export_checkpoint
from optimum_dmx.formats import quantize_mx
from optimum_dmx.nn.groups import fused_projection_groups, mixed_groups

from .helpers import INPUT_IDS

LAYER = "model.layers.{}.{}"
PROJECTIONS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
# Fused groups share a format; all three compressed-tensors formats appear.
SERVABLE = {
    **{LAYER.format(0, p): "mxfp4_e2m1" for p in PROJECTIONS[:3] + ["mlp.down_proj"]},
    **{LAYER.format(0, p): "mxfp8_e4m3" for p in ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"]},
    **{LAYER.format(1, p): "mxfp8_e4m3" for p in PROJECTIONS[:3] + ["mlp.down_proj"]},
    **{LAYER.format(1, p): "mxfp4_e2m1" for p in ["mlp.gate_proj", "mlp.up_proj"]},
    LAYER.format(1, "self_attn.o_proj"): "mxfp6_e2m3",
}


def save_dmx(
    float_dir: Path, out: Path, format_map: dict, scale_rule: str = "compressed-tensors", rotation: str = "none"
) -> Path:
    config = DMXConfig(format_map=format_map, scale_rule=scale_rule, rotation=rotation)
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(out)
    return out


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def dmx_dir(tiny_llama_dir, tmp_path_factory):
    return save_dmx(tiny_llama_dir, tmp_path_factory.mktemp("dmx") / "model", SERVABLE)


@pytest.fixture(scope="module")
def exported(dmx_dir, tmp_path_factory):
    """The mixed (MXFP4 + MXFP6 + MXFP8) checkpoint exported for compressed-tensors (MXFP6: not for vLLM)."""
    before = folder_digest(dmx_dir)
    out = export_checkpoint(dmx_dir, tmp_path_factory.mktemp("ct") / "model", force=True)
    assert folder_digest(dmx_dir) == before  # the source folder is only read
    return out


def test_every_weight_loads_bit_exact_and_logits_match_the_emulation(dmx_dir, exported):
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(dmx_dir, dtype=torch.bfloat16)
    with torch.no_grad():  # compressed-tensors decompresses the weights on the first forward pass
        assert torch.equal(loaded(INPUT_IDS).logits, ours(INPUT_IDS).logits)
    for name, fmt in SERVABLE.items():
        module = ours.get_submodule(name)
        assert isinstance(module, MXLinear) and module.fmt.name == fmt
        assert torch.equal(loaded.get_submodule(name).weight, module.dequantized_weight(torch.bfloat16)), name


def test_activations_quantize_as_compressed_tensors_does_under_its_rule(exported):
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for name, fmt in [
        (LAYER.format(0, "self_attn.q_proj"), "mxfp4_e2m1"),
        (LAYER.format(1, "self_attn.o_proj"), "mxfp6_e2m3"),
        (LAYER.format(1, "mlp.down_proj"), "mxfp8_e4m3"),
    ]:
        module = loaded.get_submodule(name)
        x = (torch.randn(3, 5, module.in_features, generator=g) * torch.logspace(-2, 2, module.in_features)).bfloat16()
        theirs = forward_quantize(module, x, "input", module.quantization_scheme.input_activations)
        assert torch.equal(theirs, quantize_mx(x, fmt, scale_rule="compressed-tensors")), name
        if fmt != "mxfp6_e2m3":  # the OCP floor differs on some blocks
            assert not torch.equal(theirs, quantize_mx(x, fmt))


def test_config_lists_one_group_per_format_and_the_files_are_the_packed_size(dmx_dir, exported):
    quantization = json.loads((exported / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors" and quantization["format"] == "mixed-precision"
    groups = {g["format"]: sorted(g["targets"]) for g in quantization["config_groups"].values()}
    expected = {
        "mxfp4-pack-quantized": "mxfp4_e2m1",
        "mxfp6-pack-quantized": "mxfp6_e2m3",
        "mxfp8-quantized": "mxfp8_e4m3",
    }
    assert groups == {k: sorted(n for n, f in SERVABLE.items() if f == v) for k, v in expected.items()}
    size = lambda folder: sum(p.stat().st_size for p in folder.glob("*.safetensors"))  # noqa: E731
    assert abs(size(exported) - size(dmx_dir)) <= 0.02 * size(dmx_dir)
    assert "vllm serve" in (exported / "README.md").read_text()


def test_scale_rule_mismatch_is_reported_and_weights_stay_exact(tiny_llama_dir, tmp_path, caplog):
    source = save_dmx(
        tiny_llama_dir, tmp_path / "ocp", {k: v for k, v in SERVABLE.items() if v != "mxfp6_e2m3"}, scale_rule="ocp"
    )
    with caplog.at_level(logging.WARNING, logger="optimum_dmx.export.checkpoint"):
        out = export_checkpoint(source, tmp_path / "ct")
    assert "scale_rule='ocp'" in caplog.text and "DMXConfig(scale_rule='compressed-tensors')" in caplog.text
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not torch.equal(loaded(INPUT_IDS).logits, ours(INPUT_IDS).logits)
    name = LAYER.format(0, "mlp.gate_proj")
    assert torch.equal(loaded.get_submodule(name).weight, ours.get_submodule(name).dequantized_weight(torch.bfloat16))


def test_maps_vllm_cannot_serve_are_refused_naming_the_layers_unless_forced(tiny_llama_dir, tmp_path):
    mixed = {**SERVABLE, LAYER.format(0, "self_attn.k_proj"): "mxfp8_e4m3"}
    source = save_dmx(tiny_llama_dir, tmp_path / "mixed", mixed)
    with pytest.raises(ExportError) as err:
        export_checkpoint(source, tmp_path / "out")
    message = str(err.value)
    assert "q_proj/k_proj/v_proj of model.layers.0.self_attn" in message and "mxfp6_e2m3" in message
    assert "shared offsets for fused projections" in message and "force=True" in message
    assert not (tmp_path / "out").exists()
    export_checkpoint(source, tmp_path / "out", force=True)
    assert (tmp_path / "out" / "config.json").is_file()


def test_formats_the_target_cannot_store_are_refused_even_when_forced(tiny_llama_dir, tmp_path):
    source = save_dmx(tiny_llama_dir, tmp_path / "e3m2", {LAYER.format(0, "mlp.up_proj"): "mxfp6_e3m2"})
    with pytest.raises(ExportError, match=r"cannot store mxfp6_e3m2 .* e.g. model.layers.0.mlp.up_proj"):
        export_checkpoint(source, tmp_path / "out", force=True)


def test_ragged_layers_are_refused(tiny_qwen3_dir, tmp_path):
    source = save_dmx(tiny_qwen3_dir, tmp_path / "qwen3", {"model.layers.0.mlp.down_proj": "mxfp4_e2m1"})
    with pytest.raises(ExportError, match="in_features divisible by 32.*model.layers.0.mlp.down_proj"):
        export_checkpoint(source, tmp_path / "out")


def test_output_folder_rules(dmx_dir, exported, tmp_path):
    with pytest.raises(FileExistsError, match="not empty"):
        export_checkpoint(dmx_dir, exported, force=True)
    with pytest.raises(ExportError, match="is .*, which this command reads"):
        export_checkpoint(dmx_dir, dmx_dir, force=True, overwrite=True)
    with pytest.raises(ExportError, match="not a dMX checkpoint"):
        export_checkpoint(exported, tmp_path / "again")
    with pytest.raises(ValueError, match="export target 'onnx' is not supported; allowed: compressed-tensors"):
        export_checkpoint(dmx_dir, tmp_path / "x", "onnx")


def test_sharded_checkpoint_and_a_loaded_model_export_alike(tiny_llama_dir, dmx_dir, exported, tmp_path):
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(dmx_dir).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    from_shards = export_checkpoint(sharded, tmp_path / "from-shards", force=True)
    index = json.loads((from_shards / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[LAYER.format(1, "mlp.down_proj") + ".weight"].endswith(".safetensors")  # MXFP8 renamed
    model = AutoModelForCausalLM.from_pretrained(dmx_dir)
    from_model = export_checkpoint(model, tmp_path / "from-model", force=True)
    reference = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(INPUT_IDS).logits
        for folder in (from_shards, from_model):
            assert torch.equal(
                AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)(INPUT_IDS).logits, expected
            )


def test_command_line_export(dmx_dir, tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "optimum_dmx", "export", str(dmx_dir), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
        )

    refused = cli("--to", "compressed-tensors", "--output", tmp_path / "a")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "vLLM does not serve mxfp6_e2m3" in refused.stderr.strip().splitlines()[-1]
    done = cli("--to", "compressed-tensors", "--output", tmp_path / "a", "--force")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Exported" in done.stdout and (tmp_path / "a" / "model.safetensors").is_file()
    again = cli("--to", "compressed-tensors", "--output", tmp_path / "a", "--force")
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_fused_projection_groups_from_names():
    names = [LAYER.format(i, p) for i in range(2) for p in PROJECTIONS] + ["model.layers.2.self_attn.q_proj"]
    groups = fused_projection_groups(names)
    assert (
        LAYER.format(0, "self_attn.q_proj"),
        LAYER.format(0, "self_attn.k_proj"),
        LAYER.format(0, "self_attn.v_proj"),
    ) in groups
    assert (LAYER.format(1, "mlp.gate_proj"), LAYER.format(1, "mlp.up_proj")) in groups
    assert len(groups) == 4  # layer 2 has no complete group
    assert mixed_groups(SERVABLE) == []
    assert mixed_groups({**SERVABLE, LAYER.format(1, "mlp.up_proj"): "mxfp8_e4m3"}) == [
        (LAYER.format(1, "mlp.gate_proj"), LAYER.format(1, "mlp.up_proj"))
    ]


@pytest.mark.slow  # a whole calibration before the export: the fused-map exports above run by default
def test_a_map_calibrated_with_the_defaults_exports_for_vllm_unforced(tiny_text_model_dir, tmp_path):
    """The whole path a vLLM user takes with the defaults (q/k/v and gate/up sharing offsets, online transforms):
    calibrate, save, export; compressed-tensors' own code applies the exported transforms."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from transformers import AutoTokenizer

    root = tiny_text_model_dir
    config = DMXConfig(
        target_bits=6.0,
        scale_rule="compressed-tensors",
        dataset=[str(root / "calibration.txt")],
        tokenizer=AutoTokenizer.from_pretrained(root / "model"),
        steps=6,
        seq_len=16,
        batch_size=2,
        num_samples=12,
    )
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32, quantization_config=config)
    format_map = model.config.quantization_config.format_map
    assert mixed_groups(format_map) == [] and len(set(format_map.values())) == 2
    model.save_pretrained(tmp_path / "dmx")
    saved = json.loads((tmp_path / "dmx" / "config.json").read_text())["quantization_config"]
    assert saved["offset_groups"] == "fused" and saved["rotation"] == "online_block_hadamard"
    out = export_checkpoint(tmp_path / "dmx", tmp_path / "ct")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    transforms = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]
    apply_transform_config(loaded, TransformConfig.model_validate(transforms))
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(INPUT_IDS % 120).logits, ours(INPUT_IDS % 120).logits)


@pytest.mark.parametrize("rotation", ["none", "online_block_hadamard"])
@pytest.mark.parametrize(
    "target, formats, scale_rule",
    [
        ("compressed-tensors", ("mxfp4_e2m1", "mxfp8_e4m3"), "compressed-tensors"),
        ("quark", ("mxfp4_e2m1", "mxfp6_e2m3"), "quark"),
    ],
)
def test_a_model_with_fused_projection_linears_exports_to_the_same_logits(
    tmp_path, target, formats, scale_rule, rotation
):
    """Phi-3 computes q/k/v and gate/up each in one `nn.Linear` (`qkv_proj`, `gate_up_proj`): each is one layer of
    the map, exported as it is, and the loader's model computes what the dMX checkpoint does, bit for bit. Rotated
    (what `rotation="auto"` picks for it), every linear's online transform is a plain block Hadamard transform (no
    layer can take random signs), which the loader's own code applies."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, initializer_range=0.2,
    )  # fmt: skip
    Phi3ForCausalLM(config).save_pretrained(tmp_path / "float")
    names = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    format_map = {LAYER.format(i, name): formats[(i + j) % 2] for i in range(2) for j, name in enumerate(names)}
    source = save_dmx(tmp_path / "float", tmp_path / "dmx", format_map, scale_rule, rotation)
    exported = export_checkpoint(source, tmp_path / target, target)
    if target == "quark":
        import quark  # noqa: F401  (transformers loads Quark checkpoints through it)
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    transforms = ours.config.quantization_config.input_transforms or {}
    assert sorted(transforms) == (sorted(format_map) if rotation != "none" else [])
    assert all(spec["signed"] is False for spec in transforms.values())
    if rotation != "none":  # the loaders' own code applies the transforms, which transformers does not call
        quantization = json.loads((exported / "config.json").read_text())["quantization_config"]
        if target == "compressed-tensors":
            from compressed_tensors.transform import TransformConfig, apply_transform_config

            apply_transform_config(loaded, TransformConfig.model_validate(quantization["transform_config"]))
        else:
            for name in format_map:
                loaded.get_submodule(name).post_process_after_loading()
    with torch.no_grad():
        assert torch.equal(loaded(INPUT_IDS).logits, ours(INPUT_IDS).logits)
    for name in format_map if target == "compressed-tensors" else ():  # Quark keeps its weights packed
        dequantized = ours.get_submodule(name).dequantized_weight(torch.bfloat16)
        assert torch.equal(loaded.get_submodule(name).weight, dequantized), name


def test_a_configuration_with_values_json_cannot_hold_exports(tmp_path):
    """Falcon-H1's configuration has an infinite `time_step_limit`, which transformers writes to config.json as
    `{"__float__": "Infinity"}`: the export reads the configuration through transformers, which decodes it, and the
    exported config.json keeps transformers' encoding."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=1,
    )  # fmt: skip
    assert config.time_step_limit[1] == float("inf")
    torch.manual_seed(0)
    FalconH1ForCausalLM(config).save_pretrained(tmp_path / "float")
    format_map = {
        LAYER.format(i, f"feed_forward.{name}"): "mxfp4_e2m1" for i in range(2) for name in ("gate_proj", "up_proj")
    }
    source = save_dmx(tmp_path / "float", tmp_path / "dmx", format_map)
    exported = export_checkpoint(source, tmp_path / "ct", force=True)
    assert json.loads((exported / "config.json").read_text())["time_step_limit"][1] == {"__float__": "Infinity"}
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    assert loaded.config.time_step_limit[1] == float("inf")
    with torch.no_grad():
        assert torch.equal(loaded(INPUT_IDS).logits, ours(INPUT_IDS).logits)
