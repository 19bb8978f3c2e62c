import json
import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict

from optimum_dmx.calibration import build_calibration_batches
from optimum_dmx.calibration.data import MAX_CHARS_PER_TOKEN, check_calibration_data

from .helpers import word_tokenizer, words

TEXTS = [words(0, 50), words(50, 30), words(80, 40)]  # 120 tokens, ids 1..120 in order


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def stream():
    return torch.arange(1, 121)


def assert_blocks_of_stream(batches, seq_len):
    """Every row is one of the non-overlapping seq_len windows of the token stream, none repeated."""
    windows = stream()[: len(stream()) // seq_len * seq_len].view(-1, seq_len)
    positions = [next(i for i, w in enumerate(windows) if torch.equal(w, row)) for row in batches]
    assert len(set(positions)) == len(positions)


def test_list_of_strings_is_packed_into_blocks(tokenizer):
    batches = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=5, seed=0)
    assert batches.shape == (5, 10) and batches.dtype == torch.long
    assert_blocks_of_stream(batches, 10)


def test_shuffle_is_reproducible_and_seeded(tokenizer):
    a = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=12, seed=0)
    b = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=12, seed=0)
    c = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=12, seed=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # The same blocks, in another order; all 12 blocks together rebuild the token stream.
    assert torch.equal(a.flatten().sort().values, stream()) and torch.equal(c.flatten().sort().values, stream())


def test_fewer_blocks_than_samples_returns_all_with_a_warning(tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        batches = build_calibration_batches(TEXTS, tokenizer, seq_len=50, num_samples=10, seed=0)
    assert batches.shape == (2, 50)
    assert "fewer than num_samples=10" in caplog.text


def test_dataset_and_datasetdict(tokenizer):
    expected = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=12, seed=0)
    ds = Dataset.from_dict({"text": TEXTS, "id": [0, 1, 2]})
    assert torch.equal(build_calibration_batches(ds, tokenizer, 10, 12, 0), expected)
    dd = DatasetDict({"train": ds})
    assert torch.equal(build_calibration_batches(dd, tokenizer, 10, 12, 0), expected)
    with pytest.raises(ValueError, match=r"no 'train' split; its splits are \['test'\]"):
        build_calibration_batches(DatasetDict({"test": ds}), tokenizer, 10, 12, 0)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json", "parquet"])
def test_local_files(tmp_path, tokenizer, kind):
    expected = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=12, seed=0)
    path = tmp_path / f"calib.{kind}"
    if kind == "txt":
        path.write_text("\n".join(TEXTS) + "\n")
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS)))
    elif kind == "json":
        path.write_text(json.dumps([{"text": t} for t in TEXTS]))
    else:
        Dataset.from_dict({"text": TEXTS}).to_parquet(str(path))
    assert torch.equal(build_calibration_batches(str(path), tokenizer, 10, 12, 0), expected)
    assert torch.equal(build_calibration_batches(path, tokenizer, 10, 12, 0), expected)


def test_several_files_directory_and_glob(tmp_path, tokenizer):
    expected = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=12, seed=0)
    for i, text in enumerate(TEXTS):
        (tmp_path / f"part{i}.txt").write_text(text + "\n")
    files = sorted(tmp_path.glob("*.txt"))
    assert torch.equal(build_calibration_batches(files, tokenizer, 10, 12, 0), expected)
    assert torch.equal(build_calibration_batches([str(f) for f in files], tokenizer, 10, 12, 0), expected)
    assert torch.equal(build_calibration_batches(str(tmp_path), tokenizer, 10, 12, 0), expected)
    assert torch.equal(build_calibration_batches(str(tmp_path / "part*.txt"), tokenizer, 10, 12, 0), expected)


def test_empty_data_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="empty"):
        build_calibration_batches([], tokenizer, 10, 4)
    with pytest.raises(ValueError, match="empty"):
        build_calibration_batches(["  ", "\n"], tokenizer, 10, 4)
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        build_calibration_batches(tmp_path / "blank.txt", tokenizer, 10, 4)


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "empty.parquet"])
def test_a_file_of_zero_bytes_is_named_as_empty(tmp_path, tokenizer, name):
    """`datasets` stops on a 0-byte file with a schema error (text), a bare StopIteration (json) or ArrowInvalid
    (parquet); the error names the file and says it is empty. Beside a file with text, it is skipped."""
    (tmp_path / name).touch()
    with pytest.raises(ValueError, match=rf"calibration data '.*{name}' is empty: 0 bytes"):
        build_calibration_batches(tmp_path / name, tokenizer, 10, 4)
    if name.endswith(".txt"):
        (tmp_path / "text.txt").write_text(" ".join(TEXTS))
        expected = build_calibration_batches(tmp_path / "text.txt", tokenizer, 10, 4, 0)
        both = build_calibration_batches([tmp_path / name, tmp_path / "text.txt"], tokenizer, 10, 4, 0)
        assert torch.equal(both, expected)


def test_text_too_short_names_both_lengths(tokenizer):
    with pytest.raises(ValueError, match="120 tokens.*seq_len=200"):
        build_calibration_batches(TEXTS, tokenizer, seq_len=200, num_samples=4)


def test_missing_tokenizer():
    with pytest.raises(ValueError, match="tokenizer is required.*None"):
        build_calibration_batches(TEXTS, None, 10, 4)
    with pytest.raises(TypeError, match="tokenizer must be a callable.*str"):
        build_calibration_batches(TEXTS, "gpt2", 10, 4)


def test_dataset_without_text_column_names_its_columns(tmp_path, tokenizer):
    ds = Dataset.from_dict({"content": TEXTS, "label": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"no 'text' column; its columns are \['content', 'label'\]"):
        build_calibration_batches(ds, tokenizer, 10, 4)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    with pytest.raises(ValueError, match=r"its columns are \['body'\]"):
        build_calibration_batches(path, tokenizer, 10, 4)


def test_bad_sources_are_named(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="type int.*Hub dataset name"):
        build_calibration_batches(42, tokenizer, 10, 4)
    (tmp_path / "data.csv").write_text("text\nw1 w2\n")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.json, \.jsonl, \.parquet, \.text, \.txt"):
        build_calibration_batches(tmp_path / "data.csv", tokenizer, 10, 4)
    with pytest.raises(ValueError, match="not found.*missing.txt"):
        build_calibration_batches([Path(tmp_path / "missing.txt")], tokenizer, 10, 4)
    with pytest.raises(ValueError, match="not found.*missing.txt"):
        build_calibration_batches(Path(tmp_path / "missing.txt"), tokenizer, 10, 4)
    with pytest.raises(ValueError, match="no calibration files match"):
        build_calibration_batches(str(tmp_path / "*.parquet"), tokenizer, 10, 4)
    (tmp_path / "a.txt").write_text("w1\n")
    (tmp_path / "b.jsonl").write_text('{"text": "w2"}\n')
    with pytest.raises(ValueError, match=r"mix formats \['json', 'text'\]"):
        build_calibration_batches([tmp_path / "a.txt", tmp_path / "b.jsonl"], tokenizer, 10, 4)
    with pytest.raises(ValueError, match="num_samples=0"):
        build_calibration_batches(TEXTS, tokenizer, 10, 0)


def test_hub_name_refused_when_offline(monkeypatch, tokenizer):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="'someone/some-corpus'.*offline"):
        build_calibration_batches("someone/some-corpus", tokenizer, 10, 4)


def test_generators_and_streaming_datasets_are_read_lazily(tokenizer):
    expected = build_calibration_batches(TEXTS, tokenizer, seq_len=10, num_samples=12, seed=0)
    assert torch.equal(build_calibration_batches(iter(TEXTS), tokenizer, 10, 12, 0), expected)
    records = Dataset.from_dict({"text": TEXTS, "id": [0, 1, 2]}).to_iterable_dataset()
    assert torch.equal(build_calibration_batches(records, tokenizer, 10, 12, 0), expected)

    consumed = []

    def endless():
        for i in range(10**6):
            consumed.append(i)
            yield words(i, 20)

    batches = build_calibration_batches(endless(), tokenizer, seq_len=10, num_samples=3, seed=0)
    assert batches.shape == (3, 10) and len(consumed) < 100  # stops once the blocks are covered


def test_stream_errors_name_what_is_wrong(tokenizer):
    with pytest.raises(ValueError, match=r"no 'text' field; its fields are \['body'\]"):
        build_calibration_batches(iter([{"body": "w1 w2"}]), tokenizer, 2, 1, 0)
    with pytest.raises(TypeError, match="yields int"):
        build_calibration_batches(iter([1, 2]), tokenizer, 2, 1, 0)
    with pytest.raises(ValueError, match="empty"):
        build_calibration_batches(iter([]), tokenizer, 2, 1, 0)


def test_blocks_start_like_the_tokenizer_starts_a_text():
    """A tokenizer that adds BOS (Llama 3, Gemma) gets BOS-led blocks; one that adds nothing (SmolLM2) does not."""
    with_bos = word_tokenizer(bos=True)
    bos = with_bos.bos_token_id
    assert with_bos("w1 w2")["input_ids"] == [bos, 2, 3]  # the tokenizer really adds it
    batches = build_calibration_batches(TEXTS, with_bos, seq_len=10, num_samples=20, seed=0)
    assert batches.shape == (13, 10)  # 120 text tokens in blocks of 9 after the BOS
    assert bool((batches[:, 0] == bos).all())
    body = batches[:, 1:]
    assert bool((body[:, 1:] - body[:, :-1] == 1).all())  # then consecutive text tokens
    assert sorted(body[:, 0].tolist()) == list(range(1, 118, 9))
    plain = build_calibration_batches(TEXTS, word_tokenizer(), seq_len=10, num_samples=20, seed=0)
    assert plain.shape == (12, 10) and bos not in plain


@pytest.mark.parametrize(
    "dataset", ["calibration.txt", ["calibration.txt"], "data/austen/emma.txt", ["shakespeare/tempest"], "./notes"]
)
def test_a_missing_file_is_named_not_taken_as_text_or_a_hub_name(tmp_path, monkeypatch, dataset):
    from optimum_dmx import DMXConfig

    monkeypatch.chdir(tmp_path)
    missing = dataset[0] if isinstance(dataset, list) else dataset
    with pytest.raises(ValueError, match=f"calibration data not found: '{missing}' looks like a file path"):
        DMXConfig(dataset=dataset)
    with pytest.raises(ValueError, match=f"not found: '{missing}'"):
        build_calibration_batches(dataset, word_tokenizer(), seq_len=10, num_samples=2)


def test_texts_hub_names_and_existing_files_are_accepted(tmp_path, monkeypatch):
    from optimum_dmx import DMXConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "calibration.txt").write_text(words(0, 40))
    for dataset in (
        ["w1 w2 w3", "w4/w5 w6"],
        "wikitext",
        "Salesforce/wikitext",
        "calibration.txt",
        ["calibration.txt"],
    ):
        assert DMXConfig(dataset=dataset).dataset == dataset
    assert build_calibration_batches(["calibration.txt"], word_tokenizer(), 10, 2).shape == (2, 10)


class _RecordingTokenizer:
    """A real tokenizer that records the length of every text it is called on."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)


def test_checking_data_tokenizes_only_what_the_samples_need(tokenizer):
    """A corpus far larger than the samples is checked from its start only; the batches still read all of it."""
    corpus = [words(i % 120, 1) for i in range(100_000)]  # 100,000 one-word lines: about 400,000 characters
    recording = _RecordingTokenizer(tokenizer)
    check_calibration_data(corpus, recording, seq_len=10, num_samples=4)
    assert max(recording.lengths) <= MAX_CHARS_PER_TOKEN * 10 * 4
    recording.lengths.clear()
    build_calibration_batches(corpus, recording, seq_len=10, num_samples=4)
    assert max(recording.lengths) == len("\n".join(corpus))


@pytest.mark.parametrize(
    "data, seq_len, num_samples",
    [([], 10, 4), (["  ", "\n"], 10, 4), ([words(0, 5)], 10, 4), (["w1"], "10", 4), (["w1"], 10, 0)],
)
def test_checking_data_raises_what_building_the_batches_raises(tokenizer, data, seq_len, num_samples):
    with pytest.raises(ValueError) as built:
        build_calibration_batches(data, tokenizer, seq_len, num_samples)
    with pytest.raises(ValueError) as checked:
        check_calibration_data(data, tokenizer, seq_len, num_samples)
    assert str(checked.value) == str(built.value)


def test_checking_too_little_data_warns_as_building_the_batches_does(tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        check_calibration_data(TEXTS, tokenizer, seq_len=50, num_samples=10)
    assert "fewer than num_samples=10" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_calibration_data(TEXTS, tokenizer, seq_len=10, num_samples=12)  # exactly enough: no warning
    assert caplog.text == ""
