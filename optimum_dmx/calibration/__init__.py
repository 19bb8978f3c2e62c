"""dMX calibration: learn a per-layer MX format assignment, plus the baselines it is compared with.

The names below load on first use (PEP 562): `DMXConfig` validates its fields with `CalibrationSettings`, and
neither that nor loading a saved dMX model should pay for importing the trainer, tqdm and `datasets`.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "CalibrationResult": "result",
    "CalibrationSettings": "settings",
    "DMXLinear": "dmx_linear",
    "EndpointProbe": "dmx_linear",
    "PRESETS": "presets",
    "PaperRecipe": "settings",
    "Preset": "presets",
    "RelaxedOffset": "dmx_linear",
    "bit_regularizer": "regularizers",
    "build_calibration_batches": "data",
    "calibrate": "trainer",
    "discrete_offset": "schedule",
    "get_preset": "presets",
    "gptq_pack": "gptq",
    "dmx_linears": "trainer",
    "kl_preselection": "baselines",
    "kl_sensitivities": "sensitivity",
    "load_calibration_dataset": "data",
    "result_from_format_map": "result",
    "round_weights_by_gptq": "gptq",
    "temperature_at": "schedule",
    "temperature_sigmoid": "schedule",
    "uniform": "baselines",
    "uniform_format_map": "baselines",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
