"""The decoder families transformers users bring calibrate with the defaults, hit their budget, and reload.

Tiny randomly initialised models (6 layers: 42 decoder linears, fine-grained enough for a +-0.05 budget):
Llama (SmolLM2's architecture), Qwen3 (q/k norms), Gemma 3 (tied embeddings, a tokenizer that starts texts
with BOS, a larger vocabulary, sliding-window layers), Mistral, and Phi-3 (q/k/v and gate/up each one fused
`nn.Linear`: 24 decoder linears, no offset groups to form, and no Llama-style layers, so `rotation="auto"` gives
its linears online transforms without random signs, as Gemma's norm readers). Each goes through
`from_pretrained(float_dir, quantization_config=DMXConfig(target_bits=5, ...))`, is saved, and is loaded back
in a fresh process with identical logits.
"""

import json

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.calibration.budget import BUDGET_TOLERANCE

from .helpers import last_json_line, run_python, word_tokenizer, words

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=128, tie_word_embeddings=True, **COMMON), False),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(vocab_size=128, head_dim=16, tie_word_embeddings=False, **COMMON), False),
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(vocab_size=1024, head_dim=16, sliding_window=8, query_pre_attn_scalar=16, **COMMON),
        True,
    ),
    "mistral": (MistralForCausalLM, MistralConfig(vocab_size=128, sliding_window=None, **COMMON), False),
    "phi3": (Phi3ForCausalLM, Phi3Config(vocab_size=128, pad_token_id=0, **COMMON), False),
}
CALIBRATION = dict(steps=20, seq_len=16, batch_size=2, num_samples=16)
INPUT = "w1 w5 w9 w17 w33 w65 w99 w3 w42 w7 w11"


PAIRS = [("mxfp8-mxfp4", 5.0), ("mxfp6-mxfp4", 5.5)]


# Each family with one pair by default (each pair with two families); every combination in the slow suite.
@pytest.mark.parametrize(
    "family, pair, target",
    [
        pytest.param(family, *pair, marks=[] if (i + j) % 2 == 0 else pytest.mark.slow)
        for i, family in enumerate(FAMILIES)
        for j, pair in enumerate(PAIRS)
    ],
)
def test_family_calibrates_to_its_budget_and_reloads(tmp_path, family, pair, target):
    model_cls, config, bos = FAMILIES[family]
    torch.manual_seed(0)
    float_model = model_cls(config)
    decoder_linears = sum(isinstance(m, nn.Linear) for m in float_model.model.layers.modules())
    float_model.save_pretrained(tmp_path / "float")
    tokenizer = word_tokenizer(bos=bos)
    tokenizer.save_pretrained(tmp_path / "float")
    texts = [words(7 * i, 40) for i in range(20)]
    dmx_config = DMXConfig(target_bits=target, format_pair=pair, dataset=texts, tokenizer=tokenizer, **CALIBRATION)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=dmx_config)

    mx = {n: m for n, m in model.named_modules() if isinstance(m, MXLinear)}
    assert len(mx) == decoder_linears == (6 * 4 if family == "phi3" else 6 * 7)  # the (tied) head stays float
    recorded = model.config.quantization_config
    assert recorded.bit_average == "weighted"  # the default: the model's size follows the target
    assert abs(recorded.achieved_bits["bits_weighted"] - target) <= BUDGET_TOLERANCE + 1e-9
    assert "lm_head" in recorded.modules_to_not_convert
    # rotation="auto": online transforms on every quantized linear (heads of 16 are no whole 32-block, so o_proj's
    # stays online too), plain Hadamard blocks: their random signs are in the decoder norms' scales (initialized to
    # ones), v_proj's and up_proj's rows, where those can take them (not Gemma's 1 + weight norms, nor Phi-3's fused
    # projections)
    assert recorded.rotation == "online_block_hadamard" and sorted(recorded.input_transforms) == sorted(mx)
    assert all(spec["signed"] is False for spec in recorded.input_transforms.values())
    norms = {n: m.weight for n, m in model.named_modules() if n.endswith("layernorm") and ".layers." in n}
    negated = {name for name, scale in norms.items() if (scale < 0).any()}
    assert norms and negated == (set() if family in ("phi3", "gemma3") else set(norms))

    ids = tokenizer(INPUT, return_tensors="pt").input_ids
    assert (ids[0, 0] == tokenizer.bos_token_id) == bos
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path / "dmx")
    saved = json.loads((tmp_path / "dmx" / "config.json").read_text())["quantization_config"]
    assert saved["format_map"] == recorded.format_map and saved["method"] == "dmx"
    code = f"""
import json, torch, optimum_dmx
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "dmx")!r})
with torch.no_grad():
    print(json.dumps(model(torch.tensor({ids.tolist()})).logits.tolist()))
"""
    assert torch.equal(torch.tensor(last_json_line(run_python(code))), logits)


def _mamba():
    config = MambaConfig(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    return MambaForCausalLM(config), 2 * 4


def _gpt_bigcode():
    config = GPTBigCodeConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return GPTBigCodeForCausalLM(config), 2 * 4


def _phimoe():
    config = PhimoeConfig(
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2, **{**COMMON, "num_hidden_layers": 2}
    )
    return PhimoeForCausalLM(config), 2 * (4 + 4 * 3 + 1)


# the linears an MXLinear cannot stand in for, by family: they stay in float
IRREPLACEABLE = {"mamba": "mixer.dt_proj", "phimoe": "mlp.router"}


@pytest.mark.parametrize("family", ["mamba", "phimoe", "gpt_bigcode"])
def test_family_with_linears_a_quantized_layer_cannot_replace_calibrates_and_reloads(tmp_path, family):
    """Mamba's mixer multiplies by `dt_proj.weight` itself, and PhiMoE's router is an `nn.Linear` whose forward pass
    returns the top experts with the logits: those linears stay float (recorded in `modules_to_not_convert`) and the
    rest are quantized. GPT-BigCode's and Mamba's weight initialization, which transformers runs while loading, sets
    linears' weights from the modules holding them: a saved checkpoint loads all the same."""
    torch.manual_seed(0)
    float_model, linears = {"mamba": _mamba, "phimoe": _phimoe, "gpt_bigcode": _gpt_bigcode}[family]()
    float_model.save_pretrained(tmp_path / "float")
    tokenizer = word_tokenizer()
    texts = [words(7 * i, 40) for i in range(20)]
    dmx_config = DMXConfig(target_bits=5, dataset=texts, tokenizer=tokenizer, **CALIBRATION)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=dmx_config)

    mx = {n for n, m in model.named_modules() if isinstance(m, MXLinear)}
    kept = {n for n, m in model.named_modules() if family in IRREPLACEABLE and n.endswith("." + IRREPLACEABLE[family])}
    assert len(kept) == (2 if family in IRREPLACEABLE else 0)
    assert len(mx) == linears - len(kept) and not mx & kept
    recorded = model.config.quantization_config
    assert (IRREPLACEABLE.get(family) in recorded.modules_to_not_convert) == (family in IRREPLACEABLE)
    # within the budget; on it, but for PhiMoE's 6 units (a layer's experts share a format: too coarse to reach it)
    bits = recorded.achieved_bits["bits_weighted"]
    assert bits <= 5 + BUDGET_TOLERANCE + 1e-9 and (family == "phimoe" or bits >= 5 - BUDGET_TOLERANCE - 1e-9)
    ids = tokenizer(INPUT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path / "dmx")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")  # a fresh process: the test above
    assert not any(hasattr(m, "weight") for m in reloaded.modules() if isinstance(m, MXLinear))  # no stand-in left
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


@pytest.mark.parametrize("family", ["gpt_bigcode", "mamba"])
def test_exports_of_families_whose_initialization_reads_a_linears_weight_load_through_load_exported(
    tmp_path, caplog, family
):
    """transformers runs the weight initialization of GPT-BigCode's attention and MLP (`c_proj.weight`) and Mamba's
    mixer (`out_proj.weight`) after loading any checkpoint: on a compressed-tensors export, whose packed layers have
    `weight_packed` and no `weight`, `from_pretrained` alone fails. The export predicts it from the family's own
    initializer (a warning and a model-card note naming the classes), and `load_exported` loads the folder to the
    dMX model's logits. The Quark export of the same model loads to them too: its float linears (Mamba's `dt_proj`,
    kept float here, which the mixer multiplies by itself; `lm_head`) are in Quark's `exclude`, so they stay
    `nn.Linear`s in the model's dtype instead of float32 `QParamsLinear`s."""
    import quark  # noqa: F401  (transformers loads Quark checkpoints through it)

    from optimum_dmx.export import export_checkpoint, load_exported

    torch.manual_seed(0)
    float_model, _ = {"mamba": _mamba, "gpt_bigcode": _gpt_bigcode}[family]()
    float_model.save_pretrained(tmp_path / "float")
    linears = [n for n, m in float_model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    quantized = [n for n in linears if not n.endswith("dt_proj")]
    expected_classes = {"mamba": ["MambaMixer"], "gpt_bigcode": ["GPTBigCodeAttention", "GPTBigCodeMLP"]}[family]
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 127, 0, 3, 42, 7, 11]])
    for target, formats, rule in [
        ("compressed-tensors", ("mxfp4_e2m1", "mxfp8_e4m3"), "compressed-tensors"),
        ("quark", ("mxfp4_e2m1", "mxfp6_e2m3"), "quark"),
    ]:
        # the layers the initializers read (`c_proj`, `out_proj`) packed: MXFP8 keeps a float8 `weight`
        format_map = {name: formats[name.endswith(("c_attn", "in_proj"))] for name in quantized}
        config = DMXConfig(format_map=format_map, scale_rule=rule)
        dmx_dir = tmp_path / f"dmx-{target}"
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config).save_pretrained(dmx_dir)
        caplog.clear()
        with caplog.at_level("WARNING", logger="optimum_dmx"):
            exported = export_checkpoint(dmx_dir, tmp_path / target, target, force=True)
        card = (exported / "README.md").read_text()
        warned = "from_pretrained alone cannot load this export" in caplog.text
        try:
            AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
            loads_alone = True
        except AttributeError as error:
            assert "'weight'" in str(error)
            loads_alone = False
        assert warned == (not loads_alone) == (target == "compressed-tensors"), target
        assert all((f"`{cls}`" in card) == warned for cls in expected_classes)
        loaded = load_exported(exported, dtype=torch.bfloat16)
        ours = AutoModelForCausalLM.from_pretrained(dmx_dir, dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, ours(ids).logits), target
        if target == "quark":
            excluded = json.loads((exported / "config.json").read_text())["quantization_config"]["exclude"]
            assert excluded == sorted(set(linears) - set(quantized) | {"lm_head"})
            for name in excluded:
                module = loaded.get_submodule(name)
                assert type(module) is nn.Linear and module.weight.dtype == torch.bfloat16, name
