"""dMX calibration: learn a per-layer MX format assignment, plus the baselines it is compared with.

The names below load on first use (PEP 562): `DMXConfig` validates its fields with `CalibrationSettings`, and
neither that nor loading a saved dMX model should pay for importing the trainer, tqdm and `datasets`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and editors see; the names load on first use (`__getattr__`)
    from .baselines import kl_preselection as kl_preselection
    from .baselines import uniform as uniform
    from .baselines import uniform_format_map as uniform_format_map
    from .data import build_calibration_batches as build_calibration_batches
    from .data import load_calibration_dataset as load_calibration_dataset
    from .dmx_linear import DMXLinear as DMXLinear
    from .dmx_linear import EndpointProbe as EndpointProbe
    from .dmx_linear import RelaxedOffset as RelaxedOffset
    from .gptq import gptq_pack as gptq_pack
    from .gptq import round_weights_by_gptq as round_weights_by_gptq
    from .presets import PRESETS as PRESETS
    from .presets import Preset as Preset
    from .presets import get_preset as get_preset
    from .regularizers import bit_regularizer as bit_regularizer
    from .result import CalibrationResult as CalibrationResult
    from .result import result_from_format_map as result_from_format_map
    from .schedule import discrete_offset as discrete_offset
    from .schedule import temperature_at as temperature_at
    from .schedule import temperature_sigmoid as temperature_sigmoid
    from .sensitivity import kl_sensitivities as kl_sensitivities
    from .settings import CalibrationSettings as CalibrationSettings
    from .settings import PaperRecipe as PaperRecipe
    from .trainer import calibrate as calibrate
    from .trainer import dmx_linears as dmx_linears

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
