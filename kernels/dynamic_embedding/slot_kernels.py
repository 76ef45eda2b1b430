"""Triton kernels on a hash table's slots and rows outside the claim: the deterministic
mode's placement (choose slots reading only, then write them), releasing slots, counting
and exporting rows, copying rows between tables and buffers, and gathering a claim's
victims. Each is called through a launcher here, whose PyTorch
twin of the same signature is in slot_reference.py (tests/test_slot_kernels.py holds
them together).
"""
import torch
import triton
import triton.language as tl

from ..launch import launch, next_power_of_2
from .claim_kernels import PLACE_BLOCK
from .probe_kernels import FIND_BLOCK, FIND_WARPS, K_ABOVE_ALL, K_EMPTY_KEY, _digest, _grid, _hash


@triton.jit(do_not_specialize=["call", "n"])
def _choose_slots_kernel(
    bucket_ptr, rank_ptr, new_score_ptr, n, table_keys_ptr, digests_ptr, scores_ptr, marks_ptr, call,
    slot_ptr, victim_key_ptr, victim_score_ptr, victim_flag_ptr,
    BUCKET: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr,
):
    """Read-only: the slot for each new key. The r-th new key of a bucket takes the bucket's
    r-th free slot; past the free slots (EVICT) it takes the (r - free)-th lowest
    (score, slot) among occupied, unprotected slots, if that score is <= its own."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    bucket = tl.load(bucket_ptr + offs, mask=live, other=0)
    rank = tl.load(rank_ptr + offs, mask=live, other=0)
    slots = bucket[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    free = (tl.load(digests_ptr + slots, mask=live[:, None], other=1) == 0) & live[:, None]
    n_free = tl.sum(free.to(tl.int64), axis=1)
    nth_free = free & (tl.cumsum(free.to(tl.int64), axis=1) == (rank + 1)[:, None])
    slot = tl.where(rank < n_free, tl.sum(tl.where(nth_free, slots, 0), axis=1), -1)
    victim_key = tl.full([BLOCK], 0, tl.int64)
    victim_score = tl.full([BLOCK], 0, tl.int64)
    if EVICT:
        over = live & (rank >= n_free)
        nth = tl.where(over, rank - n_free, -1)
        protected = tl.load(marks_ptr + slots, mask=live[:, None], other=call) == call
        scores = tl.load(scores_ptr + slots, mask=live[:, None], other=0)
        cand = over[:, None] & ~free & ~protected
        pick = tl.full([BLOCK], -1, tl.int64)
        pick_score = tl.full([BLOCK], 0, tl.int64)
        # remove the lowest (score, slot) candidate nth + 1 times; the last removed is the victim
        for it in range(0, tl.max(nth, axis=0) + 1):
            best = tl.min(tl.where(cand, scores, K_ABOVE_ALL), axis=1)
            at_best = cand & (scores == best[:, None])
            first = tl.min(tl.where(at_best, slots, K_ABOVE_ALL), axis=1)
            any_left = tl.max(cand.to(tl.int32), axis=1) > 0
            take = (it <= nth) & any_left
            pick = tl.where(take, first, tl.where(it <= nth, -1, pick))
            pick_score = tl.where(take, best, pick_score)
            cand = cand & ~(take[:, None] & (slots == first[:, None]))
        new_score = tl.load(new_score_ptr + offs, mask=live, other=0)
        ok = over & (pick >= 0) & (pick_score <= new_score)
        victim_key = tl.load(table_keys_ptr + pick, mask=ok, other=0)
        victim_score = pick_score
        slot = tl.where(ok, pick, slot)
    tl.store(slot_ptr + offs, slot, mask=live)
    if EVICT:
        tl.store(victim_key_ptr + offs, victim_key, mask=live)
        tl.store(victim_score_ptr + offs, victim_score, mask=live)
        tl.store(victim_flag_ptr + offs, ok.to(tl.int8), mask=live)


@triton.jit(do_not_specialize=["n"])  # n changes from call to call (multi_table_kernels.py)
def _write_slots_kernel(slot_ptr, key_ptr, score_ptr, n, table_keys_ptr, scores_ptr, digests_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + offs, mask=offs < n, other=-1)
    ok = (offs < n) & (slot >= 0)
    key = tl.load(key_ptr + offs, mask=ok, other=0)
    tl.store(table_keys_ptr + slot, key, mask=ok)
    tl.store(scores_ptr + slot, tl.load(score_ptr + offs, mask=ok, other=0), mask=ok)
    tl.store(digests_ptr + slot, _digest(_hash(key)), mask=ok)


@triton.jit
def _count_kernel(table_keys_ptr, scores_ptr, capacity, min_score, counts_ptr, BLOCK: tl.constexpr, FILTER: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < capacity
    keep = live & (tl.load(table_keys_ptr + offs, mask=live, other=0) != K_EMPTY_KEY)
    if FILTER:
        keep = keep & (tl.load(scores_ptr + offs, mask=live, other=0) >= min_score)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(keep.to(tl.int64), axis=0))


@triton.jit
def _export_kernel(
    table_keys_ptr, scores_ptr, values_ptr, capacity, min_score, starts_ptr,
    out_keys_ptr, out_values_ptr, out_scores_ptr, row_dim, row_stride,
    BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, FILTER: tl.constexpr,
):
    """Copies kept rows of a block of slots to out, at the block's start plus the row's
    rank among kept rows: slot order, as the reference."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < capacity
    key = tl.load(table_keys_ptr + offs, mask=live, other=0)
    score = tl.load(scores_ptr + offs, mask=live, other=0)
    keep = live & (key != K_EMPTY_KEY)
    if FILTER:
        keep = keep & (score >= min_score)
    dest = tl.load(starts_ptr + tl.program_id(0)) + tl.cumsum(keep.to(tl.int64), axis=0) - 1
    tl.store(out_keys_ptr + dest, key, mask=keep)
    tl.store(out_scores_ptr + dest, score, mask=keep)
    for c in range(0, row_dim, DIM_BLOCK):
        cols = c + tl.arange(0, DIM_BLOCK)
        m = keep[:, None] & (cols[None, :] < row_dim)
        row = tl.load(values_ptr + offs[:, None].to(tl.int64) * row_stride + cols[None, :], mask=m)
        tl.store(out_values_ptr + dest[:, None] * row_dim + cols[None, :], row, mask=m)


@triton.jit(do_not_specialize=["n"])  # n changes from call to call (multi_table_kernels.py)
def _release_slots_kernel(slot_ptr, n, keys_ptr, scores_ptr, digests_ptr, BLOCK: tl.constexpr):
    """Empties the slots given (those >= 0): key, score and digest."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + lanes, mask=lanes < n, other=-1)
    ok = slot >= 0
    tl.store(keys_ptr + slot, tl.full([BLOCK], K_EMPTY_KEY, tl.int64), mask=ok)
    tl.store(scores_ptr + slot, tl.zeros([BLOCK], tl.int64), mask=ok)
    tl.store(digests_ptr + slot, tl.zeros([BLOCK], tl.uint8), mask=ok)


@triton.jit(do_not_specialize=["n"])  # n changes from call to call (multi_table_kernels.py)
def _copy_rows_kernel(
    src_ptr, src_slot_ptr, src_stride, dst_ptr, dst_slot_ptr, dst_stride, n, width, marks_ptr,
    SRC_SLOTS: tl.constexpr, DST_SLOTS: tl.constexpr, WHOLE: tl.constexpr, ELECT: tl.constexpr, BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
):
    """dst[dst_slot[i]] = src[src_slot[i]][:width] for lanes whose slots are both >= 0 (a
    side without slots is addressed by lane). WHOLE: destination rows are written whole,
    up to dst_stride, with zeros past width. ELECT: of the lanes with one destination slot,
    the first to swap its mark (marks_ptr, by slot; a claim has just set it) to -1 writes
    the row alone: copies writing at once would leave a row of mixed columns."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lanes < n
    src = lanes.to(tl.int64)
    dst = lanes.to(tl.int64)
    if SRC_SLOTS:
        src = tl.load(src_slot_ptr + lanes, mask=live, other=-1)
    if DST_SLOTS:
        dst = tl.load(dst_slot_ptr + lanes, mask=live, other=-1)
    live = live & (src >= 0) & (dst >= 0)
    if ELECT:
        live = live & (tl.atomic_xchg(marks_ptr + dst, tl.full([BLOCK], -1, tl.int32), mask=live, sem="relaxed") != -1)
    end = width
    if WHOLE:
        end = dst_stride
    for c in range(0, end, DIM_BLOCK):
        cols = c + tl.arange(0, DIM_BLOCK)
        row = tl.load(src_ptr + src[:, None] * src_stride + cols[None, :], mask=live[:, None] & (cols[None, :] < width), other=0)
        tl.store(dst_ptr + dst[:, None] * dst_stride + cols[None, :], row, mask=live[:, None] & (cols[None, :] < end))


@triton.jit(do_not_specialize=["n"])  # n changes from call to call (multi_table_kernels.py)
def _gather_victims_kernel(
    evicted_ptr, slot_ptr, victim_key_ptr, victim_score_ptr, values_ptr, row_stride, n, row_dim,
    out_key_ptr, out_score_ptr, out_row_ptr, count_ptr, BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    """For the lanes of a block whose slot held a victim (evicted): one atomic add on the
    count reserves the block's run of entries, which take the victims' keys, scores and
    rows (values[slot], still the victim's) in lane order."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lanes < n
    ev = live & (tl.load(evicted_ptr + lanes, mask=live, other=0) != 0)
    many = tl.sum(ev.to(tl.int64), axis=0)
    if many > 0:
        at = tl.atomic_add(count_ptr, many, sem="relaxed") + tl.cumsum(ev.to(tl.int64), axis=0) - 1
        tl.store(out_key_ptr + at, tl.load(victim_key_ptr + lanes, mask=ev, other=0), mask=ev)
        tl.store(out_score_ptr + at, tl.load(victim_score_ptr + lanes, mask=ev, other=0), mask=ev)
        slot = tl.load(slot_ptr + lanes, mask=ev, other=0)
        for c in range(0, row_dim, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            m = ev[:, None] & (cols[None, :] < row_dim)
            row = tl.load(values_ptr + slot[:, None] * row_stride + cols[None, :], mask=m)
            tl.store(out_row_ptr + at[:, None] * row_dim + cols[None, :], row, mask=m)


# ---- launchers (twins: slot_reference.py) --------------------------------------------------

RELEASE_BLOCK = 256  # slots per program of release_slots
EXPORT_BLOCK = 256  # slots per program of count_rows and export_rows
VICTIM_BLOCK = 256  # lanes per program of gather_victims: one atomic add per program


def release_slots(slots: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor, digests: torch.Tensor) -> None:
    """Empties a table's slots given (those >= 0; the others are skipped): key, score and
    digest."""
    n = slots.numel()
    if n:
        launch(_release_slots_kernel, _grid(n, RELEASE_BLOCK), slots, n, keys, scores, digests, BLOCK=RELEASE_BLOCK)


def choose_slots(
    buckets: torch.Tensor, ranks: torch.Tensor, new_scores: torch.Tensor, keys: torch.Tensor, digests: torch.Tensor,
    scores: torch.Tensor, marks: torch.Tensor, call: int, bucket_size: int, evict: bool,
):
    """Deterministic placement, reading only: for M new keys (their bucket, their rank
    among the call's new keys of that bucket, their scores), the slot each takes: the
    bucket's rank-th free slot; past the free ones (evict) the (rank - free)-th lowest
    (score, slot) of the bucket's occupied rows not marked with `call`, where that score
    is at most the key's own; else -1. Returns (slots, victim_keys, victim_scores,
    victims) with evict (victims: int8, 1 where the slot held a row), else (slots, None,
    None, None)."""
    m = buckets.numel()
    slots = torch.empty(m, dtype=torch.int64, device=buckets.device)
    victim_keys = victim_scores = victims = None
    if evict:
        victim_keys, victim_scores = torch.empty_like(slots), torch.empty_like(slots)
        victims = torch.empty(m, dtype=torch.int8, device=buckets.device)
    if m:
        launch(
            _choose_slots_kernel, _grid(m, PLACE_BLOCK),
            buckets, ranks, new_scores, m, keys, digests, scores, marks, call, slots,
            *((victim_keys, victim_scores, victims) if evict else (slots, slots, slots)),
            BUCKET=bucket_size, BLOCK=PLACE_BLOCK, EVICT=evict,
        )
    return slots, victim_keys, victim_scores, victims


def write_slots(
    slots: torch.Tensor, new_keys: torch.Tensor, new_scores: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor,
    digests: torch.Tensor,
) -> None:
    """Stores new keys with their scores and digests at their slots (those >= 0)."""
    m = slots.numel()
    if m:
        launch(_write_slots_kernel, _grid(m, FIND_BLOCK), slots, new_keys, new_scores, m, keys, scores, digests, BLOCK=FIND_BLOCK)


def count_rows(keys: torch.Tensor, scores: torch.Tensor, min_score: int | None) -> tuple[torch.Tensor, int]:
    """(where each block of EXPORT_BLOCK slots starts in an export, the rows exported): the
    stored rows, or those whose score is at least min_score. Reads the total (a wait)."""
    n_blocks = _grid(keys.numel(), EXPORT_BLOCK)[0]
    counts = torch.empty(n_blocks, dtype=torch.int64, device=keys.device)
    launch(
        _count_kernel, (n_blocks,), keys, scores, keys.numel(), 0 if min_score is None else int(min_score), counts,
        BLOCK=EXPORT_BLOCK, FILTER=min_score is not None,
    )
    return torch.cumsum(counts, 0) - counts, int(counts.sum())


def export_rows(
    keys: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, min_score: int | None, starts: torch.Tensor,
    out_keys: torch.Tensor, out_values: torch.Tensor, out_scores: torch.Tensor,
) -> None:
    """Copies the rows count_rows counted, in slot order, to the outputs (values: (slots,
    row_dim) with unit column stride)."""
    if out_keys.numel():
        row_dim = out_values.shape[1]
        launch(
            _export_kernel, (starts.numel(),),
            keys, scores, values, keys.numel(), 0 if min_score is None else int(min_score), starts, out_keys, out_values,
            out_scores, row_dim, values.stride(0),
            BLOCK=EXPORT_BLOCK, DIM_BLOCK=min(64, next_power_of_2(row_dim)), FILTER=min_score is not None,
        )


def copy_rows(
    src: torch.Tensor, src_slots: torch.Tensor | None, dst: torch.Tensor, dst_slots: torch.Tensor | None, width: int,
    whole_rows: bool = False, marks: torch.Tensor | None = None,
) -> None:
    """dst[dst_slots[i], :width] = src[src_slots[i], :width] where both slots are >= 0
    (None: lane i). src and dst: 2-D with unit column stride (table storage or buffers).
    whole_rows: write each destination row up to its stride, zeros past width; for host
    memory, where a write ending inside a 64-byte line is a partial one over PCIe, many
    times slower than whole lines. marks: a table's
    marks, those of dst_slots set by a claim: one lane per destination slot writes (see
    _copy_rows_kernel)."""
    n = (src_slots if src_slots is not None else dst_slots).numel()
    if n == 0:
        return
    launch(
        _copy_rows_kernel, _grid(n, FIND_BLOCK),
        src, src_slots if src_slots is not None else src, src.stride(0), dst, dst_slots if dst_slots is not None else dst,
        dst.stride(0), n, width, marks if marks is not None else dst, SRC_SLOTS=src_slots is not None,
        DST_SLOTS=dst_slots is not None, WHOLE=whole_rows, ELECT=marks is not None, BLOCK=FIND_BLOCK,
        DIM_BLOCK=min(128, next_power_of_2(dst.stride(0))), num_warps=FIND_WARPS,
    )


def gather_victims(
    evicted: torch.Tensor, slots: torch.Tensor, victim_keys: torch.Tensor, victim_scores: torch.Tensor, values: torch.Tensor,
    out_keys: torch.Tensor, out_scores: torch.Tensor, out_rows: torch.Tensor, count: torch.Tensor,
) -> None:
    """Appends the victims of a claim's lanes (evicted (N,) bool; slots, victim_keys,
    victim_scores (N,) as claim returns them) to out_keys, out_scores and out_rows (the
    victims' rows of values, (capacity, row_dim) with unit column stride) from entry
    count[0] on, and adds their number to count (a (1,) int64). Blocks of lanes take
    their entries in the order they reach the count; a block's victims are in lane order.
    No wait for the GPU."""
    n = evicted.numel()
    if n == 0:
        return
    row_dim = out_rows.shape[1]
    launch(
        _gather_victims_kernel, _grid(n, VICTIM_BLOCK),
        evicted.view(torch.int8), slots, victim_keys, victim_scores, values, values.stride(0), n, row_dim,
        out_keys, out_scores, out_rows, count, BLOCK=VICTIM_BLOCK, DIM_BLOCK=min(128, next_power_of_2(row_dim)),
    )
