"""The ranks' agreement on a SIGTERM, without making the host wait for the GPU every step.

Under several processes Lightning (2.6) broadcasts rank 0's SIGTERM flag at the start of
every training step and reads it back at once, so that every rank stops at the same step
when a pod is preempted (an early exit of one rank would leave the others hanging in a
collective). Reading the broadcast back makes the host wait for the device every step:
the queue of kernels the host keeps ahead of the GPU drains, and then the GPU idles while
the host launches the next step (Lightning-AI/pytorch-lightning#21487). For a step of a
few milliseconds that is most of the cost of going from one GPU to several.

DeferredSigtermBroadcast keeps the agreement one step later instead: each step broadcasts
rank 0's flag and copies it to pinned host memory without waiting; the next step reads
that copy (waiting, if at all, for the step before's broadcast, long done by then), and
every rank that reads a set flag stops, all at the same step.
"""
import contextlib

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException


class DeferredSigtermBroadcast:
    """Called at the start of each training step in place of Lightning's per-step broadcast."""

    def __init__(self, trainer):
        self.trainer = trainer
        device = trainer.strategy.root_device
        self.cuda = device.type == "cuda"
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)  # rank 0's, after the broadcast
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda)
        self.copied: torch.cuda.Event | None = None  # the last step's copy to self.host (CUDA)
        self.pending = False  # a broadcast made and not yet read

    def __call__(self) -> None:
        if self.pending:
            if self.copied is not None:
                self.copied.synchronize()
            if int(self.host[0]):
                with contextlib.suppress(Exception):
                    dist.barrier()  # as Lightning: every rank reaches the exit together
                raise SIGTERMException()
        self.flag.fill_(int(bool(self.trainer.received_sigterm)))
        dist.broadcast(self.flag, src=0)
        self.host.copy_(self.flag, non_blocking=self.cuda)
        if self.cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.pending = True


def defer_sigterm_broadcast(trainer) -> bool:
    """Puts a DeferredSigtermBroadcast in place of the training loop's per-step broadcast,
    where this Lightning has one (a new one each fit: nothing pending from an earlier fit);
    whether it did."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return False
    loop._broadcast_sigterm_tensor = DeferredSigtermBroadcast(trainer)
    return True
