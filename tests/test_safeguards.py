"""What a hostile-but-fair user does: outputs over inputs, damaged checkpoints, bad data, two writers at once.

Nothing the user had is lost or overwritten without asking, no damaged checkpoint loads silently, and every mistake
on the command line is one line naming the file and the cause (exit status 2)."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from optimum_dmx import DMXConfig, DMXQuantizer
from optimum_dmx.calibration import build_calibration_batches, load_calibration_dataset
from optimum_dmx.cli import main
from optimum_dmx.export import ExportError, export_checkpoint
from optimum_dmx.integration.folders import FolderInUseError, check_output, staged_folder

from .helpers import linear_names, word_tokenizer

FAST = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--num-samples", "4"]


def run_cli(capsys, *args) -> tuple[int, str]:
    """`optimum-dmx ARGS` in this process: its exit status and the last line it wrote to stderr."""
    status = main([str(a) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    return status, err[-1] if err else ""


@pytest.fixture(scope="module")
def checkpoint(tiny_text_model_dir, tmp_path_factory) -> Path:
    """A saved dMX checkpoint of the tiny text model (explicit mixed map, no calibration)."""
    model_dir = tiny_text_model_dir / "model"
    names = linear_names(AutoModelForCausalLM.from_pretrained(model_dir))
    formats = ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1")
    format_map = {name: formats[i % 3] for i, name in enumerate(names)}
    folder = tmp_path_factory.mktemp("ckpt") / "dmx"
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=DMXConfig(format_map=format_map))
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def copy_checkpoint(checkpoint: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for path in checkpoint.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


# --- outputs over inputs ---------------------------------------------------------------------------------


def test_check_output_refuses_the_input_its_parent_and_its_children(tmp_path):
    source = tmp_path / "p" / "ck"
    source.mkdir(parents=True)
    for output, relation in ((source, "is"), (tmp_path / "p", "contains"), (source / "sub", "lies inside")):
        with pytest.raises(ValueError, match=f"{relation} .*ck"):
            check_output(output, [source])
    check_output(tmp_path / "p" / "other", [source])  # a sibling is fine


def test_export_into_the_parent_of_its_source_is_refused_and_deletes_nothing(checkpoint, tmp_path, capsys):
    parent = tmp_path / "p"
    source = copy_checkpoint(checkpoint, parent / "ck")
    (parent / "notes.txt").write_text("mine")
    status, line = run_cli(
        capsys, "export", source, "--to", "compressed-tensors", "--output", parent, "--overwrite", "--force"
    )
    assert status == 2 and "contains" in line and "ck" in line
    assert (parent / "notes.txt").read_text() == "mine" and (source / "config.json").is_file()
    with pytest.raises(ExportError, match="lies inside"):
        export_checkpoint(source, source / "out", "compressed-tensors", force=True)


def test_quantize_refuses_to_write_over_the_model_it_reads(tiny_text_model_dir, tmp_path, capsys):
    model = copy_checkpoint(tiny_text_model_dir / "model", tmp_path / "m")
    before = sorted(p.name for p in model.iterdir())
    status, line = run_cli(
        capsys,
        "quantize",
        model,
        "--dataset",
        tiny_text_model_dir / "calibration.txt",
        "--output",
        model,
        "--overwrite",
        *FAST,
    )
    assert status == 2 and "is" in line and "reads" in line
    assert sorted(p.name for p in model.iterdir()) == before


# --- damaged checkpoints -------------------------------------------------------------------------------------


def test_a_packed_layer_missing_from_the_format_map_is_refused_on_load_and_export(checkpoint, tmp_path, capsys):
    damaged = copy_checkpoint(checkpoint, tmp_path / "damaged")
    config = json.loads((damaged / "config.json").read_text())
    dropped = sorted(config["quantization_config"]["format_map"])[0]
    del config["quantization_config"]["format_map"][dropped]
    (damaged / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"does not name .*{dropped}"):
        AutoModelForCausalLM.from_pretrained(damaged)
    status, line = run_cli(
        capsys, "export", damaged, "--to", "compressed-tensors", "--output", tmp_path / "o", "--force"
    )
    assert status == 2 and dropped in line and "format_map has no format" in line
    status, line = run_cli(capsys, "eval", damaged, "--text", damaged / "config.json")
    assert status == 2 and dropped in line


# --- calibration data --------------------------------------------------------------------------------------------


def test_a_dataset_folder_and_a_list_mixing_folders_and_files_are_read(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("w1 w2 w3\n")
    (tmp_path / "b.txt").write_text("w4 w5\n")
    assert load_calibration_dataset([str(folder), str(tmp_path / "b.txt")])["text"] == ["w1 w2 w3", "w4 w5"]
    with pytest.raises(ValueError, match="mixes 1 existing paths"):
        load_calibration_dataset([str(folder), "a calibration text"])


def test_the_cli_calibrates_on_a_dataset_folder(tiny_text_model_dir, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "calibration.txt").write_text((tiny_text_model_dir / "calibration.txt").read_text())
    status = main(
        [
            "quantize",
            str(tiny_text_model_dir / "model"),
            "--dataset",
            str(folder),
            "--output",
            str(tmp_path / "out"),
            *FAST,
        ]
    )
    assert status == 0, capsys.readouterr().err[-2000:]
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()


BAD_DATA = {
    "empty.txt": (b"", "empty"),
    "blank.txt": (b"   \n\t\n", "empty"),
    "binary.txt": (bytes(range(256)) * 4, "UnicodeDecodeError"),
    "latin1.txt": ("caf\u00e9 na\u00efve ".encode("latin-1") * 50, "UnicodeDecodeError"),
    "short.txt": (b"w1 w2", "too short"),
    "broken.jsonl": (b'{"text": "w1 w2"}\n{"text": \n', "broken.jsonl"),
    "notext.jsonl": (b'{"body": "w1 w2 w3"}\n', "no 'text' column"),
}


@pytest.mark.parametrize("name", sorted(BAD_DATA))
def test_bad_calibration_data_is_one_line_naming_the_file_and_the_cause(name, tiny_text_model_dir, tmp_path, capsys):
    content, cause = BAD_DATA[name]
    (tmp_path / name).write_bytes(content)
    status, line = run_cli(
        capsys,
        "quantize",
        tiny_text_model_dir / "model",
        "--dataset",
        tmp_path / name,
        "--output",
        tmp_path / "out",
        *FAST,
    )
    assert status == 2 and name in line and cause in line, line
    assert not (tmp_path / "out").exists()


def test_a_parquet_text_column_of_integers_is_one_line(tiny_text_model_dir, tmp_path, capsys):
    from datasets import Dataset

    Dataset.from_dict({"text": [1, 2, 3]}).to_parquet(tmp_path / "numbers.parquet")
    status, line = run_cli(
        capsys,
        "quantize",
        tiny_text_model_dir / "model",
        "--dataset",
        tmp_path / "numbers.parquet",
        "--output",
        tmp_path / "out",
        *FAST,
    )
    assert status == 2 and "numbers.parquet" in line


def test_debug_shows_the_traceback_and_the_default_does_not(tiny_text_model_dir, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    command = [
        sys.executable,
        "-m",
        "optimum_dmx",
        "quantize",
        str(tiny_text_model_dir / "model"),
        "--dataset",
        str(tmp_path / "empty.txt"),
        "--output",
        str(tmp_path / "out"),
        *FAST,
    ]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    debug = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OPTIMUM_DMX_DEBUG": "1"}
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "empty" in debug.stderr


# --- writes -------------------------------------------------------------------------------------------------------


def test_a_second_writer_gets_a_clear_error_and_the_first_result_stands(tmp_path):
    target = tmp_path / "out"
    entered, release = threading.Event(), threading.Event()

    def first():
        with staged_folder(target) as staging:
            (staging / "who").write_text("first")
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    entered.wait(10)
    try:
        with pytest.raises(FolderInUseError, match="another process is writing"):
            with staged_folder(target):
                pass
    finally:
        release.set()
        thread.join()
    assert (target / "who").read_text() == "first"
    with pytest.raises(FileExistsError, match="not empty"):  # finished meanwhile: checked again, never replaced
        with staged_folder(target) as staging:
            (staging / "who").write_text("second")
    assert (target / "who").read_text() == "first"


def test_a_folder_that_appears_during_the_write_is_not_replaced(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(FileExistsError, match="not empty"):
        with staged_folder(target) as staging:
            (staging / "new").write_text("new")
            target.mkdir()
            (target / "theirs").write_text("theirs")  # another program wrote it meanwhile
    assert (target / "theirs").read_text() == "theirs" and not (target / "new").exists()


def test_staging_folders_get_the_umask_permissions_and_a_killed_writers_are_removed(tmp_path):
    target = tmp_path / "out"
    stale = tmp_path / ".out.abc123.partial"
    stale.mkdir()
    (stale / "half.safetensors").write_bytes(b"x")
    old_umask = os.umask(0o022)
    try:
        with staged_folder(target) as staging:
            assert staging.stat().st_mode & 0o777 == 0o755
            assert not stale.exists()
    finally:
        os.umask(old_umask)
    assert target.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock file or staging folder left


def test_the_tokenizer_is_saved_with_the_model_in_one_swap(checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    target = tmp_path / "saved"
    (target).mkdir()
    (target / "old.txt").write_text("old")

    class Broken:
        def save_pretrained(self, folder):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        DMXQuantizer(model.config.quantization_config).save(model, target, tokenizer=Broken(), overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]  # the old folder is whole
    DMXQuantizer(model.config.quantization_config).save(model, target, tokenizer=word_tokenizer(), overwrite=True)
    assert (target / "tokenizer.json").is_file() and (target / "model.safetensors").is_file()


# --- small mistakes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"target_bits": "5"}, TypeError, "target_bits='5' must be a number"),
        ({"seed": "a"}, ValueError, "seed='a'"),
        ({"quantize_activations": "no"}, ValueError, "quantize_activations='no'"),
        ({"format_map": {}}, ValueError, "format_map is empty"),
    ],
)
def test_wrongly_typed_fields_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        DMXConfig(**kwargs)


def test_a_sequence_longer_than_the_models_positions_is_refused_before_calibrating(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(tiny_llama_dir).max_position_embeddings
    config = DMXConfig(
        dataset=["w1 w2 w3"], tokenizer=word_tokenizer(), seq_len=limit + 1, num_samples=1, batch_size=1, steps=1
    )
    with pytest.raises(ValueError, match=f"seq_len={limit + 1} is longer than .*max_position_embeddings={limit}"):
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)


_SMALL = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=128)


@pytest.mark.parametrize(
    "auto, family, config, task",
    [
        (
            "AutoModelForSeq2SeqLM",
            "t5",
            dict(num_layers=1, d_model=64, d_ff=128, num_heads=4, d_kv=16),
            r"sequence-to-sequence generation \(an encoder-decoder model\)",
        ),
        ("AutoModelForSequenceClassification", "bert", _SMALL, "sequence classification"),
        ("AutoModelForMaskedLM", "bert", _SMALL, "masked language modelling"),
        ("AutoModel", "llama", _SMALL, r"hidden states \(no head\)"),
    ],
)
def test_a_model_that_does_not_predict_the_next_token_is_refused_before_calibrating(
    tmp_path, auto, family, config, task
):
    """Calibration and GPTQ learn from the next-token loss of text: a classifier, a masked or encoder-decoder model,
    or a model without a head is refused naming what it is built for (they crashed inside transformers or torch, or
    calibrated a masked model on copying its input). Without calibration text a given map quantizes it."""
    import transformers
    from transformers import AutoConfig

    model_class = getattr(transformers, auto)
    model_class.from_config(AutoConfig.for_model(family, **config)).save_pretrained(tmp_path)
    calibrated = DMXConfig(
        dataset=["w1 w2 w3"] * 8, tokenizer=word_tokenizer(), seq_len=4, num_samples=4, batch_size=2, steps=1
    )
    with pytest.raises(ValueError, match=f"built for {task}.*dMX calibrates on the next-token loss of text"):
        model_class.from_pretrained(tmp_path, quantization_config=calibrated)
    names = [n for n, m in model_class.from_pretrained(tmp_path).named_modules() if type(m) is torch.nn.Linear]
    quantized = model_class.from_pretrained(
        tmp_path, quantization_config=DMXConfig(format_map=dict.fromkeys(names[:2], "mxfp4_e2m1"))
    )
    assert sorted(quantized.config.quantization_config.format_map) == sorted(names[:2])


@pytest.mark.parametrize(
    "class_name",
    ["Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration", "Qwen2_5OmniForConditionalGeneration"],
)
def test_decoder_only_audio_and_omni_models_are_taken_as_language_models(class_name):
    """transformers lists Qwen2-Audio and Voxtral among its sequence-to-sequence models, but they predict the next
    token of text as a decoder: only a configuration's `is_encoder_decoder` marks an encoder-decoder model."""
    from optimum_dmx.integration.model_classes import other_task

    assert other_task(type(class_name, (torch.nn.Module,), {})()) is None
    assert other_task(type("BertForSequenceClassification", (torch.nn.Module,), {})()) == "sequence classification"


def test_inspect_into_a_missing_folder_is_one_line(checkpoint, tmp_path, capsys):
    status, line = run_cli(capsys, "inspect", checkpoint, "--heatmap", tmp_path / "missing" / "dir" / "x.png")
    assert status == 2 and "missing" in line


def test_a_damaged_packed_tensor_file_is_one_line_on_eval(checkpoint, tmp_path, capsys):
    damaged = copy_checkpoint(checkpoint, tmp_path / "damaged")
    tensors = load_file(damaged / "model.safetensors")
    name = next(k for k in tensors if k.endswith("weight_packed"))
    tensors[name] = tensors[name][:, :-1].contiguous()  # a truncated row: the wrong shape for its format
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    status, line = run_cli(capsys, "eval", damaged, "--text", damaged / "config.json")
    assert status == 2 and name in line


def test_calibration_batches_name_a_text_column_that_holds_no_text():
    from datasets import Dataset

    with pytest.raises(TypeError, match="'text' column holds int values"):
        build_calibration_batches(Dataset.from_dict({"text": [1, 2]}), word_tokenizer(), 4, 1)


# --- the integrity record ------------------------------------------------------------------------------------------


def tamper(checkpoint: Path, to: Path, edit) -> Path:
    damaged = copy_checkpoint(checkpoint, to)
    tensors = load_file(damaged / "model.safetensors")
    edit(tensors)
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    return damaged


def first_packed(tensors: dict, leaf: str = "weight_packed") -> str:
    return sorted(k for k in tensors if k.endswith(leaf))[0]


@pytest.mark.parametrize("damage", ["flipped byte", "scale 0xFF"])
def test_a_damaged_payload_is_refused_naming_the_tensor(checkpoint, tmp_path, damage, monkeypatch):
    def edit(tensors):
        name = first_packed(tensors, "weight_packed" if damage == "flipped byte" else "weight_scale")
        tensor = tensors[name].clone()
        tensor.view(-1)[0] = (tensor.view(-1)[0] ^ 1) if damage == "flipped byte" else 255
        tensors[name] = tensor
        edit.name = name

    damaged = tamper(checkpoint, tmp_path / "damaged", edit)
    with pytest.raises(ValueError, match=f"tensor '{edit.name}' in model.safetensors differs"):
        AutoModelForCausalLM.from_pretrained(damaged)
    monkeypatch.setenv("OPTIMUM_DMX_SKIP_INTEGRITY_CHECK", "1")  # edited on purpose: loads
    AutoModelForCausalLM.from_pretrained(damaged)


def test_a_format_renamed_in_config_json_is_refused(checkpoint, tmp_path):
    damaged = copy_checkpoint(checkpoint, tmp_path / "renamed")
    config = json.loads((damaged / "config.json").read_text())
    format_map = config["quantization_config"]["format_map"]
    name = next(n for n, f in format_map.items() if f == "mxfp6_e2m3")
    format_map[name] = "mxfp6_e3m2"  # the same packed shapes: only the record tells them apart
    (damaged / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format_map differs from the one the checkpoint was saved with"):
        AutoModelForCausalLM.from_pretrained(damaged)


def test_a_checkpoint_without_a_record_loads_with_one_warning(checkpoint, tmp_path, caplog):
    older = copy_checkpoint(checkpoint, tmp_path / "older")
    (older / "dmx_checksums.json").unlink()
    with caplog.at_level("WARNING", logger="optimum_dmx.integration.integrity"):
        AutoModelForCausalLM.from_pretrained(older)
    assert caplog.text.count("no dmx_checksums.json") == 1


def test_hashing_100_mb_takes_well_under_a_second():
    import time

    import torch

    from optimum_dmx.integration.integrity import tensor_digest

    tensor = torch.randint(0, 255, (100 * 2**20,), dtype=torch.uint8)
    start = time.perf_counter()
    tensor_digest(tensor)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("target", ["compressed-tensors", "quark"])
def test_a_float32_checkpoint_exports_as_bfloat16_and_runs_when_loaded_by_default(tiny_llama_dir, tmp_path, target):
    """Loaded in float32, the loaders' MX layers (bfloat16) fail on mixed dtypes in their first matmul."""
    import torch

    names = linear_names(AutoModelForCausalLM.from_pretrained(tiny_llama_dir))
    config = DMXConfig(format_map=dict.fromkeys(names, "mxfp4_e2m1"))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    assert model.dtype == torch.float32
    model.save_pretrained(tmp_path / "dmx")
    out = export_checkpoint(tmp_path / "dmx", tmp_path / target, target, force=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    served = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = served(torch.tensor([[1, 2, 3]])).logits
    assert served.dtype == torch.bfloat16 and torch.isfinite(logits).all()
