"""What each export target stores: its formats, tensor layout, `quantization_config` schema and scale rule.

compressed-tensors (read by transformers with `compressed-tensors` installed, vLLM and SGLang) stores MXFP4 and
MXFP6 (E2M3) weights as `weight_packed` uint8 codes in the same layout as dMX (FP4: even element in the low
nibble; FP6: `c0 | c1 << 6 | c2 << 12 | c3 << 18` in three little-endian bytes) and MXFP8 weights as a
float8_e4m3fn `weight` (the same bits as dMX's E4M3 codes), each with a uint8 E8M0 `weight_scale` of shape
`[out_features, in_features / 32]`. A checkpoint whose layers differ lists one config group per format, with
the exact module names as targets, under the top-level format `"mixed-precision"`; a mixture-of-experts layer's
experts (one format per layer) are one regular-expression target per layer, as their per-expert tensors are named
(`<layer>.experts.<e>.gate_proj`, ...). Input activations are quantized dynamically per block of 32 in the layer's
format with compressed-tensors' scale rule.

AMD Quark (read by transformers with `amd-quark` installed, and vLLM on AMD GPUs) stores MXFP4 and MXFP6 (E2M3,
E3M2) weights as a uint8 `weight` holding the same codes, with a uint8 E8M0 `weight_scale`; `quantization_config`
names every quantized layer in `layer_quant_config` with its element dtype (`fp4`, `fp6_e2m3`, `fp6_e3m2`),
per-group scales of 32 in E8M0 and dynamic input quantization with Quark's "even" scale rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..nn.experts import PROJECTIONS
from ..nn.groups import expert_groups, experts_module
from .transforms import TransformExport, compressed_tensors_transforms, quark_transforms

__all__ = ["EXPORT_TARGETS", "ExportTarget", "get_export_target"]

_SERVE_TEMPLATE = """\
---
library_name: transformers
tags:
- dmx
- mx
- {target}
---

# {name}

A mixed-precision MX checkpoint ({summary}) exported by `optimum-dmx export --to {target}` from a dMX checkpoint
whose per-layer formats were learned with dMX. Formats by layer are listed in `config.json`
(`quantization_config`).

## Serve with vLLM

```bash
vllm serve path/to/{name}
```

## Load with transformers

```python
from transformers import {auto_class}
model = {auto_class}.from_pretrained("path/to/{name}", dtype="bfloat16")  # needs {package}
```
{load_note}{transforms}{experts}"""

_UNINITIALIZABLE_NOTE = """
`from_pretrained` alone fails on this model (`AttributeError: ... has no attribute 'weight'`): after loading,
transformers runs its weight initialization, and that of {classes} reads the `weight` of a linear this format stores
packed, without one. Load it with `optimum_dmx.export.load_exported("path/to/{name}", dtype="bfloat16")` (from
`pip install optimum-dmx`), which gives the packed linears a stand-in `weight` while the initialization runs. vLLM is
not affected.
"""

_SUBCLASSED_NOTE = """
transformers with {package} cannot load this model: {package} builds its quantized layers for modules of class
`nn.Linear` exactly, and this model's {classes} subclass it, so loading stops on mismatched sizes. vLLM builds its
own layers and reads them by name (not tested by optimum-dmx). To load the model with transformers, export it with
`optimum-dmx export --to {alternative}`.
"""

_FLOAT_CONVERSIONS_NOTE = """
transformers with {package} cannot load this model: while loading it builds {count} tensors (e.g. `{example}`) from
float tensors this checkpoint stores apart (a mixture of experts' experts, stored per expert, or convolutions), and
beside packed layers that conversion gets no tensors (a conversion error). vLLM is not affected (not tested by
optimum-dmx). To load the model with transformers, keep the quantized layers in MXFP8, or quantize the float experts.
"""

_CT_EXPERTS_SECTION = """
## Mixture-of-experts layers

The experts of {count} layers are quantized ({formats}). vLLM reads them, each layer's experts in one format, with
its compressed-tensors mixture-of-experts methods (not tested by optimum-dmx, which has no GPU). transformers
(its compressed-tensors loader) decompresses them to bfloat16 while loading and computes them without quantizing
their inputs.{caveat}
"""

_CT_TRANSFORMS_SECTION = """
## Online transforms

{count} layers ({layers}) transform their input with a Hadamard matrix before quantizing it (the rotation the
formats were learned with), as `quantization_config["transform_config"]` in `config.json` describes. vLLM applies
them; {on_load}: after loading, apply them with compressed-tensors' own code:

```python
import json
from compressed_tensors.transform import TransformConfig, apply_transform_config
config = json.load(open("path/to/{name}/config.json"))["quantization_config"]["transform_config"]
apply_transform_config(model, TransformConfig.model_validate(config))
```

transformers' load report lists the transforms' stored matrices (`*_input.weight`, which vLLM loads) as UNEXPECTED:
`apply_transform_config` builds them again from the configuration. `optimum_dmx.export.load_exported` loads the
model, applies the transforms and checks that each stored matrix is the one built.
"""

_QUARK_TRANSFORMS_SECTION = """
## Online transforms

{count} layers ({layers}) rotate their input with a Hadamard matrix before quantizing it (the rotation the formats
were learned with), as the online rotation in `quantization_config["algo_config"]` of `config.json` describes.
{on_load}: after loading, let Quark's own code do it:

```python
for module in model.modules():
    if hasattr(module, "input_rotation"):
        module.post_process_after_loading()
```
"""


@dataclass(frozen=True)
class ExportTarget:
    """One checkpoint format that serving engines load.

    Attributes:
        name: the target's name (`--to`).
        formats: MX formats it can store, by dMX name.
        vllm_formats: the subset vLLM serves through this target.
        scale_rule: the activation block-scale rule its loaders use (`formats.spec.SCALE_RULES`).
        alternative: the other target to suggest when a map cannot be served through this one.
        package: what a user installs to load the result with transformers.
        layer_tensors: `(module, fmt, weight_packed, weight_scale) -> {tensor name: tensor}` in the target layout.
        quantization_config: `(format_map, float linears, exported names) -> quantization_config` of config.json;
            the float linears are the model's `nn.Linear`s the map leaves unquantized (module names, `lm_head`
            included), the exported names map each layer to its tensors' prefix in the export.
        input_transforms: `(input_transforms, model skeleton) -> TransformExport`, what the target writes for a
            rotated checkpoint's online transforms.
        transforms_card: the model card's section on loading a checkpoint with online transforms (a template of
            `count`, `layers`, `name` and `on_load`).
        transforms_on_load: what transformers does with the online transforms when it loads the export (a
            sentence: a warning at export and the model card say it).
        experts_card: the model card's section on quantized mixture-of-experts experts (a template of `count`,
            `formats` and `caveat`).
        experts_refused: why the target takes no quantized mixture-of-experts experts (None: it takes them).
        experts_caveat: `format_map -> ` what a loader cannot do with the map's quantized experts (None: nothing),
            for a warning and the model card.
        weightless_formats: the formats whose layers the target's transformers loader builds without a `weight`
            (compressed-tensors' packed layers hold `weight_packed`), which some families' weight initialization
            reads.
        exact_linears_only: whether the target's transformers loader builds its quantized layers only for modules
            of class `nn.Linear` exactly, not for subclasses (Quark; Falcon's `FalconLinear` is one).
    """

    name: str
    formats: tuple[str, ...]
    vllm_formats: tuple[str, ...]
    scale_rule: str
    alternative: str | None
    package: str
    layer_tensors: Callable[[str, str, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
    quantization_config: Callable[[Mapping[str, str], Sequence[str], Mapping[str, str]], dict[str, Any]]
    input_transforms: Callable[[Mapping[str, dict], nn.Module], TransformExport]
    transforms_card: str
    transforms_on_load: str
    experts_card: str = ""
    experts_refused: str | None = None
    experts_caveat: Callable[[Mapping[str, str]], str | None] = lambda format_map: None
    weightless_formats: tuple[str, ...] = ()
    exact_linears_only: bool = False

    def model_card(
        self,
        dmx_quantization: Mapping[str, Any],
        name: str,
        auto_class: str,
        uninitializable: Sequence[str] = (),
        subclassed: Sequence[str] = (),
        float_conversions: Sequence[str] = (),
    ) -> str:
        """A README saying what the export holds and how to serve and load it (with transformers' `auto_class`);
        `uninitializable` names the module classes whose weight initialization keeps `from_pretrained` alone from
        loading it (`export.checkpoint._initialization_failures`), `subclassed` the quantized layers' classes that
        subclass `nn.Linear` where the loader takes `nn.Linear` only (`exact_linears_only`), `float_conversions`
        the tensors transformers would build from float tensors beside packed layers, which its loader cannot
        (`export.checkpoint._warn_float_conversions`)."""
        counts: dict[str, int] = {}
        for fmt in dmx_quantization["format_map"].values():
            counts[fmt] = counts.get(fmt, 0) + 1
        summary = ", ".join(f"{count} layers {fmt}" for fmt, count in sorted(counts.items()))
        transformed = sorted(dmx_quantization.get("input_transforms") or {})
        kinds = ", ".join(sorted({layer.rpartition(".")[2] for layer in transformed}))
        transforms = load_note = ""
        if transformed:
            transforms = self.transforms_card.format(
                count=len(transformed), layers=kinds, name=name, on_load=self.transforms_on_load
            )
            load_note = "\nThis model is not finished until its online transforms are applied (below).\n"
        if uninitializable:
            load_note += _UNINITIALIZABLE_NOTE.format(
                classes=" and ".join(f"`{c}`" for c in uninitializable), name=name
            )
        if subclassed:
            load_note += _SUBCLASSED_NOTE.format(
                package=self.package,
                classes=" and ".join(f"`{c}`" for c in subclassed),
                alternative=self.alternative,
            )
        if float_conversions:
            load_note += self.float_conversions_note(float_conversions)
        return _SERVE_TEMPLATE.format(
            name=name,
            target=self.name,
            summary=summary,
            package=self.package,
            auto_class=auto_class,
            load_note=load_note,
            transforms=transforms,
            experts=self._experts_section(dmx_quantization["format_map"]),
        )

    def float_conversions_note(self, built: Sequence[str]) -> str:
        """The model card's note (and the export's warning) that transformers cannot load the export because it
        would build the tensors `built` from float tensors beside packed layers (`export.checkpoint`)."""
        return _FLOAT_CONVERSIONS_NOTE.format(package=self.package, count=len(built), example=built[0])

    def _experts_section(self, format_map: Mapping[str, str]) -> str:
        groups = expert_groups(format_map)
        if not groups:
            return ""
        formats = ", ".join(sorted({format_map[name] for group in groups for name in group}))
        caveat = self.experts_caveat(format_map)
        return self.experts_card.format(count=len(groups), formats=formats, caveat=f" {caveat}." if caveat else "")


# --- compressed-tensors ------------------------------------------------------------------------------------

_CT_FORMATS = {
    "mxfp4_e2m1": (4, "mxfp4-pack-quantized"),
    "mxfp6_e2m3": (6, "mxfp6-pack-quantized"),
    "mxfp8_e4m3": (8, "mxfp8-quantized"),
}


def _ct_layer_tensors(module: str, fmt: str, codes: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    if fmt == "mxfp8_e4m3":
        return {f"{module}.weight": codes.view(torch.float8_e4m3fn), f"{module}.weight_scale": scales}
    return {f"{module}.weight_packed": codes, f"{module}.weight_scale": scales}


def _ct_mx_args(bits: int, dynamic: bool) -> dict[str, Any]:
    return {
        "num_bits": bits,
        "type": "float",
        "symmetric": True,
        "group_size": 32,
        "strategy": "group",
        "dynamic": dynamic,
        "scale_dtype": "torch.uint8",
        "zp_dtype": "torch.uint8",
    }


def _ct_targets(format_map: Mapping[str, str], exported_names: Mapping[str, str]) -> dict[str, list[str]]:
    """Each format's `config_groups` targets: the exact names of its layers, and for a mixture-of-experts layer whose
    experts share one format one regular expression matching all of them (`re:` and an anchored pattern, as
    compressed-tensors and vLLM match targets), instead of a name per expert and projection (18,432 on
    Qwen3-30B-A3B): the experts module as the export names it, and either projection name, the family's checkpoint
    one (Mixtral's `w1`) or transformers' (`gate_proj`). A layer whose experts mix formats (a map exported with
    `force`) keeps their exact names."""
    targets: dict[str, list[str]] = {}
    in_experts = set()
    for group in expert_groups(format_map):
        formats = {format_map[name] for name in group}
        if len(formats) == 1:
            projections = sorted(set(PROJECTIONS) | {exported_names[name].rpartition(".")[2] for name in group})
            module = re.escape(experts_module(exported_names[group[0]]))
            targets.setdefault(formats.pop(), []).append(rf"re:^{module}\.\d+\.({'|'.join(projections)})$")
            in_experts.update(group)
    for name, fmt in format_map.items():
        if name not in in_experts:
            targets.setdefault(fmt, []).append(name)
    return {fmt: sorted(names) for fmt, names in targets.items()}


# The expert formats transformers' compressed-tensors loader decompresses: packed ones (its other path reads 8-bit
# float experts as per-channel FP8, and stops on MX scales).
_CT_TRANSFORMERS_EXPERT_FORMATS = ("mxfp4_e2m1", "mxfp6_e2m3")


def _ct_experts_caveat(format_map: Mapping[str, str]) -> str | None:
    """What transformers (5.x, with compressed-tensors) cannot load of the compressed-tensors export of `format_map`'s
    quantized experts: it decompresses every layer's experts with one scheme (the first config group targeting
    experts), so all of them must share one packed format. Tested: MXFP8 experts, or formats that differ between
    layers, stop its loading with a conversion error."""
    formats = sorted({format_map[name] for group in expert_groups(format_map) for name in group})
    if len(formats) <= 1 and set(formats) <= set(_CT_TRANSFORMERS_EXPERT_FORMATS):
        return None
    return (
        "transformers cannot load this export, only vLLM (not tested here): its compressed-tensors loader "
        "decompresses every layer's experts with one scheme, and only packed ones "
        f"({', '.join(_CT_TRANSFORMERS_EXPERT_FORMATS)}), where these experts are {', '.join(formats)}"
    )


def _ct_quantization_config(
    format_map: Mapping[str, str], float_linears: Sequence[str], exported_names: Mapping[str, str]
) -> dict:
    """compressed-tensors quantizes exactly its groups' targets: the float linears need no entry."""
    groups = {}
    targets = _ct_targets(format_map, exported_names)
    for fmt in sorted(targets, key=lambda f: _CT_FORMATS[f][0]):
        bits, packing = _CT_FORMATS[fmt]
        groups[f"group_{len(groups)}"] = {
            "targets": targets[fmt],
            "weights": _ct_mx_args(bits, dynamic=False),
            "input_activations": _ct_mx_args(bits, dynamic=True),
            "output_activations": None,
            "format": packing,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision" if len(groups) > 1 else next(iter(groups.values()))["format"],
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [],
        "kv_cache_scheme": None,
    }


COMPRESSED_TENSORS = ExportTarget(
    name="compressed-tensors",
    formats=tuple(_CT_FORMATS),
    vllm_formats=("mxfp4_e2m1", "mxfp8_e4m3"),
    scale_rule="compressed-tensors",
    alternative="quark",
    package="compressed-tensors",
    layer_tensors=_ct_layer_tensors,
    quantization_config=_ct_quantization_config,
    input_transforms=compressed_tensors_transforms,
    transforms_card=_CT_TRANSFORMS_SECTION,
    transforms_on_load=(
        "transformers does not apply them yet (it loads the model without them, which then computes another function)"
    ),
    experts_card=_CT_EXPERTS_SECTION,
    experts_caveat=_ct_experts_caveat,
    weightless_formats=tuple(fmt for fmt, (_, packing) in _CT_FORMATS.items() if packing.endswith("pack-quantized")),
)

# --- AMD Quark ---------------------------------------------------------------------------------------------

# amd-quark 0.13 reads MXFP4 and both MXFP6 formats; its dequantization of per-group fp8_e4m3 weights (MXFP8)
# raises "Unsupported QuantSchema: per_group for quant_dtype: fp8_e4m3", in its own export as in loading.
_QUARK_DTYPES = {"mxfp4_e2m1": "fp4", "mxfp6_e2m3": "fp6_e2m3", "mxfp6_e3m2": "fp6_e3m2"}
_QUARK_VERSION = "0.13"


def _quark_layer_tensors(module: str, fmt: str, codes: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{module}.weight": codes, f"{module}.weight_scale": scales}


def _quark_mx_spec(dtype: str, dynamic: bool) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "is_dynamic": dynamic,
        "qscheme": "per_group",
        "ch_axis": -1,
        "group_size": 32,
        "block_size": None,
        "symmetric": None,
        "round_method": "half_even",
        "scale_type": "float",
        "scale_format": "e8m0",
        "scale_calculation_mode": "even",
        "observer_cls": "PerBlockMXObserver",
        "mx_element_dtype": None,
        "zero_point_type": "int32",
        "is_scale_quant": False,
        "enable_buffer_reuse": False,
        "max_input_numel": 4194304,
    }


def _quark_quantization_config(
    format_map: Mapping[str, str], float_linears: Sequence[str], exported_names: Mapping[str, str]
) -> dict:
    """Quark quantizes the layers named in `layer_quant_config` and builds every other linear it does not `exclude`
    as a `QParamsLinear` of the unquantized global config, which keeps its weight in float32 whatever dtype the model
    loads in (twice a bfloat16 model's memory for such a layer, and a crash where a module multiplies by the weight
    itself, as Mamba's mixer does with `dt_proj.weight`): the float linears are excluded, and stay `nn.Linear`."""
    unquantized = {"weight": None, "bias": None, "input_tensors": None, "output_tensors": None, "target_device": None}
    layers = {
        name: {
            **unquantized,
            "weight": _quark_mx_spec(_QUARK_DTYPES[fmt], dynamic=False),
            "input_tensors": _quark_mx_spec(_QUARK_DTYPES[fmt], dynamic=True),
        }
        for name, fmt in sorted(format_map.items())
    }
    return {
        "quant_method": "quark",
        "version": _QUARK_VERSION,
        "quant_mode": "eager_mode",
        "global_quant_config": unquantized,  # only the layers named below are quantized (exact names)
        "layer_quant_config": layers,
        "layer_type_quant_config": {},
        "exclude": sorted(float_linears),
        "algo_config": None,
        "softmax_quant_spec": None,
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "export": {
            "kv_cache_group": [],
            "min_kv_scale": 0.0,
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "weight_merge_groups": None,
        },
    }


QUARK = ExportTarget(
    name="quark",
    formats=tuple(_QUARK_DTYPES),
    vllm_formats=tuple(_QUARK_DTYPES),
    scale_rule="quark",
    alternative="compressed-tensors",
    package="amd-quark",
    exact_linears_only=True,
    layer_tensors=_quark_layer_tensors,
    quantization_config=_quark_quantization_config,
    input_transforms=quark_transforms,
    transforms_card=_QUARK_TRANSFORMS_SECTION,
    transforms_on_load=(
        "transformers builds those layers as Quark's `QParamsLinearWithRotation` and loads their `input_rotation` "
        "but does not finish them (the model cannot run until then)"
    ),
    experts_refused=(
        "transformers with amd-quark 0.13 does not load them into its packed experts modules (it stops on "
        "mismatched sizes; tested), and no other loader of Quark's format was tested with them"
    ),
)

EXPORT_TARGETS: dict[str, ExportTarget] = {COMPRESSED_TENSORS.name: COMPRESSED_TENSORS, QUARK.name: QUARK}


def get_export_target(name: str) -> ExportTarget:
    """The export target called `name`; raise naming the known ones otherwise."""
    if name not in EXPORT_TARGETS:
        raise ValueError(f"export target {name!r} is not supported; allowed: {', '.join(EXPORT_TARGETS)}.")
    return EXPORT_TARGETS[name]
