"""Mixture-of-experts models: transformers keeps their experts as 3-D tensors; dMX quantizes them as one
`nn.Linear` per expert and projection (`nn.experts`), one format for each layer's experts.

Tiny randomly initialised Qwen3-MoE and Mixtral (2 layers of 4 experts, 2 per token): the linearized experts compute
the packed ones' logits bit for bit (also Qwen2-MoE's and OLMoE's, of the same layout); calibration gives each
layer's experts one format, hits the budget and reloads in a fresh process with the same logits (Mixtral's
checkpoint keys are renamed by transformers on saving); keeping the experts float on request, and refusing what
cannot be carried out (part of a layer's experts, offloaded experts, packed tensors of another layout), each before
any calibration. Quantized experts export to compressed-tensors, read back by its own decompressors and by
transformers; what no loader takes is refused at export, naming the layer.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from optimum_dmx import DMXConfig, DMXQuantizer, MXLinear
from optimum_dmx.calibration import CalibrationSettings, calibrate
from optimum_dmx.calibration.budget import BUDGET_TOLERANCE
from optimum_dmx.export import ExportError, export_checkpoint
from optimum_dmx.nn import LinearExperts, linearizable_experts, linearize_experts, packed_weight_modules
from optimum_dmx.nn.experts import PROJECTIONS

from .helpers import last_json_line, run_python, word_tokenizer, words

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    vocab_size=128,
)
FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    ),
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(**COMMON, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    ),
}
# Two more families of the same layout, for the bit-exactness of the linearized experts only.
SAME_LAYOUT = {
    **FAMILIES,
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **COMMON,
            intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        )
    ),
    "olmoe": lambda: OlmoeForCausalLM(
        OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2, pad_token_id=0)
    ),
}
EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
CALIBRATION = dict(steps=4, seq_len=16, batch_size=2, num_samples=8)
INPUT = [[1, 5, 9, 17, 33, 65, 99, 3, 7, 11, 13, 17, 19, 23]]


def save_float(family: str, folder) -> nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return model


def dmx_config(**overrides) -> DMXConfig:
    texts = [words(7 * i, 40) for i in range(20)]
    return DMXConfig(target_bits=5, dataset=texts, tokenizer=word_tokenizer(), **CALIBRATION, **overrides)


def assert_saved_and_reloaded_alike(model: nn.Module, folder) -> None:
    """Save `model` to `folder`; loaded in a fresh process, it computes the same logits bit for bit."""
    with torch.no_grad():
        logits = model(torch.tensor(INPUT)).logits
    model.save_pretrained(folder)
    code = f"""
import json, torch, optimum_dmx
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(folder)!r})
with torch.no_grad():
    print(json.dumps(model(torch.tensor({INPUT})).logits.tolist()))
"""
    assert torch.equal(torch.tensor(last_json_line(run_python(code))), logits)


@pytest.mark.parametrize("family", list(SAME_LAYOUT))
def test_linearized_experts_compute_the_packed_experts_logits_bit_for_bit(family):
    torch.manual_seed(0)
    model = SAME_LAYOUT[family]()
    packed = model.model.layers[1].mlp.experts
    with torch.no_grad():
        expected = model(torch.tensor(INPUT)).logits
    assert linearizable_experts(model, ["lm_head"]) == EXPERTS and packed_weight_modules(model, []) == {}
    linearize_experts(model, EXPERTS)

    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == 4
    gate, up = packed.gate_up_proj[2].chunk(2)  # the gate's rows first, as transformers' experts split them
    assert torch.equal(experts[2].gate_proj.weight, gate) and torch.equal(experts[2].up_proj.weight, up)
    assert torch.equal(experts[2].down_proj.weight, packed.down_proj[2])
    with torch.no_grad():
        assert torch.equal(model(torch.tensor(INPUT)).logits, expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_calibrate_with_one_format_per_layer_and_reload(tmp_path, family):
    save_float(family, tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=dmx_config())

    recorded = model.config.quantization_config
    experts = {name: fmt for name, fmt in recorded.format_map.items() if ".experts." in name}
    assert len(experts) == 2 * 4 * 3 and len(recorded.format_map) == len(experts) + 2 * 4  # and attention
    assert all(isinstance(model.get_submodule(name), MXLinear) for name in experts)
    for layer in EXPERTS:  # vLLM runs a layer's experts with one scheme: one offset, one format
        assert len({fmt for name, fmt in experts.items() if name.startswith(layer + ".")}) == 1
    # The knapsack stays at or under the budget; a layer's experts are 33% (Qwen3-MoE) or 44% (Mixtral) of the
    # quantized weights here, so it cannot come as close as with single layers.
    assert 4.25 <= recorded.achieved_bits["bits_weighted"] <= 5 + BUDGET_TOLERANCE

    assert_saved_and_reloaded_alike(model, tmp_path / "dmx")


def test_experts_take_the_online_rotation_and_reload(tmp_path):
    # each expert linear gets its online transform (as "auto" gives it), merged into the float weights before
    # calibration and rebuilt on loading.
    save_float("qwen3_moe", tmp_path / "float")
    config = dmx_config(rotation="online_block_hadamard")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    transforms = model.config.quantization_config.input_transforms
    assert "model.layers.1.mlp.experts.3.down_proj" in transforms and len(transforms) == 2 * (4 * 3 + 4)
    assert_saved_and_reloaded_alike(model, tmp_path / "dmx")


def test_a_damaged_expert_tensor_is_refused_under_the_checkpoints_own_key_names(tmp_path):
    # transformers saves Mixtral's `mlp` as its original checkpoints' `block_sparse_moe`: the integrity check maps
    # the keys back before comparing them with the record.
    save_float("mixtral", tmp_path / "float")
    AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=dmx_config()).save_pretrained(
        tmp_path / "dmx"
    )
    path = tmp_path / "dmx" / "model.safetensors"
    tensors = load_file(path)
    key = "model.layers.1.block_sparse_moe.experts.3.down_proj.weight_packed"
    tensors[key][0, 0] ^= 0x11
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    save_file(tensors, path, metadata=metadata)
    with pytest.raises(ValueError, match=f"tensor '{key}' in model.safetensors differs from the one saved"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_kept_in_float_on_request_calibrate_the_rest_and_reload(tmp_path, family):
    float_model = save_float(family, tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=dmx_config(modules_to_not_convert=["mlp.experts"])
    )
    recorded = model.config.quantization_config
    assert sorted(recorded.format_map) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"
    )
    assert "mlp.experts" in recorded.modules_to_not_convert
    for layer in EXPERTS:
        kept, original = model.get_submodule(layer), float_model.get_submodule(layer)
        assert not isinstance(kept, LinearExperts)
        assert torch.equal(kept.gate_up_proj, original.gate_up_proj)
        assert torch.equal(kept.down_proj, original.down_proj)

    assert_saved_and_reloaded_alike(model, tmp_path / "dmx")
    with safe_open(tmp_path / "dmx" / "model.safetensors", "pt") as f:  # transformers' per-expert layout, float
        stored = {name: f.get_tensor(name).dtype for name in f.keys() if ".experts." in name}
    assert len(stored) == 2 * 4 * 3 and set(stored.values()) == {torch.float32}, stored


def test_part_of_a_layers_experts_is_refused_naming_the_module(tmp_path):
    save_float("qwen3_moe", tmp_path / "float")
    config = dmx_config(modules_to_not_convert=["model.layers.1.mlp.experts.2"])
    with pytest.raises(ValueError, match=r"3 of the 12 expert linears of model.layers.1.mlp.experts would stay float"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)


def test_offloaded_experts_are_refused_naming_the_way_out(tmp_path):
    save_float("qwen3_moe", tmp_path / "float")
    with pytest.raises(ValueError, match=r"offloaded by device_map.*modules_to_not_convert=\['mlp.experts'\]"):
        AutoModelForCausalLM.from_pretrained(
            tmp_path / "float",
            quantization_config=dmx_config(),
            device_map="auto",
            max_memory={"cpu": "20KB"},
            offload_folder=str(tmp_path / "offload"),
        )


def test_packed_experts_of_another_layout_are_refused_before_any_calibration():
    torch.manual_seed(0)
    model = FAMILIES["qwen3_moe"]()
    for layer in EXPERTS:
        model.get_submodule(layer).is_transposed = True  # a layout LinearExperts does not compute
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    attention = sum(
        p.numel() for name, p in model.named_parameters() if "self_attn" in name and name.endswith("proj.weight")
    )
    assert sorted(packed_weight_modules(model, [])) == EXPERTS and linearizable_experts(model, []) == []

    with pytest.raises(ValueError) as raised:
        DMXQuantizer(dmx_config()).quantize_model(model)
    message = str(raised.value)
    assert f"{experts / (experts + attention):.0%} of the weights Qwen3MoeForCausalLM" in message
    assert "model.layers.0.mlp.experts (Qwen3MoeExperts: gate_up_proj (4, 64, 64), down_proj (4, 64, 32))" in message
    assert (
        "add ['mlp.experts'] to modules_to_not_convert (command line: --modules-to-not-convert mlp.experts)" in message
    )
    assert raised.traceback[-1].name == "_check_quantizable"
    assert not any(isinstance(m, MXLinear) for m in model.modules())


def test_calibrate_refuses_experts_left_packed_and_takes_them_linearized():
    # The library's own entry point (what examples/calibrate_sharded.py calls) does not linearize: it says how.
    torch.manual_seed(0)
    model = FAMILIES["qwen3_moe"]()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(target_bits=5, steps=2, batch_size=2, modules_to_not_convert=["lm_head"])
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts and 1 more hold .*nn.linearize_experts"):
        calibrate(model, ids, settings, progress=False)
    linearize_experts(model, linearizable_experts(model, ["lm_head"]))
    result = calibrate(model, ids, settings, progress=False)
    assert len([name for name in result.format_map if ".experts." in name]) == 2 * 4 * 3


def test_the_scan_puts_a_layers_experts_low_in_one_pass():
    """With fused groups a layer's experts share a format, so the KL scan makes one pass for all of them (not one
    per expert linear: 18,432 on Qwen3-30B-A3B) and splits its divergence evenly among them."""
    from optimum_dmx.calibration import kl_sensitivities

    torch.manual_seed(0)
    model = FAMILIES["qwen3_moe"]()
    linearize_experts(model, linearizable_experts(model, ["lm_head"]))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    passes = []
    model.model.norm.register_forward_pre_hook(lambda module, args: passes.append(1))
    settings = CalibrationSettings(batch_size=4, offset_groups="fused", modules_to_not_convert=["lm_head"])
    grouped = kl_sensitivities(model, ids, settings, progress=False, head_tokens=None)
    assert len(passes) == 1 + 2 * 3  # the reference, then per layer: q/k/v, o_proj, the experts
    for layer in EXPERTS:
        shares = {value for name, value in grouped.items() if name.startswith(layer + ".")}
        assert len(shares) == 1 and shares.pop() > 0
    passes.clear()
    alone = kl_sensitivities(
        model, ids, CalibrationSettings(batch_size=4, modules_to_not_convert=["lm_head"]), progress=False
    )
    # ungrouped: every linear alone, q/k/v/o in one pass over 4 copies of the batch, each expert linear in a pass of
    # its own (it reads the tokens routed to it, not the copies one after the other)
    assert len(passes) == 1 + 2 * (1 + 4 * 3)
    passes.clear()
    assert alone == kl_sensitivities(
        model,
        ids,
        CalibrationSettings(batch_size=4, modules_to_not_convert=["lm_head"]),
        progress=False,
        units_per_pass=1,
    )
    assert len(passes) == 1 + 2 * (4 + 4 * 3)


def test_the_scans_passes_over_copies_scan_a_layers_experts_in_passes_of_their_own():
    """A pass over copies of the batch puts a unit low in its copy's rows, which a mixture of experts' expert does
    not read in order (the router's order): a layer's experts are scanned in passes of their own, so that every
    unit gets the divergence of a pass of its own, grouped (q/k/v, o_proj and the experts would otherwise share a
    pass) or not."""
    from optimum_dmx.calibration import kl_sensitivities

    torch.manual_seed(0)
    model = FAMILIES["qwen3_moe"]()
    linearize_experts(model, linearizable_experts(model, ["lm_head"]))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for groups in ("fused", "none"):
        settings = CalibrationSettings(batch_size=4, offset_groups=groups, modules_to_not_convert=["lm_head"])
        shared = kl_sensitivities(model, ids, settings, progress=False, head_tokens=16)
        single = kl_sensitivities(model, ids, settings, progress=False, head_tokens=16, units_per_pass=1)
        assert shared.keys() == single.keys()
        for name in single:
            assert shared[name] == pytest.approx(single[name], rel=1e-5), name


def test_packed_weight_modules_leave_out_convolutions_vectors_and_skipped_modules():
    assert packed_weight_modules(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Linear(4, 4)), []) == {}
    vectors = nn.Module()  # Kimi-Linear's A_log (1, 1, heads, 1), and a matrix stored in three dimensions
    vectors.a_log, vectors.matrix = nn.Parameter(torch.zeros(1, 1, 32, 1)), nn.Parameter(torch.zeros(1, 8, 8))
    vectors.stack = nn.Parameter(torch.zeros(2, 8, 8))
    assert packed_weight_modules(nn.Sequential(vectors), []) == {"0": {"stack": (2, 8, 8)}}
    torch.manual_seed(0)
    model = FAMILIES["mixtral"]()
    for layer in EXPERTS:
        model.get_submodule(layer).has_bias = True
    assert list(packed_weight_modules(model, ["model.layers.0"])) == ["model.layers.1.mlp.experts"]
    assert packed_weight_modules(model, ["mlp.experts"]) == {}
    assert packed_weight_modules(model, [])["model.layers.1.mlp.experts"] == {
        "gate_up_proj": (4, 256, 64),
        "down_proj": (4, 64, 128),
    }


def expert_map(layer_formats: tuple[str, str]) -> dict[str, str]:
    """A servable map of the tiny Qwen3-MoE: attention MXFP4 (o_proj MXFP8), layer i's experts in layer_formats[i]."""
    format_map = {}
    for layer, experts_format in enumerate(layer_formats):
        format_map.update({f"model.layers.{layer}.self_attn.{p}_proj": "mxfp4_e2m1" for p in "qkv"})
        format_map[f"model.layers.{layer}.self_attn.o_proj"] = "mxfp8_e4m3"
        for expert in range(4):
            format_map.update({f"{EXPERTS[layer]}.{expert}.{p}": experts_format for p in PROJECTIONS})
    return format_map


def save_dmx_with_map(tmp_path, layer_formats: tuple[str, str], family: str = "qwen3_moe", **changes: str):
    """The tiny `family` model saved with `expert_map(layer_formats)`, with `changes` (module name -> format)."""
    save_float(family, tmp_path / "float")
    config = DMXConfig(format_map={**expert_map(layer_formats), **changes}, scale_rule="compressed-tensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    model.save_pretrained(tmp_path / "dmx")
    return model


# Layer 1's experts in MXFP8 (a regular-expression target per layer); or, exported forced, one of layer 0's experts.
EXPERT_CHANGES = {"per layer": {}, "within a layer": {f"{EXPERTS[0]}.2.{p}": "mxfp8_e4m3" for p in PROJECTIONS}}


@pytest.mark.parametrize("changes", list(EXPERT_CHANGES))
def test_quantized_experts_export_to_compressed_tensors_and_decompress_with_its_own_code(tmp_path, caplog, changes):
    """Experts in MXFP4 and MXFP8: every expert's tensors, read through the config group compressed-tensors matches
    to the expert's name and decompressed by compressed-tensors' compressor for that group's format, give this
    package's weight bit for bit; one target per layer's experts in one format, exact names where a forced export's
    layer mixes them. transformers cannot load experts whose formats differ, which the export says."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.utils.match import match_name

    layer_formats = ("mxfp4_e2m1", "mxfp8_e4m3") if changes == "per layer" else ("mxfp4_e2m1", "mxfp4_e2m1")
    model = save_dmx_with_map(tmp_path, layer_formats, **EXPERT_CHANGES[changes])
    with caplog.at_level("WARNING", logger="optimum_dmx"):
        export_checkpoint(tmp_path / "dmx", tmp_path / "ct", "compressed-tensors", force=changes != "per layer")
    assert "transformers cannot load this export, only vLLM" in caplog.text
    assert "quantized (mxfp4_e2m1, mxfp8_e4m3)" in (tmp_path / "ct" / "README.md").read_text()
    groups = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    patterns = sum(target.startswith("re:") for group in groups.values() for target in group["targets"])
    assert patterns == (2 if changes == "per layer" else 1)
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    for name, fmt in {**expert_map(layer_formats), **EXPERT_CHANGES[changes]}.items():
        (group,) = [g for g in groups.values() if any(match_name(name, target) for target in g["targets"])]
        scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
        stored = {key.rpartition(".")[2]: tensor for key, tensor in tensors.items() if key.startswith(name + ".")}
        module = model.get_submodule(name)
        stored["weight_shape"] = torch.tensor(module.weight_shape)
        weight = BaseCompressor.get_value_from_registry(group["format"]).decompress(stored, scheme)["weight"]
        assert module.fmt.name == fmt
        assert torch.equal(weight.to(torch.bfloat16), module.dequantized_weight(torch.bfloat16)), name


@pytest.mark.parametrize(
    ("family", "experts_format"), [("qwen3_moe", "mxfp4_e2m1"), ("qwen3_moe", "mxfp6_e2m3"), ("mixtral", "mxfp4_e2m1")]
)
def test_experts_of_one_packed_format_load_through_transformers_to_our_weights_and_function(
    tmp_path, family, experts_format
):
    """transformers with compressed-tensors decompresses MXFP4 (or MXFP6) experts into its packed experts modules:
    the same weights as ours, and the same logits as this package's model with the experts' inputs left unquantized
    (the loader computes experts from their decompressed weights). Mixtral's are written under its checkpoints'
    names (`block_sparse_moe.experts.<e>.w1`, `w3`, `w2`), which its loaders read; its logits are not compared:
    transformers' Mixtral experts differ from ours by bfloat16 rounding even unquantized (up to 0.047 on this model's
    logits, where its Qwen3-MoE experts and ours agree bit for bit)."""
    bf16 = torch.bfloat16
    save_dmx_with_map(tmp_path, (experts_format, experts_format), family)
    export_checkpoint(tmp_path / "dmx", tmp_path / "ct", "compressed-tensors", force=True)  # vLLM: no MXFP6
    assert "transformers cannot" not in (tmp_path / "ct" / "README.md").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx", dtype=torch.bfloat16)
    for layer in EXPERTS:
        theirs, mine = loaded.get_submodule(layer), ours.get_submodule(layer)
        for expert in range(4):
            gate_up = torch.cat(
                [mine[expert].gate_proj.dequantized_weight(bf16), mine[expert].up_proj.dequantized_weight(bf16)]
            )
            assert torch.equal(theirs.gate_up_proj[expert], gate_up)
            assert torch.equal(theirs.down_proj[expert], mine[expert].down_proj.dequantized_weight(bf16))
            for projection in PROJECTIONS:
                getattr(mine[expert], projection).quantize_activations = False
    with safe_open(tmp_path / "ct" / "model.safetensors", "pt") as f:
        names = {"qwen3_moe": "mlp.experts.3.gate_proj", "mixtral": "block_sparse_moe.experts.3.w1"}
        assert f"model.layers.1.{names[family]}.weight_packed" in set(f.keys())
    if family == "mixtral":  # in bfloat16 transformers' Mixtral experts add in another order than ours (and Qwen3's)
        return
    with torch.no_grad():
        assert torch.equal(loaded(torch.tensor(INPUT)).logits, ours(torch.tensor(INPUT)).logits)


def test_experts_exports_refuse_what_no_loader_takes_naming_the_layer(tmp_path):
    save_dmx_with_map(tmp_path, ("mxfp4_e2m1", "mxfp4_e2m1"))
    with pytest.raises(
        ExportError,
        match=r"quark cannot take quantized mixture-of-experts experts \(2 layers, e.g. "
        r"model.layers.0.mlp.experts\): transformers with amd-quark 0.13 does not load them",
    ):
        export_checkpoint(tmp_path / "dmx", tmp_path / "quark", "quark", force=True)
    # online transforms on experts: no loader applies them to fused experts
    config = dmx_config(rotation="online_block_hadamard")
    AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config).save_pretrained(
        tmp_path / "rotated"
    )
    with pytest.raises(ExportError, match=r"expert linears have online input transforms \(e.g. model.layers.0.mlp"):
        export_checkpoint(tmp_path / "rotated", tmp_path / "ct", "compressed-tensors")
    assert not (tmp_path / "quark").exists() and not (tmp_path / "ct").exists()


def test_auto_transforms_the_linears_outside_the_experts_so_that_it_exports(tmp_path, caplog):
    """`rotation="auto"` gives online transforms to attention's linears, none to the experts (no loader applies them
    there), and the calibrated model exports with one regular-expression target per layer's experts."""
    save_float("qwen3_moe", tmp_path / "float")
    with caplog.at_level("WARNING", logger="optimum_dmx"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=dmx_config())
    assert "rotation='auto' leaves this model unrotated" not in caplog.text
    recorded = model.config.quantization_config
    assert recorded.rotation == "online_block_hadamard"
    assert sorted(recorded.input_transforms) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"
    )
    model.save_pretrained(tmp_path / "dmx")
    export_checkpoint(tmp_path / "dmx", tmp_path / "ct", "compressed-tensors", force=True)
    exported = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    targets = [target for group in exported["config_groups"].values() for target in group["targets"]]
    assert sorted(t for t in targets if t.startswith("re:")) == [
        r"re:^model\.layers\.0\.mlp\.experts\.\d+\.(down_proj|gate_proj|up_proj)$",
        r"re:^model\.layers\.1\.mlp\.experts\.\d+\.(down_proj|gate_proj|up_proj)$",
    ]
    assert len(exported["transform_config"]["config_groups"]) >= 1
    # a model whose only quantized linears are experts stays unrotated, with the reason
    caplog.clear()
    attention_float = dmx_config(modules_to_not_convert=["q_proj", "k_proj", "v_proj", "o_proj"])
    with caplog.at_level("WARNING", logger="optimum_dmx"):
        experts_only = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=attention_float)
    assert "no quantized linear (mixture-of-experts experts aside)" in caplog.text
    assert not experts_only.config.quantization_config.input_transforms


def test_the_command_line_keeps_the_experts_float_with_its_flag(tmp_path):
    save_float("qwen3_moe", tmp_path / "float")
    (tmp_path / "calibration.txt").write_text("\n".join(words(7 * i, 40) for i in range(20)))
    command = [sys.executable, "-m", "optimum_dmx", "quantize", str(tmp_path / "float"), "--dataset"]
    command += [str(tmp_path / "calibration.txt"), "--steps", "4", "--seq-len", "16", "--batch-size", "2"]
    command += ["--num-samples", "8", "--weight-rounding", "rtn", "--modules-to-not-convert", "mlp.experts"]
    done = subprocess.run([*command, "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "mlp.experts" in saved["modules_to_not_convert"] and len(saved["format_map"]) == 8


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_float_experts_beside_packed_layers_are_named_in_a_warning_and_the_model_card(tmp_path, caplog, family):
    """transformers with compressed-tensors cannot load an export whose packed (MXFP4) layers sit beside float
    experts stored per expert, which it merges into its packed experts tensors while loading: the export says so,
    naming the tensors transformers would build (two per layer, under the model's names, also for Mixtral's
    checkpoint names), and the loading fails as it says, whether the map is all MXFP4 or mixed. Packed experts (the
    test above) and float experts beside MXFP8 layers only load."""
    save_float(family, tmp_path / "float")
    attention = {f"model.layers.{i}.self_attn.{p}_proj": "mxfp4_e2m1" for i in range(2) for p in "qkvo"}
    mixed = {
        name: "mxfp8_e4m3" if name.endswith(("q_proj", "k_proj", "v_proj")) else fmt for name, fmt in attention.items()
    }
    for case, (formats, fails) in enumerate(
        ((attention, True), (mixed, True), (dict.fromkeys(attention, "mxfp8_e4m3"), False))
    ):
        config = DMXConfig(format_map=formats, scale_rule="compressed-tensors")
        dmx, exported = tmp_path / f"dmx{case}", tmp_path / f"ct{case}"
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config).save_pretrained(dmx)
        caplog.clear()
        with caplog.at_level("WARNING", logger="optimum_dmx"):
            export_checkpoint(dmx, exported, "compressed-tensors", force=True)
        card = " ".join((exported / "README.md").read_text().split())  # the note's lines joined
        said = "builds 4 tensors (e.g."
        assert (said in caplog.text) == fails and (said in card) == fails
        if not fails:
            AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
            continue
        example = "(e.g. `model.layers.0.mlp.experts.down_proj`)"
        assert example in caplog.text and example in card
        with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
            AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
