"""Export dMX checkpoints to the formats serving engines load: `export_checkpoint` and its targets, and
`load_exported`, which loads an export with transformers finished by its loader's code.

Above `integration` (it reads saved dMX folders) and below the command line. The names below load on first use
(`optimum_dmx.lazy`): the command line lists `EXPORT_TARGETS` without importing transformers.
"""

from __future__ import annotations

from ..lazy import lazy_exports

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
