"""Packages whose public names load on first use (PEP 562), so that importing a package costs only what it uses.

The top-level package (`import optimum_dmx` and the command line's `--help` import neither torch nor
transformers), `calibration` (`DMXConfig` validates its fields with `CalibrationSettings` without importing the
trainer, tqdm and `datasets`), `export` (the command line lists the export targets without loading transformers) and
`integration` (`optimum-dmx inspect` uses the model card's helpers without transformers' quantizer registry) use it.
Each of them also imports its names under `TYPE_CHECKING`, for type checkers and editors, which do not run
`__getattr__`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level `__getattr__` and `__dir__` for `exports` (public name -> the submodule, relative to
    the package, that defines it). `namespace` is the package's `globals()`: a name, once imported, is kept there, so
    later lookups do not come back here.

    Usage, in a package's `__init__.py`: `__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)`."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
