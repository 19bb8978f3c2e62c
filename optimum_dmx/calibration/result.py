"""`CalibrationResult`: a format assignment with its bit accounting, whichever method produced it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from torch import nn

from ..nn.bits import format_map_bits
from .settings import CalibrationSettings


@dataclass
class CalibrationResult:
    """Outcome of a calibration (or of a baseline format assignment).

    Attributes:
        format_map: full module name -> canonical MX format name.
        bits_simple: mean element bits over the quantized layers (scales excluded).
        bits_weighted: element bits averaged by tensor size (weight numel + in_features per layer).
        storage_bits: stored bits per weight element, E8M0 block scales and padding included.
        history: one record per step: `step`, `loss`, `task_loss`, `reg_loss`, `bits` (the average the
            regularizer uses), `bits_simple`, `bits_weighted`, `temperature`.
        beta_hat: final raw offset per module (empty for methods without offsets).
        kl_sensitivities: the KL scan's per-module sensitivity, when the default method blended it into its ranking.
        method: which procedure produced the assignment (`"dmx"`, `"paper"`, `"kl"`, `"uniform"`).
        seconds: wall time of the procedure.
        step_seconds: wall time of each training step (the first one includes compiling the kernels).
        scan_seconds: wall time of the KL scan (0 where the method has none).
        kernel_seconds: of the steps' and of the scan's wall time, how much went to making compiled kernels ready
            (`formats.compilation.kernel_setup_seconds`), by phase (`"steps"`, `"scan"`): a cost paid once per
            kernel, most of it on a machine's first run, whose inductor cache is cold.
    """

    format_map: dict[str, str]
    bits_simple: float
    bits_weighted: float
    storage_bits: float
    history: list[dict] = field(default_factory=list)
    beta_hat: dict[str, float] = field(default_factory=dict)
    kl_sensitivities: dict[str, float] = field(default_factory=dict)
    method: str = "dmx"
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    scan_seconds: float = 0.0
    kernel_seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the result, history included, as indented JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)


def result_from_format_map(
    format_map: Mapping[str, str],
    linears: Mapping[str, nn.Module],
    settings: CalibrationSettings,
    **fields,
) -> CalibrationResult:
    """A `CalibrationResult` for `format_map` over `linears` (modules with a `weight`), bits filled in."""
    shapes = {name: tuple(linears[name].weight.shape) for name in format_map}
    summary = format_map_bits(format_map, shapes, settings.quantize_activations, settings.block_size)
    return CalibrationResult(format_map=dict(format_map), **summary, **fields)
