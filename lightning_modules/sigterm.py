"""The ranks' agreement on a SIGTERM, without making the host wait for the GPU every step.

Under several processes Lightning (2.6) broadcasts rank 0's SIGTERM flag at the start of
every training step and reads it back at once, so that every rank stops at the same step
when a pod is preempted (an early exit of one rank would leave the others hanging in a
collective). Reading the broadcast back makes the host wait for the device every step:
the queue of kernels the host keeps ahead of the GPU drains, and then the GPU idles while
the host launches the next step (Lightning-AI/pytorch-lightning#21487). For a step of a
few milliseconds that is most of the cost of going from one GPU to several.

DeferredSigtermBroadcast keeps the agreement one step later instead (rank_zero_flag.py):
each step broadcasts rank 0's flag without waiting, the next step reads it, and every
rank that reads a set flag stops, all at the same step.
"""
import contextlib

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .rank_zero_flag import DeferredFlag


class DeferredSigtermBroadcast:
    """Called at the start of each training step in place of Lightning's per-step broadcast."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.flag = DeferredFlag(trainer.strategy.root_device)

    @property
    def pending(self) -> bool:
        """Whether a step's flag was broadcast and not yet read."""
        return self.flag.pending

    def __call__(self) -> None:
        if self.flag.read():
            with contextlib.suppress(Exception):
                dist.barrier()  # as Lightning: every rank reaches the exit together
            raise SIGTERMException()
        self.flag.post(bool(self.trainer.received_sigterm))


def defer_sigterm_broadcast(trainer) -> bool:
    """Puts a DeferredSigtermBroadcast in place of the training loop's per-step broadcast,
    where this Lightning has one (a new one each fit: nothing pending from an earlier fit);
    whether it did."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return False
    loop._broadcast_sigterm_tensor = DeferredSigtermBroadcast(trainer)
    return True
