"""Learned rotations: the merged orthogonal rotations trained jointly with the format offsets (SpinQuant style).

After `nn.rotation.rotate_model` has merged randomized Hadamard rotations into a model, `learned_rotations`
puts one more orthogonal matrix on top of each merged rotation, starting at the identity (so training starts from
the Hadamard-rotated model): `residual` (`[hidden, hidden]`, R1) rotates the residual stream, and one `[head_dim,
head_dim]` matrix per decoder layer (R2) rotates its value heads. The quantized layers (`DMXLinear`) compute with
their weight rotated by the matrices on either side and quantize it afresh every step, so the calibration loss
reaches the matrices through the quantizers' straight-through gradient; the float modules (embeddings, lm_head,
any linear left in float) rotate their activations instead, which is the same function. Every step the matrices
move by `CayleySGD`, which keeps them orthogonal, so the float model's function never changes; at the end they
are merged into the weights (`nn.rotation.merge_rotations`) and nothing of them is needed at load time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..nn.placement import execution_device
from ..nn.rotation import RotationSites, has_unit_norm_scales, merge_rotations, rotate_input_side, rotation_sites
from ..nn.surgery import swapped_modules
from .distributed import average_across_processes
from .dmx_linear import DMXLinear

ROTATION_LR = 1.5  # SpinQuant's Cayley SGD step size (each step's turn is capped by MAX_STEP_ANGLE)
MAX_STEP_ANGLE = 1.0  # CayleySGD caps each step's ||a A||_F at this, which bounds ||X_new - X||_F by it too


class CayleySGD(torch.optim.Optimizer):
    """Gradient descent on square orthogonal matrices, retracted by the Cayley transform.

    For a matrix `X` with loss gradient `G`, the skew-symmetric `A = G X^T - X G^T` generates the rotation of
    steepest descent; the step is `X <- (I + a/2 A)^-1 (I - a/2 A) X`, orthogonal for any step size, with
    `a = min(lr, MAX_STEP_ANGLE / ||A||_F)` so that no step moves the matrix by more than `MAX_STEP_ANGLE` in
    Frobenius norm (`X_new - X = -(I + a/2 A)^-1 a A X`, and `(I + a/2 A)^-1` is a contraction for a skew `A`; the
    normalization of Li et al., "Efficient Riemannian Optimization on the Stiefel Manifold via the Cayley
    Transform", ICLR 2020, used by SpinQuant). Computed in float64.
    """

    def __init__(self, params, lr: float = ROTATION_LR):
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be positive.")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for matrix in group["params"]:
                if matrix.grad is None:
                    continue
                x, g = matrix.double(), matrix.grad.double()
                direction = g @ x.T - x @ g.T
                norm = torch.linalg.matrix_norm(direction)
                if norm == 0:
                    continue
                half_step = 0.5 * min(group["lr"], MAX_STEP_ANGLE / norm.item()) * direction
                identity = torch.eye(len(x), dtype=x.dtype, device=x.device)
                matrix.copy_(torch.linalg.solve(identity + half_step, (identity - half_step) @ x).to(matrix.dtype))


class LearnedRotations:
    """The orthogonal matrices learned on top of a model's merged rotations, and their optimizer.

    `residual` is None for a model whose residual stream is not rotated (post-block norms, `RotationSites`).
    """

    def __init__(self, sites: RotationSites, hidden_size: int, device: torch.device, lr: float = ROTATION_LR):
        def identity(size: int) -> torch.Tensor:
            return torch.eye(size, dtype=torch.float64, device=device, requires_grad=True)

        self.sites = sites
        self.residual = identity(hidden_size) if sites.residual else None
        self.heads = [identity(head_dim) for _, _, head_dim in sites.heads]
        self.optimizer = CayleySGD(self.parameters(), lr=lr)

    def parameters(self) -> list[torch.Tensor]:
        return [*([self.residual] if self.residual is not None else []), *self.heads]

    def step(self, world_size: int = 1) -> None:
        """One Cayley step on the gradients the last backward pass left (averaged across processes); clears them."""
        for matrix in self.parameters():
            if matrix.grad is not None:
                average_across_processes(matrix.grad, world_size)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def sides(self) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Module name -> `(input side, output side)` matrices acting on its weight."""
        sides: dict[str, list] = {}
        if self.residual is not None:
            for name in self.sites.readers:
                sides.setdefault(name, [None, None])[0] = self.residual
            for name in self.sites.writers:
                sides.setdefault(name, [None, None])[1] = self.residual
        for (v_proj, o_proj, _), matrix in zip(self.sites.heads, self.heads):
            sides.setdefault(v_proj, [None, None])[1] = matrix
            sides.setdefault(o_proj, [None, None])[0] = matrix
        return {name: (inputs, outputs) for name, (inputs, outputs) in sides.items()}

    def merge_into(self, model: nn.Module) -> None:
        """Merge the learned matrices into `model`'s weights (`nn.rotation.merge_rotations`)."""
        merge_rotations(
            model,
            self.sites,
            None if self.residual is None else self.residual.detach(),
            [matrix.detach() for matrix in self.heads],
        )


def learnable_sites(model: nn.Module) -> RotationSites:
    """`model`'s `RotationSites`, checked to be learnable: raises `ValueError` when the model has no merged rotation
    to start from (its RMSNorm scales are not folded, so rotating its residual stream would change its function)."""
    sites = rotation_sites(model)
    if sites.residual and not has_unit_norm_scales(model):
        raise ValueError(
            "learned rotations start from merged ones: rotate the model first (rotation='hadamard' or "
            "'block_hadamard'), which folds its RMSNorm scales into the linears"
        )
    return sites


@contextmanager
def learned_rotations(
    model: nn.Module, layers: Mapping[str, DMXLinear], sites: RotationSites, lr: float = ROTATION_LR
) -> Iterator[LearnedRotations]:
    """Learn rotations on top of `model`'s merged ones while the block runs (see the module docstring).

    `layers` are the model's `DMXLinear` modules by name (installed in `model`); `sites` are the model's
    `RotationSites`, found before the `DMXLinear` modules went in (`learnable_sites`). On a normal exit the learned
    matrices are merged into the weights; on an error the model is left as it was.
    """
    hidden_size = model.get_input_embeddings().weight.shape[1]
    rotations = LearnedRotations(sites, hidden_size, execution_device(model.get_input_embeddings()), lr)
    handles: list[RemovableHandle] = []
    try:
        if rotations.residual is not None:
            handles.append(model.get_input_embeddings().register_forward_hook(_rotate_output(rotations.residual)))
        for name, (input_side, output_side) in rotations.sides().items():
            module = model.get_submodule(name)
            if isinstance(module, DMXLinear):
                module.input_rotation, module.output_rotation = input_side, output_side
                continue
            if input_side is not None:
                handles.append(module.register_forward_pre_hook(_unrotate_input(input_side)))
            if output_side is not None:
                handles.append(module.register_forward_hook(_rotate_output(output_side)))
        yield rotations
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers.values():
            layer.input_rotation = layer.output_rotation = None
    # The `DMXLinear`s are still installed: merge into the linears they stand in for, where their weights live.
    with swapped_modules(model, {name: layer.source for name, layer in layers.items()}):
        rotations.merge_into(model)


def _unrotate_input(matrix: torch.Tensor):
    """A float module expecting the unrotated input: undo the rotation (`x R^T`) before it runs."""
    return lambda module, args: (rotate_input_side(args[0], matrix.T.to(args[0].dtype)), *args[1:])


def _rotate_output(matrix: torch.Tensor):
    """A float module whose output the rest of the model reads rotated: rotate it (`y R`)."""
    return lambda module, args, output: rotate_input_side(output, matrix.to(output.dtype))
