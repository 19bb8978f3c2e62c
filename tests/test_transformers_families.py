"""Every decoder family of transformers that dMX was tried on: it quantizes, saves and reloads, or it is refused
with an error that names what dMX cannot quantize.

Tiny randomly initialised models (2 layers, hidden size 64) built from each family's own configuration class
(`AutoConfig.for_model`), calibrated with the defaults for a few steps, saved and loaded back: the reloaded model's
logits must equal the quantized model's. The families of `test_families.py` (Llama, Qwen3, Gemma 3, Mistral, Phi-3,
Mamba, PhiMoE, GPT-BigCode) and of `test_mixture_of_experts.py` are checked there more closely, in the default suite.
A family this version of transformers does not have is skipped.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.calibration.budget import BUDGET_TOLERANCE

from .helpers import transformers_warnings, word_tokenizer, words

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    head_dim=16,
    max_position_embeddings=128,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MLA = dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, q_lora_rank=32, kv_lora_rank=32)
# what a family's configuration needs besides SMALL (hybrid models: a full-attention layer among the first few)
EXTRA = {
    "codegen": dict(rotary_dim=4),
    "deepseek_v2": dict(**MLA, first_k_dense_replace=1, n_group=1, topk_group=1),
    "falcon": dict(head_dim=None),
    "gptj": dict(rotary_dim=4),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "minicpm3": MLA,
    "qwen3_5_text": dict(num_hidden_layers=4),
    "qwen3_next": dict(num_hidden_layers=4),
}
QUANTIZED = [
    "afmoe", "apertus", "arcee", "bitnet", "bloom", "codegen", "cohere", "cohere2", "cohere2_moe", "deepseek_v2",
    "dots1", "ernie4_5", "ernie4_5_moe", "exaone4", "falcon", "falcon_h1", "falcon_mamba", "gemma", "gemma2",
    "gemma4_text", "glm", "glm4", "glm4_moe", "gpt_neox", "gptj", "granite", "granitemoe", "granitemoeshared",
    "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "internlm3", "jamba", "lfm2", "minicpm3", "minimax", "minimax_m2",
    "ministral", "mpt", "nemotron", "olmo", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "opt", "persimmon", "qwen2",
    "qwen3_5_text", "qwen3_next", "seed_oss", "smollm3", "stablelm", "starcoder2", "vaultgemma",
]  # fmt: skip
# refused before calibrating, with the error naming the weights dMX cannot quantize
REFUSED = {
    "gpt2": r"no nn.Linear layer to quantize .* \['Conv1D'\] modules",
    "gpt_oss": r"lie outside nn.Linear layers, in tensors of three dimensions or more .*GptOssExperts",
    "jetmoe": r"lie outside nn.Linear layers, in tensors of three dimensions or more .*JetMoeParallelExperts",
    "llama4_text": r"lie outside nn.Linear layers, in tensors of three dimensions or more .*Llama4TextExperts",
    "nemotron_h": r"lie outside nn.Linear layers, in tensors of three dimensions or more .*NemotronHExperts",
    "recurrent_gemma": r"lie outside nn.Linear layers, in tensors of three dimensions or more .*RecurrentGemmaRglru",
}
CALIBRATION = dict(steps=4, seq_len=16, batch_size=2, num_samples=8)


def _family_config(family: str, **overrides):
    """The family's tiny configuration (`SMALL` with its `EXTRA` and `overrides`); skips a family this transformers
    lacks."""
    if family not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {family!r} models")
    values = {**SMALL, **EXTRA.get(family, {}), **overrides}
    return AutoConfig.for_model(family, **{k: v for k, v in values.items() if v is not None})


def _float_checkpoint(family: str, folder, **overrides):
    config = _family_config(family, **overrides)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = word_tokenizer()
    tokenizer.save_pretrained(folder)
    return tokenizer


def _config(tokenizer) -> DMXConfig:
    texts = [words(7 * i, 40) for i in range(20)]
    return DMXConfig(target_bits=5, dataset=texts, tokenizer=tokenizer, **CALIBRATION)


@pytest.mark.slow
@pytest.mark.parametrize("family", QUANTIZED)
def test_family_quantizes_saves_and_reloads(tmp_path, family):
    tokenizer = _float_checkpoint(family, tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=_config(tokenizer))
    assert any(isinstance(m, MXLinear) for m in model.modules())
    assert model.config.quantization_config.achieved_bits["bits_weighted"] <= 5 + BUDGET_TOLERANCE + 1e-9
    ids = tokenizer("w1 w5 w9 w17 w33 w65 w99 w3 w42 w7 w11", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path / "dmx")
    with transformers_warnings() as reloading:
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")
    assert not [message for message in reloading if "LOAD REPORT" in message]  # nothing missing or unexpected
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_dmx_cannot_quantize_is_refused_naming_why(tmp_path, family):
    tokenizer = _float_checkpoint(family, tmp_path / "float")
    with pytest.raises(ValueError, match=REFUSED[family]):
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=_config(tokenizer))


# exports transformers cannot load, by family and target: the error's pattern and why
UNLOADABLE_EXPORTS = {
    **{
        (family, "compressed-tensors"): (
            "automatic conversion of the weights",
            "float mixture-of-experts experts beside packed layers: transformers' per-expert merge gets no tensors "
            "(docs/calibration.md, 'Export')",
        )
        for family in [
            "afmoe",
            "cohere2_moe",
            "deepseek_v2",
            "dots1",
            "ernie4_5_moe",
            "glm4_moe",
            "hunyuan_v1_moe",
            "jamba",
            "minimax",
            "minimax_m2",
            "olmoe",
            "qwen3_next",
        ]  # fmt: skip
    },
    ("olmo_hybrid", "compressed-tensors"): (
        "automatic conversion of the weights",
        "the same conversion of float tensors beside packed layers: its q/k/v convolutions, stored apart, which "
        "transformers concatenates into one conv1d while loading",
    ),
    ("falcon", "quark"): (
        "ignore_mismatched_sizes",
        "amd-quark builds its layers for modules of type nn.Linear only, and Falcon's are FalconLinear",
    ),
}


# Sizes of SMALL that are one MX block (32): as a linear's whole input, rotated, Quark's loader transforms it by its
# own fast Hadamard algorithm instead of the matrix it stores (`QParamsLinearWithRotation.post_process_after_loading`,
# rotation_size == in_features), whose other order of additions moves some MXFP4 codes. Real models have no linear
# of 32 inputs; the rotated exports double them.
ONE_BLOCK_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank")


@pytest.mark.slow
@pytest.mark.parametrize("rotation", ["none", "auto"])
@pytest.mark.parametrize("target", ["compressed-tensors", "quark"])
@pytest.mark.parametrize("family", QUANTIZED)
def test_the_export_loads_to_the_dmx_models_logits(tmp_path, caplog, family, target, rotation):
    """Every linear MXFP4 but the ones the model reads itself (packed: no `weight` in compressed-tensors' layers),
    calibrated with the target's scale rule and exported: `load_exported` gives the dMX model's logits in bfloat16,
    bit for bit, with no load report from transformers (nothing missing or unexpected), but for the exports of
    `UNLOADABLE_EXPORTS`, of which the export warns exactly those that stop on a conversion of float tensors (float
    experts, OLMo-Hybrid's convolutions). For compressed-tensors, the export warns that
    `from_pretrained` alone cannot load the folder exactly when transformers' weight initialization stops on a
    packed layer's missing `weight` (Falcon-Mamba's mixer, Falcon's linears; GPT-BigCode's and Mamba's are in
    `test_families.py`). With `rotation="auto"` (online 32-block transforms wherever an export carries them, their
    signs moved into the layers producing their inputs) the same holds."""
    import quark  # noqa: F401  (transformers loads Quark checkpoints through it)
    from torch import nn

    from optimum_dmx.export import export_checkpoint, load_exported
    from optimum_dmx.nn.replaceable import linears_kept_in_float

    overrides = dict.fromkeys(ONE_BLOCK_SIZES, 64) if rotation == "auto" else {}
    tokenizer = _float_checkpoint(family, tmp_path / "float", **overrides)
    float_model = AutoModelForCausalLM.from_pretrained(tmp_path / "float")
    ids = tokenizer("w1 w5 w9 w17 w33 w65 w99 w3 w42 w7 w11", return_tensors="pt").input_ids
    linears = [
        name
        for name, module in float_model.named_modules()
        if isinstance(module, nn.Linear) and name != "lm_head" and module.in_features % 32 == 0
    ]
    kept = linears_kept_in_float(float_model, ids, linears)
    format_map = {name: "mxfp4_e2m1" for name in linears if name not in kept}
    config = DMXConfig(format_map=format_map, weight_rounding="rtn", scale_rule=target, rotation=rotation)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    model.save_pretrained(tmp_path / "dmx")
    with caplog.at_level("WARNING", logger="optimum_dmx"):
        export_checkpoint(tmp_path / "dmx", tmp_path / target, target, force=True)
    subclassed = "builds its quantized layers for nn.Linear exactly" in caplog.text  # the export's warning
    assert subclassed == ((family, target) == ("falcon", "quark"))
    float_conversions = "from float tensors this checkpoint stores apart" in caplog.text  # the export's warning
    assert float_conversions == (
        UNLOADABLE_EXPORTS.get((family, target), ("",))[0] == "automatic conversion of the weights"
    )
    if (family, target) in UNLOADABLE_EXPORTS:
        with pytest.raises(RuntimeError, match=UNLOADABLE_EXPORTS[family, target][0]):
            load_exported(tmp_path / target, dtype=torch.bfloat16)
        return
    with transformers_warnings() as loading:
        loaded = load_exported(tmp_path / target, dtype=torch.bfloat16)
    assert not [message for message in loading if "LOAD REPORT" in message]  # nothing missing or unexpected
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ours(ids).logits)
    predicted = "from_pretrained alone cannot load this export" in caplog.text
    try:
        AutoModelForCausalLM.from_pretrained(tmp_path / target, dtype=torch.bfloat16)
        failure = None
    except AttributeError as error:
        failure = error
    assert predicted == (failure is not None and "'weight'" in str(failure)), failure


@pytest.mark.parametrize(
    "family, key, built",
    [
        ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w3.weight", "model.layers.1.mlp.experts.gate_up_proj"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w2.weight", "model.layers.1.mlp.experts.down_proj"),
        ("olmo_hybrid", "model.layers.0.linear_attn.k_conv1d.weight", "model.layers.0.linear_attn.conv1d.weight"),
        ("olmo_hybrid", "model.layers.0.linear_attn.k_proj.weight", None),
        ("llama", "model.layers.0.mlp.gate_proj.weight", None),
        ("qwen3_moe", "model.layers.0.mlp.experts.1.up_proj.weight_packed", None),  # a packed expert loads as it is
    ],
)
def test_the_tensors_transformers_builds_from_a_checkpoint_key_are_read_from_its_converters(family, key, built):
    """`converted_weight_target`, which the export's warning of float conversions beside packed layers rests on:
    the model's tensor that one of transformers' converters for the family builds from a checkpoint key (Mixtral's
    checkpoint names renamed), and None for keys that load as they are."""
    from optimum_dmx.integration.checkpoint_names import converted_weight_target

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_family_config(family))
    assert converted_weight_target(model)(key) == built
