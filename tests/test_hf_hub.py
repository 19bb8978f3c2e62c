"""Pushing to and loading from the Hub with the real huggingface_hub client, against a local Hub server."""

import json

import torch
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig

from .helpers import INPUT_IDS, cycling_format_map, run_python


def test_push_to_hub_then_from_pretrained_round_trips(tmp_path, tiny_llama_dir, local_hub):
    format_map = cycling_format_map(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=DMXConfig(format_map=format_map))
    model.save_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        logits = model(INPUT_IDS).logits

    def hub_env(name: str) -> dict[str, str]:  # a fresh cache per process: downloads really come from the server
        return {
            "HF_ENDPOINT": local_hub.endpoint,
            "HF_HUB_DISABLE_XET": "1",
            "HF_TOKEN": "hf_local_test",
            "HF_HOME": str(tmp_path / name),
        }

    # the model's push_to_hub, and DMXQuantizer.push_to_hub with extra card facts: both upload the dMX card
    run_python(
        f"""
import optimum_dmx
from optimum_dmx.integration.model_card import ModelCardInfo
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "dmx")!r})
model.push_to_hub("user/tiny-llama-dmx")
quantizer = optimum_dmx.DMXQuantizer(model.config.quantization_config)
quantizer.push_to_hub(model, "user/tiny-llama-dmx-card", ModelCardInfo(base_model="tests/tiny-llama"))
""",
        env=hub_env("pusher"),
    )
    for repo_id in ("user/tiny-llama-dmx", "user/tiny-llama-dmx-card"):
        uploaded = local_hub.state.repos[repo_id]
        assert {"config.json", "model.safetensors", "README.md"} <= set(uploaded)
        assert uploaded["model.safetensors"] == (tmp_path / "dmx" / "model.safetensors").read_bytes()
        assert json.loads(uploaded["config.json"])["quantization_config"]["format_map"] == format_map
        card = uploaded["README.md"].decode()
        assert "- dmx" in card and "## Format per layer" in card and "dmx_format_map.png" in uploaded
        assert f'from_pretrained("{repo_id}")' in card  # the loading snippet names the repo
    assert "tiny-llama dMX" in local_hub.state.repos["user/tiny-llama-dmx-card"]["README.md"].decode()
    # model.save_pretrained wrote the card too; a local folder has no repo id for the loading snippet yet
    assert "path/to/this/model" in (tmp_path / "dmx" / "README.md").read_text()

    run_python(
        f"""
import torch, optimum_dmx
from transformers import AutoModelForCausalLM
for i, repo_id in enumerate(["user/tiny-llama-dmx", "user/tiny-llama-dmx-card"]):
    model = AutoModelForCausalLM.from_pretrained(repo_id)
    with torch.no_grad():
        torch.save(model(torch.tensor({INPUT_IDS.tolist()})).logits, {str(tmp_path)!r} + f"/logits{{i}}.pt")
""",
        env=hub_env("downloader"),
    )
    for i in range(2):
        assert torch.equal(torch.load(tmp_path / f"logits{i}.pt"), logits)


def test_push_to_hub_arguments_reach_the_hub_client(tmp_path, tiny_llama_dir, local_hub):
    format_map = cycling_format_map(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=DMXConfig(format_map=format_map))
    model.save_pretrained(tmp_path / "dmx")
    run_python(
        f"""
import optimum_dmx
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "dmx")!r})
model.push_to_hub("user/private-dmx", commit_message="first dMX upload", commit_description="why: a test",
                  private=True, revision="dev", tags=["my-tag"])
model.push_to_hub("user/public-dmx", private=False)
""",
        env={
            "HF_ENDPOINT": local_hub.endpoint,
            "HF_HUB_DISABLE_XET": "1",
            "HF_TOKEN": "hf_local_test",
            "HF_HOME": str(tmp_path / "home"),
        },
    )
    state = local_hub.state
    assert state.visibility == {"user/private-dmx": "private", "user/public-dmx": "public"}
    first, second = state.commits
    assert first == {
        "repo_id": "user/private-dmx",
        "revision": "dev",
        "summary": "first dMX upload",
        "description": "why: a test",
    }
    assert (second["repo_id"], second["revision"], second["summary"]) == (
        "user/public-dmx",
        "main",
        "Upload dMX-quantized model",
    )
    card = state.repos["user/private-dmx"]["README.md"].decode()
    assert "- my-tag" in card and "- dmx" in card


def test_the_model_card_hooks_leave_no_reference_cycle(tiny_llama_dir):
    """Deleting a dMX model frees it at once (no garbage collection needed), like any transformers model."""
    import gc
    import weakref

    gc.disable()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, quantization_config=DMXConfig(format_map=cycling_format_map(tiny_llama_dir))
        )
        float_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        assert type(model).save_pretrained is not type(float_model).save_pretrained  # the card hooks are in place
        dmx_ref, float_ref = weakref.ref(model), weakref.ref(float_model)
        del model, float_model
        assert float_ref() is None, "transformers itself keeps a cycle: this check says nothing"
        assert dmx_ref() is None
    finally:
        gc.enable()
