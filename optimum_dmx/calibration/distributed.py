"""Data-parallel calibration: every process takes its share of each batch and the offsets' gradients are averaged.

Under `torchrun` or `accelerate launch` (environment variable `WORLD_SIZE` > 1) every process runs the same
calibration on the same seeded batches; each computes the loss on its contiguous share of the batch rows and
the few hundred offset gradients are averaged across processes after every backward pass. Since every share
holds the same number of tokens, the average equals the full batch's gradient, so every process ends with the
same offsets and format map as a single process with the same global batch and seed. The process group is
initialized here if the launcher has not (gloo on CPU, NCCL on CUDA), and then destroyed here at exit: a gloo group
left to interpreter shutdown can abort the process (`terminate called without an active exception`, SIGABRT) after
the work has finished, which a launcher reports as a failed worker.
"""

from __future__ import annotations

import atexit
import logging
import os

import torch
import torch.distributed as dist

__all__ = ["process_share", "average_across_processes", "sum_across_processes", "is_main_process", "world"]

logger = logging.getLogger(__name__)


def world(device: torch.device | None = None) -> tuple[int, int]:
    """`(rank, world size)` of this calibration; `(0, 1)` in a single process.

    Initializes the default process group when a launcher started several processes and nobody else did.
    """
    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return 0, 1
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        atexit.register(_destroy_process_group)
        logger.info("dMX calibration: initialized a %s process group of %d processes", backend, dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def _destroy_process_group() -> None:
    """Destroy the process group `world` initialized, if nobody has, before the interpreter shuts down."""
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    """True in a single process and on rank 0 of a process group: the process that writes files."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def process_share(rows: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This process's contiguous share of a batch's rows (the batch size is a multiple of `world_size`)."""
    share = len(rows) // world_size
    return rows[rank * share : (rank + 1) * share]


def sum_across_processes(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """`tensor` summed over all processes, in place (unchanged in a single process)."""
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def average_across_processes(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """`tensor` averaged over all processes, in place (unchanged in a single process)."""
    return sum_across_processes(tensor, world_size).div_(world_size)
