"""Calibration settings: every knob of a dMX calibration run, validated once, at construction.

The defaults are the dMX paper's (`docs/method.md`). `DMXConfig` builds one of these to validate its
calibration fields, so defaults and validation live here only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..continuous import get_format_pair
from ..formats.spec import validate_scale_rule
from .groups import validate_offset_groups
from ..nn.bits import BIT_AVERAGES
from .regularizers import REGULARIZERS

RECIPES = ("dmx", "paper")
DISCRETIZATIONS = ("budget", "threshold")
OFFSET_PROBES = ("low", "path", "swap")
LOSSES = ("cross_entropy", "distillation")
DEFAULT_KL_WEIGHT = 0.5  # the default recipe's blend of its learned ranking with KL pre-selection's


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class CalibrationSettings:
    """Hyper-parameters of one dMX calibration run.

    Args:
        recipe: `"dmx"` (default) or `"paper"`. Both learn from the derivative of the task loss with respect to
            each layer's format offset, through the continuous quantizer (`docs/method.md`):
            * `"paper"` is the dMX paper's procedure, exactly: every layer follows its relaxed offset
              `F(beta_hat, T)` through fractional formats, SGD on cross-entropy + the bit regularizer, and
              `beta_hat >= 1` picks the high format;
            * `"dmx"` (this package's default) samples, each step, a format map at the bit budget (Gumbel top-k
              on the offsets, from uniform to deterministic as `T` anneals), learns each offset as the running
              mean of the loss's decrease per unit of format offset at the layer's low format, and picks the
              budget's highest offsets (`discretization="budget"`). No learning rate, no regularizer.
        target_bits: average element bits the format assignment should reach (scales excluded, so
            MXFP4 counts 4.0). Must lie within the format pair's range.
        format_pair: `"mxfp8-mxfp4"` (E2M1 -> E3M2 -> E4M3, 4 to 8 bits) or `"mxfp6-mxfp4"`
            (E2M1 -> E2M3, 4 to 6 bits).
        num_samples: number of packed calibration sequences.
        seq_len: tokens per calibration sequence.
        batch_size: sequences per optimization step.
        steps: number of optimization steps (forward + backward passes) on the per-layer offsets.
        lr: SGD learning rate for the offsets `beta_hat` (`"paper"` recipe).
        regularizer: `"target"` for `max(0, lambda (bits - target))`, `"simple"` for `lambda bits`
            (`"paper"` recipe; the `"dmx"` recipe keeps the target budget by construction).
        reg_lambda: regularizer strength lambda (`"paper"` recipe).
        discretization: how the learned offsets become formats: `"budget"` (the highest offsets that fit
            `target_bits`, within `BUDGET_TOLERANCE`; `calibration.budget`) or `"threshold"` (`beta_hat >= 1`,
            the paper's rule). Default: `"budget"` for the `"dmx"` recipe, `"threshold"` for `"paper"`.
        bit_average: `"simple"` (mean over layers) or `"weighted"` (by tensor size) average used by the
            regularizer. Both are always reported.
        t_start, t_end: temperature before and at the end of annealing: of the sigmoid that maps `beta_hat` to
            `beta` (`"paper"`), of the map sampling (`"dmx"`: uniform at `t_start`, sharper as it rises).
        t_warmup_ratio: fraction of the steps kept at `t_start` before the exponential rise to `t_end`.
        offset_probe: where the `"dmx"` recipe reads the derivative of a layer drawn in its low format: `"low"`
            (at `beta = 0`: the first-order gain of leaving the low format) or `"path"` (at a point drawn
            uniformly on `[0, 2]` each step: its mean is `(L(low) - L(high)) / 2`, the whole gain of the high
            format integrated along the continuous path) or `"swap"` (every layer, in the discrete format it was
            drawn in, estimates `L(low) - L(high)` to first order from the change of its output the other format
            would make; the means from the two ends are averaged, the trapezoid rule).
        loss: what the offsets learn from: `"cross_entropy"` (the model's own next-token loss on the calibration
            text, the paper's) or `"distillation"` (`KL(float || quantized)` of the next-token distributions: one
            more gradient-free forward pass per step; `calibration.losses`).
        kl_weight: weight in `[0, 1]` of KL pre-selection's ranking in the final ranking (`discretization="budget"`
            only): each layer's priority is `(1 - kl_weight) * rank(offset) + kl_weight * rank(KL sensitivity)`,
            ranks as fractions of the layer count (`calibration.budget.blended_priority`). 0 ranks by the learned
            offsets alone; the KL scan (one forward pass per layer on `kl_samples` sequences) runs only when it is
            above 0. Default: 0.5 for the `"dmx"` recipe (the two rankings are complementary: measured in
            `benchmarks/results/README.md`), 0 for `"paper"` (the paper's procedure, exactly).
        kl_samples: calibration sequences the KL scan reads (the first ones).
        offset_groups: layers that share one offset, and so one format: `"none"` (every layer its own),
            `"fused"` (q/k/v and gate/up of each decoder layer, which serving engines run as one matmul with one
            format; found from module names) or explicit lists of module names.
        block_size: MX block size along `in_features`.
        scale_rule: how each MX block scale follows its block maximum: `"ocp"` (the specification's floor), or the
            rounding rule of the loader the model will be served with, `"compressed-tensors"` or `"quark"`
            (`formats.spec.SCALE_RULES`), so that calibration sees the activations the server will compute.
        quantize_activations: also quantize each targeted linear's input activation (dynamically, with the
            layer's format).
        modules_to_not_convert: module-name patterns left in float (see `linear_modules_to_quantize`).
        seed: seeds data shuffling and the batch order, which makes a run deterministic.
        learn_rotations: train the model's merged rotations with the offsets, on the same loss (Cayley SGD on one
            extra orthogonal matrix for the residual stream and one per layer for the value heads, starting at the
            identity; `calibration.rotations`), then merge them into the weights. Needs a model rotated with a
            merged rotation first (`nn.rotation`: `DMXConfig(rotation="hadamard")` or `"block_hadamard"`); each
            step then quantizes every weight afresh.
        rotation_lr: the Cayley SGD step size of the learned rotations (SpinQuant's 1.5; each step's turn is capped,
            `calibration.rotations.CayleySGD`).
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass instead of keeping
            them (transformers' activation checkpointing, non-reentrant; `calibration.checkpointing`): less memory
            for about one more forward pass per step. The results are the same bit for bit.
    """

    recipe: str = "dmx"
    target_bits: float = 5.0
    format_pair: str = "mxfp8-mxfp4"
    num_samples: int = 3200
    seq_len: int = 2048
    batch_size: int = 8
    steps: int = 400
    lr: float = 1.0
    regularizer: str = "target"
    reg_lambda: float = 5.0
    bit_average: str = "simple"
    discretization: str | None = None
    t_start: float = 8.0
    t_end: float = 400.0
    t_warmup_ratio: float = 0.6
    offset_probe: str = "low"
    loss: str = "cross_entropy"
    kl_weight: float | None = None
    kl_samples: int = 4
    offset_groups: str | list[list[str]] = "none"
    block_size: int = 32
    quantize_activations: bool = True
    scale_rule: str = "ocp"
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head"])
    seed: int = 0
    learn_rotations: bool = False
    rotation_lr: float = 1.5
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        _require(self.recipe in RECIPES, f"recipe={self.recipe!r} is not supported; allowed: {', '.join(RECIPES)}.")
        if self.discretization is None:
            self.discretization = "budget" if self.recipe == "dmx" else "threshold"
        if self.kl_weight is None:
            self.kl_weight = DEFAULT_KL_WEIGHT if self.recipe == "dmx" else 0.0
        _require(
            self.discretization in DISCRETIZATIONS,
            f"discretization={self.discretization!r} is not supported; allowed: {', '.join(DISCRETIZATIONS)}.",
        )
        pair = get_format_pair(self.format_pair)
        self.format_pair = pair.name
        _require(
            pair.min_bits <= self.target_bits <= pair.max_bits,
            f"target_bits={self.target_bits!r} is outside the range of format pair {pair.name!r}: "
            f"allowed {pair.min_bits} to {pair.max_bits}.",
        )
        for name in ("num_samples", "seq_len", "batch_size", "steps", "block_size", "kl_samples"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name}={value!r} must be a positive integer.",
            )
        validate_scale_rule(self.scale_rule)
        _require(
            isinstance(self.kl_weight, (int, float)) and 0.0 <= self.kl_weight <= 1.0,
            f"kl_weight={self.kl_weight!r} must lie in [0, 1].",
        )
        _require(
            self.kl_weight == 0 or self.discretization == "budget",
            f"kl_weight={self.kl_weight!r} blends rankings for the budget rule; discretization="
            f"{self.discretization!r} has none (use kl_weight=0).",
        )
        _require(self.loss in LOSSES, f"loss={self.loss!r} is not supported; allowed: {', '.join(LOSSES)}.")
        _require(
            self.offset_probe in OFFSET_PROBES,
            f"offset_probe={self.offset_probe!r} is not supported; allowed: {', '.join(OFFSET_PROBES)}.",
        )
        self.offset_groups = validate_offset_groups(self.offset_groups)
        _require(
            isinstance(self.gradient_checkpointing, bool),
            f"gradient_checkpointing={self.gradient_checkpointing!r} must be True or False.",
        )
        _require(
            not (self.gradient_checkpointing and self.recipe == "dmx" and self.offset_probe == "swap"),
            "offset_probe='swap' records each layer's output in its forward pass, which activation checkpointing "
            "runs twice; use gradient_checkpointing=False with it.",
        )
        _require(
            isinstance(self.learn_rotations, bool),
            f"learn_rotations={self.learn_rotations!r} must be True or False.",
        )
        _require(
            not (self.learn_rotations and self.recipe == "dmx" and self.offset_probe == "swap"),
            "offset_probe='swap' casts each frozen weight once, and learned rotations change the weights every step; "
            "use offset_probe='low' or 'path' with learn_rotations=True.",
        )
        _require(self.rotation_lr > 0, f"rotation_lr={self.rotation_lr!r} must be positive.")
        _require(self.seq_len >= 2, f"seq_len={self.seq_len!r} must be at least 2 to predict a next token.")
        _require(self.lr > 0, f"lr={self.lr!r} must be positive.")
        _require(self.reg_lambda >= 0, f"reg_lambda={self.reg_lambda!r} must be non-negative.")
        _require(
            self.regularizer in REGULARIZERS,
            f"regularizer={self.regularizer!r} is not supported; allowed: {', '.join(REGULARIZERS)}.",
        )
        _require(
            self.bit_average in BIT_AVERAGES,
            f"bit_average={self.bit_average!r} is not supported; allowed: {', '.join(BIT_AVERAGES)}.",
        )
        _require(
            0 < self.t_start <= self.t_end,
            f"temperatures must satisfy 0 < t_start <= t_end; got t_start={self.t_start!r}, t_end={self.t_end!r}.",
        )
        _require(
            0.0 <= self.t_warmup_ratio <= 1.0,
            f"t_warmup_ratio={self.t_warmup_ratio!r} must lie in [0, 1].",
        )
        _require(
            isinstance(self.modules_to_not_convert, (list, tuple))
            and all(isinstance(p, str) for p in self.modules_to_not_convert),
            f"modules_to_not_convert={self.modules_to_not_convert!r} must be a list of module-name patterns (str).",
        )
        self.modules_to_not_convert = list(self.modules_to_not_convert)
        _require(
            self.recipe == "paper" or (self.regularizer == "target" and self.discretization == "budget"),
            f"recipe='dmx' samples format maps at target_bits and needs regularizer='target' and "
            f"discretization='budget' (got {self.regularizer!r}, {self.discretization!r}); use recipe='paper' for "
            "the simple regularizer or the threshold rule.",
        )
        _require(
            self.regularizer == "target" or self.discretization == "threshold",
            "regularizer='simple' sets no bit target, so it needs discretization='threshold'.",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (JSON-serialisable)."""
        return dataclasses.asdict(self)
