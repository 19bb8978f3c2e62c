"""The README's Python snippets and the examples run as written."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimum_dmx.nn.groups import mixed_groups

ROOT = Path(__file__).resolve().parents[1]


DOCUMENTS = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]


def python_blocks(document: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / document).read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_python_snippets_run_in_order(document):
    # examples that download a model from the Hub are left out; the examples' tests cover that workflow offline
    blocks = [block for block in python_blocks(document) if "HuggingFaceTB/" not in block]
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, document, "exec"), namespace)  # noqa: S102 - executing our own documentation


def test_the_readme_stays_short_and_the_docs_stand_alone():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert sum(len(python_blocks(d)) for d in DOCUMENTS) >= 3
    for document in DOCUMENTS:
        text = (ROOT / document).read_text()
        assert "../shared" not in text, document
        for link in re.findall(r"\]\(([^)#]+)\)", text):
            if not link.startswith("http"):
                assert ((ROOT / document).parent / link).exists(), (document, link)


def run_example(script: str, *args, processes: int = 1) -> str:
    """Run an example as a user would (under `torchrun` with `processes` > 1), with the suite's eager MX kernels
    (same results; `test_compilation.py` tests the compiled ones)."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    result = subprocess.run(
        [sys.executable, *launch, str(ROOT / "examples" / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quickstart_example():
    stdout = run_example("quickstart.py")
    assert "mxfp4_e2m1" in stdout and "beta=2.0" in stdout


def test_quantize_save_load_generate_examples(tiny_text_model_dir, tmp_path):
    root, out = tiny_text_model_dir, tmp_path / "dmx"
    stdout = run_example(
        "quantize_and_save.py",
        root / "model",
        "--dataset",
        root / "calibration.txt",
        "--steps",
        4,
        "--seq-len",
        16,
        "--batch-size",
        2,
        "--output",
        out,
    )
    assert "average bits" in stdout and (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    stdout = run_example("load_and_generate.py", out, "--prompt", "w1 w2 w3", "--max-new-tokens", 5)
    assert "14 MX linear layers" in stdout and stdout.strip().splitlines()[-1].startswith("w1 w2 w3")


SHARDED_EXAMPLE_SIZES = {"steps": 4, "seq_len": 16, "batch_size": 2, "num_samples": 8}


def _run_sharded_example(root, out, *options) -> None:
    """`examples/calibrate_sharded.py` on two CPU processes, at `SHARDED_EXAMPLE_SIZES`."""
    sizes = [f"--{key.replace('_', '-')}={value}" for key, value in SHARDED_EXAMPLE_SIZES.items()]
    run_example(
        "calibrate_sharded.py",
        root / "model",
        *("--dataset", root / "calibration.txt", *options),
        *("--device", "cpu", "--dtype", "float32", "--preset", "cpu-demo", "--output", out, *sizes),
        processes=2,
    )


@pytest.mark.slow  # two processes, calibration, then a quantization: about a minute
def test_calibrate_sharded_example_learns_the_single_process_map_and_saves_the_model(tiny_text_model_dir, tmp_path):
    """The FSDP2 recipe, as its docstring runs it, on two CPU processes (gloo): the map it writes is the one a single
    process calibrating the same sequences learns, and the saved model loads with that map."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_dmx import DMXConfig
    from optimum_dmx.calibration import build_calibration_batches, calibrate

    root, out = tiny_text_model_dir, tmp_path / "dmx"
    _run_sharded_example(root, out)
    sizes = SHARDED_EXAMPLE_SIZES
    learned = json.loads((out / "format_map.json").read_text())

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    ids = build_calibration_batches([root / "calibration.txt"], tokenizer, sizes["seq_len"], sizes["num_samples"])
    config = DMXConfig(preset="cpu-demo", gradient_checkpointing=True, **sizes)
    settings = config.calibration_settings(modules_to_not_convert=["lm_head"])
    assert learned == calibrate(model, ids, settings, progress=False).format_map
    saved = AutoModelForCausalLM.from_pretrained(out).config.quantization_config
    assert saved.format_map == learned and saved.weight_rounding == "gptq"


@pytest.mark.slow  # two processes learning rotations, then a quantization
def test_calibrate_sharded_example_learns_rotations_on_the_shards_and_saves_them(tiny_text_model_dir, tmp_path):
    """With `--rotation hadamard --learn-rotations`: the saved model holds the rotations learned on the shards (its
    float lm_head is the seeded random rotation's, turned further: the same row norms, other values) and records
    the online transforms of its down_proj layers, so that it reloads as it was saved."""
    from transformers import AutoModelForCausalLM

    from optimum_dmx import DMXConfig

    root, out = tiny_text_model_dir, tmp_path / "dmx"
    _run_sharded_example(root, out, "--rotation", "hadamard", "--learn-rotations")
    saved = AutoModelForCausalLM.from_pretrained(out)
    config = saved.config.quantization_config
    assert config.format_map == json.loads((out / "format_map.json").read_text())
    down_projs = [name for name in config.format_map if name.endswith("down_proj")]
    assert sorted(config.input_transforms) == sorted(down_projs) and down_projs

    from optimum_dmx.nn import linear_modules_to_quantize
    from optimum_dmx.nn.rotation import rotate_model

    random = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    seed = DMXConfig().seed
    rotate_model(random, "hadamard", list(linear_modules_to_quantize(random, ["lm_head"])), seed=seed)
    learned_head, random_head = saved.lm_head.weight, random.lm_head.weight
    torch.testing.assert_close(learned_head.norm(dim=1), random_head.norm(dim=1), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(learned_head, random_head, atol=1e-4)


@pytest.mark.slow  # two processes, calibration, then a quantization
def test_calibrate_sharded_example_quantizes_a_mixture_of_experts_like_a_single_process(tmp_path):
    """A tiny Qwen3-MoE: the example turns the packed experts into linears before sharding (`nn.experts`), and the
    map the two processes learn, experts included, is the one a single process learns on the linearized model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_dmx import DMXConfig
    from optimum_dmx.calibration import build_calibration_batches, calibrate
    from optimum_dmx.nn import LinearExperts, linearizable_experts, linearize_experts

    from .helpers import words
    from .test_mixture_of_experts import save_float

    root, out = tmp_path, tmp_path / "dmx"
    save_float("qwen3_moe", root / "model")
    (root / "calibration.txt").write_text("\n".join(words(7 * i, 40) for i in range(40)))
    _run_sharded_example(root, out)
    learned = json.loads((out / "format_map.json").read_text())
    assert len([name for name in learned if ".experts." in name]) == 2 * 4 * 3

    sizes = SHARDED_EXAMPLE_SIZES
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    linearize_experts(model, linearizable_experts(model, ["lm_head"]))
    ids = build_calibration_batches([root / "calibration.txt"], tokenizer, sizes["seq_len"], sizes["num_samples"])
    config = DMXConfig(preset="cpu-demo", gradient_checkpointing=True, **sizes)
    assert learned == calibrate(model, ids, config.calibration_settings(modules_to_not_convert=["lm_head"])).format_map
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert saved.config.quantization_config.format_map == learned
    assert isinstance(saved.model.layers[1].mlp.experts, LinearExperts)


def test_serve_with_vllm_example_exports_then_needs_vllm(tiny_text_model_dir, tmp_path):
    """vLLM needs a GPU and is not installed here: the example exports, then stops at `import vllm`."""
    from transformers import AutoModelForCausalLM

    from optimum_dmx import DMXConfig

    from .helpers import linear_names

    model_dir = tiny_text_model_dir / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    format_map = dict.fromkeys(linear_names(model), "mxfp4_e2m1")
    AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=DMXConfig(format_map=format_map)
    ).save_pretrained(tmp_path / "dmx")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve_with_vllm.py"), str(tmp_path / "dmx")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert "serving" in result.stdout and (tmp_path / "dmx-compressed-tensors" / "config.json").is_file()
    assert result.returncode != 0 and "No module named 'vllm'" in result.stderr


@pytest.mark.slow  # a short calibration in a subprocess
def test_serve_with_vllm_example_calibrates_a_rotated_grouped_model_and_exports_it(tiny_text_model_dir, tmp_path):
    """With --calibrate the example calibrates what vLLM serves (online transforms, fused groups, the target's scale
    rule), exports it with compressed-tensors' transforms, then stops at `import vllm`."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve_with_vllm.py"), str(tiny_text_model_dir / "model")]
        + ["--calibrate", str(tiny_text_model_dir / "calibration.txt"), "--preset", "cpu-demo"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "No module named 'vllm'" in result.stderr, result.stderr[-2000:]
    dmx = json.loads((tmp_path / "model-dmx5" / "config.json").read_text())["quantization_config"]
    assert dmx["rotation"] == "online_block_hadamard" and dmx["offset_groups"] == "fused"
    assert dmx["scale_rule"] == "compressed-tensors" and not mixed_groups(dmx["format_map"])
    exported = json.loads((tmp_path / "model-dmx5-compressed-tensors" / "config.json").read_text())
    (scheme,) = exported["quantization_config"]["transform_config"]["config_groups"].values()
    assert sorted(scheme["apply"][0]["targets"]) == sorted(dmx["format_map"])
