"""push_to_hub and from_pretrained(repo_id) through the real huggingface_hub client, against a local Hub server."""

import json

import torch
from transformers import AutoModelForCausalLM

from .hf_utils import INPUT_IDS, cycling_format_map, run_python
from optimum_dmx import DMXConfig


def test_push_to_hub_then_from_pretrained_round_trips(tmp_path, tiny_llama_dir, local_hub):
    format_map = cycling_format_map(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=DMXConfig(format_map=format_map))
    model.save_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        logits = model(INPUT_IDS).logits

    def hub_env(name: str) -> dict[str, str]:  # a fresh cache per process: downloads really come from the server
        return {"HF_ENDPOINT": local_hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_local_test",
                "HF_HOME": str(tmp_path / name)}

    run_python(
        f"""
import optimum_dmx
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({str(tmp_path / "dmx")!r}).push_to_hub("user/tiny-llama-dmx")
""",
        env=hub_env("pusher"),
    )
    uploaded = local_hub.state.repos["user/tiny-llama-dmx"]
    assert {"config.json", "model.safetensors", "README.md"} <= set(uploaded)
    assert uploaded["model.safetensors"] == (tmp_path / "dmx" / "model.safetensors").read_bytes()
    assert json.loads(uploaded["config.json"])["quantization_config"]["format_map"] == format_map
    assert "- dmx" in uploaded["README.md"].decode()  # the model card lists the backend's tags

    run_python(
        f"""
import torch, optimum_dmx
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("user/tiny-llama-dmx")
with torch.no_grad():
    torch.save(model(torch.tensor({INPUT_IDS.tolist()})).logits, {str(tmp_path / "logits.pt")!r})
""",
        env=hub_env("downloader"),
    )
    assert torch.equal(torch.load(tmp_path / "logits.pt"), logits)
