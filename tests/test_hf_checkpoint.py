"""from_pretrained with DMXConfig, packed safetensors checkpoints, reload in a fresh process, integrity errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig, DMXQuantizer, MXLinear, quantize_mx
from optimum_dmx.formats import get_format, packed_shapes

from .helpers import INPUT_IDS, REPO_ROOT, cycling_format_map, last_json_line, run_python


def quantize_and_save(float_dir: Path, out_dir: Path, dtype=torch.float32):
    format_map = cycling_format_map(float_dir)
    config = DMXConfig(format_map=format_map)
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=dtype, quantization_config=config)
    model.save_pretrained(out_dir)
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    return model, format_map, logits


@pytest.fixture(scope="module")
def llama_dmx(tmp_path_factory, tiny_llama_dir):
    """(saved dMX checkpoint, its format map, its logits on INPUT_IDS)."""
    out = tmp_path_factory.mktemp("llama-dmx")
    _, format_map, logits = quantize_and_save(tiny_llama_dir, out)
    return out, format_map, logits


def test_explicit_format_map_is_applied_without_calibration(tiny_llama_dir):
    format_map = cycling_format_map(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=DMXConfig(format_map=format_map))
    converted = {n: m.fmt.name for n, m in model.named_modules() if isinstance(m, MXLinear)}
    assert converted == format_map
    assert type(model.lm_head) is nn.Linear
    saved_config = model.config.quantization_config
    assert saved_config.format_map == format_map and saved_config.dataset is None
    # the packed weights are the float checkpoint's weights, quantized
    float_weights = load_file(tiny_llama_dir / "model.safetensors")
    for name, module in model.named_modules():
        if isinstance(module, MXLinear):
            expected = quantize_mx(float_weights[f"{name}.weight"], module.fmt)
            assert torch.equal(module.dequantized_weight(torch.float32), expected)


def test_checkpoint_stores_packed_tensors_and_the_map(llama_dmx, tiny_llama_dir):
    out, format_map, _ = llama_dmx
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "dmx" and config["format_map"] == format_map
    assert "dataset" not in config and "tokenizer" not in config
    saved = load_file(out / "model.safetensors")
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as handle:
        float_shapes = {k: handle.get_slice(k).get_shape() for k in handle.keys()}
    packed_bytes = expected_bytes = 0
    for name, fmt in format_map.items():
        assert f"{name}.weight" not in saved
        codes, scales = saved[f"{name}.weight_packed"], saved[f"{name}.weight_scale"]
        assert codes.dtype == scales.dtype == torch.uint8
        assert (codes.shape, scales.shape) == packed_shapes(float_shapes[f"{name}.weight"], fmt)
        packed_bytes += codes.numel() + scales.numel()
        out_features, in_features = float_shapes[f"{name}.weight"]
        expected_bytes += out_features * in_features * get_format(fmt).storage_bits() / 8
    assert packed_bytes == expected_bytes  # in_features here are multiples of 32: no padding


@pytest.mark.parametrize(
    ("model_fixture", "dtype", "device_map"),
    [
        ("tiny_llama_dir", "float32", None),
        ("tiny_llama_dir", "bfloat16", "cpu"),
        ("tiny_qwen3_dir", "float32", "auto"),
        ("tiny_qwen3_dir", "bfloat16", None),
    ],
)
def test_reload_in_a_fresh_process_gives_identical_logits(request, tmp_path, model_fixture, dtype, device_map):
    float_dir = request.getfixturevalue(model_fixture)
    _, format_map, logits = quantize_and_save(float_dir, tmp_path / "dmx", getattr(torch, dtype))
    code = f"""
import json, logging, sys, torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging
import optimum_dmx
records = []
handler = logging.Handler(); handler.emit = lambda r: records.append(r.getMessage())
hf_logging.get_logger().addHandler(handler)
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "dmx")!r}, dtype=torch.{dtype}, device_map={device_map!r})
assert model.hf_quantizer.pre_quantized
with torch.no_grad():
    torch.save(model(torch.tensor({INPUT_IDS.tolist()})).logits, {str(tmp_path / "logits.pt")!r})
formats = {{n: m.fmt.name for n, m in model.named_modules() if isinstance(m, optimum_dmx.MXLinear)}}
print(json.dumps({{"formats": formats, "log": records}}))
"""
    result = last_json_line(run_python(code))
    assert result["formats"] == format_map
    assert not [line for line in result["log"] if any(w in line for w in ("MISSING", "UNEXPECTED", "MISMATCH"))]
    reloaded = torch.load(tmp_path / "logits.pt")
    assert reloaded.dtype == getattr(torch, dtype)
    assert torch.equal(reloaded, logits)


def test_dmx_quantizer_quantizes_and_saves(tmp_path, tiny_qwen3_dir):
    format_map = cycling_format_map(tiny_qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    quantizer = DMXQuantizer(DMXConfig(format_map=format_map))
    assert quantizer.quantize_model(model) is model
    assert model.is_quantized and model.config.quantization_config.format_map == format_map
    quantizer.save(model, tmp_path / "dmx")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        assert torch.equal(model(INPUT_IDS).logits, reloaded(INPUT_IDS).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dmx"]  # no staging directory left behind
    assert "dmx_format_map.png" in (tmp_path / "dmx" / "README.md").read_text()  # the dMX model card


def test_a_model_rotated_before_quantizing_records_its_online_transforms(tmp_path, tiny_llama_dir):
    # Rotated by the caller (as before sharding a model with FSDP2), quantized with rotation="none": config.json must
    # still carry the online transforms the MX linears compute with, or the reload would silently drop them.
    from optimum_dmx.nn import linear_modules_to_quantize
    from optimum_dmx.nn.rotation import rotate_model

    format_map = cycling_format_map(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    transforms = rotate_model(model, "hadamard", list(linear_modules_to_quantize(model, ["lm_head"])), seed=5)
    assert transforms  # every down_proj
    DMXQuantizer(DMXConfig(format_map=format_map)).quantize_model(model)
    assert model.config.quantization_config.input_transforms == transforms
    model.save_pretrained(tmp_path / "dmx")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")
    with torch.no_grad():
        assert torch.equal(model(INPUT_IDS).logits, reloaded(INPUT_IDS).logits)


def test_dmx_quantizer_quantize_is_quantize_model_then_save(tmp_path, tiny_qwen3_dir):
    format_map = cycling_format_map(tiny_qwen3_dir)
    quantizer = DMXQuantizer(DMXConfig(format_map=format_map))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="file_prefix='q' is not supported"):
        quantizer.quantize(tmp_path / "dmx", "q", model=model)
    assert not any(isinstance(m, MXLinear) for m in model.modules())
    quantizer.quantize(tmp_path / "dmx", model=model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx")
    assert reloaded.config.quantization_config.format_map == format_map


# -- bad input and integrity ---------------------------------------------------------------------------


def _copy_with_format_map_update(src: Path, dst: Path, update: dict[str, str]) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["format_map"].update(update)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_format_map_naming_a_missing_module_is_an_error(llama_dmx, tmp_path):
    bad = _copy_with_format_map_update(llama_dmx[0], tmp_path / "bad", {"model.layers.7.mlp.up_proj": "mxfp4"})
    with pytest.raises(ValueError, match=r"'model\.layers\.7\.mlp\.up_proj'.*does not have"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_unknown_format_in_checkpoint_is_an_error(llama_dmx, tmp_path):
    bad = _copy_with_format_map_update(llama_dmx[0], tmp_path / "bad", {"model.layers.0.mlp.up_proj": "fp5"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj'.*fp5"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_packed_shapes_not_matching_the_map_is_an_error(llama_dmx, tmp_path):
    out, format_map, _ = llama_dmx
    name = next(n for n, f in format_map.items() if f == "mxfp4_e2m1")
    bad = _copy_with_format_map_update(out, tmp_path / "bad", {name: "mxfp8"})
    with pytest.raises(ValueError, match=rf"module '{name}'.*U8\[.*needs U8\["):
        AutoModelForCausalLM.from_pretrained(bad)


def test_missing_packed_tensor_is_an_error(llama_dmx, tmp_path):
    out, format_map, _ = llama_dmx
    shutil.copytree(out, tmp_path / "bad")
    tensors = load_file(out / "model.safetensors")
    name = next(iter(format_map))
    del tensors[f"{name}.weight_scale"]
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"module '{name}'.*no '{name}\.weight_scale'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "bad")


def _save_with_file_size_limit(source: Path, target: Path, how: str) -> subprocess.CompletedProcess:
    """Load `source` and save it to `target` in a process whose files may not grow past 20 kB."""
    save = (
        f"model.save_pretrained({str(target)!r})"
        if how == "save_pretrained"
        else (
            f"optimum_dmx.DMXQuantizer(model.config.quantization_config).save(model, {str(target)!r}, overwrite=True)"
        )
    )
    code = f"""
import resource, signal
import optimum_dmx
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(source)!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
{save}
"""
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_interrupted_save_pretrained_does_not_load(llama_dmx, tmp_path):
    proc = _save_with_file_size_limit(llama_dmx[0], tmp_path / "partial", "save_pretrained")
    assert proc.returncode != 0, "the save was expected to be cut off"
    assert (tmp_path / "partial" / "config.json").exists()  # a half-written checkpoint is on disk...
    with pytest.raises(Exception, match="(?i)safetensor|incomplete|header"):  # ...and refuses to load
        AutoModelForCausalLM.from_pretrained(tmp_path / "partial")


def test_interrupted_dmx_quantizer_save_leaves_previous_checkpoint(llama_dmx, tmp_path):
    out, format_map, logits = llama_dmx
    target = tmp_path / "ckpt"
    shutil.copytree(out, target)
    proc = _save_with_file_size_limit(out, target, "dmx_quantizer")
    assert proc.returncode != 0, "the save was expected to be cut off"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    model = AutoModelForCausalLM.from_pretrained(target)  # still the complete previous checkpoint
    with torch.no_grad():
        assert torch.equal(model(INPUT_IDS).logits, logits)
    proc = _save_with_file_size_limit(out, tmp_path / "new", "dmx_quantizer")
    assert proc.returncode != 0 and not (tmp_path / "new").exists()


def test_dmx_quantizer_save_keeps_a_non_empty_folder_unless_told(llama_dmx, tmp_path):
    out, _, _ = llama_dmx
    model = AutoModelForCausalLM.from_pretrained(out)
    quantizer = DMXQuantizer(model.config.quantization_config)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="mine' exists and is not empty; pass overwrite=True"):
        quantizer.save(model, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    quantizer.save(model, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "config.json").is_file() and not (tmp_path / "mine" / "notes.txt").exists()


def test_calibration_without_dataset_or_tokenizer_fails_before_loading(tiny_llama_dir):
    with pytest.raises(ValueError, match="dataset and no tokenizer"):
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=DMXConfig(target_bits=5.0))


def test_dmx_quantizer_without_tokenizer_touches_no_weight(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="no tokenizer"):
        DMXQuantizer(DMXConfig(dataset=["some text"])).quantize_model(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, MXLinear) for m in model.modules())


def test_quantizing_a_dmx_model_again_is_an_error(llama_dmx):
    out, format_map, _ = llama_dmx
    model = AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match="already dMX-quantized"):
        DMXQuantizer(DMXConfig(format_map=format_map)).quantize_model(model)


def test_from_pretrained_on_a_dmx_checkpoint_with_a_new_config_keeps_the_checkpoint(llama_dmx):
    out, format_map, logits = llama_dmx
    other = {name: "mxfp8" for name in format_map}
    with pytest.warns(UserWarning, match="quantization_config` from the model will be used"):
        model = AutoModelForCausalLM.from_pretrained(out, quantization_config=DMXConfig(format_map=other))
    assert model.config.quantization_config.format_map == format_map
    with torch.no_grad():
        assert torch.equal(model(INPUT_IDS).logits, logits)


def test_dequantize_returns_the_float_model_of_the_mx_weights(llama_dmx):
    out, format_map, _ = llama_dmx
    model = AutoModelForCausalLM.from_pretrained(out)
    mx_weights = {n: m.dequantized_weight(torch.float32) for n, m in model.named_modules() if isinstance(m, MXLinear)}
    for name in format_map:
        model.get_submodule(name).quantize_activations = False  # dequantize keeps the weights' MX values only
    with torch.no_grad():
        weight_only_logits = model(INPUT_IDS).logits
    float_model = model.dequantize()
    assert not any(isinstance(m, MXLinear) for m in float_model.modules())
    assert not getattr(float_model.config, "quantization_config", None) and not float_model.is_quantized
    for name, weight in mx_weights.items():
        linear = float_model.get_submodule(name)
        assert type(linear) is nn.Linear and torch.equal(linear.weight, weight)
    with torch.no_grad():
        assert torch.equal(float_model(INPUT_IDS).logits, weight_only_logits)
    float_model.save_pretrained(out.parent / "dequantized")  # an ordinary float checkpoint, no dMX card
    assert not (out.parent / "dequantized" / "README.md").exists()
    assert "quantization_config" not in json.loads((out.parent / "dequantized" / "config.json").read_text())


def test_scale_rule_is_recorded_and_used_after_reload(tiny_llama_dir, tmp_path):
    """A checkpoint made for a loader's scale rule keeps it: config.json names it and a reload computes with it."""
    format_map = cycling_format_map(tiny_llama_dir)
    config = DMXConfig(format_map=format_map, scale_rule="compressed-tensors")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    model.save_pretrained(tmp_path)
    assert (
        json.loads((tmp_path / "config.json").read_text())["quantization_config"]["scale_rule"] == "compressed-tensors"
    )
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    modules = [m for m in reloaded.modules() if isinstance(m, MXLinear)]
    assert modules and all(m.scale_rule == "compressed-tensors" for m in modules)
    float_weights = load_file(tiny_llama_dir / "model.safetensors")
    name = next(iter(format_map))
    expected = quantize_mx(float_weights[f"{name}.weight"], format_map[name], scale_rule="compressed-tensors")
    assert torch.equal(reloaded.get_submodule(name).dequantized_weight(torch.float32), expected)
    with torch.no_grad():
        assert torch.equal(reloaded(INPUT_IDS).logits, model(INPUT_IDS).logits)
        ocp = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=DMXConfig(format_map=format_map))
        assert not torch.equal(ocp(INPUT_IDS).logits, model(INPUT_IDS).logits)


def test_torch_compile_of_a_loaded_dmx_model_is_one_graph_with_the_same_logits(tiny_llama_dir, tmp_path):
    """`torch.compile` (inductor) of a reloaded checkpoint in every format traces the whole model as one graph
    (`fullgraph`: the weight cache and the activation casts' host synchronisation stay out of it; a graph break at
    every linear also made dynamo recompile their format constants as symbols, which Triton failed to compile) and
    matches eager to float32 rounding."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=DMXConfig(format_map=cycling_format_map(tiny_llama_dir))
    )
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    compiled = torch.compile(reloaded, fullgraph=True)
    with torch.no_grad():
        eager = reloaded(INPUT_IDS, use_cache=False).logits
        torch.testing.assert_close(compiled(INPUT_IDS, use_cache=False).logits, eager, rtol=1e-5, atol=1e-5)
