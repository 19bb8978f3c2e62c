"""Calibration settings: what a dMX calibration run does, validated once, at construction.

`CalibrationSettings` holds what a user chooses (method, budget, data sizes, groups, rotations); the dMX paper's
own hyper-parameters live in `PaperRecipe`, read only by `method="paper"`. `DMXConfig` builds one of these to
validate its fields, so defaults and validation live here only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..continuous import get_format_pair
from ..formats import get_format
from ..formats.spec import validate_scale_rule
from ..nn.bits import BIT_AVERAGES
from .groups import validate_offset_groups
from .regularizers import REGULARIZERS
from .schedule import T_END, T_START, T_WARMUP_RATIO

METHODS = ("dmx", "paper", "kl")
DISCRETIZATIONS = ("threshold", "budget")
MX_BLOCK_SIZE = 32  # the OCP specification's block, the only one the serving engines read


def require(condition: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `condition`: the settings' one way to refuse a value."""
    if not condition:
        raise ValueError(message)


def require_positive_int(name: str, value: Any) -> None:
    require(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        f"{name}={value!r} must be a positive integer.",
    )


def require_bool(name: str, value: Any) -> None:
    require(isinstance(value, bool), f"{name}={value!r} must be True or False.")


def require_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a number, got {type(value).__name__}.")


def validate_cost_table(table: Any) -> dict[str, dict[str, float]] | None:
    """A cost table as plain data with canonical format names (`calibration.budget.layer_costs`), or None."""
    if table is None:
        return None
    require(
        isinstance(table, dict) and all(isinstance(costs, dict) for costs in table.values()),
        f"cost_table={table!r} must map format names to {{'OUTxIN': cost}} dicts (weight shape -> cost of a layer).",
    )
    canonical = {}
    for fmt, costs in table.items():
        try:
            name = get_format(fmt).name
        except (KeyError, ValueError) as error:
            raise ValueError(f"cost_table names an unknown format {fmt!r}: {error}") from None
        for key, cost in costs.items():
            parts = key.split("x") if isinstance(key, str) else []
            require(
                len(parts) == 2 and all(part.isdigit() for part in parts),
                f"cost_table[{fmt!r}] has key {key!r}; keys are weight shapes 'OUTxIN', e.g. '576x1536'.",
            )
            require_number(f"cost_table[{fmt!r}][{key!r}]", cost)
            require(
                math.isfinite(cost) and cost >= 0,
                f"cost_table[{fmt!r}][{key!r}]={cost!r} must be a finite, non-negative cost.",
            )
        canonical[name] = {key: float(cost) for key, cost in costs.items()}
    return canonical


@dataclass(frozen=True)
class PaperRecipe:
    """The dMX paper's procedure, exactly (`method="paper"`), with the paper's values as defaults.

    Every layer follows its relaxed offset `F(beta_hat, T)` through the fractional formats; SGD at `lr` on the
    task loss plus the bit regularizer; the temperature `T` stays at `t_start` for the first `t_warmup_ratio` of
    the steps, then rises exponentially to `t_end`; the offsets then become formats by `discretization`.

    Args:
        lr: SGD learning rate of the offsets.
        regularizer: `"target"`: `max(0, reg_lambda (bits - target_bits))`; `"simple"`: `reg_lambda bits` (no
            target: needs `discretization="threshold"`).
        reg_lambda: the regularizer's strength.
        t_start, t_end, t_warmup_ratio: the temperature schedule.
        discretization: `"threshold"` (the paper's `beta_hat >= 1`) or `"budget"` (the highest offsets that fit
            `target_bits`, as the other methods).
    """

    lr: float = 1.0
    regularizer: str = "target"
    reg_lambda: float = 5.0
    t_start: float = T_START
    t_end: float = T_END
    t_warmup_ratio: float = T_WARMUP_RATIO
    discretization: str = "threshold"

    def __post_init__(self) -> None:
        for name in ("lr", "reg_lambda", "t_start", "t_end", "t_warmup_ratio"):
            require_number(f"PaperRecipe.{name}", getattr(self, name))
        require(self.lr > 0, f"PaperRecipe.lr={self.lr!r} must be positive.")
        require(self.reg_lambda >= 0, f"PaperRecipe.reg_lambda={self.reg_lambda!r} must be non-negative.")
        require(
            self.regularizer in REGULARIZERS,
            f"PaperRecipe.regularizer={self.regularizer!r} is not supported; allowed: {', '.join(REGULARIZERS)}.",
        )
        require(
            self.discretization in DISCRETIZATIONS,
            f"PaperRecipe.discretization={self.discretization!r} is not supported; allowed: "
            f"{', '.join(DISCRETIZATIONS)}.",
        )
        require(
            0 < self.t_start <= self.t_end,
            f"PaperRecipe temperatures must satisfy 0 < t_start <= t_end; got t_start={self.t_start!r}, "
            f"t_end={self.t_end!r}.",
        )
        require(
            0.0 <= self.t_warmup_ratio <= 1.0,
            f"PaperRecipe.t_warmup_ratio={self.t_warmup_ratio!r} must lie in [0, 1].",
        )
        require(
            self.regularizer == "target" or self.discretization == "threshold",
            "PaperRecipe: regularizer='simple' sets no bit target, so it needs discretization='threshold'.",
        )

    @classmethod
    def from_dict(cls, values: PaperRecipe | dict[str, Any] | None) -> PaperRecipe:
        """A recipe from a dict (as config.json stores it), a recipe, or None (the paper's values)."""
        if values is None:
            return cls()
        if isinstance(values, cls):
            return values
        if not isinstance(values, dict):
            raise TypeError(f"paper={values!r} must be a PaperRecipe or a dict of its fields.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"paper has unknown fields {unknown}; allowed: {sorted(known)}.")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class CalibrationSettings:
    """What one dMX calibration run does.

    Args:
        method: how the format map is chosen (`docs/method.md`):
            * `"dmx"` (default): each step draws a format map at the bit budget and learns each layer's offset
              from the loss's derivative at its low format; the final ranking blends the learned offsets with KL
              pre-selection's; the budget's highest layers go high. No learning rate, no regularizer.
            * `"paper"`: the dMX paper's procedure, exactly, with `paper`'s hyper-parameters.
            * `"kl"`: KL pre-selection, the cheap baseline: one forward pass per layer, no training steps.
        target_bits: average element bits the format map should reach (scales excluded, so MXFP4 counts 4.0),
            within the format pair's range.
        format_pair: `"mxfp8-mxfp4"` (E2M1 -> E3M2 -> E4M3, 4 to 8 bits) or `"mxfp6-mxfp4"` (E2M1 -> E2M3,
            4 to 6 bits).
        num_samples, seq_len, batch_size, steps: calibration sequences drawn from the text, tokens per sequence,
            sequences per step, optimization steps.
        bit_average: the average the budget is kept in: `"weighted"` (by tensor size: what the model's size, memory
            traffic and matmul work follow) or `"simple"` (per layer). Default: weighted, but for
            `method="paper"`, whose procedure averages per layer.
        cost_table: what a layer costs in each format, `{format: {"OUTxIN": cost}}` for every weight shape (e.g.
            latency measured on the serving target, or `calibration.budget.storage_cost_table`'s bytes): the
            budget rule then caps the total cost, `target_bits` placing the cap between the all-low and all-high
            totals as it lies between the pair's bits. None (default): bits in `bit_average`.
        offset_groups: layers sharing one offset, so one format: `"none"`, `"fused"` (q/k/v and gate/up of each
            decoder layer, and each mixture-of-experts layer's experts, as serving engines fuse them) or explicit
            lists of module names. The KL scan puts each group low whole, in one pass (`calibration.sensitivity`).
        quantize_activations: also quantize each layer's input activations (dynamically, in its format).
        scale_rule: how a block scale follows the block maximum (`formats.spec.SCALE_RULES`).
        modules_to_not_convert: module-name patterns left in float (`nn.linear_modules_to_quantize`).
        seed: data order and sampling; a run is deterministic for a seed.
        learn_rotations: train the model's merged rotations with the offsets (`calibration.rotations`); needs a
            model rotated with a merged rotation first.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass (less memory,
            about one more forward pass per step, the same result bit for bit).
        paper: the paper's hyper-parameters (`method="paper"` only).
        block_size: MX block size along `in_features` (the specification's 32; lower-level API only).
    """

    method: str = "dmx"
    target_bits: float = 5.0
    format_pair: str = "mxfp8-mxfp4"
    num_samples: int = 3200
    seq_len: int = 2048
    batch_size: int = 8
    steps: int = 400
    bit_average: str | None = None
    cost_table: dict[str, dict[str, float]] | None = None
    offset_groups: str | list[list[str]] = "none"
    quantize_activations: bool = True
    scale_rule: str = "ocp"
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head"])
    seed: int = 0
    learn_rotations: bool = False
    gradient_checkpointing: bool = False
    paper: PaperRecipe = field(default_factory=PaperRecipe)
    block_size: int = MX_BLOCK_SIZE

    def __post_init__(self) -> None:
        require(
            self.method in METHODS,
            f"method={self.method!r} is not supported; allowed: {', '.join(map(repr, METHODS))}.",
        )
        self.paper = PaperRecipe.from_dict(self.paper)
        pair = get_format_pair(self.format_pair)
        self.format_pair = pair.name
        require_number("target_bits", self.target_bits)
        require(
            pair.min_bits <= self.target_bits <= pair.max_bits,
            f"target_bits={self.target_bits!r} is outside the range of format pair {pair.name!r}: "
            f"allowed {pair.min_bits} to {pair.max_bits}.",
        )
        for name in ("num_samples", "seq_len", "batch_size", "steps", "block_size"):
            require_positive_int(name, getattr(self, name))
        require(self.seq_len >= 2, f"seq_len={self.seq_len!r} must be at least 2 to predict a next token.")
        require(
            self.batch_size <= self.num_samples,
            f"batch_size={self.batch_size!r} is larger than num_samples={self.num_samples!r}: a step's batch holds "
            "distinct calibration sequences; lower batch_size or raise num_samples.",
        )
        require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
            f"seed={self.seed!r} must be a non-negative integer.",
        )
        validate_scale_rule(self.scale_rule)
        if self.bit_average is None:
            self.bit_average = "simple" if self.method == "paper" else "weighted"
        require(
            self.bit_average in BIT_AVERAGES,
            f"bit_average={self.bit_average!r} is not supported; allowed: {', '.join(BIT_AVERAGES)}.",
        )
        self.offset_groups = validate_offset_groups(self.offset_groups)
        self.cost_table = validate_cost_table(self.cost_table)
        for name in ("quantize_activations", "learn_rotations", "gradient_checkpointing"):
            require_bool(name, getattr(self, name))
        require(
            isinstance(self.modules_to_not_convert, (list, tuple))
            and all(isinstance(p, str) for p in self.modules_to_not_convert),
            f"modules_to_not_convert={self.modules_to_not_convert!r} must be a list of module-name patterns (str).",
        )
        self.modules_to_not_convert = list(self.modules_to_not_convert)
        require(
            not (self.learn_rotations and self.method == "kl"),
            "learn_rotations=True trains rotations with the offsets; method='kl' trains nothing (use 'dmx').",
        )

    @property
    def discretization(self) -> str:
        """How the offsets become formats: the paper's own rule for `method="paper"`, else the budget."""
        return self.paper.discretization if self.method == "paper" else "budget"

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (JSON-serialisable)."""
        return dataclasses.asdict(self)
