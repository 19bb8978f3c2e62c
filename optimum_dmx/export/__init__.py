"""Export dMX checkpoints to the formats serving engines load: `export_checkpoint` and its targets.

Above `integration` (it reads saved dMX folders) and below the command line.
"""

from .checkpoint import ExportError, export_checkpoint
from .targets import EXPORT_TARGETS, ExportTarget, get_export_target

__all__ = ["EXPORT_TARGETS", "ExportError", "ExportTarget", "export_checkpoint", "get_export_target"]
