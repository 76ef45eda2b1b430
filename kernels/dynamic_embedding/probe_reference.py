"""The probe (probe_kernels.probe) in plain PyTorch: probe_reference has probe's signature
and is its twin in the differential tests (tests/test_probe_kernels.py).

It reads each table of the stack as tensors (keys, scores, values) and takes a table's
bucket count from its keys, where the kernel reads descriptors, and compares whole keys
where the kernel compares one-byte digests first: a stale digest, a wrong bucket mask or
a row stride that is not the table's shows as a difference. Nothing here calls a kernel
or shares a helper with one.
"""
import torch

from .hashing import EMPTY_KEY, bucket_of


def probe_reference(
    stack, keys: torch.Tensor, bucket_size: int, row_stride: int, tids: torch.Tensor | None = None,
    out: torch.Tensor | None = None, count: torch.Tensor | None = None, found_only: bool = False,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """probe's result: key i's slot in table tids[i] (or table 0), -1 if absent (the
    reserved key never found), or whether it is found; out's first d values of found rows
    written, other rows left; scores: stored scores, 0 where absent. Only the first
    `count` keys where count is given (the rest of the outputs left as they are)."""
    n = keys.numel()
    slots = torch.empty(n, dtype=torch.bool if found_only else torch.int64, device=keys.device)
    live = n if count is None else int(count.reshape(-1)[0])
    table_of = tids[:live].to(torch.int64) if tids is not None else torch.zeros(live, dtype=torch.int64, device=keys.device)
    slot = torch.full((live,), -1, dtype=torch.int64, device=keys.device)
    for t, table in enumerate(stack.tables):
        lanes = torch.nonzero(table_of == t).squeeze(1)
        k = keys[lanes]
        num_buckets = table.keys.numel() // bucket_size
        bucket = bucket_of(k, num_buckets)
        match = (table.keys.view(num_buckets, bucket_size)[bucket] == k[:, None]) & (k != EMPTY_KEY)[:, None]
        found = match.any(1)
        at = bucket * bucket_size + match.to(torch.int8).argmax(1)  # the lowest matching column
        slot[lanes] = torch.where(found, at, -1)
        if scores is not None:
            scores[lanes] = torch.where(found, table.scores[at], 0)
        if out is not None:
            out[lanes[found]] = table.values[at[found], : out.shape[1]]
    slots[:live] = slot >= 0 if found_only else slot
    return slots
