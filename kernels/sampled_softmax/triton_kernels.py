"""The rows of a sampled softmax cross-entropy as Triton kernels: the twin in reference.py
states the computation.

A row's softmax leaves out the negatives whose id is its own. Such rows are few, and the
row kernels compare a program's rows with the negatives' ids only where one of its rows
may meet its id: `id_bitmap` first sets one bit for each negative's id (the top bits of
the id times an odd constant), about ID_BITS_PER_NEGATIVE bits a negative, so that a row
whose id has no negative finds its bit clear with a chance of about 1 - 1 /
ID_BITS_PER_NEGATIVE. A program whose rows all find their bit clear reads the logits
alone (comparing every pair's ids read 8 bytes of ids a logit and took most of the row
kernels' time: benchmarks/train_throughput.md, "The sampled softmax's rows in one pass").

Rows of up to MAX_WHOLE_ROW logits (`_softmax_whole_rows_kernel`): a program holds its
rows whole in registers, so each logit is read once and overwritten once with its
probability. Wider rows (`_softmax_wide_rows_kernel`), and the programs that compare
ids, walk the rows MAX_BLOCK_N columns at a time, twice: once for each row's running maximum
and sum of exponentials (an online softmax that starts from the positive's logit), once
to overwrite the logits (few enough rows a program that the programs running at once find
them in L2 on the second pass). The comparing path is kept apart from the whole rows': the
ids beside a whole row would double its registers.
"""
import torch
import triton
import triton.language as tl

from ..launch import cdiv, launch, next_power_of_2

MAX_WHOLE_ROW = 32768  # the widest rows a program holds whole (at most 32 warps of 32 logits a thread)
LOGITS_PER_THREAD = 32  # what sets a whole-row program's warps
THREADS_PER_WARP = 32
MAX_WARPS = 32
MAX_BLOCK_N = 1024  # logits columns per step where rows are walked
ROW_BLOCK_ELEMENTS = 4096  # rows × columns a program holds at least: narrow logits take more rows
WIDE_ROWS_PER_PROGRAM = 2  # rows a program walks where they are wider than MAX_WHOLE_ROW
ID_BITS_PER_NEGATIVE = 64  # the bitmap's size: a row without a hit finds its bit set about once in this many
MIN_ID_BITS = 1 << 10
MAX_ID_BITS = 1 << 27  # (16 MB: past 2²¹ negatives, more rows compare ids instead of a larger bitmap)
ID_MARK_BLOCK = 1024  # negatives' ids a program of id_bitmap marks
# (2⁶⁴ / golden ratio, odd, as a signed 64-bit integer): its product spreads ids over the top bits
ID_HASH_MULTIPLIER = -7046029254386353131
_ID_HASH_MULTIPLIER = tl.constexpr(ID_HASH_MULTIPLIER)
_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2(e))


@triton.jit
def _id_bit(ids, shift):
    """Each id's bit in the bitmap: the top 64 - shift bits of id × the multiplier."""
    return (ids * _ID_HASH_MULTIPLIER).to(tl.uint64, bitcast=True) >> shift


@triton.jit(do_not_specialize=["N"])
def _id_bitmap_kernel(key_ids_ptr, bitmap_ptr, N, shift, BLOCK: tl.constexpr):
    keys = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = keys < N
    bit = _id_bit(tl.load(key_ids_ptr + keys, mask=live, other=0), shift)
    tl.atomic_or(bitmap_ptr + (bit >> 5).to(tl.int64), (1 << (bit & 31)).to(tl.int32), mask=live, sem="relaxed")


def id_bitmap_shift(negatives: int) -> int:
    """The right shift of id_bitmap's hash: 64 - log2 of its bits (ID_BITS_PER_NEGATIVE a
    negative, between MIN_ID_BITS and MAX_ID_BITS)."""
    bits = min(MAX_ID_BITS, max(MIN_ID_BITS, next_power_of_2(max(negatives, 1)) * ID_BITS_PER_NEGATIVE))
    return 64 - bits.bit_length() + 1


def id_bitmap(key_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """(2^(64 - shift) / 32,) int32 words: bit b (word b // 32, bit b % 32) is set where b
    is some negative's id's bit (_id_bit)."""
    bitmap = torch.zeros(1 << (64 - shift - 5), dtype=torch.int32, device=key_ids.device)
    N = key_ids.shape[0]
    if N:
        launch(_id_bitmap_kernel, (cdiv(N, ID_MARK_BLOCK),), key_ids, bitmap, N, shift, BLOCK=ID_MARK_BLOCK)
    return bitmap


@triton.jit
def _rows(positive_ptr, row_ids_ptr, bitmap_ptr, P, shift, ROWS: tl.constexpr):
    """(this program's rows, which are below P, their positives' logits, their ids, whether
    any of them may meet its id among the negatives)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_live = rows < P
    positive = tl.load(positive_ptr + rows, mask=row_live, other=0.0)
    row_id = tl.load(row_ids_ptr + rows, mask=row_live, other=0)
    bit = _id_bit(row_id, shift)
    word = tl.load(bitmap_ptr + (bit >> 5).to(tl.int64), mask=row_live, other=0)
    return rows, row_live, positive, row_id, tl.max((word >> (bit & 31).to(tl.int32)) & 1, 0) != 0


@triton.jit
def _store_row_results(loss_ptr, dpositive_ptr, rows, row_live, positive, lse):
    tl.store(loss_ptr + rows, lse - positive, mask=row_live)
    tl.store(dpositive_ptr + rows, tl.exp2((positive - lse) * _LOG2E) - 1.0, mask=row_live)


@triton.jit
def _block(logits_ptr, key_ids_ptr, row_at, row_live, row_id, n0, N, COMPARE_IDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pointers to columns n0 .. n0 + BLOCK_N - 1 of the rows, which of them are in the
    logits, which pairs are in the softmax (all of them unless COMPARE_IDS), their logits as
    float32, -inf where not)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_live = cols < N
    live = row_live[:, None] & col_live[None, :]
    kept = live
    if COMPARE_IDS:
        ids = tl.load(key_ids_ptr + cols, mask=col_live, other=0)
        kept = live & (ids[None, :] != row_id[:, None])
    at = row_at[:, None] + cols[None, :]
    x = tl.load(at, mask=live, other=0.0).to(tl.float32)
    return at, live, kept, tl.where(kept, x, -float("inf"))


@triton.jit
def _walk_rows(
    logits_ptr, key_ids_ptr, loss_ptr, dpositive_ptr, rows, row_live, positive, row_id, N, stride,
    COMPARE_IDS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The softmax of the rows in two passes over their logits, BLOCK_N columns at a time."""
    row_at = logits_ptr + rows.to(tl.int64) * stride
    top = positive  # running maximum
    norm = tl.zeros_like(positive) + 1.0  # running sum of exp(logit - top), the positive's term included
    for n0 in range(0, N, BLOCK_N):
        _, _, _, x = _block(logits_ptr, key_ids_ptr, row_at, row_live, row_id, n0, N, COMPARE_IDS, BLOCK_N)
        new_top = tl.maximum(top, tl.max(x, 1))
        norm = norm * tl.exp2((top - new_top) * _LOG2E) + tl.sum(tl.exp2((x - new_top[:, None]) * _LOG2E), 1)
        top = new_top
    lse = top + tl.log(norm)
    _store_row_results(loss_ptr, dpositive_ptr, rows, row_live, positive, lse)
    for n0 in range(0, N, BLOCK_N):
        at, live, kept, x = _block(logits_ptr, key_ids_ptr, row_at, row_live, row_id, n0, N, COMPARE_IDS, BLOCK_N)
        probs = tl.where(kept, tl.exp2((x - lse[:, None]) * _LOG2E), 0.0)
        tl.store(at, probs.to(logits_ptr.dtype.element_ty), mask=live)


# P varies from call to call: not specialized
@triton.jit(do_not_specialize=["P"])
def _softmax_whole_rows_kernel(
    logits_ptr, positive_ptr, key_ids_ptr, row_ids_ptr, bitmap_ptr, loss_ptr, dpositive_ptr, P, N, stride, shift,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, WALK_N: tl.constexpr,
):
    rows, row_live, positive, row_id, may_meet = _rows(positive_ptr, row_ids_ptr, bitmap_ptr, P, shift, ROWS)
    if may_meet:
        _walk_rows(logits_ptr, key_ids_ptr, loss_ptr, dpositive_ptr, rows, row_live, positive, row_id, N, stride, True, WALK_N)
    else:
        cols = tl.arange(0, BLOCK_N)
        live = row_live[:, None] & (cols < N)[None, :]
        at = logits_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :]
        x = tl.load(at, mask=live, other=-float("inf")).to(tl.float32)
        top = tl.maximum(positive, tl.max(x, 1))
        e = tl.exp2((x - top[:, None]) * _LOG2E)  # 0 past the row
        norm = tl.exp2((positive - top) * _LOG2E) + tl.sum(e, 1)
        _store_row_results(loss_ptr, dpositive_ptr, rows, row_live, positive, top + tl.log(norm))
        tl.store(at, (e * (1.0 / norm)[:, None]).to(logits_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["P"])
def _softmax_wide_rows_kernel(
    logits_ptr, positive_ptr, key_ids_ptr, row_ids_ptr, bitmap_ptr, loss_ptr, dpositive_ptr, P, N, stride, shift,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, row_live, positive, row_id, may_meet = _rows(positive_ptr, row_ids_ptr, bitmap_ptr, P, shift, ROWS)
    if may_meet:
        _walk_rows(logits_ptr, key_ids_ptr, loss_ptr, dpositive_ptr, rows, row_live, positive, row_id, N, stride, True, BLOCK_N)
    else:
        _walk_rows(logits_ptr, key_ids_ptr, loss_ptr, dpositive_ptr, rows, row_live, positive, row_id, N, stride, False, BLOCK_N)


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
    if not P:
        return loss, dpositive
    key_ids, row_ids = key_ids.contiguous(), row_ids.contiguous()
    shift = id_bitmap_shift(N)
    bitmap = id_bitmap(key_ids, shift)
    args = (logits, positive.float().contiguous(), key_ids, row_ids, bitmap, loss, dpositive, P, N, logits.stride(0), shift)
    block_n = max(16, next_power_of_2(N))
    if block_n <= MAX_WHOLE_ROW:
        rows = max(1, ROW_BLOCK_ELEMENTS // block_n)
        warps = min(MAX_WARPS, max(1, rows * block_n // (LOGITS_PER_THREAD * THREADS_PER_WARP)))
        launch(_softmax_whole_rows_kernel, (cdiv(P, rows),), *args, ROWS=rows, BLOCK_N=block_n,
               WALK_N=min(block_n, MAX_BLOCK_N), num_warps=warps)
    else:
        rows = WIDE_ROWS_PER_PROGRAM
        launch(_softmax_wide_rows_kernel, (cdiv(P, rows),), *args, ROWS=rows, BLOCK_N=MAX_BLOCK_N)
    return loss, dpositive
