"""dMX calibration: learn a per-layer MX format assignment, plus the baselines it is compared with."""

from .baselines import calibrate_round_ste, kl_preselection, kl_sensitivities, uniform, uniform_format_map
from .data import build_calibration_batches, load_calibration_dataset
from .regularizers import average_bits, bit_regularizer, bit_summary, storage_bits, tensor_sizes
from .schedule import temperature_at, temperature_sigmoid
from .settings import CalibrationSettings
from .trainer import (
    CalibrationResult,
    calibrate,
    dmx_linears,
    emulate_format_map,
    linear_modules_to_quantize,
    result_from_format_map,
)

__all__ = [
    "CalibrationResult",
    "CalibrationSettings",
    "average_bits",
    "bit_regularizer",
    "bit_summary",
    "build_calibration_batches",
    "calibrate",
    "calibrate_round_ste",
    "dmx_linears",
    "emulate_format_map",
    "kl_preselection",
    "kl_sensitivities",
    "linear_modules_to_quantize",
    "load_calibration_dataset",
    "result_from_format_map",
    "storage_bits",
    "temperature_at",
    "temperature_sigmoid",
    "tensor_sizes",
    "uniform",
    "uniform_format_map",
]
