"""Kernels that move rows between the tiers of tiered tables addressed together (tiers.py):
a TableStack whose first T tables are the device tiers and whose next T are their host
tiers, in the same order, so that table t's host tier is table t + T.

A lane names its table by tids[i]; its host tier is table tids[i] + T (the caller gives
the offset, which saves it a tensor of shifted ids). Lanes whose slot is negative are
skipped, and with `count` (a device scalar) so are lanes from count[0] on.

Twins: tier_reference.py, held against these in tests/test_tier_kernels.py.
"""
import torch
import triton
import triton.language as tl

from ..launch import aligned_empty, cdiv, launch, next_power_of_2
from .counters import K_EVICTIONS, K_HITS, K_INSERTS, K_LOOKUPS, K_NUM_COUNTED, K_REJECTIONS
from .probe_kernels import K_ABOVE_ALL, K_EMPTY_KEY, ROW_ALIGN, _DIGESTS, _KEYS, _SCORES, _VALUES, TableStack, _field

# exchange_tier_rows' tiling: lanes per program, warps, columns moved at a time
# (benchmarks/embedding_tuning.md)
TIER_TILING = (32, 8, 256)
MARK_BLOCK = 256  # lanes per program of mark_tier_slots
COUNT_BLOCK = 1024  # lanes per program of count_swap
FLAGS_BLOCK = 1024  # lanes per program of host_claim_lanes and swap_outcome
K_NO_TABLE = tl.constexpr(2**31)  # above every table's index
PROTECT, RELEASE = 0, 1  # mark_tier_slots' actions
K_PROTECT = tl.constexpr(PROTECT)  # (kernels read only constexpr globals)


@triton.jit
def _live_lanes(count_ptr, n, BLOCK: tl.constexpr, COUNTED: tl.constexpr):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if COUNTED:
        n = tl.minimum(n, tl.load(count_ptr))
    return lanes, lanes < n


@triton.jit(do_not_specialize=["n"])
def _exchange_tier_rows_kernel(
    tid_ptr, slot_ptr, down_ptr, up_ptr, n, count_ptr, desc_ptr, host, width, row_stride, COUNTED: tl.constexpr,
    BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    """For each lane, in table tid[i]'s two tiers: the device row at slot[i] moves to the
    host tier at down[i] (written whole, up to the stride) and the host row at up[i] moves
    into the device slot (either move only where its slot is >= 0). Both rows are read
    before either is written, so one pass moves rows both ways over PCIe at once."""
    lanes, live = _live_lanes(count_ptr, n, BLOCK, COUNTED)
    t = tl.load(tid_ptr + lanes, mask=live, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + lanes, mask=live, other=-1)
    down = tl.load(down_ptr + lanes, mask=live, other=-1)
    up = tl.load(up_ptr + lanes, mask=live, other=-1)
    live = live & (slot >= 0)
    going, coming = live & (down >= 0), live & (up >= 0)
    t = tl.where(live, t, 0)
    device_row = tl.multiple_of(_field(desc_ptr, t, _VALUES).to(tl.pointer_type(tl.float32)) + slot * row_stride, ROW_ALIGN)
    host_values = _field(desc_ptr, t + host, _VALUES).to(tl.pointer_type(tl.float32))
    down_row = tl.multiple_of(host_values + down * row_stride, ROW_ALIGN)
    up_row = tl.multiple_of(host_values + up * row_stride, ROW_ALIGN)
    # most lanes of a call move nothing (a lookup's rows are mostly on the device already):
    # a program with no move skips the row loop, whose masked instructions still issue
    if tl.max((going | coming).to(tl.int32), axis=0) != 0:
        for c in range(0, row_stride, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            inside = cols[None, :] < width
            old = tl.load(device_row[:, None] + cols[None, :], mask=going[:, None] & inside, other=0.0)
            new = tl.load(up_row[:, None] + cols[None, :], mask=coming[:, None] & inside)
            tl.store(down_row[:, None] + cols[None, :], old, mask=going[:, None] & (cols[None, :] < row_stride))
            tl.store(device_row[:, None] + cols[None, :], new, mask=coming[:, None] & inside)


@triton.jit(do_not_specialize=["n"])
def _mark_tier_slots_kernel(
    tid_ptr, slot_ptr, offset, n, count_ptr, desc_ptr, ACTION: tl.constexpr, COUNTED: tl.constexpr, BLOCK: tl.constexpr,
):
    """PROTECT: the rows at the lanes' slots get the highest score (no claim evicts them);
    RELEASE: the slots are emptied (key, score and digest cleared)."""
    lanes, live = _live_lanes(count_ptr, n, BLOCK, COUNTED)
    slot = tl.load(slot_ptr + lanes, mask=live, other=-1)
    live = live & (slot >= 0)
    t = tl.where(live, tl.load(tid_ptr + lanes, mask=live, other=0).to(tl.int64) + offset, 0)
    scores = _field(desc_ptr, t, _SCORES).to(tl.pointer_type(tl.int64)) + slot
    if ACTION == K_PROTECT:
        tl.store(scores, tl.full([BLOCK], K_ABOVE_ALL, tl.int64), mask=live)
    else:
        tl.store(_field(desc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64)) + slot, tl.full([BLOCK], K_EMPTY_KEY, tl.int64), mask=live)
        tl.store(scores, tl.zeros([BLOCK], tl.int64), mask=live)
        tl.store(_field(desc_ptr, t, _DIGESTS).to(tl.pointer_type(tl.uint8)) + slot, tl.zeros([BLOCK], tl.uint8), mask=live)


@triton.jit
def _flag(ptr, lanes, live):
    return live & (tl.load(ptr + lanes, mask=live, other=0) != 0)


@triton.jit
def _add_count(ptr, value):
    if value != 0:  # (most counters of most programs stay as they are)
        tl.atomic_add(ptr, value, sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _count_swap_kernel(
    tid_ptr, key_ptr, slot_ptr, inserted_ptr, promoted_ptr, held_ptr, made_ptr, demoted_ptr, lost_ptr, n, count_ptr,
    inserting_ptr, counts_ptr, moves_ptr, COUNTED: tl.constexpr, TRAIN: tl.constexpr, BLOCK: tl.constexpr,
):
    """A block of a swap's lanes counted per table: each table's sums over the block's
    lanes, one atomic add per table and counter (a call's lanes lie in table order, so a
    block spans one table or a few)."""
    lanes, live = _live_lanes(count_ptr, n, BLOCK, COUNTED)
    if tl.max(live.to(tl.int32), axis=0) != 0:
        t = tl.load(tid_ptr + lanes, mask=live, other=0).to(tl.int64)
        promoted = _flag(promoted_ptr, lanes, live)
        demoted = _flag(demoted_ptr, lanes, live)
        lost = _flag(lost_ptr, lanes, live)
        if TRAIN:
            stored = live & (tl.load(slot_ptr + lanes, mask=live, other=-1) >= 0)
            inserted = _flag(inserted_ptr, lanes, live)
            held = _flag(held_ptr, lanes, live)
            made = _flag(made_ptr, lanes, live)
            hits = (stored & ~inserted) | promoted | (held & ~made)
            inserts = (inserted & ~promoted) | made
            keyed = tl.load(key_ptr + lanes, mask=live, other=K_EMPTY_KEY) != K_EMPTY_KEY
            rowless = live & keyed & ~stored & ~held
        for table in range(tl.min(tl.where(live, t, K_NO_TABLE), axis=0), tl.max(tl.where(live, t, -1), axis=0) + 1):
            mine = live & (t == table)
            counters = counts_ptr + table * K_NUM_COUNTED
            _add_count(moves_ptr + 2 * table, tl.sum((mine & promoted).to(tl.int64), axis=0))
            _add_count(moves_ptr + 2 * table + 1, tl.sum((mine & demoted).to(tl.int64), axis=0))
            _add_count(counters + K_EVICTIONS, tl.sum((mine & lost).to(tl.int64), axis=0))
            if TRAIN:
                _add_count(counters + K_LOOKUPS, tl.sum(mine.to(tl.int64), axis=0))
                _add_count(counters + K_HITS, tl.sum((mine & hits).to(tl.int64), axis=0))
                _add_count(counters + K_INSERTS, tl.sum((mine & inserts).to(tl.int64), axis=0))
                rejected = tl.sum((mine & rowless).to(tl.int64), axis=0) * tl.load(inserting_ptr + table)
                _add_count(counters + K_REJECTIONS, rejected)


def exchange_tier_rows(
    stack: TableStack, tids: torch.Tensor, slots: torch.Tensor, down: torch.Tensor, up: torch.Tensor, host: int, width: int,
    count: torch.Tensor | None = None, tiles: tuple[int, int, int] = TIER_TILING,
) -> None:
    """For each lane with slots[i] >= 0 (of the first count[0] lanes where a count is
    given), in table tids[i]'s device tier and its host tier (table tids[i] + host): the device row at slots[i] moves to host slot
    down[i] (its first `width` values, zeros to the stride: whole lines), and the host row
    at up[i] moves to the device slot; a negative down or up skips that move. Each lane's
    rows are read before they are written; no lane may write where another reads.
    tiles: (lanes per program, warps, columns at a time); TIER_TILING is the tuned one
    (`benchmarks/tier_bandwidth.py --tiles` times others)."""
    n = tids.numel()
    if n == 0:
        return
    block, warps, dim_block = tiles
    stride = stack.tables[0].row_stride
    launch(
        _exchange_tier_rows_kernel, (cdiv(n, block),),
        tids, slots, down, up, n, count if count is not None else tids, stack.desc, host, width, stride,
        COUNTED=count is not None, BLOCK=block, DIM_BLOCK=min(dim_block, next_power_of_2(stride)), num_warps=warps,
    )


def mark_tier_slots(
    stack: TableStack, tids: torch.Tensor, slots: torch.Tensor, offset: int, action: int, count: torch.Tensor | None = None,
) -> None:
    """For each lane with slots[i] >= 0 (of the first count[0] lanes where a count is
    given), in table tids[i] + offset: PROTECT gives the row the highest score, so that no claim evicts it; RELEASE empties
    the slot."""
    n = tids.numel()
    if n == 0:
        return
    launch(
        _mark_tier_slots_kernel, (cdiv(n, MARK_BLOCK),),
        tids, slots, offset, n, count if count is not None else tids, stack.desc, ACTION=action, COUNTED=count is not None,
        BLOCK=MARK_BLOCK,
    )


def count_swap(
    tids: torch.Tensor, keys: torch.Tensor, swapped, count: torch.Tensor | None, inserting: torch.Tensor, counts: torch.Tensor,
    moves: torch.Tensor, train: bool,
) -> None:
    """Adds a swap's statistics (swapped: tiers.Swapped, for lanes keys of tables tids)
    per table, over its lanes (the first count[0] where a count is given): to moves (T,
    2) its promotions and demotions; to counts (T, NUM_COUNTED) its rows lost, counted as
    evictions, and with train a training lookup's lookups, hits (in either tier), inserts
    (in either tier) and rejections (keyed lanes left without a row, in tables whose
    inserting[t] is 1)."""
    n = tids.numel()
    if n == 0:
        return
    s = swapped
    flags = [x.view(torch.int8) for x in (s.inserted, s.promoted, s.held, s.made, s.demoted, s.lost)]
    launch(
        _count_swap_kernel, (cdiv(n, COUNT_BLOCK),),
        tids, keys, s.slots, *flags, n, count if count is not None else tids, inserting, counts, moves,
        COUNTED=count is not None, TRAIN=train, BLOCK=COUNT_BLOCK,
    )


@triton.jit
def _all_lanes(count_ptr, n, BLOCK: tl.constexpr, COUNTED: tl.constexpr):
    """(lanes, inside, written) of this program: `inside` marks the lanes the kernel reads
    and flags (below count[0] where COUNTED, else below n); `written` marks every lane of
    the outputs (below n). Lanes from count[0] to n get the values of a lane that moves
    nothing, since the callers allocate the outputs unfilled and read all n lanes."""
    lanes, inside = _live_lanes(count_ptr, n, BLOCK, COUNTED)
    return lanes, inside, lanes < n


@triton.jit(do_not_specialize=["n", "score_offset"])
def _host_claim_lanes_kernel(
    key_ptr, tid_ptr, slot_ptr, inserted_ptr, evicted_ptr, victim_key_ptr, victim_score_ptr, from_host_ptr, barred_ptr,
    score_ptr, score_offset, n, count_ptr, inserted_out_ptr, evicted_out_ptr, promoted_ptr, up_ptr, rowless_ptr,
    host_key_ptr, host_score_ptr, COUNTED: tl.constexpr, BARRED: tl.constexpr, TABLE_SCORES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """host_claim_lanes for a block of lanes: every lane before n written, those at or
    past the count as lanes that do nothing."""
    lanes, inside, written = _all_lanes(count_ptr, n, BLOCK, COUNTED)
    key = tl.load(key_ptr + lanes, mask=inside, other=K_EMPTY_KEY)
    live = inside & (key != K_EMPTY_KEY)
    inserted = _flag(inserted_ptr, lanes, live)
    evicted = _flag(evicted_ptr, lanes, live)
    from_host = tl.load(from_host_ptr + lanes, mask=live, other=-1)
    promoted = inserted & (from_host >= 0)
    rowless = live & (tl.load(slot_ptr + lanes, mask=live, other=0) < 0)
    if BARRED:
        rowless = rowless & (tl.load(barred_ptr + lanes, mask=live, other=1) == 0)
    if TABLE_SCORES:
        t = tl.load(tid_ptr + lanes, mask=live, other=0).to(tl.int64)
        score = tl.where(live, tl.load(score_ptr + t, mask=live, other=0) + score_offset, 0)
    else:
        score = tl.load(score_ptr + lanes, mask=live, other=0)
    victim_key = tl.load(victim_key_ptr + lanes, mask=evicted, other=K_EMPTY_KEY)
    victim_score = tl.load(victim_score_ptr + lanes, mask=evicted, other=0)
    tl.store(inserted_out_ptr + lanes, inserted.to(tl.int8), mask=written)
    tl.store(evicted_out_ptr + lanes, evicted.to(tl.int8), mask=written)
    tl.store(promoted_ptr + lanes, promoted.to(tl.int8), mask=written)
    tl.store(rowless_ptr + lanes, rowless.to(tl.int8), mask=written)
    tl.store(up_ptr + lanes, tl.where(promoted, from_host, -1), mask=written)
    tl.store(host_key_ptr + lanes, tl.where(evicted, victim_key, tl.where(rowless, key, K_EMPTY_KEY)), mask=written)
    tl.store(host_score_ptr + lanes, tl.where(evicted, victim_score, score), mask=written)


@triton.jit(do_not_specialize=["n"])
def _swap_outcome_kernel(
    key_ptr, inserted_ptr, evicted_ptr, promoted_ptr, rowless_ptr, down_ptr, down_inserted_ptr, host_evicted_ptr, n,
    count_ptr, going_ptr, fresh_ptr, made_ptr, held_ptr, demoted_ptr, lost_ptr, COUNTED: tl.constexpr, BLOCK: tl.constexpr,
):
    """swap_outcome for a block of lanes (every lane before n written)."""
    lanes, inside, written = _all_lanes(count_ptr, n, BLOCK, COUNTED)
    live = inside & (tl.load(key_ptr + lanes, mask=inside, other=K_EMPTY_KEY) != K_EMPTY_KEY)
    evicted = _flag(evicted_ptr, lanes, live)
    rowless = _flag(rowless_ptr, lanes, live)
    down = tl.load(down_ptr + lanes, mask=evicted | rowless, other=-1)
    kept = down >= 0
    tl.store(going_ptr + lanes, tl.where(evicted, down, -1), mask=written)
    tl.store(fresh_ptr + lanes, (_flag(inserted_ptr, lanes, live) & ~_flag(promoted_ptr, lanes, live)).to(tl.int8), mask=written)
    tl.store(made_ptr + lanes, (rowless & _flag(down_inserted_ptr, lanes, live)).to(tl.int8), mask=written)
    tl.store(held_ptr + lanes, (rowless & kept).to(tl.int8), mask=written)
    tl.store(demoted_ptr + lanes, (evicted & kept).to(tl.int8), mask=written)
    lost = (evicted & ~kept) | _flag(host_evicted_ptr, lanes, live)
    tl.store(lost_ptr + lanes, lost.to(tl.int8), mask=written)


def host_claim_lanes(
    keys, tids, slots, inserted, evicted, victim_keys, victim_scores, from_host, barred, scores, score_offset: int,
    table_scores: bool, count,
):
    """After a swap's device claim, per lane (N,): (inserted, evicted, promoted, up,
    rowless, host_keys, host_scores). A lane is live if its key is not the reserved one
    (and it lies before count[0] where a count is given); other lanes come back with every
    flag unset, up -1 and the reserved key. inserted and evicted: the claim's, for live
    lanes; promoted: inserted with a host slot (from_host >= 0); up: that slot, else -1;
    rowless: live without a device slot (slots < 0) and not barred (barred (N,) bool or
    None); host_keys and host_scores, what the host claim takes: an evicted lane's victim
    (victim_keys, victim_scores), else a rowless lane's key with its score (scores per
    lane, or with table_scores per table tids[i] plus score_offset), else the reserved key."""
    n = keys.numel()
    flags = aligned_empty(4, n, torch.int8, keys.device)  # inserted, evicted, promoted, rowless
    up, host_keys, host_scores = aligned_empty(3, n, torch.int64, keys.device)
    if n:
        launch(
            _host_claim_lanes_kernel, (cdiv(n, FLAGS_BLOCK),),
            keys, tids, slots, inserted.view(torch.int8), evicted.view(torch.int8), victim_keys, victim_scores, from_host,
            barred.view(torch.int8) if barred is not None else keys, scores, score_offset, n,
            count if count is not None else keys, *flags[:3], up, flags[3], host_keys, host_scores,
            COUNTED=count is not None, BARRED=barred is not None, TABLE_SCORES=table_scores, BLOCK=FLAGS_BLOCK,
        )
    inserted, evicted, promoted, rowless = (x.view(torch.bool) for x in flags)
    return inserted, evicted, promoted, up, rowless, host_keys, host_scores


def swap_outcome(keys, inserted, evicted, promoted, rowless, down, down_inserted, host_evicted, count):
    """After a swap's host claim (down: each lane's host slot, -1 for none; down_inserted
    and host_evicted: the host claim's flags), per lane (N,): (going, fresh, made, held,
    demoted, lost), unset for lanes not live (the reserved key, or at or past count[0]).
    going: an evicted lane's host slot for its victim, else -1; fresh: inserted on the
    device and not promoted (its row is new); made: rowless, given a new host row; held:
    rowless, with a host row; demoted: evicted, its victim kept in host memory; lost:
    evicted with no host row for its victim, or the host claim evicted a row for it."""
    n = keys.numel()
    going = torch.empty(n, dtype=torch.int64, device=keys.device)
    fresh, made, held, demoted, lost = aligned_empty(5, n, torch.int8, keys.device)
    if n:
        launch(
            _swap_outcome_kernel, (cdiv(n, FLAGS_BLOCK),),
            keys, inserted.view(torch.int8), evicted.view(torch.int8), promoted.view(torch.int8), rowless.view(torch.int8),
            down, down_inserted.view(torch.int8), host_evicted.view(torch.int8), n, count if count is not None else keys,
            going, fresh, made, held, demoted, lost, COUNTED=count is not None, BLOCK=FLAGS_BLOCK,
        )
    return (going, *(x.view(torch.bool) for x in (fresh, made, held, demoted, lost)))
