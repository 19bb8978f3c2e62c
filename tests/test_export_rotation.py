"""Rotated dMX checkpoints exported to compressed-tensors (the online transforms travel as its `transform_config`)
and to AMD Quark (as its online rotation), applied by the loaders' own code to the model transformers loads (no
mocks)."""

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.transform import TransformConfig, apply_transform_config
from safetensors.torch import load_file, save_file
from scipy.linalg import hadamard
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_dmx import DMXConfig
from optimum_dmx.continuous import get_format_pair
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.export import (
    ExportError,
    export_checkpoint,
    finish_loading,
    get_export_target,
    is_export,
    load_exported,
)

from .helpers import (
    held_out,
    linear_names,
    run_python,
    tiny_decoder,
    transformers_warnings,
    transforms_kept_online,
    word_tokenizer,
    words,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))


def float_model(folder: Path, kind: str, intermediate: int, mlp_bias: bool = False) -> Path:
    """A tiny Llama, Qwen2 or Qwen3 (`helpers.tiny_decoder`) of that MLP size, saved to `folder`."""
    extra = {"mlp_bias": True} if mlp_bias else {}  # Llama only
    tiny_decoder(kind, tied=False, intermediate_size=intermediate, **extra).save_pretrained(folder)
    return folder


# what each target stores: the pair of formats calibrated or mapped for it, and its loaders' scale rule
TARGET_SETTINGS = {
    "compressed-tensors": {"format_pair": "mxfp8-mxfp4", "scale_rule": "compressed-tensors"},
    "quark": {"format_pair": "mxfp6-mxfp4", "scale_rule": "quark"},
}


def servable_map(high: str = "mxfp8_e4m3") -> dict[str, str]:
    """MXFP4 and `high` alternating by layer, fused projections sharing one format (what vLLM serves)."""
    return {
        f"model.layers.{i}.{'self_attn' if p in PROJECTIONS[:4] else 'mlp'}.{p}": (
            high if (i + (p in ("o_proj", "down_proj"))) % 2 else "mxfp4_e2m1"
        )
        for i in range(2)
        for p in PROJECTIONS
    }


def dmx_checkpoint(
    folder: Path, float_dir: Path, rotation: str, learned: bool = False, target: str = "compressed-tensors"
) -> Path:
    """`float_dir` quantized for `target` with `rotation` (an explicit map, or calibrated: learning the rotations
    where they are merged) and saved."""
    settings = TARGET_SETTINGS[target]
    if learned:
        config = DMXConfig(
            target_bits=5,
            dataset=[words(0, 3000, 200)],
            tokenizer=word_tokenizer(num_words=200),
            rotation=rotation,
            learn_rotations=rotation != "online_block_hadamard",
            offset_groups="fused",
            num_samples=8,
            seq_len=16,
            batch_size=2,
            steps=3,
            **settings,
        )
    else:
        high = get_format_pair(settings["format_pair"]).high.name
        config = DMXConfig(format_map=servable_map(high), rotation=rotation, scale_rule=settings["scale_rule"])
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(folder)
    return folder


def signed_everywhere(checkpoint: Path) -> Path:
    """`checkpoint` with the records of its unsigned transforms made signed, as earlier versions drew them."""
    config = json.loads((checkpoint / "config.json").read_text())
    for spec in config["quantization_config"]["input_transforms"].values():
        spec.pop("signed", None)
    (checkpoint / "config.json").write_text(json.dumps(config))
    return checkpoint


def transformed_layers(rotation: str, earlier_version: bool = False) -> list[str]:
    """The layers whose input a checkpoint rotated by `rotation` transforms online, sorted: for
    `online_block_hadamard` every linear but `o_proj`, whose input `v_proj` transforms, or every one in checkpoints
    of earlier versions (`earlier_version`)."""
    if rotation != "online_block_hadamard":
        online = ("down_proj",)
    else:
        online = PROJECTIONS if earlier_version else tuple(p for p in PROJECTIONS if p != "o_proj")
    return sorted(name for name in servable_map() if name.rpartition(".")[2] in online)


@pytest.mark.parametrize(
    "kind, intermediate, rotation, learned, mlp_bias",
    [
        ("llama", 96, "block_hadamard", False, True),  # up_proj's bias takes the signs too
        ("qwen3", 96, "block_hadamard", False, False),
        ("llama", 128, "hadamard", False, False),  # a power of two: one transform of the whole input
        ("llama", 96, "hadamard", True, False),  # 96 = 32 x 3: blocks of 32
        ("qwen3", 96, "block_hadamard", True, False),
        # every linear: signs into the norms (q/k/v, gate/up), o_proj's whole transform into v_proj's rows (2 query
        # heads per value head)
        ("llama", 96, "online_block_hadamard", False, True),
        ("qwen3", 96, "online_block_hadamard", False, False),  # q_norm/k_norm after q/k_proj: untouched
        ("qwen2", 96, "online_block_hadamard", False, False),  # q/k/v biases (Qwen2.5): added after the transform
        ("qwen3", 96, "online_block_hadamard", True, False),  # calibrated, fused offset groups
        # Gemma's norms scale by 1 + weight: q/k/v and gate/up have transforms without signs, down_proj signs that
        # go into up_proj, o_proj's whole transform goes into v_proj
        ("gemma3", 96, "online_block_hadamard", False, False),
    ],
)
def test_rotated_checkpoint_exports_its_transforms_and_loads_to_the_same_logits(
    tmp_path, kind, intermediate, rotation, learned, mlp_bias
):
    float_dir = float_model(tmp_path / "float", kind, intermediate, mlp_bias)
    source = dmx_checkpoint(tmp_path / "dmx", float_dir, rotation, learned)
    exported = export_checkpoint(source, tmp_path / "ct")

    quantization = json.loads((exported / "config.json").read_text())["quantization_config"]
    block = 32 if "block_hadamard" in rotation else intermediate & -intermediate
    transformed = transformed_layers(rotation)
    (scheme_name, scheme), *others = quantization["transform_config"]["config_groups"].items()
    assert not others and scheme["type"] == "hadamard" and scheme["head_dim"] == block
    assert scheme["apply"] == [{"targets": transformed, "location": "input", "inverse": False, "ignore": []}]

    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)  # transformers ignores transforms
    with torch.no_grad():
        expected = ours(IDS).logits
        assert not torch.equal(loaded(IDS).logits, expected)  # without the transforms: another function
        apply_transform_config(loaded, TransformConfig.model_validate(quantization["transform_config"]))
        assert torch.equal(loaded(IDS).logits, expected)

    stored = {k: v for f in exported.glob("*.safetensors") for k, v in load_file(f).items()}
    for layer in transformed:  # the matrices in the files are those compressed-tensors builds (vLLM reads the files)
        transform = loaded.get_submodule(f"{layer}.{scheme_name}_input")
        assert torch.equal(stored[f"{layer}.{scheme_name}_input.weight"], transform.weight.detach().float())


@pytest.mark.parametrize(
    "kind, intermediate, rotation, learned, dtype",
    [
        ("llama", 96, "block_hadamard", False, torch.bfloat16),
        ("qwen3", 96, "block_hadamard", False, torch.bfloat16),
        # a power of two: one transform of the whole input, which Quark computes by a butterfly in the model's dtype
        # (in bfloat16 it rounds at each of its stages, where this package's transform computes in float32)
        ("llama", 128, "hadamard", False, torch.float32),
        ("llama", 96, "hadamard", True, torch.bfloat16),  # 96 = 32 x 3: blocks of 32
        ("llama", 96, "online_block_hadamard", False, torch.bfloat16),  # every linear but o_proj
        ("qwen3", 96, "online_block_hadamard", True, torch.bfloat16),
        ("gemma3", 96, "online_block_hadamard", False, torch.bfloat16),
    ],
)
def test_rotated_checkpoint_exports_to_quark_and_loads_to_the_same_logits(
    tmp_path, kind, intermediate, rotation, learned, dtype
):
    """The online transforms become Quark's online rotation: transformers builds the transformed layers as Quark's
    rotating linears, Quark's `post_process_after_loading` finishes them, and the logits are this package's."""
    float_dir = float_model(tmp_path / "float", kind, intermediate)
    source = dmx_checkpoint(tmp_path / "dmx", float_dir, rotation, learned, target="quark")
    exported = export_checkpoint(source, tmp_path / "quark", "quark")

    quantization = json.loads((exported / "config.json").read_text())["quantization_config"]
    block = 32 if "block_hadamard" in rotation else intermediate & -intermediate
    transformed = transformed_layers(rotation)
    (rotation_config,) = quantization["algo_config"]
    assert rotation_config["rotation_size"] == block and not rotation_config["trainable"]
    assert rotation_config["online_config"]["online_rotation_layers"] == transformed

    ours = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=dtype)
    rotating = sorted(name for name, module in loaded.named_modules() if hasattr(module, "input_rotation"))
    assert rotating == transformed
    stored = {k: v for f in exported.glob("*.safetensors") for k, v in load_file(f).items()}
    for layer in transformed:  # the +-1 matrices Quark builds (scipy's), in the int8 it serializes them as
        assert torch.equal(stored[f"{layer}.input_rotation"], torch.tensor(hadamard(block), dtype=torch.int8))
        loaded.get_submodule(layer).post_process_after_loading()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, ours(IDS).logits)


@pytest.mark.parametrize("target", ["compressed-tensors", "quark"])
def test_a_checkpoint_with_its_signs_online_exports_them_into_the_layers_and_norms_producing_the_inputs(
    tmp_path, target
):
    """Earlier versions kept every online transform's random signs in the transform (this one moves them into the
    modules producing the inputs when it rotates). Their checkpoints still export: the norms' scales, `v_proj`'s
    rows (one copy per value head) and `up_proj`'s rows and bias take the signs, the loaders apply plain Hadamard
    transforms, and the logits are the dMX model's."""
    float_dir = float_model(tmp_path / "float", "llama", 96, mlp_bias=True)
    with transforms_kept_online(signs=True):
        source = dmx_checkpoint(tmp_path / "dmx", float_dir, "online_block_hadamard", target=target)
    transforms = json.loads((source / "config.json").read_text())["quantization_config"]["input_transforms"]
    assert sorted(transforms) == transformed_layers("online_block_hadamard", earlier_version=True)
    assert all("signed" not in spec for spec in transforms.values())  # signed, as those versions recorded them
    exported = export_checkpoint(source, tmp_path / "out", target)

    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    quantization = json.loads((exported / "config.json").read_text())["quantization_config"]
    if target == "compressed-tensors":
        apply_transform_config(loaded, TransformConfig.model_validate(quantization["transform_config"]))
    else:
        for layer in transformed_layers("online_block_hadamard", earlier_version=True):
            loaded.get_submodule(layer).post_process_after_loading()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, ours(IDS).logits)
    norm = "model.layers.0.input_layernorm.weight"  # the float norm scales: negated where the signs went
    stored = {k: v for f in exported.glob("*.safetensors") for k, v in load_file(f).items()}
    saved = {k: v for f in source.glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(stored[norm].abs(), saved[norm].abs()) and not torch.equal(stored[norm], saved[norm])


def test_rotations_a_target_cannot_express_are_refused_naming_the_layer(tmp_path):
    float_dir = float_model(tmp_path / "float", "llama", 96)
    # A checkpoint of an earlier version, whose "hadamard" transform was full size: 96 = 32 x 3, an odd factor
    full = dmx_checkpoint(tmp_path / "hadamard", float_dir, "hadamard")
    config = json.loads((full / "config.json").read_text())
    for spec in config["quantization_config"]["input_transforms"].values():
        spec["block_size"] = spec["size"]
    (full / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"model\.layers\.0\.mlp\.down_proj's online transform .* random orthogonal"):
        export_checkpoint(full, tmp_path / "out")
    # online_block_hadamard of an earlier version: o_proj's signs differ between the 2 query heads of a value head
    with transforms_kept_online(signs=True):
        every = dmx_checkpoint(tmp_path / "online", float_dir, "online_block_hadamard")
    config = json.loads((every / "config.json").read_text())
    transforms = config["quantization_config"]["input_transforms"]
    for spec in transforms.values():
        spec.pop("sign_copies", None)
    (every / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"layers\.0\.self_attn\.o_proj's online transform has different signs"):
        export_checkpoint(every, tmp_path / "out")
    transforms["model.layers.0.self_attn.o_proj"]["sign_copies"] = [2, 32]
    transforms["model.layers.1.self_attn.o_proj"]["sign_copies"] = [2, 32]
    transforms["model.layers.1.self_attn.k_proj"]["seed"] += 1  # k_proj's signs no longer those of q/v_proj
    (every / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ExportError, match=r"layers\.1\.self_attn\.k_proj reads .*input_layernorm .*q_proj reads it too"
    ):
        export_checkpoint(every, tmp_path / "out")
    # online_block_hadamard of an earlier version on Gemma 3: signs on the linears reading its `1 + weight` norms
    gemma = signed_everywhere(
        dmx_checkpoint(tmp_path / "gemma", float_model(tmp_path / "gemma3", "gemma3", 96), "online_block_hadamard")
    )
    with pytest.raises(
        ExportError, match=r"layers\.0\.pre_feedforward_layernorm \(Gemma3RMSNorm\) does not output its weight"
    ):
        export_checkpoint(gemma, tmp_path / "out")
    sizes = dmx_checkpoint(tmp_path / "sizes", float_model(tmp_path / "pow2", "llama", 128), "hadamard", target="quark")
    config = json.loads((sizes / "config.json").read_text())
    config["quantization_config"]["input_transforms"]["model.layers.1.mlp.down_proj"]["block_size"] = 64
    (sizes / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"one rotation_size.*layers\.1\.mlp\.down_proj blocks of 64.*of 128"):
        export_checkpoint(sizes, tmp_path / "out", "quark")
    with pytest.raises(ExportError, match=r"quark cannot carry .*pre_feedforward_layernorm \(Gemma3RMSNorm\)"):
        export_checkpoint(
            signed_everywhere(
                dmx_checkpoint(tmp_path / "gemma-quark", tmp_path / "gemma3", "online_block_hadamard", target="quark")
            ),
            tmp_path / "out",
            "quark",
        )
    assert not (tmp_path / "out").exists()


def test_signs_an_mlp_without_a_gate_cannot_pass_on_are_refused(tmp_path):
    """Nemotron's MLP is `down_proj(relu(up_proj(x)) ** 2)`: a sign of `up_proj`'s output does not reach
    `down_proj`'s input. This version draws no signs there; a checkpoint of an earlier version, which did, is refused
    instead of exported with signs in `up_proj`'s rows that would change the model's function."""
    from .test_transformers_families import SMALL

    torch.manual_seed(0)
    float_dir = tmp_path / "nemotron"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron", **SMALL)).save_pretrained(float_dir)
    names = linear_names(AutoModelForCausalLM.from_pretrained(float_dir))
    format_map = dict.fromkeys(names, "mxfp8_e4m3")
    config = DMXConfig(format_map=format_map, rotation="online_block_hadamard", scale_rule="compressed-tensors")
    checkpoint = tmp_path / "dmx"
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(checkpoint)
    transforms = json.loads((checkpoint / "config.json").read_text())["quantization_config"]["input_transforms"]
    assert transforms["model.layers.0.mlp.down_proj"]["signed"] is False  # drew none
    assert transforms["model.layers.0.self_attn.o_proj"]["signed"] is False  # its signs are in v_proj's rows
    export_checkpoint(checkpoint, tmp_path / "exported")
    with pytest.raises(ExportError, match=r"layers\.0\.mlp\.down_proj's online transform has random signs, and "):
        export_checkpoint(signed_everywhere(checkpoint), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("target, how", [("compressed-tensors", "apply_transform_config"), ("quark", "post_process")])
def test_the_exported_model_card_says_how_to_apply_the_transforms(tmp_path, caplog, target, how):
    """transformers loads neither target's transforms finished: the card's loading snippet says the model is not
    finished without them, its section shows the call, and the export warns, pointing at the card."""
    float_dir = float_model(tmp_path / "float", "llama", 96)
    source = dmx_checkpoint(tmp_path / "dmx", float_dir, "block_hadamard", target=target)
    with caplog.at_level(logging.WARNING, logger="optimum_dmx.export.checkpoint"):
        card = (export_checkpoint(source, tmp_path / "out", target) / "README.md").read_text()
    assert how in card and "2 layers" in card
    loading = card.split("## Load with transformers")[1].split("## Online transforms")[0]
    assert "not finished until its online transforms are applied" in loading
    on_load = get_export_target(target).transforms_on_load
    assert on_load in card
    assert any(on_load in message and "README.md" in message for message in caplog.messages)
    plain = (
        export_checkpoint(dmx_checkpoint(tmp_path / "plain", float_dir, "none", target=target), tmp_path / "p", target)
        / "README.md"
    ).read_text()
    assert "online transforms" not in plain
    if target == "compressed-tensors":  # transformers' load report calls the stored matrices unexpected
        assert "`*_input.weight`, which vLLM loads) as UNEXPECTED" in card


@pytest.mark.slow
@pytest.mark.parametrize("rotation", ["block_hadamard", "online_block_hadamard"])
def test_a_rotated_grouped_5_bit_smollm2_export_loads_with_its_transforms_in_a_fresh_process(bench, tmp_path, rotation):
    """The configuration a vLLM user runs, on the real model: SmolLM2-135M calibrated to 5 bits with learned
    block rotations (or online transforms on every input: SmolLM2 has 3 query heads per value head), fused offset
    groups and compressed-tensors' scale rule (a short calibration: the export is under test, not the map), exported
    unforced, then loaded by transformers + compressed-tensors in a fresh process with the transforms applied by
    compressed-tensors' code: the same logits as this package's model, bit for bit.

    (`rotation="hadamard"` transforms blocks of 512 here, as two matrix products of 8 and 64; compressed-tensors
    makes one product of 512, whose sums round differently: close logits, not the same bits.)"""
    from transformers import AutoTokenizer

    folder, texts = bench.benchmark_model(), bench.benchmark_texts()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = DMXConfig(
        target_bits=5,
        dataset=[path.read_text() for path in texts.calibration],
        tokenizer=tokenizer,
        rotation=rotation,
        learn_rotations=rotation == "block_hadamard",
        offset_groups="fused",
        scale_rule="compressed-tensors",
        num_samples=8,
        seq_len=128,
        batch_size=4,
        steps=6,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=config)
    model.save_pretrained(tmp_path / "dmx")
    exported = export_checkpoint(tmp_path / "dmx", tmp_path / "ct")
    transforms = json.loads((exported / "config.json").read_text())["quantization_config"]["transform_config"]
    assert [scheme["head_dim"] for scheme in transforms["config_groups"].values()] == [32]

    ids = tokenizer(held_out(texts, "pride_prejudice")[:2000], return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx", dtype=torch.bfloat16)(ids).logits
    torch.save(ids, tmp_path / "ids.pt")
    run_python(f"""
import json, torch
from compressed_tensors.transform import TransformConfig, apply_transform_config
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging
model = AutoModelForCausalLM.from_pretrained({str(exported)!r}, dtype=torch.bfloat16)
config = json.load(open({str(exported / "config.json")!r}))["quantization_config"]["transform_config"]
apply_transform_config(model, TransformConfig.model_validate(config))
with torch.no_grad():
    torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})).logits, {str(tmp_path / "served.pt")!r})
""")
    assert torch.equal(torch.load(tmp_path / "served.pt"), expected)


def quark_and_our_logits(folder: Path, texts, dmx: Path, exported: Path) -> tuple[torch.Tensor, ...]:
    """Logits on a 128-token held-out passage of the Quark export as Quark finishes it (bfloat16), and of this
    package's checkpoint `dmx` in bfloat16 and float32."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(held_out(texts, "pride_prejudice")[:2000], return_tensors="pt")
    ids = ids.input_ids[:, :128]
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    for module in loaded.modules():
        if hasattr(module, "input_rotation"):
            module.post_process_after_loading()
    with torch.no_grad():
        served = loaded(ids).logits.float()
        ours = AutoModelForCausalLM.from_pretrained(dmx, dtype=torch.bfloat16)(ids).logits.float()
        return served, ours, AutoModelForCausalLM.from_pretrained(dmx, dtype=torch.float32)(ids).logits


@pytest.mark.slow
def test_a_hadamard_rotated_smollm2_exported_to_quark_computes_our_function_to_bfloat16_noise(bench, tmp_path):
    """SmolLM2-135M with the `"hadamard"` rotation (its down_proj transform on blocks of 512), every layer MXFP6 E2M3
    under Quark's scale rule, exported to Quark and finished by Quark's `post_process_after_loading`. Quark's transform
    is one matrix product of 512, this package's two smaller ones: their sums round differently, and a few activations
    then round to another MX value. On a held-out passage the served logits stay closer to this package's bfloat16
    logits than those are to its own float32 ones (measured: mean difference 0.50 against 0.73, of logits up to 34)."""
    folder, texts = bench.benchmark_model(), bench.benchmark_texts()
    format_map = {name: "mxfp6_e2m3" for name in linear_names(AutoModelForCausalLM.from_pretrained(folder))}
    config = DMXConfig(format_map=format_map, rotation="hadamard", scale_rule="quark")
    AutoModelForCausalLM.from_pretrained(folder, quantization_config=config).save_pretrained(tmp_path / "dmx")
    exported = export_checkpoint(tmp_path / "dmx", tmp_path / "quark", "quark")
    (rotation_config,) = json.loads((exported / "config.json").read_text())["quantization_config"]["algo_config"]
    assert rotation_config["rotation_size"] == 512

    served, ours, ours_float32 = quark_and_our_logits(folder, texts, tmp_path / "dmx", exported)
    assert (served - ours).abs().mean() < (ours_float32 - ours).abs().mean()


@pytest.mark.slow
def test_an_online_rotated_smollm2_exported_to_quark_computes_our_function_to_bfloat16_noise(bench, tmp_path):
    """SmolLM2-135M with `"online_block_hadamard"` (32-block transforms on every quantized input, `o_proj`'s merged
    into `v_proj`'s rows; 3 query heads per value head), MXFP6 E2M3 and MXFP4 alternating by decoder layer under
    Quark's scale rule, exported to Quark and finished by Quark's `post_process_after_loading`. Quark multiplies by
    the normalized Hadamard matrix (entries `1 / sqrt(32)` rounded to float32), this package adds and subtracts and
    divides once (as compressed-tensors): about one transformed bfloat16 value in a million differs, and then an MX
    value. On a held-out passage the served logits stay within a tenth of the distance between this package's
    bfloat16 and float32 logits (measured with `o_proj`'s transform online: mean difference 0.012 against 1.32, 93%
    of the logits bit-equal, the largest difference 1.0 of logits up to 34)."""
    folder, texts = bench.benchmark_model(), bench.benchmark_texts()
    names = linear_names(AutoModelForCausalLM.from_pretrained(folder))
    format_map = {name: ("mxfp6_e2m3" if int(name.split(".")[2]) % 2 else "mxfp4_e2m1") for name in names}
    config = DMXConfig(format_map=format_map, rotation="online_block_hadamard", scale_rule="quark")
    AutoModelForCausalLM.from_pretrained(folder, quantization_config=config).save_pretrained(tmp_path / "dmx")
    exported = export_checkpoint(tmp_path / "dmx", tmp_path / "quark", "quark")
    (rotation_config,) = json.loads((exported / "config.json").read_text())["quantization_config"]["algo_config"]
    assert rotation_config["rotation_size"] == 32
    online = sorted(name for name in names if not name.endswith("o_proj"))
    assert sorted(rotation_config["online_config"]["online_rotation_layers"]) == online

    served, ours, ours_float32 = quark_and_our_logits(folder, texts, tmp_path / "dmx", exported)
    assert (served - ours).abs().mean() < 0.1 * (ours_float32 - ours).abs().mean()


@pytest.mark.parametrize("target", ["compressed-tensors", "quark"])
def test_load_exported_finishes_the_transforms_as_the_loader_does(tmp_path, target):
    """`load_exported` gives this package's logits where a plain `from_pretrained` gives another function
    (compressed-tensors) or a model that cannot run (Quark); finishing an already finished model changes nothing;
    a folder that is not an export is refused by name."""
    float_dir = float_model(tmp_path / "float", "llama", 96)
    source = dmx_checkpoint(tmp_path / "dmx", float_dir, "block_hadamard", target=target)
    exported = export_checkpoint(source, tmp_path / "out", target)
    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    loaded = load_exported(exported, dtype=torch.bfloat16)
    quantization = json.loads((exported / "config.json").read_text())["quantization_config"]
    with torch.no_grad():
        expected = ours(IDS).logits
        assert torch.equal(loaded(IDS).logits, expected)
        if target == "compressed-tensors":
            assert finish_loading(loaded, quantization) == 0  # the transforms are attached already
            assert torch.equal(loaded(IDS).logits, expected)
            unfinished = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
            assert not torch.equal(unfinished(IDS).logits, expected)
            assert finish_loading(unfinished, quantization) == len(transformed_layers("block_hadamard"))
            assert torch.equal(unfinished(IDS).logits, expected)
    assert is_export(exported) and not is_export(source)
    with pytest.raises(ValueError, match=r"is not an exported checkpoint: its quant_method is 'dmx'"):
        load_exported(source)


def test_load_exported_checks_the_stored_transform_matrices_instead_of_reporting_them(tmp_path):
    """transformers builds no compressed-tensors transform modules, so its load report calls the transform matrices a
    compressed-tensors export stores (which vLLM loads) unexpected; `load_exported` leaves them out of the report and
    checks each against the matrix compressed-tensors built for its layer, refusing, by name, a stored matrix that
    differs or that no transform of the config is attached to."""
    float_dir = float_model(tmp_path / "float", "llama", 96)
    source = dmx_checkpoint(tmp_path / "dmx", float_dir, "block_hadamard", target="compressed-tensors")
    exported = export_checkpoint(source, tmp_path / "out", "compressed-tensors")
    stored = [f"{layer}.dmx_hadamard_32_input.weight" for layer in transformed_layers("block_hadamard")]
    with transformers_warnings() as plain_load:
        AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    (report,) = [message for message in plain_load if "LOAD REPORT" in message]
    assert "UNEXPECTED" in report and "dmx_hadamard_32_input.weight" in report
    with transformers_warnings() as loading:
        load_exported(exported, dtype=torch.bfloat16)
    assert not [message for message in loading if "LOAD REPORT" in message]

    tensors = load_file(exported / "model.safetensors")
    assert sorted(name for name in tensors if "_input." in name) == stored
    tensors[stored[-1]][0, 0] *= -1
    save_file(tensors, exported / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(stored[-1])}.* not the matrix compressed-tensors built"):
        load_exported(exported, dtype=torch.bfloat16)
    tensors[stored[-1]][0, 0] *= -1
    untransformed = "model.layers.0.self_attn.o_proj.dmx_hadamard_32_input.weight"
    tensors[untransformed] = tensors[stored[0]].clone()
    save_file(tensors, exported / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(untransformed)}.* attached no transform to its layer"):
        load_exported(exported, dtype=torch.bfloat16)


def transformed_checkpoint(
    folder: Path, layout: str, kind: str, randomize: bool, seed: int | None, fp8: bool = False
) -> tuple[Path, torch.Tensor]:
    """A tiny Llama rotated by compressed-tensors' own transform factories (drawing from a generator seeded with
    `seed`, or from its default one as `apply_transform_config` does) as llm-compressor rotates a model (`layout`,
    `transform_layouts`; transforms of `kind`, blocks of 32 where online), saved with the `transform_config` its
    `ModelCompressor` writes; with `fp8`, its linears (but `lm_head`) then quantized by compressed-tensors to its
    `FP8_DYNAMIC` scheme (weights per output channel, their scales from each row's range) and compressed; with the
    rotated (and quantized) model's logits on `IDS`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.transform import TransformFactory
    from compressed_tensors.transform.apply import _register_tied_transform_weights

    model = tiny_decoder("llama", tied=False)
    config = TransformConfig.model_validate(transform_layouts(kind, randomize)[layout])
    if seed is None:
        apply_transform_config(model, config)
    else:
        for name, transforms in config.config_groups.items():  # `apply_transform_config` with seeded factories
            TransformFactory.from_scheme(transforms, name=name, seed=seed).apply_to_model(model, use_tqdm=False)
        _register_tied_transform_weights(model)
        model.transform_config = config
    if fp8:
        fp8_dynamic(model)
    with torch.no_grad():
        logits = model(IDS).logits
    compressor = ModelCompressor.from_pretrained_model(model)
    if fp8:
        compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return folder, logits


def fp8_dynamic(model: torch.nn.Module) -> None:
    """Quantize `model`'s linears but `lm_head` to compressed-tensors' `FP8_DYNAMIC` scheme, as llm-compressor does
    without calibration data: each weight row's scale from its range (`calculate_qparams`), activations dynamic."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                rows = module.weight
                low, high = rows.amin(1, keepdim=True).clamp(max=0), rows.amax(1, keepdim=True).clamp(min=0)
                scale, _ = calculate_qparams(low, high, module.quantization_scheme.weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))


def transform_layouts(kind: str, randomize: bool) -> dict[str, dict]:
    """Where llm-compressor's QuIP and SpinQuant modifiers put their transforms: QuIP's "v" online on each linear's
    input and merged into its weight, "u" merged into its weight's output and online on its output; SpinQuant's R1
    (residual) and R2 (per head) merged, R3 online on the queries and keys, R4 online on `down_proj`'s input; R1 and
    R2 alone (`spinquant-merged`). Without the modifiers' folding of the norms' scales into the next weights, the
    rotated model computes another function than the float one: what matters here is that it is saved and loaded."""

    def scheme(*apply: tuple[list[str], str, bool], head_dim: int | None = 32) -> dict:
        return {
            "type": kind,
            "randomize": randomize,
            "head_dim": head_dim,
            "precision": "torch.float64",
            "apply": [
                {"targets": t, "location": where, "inverse": inverse, "ignore": "lm_head" if t == ["Linear"] else []}
                for t, where, inverse in apply
            ],
        }

    linear, attention = ["Linear"], ["re:.*self_attn$"]
    readers = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    merged = {
        "R1": scheme(
            (["embed_tokens", "o_proj", "down_proj"], "weight_output", False),
            ([*readers, "lm_head"], "weight_input", True),
            head_dim=None,
        ),
        "R2": scheme((["v_proj"], "weight_output", False), (["o_proj"], "weight_input", True)),
    }
    return {
        "quip": {
            "config_groups": {
                "v": scheme((linear, "input", False), (linear, "weight_input", True)),
                "u": scheme((linear, "weight_output", False), (linear, "output", True)),
            }
        },
        "spinquant": {
            "config_groups": {
                **merged,
                "R3": scheme((attention, "q_attn", False), (attention, "k_cache", False)),
                "R4": scheme((["down_proj"], "input", False), (["down_proj"], "weight_input", True)),
            }
        },
        "spinquant-merged": {"config_groups": merged},  # SpinQuantModifier's default rotations: nothing online
    }


@pytest.mark.parametrize(
    "layout, kind, randomize, seed, fp8",
    [
        ("quip", "hadamard", False, None, False),  # the matrices the configuration determines
        ("quip", "hadamard", True, 7, False),  # and random permutations of them
        ("quip", "random-hadamard", False, None, False),  # what llm-compressor's QuIPModifier writes by default
        ("quip", "random-hadamard", False, None, True),  # and with the FP8 weights it would quantize them to
        ("quip", "random-hadamard", False, 7, False),
        ("quip", "random-matrix", False, 7, False),
        ("spinquant", "random-hadamard", False, 7, False),  # online transforms of attention's queries and keys too
        ("spinquant-merged", "random-hadamard", False, None, False),
    ],
)
def test_load_exported_computes_what_a_third_party_transformed_checkpoint_was_saved_computing(
    tmp_path, layout, kind, randomize, seed, fp8
):
    """A compressed-tensors checkpoint with online and merged transforms (`transformed_checkpoint`) loads to exactly the
    model that was saved: the merged transforms are not applied to the stored weights a second time, and the stored
    random matrices and permutations, which the configuration does not determine, are the ones computed with; no
    stored transform tensor is reported as unexpected."""
    folder, saved = transformed_checkpoint(tmp_path / layout, layout, kind, randomize, seed, fp8)
    stored = load_file(folder / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert stored.dtype == (torch.float8_e4m3fn if fp8 else torch.float32)
    with transformers_warnings() as loading:
        loaded = load_exported(folder)
    assert not [message for message in loading if "LOAD REPORT" in message]
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, saved)


def test_a_stored_transform_differing_from_its_shared_one_gets_its_layer_a_tensor_of_its_own(tmp_path):
    """compressed-tensors shares one transform matrix between the layers of one size and stores it once; a matrix
    stored for another of those layers (as vLLM reads one per layer) is that layer's alone, and one of another shape
    is refused by name."""
    folder, _ = transformed_checkpoint(tmp_path / "quip", "quip", "random-hadamard", False, 7)
    tensors = load_file(folder / "model.safetensors")
    shared = "model.layers.0.self_attn.q_proj.v_input.weight"
    own = "model.layers.0.self_attn.k_proj.v_input.weight"  # the same size: q_proj's matrix, not stored
    assert shared in tensors and own not in tensors
    tensors[own] = -tensors[shared]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = load_exported(folder)
    assert torch.equal(loaded.get_parameter(shared), tensors[shared])
    assert torch.equal(loaded.get_parameter(own), tensors[own])
    assert torch.equal(loaded.get_parameter(own.replace("k_proj", "v_proj")), tensors[shared])

    tensors[own] = tensors[own][:16, :16].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=rf"{re.escape(own)}.* shape is \(16, 16\), the attached transform's \(32, 32\)"
    ):
        load_exported(folder)


@pytest.mark.parametrize("target", ["compressed-tensors", "quark"])
def test_the_command_line_evaluates_an_export_with_its_transforms(tmp_path, target):
    """`optimum-dmx eval` on an export measures the finished model: this package's perplexity for the checkpoint
    it was exported from (bfloat16, equal logits), not the unfinished model's."""
    float_dir = float_model(tmp_path / "float", "llama", 96)
    source = dmx_checkpoint(tmp_path / "dmx", float_dir, "block_hadamard", target=target)
    tokenizer = word_tokenizer()
    tokenizer.save_pretrained(source)
    exported = export_checkpoint(source, tmp_path / "out", target)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words(7 * i, 40) for i in range(8)))
    result = subprocess.run(
        [sys.executable, "-m", "optimum_dmx", "eval", exported, "--text", text, "--seq-len", "16"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    printed = float(re.search(r"perplexity (\S+)", result.stdout).group(1))
    ours = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    expected = evaluate_perplexity(ours, tokenizer, text.read_text(), seq_len=16).perplexity
    assert printed == pytest.approx(expected, abs=1e-4)
    if target == "compressed-tensors":
        unfinished = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
        assert evaluate_perplexity(unfinished, tokenizer, text.read_text(), seq_len=16).perplexity != pytest.approx(
            expected, rel=1e-3
        )
