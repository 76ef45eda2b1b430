"""A jagged batch padded to a row count, its padding rows sequences of their own.

Two users: CUDA graphs, whose shapes are fixed (cuda_graphs.py pads each batch up to a
bucket), and the eager training step on a GPU, which pads each batch's rows up to a
multiple of HSTUConfig.row_multiple: cuBLAS chooses a kernel per matrix shape, and a row
count it has not seen costs the host up to milliseconds in that choice (a jagged batch's
total changes every step), while the multiples are few and soon all seen
(benchmarks/train_throughput.md). No real row attends to a padding row; the loss leaves
the padding rows out (losses.py), so they pass no gradient.
"""
import math

import torch
import torch.nn.functional as F


def pad_jagged(
    x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, rows: int, batch_slots: int, max_seq_len: int,
    pad_sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A jagged batch (x (P, D), timestamps (P,), offsets (B + 1,)) padded to `rows` rows
    and batch_slots + pad_sequences sequences (by default ceil(rows / max_seq_len), which
    depends on the shapes alone): the B sequences, then empty ones up to batch_slots, then
    the padding rows (zeros, timestamp 0) in sequences of at most max_seq_len rows (empty
    ones at the end). The offsets added are made on the host and copied without waiting
    (the host reads nothing back)."""
    P, B = x.shape[0], offsets.numel() - 1
    pad_sequences = math.ceil(rows / max_seq_len) if pad_sequences is None else pad_sequences
    if P > rows or B > batch_slots or rows - P > pad_sequences * max_seq_len:
        raise ValueError(
            f"a batch of {B} sequences and {P} rows does not fit {batch_slots} sequences of {rows} rows"
            f" with {pad_sequences} padding sequences"
        )
    # the first batch_slots - B offsets after the batch's stay at P (empty sequences), then
    # each grows by max_seq_len until it reaches `rows`
    tail = [min(rows, P + max_seq_len * max(0, k - (batch_slots - B))) for k in range(1, batch_slots - B + pad_sequences + 1)]
    tail = torch.tensor(tail, dtype=offsets.dtype).to(offsets.device, non_blocking=True)  # (pageable: staged before it returns)
    return F.pad(x, (0, 0, 0, rows - P)), F.pad(timestamps, (0, rows - P)), torch.cat([offsets, tail])


def pad_to_multiple(
    x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, multiple: int, max_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pad_jagged up to the next multiple of `multiple` rows, with as few padding sequences
    as those rows need (none where the batch's rows are a multiple already)."""
    P, B = x.shape[0], offsets.numel() - 1
    rows = math.ceil(P / multiple) * multiple
    if rows == P:
        return x, timestamps, offsets
    return pad_jagged(x, timestamps, offsets, rows, B, max_seq_len, pad_sequences=math.ceil((rows - P) / max_seq_len))
