"""Writing a model folder all at once: never a half-written checkpoint, never a user's folder replaced unasked.

`staged_folder` writes into a hidden sibling and renames it into place only once complete; a lock file beside the
target keeps a second writer from racing the first (the second gets a clear error, nothing is lost); `check_output`
refuses an output folder that is, contains or lies inside a folder the command reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["FolderInUseError", "check_output", "staged_folder"]


class FolderInUseError(FileExistsError):
    """Another process is writing the same output folder."""


def check_output(output: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> None:
    """Raise `ValueError` when `output` is, contains or lies inside one of the `inputs` (what the command reads):
    writing it would replace or delete what is being read."""
    out = Path(output).expanduser().resolve()
    for source in inputs:
        src = Path(source).expanduser().resolve()
        if out == src:
            relation = "is"
        elif out in src.parents:
            relation = "contains"
        elif src in out.parents:
            relation = "lies inside"
        else:
            continue
        raise ValueError(
            f"output folder {str(output)!r} {relation} {str(source)!r}, which this command reads; writing it would "
            "replace what is being read. Choose an output folder outside it."
        )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def _writer_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on `.<name>.lock` beside `target`; raise `FolderInUseError` if another process does."""
    lock_path = target.parent / f".{target.name}.lock"
    in_use = FolderInUseError(
        f"another process is writing {str(target)!r}; wait for it or choose another output folder"
    )
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use from None
        try:
            if not lock_path.exists() or lock_path.stat().st_ino != os.fstat(lock.fileno()).st_ino:
                raise in_use  # the lock file was removed by a writer that finished meanwhile: someone else has it
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
            fcntl.flock(lock, fcntl.LOCK_UN)


def _check_replaceable(target: Path, overwrite: bool) -> None:
    if target.exists() and not overwrite and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{str(target)!r} exists and is not empty; pass overwrite=True to replace it")


@contextmanager
def staged_folder(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder that replaces `target` when the block completes without error.

    The staging folder is a hidden sibling of `target` (same file system, so the final move is a rename), created
    with the permissions a new folder gets (the umask's). If the block raises, or the process dies, `target` is
    untouched; staging folders a killed writer left behind are removed by the next writer. A `target` that exists
    and is not an empty folder raises `FileExistsError` unless `overwrite`, checked on entry and again just before
    the swap (another writer may have finished meanwhile); it is then replaced whole, only once the new content is
    complete. Two writers of one `target` at a time: the second raises `FolderInUseError`.
    """
    target = Path(target)
    _check_replaceable(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _writer_lock(target):
        for stale in target.parent.glob(f".{target.name}.*.partial"):  # a live writer would hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
        staging.chmod(0o777 & ~_umask())
        try:
            yield staging
            _check_replaceable(target, overwrite)
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
                os.replace(target, old / target.name)
                os.replace(staging, target)
                shutil.rmtree(old)
            else:
                os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
