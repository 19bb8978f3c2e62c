"""`DMXConfig`: the transformers quantization config of the dMX backend.

One object serves two moments:

* **before quantization** it describes a calibration (target bits, format pair, method, data), or an explicit
  per-layer `format_map` to apply without calibrating;
* **after quantization** (what `config.json` holds) it records the `format_map` that was applied, the achieved
  bit-widths and the settings that reproduce it, nothing else.

The calibration fields are validated by `CalibrationSettings`, so both live in one place. The calibration inputs
(`dataset`, `tokenizer`) are runtime objects: they are shared by reference on `copy.deepcopy` (transformers
deep-copies quantization configs, and a generator cannot be copied) and never serialized.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..calibration.data import check_calibration_source
from ..calibration.presets import DEFAULT_PRESET, get_preset
from ..calibration.settings import MX_BLOCK_SIZE, CalibrationSettings, PaperRecipe
from ..formats import MX_FORMATS, get_format
from ..nn.rotation import AUTO_ROTATION, LEARNABLE_ROTATIONS, validate_rotation
from ..nn.transforms import RandomizedHadamard

QUANT_METHOD = "dmx"

# The fields a config.json records besides the map; `gradient_checkpointing` changes no result, so it is not one.
_RECORDED_SETTINGS = (
    "method",
    "target_bits",
    "format_pair",
    "preset",
    "num_samples",
    "seq_len",
    "batch_size",
    "steps",
    "bit_average",
    "cost_table",
    "rotation",
    "learn_rotations",
    "offset_groups",
    "scale_rule",
    "weight_rounding",
    "quantize_activations",
    "modules_to_not_convert",
    "seed",
)
_SETTINGS_FIELDS = (
    "method",
    "target_bits",
    "format_pair",
    "num_samples",
    "seq_len",
    "batch_size",
    "steps",
    "bit_average",
    "cost_table",
    "offset_groups",
    "quantize_activations",
    "scale_rule",
    "modules_to_not_convert",
    "seed",
    "learn_rotations",
    "gradient_checkpointing",
    "paper",
)
# How each weight is rounded in its format once the map is fixed (`calibration.gptq`). By default GPTQ when the
# config calibrates (it has the data; GPTQ had lower held-out perplexity than round-to-nearest on every map of
# benchmarks/results/quality.md), round-to-nearest for a given map (which needs no data).
WEIGHT_ROUNDINGS = ("rtn", "gptq")
_ACHIEVED_BITS = ("bits_simple", "bits_weighted", "storage_bits")
# Runtime-only inputs: shared on deepcopy, never serialized.
_RUNTIME_FIELDS = ("dataset", "tokenizer")
# Keys that config.json files written by optimum-dmx 0.1.0.dev0 hold and this version reads differently: the
# paper's hyper-parameters (now `paper`), the achieved bits (now `achieved_bits`), the recipe (now `method`), and
# the default method's internal settings, which describe how a map was made and are not needed to load it.
_LEGACY_PAPER_KEYS = ("lr", "regularizer", "reg_lambda", "discretization", "t_start", "t_end", "t_warmup_ratio")
_LEGACY_IGNORED_KEYS = ("offset_probe", "loss", "kl_weight", "kl_samples", "rotation_lr")
_LEGACY_KEYS = ("recipe", "block_size", *_ACHIEVED_BITS, *_LEGACY_PAPER_KEYS, *_LEGACY_IGNORED_KEYS)


class DMXConfig(QuantizationConfigMixin):
    """Configuration of dMX mixed-precision MX quantization.

    Args:
        target_bits: average element bit-width to reach (scales excluded: MXFP4 counts 4): 4-8 for
            `"mxfp8-mxfp4"`, 4-6 for `"mxfp6-mxfp4"`. The result lands within 0.05 bits of it, never above
            (`method="paper"` lands where its regularizer leads).
        format_pair: `"mxfp8-mxfp4"` (default) or `"mxfp6-mxfp4"`, the low and high format each layer chooses from.
        method: `"dmx"` (default: format maps sampled at the budget, offsets from the loss's derivative, ranking
            blended with KL pre-selection's), `"paper"` (the dMX paper's procedure, exactly, with `paper`'s
            hyper-parameters) or `"kl"` (KL pre-selection: one forward pass per layer, no training).
        preset: calibration sizes by name (`calibration.presets`): `"paper"` (default: 400 steps of 8 x 2048
            tokens), `"gpu"`, `"cpu-demo"`, `"cpu-bench"`. `num_samples`, `seq_len`, `batch_size`, `steps` and
            `gradient_checkpointing` given here override the preset's.
        dataset: calibration text: a Hub dataset name, local text/json/parquet file(s) or folder, a
            `datasets.Dataset` (streaming or not), a generator or a list of strings. Never serialized.
        tokenizer: tokenizer used to build the calibration batches. Never serialized.
        num_samples, seq_len, batch_size, steps: calibration sequences drawn from the text, tokens per sequence,
            sequences per step, optimization steps.
        bit_average: the average `target_bits` is kept in: `"weighted"` (by tensor size, so the model's size
            follows `target_bits`; default) or `"simple"` (per layer; the default of `method="paper"`, whose
            procedure averages per layer); both are recorded.
        cost_table: what a layer costs in each format, `{format: {"OUTxIN": cost}}` for every quantized weight shape
            (e.g. latency measured on the serving target; `calibration.budget.storage_cost_table` gives bytes):
            the budget then caps the total cost, `target_bits` placing the cap between the all-low and all-high
            totals as it lies between the pair's element bits. Default None: bits in `bit_average`.
        rotation: function-preserving rotations applied before calibration (`nn.rotation`, `docs/rotations.md`):
            `"auto"`, `"none"`, `"hadamard"`, `"block_hadamard"` or `"online_block_hadamard"`. Merged rotations
            change the saved weights (tied embeddings are untied); online transforms are recorded in
            `input_transforms` and rebuilt on load. `"auto"` is `"online_block_hadamard"` where every quantized
            layer is an `nn.Linear` of whole MX blocks (exported checkpoints carry its transforms; mixture-of-experts
            experts get none, as no loader applies them there), else `"none"`
            (`nn.rotation.resolve_rotation`; config.json records which). Default: `"auto"` when calibrating with
            `method="dmx"` or `"kl"`, `"none"` with `method="paper"` (the paper's procedure, exactly) or a given
            `format_map`.
        learn_rotations: train the merged rotations (`"hadamard"`, `"block_hadamard"`) with the formats (Cayley
            SGD, SpinQuant's step); merged into the saved weights, nothing is needed at load time.
        offset_groups: layers that share one format: `"fused"` (q/k/v and gate/up of each decoder layer, and each
            mixture-of-experts layer's experts, as vLLM and SGLang fuse them: needed to export a servable map; the
            KL scan takes each group whole, in one pass), `"none"` or lists of module names. Default: `"fused"`
            when calibrating with `method="dmx"` or `"kl"`, else `"none"`.
        scale_rule: how each MX block scale follows its block maximum, in calibration, in the saved model and in
            export: `"ocp"` (default: the specification's floor), `"compressed-tensors"` or `"quark"` (those
            loaders' rounding, so that a served model computes what was calibrated).
        weight_rounding: how each weight is rounded in its layer's format once the map is fixed: `"gptq"`
            (GPTQ: columns in order, each one's error spread over the others by the inverse Hessian of the
            layer's inputs on the calibration data, decoder layer by decoder layer; `calibration.gptq`) or
            `"rtn"` (to nearest). Default: `"gptq"` when the map is calibrated, `"rtn"` with a given
            `format_map`; with a given map, `"gptq"` needs `dataset` and `tokenizer` too (the map is kept, only
            its rounding is computed). Loading reads the stored codes either way.
        quantize_activations: also quantize each layer's input activations (dynamically, in its format).
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass of calibration
            (less memory, about one more forward pass per step, the same result).
        modules_to_not_convert: module-name patterns kept in float (transformers' matching rule), besides
            transformers' default skips (output embeddings, tied weights, `keep_in_fp32` modules). Default
            `["lm_head"]`.
        seed: data order and sampling; a run is deterministic for a seed.
        paper: `PaperRecipe` (or a dict of its fields) for `method="paper"`: lr, regularizer, lambda, temperature
            schedule, discretization; the paper's values by default.
        format_map: full module name -> MX format name. Given without a dataset, it is applied as is (no
            calibration); after calibration it holds the learned assignment.
        input_transforms: full module name -> online input transform (`RandomizedHadamard.to_dict()`), written
            with the format map when `rotation` is on.
        achieved_bits: `bits_simple`, `bits_weighted` and `storage_bits` of the applied map, written with it.
    """

    def __init__(
        self,
        target_bits: float | None = None,
        format_pair: str | None = None,
        method: str | None = None,
        preset: str | None = None,
        dataset: Any = None,
        tokenizer: Any = None,
        num_samples: int | None = None,
        seq_len: int | None = None,
        batch_size: int | None = None,
        steps: int | None = None,
        bit_average: str | None = None,
        cost_table: Mapping[str, Mapping[str, float]] | None = None,
        rotation: str | None = None,
        learn_rotations: bool | None = None,
        offset_groups: str | list[list[str]] | None = None,
        scale_rule: str | None = None,
        weight_rounding: str | None = None,
        quantize_activations: bool | None = None,
        gradient_checkpointing: bool | None = None,
        modules_to_not_convert: list[str] | None = None,
        seed: int | None = None,
        paper: PaperRecipe | Mapping[str, Any] | None = None,
        format_map: Mapping[str, str] | None = None,
        input_transforms: Mapping[str, dict] | None = None,
        achieved_bits: Mapping[str, float] | None = None,
    ):
        self.preset = DEFAULT_PRESET if preset is None else preset
        if not isinstance(self.preset, str):
            raise TypeError(f"preset={self.preset!r} must be a preset name (str).")
        sizes = get_preset(self.preset).settings()
        if paper is not None and method != "paper":
            raise ValueError(
                f"paper={paper!r} sets the hyper-parameters of method='paper'; method="
                f"{method or 'dmx'!r} has none (pass method='paper', or leave paper out)."
            )
        # The defaults of a calibration by dMX or KL make a servable model (docs/rotations.md: it scored lower
        # held-out perplexity than the unrotated, ungrouped map at every measured target); the paper's procedure
        # and a given map keep the model as it is.
        servable = format_map is None and method != "paper"
        if offset_groups is None:
            offset_groups = "fused" if servable else "none"
        if rotation is None:
            rotation = AUTO_ROTATION if servable else "none"
        given = {
            "method": method,
            "target_bits": target_bits,
            "format_pair": format_pair,
            "num_samples": num_samples,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "steps": steps,
            "bit_average": bit_average,
            "cost_table": cost_table,
            "offset_groups": offset_groups,
            "quantize_activations": quantize_activations,
            "scale_rule": scale_rule,
            "modules_to_not_convert": modules_to_not_convert,
            "seed": seed,
            "learn_rotations": learn_rotations,
            "gradient_checkpointing": gradient_checkpointing,
            "paper": paper,
        }
        settings = CalibrationSettings(**{**sizes, **{k: v for k, v in given.items() if v is not None}})
        for name in _SETTINGS_FIELDS:
            setattr(self, name, copy.copy(getattr(settings, name)))
        check_calibration_source(dataset)
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.rotation = validate_rotation(rotation)
        if self.learn_rotations and self.rotation not in LEARNABLE_ROTATIONS:
            raise ValueError(
                f"learn_rotations=True trains merged rotations: it needs rotation="
                f"{' or '.join(map(repr, LEARNABLE_ROTATIONS))}, got rotation={self.rotation!r}."
            )
        self.format_map = _validate_format_map(format_map)
        if weight_rounding is None:
            weight_rounding = "gptq" if self.format_map is None else "rtn"
        self.weight_rounding = weight_rounding
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise ValueError(
                f"weight_rounding={self.weight_rounding!r}; allowed: {', '.join(map(repr, WEIGHT_ROUNDINGS))}"
            )
        self.input_transforms = _validate_input_transforms(input_transforms)
        self.achieved_bits = _validate_achieved_bits(achieved_bits)
        self.quant_method = QUANT_METHOD

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """A config from a saved `quantization_config` (what transformers calls when it loads config.json),
        including those written by optimum-dmx 0.1.0.dev0; a key this version does not know is refused by name."""
        return super().from_dict(_current_fields(config_dict), return_unused_kwargs, **kwargs)

    @property
    def block_size(self) -> int:
        """The MX block size: the specification's 32."""
        return MX_BLOCK_SIZE

    @property
    def needs_calibration(self) -> bool:
        """True when quantizing with this config means learning a format map (none was given)."""
        return self.format_map is None

    @property
    def needs_data(self) -> bool:
        """True when quantizing with this config reads calibration text: to learn a map, or to round by GPTQ."""
        return self.needs_calibration or self.weight_rounding == "gptq"

    def calibration_settings(self, **overrides: Any) -> CalibrationSettings:
        """The `CalibrationSettings` these fields describe, with `overrides` (e.g. the resolved skip list)."""
        values = {name: copy.copy(getattr(self, name)) for name in _SETTINGS_FIELDS}
        return CalibrationSettings(**{**values, **overrides})

    def check_calibration_inputs(self) -> None:
        """Raise unless this config can be carried out: a format map, or a dataset and a tokenizer to calibrate
        (and to round by GPTQ)."""
        if not self.needs_data:
            return
        missing = [name for name in _RUNTIME_FIELDS if getattr(self, name) is None]
        if missing and not self.needs_calibration:
            raise ValueError(
                f"weight_rounding='gptq' computes each layer's rounding from calibration text, but no "
                f"{' and no '.join(missing)} was given: pass DMXConfig(dataset=..., tokenizer=...), or "
                "weight_rounding='rtn' to apply the format_map without data"
            )
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
        achieved_bits: Mapping[str, float] | None = None,
        **settings: Any,
    ) -> DMXConfig:
        """A config recording an applied `format_map`, its achieved bits and any `settings` that were resolved
        while applying it (e.g. the full skip list), without dataset or tokenizer."""
        values = {k: v for k, v in self.to_dict().items() if k != "quant_method"}
        values.update(
            settings,
            format_map=dict(format_map),
            input_transforms=None if not input_transforms else dict(input_transforms),
            achieved_bits=None if achieved_bits is None else dict(achieved_bits),
        )
        return DMXConfig(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-serializable record: the settings that reproduce the map, the map, its bits; never the dataset
        or the tokenizer. The paper's hyper-parameters only with `method="paper"`."""
        out = {name: copy.copy(getattr(self, name)) for name in _RECORDED_SETTINGS}
        if self.method == "paper":
            out["paper"] = self.paper.to_dict()
        out["format_map"] = None if self.format_map is None else dict(self.format_map)
        if self.input_transforms is not None:
            out["input_transforms"] = dict(self.input_transforms)
        if self.achieved_bits is not None:
            out["achieved_bits"] = dict(self.achieved_bits)
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


_FIELDS = tuple(inspect.signature(DMXConfig.__init__).parameters)[1:]  # what a record may hold


def _current_fields(record: Mapping[str, Any]) -> dict[str, Any]:
    """A saved `quantization_config` as this version's fields: `quant_method` dropped, the keys that config.json
    files of 0.1.0.dev0 hold folded in (`recipe` -> `method`, the paper's hyper-parameters -> `paper`, `bits_*` ->
    `achieved_bits`, the default recipe's internal settings dropped); any other unknown key is refused by name."""
    values = dict(record)
    quant_method = values.pop("quant_method", QUANT_METHOD)
    if quant_method != QUANT_METHOD:
        raise ValueError(f"quant_method={quant_method!r}: a DMXConfig is quant_method {QUANT_METHOD!r}.")
    legacy = {key: values.pop(key) for key in _LEGACY_KEYS if key in values}
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise TypeError(f"quantization_config has unknown fields {unknown}; allowed: {', '.join(_FIELDS)}.")
    block_size = legacy.get("block_size", MX_BLOCK_SIZE)
    if block_size != MX_BLOCK_SIZE:
        raise ValueError(
            f"block_size={block_size!r}: this version reads MX blocks of {MX_BLOCK_SIZE} (the OCP "
            "specification's) only."
        )
    if values.get("method") is None and legacy.get("recipe") is not None:
        values["method"] = legacy["recipe"]
    if values.get("method") == "paper" and values.get("paper") is None:
        values["paper"] = {key: legacy[key] for key in _LEGACY_PAPER_KEYS if legacy.get(key) is not None} or None
    if values.get("achieved_bits") is None and any(legacy.get(key) is not None for key in _ACHIEVED_BITS):
        values["achieved_bits"] = {key: legacy.get(key) for key in _ACHIEVED_BITS}
    return values


def _validate_achieved_bits(achieved_bits: Mapping[str, float] | None) -> dict[str, float] | None:
    """A copy of `achieved_bits`; raises naming a key that is not one of the recorded bit-widths."""
    if achieved_bits is None:
        return None
    if not isinstance(achieved_bits, Mapping):
        raise TypeError(f"achieved_bits must map {list(_ACHIEVED_BITS)} to numbers, got {achieved_bits!r}")
    unknown = sorted(set(achieved_bits) - set(_ACHIEVED_BITS))
    if unknown:
        raise ValueError(f"achieved_bits has unknown keys {unknown}; allowed: {list(_ACHIEVED_BITS)}")
    for key, value in achieved_bits.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"achieved_bits[{key!r}]={value!r} must be a number")
    return dict(achieved_bits)


def _validate_format_map(format_map: Mapping[str, str] | None) -> dict[str, str] | None:
    """Canonical-name copy of `format_map`; raises naming the module whose format is unknown."""
    if format_map is None:
        return None
    if not isinstance(format_map, Mapping):
        raise TypeError(f"format_map must map module names to format names, got {type(format_map).__name__}")
    if not format_map:
        raise ValueError(
            "format_map is empty: name the modules to quantize (module name -> MX format), or leave it "
            "out to calibrate one"
        )
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
