"""Export a saved dMX checkpoint to a format that serving engines load (compressed-tensors, AMD Quark).

The export is a file-to-file transform: it reads the dMX folder's `config.json` and safetensors files, rewrites
each quantized linear's packed tensors in the target's layout and its `quantization_config` in the target's
schema, copies everything else (tokenizer, generation config, tied or float tensors) unchanged and writes a
model card on how to serve the result. No model is instantiated, and the source folder is only read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedModel

from ..formats.packing import negate_rows
from ..integration.checkpoint_names import (
    checkpoint_key_renaming,
    converted_weight_target,
    expert_projection_names,
)
from ..integration.configuration import QUANT_METHOD
from ..integration.folders import check_output, staged_folder
from ..integration.model_classes import generating_model_class
from ..nn.experts import linearize_experts
from ..nn.groups import expert_groups, experts_module, mixed_groups
from .targets import ExportTarget, get_export_target
from .transforms import TransformExport

__all__ = ["ExportError", "export_checkpoint"]

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files of a dMX folder that the export writes anew instead of copying.
_REWRITTEN = {"config.json", "README.md", "dmx_format_map.png", SAFETENSORS_INDEX}


class ExportError(ValueError):
    """The checkpoint cannot be exported to the requested target (the message says why and what to do)."""


def export_checkpoint(
    source: str | os.PathLike | Any,
    output_dir: str | os.PathLike,
    target: str = "compressed-tensors",
    *,
    for_vllm: bool = True,
    force: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write a copy of a dMX checkpoint that `target`'s loaders read, and return its folder.

    Args:
        source: a saved dMX model folder, or a loaded dMX model (saved to a temporary folder first).
        output_dir: the folder to write; must not exist or be empty unless `overwrite`. It is written whole or
            not at all.
        target: `"compressed-tensors"` (transformers with `compressed-tensors`, vLLM, SGLang) or `"quark"`
            (AMD Quark; vLLM on AMD GPUs).
        for_vllm: check that vLLM can serve the result: every fused projection group (q/k/v, gate/up, a layer's
            experts) in one format, and only formats vLLM serves through `target`.
        force: export a map that fails the vLLM checks anyway (loaders other than vLLM read it).
        overwrite: replace a non-empty `output_dir`.

    Raises:
        ExportError: `source` is not a dMX checkpoint, or holds a format or shape `target` cannot store, or
            (with `for_vllm` and without `force`) a map vLLM cannot serve; the message names the layers.
    """
    spec = get_export_target(target)
    if not isinstance(source, (str, os.PathLike)):
        with tempfile.TemporaryDirectory(prefix="dmx-export-") as saved:
            source.save_pretrained(saved)
            return export_checkpoint(saved, output_dir, target, for_vllm=for_vllm, force=force, overwrite=overwrite)
    source, output_dir = Path(source), Path(output_dir)
    try:
        check_output(output_dir, [source])
    except ValueError as error:
        raise ExportError(str(error)) from None
    config = _read_dmx_config(source)
    quantization = config["quantization_config"]
    format_map: dict[str, str] = quantization["format_map"]
    _check_exportable(spec, quantization, for_vllm=for_vllm, force=force)
    skeleton = _skeleton(source, format_map)
    _check_whole_blocks(skeleton, format_map, spec)
    transforms = _online_transforms(spec, quantization, skeleton)

    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{str(source)!r} has no safetensors files")
    stored = _stored_layers(files, skeleton, format_map)

    with staged_folder(output_dir, overwrite=overwrite) as staging:
        weight_map = _convert_tensors(files, staging, spec, format_map, stored, transforms, skeleton)
        if len(set(weight_map.values())) > 1:
            index = json.loads((source / SAFETENSORS_INDEX).read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            (staging / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        exported_names = {module: exported for module, exported in stored.values()}
        float_linears = [
            name
            for name, module in skeleton.named_modules()
            if isinstance(module, torch.nn.Linear) and name not in format_map
        ]
        config["quantization_config"] = spec.quantization_config(format_map, float_linears, exported_names)
        if transforms is not None:
            config["quantization_config"].update(transforms.quantization_config)
        _serve_in_bfloat16(config)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in source.iterdir():
            if path.is_file() and path.name not in _REWRITTEN and path.suffix != ".safetensors":
                shutil.copy2(path, staging / path.name)
        (staging / "README.md").write_text(
            spec.model_card(
                quantization,
                output_dir.name,
                generating_model_class(skeleton.config).__name__,
                _warn_uninitializable(
                    skeleton, [name for name, fmt in format_map.items() if fmt in spec.weightless_formats]
                ),
                _warn_subclassed(spec, skeleton, format_map),
                _warn_float_conversions(spec, skeleton, format_map, weight_map, exported_names.values()),
            ),
            encoding="utf-8",
        )
    return output_dir


def _serve_in_bfloat16(config: dict[str, Any]) -> None:
    """A float32 checkpoint is exported as bfloat16: the loaders' MX layers compute in bfloat16, and loaded in its
    own float32 the exported model's first matmul fails on mixed dtypes inside the loader."""
    for key in ("dtype", "torch_dtype"):
        if config.get(key) == "float32":
            logger.warning(
                "The checkpoint is float32; its export loads as bfloat16, the dtype the loaders' MX layers "
                "compute in (embeddings, norms and lm_head included)."
            )
            config[key] = "bfloat16"


def _read_dmx_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"{str(folder)!r} has no config.json: not a saved model folder")
    config = json.loads(path.read_text())
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != QUANT_METHOD or not quantization.get("format_map"):
        raise ExportError(f"{str(folder)!r} is not a dMX checkpoint (its config.json has no dMX format_map)")
    return config


def _check_exportable(spec: ExportTarget, quantization: Mapping[str, Any], *, for_vllm: bool, force: bool) -> None:
    """Raise for what the target cannot store; for what vLLM cannot serve, unless forced; warn on scale rules."""
    format_map = quantization["format_map"]
    if quantization.get("block_size", 32) != 32:
        raise ExportError(
            f"{spec.name} stores MX blocks of 32 elements; this checkpoint uses block_size={quantization['block_size']}"
        )
    _check_experts(spec, quantization)
    unsupported = sorted(name for name, fmt in format_map.items() if fmt not in spec.formats)
    if unsupported:
        found = sorted({format_map[name] for name in unsupported})
        raise ExportError(
            f"{spec.name} cannot store {', '.join(found)} (it stores {', '.join(spec.formats)}): "
            f"{len(unsupported)} layers, e.g. {', '.join(unsupported[:3])}"
            + (f"; export to {spec.alternative!r} instead" if spec.alternative else "")
        )
    if for_vllm:
        problems = []
        not_served = sorted(name for name, fmt in format_map.items() if fmt not in spec.vllm_formats)
        if not_served:
            found = sorted({format_map[name] for name in not_served})
            problems.append(
                f"vLLM does not serve {', '.join(found)} through {spec.name} ({len(not_served)} layers, "
                f"e.g. {', '.join(not_served[:3])}; use the {spec.alternative!r} target or a "
                "format pair without them)"
            )
        mixed = mixed_groups(format_map)
        if mixed:
            shown = "; ".join(
                f"{'/'.join(n.rpartition('.')[2] for n in g)} of {g[0].rpartition('.')[0]} are "
                f"{'/'.join(format_map[n] for n in g)}"
                for g in mixed[:3]
            )
            problems.append(
                f"vLLM runs q/k/v, gate/up and a layer's experts as one fused operation with one format, but "
                f"{len(mixed)} groups mix formats ({shown}); calibrate with shared offsets for fused projections"
            )
        if problems and not force:
            raise ExportError(
                "the format map cannot be served by vLLM as is: "
                + "; ".join(problems)
                + ". Pass force=True (--force) to export anyway for other loaders."
            )
        for problem in problems:
            logger.warning("exporting anyway: %s", problem)
    rule = quantization.get("scale_rule", "ocp")
    if quantization.get("quantize_activations", True) and rule != spec.scale_rule:
        logger.warning(
            "this checkpoint was calibrated with scale_rule=%r, but %s computes activation block scales with its "
            "own rule (%r): served outputs will differ slightly from this package's. Calibrate with "
            "DMXConfig(scale_rule=%r) for an exact match.",
            rule,
            spec.name,
            spec.scale_rule,
            spec.scale_rule,
        )


def _check_experts(spec: ExportTarget, quantization: Mapping[str, Any]) -> None:
    """Raise for quantized mixture-of-experts experts `spec` cannot take, or that carry online transforms; warn for
    what a loader cannot do with them."""
    format_map = quantization["format_map"]
    experts = expert_groups(format_map)
    if not experts:
        return
    layer = experts_module(experts[0][0])
    if spec.experts_refused:
        raise ExportError(
            f"{spec.name} cannot take quantized mixture-of-experts experts ({len(experts)} layers, e.g. {layer}): "
            f"{spec.experts_refused}. Export to {spec.alternative!r}, or keep the experts in float "
            "(modules_to_not_convert=['mlp.experts']) to export the rest"
        )
    expert_linears = {name for group in experts for name in group}
    transformed = sorted(set(quantization.get("input_transforms") or {}) & expert_linears)
    if transformed:
        raise ExportError(
            f"{len(transformed)} expert linears have online input transforms (e.g. {transformed[0]}), which no loader "
            "applies to a mixture-of-experts layer's fused experts (vLLM applies compressed-tensors' transforms to "
            "linear layers only). Calibrate with rotation='auto', which transforms the other linears only, or 'none'"
        )
    caveat = spec.experts_caveat(format_map)
    if caveat:
        logger.warning("%s.", caveat)


def _skeleton(folder: Path, format_map: Mapping[str, str]) -> PreTrainedModel:
    """The model of the checkpoint in `folder` built on the meta device (no memory, no weights): its modules and
    shapes, with the mixture-of-experts layers whose experts `format_map` quantizes as one linear per expert, as dMX
    built them. Its configuration is read by transformers, which decodes what plain JSON cannot hold (Falcon-H1's
    infinite `time_step_limit`)."""
    architecture = AutoConfig.from_pretrained(folder, quantization_config=None)  # the float model's architecture
    with torch.device("meta"):
        model = generating_model_class(architecture).from_config(architecture)
    linearize_experts(model, [experts_module(group[0]) for group in expert_groups(format_map)], skeleton=True)
    return model


def _initialization_failures(skeleton: PreTrainedModel, weightless: Iterable[str]) -> dict[str, str]:
    """The module classes whose weight initialization reads the `weight` of a linear among `weightless` (module
    class -> one such linear), found by running the family's `_init_weights` on those linears of the meta
    `skeleton` and the modules holding them, with their `weight` taken away as the loader's packed layers have none.

    transformers runs that initialization after loading any checkpoint, on every module it has not marked
    initialized (each with the `_init_weights` of the nearest model holding it), and some families' initializers
    read a linear's weight from the module holding it (GPT-BigCode's attention and MLP: `c_proj.weight`; Mamba's
    mixer: `out_proj.weight`) or from the linear itself without checking it has one (Falcon's `FalconLinear`):
    `from_pretrained` then stops with an `AttributeError` (`export.loading.load_exported`
    loads such exports). An initializer that fails otherwise on the meta device says nothing about this and is
    passed over."""
    weightless = list(weightless)
    holders = {".".join(name.split(".")[:end]) for name in weightless for end in range(name.count(".") + 2)}
    taken = {name: skeleton.get_submodule(name)._parameters.pop("weight") for name in weightless}
    failures: dict[str, str] = {}
    try:
        with torch.no_grad():
            for holder in sorted(holders):
                module = skeleton.get_submodule(holder)
                try:
                    _owning_model(skeleton, holder)._init_weights(module)
                except AttributeError as error:
                    if "'weight'" in str(error):
                        held = [n for n in weightless if not holder or n == holder or n.startswith(f"{holder}.")]
                        failures.setdefault(type(module).__name__, held[0])
                except Exception:  # noqa: BLE001  (an initializer the meta device cannot run: not this failure)
                    continue
    finally:
        for name, weight in taken.items():
            skeleton.get_submodule(name)._parameters["weight"] = weight
    return failures


def _owning_model(skeleton: PreTrainedModel, name: str) -> PreTrainedModel:
    """The innermost model (`PreTrainedModel`) holding or being the module `name`, whose `_init_weights`
    transformers runs on it (a composite model's language model initializes its own modules)."""
    parts = name.split(".") if name else []
    for end in range(len(parts), 0, -1):
        module = skeleton.get_submodule(".".join(parts[:end]))
        if isinstance(module, PreTrainedModel):
            return module
    return skeleton


def _warn_uninitializable(skeleton: PreTrainedModel, weightless: list[str]) -> list[str]:
    """Warn if transformers' `from_pretrained` alone cannot load the export (`_initialization_failures`); return the
    module classes at fault, for the model card."""
    failures = _initialization_failures(skeleton, weightless)
    if failures:
        logger.warning(
            "transformers' from_pretrained alone cannot load this export: the weight initialization it runs after "
            "loading reads the weight of packed layers, which they do not have (%s). Load it with "
            "optimum_dmx.export.load_exported; vLLM is not affected.",
            "; ".join(f"{cls}, e.g. at {linear}" for cls, linear in failures.items()),
        )
    return sorted(failures)


def _warn_float_conversions(
    spec: ExportTarget,
    skeleton: PreTrainedModel,
    format_map: Mapping[str, str],
    tensor_names: Iterable[str],
    quantized: Iterable[str],
) -> list[str]:
    """Warn if transformers builds tensors of the model from float tensors of the export (`tensor_names` outside the
    `quantized` layers) with one of its converters (`converted_weight_target`) while packed layers are present
    (`ExportTarget.weightless_formats`); return the tensors it would build, for the model card.

    With compressed-tensors (0.20, transformers 5.25) such a conversion gets no tensors. transformers runs the
    compressed-tensors decompression before each converter of weights, with the scheme of the first quantization
    group whose targets are module names (`get_experts_scheme`); the export lists the groups from the fewest bits,
    so with a packed format present that scheme is packed, and its decompression passes on only packed tensors.
    Loading then stops with a conversion error: float experts stored per expert (tiny Qwen3-MoE and Mixtral, tested;
    12 families of the families sweep) and OLMo-Hybrid's q/k/v convolutions. Beside MXFP8 layers only, the
    decompression passes float tensors on unchanged, and the same models load."""
    if not any(fmt in spec.weightless_formats for fmt in format_map.values()):
        return []
    quantized, target_of = set(quantized), converted_weight_target(skeleton)
    built = sorted(
        {
            target
            for name in tensor_names
            if name.rpartition(".")[0] not in quantized and (target := target_of(name)) is not None
        }
    )
    if built:
        logger.warning(" ".join(spec.float_conversions_note(built).split()))
    return built


def _warn_subclassed(spec: ExportTarget, skeleton: torch.nn.Module, format_map: Mapping[str, str]) -> list[str]:
    """Warn if `spec`'s transformers loader builds its layers for `nn.Linear` exactly and quantized layers subclass
    it (`ExportTarget.exact_linears_only`); return their classes, for the model card."""
    if not spec.exact_linears_only:
        return []
    layer_classes = {name: type(skeleton.get_submodule(name)) for name in format_map}
    subclassed = {name: cls.__name__ for name, cls in layer_classes.items() if cls is not torch.nn.Linear}
    if subclassed:
        logger.warning(
            "transformers with %s cannot load this export: %s builds its quantized layers for nn.Linear exactly, and "
            "%d quantized layers are subclasses (%s, e.g. %s); loading stops on mismatched sizes. Export with "
            "--to %s to load the model with transformers.",
            spec.package,
            spec.package,
            len(subclassed),
            ", ".join(sorted(set(subclassed.values()))),
            next(iter(subclassed)),
            spec.alternative,
        )
    return sorted(set(subclassed.values()))


def _online_transforms(
    spec: ExportTarget, quantization: Mapping[str, Any], skeleton: torch.nn.Module
) -> TransformExport | None:
    """What `spec` writes for the checkpoint's online input transforms (None without any)."""
    input_transforms = quantization.get("input_transforms") or {}
    if not input_transforms:
        return None
    try:
        export = spec.input_transforms(input_transforms, skeleton)
    except ValueError as error:
        raise ExportError(f"{spec.name} cannot carry this checkpoint's rotation: {error}") from None
    logger.warning(
        "%d layers carry online transforms. vLLM applies them; %s. The export's README.md shows the call that "
        "applies them after loading, which optimum_dmx.export.load_exported makes.",
        len(input_transforms),
        spec.transforms_on_load,
    )
    return export


def _check_whole_blocks(skeleton: torch.nn.Module, format_map: Mapping[str, str], spec: ExportTarget) -> None:
    """Raise for layers whose `in_features` is not a multiple of 32: the loaders store no padded last block."""
    ragged = sorted(name for name in format_map if skeleton.get_submodule(name).in_features % 32)
    if ragged:
        raise ExportError(
            f"{spec.name} needs in_features divisible by 32 (whole MX blocks); {len(ragged)} layers are "
            f"not, e.g. {', '.join(ragged[:3])}"
        )


def _stored_layers(
    files: list[Path], skeleton: torch.nn.Module, format_map: Mapping[str, str]
) -> dict[str, tuple[str, str]]:
    """Each quantized layer's tensor prefix in the checkpoint -> `(module name, prefix in the export)`, from the
    safetensors headers. `save_pretrained` writes some families' modules under their original checkpoints' names
    (Mixtral's `block_sparse_moe` for `mlp`: `integration.checkpoint_names`), which the export keeps; an expert's
    projection takes the family's own checkpoint name (Mixtral's `w1`, `w3`, `w2`), which its loaders expect."""
    module_name = checkpoint_key_renaming(skeleton)
    projections = expert_projection_names(skeleton)
    experts = {name for group in expert_groups(format_map) for name in group}
    stored = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            keys = list(reader.keys())
        for key in keys:
            prefix, _, leaf = key.rpartition(".")
            if leaf != "weight_packed":
                continue
            module = module_name(prefix)
            if module not in format_map:
                raise ExportError(
                    f"layer {module!r} is stored packed ({key!r}) but the checkpoint's format_map has no format for "
                    "it: the checkpoint is damaged or its config.json was edited"
                )
            parent, _, projection = prefix.rpartition(".")
            stored[prefix] = (module, f"{parent}.{projections[projection]}" if module in experts else prefix)
    missing = set(format_map) - {module for module, _ in stored.values()}
    if missing:
        raise ExportError(
            f"the safetensors files lack the packed weights of {len(missing)} layers of the format "
            f"map, e.g. {sorted(missing)[:3]}"
        )
    return stored


def _convert_tensors(
    files: list[Path],
    staging: Path,
    spec: ExportTarget,
    format_map: Mapping[str, str],
    stored: Mapping[str, tuple[str, str]],
    transforms: TransformExport | None,
    skeleton: torch.nn.Module,
) -> dict[str, str]:
    """Rewrite every safetensors file into `staging`, each quantized layer's tensors (`stored`: `_stored_layers`) in
    the target's layout, the rows of the layers that take `transforms`' signs negated where they say and the
    transforms' matrices beside the weights of the layers they apply to; return the new tensor name -> file map.
    Tensors keep the checkpoint's names (`save_pretrained` writes some families' modules under other names: an
    image-text model's `model.language_model` as `language_model.model`), and the matrices take them too."""
    row_signs = transforms.row_signs if transforms else {}
    matrices = transforms.tensors if transforms else {}
    module_name = checkpoint_key_renaming(skeleton)
    signs_to_apply = set(row_signs)
    weight_map = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            tensors = {name: reader.get_tensor(name) for name in reader.keys()}
            metadata = reader.metadata()
        stored_as = {module_name(prefix): prefix for prefix in {name.rpartition(".")[0] for name in tensors}}
        signs_to_apply -= _apply_row_signs(tensors, row_signs, format_map, stored_as)
        out = {}
        for name, tensor in tensors.items():
            prefix, _, leaf = name.rpartition(".")
            if prefix not in stored or leaf not in ("weight_packed", "weight_scale"):
                out[name] = tensor
            elif leaf == "weight_packed":
                module, exported = stored[prefix]
                out.update(spec.layer_tensors(exported, format_map[module], tensor, tensors[f"{prefix}.weight_scale"]))
        for module in stored_as.keys() & matrices.keys():
            out.update({stored_as[module] + name[len(module) :]: matrix for name, matrix in matrices[module].items()})
        save_file(out, staging / file.name, metadata=metadata)
        weight_map.update(dict.fromkeys(out, file.name))
    if signs_to_apply:
        raise ExportError(f"the safetensors files lack the weights of {sorted(signs_to_apply)}, whose rows take signs")
    return weight_map


def _apply_row_signs(
    tensors: dict[str, torch.Tensor],
    row_signs: Mapping[str, torch.Tensor],
    format_map: Mapping[str, str],
    stored_as: Mapping[str, str],
) -> set[str]:
    """Negate, in `tensors`, the outputs of each layer of `row_signs` where its sign is -1: packed MX codes' rows by
    their sign bits (exact), float weights' rows (a norm's scale elements) and biases by multiplication. A layer's
    tensors are named by its prefix in the checkpoint (`stored_as`: module name -> prefix). Return the layers whose
    weight was here."""
    done = set()
    for module, signs in row_signs.items():
        prefix = stored_as.get(module, module)
        if f"{prefix}.weight_packed" in tensors:
            packed = tensors[f"{prefix}.weight_packed"]
            tensors[f"{prefix}.weight_packed"] = negate_rows(packed, format_map[module], signs < 0)
        elif f"{prefix}.weight" in tensors:
            weight = tensors[f"{prefix}.weight"]  # a linear's [out, in], or a norm's scale [features]
            tensors[f"{prefix}.weight"] = weight * signs.to(weight.dtype).view(-1, *(1,) * (weight.dim() - 1))
        else:
            continue
        done.add(module)
        if f"{prefix}.bias" in tensors:
            bias = tensors[f"{prefix}.bias"]
            tensors[f"{prefix}.bias"] = bias * signs.to(bias.dtype)
    return done
