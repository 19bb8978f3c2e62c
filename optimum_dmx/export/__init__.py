"""Export dMX checkpoints to the formats serving engines load: `export_checkpoint` and its targets, and
`load_exported`, which loads an export with transformers finished by its loader's code.

Above `integration` (it reads saved dMX folders) and below the command line. The names below load on first use
(`optimum_dmx.lazy`): the command line lists `EXPORT_TARGETS` without importing transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and editors see; the names load on first use (`__getattr__`)
    from .checkpoint import ExportError as ExportError
    from .checkpoint import export_checkpoint as export_checkpoint
    from .loading import finish_loading as finish_loading
    from .loading import is_export as is_export
    from .loading import load_exported as load_exported
    from .targets import EXPORT_TARGETS as EXPORT_TARGETS
    from .targets import ExportTarget as ExportTarget
    from .targets import get_export_target as get_export_target

_EXPORTS = {
    "EXPORT_TARGETS": "targets",
    "ExportError": "checkpoint",
    "ExportTarget": "targets",
    "export_checkpoint": "checkpoint",
    "finish_loading": "loading",
    "get_export_target": "targets",
    "is_export": "loading",
    "load_exported": "loading",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
