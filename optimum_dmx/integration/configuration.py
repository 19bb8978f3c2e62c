"""`DMXConfig`: the transformers quantization config of the dMX backend.

One object serves two moments:

* **before quantization** it describes a calibration (target bits, format pair, data, schedule), or an
  explicit per-layer `format_map` to apply without calibrating;
* **after quantization** (what `config.json` holds) it records the `format_map` that was applied, the
  achieved bit-widths and the settings needed to reproduce it.

The calibration fields are validated and defaulted by `CalibrationSettings`, so both live in one place.
The calibration inputs (`dataset`, `tokenizer`) are runtime objects: they are shared by reference on
`copy.deepcopy` (transformers deep-copies quantization configs, and a generator cannot be copied) and
never serialized.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..calibration.data import check_calibration_source
from ..calibration.settings import CalibrationSettings
from ..formats import MX_FORMATS, get_format
from ..nn.rotation import LEARNABLE_ROTATIONS, validate_rotation
from ..nn.transforms import RandomizedHadamard

QUANT_METHOD = "dmx"

logger = logging.getLogger(__name__)

# Settings only the paper's recipe reads; the default recipe keeps the budget by construction.
_PAPER_ONLY_FIELDS = ("lr", "reg_lambda")
_SETTINGS_FIELDS = tuple(field.name for field in dataclasses.fields(CalibrationSettings))
# Achieved bit-widths, recorded with an applied format map.
_RESULT_FIELDS = ("bits_simple", "bits_weighted", "storage_bits")
# Runtime-only inputs: shared on deepcopy, never serialized.
_RUNTIME_FIELDS = ("dataset", "tokenizer")


class DMXConfig(QuantizationConfigMixin):
    """Configuration of dMX mixed-precision MX quantization.

    Args:
        target_bits: average element bit-width the calibration aims for; within the format pair's range
            (4-8 for `"mxfp8-mxfp4"`, 4-6 for `"mxfp6-mxfp4"`). With the default recipe the result lands within
            0.05 bits of it (when the model's layers are fine-grained enough to allow it), never above.
        recipe: `"dmx"` (default: sampled format maps at the budget, see `docs/method.md`) or `"paper"` (the dMX
            paper's procedure exactly).
        format_pair: `"mxfp8-mxfp4"` or `"mxfp6-mxfp4"`, the low and high format each layer chooses from.
        dataset: calibration text: a Hub dataset name, local text/json/parquet file(s), a
            `datasets.Dataset` (streaming or not), a generator or a list of strings. Never serialized.
        tokenizer: tokenizer used to build the calibration batches. Never serialized.
        num_samples, seq_len, batch_size, steps, lr, regularizer, reg_lambda, bit_average, discretization, t_start,
        t_end, t_warmup_ratio, seed: calibration settings (`CalibrationSettings`, `docs/method.md`); `None` takes
        the default.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass of calibration
            instead of keeping them (less memory, about one more forward pass per step; same results).
        offset_probe: where the default recipe reads each layer's loss derivative: `"low"` (default), `"path"` or `"swap"`
            (`CalibrationSettings`).
        loss: what the offsets learn from: `"cross_entropy"` (default; the model's loss on the calibration text) or
            `"distillation"` (KL from the float model's next-token distributions; one more forward pass per step).
        kl_weight, kl_samples: the final ranking blends the learned offsets' rank with KL pre-selection's (weight
            `kl_weight`, scan on the first `kl_samples` calibration sequences); `CalibrationSettings`.
        rotation: function-preserving rotations applied before calibration (`nn.rotation`, `docs/method.md`):
            `"none"` (default), `"hadamard"` (full-size randomized Hadamard transforms), `"block_hadamard"`
            (block-diagonal ones aligned to the MX blocks) or `"online_block_hadamard"` (a block-diagonal transform of
            every quantized linear's input at run time, nothing merged into the residual stream). Merged rotations change the saved weights (tied
            embeddings are untied); the online transform of each `down_proj` input is recorded in
            `input_transforms` and rebuilt on load.
        learn_rotations, rotation_lr: train the merged rotations of `"hadamard"` / `"block_hadamard"` jointly with
            the offsets (Cayley SGD at `rotation_lr`, `CalibrationSettings`); the learned rotations are merged into
            the saved weights, nothing is needed at load time.
        offset_groups: layers that share one offset and so one format: `"none"` (default), `"fused"` (q/k/v and
            gate/up of each decoder layer, as vLLM and SGLang fuse them: needed to export a servable map) or
            explicit lists of module names.
        block_size: MX block size (32 in the OCP spec).
        quantize_activations: quantize each quantized linear's input activations to its format.
        scale_rule: how each MX block scale follows its block maximum, in calibration, in the saved model and in
            export: `"ocp"` (default: the OCP specification's floor) or the rounding rule of the engine the model
            will be served with, `"compressed-tensors"` (vLLM's compressed-tensors path) or `"quark"` (AMD Quark).
            Stored in config.json.
        modules_to_not_convert: module-name patterns kept in full precision (transformers' matching rule), in
            addition to transformers' default skips (the output embeddings, tied weights and the model's
            `keep_in_fp32` modules). Defaults to `["lm_head"]`.
        format_map: full module name -> MX format name. Given without a dataset, it is applied as is
            (no calibration); after calibration it holds the learned assignment.
        input_transforms: full module name -> online input transform (`RandomizedHadamard.to_dict()`), written
            with the format map when `rotation` is on.
        bits_simple, bits_weighted, storage_bits: achieved bit-widths, written with the format map.
        kwargs: keys written by other versions of the package; accepted and ignored.
    """

    def __init__(
        self,
        target_bits: float | None = None,
        recipe: str | None = None,
        format_pair: str | None = None,
        dataset: Any = None,
        tokenizer: Any = None,
        num_samples: int | None = None,
        seq_len: int | None = None,
        batch_size: int | None = None,
        steps: int | None = None,
        lr: float | None = None,
        regularizer: str | None = None,
        reg_lambda: float | None = None,
        bit_average: str | None = None,
        discretization: str | None = None,
        t_start: float | None = None,
        t_end: float | None = None,
        t_warmup_ratio: float | None = None,
        offset_probe: str | None = None,
        loss: str | None = None,
        kl_weight: float | None = None,
        kl_samples: int | None = None,
        rotation: str | None = None,
        learn_rotations: bool | None = None,
        rotation_lr: float | None = None,
        offset_groups: str | list[list[str]] | None = None,
        block_size: int | None = None,
        quantize_activations: bool | None = None,
        scale_rule: str | None = None,
        modules_to_not_convert: list[str] | None = None,
        seed: int | None = None,
        gradient_checkpointing: bool | None = None,
        format_map: Mapping[str, str] | None = None,
        input_transforms: Mapping[str, dict] | None = None,
        bits_simple: float | None = None,
        bits_weighted: float | None = None,
        storage_bits: float | None = None,
        **kwargs: Any,
    ):
        given = {
            "recipe": recipe,
            "target_bits": target_bits,
            "format_pair": format_pair,
            "num_samples": num_samples,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "steps": steps,
            "lr": lr,
            "regularizer": regularizer,
            "reg_lambda": reg_lambda,
            "bit_average": bit_average,
            "discretization": discretization,
            "t_start": t_start,
            "t_end": t_end,
            "t_warmup_ratio": t_warmup_ratio,
            "offset_probe": offset_probe,
            "loss": loss,
            "kl_weight": kl_weight,
            "kl_samples": kl_samples,
            "offset_groups": offset_groups,
            "block_size": block_size,
            "quantize_activations": quantize_activations,
            "scale_rule": scale_rule,
            "modules_to_not_convert": modules_to_not_convert,
            "seed": seed,
            "gradient_checkpointing": gradient_checkpointing,
            "learn_rotations": learn_rotations,
            "rotation_lr": rotation_lr,
        }
        settings = CalibrationSettings(**{k: v for k, v in given.items() if v is not None})
        for field in dataclasses.fields(settings):
            setattr(self, field.name, copy.copy(getattr(settings, field.name)))
        unused = [name for name in _PAPER_ONLY_FIELDS if given[name] is not None]
        if format_map is None and settings.recipe != "paper" and unused:
            logger.warning(
                "DMXConfig: %s only apply to recipe='paper'; recipe=%r ignores them.", ", ".join(unused), settings.recipe
            )
        check_calibration_source(dataset)
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.rotation = validate_rotation("none" if rotation is None else rotation)
        if self.learn_rotations and self.rotation not in LEARNABLE_ROTATIONS:
            raise ValueError(f"learn_rotations=True trains merged rotations: it needs rotation="
                             f"{' or '.join(map(repr, LEARNABLE_ROTATIONS))}, got rotation={self.rotation!r}.")
        self.format_map = _validate_format_map(format_map)
        self.input_transforms = _validate_input_transforms(input_transforms)
        self.bits_simple = bits_simple
        self.bits_weighted = bits_weighted
        self.storage_bits = storage_bits
        self.quant_method = QUANT_METHOD

    @property
    def needs_calibration(self) -> bool:
        """True when quantizing with this config means learning a format map (none was given)."""
        return self.format_map is None

    def calibration_settings(self, **overrides: Any) -> CalibrationSettings:
        """The `CalibrationSettings` these fields describe, with `overrides` (e.g. the resolved skip list)."""
        values = {name: copy.copy(getattr(self, name)) for name in _SETTINGS_FIELDS}
        return CalibrationSettings(**{**values, **overrides})

    def check_calibration_inputs(self) -> None:
        """Raise unless this config can be carried out: a format map, or a dataset and a tokenizer to calibrate."""
        if not self.needs_calibration:
            return
        missing = [name for name in _RUNTIME_FIELDS if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"DMXConfig has no format_map, so the model must be calibrated, but no {' and no '.join(missing)} "
                "was given: pass DMXConfig(dataset=..., tokenizer=...), or a format_map to apply without calibrating"
            )

    def with_runtime_inputs(self, **inputs: Any) -> DMXConfig:
        """A copy with the runtime inputs (`dataset`, `tokenizer`) given here replaced; `None` keeps the current one."""
        unknown = set(inputs) - set(_RUNTIME_FIELDS)
        if unknown:
            raise TypeError(f"with_runtime_inputs takes {', '.join(_RUNTIME_FIELDS)}; got {sorted(unknown)}")
        new = copy.deepcopy(self)
        for name, value in inputs.items():
            if value is not None:
                if name == "dataset":
                    check_calibration_source(value)
                setattr(new, name, value)
        return new

    def with_result(
        self,
        format_map: Mapping[str, str],
        *,
        input_transforms: Mapping[str, dict] | None = None,
        bits_simple: float | None = None,
        bits_weighted: float | None = None,
        storage_bits: float | None = None,
        **settings: Any,
    ) -> DMXConfig:
        """A config recording an applied `format_map`, its achieved bits and any `settings` that were resolved
        while applying it (e.g. the full skip list), without dataset or tokenizer."""
        values = {k: v for k, v in self.to_dict().items() if k != "quant_method"}
        values.update(
            settings,
            format_map=dict(format_map),
            input_transforms=None if not input_transforms else dict(input_transforms),
            bits_simple=bits_simple,
            bits_weighted=bits_weighted,
            storage_bits=storage_bits,
        )
        return DMXConfig(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-serializable fields (never the dataset or the tokenizer)."""
        out = {name: copy.copy(getattr(self, name)) for name in _SETTINGS_FIELDS}
        out["rotation"] = self.rotation
        out["format_map"] = None if self.format_map is None else dict(self.format_map)
        out["input_transforms"] = None if self.input_transforms is None else dict(self.input_transforms)
        out.update({name: getattr(self, name) for name in _RESULT_FIELDS})
        out["quant_method"] = self.quant_method
        return out

    def __iter__(self):
        yield from self.to_dict().items()

    def __deepcopy__(self, memo: dict) -> DMXConfig:
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in _RUNTIME_FIELDS else copy.deepcopy(value, memo)
        return new


def _validate_format_map(format_map: Mapping[str, str] | None) -> dict[str, str] | None:
    """Canonical-name copy of `format_map`; raises naming the module whose format is unknown."""
    if format_map is None:
        return None
    if not isinstance(format_map, Mapping):
        raise TypeError(f"format_map must map module names to format names, got {type(format_map).__name__}")
    canonical = {}
    for module_name, fmt in format_map.items():
        try:
            canonical[module_name] = get_format(fmt).name
        except ValueError as err:
            raise ValueError(
                f"format_map[{module_name!r}] = {fmt!r} is not an MX format; allowed: {sorted(MX_FORMATS)}"
            ) from err
    return canonical


def _validate_input_transforms(input_transforms: Mapping[str, dict] | None) -> dict[str, dict] | None:
    """A copy of `input_transforms`; raises naming the module whose transform cannot be rebuilt."""
    if input_transforms is None:
        return None
    if not isinstance(input_transforms, Mapping):
        raise TypeError(f"input_transforms must map module names to transforms, got {type(input_transforms).__name__}")
    for module_name, spec in input_transforms.items():
        try:
            RandomizedHadamard.from_dict(spec)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"input_transforms[{module_name!r}] cannot be rebuilt: {error}") from None
    return {name: dict(spec) for name, spec in input_transforms.items()}
