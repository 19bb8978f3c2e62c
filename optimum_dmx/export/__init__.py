"""Export dMX checkpoints to the formats serving engines load: `export_checkpoint` and its targets, and
`load_exported`, which loads an export with transformers finished by its loader's code.

Above `integration` (it reads saved dMX folders) and below the command line.
"""

from .checkpoint import ExportError, export_checkpoint
from .loading import finish_loading, is_export, load_exported
from .targets import EXPORT_TARGETS, ExportTarget, get_export_target

__all__ = [
    "EXPORT_TARGETS",
    "ExportError",
    "ExportTarget",
    "export_checkpoint",
    "finish_loading",
    "get_export_target",
    "is_export",
    "load_exported",
]
