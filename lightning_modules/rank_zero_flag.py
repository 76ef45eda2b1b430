"""Rank 0's yes or no, taken by every rank one call later, without the host waiting for the
device at each call.

Under several processes some decisions are made on rank 0's host (a SIGTERM received, its
clock saying a checkpoint is due), and every rank must act on them at the same step: a
rank that acts alone waits in a collective the others never make. Broadcasting the value
and reading it back at once makes the host wait for the GPU at every call: the queue of
kernels the host keeps ahead of the GPU drains, and the GPU then idles while the host
launches the next step. DeferredFlag broadcasts each call's value and copies it to pinned
host memory without waiting; the next call reads that copy (waiting, if at all, for the
call before's broadcast, long done by then). Every rank reads the same value at the same
call.
"""
import torch
import torch.distributed as dist


class DeferredFlag:
    """post(value) sends rank 0's value; read() gives the value the last post sent, the same
    on every rank (False before any). Both are collectives in effect: every rank makes the
    same calls in the same order."""

    def __init__(self, device: torch.device, group=None):
        self.group = group
        self.cuda = device.type == "cuda"
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)  # rank 0's, after the broadcast
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda)
        self.copied: torch.cuda.Event | None = None  # the last post's copy to self.host (CUDA)
        self.pending = False  # a post made and not yet read

    def read(self) -> bool:
        if not self.pending:
            return False
        if self.copied is not None:
            self.copied.synchronize()
        self.pending = False
        return bool(self.host[0])

    def post(self, value: bool) -> None:
        self.flag.fill_(int(value))
        dist.broadcast(self.flag, src=0, group=self.group)
        self.host.copy_(self.flag, non_blocking=self.cuda)
        if self.cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.pending = True
