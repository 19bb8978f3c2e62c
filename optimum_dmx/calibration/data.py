"""Calibration data: text from any common source -> packed, shuffled token blocks.

Accepted sources (all go through `datasets`):

* a `datasets.Dataset` (or a `DatasetDict` with a `"train"` split) with a `"text"` column;
* a list of strings: the texts themselves, unless every string names an existing file;
* a local file, a directory, a glob pattern, or a list of file paths (`pathlib.Path`, or strings naming
  existing files): `.txt`, `.json`/`.jsonl` and `.parquet` files (json and parquet need a `"text"` field);
* any other string is a Hub dataset name, loaded with `split="train"` (only when online).

A string that looks like a file path but names no file is an error, never text or a Hub name
(`looks_like_local_path`): it has no whitespace and ends with a data-file extension, or it starts with `/`,
`./`, `../` or `~`, or it holds a path separator that a Hub id would not (a text in a list: any `/`; a single
source: more than one, since Hub ids are `owner/name`).
* a streaming `datasets.IterableDataset`, or a generator/iterator of strings or of records with a `"text"`
  field: read lazily, only as far as the requested blocks need.

All texts are joined with newlines (for text files this restores the original line breaks), tokenized
once without special tokens, cut into non-overlapping blocks that each start the way the tokenizer starts a
text (its BOS token, if it adds one; see `optimum_dmx.text`), and `num_samples` blocks are drawn without
replacement in a seeded random order.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..text import start_tokens, text_tokens, token_windows

# `datasets` (with pyarrow and pandas) takes seconds to import and only reading calibration data needs it, so the
# functions below import it themselves; `DMXConfig` imports this module to check paths when a config is built.


logger = logging.getLogger(__name__)

TEXT_COLUMN = "text"
_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}

CalibrationDataset = str | os.PathLike | Sequence[str] | Sequence[os.PathLike] | Any


def looks_like_local_path(source: str, *, in_list: bool = False) -> bool:
    """Whether a string is meant as a local path rather than a Hub id (or, in a list, a calibration text)."""
    if not source or any(c.isspace() for c in source):
        return False
    separators = source.count("/") + (source.count(os.sep) if os.sep != "/" else 0)
    return (
        Path(source).suffix.lower() in _BUILDERS
        or source.startswith(("/", "./", "../", "~"))
        or os.path.isabs(source)
        or separators > (0 if in_list else 1)
    )


def check_calibration_source(source: Any) -> None:
    """Raise, naming it, for a string of `source` that looks like a local path but names nothing on disk.

    Called when a config is built, so a mistyped file name fails at once instead of being calibrated on as
    a 16-character text or looked up as a Hub dataset. Glob patterns and everything else are left to loading.
    """
    if isinstance(source, (str, os.PathLike)):
        candidates, in_list = [source], False
    elif isinstance(source, (list, tuple)):
        candidates, in_list = [s for s in source if isinstance(s, (str, os.PathLike))], True
    else:
        return
    for candidate in candidates:
        path = os.fspath(candidate)
        meant_as_path = isinstance(candidate, os.PathLike) or looks_like_local_path(path, in_list=in_list)
        if meant_as_path and not glob.has_magic(path) and not os.path.exists(os.path.expanduser(path)):
            raise ValueError(
                f"calibration data not found: {path!r} looks like a file path, but no such file or directory "
                f"exists (relative paths are taken from {os.getcwd()!r}). Pass existing .txt/.json/.jsonl/.parquet "
                "files or folders, a Hub dataset name, a datasets.Dataset, or a list of calibration texts."
            )


def _local_files(source: str | os.PathLike | Sequence[os.PathLike]) -> list[str] | None:
    """The files a local source names (a folder: its data files), or None when `source` is not a local path (then:
    a Hub name)."""
    if not isinstance(source, (str, os.PathLike)):
        paths = [os.path.expanduser(os.fspath(p)) for p in source]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise ValueError(f"calibration files not found: {missing}.")
        return [f for p in paths for f in _local_files(p)]
    path = os.path.expanduser(os.fspath(source))
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if Path(n).suffix.lower() in _BUILDERS)
        if not files:
            raise ValueError(
                f"directory {path!r} holds no calibration files; allowed extensions: {', '.join(sorted(_BUILDERS))}."
            )
        return files
    if os.path.isfile(path):
        return [path]
    if glob.has_magic(path):
        files = sorted(glob.glob(path))
        if not files:
            raise ValueError(f"no calibration files match the pattern {path!r}.")
        return files
    return None


def _load_local(files: list[str]):
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    if not files:
        raise ValueError("the calibration data names no files.")
    builders = {}
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in _BUILDERS:
            raise ValueError(
                f"calibration file {f!r} has an unsupported extension {suffix!r}; "
                f"allowed: {', '.join(sorted(_BUILDERS))}."
            )
        builders[_BUILDERS[suffix]] = f
    if len(builders) > 1:
        raise ValueError(f"calibration files mix formats {sorted(builders)}; pass files of one format at a time.")
    (builder,) = builders
    where = files[0] if len(files) == 1 else f"{len(files)} {builder} files ({files[0]!r}, ...)"
    # A file of 0 bytes holds no text; `datasets` stops on one with an error about schemas (or, for json, a bare
    # StopIteration) that names neither the file nor the cause.
    files = [f for f in files if os.path.getsize(f) > 0]
    if not files:
        raise ValueError(f"calibration data {where!r} is empty: 0 bytes; pass files that hold text.")
    try:
        return load_dataset(builder, data_files=files, split="train")
    except DatasetGenerationError as error:  # its own message names neither the file nor what went wrong
        cause = error.__cause__ or error.__context__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
        raise ValueError(f"cannot read calibration data {where!r} as {builder}: {reason}") from error


def load_calibration_dataset(source: CalibrationDataset):
    """Turn any accepted calibration source into a `datasets.Dataset`."""
    from datasets import Dataset, DatasetDict, config

    if isinstance(source, Dataset):
        return source
    if isinstance(source, DatasetDict):
        if "train" not in source:
            raise ValueError(f"the DatasetDict has no 'train' split; its splits are {sorted(source)}.")
        return source["train"]
    check_calibration_source(source)
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, (str, os.PathLike)) for s in source):
        existing = [s for s in source if isinstance(s, os.PathLike) or os.path.exists(os.path.expanduser(s))]
        if len(existing) == len(source):
            return _load_local(_local_files(source))
        if existing:
            raise ValueError(
                f"the calibration list mixes {len(existing)} existing paths (e.g. {os.fspath(existing[0])!r}) with "
                f"{len(source) - len(existing)} strings that name nothing on disk: pass only files and folders, or "
                "only calibration texts."
            )
        return Dataset.from_dict({TEXT_COLUMN: list(source)})
    if isinstance(source, (str, os.PathLike)):
        files = _local_files(source)
        if files is not None:
            return _load_local(files)
        if isinstance(source, os.PathLike):
            raise ValueError(f"calibration path {os.fspath(source)!r} is neither a file nor a directory.")
        if config.HF_HUB_OFFLINE:
            raise ValueError(
                f"{source!r} is not a local file, directory or glob, and the Hub is offline "
                "(HF_HUB_OFFLINE), so it cannot be loaded as a Hub dataset."
            )
        from datasets import load_dataset

        return load_dataset(source, split="train")
    raise TypeError(
        f"unsupported calibration data of type {type(source).__name__}; allowed: a Hub dataset name, a local "
        "file/directory/glob, a list of pathlib.Path, a datasets.Dataset, or a list of strings."
    )


def _is_stream(source: Any) -> bool:
    """A streaming `datasets.IterableDataset`, or any other iterator or generator (read once, lazily)."""
    from datasets import IterableDataset

    return isinstance(source, IterableDataset) or isinstance(source, Iterator)


def _streamed_texts(source: Any, max_chars: int) -> list[str]:
    """Texts from a stream of strings or of records with a "text" field, until `max_chars` characters."""
    texts, total = [], 0
    for item in source:
        if isinstance(item, Mapping):
            if TEXT_COLUMN not in item:
                raise ValueError(f"the calibration stream has no {TEXT_COLUMN!r} field; its fields are {sorted(item)}.")
            item = item[TEXT_COLUMN]
        if not isinstance(item, str):
            raise TypeError(
                f"the calibration stream yields {type(item).__name__}; expected str or a record with 'text'."
            )
        texts.append(item)
        total += len(item) + 1
        if total >= max_chars:
            break
    return texts


def _texts(dataset) -> list[str]:
    if TEXT_COLUMN not in dataset.column_names:
        raise ValueError(
            f"the calibration dataset has no {TEXT_COLUMN!r} column; its columns are {dataset.column_names}."
        )
    texts = [t for t in dataset[TEXT_COLUMN] if t is not None]
    wrong = next((t for t in texts if not isinstance(t, str)), None)
    if wrong is not None:
        raise TypeError(
            f"the calibration dataset's {TEXT_COLUMN!r} column holds {type(wrong).__name__} values; it "
            "must hold strings."
        )
    return texts


# No tokenizer packs more than this many characters per token on average: text for n tokens is within 16 n characters.
MAX_CHARS_PER_TOKEN = 16


def build_calibration_batches(
    dataset: CalibrationDataset, tokenizer, seq_len: int, num_samples: int, seed: int = 0
) -> torch.LongTensor:
    """Tokenize, pack and sample calibration sequences.

    Returns a `[num_samples, seq_len]` LongTensor of token ids, each row starting with the tokenizer's start
    tokens (BOS where it adds one). When the text holds fewer than
    `num_samples` blocks, all blocks are returned (with a warning) rather than repeating any.
    Deterministic for a given `seed`.
    """
    _check_arguments(dataset, tokenizer, seq_len, num_samples)
    if _is_stream(dataset):
        # Read only what the blocks need.
        texts = _streamed_texts(dataset, max_chars=MAX_CHARS_PER_TOKEN * seq_len * num_samples)
    else:
        texts = _texts(load_calibration_dataset(dataset))
    text = "\n".join(texts)
    if not text.strip():
        raise ValueError("the calibration data is empty: it holds no non-whitespace text.")
    ids = text_tokens(tokenizer, text)
    blocks = token_windows(ids, seq_len, start_tokens(tokenizer))
    num_blocks = len(blocks)
    if num_blocks == 0:
        raise ValueError(
            f"the calibration text is too short: {len(ids)} tokens, but one block needs seq_len={seq_len} tokens."
        )
    if num_blocks < num_samples:
        logger.warning(
            "The calibration text holds %d blocks of %d tokens, fewer than num_samples=%d; using all %d.",
            num_blocks,
            seq_len,
            num_samples,
            num_blocks,
        )
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return blocks[order[:num_samples]]


def check_calibration_data(dataset: CalibrationDataset, tokenizer, seq_len: int, num_samples: int) -> None:
    """Raise (or warn) as `build_calibration_batches` would for these arguments, reading no more text than
    `num_samples` blocks need when the data holds that much (a stream is not read: reading would consume it).

    What the CLI runs before it loads a model: a corpus of megabytes takes seconds to tokenize, and calibration
    tokenizes it again.
    """
    _check_arguments(dataset, tokenizer, seq_len, num_samples)
    if _is_stream(dataset):
        return
    text = "\n".join(_texts(load_calibration_dataset(dataset)))
    prefix = text[: MAX_CHARS_PER_TOKEN * seq_len * num_samples]
    if (
        prefix.strip()
        and len(token_windows(text_tokens(tokenizer, prefix), seq_len, start_tokens(tokenizer))) >= num_samples
    ):
        return
    build_calibration_batches(dataset, tokenizer, seq_len, num_samples)  # too little text: its error or warning


def _check_arguments(dataset: CalibrationDataset, tokenizer, seq_len: int, num_samples: int) -> None:
    if tokenizer is None:
        raise ValueError("a tokenizer is required to build calibration batches; got tokenizer=None.")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must be a callable Hugging Face tokenizer; got {type(tokenizer).__name__}.")
    for name, value in (("seq_len", seq_len), ("num_samples", num_samples)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if isinstance(dataset, (list, tuple)) and not dataset:
        raise ValueError("the calibration data is empty: got an empty list.")
