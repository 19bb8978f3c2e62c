"""Model cards for dMX checkpoints: a Hub-ready README.md and a per-layer format heatmap.

The card is rendered from what ``config.json`` records (the ``quantization_config`` of a dMX model) plus
facts only the caller knows (base model, calibration data, checkpoint sizes, perplexities). The template
lives in ``model_cards/dmx_model_card.md`` (installed as the package data ``optimum_dmx.model_cards``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from huggingface_hub import HfApi

from ..calibration.settings import MX_BLOCK_SIZE
from ..continuous import get_format_pair
from ..formats import MX_FORMATS
from ..nn.groups import experts_wildcard
from .integrity import write_integrity_record
from .model_classes import generating_model_class

README_NAME = "README.md"
HEATMAP_NAME = "dmx_format_map.png"
TEMPLATE_NAME = "dmx_model_card.md"
# Decoder-layer linears: "<prefix>.layers.<index>.<projection path>"
_LAYER_PATTERN = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")
MIXED = "mixed"  # a cell whose experts are in several formats
_FORMAT_COLOURS = {
    "mxfp4_e2m1": "#d7191c",
    "mxfp6_e3m2": "#fdae61",
    "mxfp6_e2m3": "#a6d96a",
    "mxfp8_e4m3": "#1a9641",
    MIXED: "#7b3294",
}


@dataclass
class PerplexityComparison:
    """Perplexity of the float and the dMX model on one text, under one protocol."""

    text: str
    protocol: str
    before: float | None
    after: float


@dataclass
class ModelCardInfo:
    """What the card needs beyond ``quantization_config``; every field is optional."""

    base_model: str | None = None
    repo_id: str | None = None
    calibration_data: str | None = None
    calibration_seconds: float | None = None
    checkpoint_bytes: int | None = None
    float_checkpoint_bytes: int | None = None
    perplexities: Sequence[PerplexityComparison] = field(default_factory=list)
    license: str | None = None
    tags: Sequence[str] = ()
    auto_class: str = "AutoModelForCausalLM"  # what the card loads the model with (set from the model when saved)


def layer_grid(format_map: Mapping[str, str]) -> tuple[list[int], list[str], dict[tuple[int, str], str]]:
    """Decoder layer indices, projection names (in first-seen order) and ``(layer, projection) -> format``.

    A mixture-of-experts layer's experts make one projection each (``mlp.experts.*.gate_proj``, ...), not one per
    expert (384 on Qwen3-30B-A3B), whose format is the experts' (``MIXED`` where they differ)."""
    cells: dict[tuple[int, str], str] = {}
    projections: list[str] = []
    for name, fmt in format_map.items():
        match = _LAYER_PATTERN.match(name)
        if match is None:
            continue
        layer, projection = int(match.group(1)), experts_wildcard(match.group(2))
        if projection not in projections:
            projections.append(projection)
        cells[(layer, projection)] = fmt if cells.get((layer, projection), fmt) == fmt else MIXED
    return sorted({layer for layer, _ in cells}), projections, cells


def save_format_heatmap(format_map: Mapping[str, str], path: str | Path) -> Path | None:
    """Save a decoder-layer x projection heatmap of the formats as PNG; ``None`` if no layer names match."""
    layers, projections, cells = layer_grid(format_map)
    if not cells:
        return None
    import matplotlib  # imported here: a second of start-up that only drawing the heatmap needs

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    names = [*MX_FORMATS, MIXED]
    grid = [[names.index(cells[(layer, p)]) if (layer, p) in cells else -1 for p in projections] for layer in layers]
    cmap = ListedColormap(["#eeeeee"] + [_FORMAT_COLOURS[n] for n in names])
    fig, ax = plt.subplots(figsize=(1.1 + 0.9 * len(projections), 1.2 + 0.22 * len(layers)))
    ax.imshow([[v + 1 for v in row] for row in grid], cmap=cmap, vmin=0, vmax=len(names), aspect="auto")
    labels = [("experts " if ".experts.*." in p else "") + p.split(".")[-1] for p in projections]
    ax.set_xticks(range(len(projections)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_ylabel("decoder layer")
    used = sorted({fmt for fmt in cells.values()}, key=names.index)
    ax.legend(
        handles=[Patch(color=_FORMAT_COLOURS[n], label=n) for n in used],
        loc="upper left",
        bbox_to_anchor=(1.02, 1),
        frameon=False,
    )
    ax.set_title("dMX format per layer")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_bits(value: Any) -> str:
    """A recorded bit count to three decimals ("n/a" where a checkpoint has none)."""
    return "n/a" if value is None else f"{value:.3f}"


def _format_table(format_map: Mapping[str, str]) -> str:
    layers, projections, cells = layer_grid(format_map)
    short = {**{name: f"{name[:5].upper()} {name[6:].upper()}" for name in MX_FORMATS}, MIXED: MIXED}
    lines = []
    if cells:
        lines += ["| layer | " + " | ".join(projections) + " |", "|---" * (len(projections) + 1) + "|"]
        for layer in layers:
            row = [short.get(cells.get((layer, p), ""), "-") for p in projections]
            lines.append(f"| {layer} | " + " | ".join(row) + " |")
    others = {n: f for n, f in format_map.items() if _LAYER_PATTERN.match(n) is None}
    if others:
        lines += ["", "| module | format |", "|---|---|"] + [f"| `{n}` | {short[f]} |" for n, f in others.items()]
    return "\n".join(lines)


def _metadata(config: Mapping[str, Any], info: ModelCardInfo) -> str:
    formats_used = sorted(set(config["format_map"].values()))
    tags = ["dmx", "mx-formats", "mxfp4", "quantized", "mixed-precision"]
    for tag in [f.split("_")[0] for f in formats_used] + list(info.tags):
        if tag not in tags:
            tags.append(tag)
    lines = ["library_name: transformers"]
    if info.license:
        lines.append(f"license: {info.license}")
    if info.base_model:
        lines += ["base_model:", f"- {info.base_model}", "base_model_relation: quantized"]
    lines += ["tags:"] + [f"- {tag}" for tag in tags]
    return "\n".join(lines)


def _size_row(info: ModelCardInfo) -> str:
    if not info.checkpoint_bytes:
        return ""
    if not info.float_checkpoint_bytes:
        return f"| Checkpoint size | {info.checkpoint_bytes / 2**20:.1f} MiB |\n"
    ratio = info.checkpoint_bytes / info.float_checkpoint_bytes
    return (
        f"| Checkpoint size | {info.checkpoint_bytes / 2**20:.1f} MiB, {ratio:.3f} x the float checkpoint "
        f"({info.float_checkpoint_bytes / 2**20:.1f} MiB) |\n"
    )


_METHOD_TEXT = {
    "dmx": "`dmx`: format maps sampled at the bit budget each step, per-layer offsets learned from the task loss's "
    "derivative, their ranking blended with KL pre-selection's, highest-ranked layers kept within the budget",
    "paper": "`paper`: the dMX paper's procedure (relaxed offsets through fractional formats, SGD on task loss + bit "
    "regularizer)",
    "kl": "`kl`: KL pre-selection (the layers whose MXFP4 quantization moves the next-token distribution most go "
    "high, within the budget)",
}
# Settings that take part in each method; the paper's hyper-parameters are listed with its own.
_METHOD_SETTINGS = {
    "dmx": ("preset", "steps", "batch_size", "seq_len", "num_samples", "bit_average", "offset_groups", "seed"),
    "paper": ("preset", "steps", "batch_size", "seq_len", "num_samples", "bit_average", "offset_groups", "seed"),
    "kl": ("seq_len", "batch_size", "bit_average", "offset_groups", "seed"),
}


_ROTATION_TEXT = {
    "none": "none",
    "hadamard": "full-size randomized Hadamard (merged into the weights; online on each `down_proj` input)",
    "block_hadamard": "block-diagonal randomized Hadamard aligned to the MX blocks (merged into the weights; online on "
    "each `down_proj` input)",
    "online_block_hadamard": "block-diagonal randomized Hadamard aligned to the MX blocks on every quantized linear's "
    "input, at run time (inverse merged into the weights)",
}


_WEIGHT_ROUNDING_TEXT = {
    "rtn": "round to nearest",
    "gptq": "GPTQ in each layer's format (second-order error feedback from the calibration data)",
}


def _rotation_text(config: Mapping[str, Any]) -> str:
    rotation = config.get("rotation") or "none"
    text = _ROTATION_TEXT.get(rotation, rotation)
    if config.get("learn_rotations"):
        text += "; the merged rotations then trained with the formats (Cayley SGD)"
    return text


def _calibration_section(config: Mapping[str, Any], info: ModelCardInfo) -> str:
    if config.get("target_bits") is None or config.get("steps") is None:
        return "The format map was given explicitly (no calibration)."
    method = config.get("method") or "dmx"
    settings = [f"{key}={config[key]}" for key in _METHOD_SETTINGS.get(method, ()) if config.get(key) is not None]
    settings += [f"{key}={value}" for key, value in (config.get("paper") or {}).items()]
    data = info.calibration_data or "not recorded"
    text = (
        f"Calibration data: {data}.\n\nMethod: {_METHOD_TEXT.get(method, method)}.\n\nSettings: {', '.join(settings)}."
    )
    if info.calibration_seconds is not None:
        text += f" Calibration took {info.calibration_seconds / 60:.1f} min."
    return text


def _evaluation_section(info: ModelCardInfo) -> str:
    if not info.perplexities:
        return ""
    lines = ["\n## Evaluation\n", "| text | protocol | perplexity (float) | perplexity (dMX) |", "|---|---|---|---|"]
    for r in info.perplexities:
        before = "n/a" if r.before is None else f"{r.before:.2f}"
        lines.append(f"| {r.text} | {r.protocol} | {before} | {r.after:.2f} |")
    return "\n".join(lines) + "\n"


def render_model_card(quantization_config: Mapping[str, Any], info: ModelCardInfo | None = None) -> str:
    """The README.md text of a dMX model card, from ``quantization_config.to_dict()`` and ``info``."""
    info = info or ModelCardInfo()
    config = dict(quantization_config)
    if not config.get("format_map"):
        raise ValueError("A dMX model card needs a quantization_config with a format_map (quantize the model first).")
    pair = get_format_pair(config.get("format_pair") or "mxfp8-mxfp4")
    counts = Counter(config["format_map"].values())
    bits = config.get("achieved_bits") or {}
    bit_average = config.get("bit_average") or "simple"  # checkpoints before the setting kept the simple average
    budget_bits = "bits_weighted" if bit_average == "weighted" else "bits_simple"  # what the title states
    base = info.base_model or "a transformers model"
    values = {
        "metadata": _metadata(config, info),
        "title": f"{info.base_model.split('/')[-1]} dMX ({format_bits(bits.get(budget_bits))} bits)"
        if info.base_model
        else "dMX mixed-precision MX model",
        "base_model_label": f"[{info.base_model}](https://huggingface.co/{info.base_model})"
        if info.base_model and "/" in info.base_model
        else base,
        "kept": ", ".join(f"`{m}`" for m in config.get("modules_to_not_convert") or []) or "none",
        "format_pair": pair.name,
        "low_format": pair.low.name,
        "high_format": pair.high.name,
        "target_bits": "n/a" if config.get("target_bits") is None else f"{config['target_bits']}",
        "budget": "weighted by tensor size" if bit_average == "weighted" else "simple mean over layers",
        "bits_simple": format_bits(bits.get("bits_simple")),
        "bits_weighted": format_bits(bits.get("bits_weighted")),
        "storage_bits": format_bits(bits.get("storage_bits")),
        "format_counts": ", ".join(f"{name}: {counts[name]}" for name in MX_FORMATS if counts[name]),
        "size_rows": _size_row(info),
        "repo_id": info.repo_id or "path/to/this/model",
        "auto_class": info.auto_class,
        "calibration": _calibration_section(config, info),
        "evaluation": _evaluation_section(info),
        "format_table": _format_table(config["format_map"]),
        "block_size": MX_BLOCK_SIZE,
        "rotation": _rotation_text(config),
        "weight_rounding": _WEIGHT_ROUNDING_TEXT.get(config.get("weight_rounding") or "rtn"),
    }
    template = resources.files("optimum_dmx.model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")
    return Template(template).substitute(values)


def checkpoint_bytes(folder: str | Path) -> int:
    """Bytes of the ``*.safetensors`` files in ``folder`` (0 when there are none)."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def write_model_card(
    save_directory: str | Path, quantization_config: Mapping[str, Any], info: ModelCardInfo | None = None
) -> Path:
    """Write ``README.md`` and the heatmap ``dmx_format_map.png`` into ``save_directory``.

    The checkpoint size on the card is measured from the ``*.safetensors`` files already in the folder.
    """
    save_directory = Path(save_directory)
    info = dataclasses.replace(info or ModelCardInfo(), checkpoint_bytes=checkpoint_bytes(save_directory) or None)
    save_format_heatmap(dict(quantization_config)["format_map"], save_directory / HEATMAP_NAME)
    path = save_directory / README_NAME
    path.write_text(render_model_card(quantization_config, info), encoding="utf-8")
    return path


class _WritesDMXModelCard:
    """Mixin of the class `attach_model_card` gives a dMX model: saving and pushing also write the dMX card."""

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> Any:
        """transformers' `save_pretrained`, then (on the main process) the dMX model card and heatmap."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        call = inspect.signature(super().save_pretrained).bind(save_directory, *args, **kwargs)
        call.apply_defaults()
        config = getattr(self.config, "quantization_config", None)
        if call.arguments["is_main_process"] and config is not None and config.format_map:
            write_integrity_record(save_directory, self, config.format_map)
        if call.arguments["is_main_process"] and not call.arguments["push_to_hub"] and config is not None:
            info = dataclasses.replace(self.dmx_card_info, auto_class=generating_model_class(self.config).__name__)
            write_model_card(save_directory, config.to_dict(), info)
        return result

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ) -> Any:
        """transformers' `push_to_hub` (same arguments), uploading the dMX model card instead of a generic one."""
        api = HfApi(token=token if isinstance(token, str) else None)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
        card = self.dmx_card_info
        self.dmx_card_info = dataclasses.replace(
            card, repo_id=card.repo_id or repo_id, tags=[*card.tags, *(self.model_tags or []), *extra_tags]
        )
        try:
            with tempfile.TemporaryDirectory() as folder:
                self.save_pretrained(folder, max_shard_size=max_shard_size)
                return api.upload_folder(
                    repo_id=repo_id,
                    folder_path=folder,
                    commit_message=commit_message or "Upload dMX-quantized model",
                    commit_description=commit_description,
                    revision=revision,
                    create_pr=create_pr,
                )
        finally:
            self.dmx_card_info = card

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError(
            "a dMX model is saved with save_pretrained (packed safetensors + config.json), not pickled; "
            "its class carries the model-card hooks and exists only in this process"
        )


_CARD_CLASSES: dict[type, type] = {}


def attach_model_card(model: Any, info: ModelCardInfo | None = None) -> None:
    """Make ``model.save_pretrained`` and ``model.push_to_hub`` write the dMX model card.

    transformers has no hook through which a quantization method writes its model card: ``save_pretrained``
    writes none and ``push_to_hub`` uploads a generic one. So, as ``torch.nn.utils.parametrize`` does for
    parametrized modules, the model's class is swapped for a subclass (cached per class, with the same name,
    so ``config.architectures`` is unchanged) whose two methods call transformers' and add the card; no
    instance attribute refers back to the model, so there is no reference cycle. ``info`` (replaceable later
    through ``model.dmx_card_info``) defaults to the model's source as base model.
    """
    base = type(model)
    if not issubclass(base, _WritesDMXModelCard):
        if base not in _CARD_CLASSES:
            namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
            _CARD_CLASSES[base] = type(base.__name__, (_WritesDMXModelCard, base), namespace)
        model.__class__ = _CARD_CLASSES[base]
    model.dmx_card_info = info or ModelCardInfo(base_model=getattr(model.config, "_name_or_path", None) or None)


def detach_model_card(model: Any) -> None:
    """Undo `attach_model_card`: the model gets its transformers class back."""
    if isinstance(model, _WritesDMXModelCard):
        model.__class__ = next(c for c in type(model).__mro__ if not issubclass(c, _WritesDMXModelCard))
        del model.dmx_card_info
