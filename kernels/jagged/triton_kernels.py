"""Jagged tensor ops as Triton kernels, each with the signature of its twin in reference.py.

One program per sequence (a grid of B: no lengths are read on the host), stepping through
its rows BLOCK_ROWS at a time and through their columns BLOCK_COLS at a time. The pairs of
ops that undo each other share a kernel, run one way or the other (TO_PADDED, SPLIT).
"""
import torch
import triton
import triton.language as tl

from ..launch import launch, next_power_of_2

BLOCK_ROWS = 16
MAX_BLOCK_COLS = 128
WARPS = 4


def _block_cols(dim: int) -> int:
    return min(MAX_BLOCK_COLS, next_power_of_2(max(dim, 1)))


@triton.jit(do_not_specialize=["n"])  # a batch's sequences, which change from batch to batch
def _lengths_to_offsets_kernel(lengths_ptr, offsets_ptr, n, BLOCK: tl.constexpr):
    """offsets[0] = 0, offsets[i + 1] = lengths[0] + ... + lengths[i]; one program."""
    tl.store(offsets_ptr, tl.zeros([], dtype=tl.int64))
    carry = tl.zeros([], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        lengths = tl.load(lengths_ptr + i, mask=i < n, other=0).to(tl.int64)
        tl.store(offsets_ptr + 1 + i, carry + tl.cumsum(lengths, axis=0), mask=i < n)
        carry += tl.sum(lengths, axis=0)


@triton.jit(do_not_specialize=["max_len"])  # a batch's longest length, which changes from batch to batch
def _padded_kernel(
    values_ptr, offsets_ptr, padded_ptr, max_len, dim, padding_value,
    TO_PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """TO_PADDED: padded[b, j] = values[offsets[b] + j] for j < length, padding_value for
    length <= j < max_len. Else values[offsets[b] + j] = padded[b, j] for j < max_len and 0
    for max_len <= j < length."""
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + b)
    length = tl.load(offsets_ptr + b + 1) - start
    span = max_len if TO_PADDED else length
    for r in range(0, span, BLOCK_ROWS):
        j = r + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        stored = j < length
        in_padded = j < max_len
        for c in range(0, dim, BLOCK_COLS):
            cols = c + tl.arange(0, BLOCK_COLS)
            in_row = cols[None, :] < dim
            jagged = values_ptr + (start + j)[:, None] * dim + cols[None, :]
            square = padded_ptr + (b * max_len + j)[:, None] * dim + cols[None, :]
            if TO_PADDED:
                x = tl.load(jagged, mask=(stored & in_padded)[:, None] & in_row, other=padding_value)
                tl.store(square, x, mask=in_padded[:, None] & in_row)
            else:
                x = tl.load(square, mask=(stored & in_padded)[:, None] & in_row, other=0)
                tl.store(jagged, x, mask=stored[:, None] & in_row)


@triton.jit
def _concat_kernel(
    a_ptr, a_offsets_ptr, b_ptr, b_offsets_ptr, out_ptr, dim,
    SPLIT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Sequence s of out is a's sequence s then b's: rows move into out, or (SPLIT) back out
    of it into a and b."""
    s = tl.program_id(0).to(tl.int64)
    a_start = tl.load(a_offsets_ptr + s)
    a_length = tl.load(a_offsets_ptr + s + 1) - a_start
    b_start = tl.load(b_offsets_ptr + s)
    b_length = tl.load(b_offsets_ptr + s + 1) - b_start
    out_start = a_start + b_start
    for r in range(0, a_length + b_length, BLOCK_ROWS):
        j = r + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        from_a = j < a_length
        live = j < a_length + b_length
        part = tl.where(from_a, a_start + j, b_start + j - a_length)
        for c in range(0, dim, BLOCK_COLS):
            cols = c + tl.arange(0, BLOCK_COLS)
            in_row = cols[None, :] < dim
            a_rows = a_ptr + part[:, None] * dim + cols[None, :]
            b_rows = b_ptr + part[:, None] * dim + cols[None, :]
            out_rows = out_ptr + (out_start + j)[:, None] * dim + cols[None, :]
            if SPLIT:
                x = tl.load(out_rows, mask=live[:, None] & in_row)
                tl.store(a_rows, x, mask=from_a[:, None] & in_row)
                tl.store(b_rows, x, mask=(live & ~from_a)[:, None] & in_row)
            else:
                x = tl.load(a_rows, mask=from_a[:, None] & in_row, other=0)
                x += tl.load(b_rows, mask=(live & ~from_a)[:, None] & in_row, other=0)
                tl.store(out_rows, x, mask=live[:, None] & in_row)


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    n = lengths.numel()
    offsets = torch.empty(n + 1, dtype=torch.int64, device=lengths.device)
    launch(_lengths_to_offsets_kernel, (1,), lengths.contiguous(), offsets, n, BLOCK=1024)
    return offsets


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0.0) -> torch.Tensor:
    values, dim = values.contiguous(), values.shape[1]
    padded = values.new_empty((offsets.numel() - 1, max_len, dim))
    if padded.numel():
        launch(
            _padded_kernel, (padded.shape[0],), values, offsets.contiguous(), padded, max_len, dim, float(padding_value),
            TO_PADDED=True, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=_block_cols(dim), num_warps=WARPS,
        )
    return padded


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    if total is None:
        total = int(offsets[-1])
    padded, dim = padded.contiguous(), padded.shape[2]
    values = padded.new_empty((total, dim))
    if values.numel():
        launch(
            _padded_kernel, (padded.shape[0],), values, offsets.contiguous(), padded, padded.shape[1], dim, 0.0,
            TO_PADDED=False, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=_block_cols(dim), num_warps=WARPS,
        )
    return values


def jagged_concat(
    a_values: torch.Tensor, a_offsets: torch.Tensor, b_values: torch.Tensor, b_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dim = a_values.shape[1]
    a_values, b_values = a_values.contiguous(), b_values.contiguous()
    out = a_values.new_empty((a_values.shape[0] + b_values.shape[0], dim))
    a_offsets, b_offsets = a_offsets.contiguous(), b_offsets.contiguous()
    if out.numel():
        launch(
            _concat_kernel, (a_offsets.numel() - 1,), a_values, a_offsets, b_values, b_offsets, out, dim,
            SPLIT=False, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=_block_cols(dim), num_warps=WARPS,
        )
    return out, a_offsets + b_offsets


def jagged_split(
    values: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor, a_total: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if a_total is None:
        a_total = int(a_offsets[-1])
    values, dim = values.contiguous(), values.shape[1]
    a_values = values.new_empty((a_total, dim))
    b_values = values.new_empty((values.shape[0] - a_total, dim))
    if values.numel():
        launch(
            _concat_kernel, (a_offsets.numel() - 1,), a_values, a_offsets.contiguous(), b_values, b_offsets.contiguous(),
            values, dim, SPLIT=True, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=_block_cols(dim), num_warps=WARPS,
        )
    return a_values, b_values
