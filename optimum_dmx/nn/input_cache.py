"""`InputCache`: what several modules compute from the same input tensor, computed once.

In transformers' decoders q/k/v read one normalized hidden state and gate/up another. Each of them quantizes
its input activation; where their formats (and block settings) agree, the quantized activations are identical, so
the first module computes it and the others reuse it. The same holds during calibration, where layers probed
at the same format share their input's quantization.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["InputCache", "tensor_version"]


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place modification counter (``None`` for tensors made under ``torch.inference_mode``,
    which have none)."""
    return None if tensor.is_inference() else tensor._version


class InputCache:
    """Values computed from input tensors, kept as long as the tensor lives and is not modified in place.

    An entry is keyed by the input tensor's identity and a caller's key (a format and its settings). A finalizer
    drops the tensor's entries when it is freed, so a later tensor at the same address never matches them, and
    activation checkpointing frees them with the activation; an in-place modification of the tensor (its version
    counter) makes them stale. Tensors made under ``torch.inference_mode`` have no version counter: there the cache
    relies on the modules reading an input without modifying it between them, as every transformers decoder does.

    The cache is a plain attribute of the modules sharing it, not state: a copy (``copy.deepcopy``, pickling) of a
    model gets an empty cache of its own.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int | None, dict[Hashable, Any]]] = {}  # id -> (version, key -> value)

    def get(self, x: torch.Tensor, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The value of ``key`` for ``x``: ``compute()``, called only the first time for this tensor and key."""
        version = tensor_version(x)
        entry = self._entries.get(id(x))
        if entry is None:
            weakref.finalize(x, self._entries.pop, id(x), None)
        if entry is None or entry[0] != version:
            entry = self._entries[id(x)] = (version, {})
        values = entry[1]
        if key not in values:
            values[key] = compute()
        return values[key]

    def clear(self) -> None:
        """Drop every entry (their finalizers then find nothing to drop)."""
        self._entries.clear()

    def __len__(self) -> int:
        return sum(len(values) for _, values in self._entries.values())

    def __reduce__(self) -> tuple:
        return type(self), ()
