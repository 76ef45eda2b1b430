"""The rows of a sampled softmax cross-entropy as a Triton kernel: the twin in reference.py
states the computation.

A program takes ROWS rows and walks their logits BLOCK_N columns at a time, twice: once
for each row's running maximum and sum of exponentials (an online softmax that starts
from the positive's logit), once to overwrite the logits with the probabilities (0 where
a negative's id is the row's own). The negatives' ids are read once per block for all of
a program's rows. Two passes over logits of 2 bytes each cost a (P, N) tensor three
memory passes, where the PyTorch formulation (mask, concatenate, log-softmax and their
backward in float32) makes a dozen.
"""
import torch
import triton
import triton.language as tl

from ..launch import cdiv, launch, next_power_of_2

MAX_BLOCK_N = 1024  # logits columns per step
ROW_BLOCK_ELEMENTS = 4096  # rows × columns a program holds: narrow logits take more rows
# rows a program walks where they are wider than a block: few enough that the programs
# running at once find their rows in L2 on the second pass (benchmarks/train_throughput.md,
# "where the host's time goes, sampled")
WIDE_ROWS_PER_PROGRAM = 2
_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2(e))


@triton.jit
def _block(logits_ptr, key_ids_ptr, row_at, row_id, row_live, n0, N, BLOCK_N: tl.constexpr):
    """(pointers to columns n0 .. n0 + BLOCK_N - 1 of the rows, which columns are below N,
    which pairs are in the softmax, their logits as float32, -inf where not)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_live = cols < N
    ids = tl.load(key_ids_ptr + cols, mask=col_live, other=0)
    kept = row_live[:, None] & col_live[None, :] & (ids[None, :] != row_id[:, None])
    at = row_at[:, None] + cols[None, :]
    # (loaded by rows and columns, the row's own id masked after: a mask per pair is not
    # constant over a vector, which makes one 2-byte load per logit)
    x = tl.load(at, mask=row_live[:, None] & col_live[None, :], other=0.0).to(tl.float32)
    return at, col_live, kept, tl.where(kept, x, -float("inf"))


# P varies from call to call: not specialized
@triton.jit(do_not_specialize=["P"])
def _softmax_rows_kernel(
    logits_ptr, positive_ptr, key_ids_ptr, row_ids_ptr, loss_ptr, dpositive_ptr, P, N, stride,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_live = rows < P
    positive = tl.load(positive_ptr + rows, mask=row_live, other=0.0)
    row_id = tl.load(row_ids_ptr + rows, mask=row_live, other=0)
    row_at = logits_ptr + rows.to(tl.int64) * stride
    top = positive  # running maximum
    norm = tl.full([ROWS], 1.0, tl.float32)  # running sum of exp(logit - top), the positive's term included
    for n0 in range(0, N, BLOCK_N):
        _, _, _, x = _block(logits_ptr, key_ids_ptr, row_at, row_id, row_live, n0, N, BLOCK_N)
        new_top = tl.maximum(top, tl.max(x, 1))
        norm = norm * tl.exp2((top - new_top) * _LOG2E) + tl.sum(tl.exp2((x - new_top[:, None]) * _LOG2E), 1)
        top = new_top
    lse = top + tl.log(norm)
    tl.store(loss_ptr + rows, lse - positive, mask=row_live)
    tl.store(dpositive_ptr + rows, tl.exp2((positive - lse) * _LOG2E) - 1.0, mask=row_live)
    for n0 in range(0, N, BLOCK_N):
        at, col_live, kept, x = _block(logits_ptr, key_ids_ptr, row_at, row_id, row_live, n0, N, BLOCK_N)
        probs = tl.where(kept, tl.exp2((x - lse[:, None]) * _LOG2E), 0.0)
        tl.store(at, probs.to(logits_ptr.dtype.element_ty), mask=row_live[:, None] & col_live[None, :])


def softmax_rows(
    logits: torch.Tensor, positive: torch.Tensor, key_ids: torch.Tensor, row_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's loss, the gradient of the summed losses by each positive), float32 (P,);
    logits (P, N) (rows contiguous) become the gradient by them, in their dtype."""
    P, N = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("softmax_rows: the logits' rows must be contiguous")
    loss = torch.empty(P, dtype=torch.float32, device=logits.device)
    dpositive = torch.empty_like(loss)
    if P:
        block_n = min(MAX_BLOCK_N, max(16, next_power_of_2(N)))
        rows = WIDE_ROWS_PER_PROGRAM if N > MAX_BLOCK_N else max(1, ROW_BLOCK_ELEMENTS // block_n)
        launch(
            _softmax_rows_kernel, (cdiv(P, rows),), logits, positive.float().contiguous(), key_ids.contiguous(),
            row_ids.contiguous(), loss, dpositive, P, N, logits.stride(0), ROWS=rows, BLOCK_N=block_n,
        )
    return loss, dpositive
