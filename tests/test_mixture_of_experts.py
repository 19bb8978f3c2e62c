"""Mixture-of-experts models: transformers keeps their experts as 3-D tensors, not `nn.Linear` layers, so dMX
cannot quantize them. Quantizing such a model is refused before its weights load, naming the modules and the
pattern that keeps them in float; with that pattern the other linears calibrate, and the experts stay as they were.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from optimum_dmx import DMXConfig, DMXQuantizer, MXLinear
from optimum_dmx.nn import packed_weight_modules

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
CALIBRATION = dict(steps=4, seq_len=16, batch_size=2, num_samples=8)
INPUT = [[1, 5, 9, 17, 33, 65, 99, 3]]


def save_float(family: str, folder) -> nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return model


def dmx_config(**overrides) -> DMXConfig:
    texts = [words(7 * i, 40) for i in range(20)]
    return DMXConfig(target_bits=5, dataset=texts, tokenizer=word_tokenizer(), **CALIBRATION, **overrides)


def expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".experts." in name}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantizing_packed_experts_is_refused_before_loading_naming_the_way_out(tmp_path, family):
    model = save_float(family, tmp_path / "float")
    packed = packed_weight_modules(model, ["lm_head"])
    assert sorted(packed) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    attention = sum(
        p.numel() for name, p in model.named_parameters() if "self_attn" in name and name.endswith("proj.weight")
    )

    with pytest.raises(ValueError) as raised:
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=dmx_config())
    message = str(raised.value)
    assert f"{experts / (experts + attention):.0%} of the weights" in message
    assert "model.layers.0.mlp.experts" in message and type(model.model.layers[0].mlp.experts).__name__ in message
    assert "['mlp.experts'] to modules_to_not_convert" in message
    assert "--modules-to-not-convert mlp.experts" in message
    # Raised by the hook that runs before any weight is read: the traceback never reached calibration.
    assert raised.traceback[-1].name == "_check_quantizable"
    assert "_process_model_before_weight_loading" in [entry.name for entry in raised.traceback]

    with pytest.raises(ValueError, match="modules_to_not_convert"):
        DMXQuantizer(dmx_config()).quantize_model(model)  # an already-loaded model: refused the same way
    assert not any(isinstance(m, MXLinear) for m in model.modules())


def test_packed_weight_modules_leave_out_convolutions_and_skipped_modules():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Linear(4, 4))
    assert packed_weight_modules(model, []) == {}  # a convolution's 4-D weight is not a packed expert
    model = FAMILIES["qwen3_moe"]()
    assert packed_weight_modules(model, ["mlp.experts"]) == {}
    assert list(packed_weight_modules(model, ["model.layers.0"])) == ["model.layers.1.mlp.experts"]
    assert packed_weight_modules(model, [])["model.layers.1.mlp.experts"] == {
        "gate_up_proj": (4, 64, 64),
        "down_proj": (4, 64, 32),
    }


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
    kept = expert_weights(model)
    assert kept and all(torch.equal(kept[name], w) for name, w in expert_weights(float_model).items())

    with torch.no_grad():
        logits = model(torch.tensor(INPUT)).logits
    model.save_pretrained(tmp_path / "dmx")
    saved = json.loads((tmp_path / "dmx" / "config.json").read_text())["quantization_config"]
    assert "mlp.experts" in saved["modules_to_not_convert"]
    with safe_open(tmp_path / "dmx" / "model.safetensors", "pt") as f:  # transformers' per-expert layout, float
        stored = {name: f.get_tensor(name).dtype for name in f.keys() if ".experts." in name}
    assert len(stored) == 2 * 4 * 3 and set(stored.values()) == {torch.float32}, stored
    code = f"""
import json, torch, optimum_dmx
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "dmx")!r})
with torch.no_grad():
    print(json.dumps(model(torch.tensor({INPUT})).logits.tolist()))
"""
    assert torch.equal(torch.tensor(last_json_line(run_python(code))), logits)


def test_the_command_line_names_the_flag_and_takes_it(tmp_path):
    save_float("qwen3_moe", tmp_path / "float")
    (tmp_path / "calibration.txt").write_text("\n".join(words(7 * i, 40) for i in range(20)))
    command = [sys.executable, "-m", "optimum_dmx", "quantize", str(tmp_path / "float"), "--dataset"]
    command += [str(tmp_path / "calibration.txt"), "--steps", "4", "--seq-len", "16", "--batch-size", "2"]
    command += ["--num-samples", "8", "--weight-rounding", "rtn"]

    refused = subprocess.run([*command, "--output", str(tmp_path / "a")], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "--modules-to-not-convert mlp.experts" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "a").exists()

    done = subprocess.run(
        [*command, "--modules-to-not-convert", "mlp.experts", "--output", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert "mlp.experts" in saved["modules_to_not_convert"] and len(saved["format_map"]) == 8
