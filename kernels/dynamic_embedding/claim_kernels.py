"""The claim: fast find_or_insert on Triton hash tables, in two launches of _claim_kernel
that race safely (see its docstring), and the launches' tuning.

A new key claims an empty slot by compare-and-swap; keys whose bucket is full join a list
per bucket, whose head takes them one after the other in a second launch, the bucket's
only writer there. Each slot also records the id of the last call that used it (a row
used by a call is never evicted by that call).
"""
import functools
import itertools

import torch
import triton
import triton.language as tl

from ..launch import ALIGN_BYTES, aligned_size, cdiv, launch_each, multiprocessors, next_power_of_2, prepare
from .counters import K_EVICTIONS, K_HITS, K_INSERTS, K_NUM_COUNTED
from .probe_kernels import (
    _DIGESTS, _HEADS, _KEYS, _MARKS, _MODE, _SCORES, _VALUES, _WAITS, K_ABOVE_ALL, K_EMPTY_KEY, ROW_ALIGN, TableStack,
    _buf_rows, _bytes_equal, _digest,
    _digest_words, _field, _find_column, _grid, _hash, _key_column, _lane_bucket, _lane_rows,
)

# what the claim does with rows of a buffer (_claim_kernel's ROWS; 0: nothing)
FETCH, ASSIGN = tl.constexpr(1), tl.constexpr(2)
_ALIGN_BYTES = tl.constexpr(ALIGN_BYTES)  # the outputs' alignment in out (_output_strides)
_ALIGN_WORDS = tl.constexpr(ALIGN_BYTES // 8)


@triton.jit
def _key_scores(score_ptr, t, lanes, live, score_offset, TABLE_SCORES: tl.constexpr):
    """The claim's score of the keys at lanes: their table's, score_ptr[t] + score_offset,
    under TABLE_SCORES, else their own, score_ptr[lanes]."""
    if TABLE_SCORES:
        return tl.load(score_ptr + t, mask=live, other=0) + score_offset
    return tl.load(score_ptr + lanes, mask=live, other=0)


@triton.jit
def _claim_keys(
    offs, live, query_ptr, tid_ptr, score_ptr, desc_ptr, slot_ptr, inserted_ptr, counts_ptr, barred_ptr, BUCKET: tl.constexpr,
    MULTI: tl.constexpr, TABLE_SCORES: tl.constexpr, COUNT: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr,
    BARRED: tl.constexpr, call, score_offset,
):
    """_claim_kernel's phase 0 on the keys at offs (lanes live). Stores their slots and
    inserted flags, and returns their slots and whether each was inserted."""
    t, key, h, bucket = _lane_bucket(offs, live, query_ptr, tid_ptr, desc_ptr, MULTI)
    mode = _field(desc_ptr, t, _MODE) + tl.zeros(offs.shape, dtype=tl.int64)  # per key, also for one table
    slot = tl.full(offs.shape, -1, tl.int64)
    active = live & (key != K_EMPTY_KEY)  # the reserved key: never found, never stored
    score = _key_scores(score_ptr, t, offs, active, score_offset, TABLE_SCORES)
    digest = _digest(h)
    keys_base = _field(desc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64))
    digests_base = _field(desc_ptr, t, _DIGESTS).to(tl.pointer_type(tl.uint8))
    scores_base = _field(desc_ptr, t, _SCORES).to(tl.pointer_type(tl.int64))
    marks = _field(desc_ptr, t, _MARKS).to(tl.pointer_type(tl.int32))
    key_row = tl.multiple_of(keys_base + bucket * BUCKET, ALIGN)
    inserted = tl.zeros(offs.shape, dtype=tl.int8)
    empty_key = tl.full(offs.shape, K_EMPTY_KEY, tl.int64)
    may_insert = mode != 0  # READ_ONLY tables only look up
    if BARRED:  # nor do barred keys
        may_insert = may_insert & (tl.load(barred_ptr + offs, mask=live, other=0) == 0)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # find the key (stored before, or by a copy in this launch), raise its score and
        # mark it used by this call, before phase 1 evicts anything. Else claim the
        # bucket's first empty slot by compare-and-swap of the key, which copies of a key
        # all aim at; the slot is marked used (phase 1, a later launch, sees the mark: no
        # evicting key takes the row). Reads go through L2, where this launch's writes
        # are, so the atomics need no ordering (acquire-release ones fence every lane).
        col, empty = _find_column(digests_base, key_row, bucket, key, digest, active, BUCKET, ALIGN, ".cg", "")
        found = col < BUCKET
        hit_slot = bucket * BUCKET + col
        tl.atomic_max(scores_base + hit_slot, score, mask=found, sem="relaxed")
        if ROWS != ASSIGN:  # (ASSIGN marks stored rows by swaps after the loop)
            tl.store(marks + hit_slot, tl.full(offs.shape, call, tl.int32), mask=found)
        slot = tl.where(found, hit_slot, slot)
        active = active & ~found
        # a free column: its zero digest may trail its key (the swap tells)
        has_empty = (empty < BUCKET) & may_insert
        claiming = active & has_empty
        target = bucket * BUCKET + empty
        won = claiming & False
        if tl.max(claiming.to(tl.int32), axis=0) > 0:  # a block of found keys skips the swap
            if ROWS != ASSIGN:
                tl.store(marks + target, tl.full(offs.shape, call, tl.int32), mask=claiming)
            # lanes not claiming swap their own slot entry, which is stored at the end
            old = tl.atomic_cas(
                tl.where(claiming, keys_base + target, slot_ptr + offs), tl.where(claiming, empty_key, -3),
                tl.where(claiming, key, 0), sem="relaxed",
            )
            won = claiming & (old == empty_key)
            tl.store(scores_base + target, score, mask=won)
            tl.store(digests_base + target, digest, mask=won)
        slot = tl.where(won, target, slot)
        inserted = tl.where(won, 1, inserted).to(tl.int8)
        active = active & ~won  # a lost swap reads the bucket again
        full = active & ~has_empty
        slot = tl.where(full, tl.where(~may_insert, -1, tl.where(mode == 1, -2, tl.where(mode == 2, -3, -1))), slot)
        active = active & ~full
    # under EVICT (mode 2) a key of a full bucket (-3) joins the bucket's list of waiting
    # keys, whose head (1 + its lane, 0 for none) is the bucket's word in HEADS: its slot
    # entry becomes -3 - the head it replaced (its successor in the list). (After the loop:
    # inside it, the swap took registers from the probe.)
    waits = live & (slot == -3)
    if tl.max(waits.to(tl.int32), axis=0) > 0:
        head = _field(desc_ptr, t, _HEADS).to(tl.pointer_type(tl.int64)) + bucket
        slot = tl.where(waits, -3 - tl.atomic_xchg(head, offs + 1, mask=waits, sem="relaxed"), slot)
    tl.store(slot_ptr + offs, slot, mask=live)
    if COUNT:
        ones = tl.full(offs.shape, 1, tl.int64)
        counters = counts_ptr + (t + tl.zeros(offs.shape, tl.int64)) * K_NUM_COUNTED  # per lane, also for one table
        tl.atomic_add(counters + K_INSERTS, ones, mask=inserted != 0, sem="relaxed")
        tl.atomic_add(counters + K_HITS, -ones, mask=inserted != 0, sem="relaxed")
    tl.store(inserted_ptr + offs, inserted, mask=live)
    return slot, inserted


@triton.jit
def _evict_lists(
    offs, live, query_ptr, tid_ptr, score_ptr, desc_ptr, slot_ptr, inserted_ptr, evicted_ptr, victim_key_ptr, victim_score_ptr,
    counts_ptr, values_base, buf_ptr, row_dim, row_stride, BUCKET: tl.constexpr, MULTI: tl.constexpr,
    TABLE_SCORES: tl.constexpr, COUNT: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr, DIM_BLOCK: tl.constexpr,
    VICTIMS: tl.constexpr, HISTORY: tl.constexpr, ROW_TILE: tl.constexpr, FORCE: tl.constexpr, call, score_offset,
):
    """_claim_kernel's phase 1 for the lanes at offs (live) that head their bucket's list of
    waiting keys: each takes the keys of its list in turn, alone in the bucket (no other
    program writes it in this launch, so nothing is locked or fenced). A key takes the
    lowest (score, column) row not used by `call` if that score is <= its own (under FORCE
    whatever its own), else is not stored (-1); a copy of a key stored earlier in the list finds that row instead (no key
    of the list is in the bucket at the launch's start: phase 0 found it full). Stores
    each key's slot and flags, and empties the lists' heads.
    The bucket's scores and marks are read once per list and kept in registers, as are the
    last HISTORY keys the list stored (their copies need no probe of the bucket), and the
    next key with the first ROW_TILE values of its row of buf is read a step ahead, so
    that a key's step waits on memory for one trip, not one per read."""
    t, key, h, bucket = _lane_bucket(offs, live, query_ptr, tid_ptr, desc_ptr, MULTI)
    keys_base = _field(desc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64))
    digests_base = _field(desc_ptr, t, _DIGESTS).to(tl.pointer_type(tl.uint8))
    scores_base = _field(desc_ptr, t, _SCORES).to(tl.pointer_type(tl.int64))
    marks = _field(desc_ptr, t, _MARKS).to(tl.pointer_type(tl.int32))
    head = _field(desc_ptr, t, _HEADS).to(tl.pointer_type(tl.int64)) + bucket
    key_row = tl.multiple_of(keys_base + bucket * BUCKET, ALIGN)
    score_row = tl.multiple_of(scores_base + bucket * BUCKET, ALIGN)
    mark_row = tl.multiple_of(marks + bucket * BUCKET, ALIGN)
    lane = offs.to(tl.int64)
    link = tl.load(slot_ptr + lane, mask=live, other=-3)
    score = _key_scores(score_ptr, t, lane, live, score_offset, TABLE_SCORES)
    if ROWS != 0:
        row = _buf_rows(buf_ptr, lane, live, row_dim, ROW_TILE)
    # rows free to take: not used by this call (phase 0's found and inserted rows are
    # marked), nor taken by a key of the list
    cols = tl.arange(0, BUCKET)[None, :]
    row_scores = tl.load(score_row[:, None] + cols, mask=live[:, None], other=0, cache_modifier=".cg")
    free = tl.load(mark_row[:, None] + cols, mask=live[:, None], other=call, cache_modifier=".cg") != call
    # the keys the list stored last and their slots, a ring by count of keys stored
    ring = tl.arange(0, HISTORY)[None, :]
    kept_key = tl.full([offs.shape[0], HISTORY], K_EMPTY_KEY, tl.int64)  # the reserved key: never waits
    kept_slot = tl.zeros([offs.shape[0], HISTORY], dtype=tl.int64)
    stored = tl.zeros(offs.shape, dtype=tl.int32)
    pending = live
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        # the next key of the list is read while this one is placed
        more = pending & (link < -3)
        next_lane = tl.where(more, -4 - link, lane)
        next_key = tl.load(query_ptr + next_lane, mask=more, other=0)
        next_link = tl.load(slot_ptr + next_lane, mask=more, other=-3)
        next_score = _key_scores(score_ptr, t, next_lane, more, score_offset, TABLE_SCORES)
        if ROWS != 0:  # FETCH and ASSIGN: the key's row of buf goes in
            next_row = _buf_rows(buf_ptr, next_lane, more, row_dim, ROW_TILE)
        digest = _digest(h)
        kept = pending[:, None] & (kept_key == key[:, None])
        copy = tl.max(kept.to(tl.int32), axis=1) > 0
        hit_slot = tl.sum(tl.where(kept, kept_slot, 0), axis=1)
        probing = pending & ~copy & (stored > HISTORY)  # a key stored before the history's
        if tl.max(probing.to(tl.int32), axis=0) > 0:
            tl.debug_barrier()  # the keys and digests this program stored (other threads)
            words = _digest_words(digests_base, bucket, probing, BUCKET, ALIGN, ".cg", 0, 0, "")
            col = _key_column(key_row, key, _bytes_equal(words, digest), BUCKET, ".cg")
            copy = copy | (probing & (col < BUCKET))
            hit_slot = tl.where(probing, bucket * BUCKET + col, hit_slot)
        tl.atomic_max(scores_base + hit_slot, score, mask=copy, sem="relaxed")
        # the lowest (score, column) free row: ties keep the lower column
        low = tl.min(tl.where(free, row_scores, K_ABOVE_ALL), axis=1)
        victim = tl.min(tl.where(free & (row_scores == low[:, None]), cols, BUCKET), axis=1)
        evicting = pending & ~copy & (victim < BUCKET)
        if not FORCE:
            evicting = evicting & (low <= score)
        free = free & ~(evicting[:, None] & (cols == victim[:, None]))
        target = bucket * BUCKET + victim
        if VICTIMS:
            old_key = tl.load(keys_base + target, mask=evicting, other=0, cache_modifier=".cg")
            tl.store(victim_key_ptr + lane, old_key, mask=evicting)
            tl.store(victim_score_ptr + lane, low, mask=evicting)
            tl.store(evicted_ptr + lane, tl.full(offs.shape, 1, tl.int8), mask=evicting)
        tl.store(marks + target, tl.full(offs.shape, call, tl.int32), mask=evicting)
        tl.store(scores_base + target, score, mask=evicting)
        tl.store(digests_base + target, digest, mask=evicting)
        tl.store(keys_base + target, key, mask=evicting)
        if ROWS != 0:
            tile = tl.arange(0, ROW_TILE)[None, :]
            row_ptr = tl.multiple_of(values_base + target * row_stride, ROW_ALIGN)  # as _lane_rows'
            tl.store(row_ptr[:, None] + tile, row, mask=evicting[:, None] & (tile < row_dim))
            if row_dim > ROW_TILE:
                _lane_rows(values_base, target, row_stride, buf_ptr, lane, evicting, row_dim, True, DIM_BLOCK, "", ROW_TILE)
        put = evicting[:, None] & (ring == (stored % HISTORY)[:, None])
        kept_key = tl.where(put, key[:, None], kept_key)
        kept_slot = tl.where(put, target[:, None], kept_slot)
        stored += evicting.to(tl.int32)
        if ROWS == FETCH:  # a copy gets its key's row
            if tl.max(copy.to(tl.int32), axis=0) > 0:
                tl.debug_barrier()  # the rows this program stored (other threads)
                _lane_rows(values_base, hit_slot, row_stride, buf_ptr, lane, copy, row_dim, False, DIM_BLOCK, ".cg", 0)
        tl.store(slot_ptr + lane, tl.where(copy, hit_slot, tl.where(evicting, target, -1)), mask=pending)
        tl.store(inserted_ptr + lane, tl.full(offs.shape, 1, tl.int8), mask=evicting)
        if COUNT:
            ones = tl.full(offs.shape, 1, tl.int64)
            counters = counts_ptr + (t + tl.zeros(offs.shape, tl.int64)) * K_NUM_COUNTED  # per lane, also for one table
            tl.atomic_add(counters + K_INSERTS, ones, mask=evicting, sem="relaxed")
            tl.atomic_add(counters + K_HITS, -ones, mask=evicting, sem="relaxed")
            tl.atomic_add(counters + K_EVICTIONS, ones, mask=evicting, sem="relaxed")
        pending, lane, key, link, score = more, next_lane, next_key, next_link, next_score
        if ROWS != 0:
            row = next_row
        h = _hash(key)
    tl.store(head, tl.zeros(offs.shape, dtype=tl.int64), mask=live)


# n, the keys of a call, is not specialized on (see multi_table_kernels.py)
@triton.jit(do_not_specialize=["call", "score_offset", "n"])
def _claim_kernel(
    query_ptr, tid_ptr, score_ptr, n, count_ptr, desc_ptr, out_ptr, call, counts_ptr, refuse_ptr, barred_ptr,
    buf_ptr, row_dim, row_stride, score_offset, BUCKET: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr,
    MULTI: tl.constexpr, TABLE_SCORES: tl.constexpr, COUNT: tl.constexpr, ALIGN: tl.constexpr, PHASE: tl.constexpr,
    COUNTED: tl.constexpr, REFUSE: tl.constexpr, BARRED: tl.constexpr, ROWS: tl.constexpr, DIM_BLOCK: tl.constexpr, VICTIMS: tl.constexpr,
    LISTS: tl.constexpr, HISTORY: tl.constexpr, ROW_TILE: tl.constexpr, FORCE: tl.constexpr,
):
    """Fast find_or_insert in two launches. PHASE 0: each key looks for itself (found: its
    score is raised to the key's and its row marked used by `call`), else takes its
    bucket's first empty slot. A key whose bucket is full gets slot -2 under GROW (the
    caller grows and retries), -1 under KEEP (not stored) or READ_ONLY, and under EVICT
    joins its bucket's list of waiting keys for PHASE 1, a second launch, after every found
    row is marked: there the list's head (the last key to join) takes the list's keys one
    after the other (_evict_lists): each takes the lowest (score, slot) row not used by
    this call if that score is <= its own, else is not stored (-1). A key stored is marked
    used by `call` at once, so no later key of the call evicts it. The reserved key is
    never found nor stored (-1).
    TABLE_SCORES: a key's score is its table's, score_ptr[t] + score_offset (scores move
    together from call to call: the offset saves the caller an add on the device).
    COUNT: each insert adds to counts[t, INSERTS] and takes one from counts[t, HITS] (a distinct id
    inserted is no hit), each eviction adds to counts[t, EVICTIONS]. COUNTED: as _find_kernel.
    REFUSE: nothing is done if refuse_ptr[0] is set (the caller raises; slots are unset).
    BARRED: a key whose barred_ptr entry is set is found if stored but never inserted (-1
    if not stored: admission's ids below their threshold).
    ROWS (one table, no victims returned: their rows are overwritten), with buf (N, row_dim):
    FETCH, find_or_insert_values' rows: a key inserted stores its row of buf, the others
    get their stored row in buf. A key inserted in phase 0 writes its row there; rows go
    out in phase 1, which then runs over every key: a key found in phase 0 may be a copy of
    one whose row is written in the same launch (the copy is bound by bandwidth, so it
    shares phase 1 rather than taking a launch of its own). There a key that evicts stores its
    row, and a copy of it gets that row. ASSIGN, insert_or_assign's: every key
    stored gets its row of buf, written by one of its copies (in phase 0 the first to mark
    the row, in phase 1 the one that evicts).
    Each program takes a run of consecutive blocks of BLOCK keys, its share of the batch
    (a grid smaller than the batch serves a device count, which leaves most of a grid
    sized for the batch without work). In phase 1 a program takes chunks of SPAN blocks
    and gathers each chunk's list heads, LISTS at a time (a step costs one chain of trips
    to memory however few of its lanes lead). HISTORY and ROW_TILE: see _evict_lists.
    Outputs, all in out (int64, one allocation: the host's time to make tensors before
    the first launch is time the device waits), each starting ALIGN_BYTES-aligned
    (_output_strides): the slots (n); with VICTIMS the evicted keys and their scores;
    then flags, int8, whether each key was inserted and whether it evicted (phase 0
    writes both for every key, so nothing needs zeroing).
    Without VICTIMS neither victims nor the evicted flags are written. Phase 0 stores
    `call` in the first table's WAITS word if any key waits; phase 1 does nothing
    otherwise (a fresh call id needs no reset between calls)."""
    words = tl.cdiv(n, _ALIGN_WORDS) * _ALIGN_WORDS  # as _output_strides
    slot_ptr, victim_key_ptr, victim_score_ptr = out_ptr, out_ptr + words, out_ptr + 2 * words
    inserted_ptr = (out_ptr + (3 * words if VICTIMS else words)).to(tl.pointer_type(tl.int8))
    evicted_ptr = inserted_ptr + tl.cdiv(n, _ALIGN_BYTES) * _ALIGN_BYTES
    waits_ptr = _field(desc_ptr, 0, _WAITS).to(tl.pointer_type(tl.int64))
    values_base = buf_ptr
    if ROWS != 0:  # one table
        values_base = _field(desc_ptr, 0, _VALUES).to(tl.pointer_type(buf_ptr.dtype.element_ty))
    if COUNTED:
        n = tl.load(count_ptr)
    if REFUSE:
        n = tl.where(tl.load(refuse_ptr) != 0, 0, n)
    # a store to waits_ptr from every block would queue at one address: set once is enough
    flagged = tl.load(waits_ptr) == call
    if PHASE == 0:
        share = tl.cdiv(tl.cdiv(n, BLOCK), tl.num_programs(0))
        first_block = tl.program_id(0) * share
        for block in range(first_block, tl.minimum(first_block + share, tl.cdiv(n, BLOCK))):
            offs = block * BLOCK + tl.arange(0, BLOCK)
            live = offs < n
            offs = tl.minimum(offs, n - 1)  # (idle lanes of the last block swap a live lane's slot entry)
            slot, inserted = _claim_keys(
                offs, live, query_ptr, tid_ptr, score_ptr, desc_ptr, slot_ptr, inserted_ptr, counts_ptr, barred_ptr, BUCKET,
                MULTI, TABLE_SCORES, COUNT, ALIGN, ROWS, BARRED, call, score_offset,
            )
            if VICTIMS:
                tl.store(evicted_ptr + offs, tl.zeros(offs.shape, dtype=tl.int8), mask=live)
            if ROWS == FETCH:
                _lane_rows(values_base, slot, row_stride, buf_ptr, offs, inserted != 0, row_dim, True, DIM_BLOCK, "", 0)
            if ROWS == ASSIGN:
                # the first of a slot's lanes (copies of a key) to swap its mark to this call
                # writes the row alone: copies writing at once could mix their columns
                stored = slot >= 0
                # (the marks' address is read here: live across the loop it takes 5 more registers)
                marks = _field(desc_ptr, 0, _MARKS).to(tl.pointer_type(tl.int32))
                first = stored & (tl.atomic_xchg(marks + slot, tl.full(offs.shape, call, tl.int32), mask=stored, sem="relaxed") != call)
                _lane_rows(values_base, slot, row_stride, buf_ptr, offs, first, row_dim, True, DIM_BLOCK, "", 0)
            if not flagged and tl.max((slot <= -3).to(tl.int32), axis=0) > 0:
                tl.store(waits_ptr, call.to(tl.int64))
                flagged = True
    else:
        if ROWS != FETCH:
            n = tl.where(flagged, n, 0)
        CHUNK: tl.constexpr = BLOCK * SPAN  # keys
        share = tl.cdiv(tl.cdiv(n, CHUNK), tl.num_programs(0))
        first_chunk = tl.program_id(0) * share
        for chunk in range(first_chunk, tl.minimum(first_chunk + share, tl.cdiv(n, CHUNK))):
            lanes = chunk * CHUNK + tl.arange(0, CHUNK)
            chunk_slots = tl.load(slot_ptr + lanes, mask=lanes < n, other=0)
            waiting = (lanes < n) & (chunk_slots <= -3)
            if ROWS == FETCH:  # rows of keys found in phase 0 go out (a key inserted there wrote its row)
                # the chunk's slots and flags are read at once, and then again from L1 a block
                # at a time: a block's trips to memory are then its rows' alone
                old_rows = (chunk_slots >= 0) & (tl.load(inserted_ptr + lanes, mask=lanes < n, other=1) == 0)
                if tl.max(old_rows.to(tl.int32), axis=0) > 0:
                    for b in range(0, SPAN):
                        offs = (chunk * SPAN + b) * BLOCK + tl.arange(0, BLOCK)
                        slot = tl.load(slot_ptr + offs, mask=offs < n, other=-1)
                        old = (slot >= 0) & (tl.load(inserted_ptr + offs, mask=offs < n, other=1) == 0)
                        _lane_rows(values_base, slot, row_stride, buf_ptr, offs, old, row_dim, False, DIM_BLOCK, "", 0)
            if tl.max(waiting.to(tl.int32), axis=0) > 0:
                # the heads of the chunk's lists
                t, _, _, bucket = _lane_bucket(lanes, waiting, query_ptr, tid_ptr, desc_ptr, MULTI)
                head = tl.load(_field(desc_ptr, t, _HEADS).to(tl.pointer_type(tl.int64)) + bucket, mask=waiting, other=0)
                leading = waiting & (head == lanes + 1)
                count = tl.sum(leading.to(tl.int32), axis=0)
                rank = tl.cumsum(leading.to(tl.int32), axis=0) - 1
                for j in range(0, count, LISTS):
                    # the lanes of heads j .. j + LISTS - 1 of the chunk (idle lanes take any lane of it)
                    r = j + tl.arange(0, LISTS)
                    pick = leading[None, :] & (rank[None, :] == r[:, None])
                    live = r < count
                    spare = tl.minimum(chunk * CHUNK + tl.arange(0, LISTS), n - 1)
                    offs = tl.where(live, tl.sum(tl.where(pick, lanes[None, :], 0), axis=1), spare)
                    _evict_lists(
                        offs, live, query_ptr, tid_ptr, score_ptr, desc_ptr, slot_ptr, inserted_ptr, evicted_ptr, victim_key_ptr,
                        victim_score_ptr, counts_ptr, values_base, buf_ptr, row_dim, row_stride, BUCKET, MULTI, TABLE_SCORES,
                        COUNT, ALIGN, ROWS, DIM_BLOCK, VICTIMS, HISTORY, ROW_TILE, FORCE, call, score_offset,
                    )


_calls = itertools.count(1)


def new_call() -> int:
    """A fresh id for a call that evicts: rows marked with it are used by the call. Ids
    repeat after 2**31 - 1 calls (a row untouched that long could be spared once)."""
    return (next(_calls) - 1) % (2**31 - 1) + 1


# keys per block and warps of the claim's first phase: small programs keep more memory
# requests in flight
PLACE_BLOCK, PLACE_WARPS = 8, 1
# the first phase over a device count (a collection's lookup: distinct ids, most found)
GROUP_PLACE_BLOCK, GROUP_PLACE_WARPS = 16, 2
# the claim's eviction phase: keys per block (of the found rows' copy-out), blocks per
# chunk (whose list heads it gathers), warps, lists an eviction step takes at once, the
# register cap, and programs per multiprocessor over a device count (as PLACE_PROGRAMS for
# the first phase; a grid sized for the batch leaves most programs idle there)
EVICT_BLOCK, EVICT_SPAN, EVICT_WARPS, EVICT_LISTS, EVICT_REGISTERS, EVICT_PROGRAMS = 8, 4, 1, 1, 96, 32
# how many of the keys a list stored last the eviction keeps, to find their copies without
# a probe of the bucket (half a bucket at most: a list of a small bucket can then outgrow
# it, as one of 128 can)
EVICT_HISTORY = 8
# columns of a waiting key's row of buf the eviction reads a step ahead, into registers
# (the rest, if any, moves after the key's row is chosen)
EVICT_ROW_TILE = 128
PLACE_PROGRAMS = 32
# columns of find_or_insert_values' rows the claim moves at a time: wider blocks take more
# registers (phase 0: 64 columns 72, 128 columns 117)
CLAIM_DIM_BLOCK = 64
# (the measurements behind these: benchmarks/embedding_tuning.md)


def resident_grid(blocks: int, device: torch.device, per_multiprocessor: int) -> tuple[int]:
    """A grid for kernels whose programs step through `blocks` blocks of work: at most
    per_multiprocessor programs for each multiprocessor of the device (launch.multiprocessors)."""
    return (max(1, min(blocks, per_multiprocessor * multiprocessors(device))),)


def claim(
    stack: TableStack, keys: torch.Tensor, scores: torch.Tensor, bucket_size: int, tids: torch.Tensor | None = None,
    table_scores: bool = False, counts: torch.Tensor | None = None, count: torch.Tensor | None = None,
    refuse: torch.Tensor | None = None, rows: torch.Tensor | None = None, row_stride: int = 0, victims: bool = True,
    assign: bool = False, score_offset: int = 0, barred: torch.Tensor | None = None, force: bool = False,
):
    """Fast find_or_insert on the tables of `stack` (_claim_kernel): found rows get their
    scores raised, missing keys are inserted. Returns (slots, inserted, evicted,
    victim_keys, victim_scores), all (N,): an evicted lane's slot still holds its victim's
    row. Found and inserted rows are marked used by this call: none of its keys evicts
    them. table_scores: `scores` are per table, each plus score_offset; counts: (T, 5)
    counters (see _claim_kernel); count: as probe's (flags past it are unset too);
    refuse: a device flag, if set nothing is done (slots and flags unset), so that a
    caller can check a batch without waiting before the claim. barred: (N,) bool, keys
    that are found if stored but never inserted (slot -1 otherwise).
    rows: a contiguous (N, d) buffer of find_or_insert_values (one table whose rows are
    row_stride apart): new keys' first d values are stored from it, the other keys' come
    back in it; victims' rows are overwritten. assign: rows is insert_or_assign's instead,
    every key stored gets its row (of copies of a key, one's). victims=False: the caller
    drops the victims (evicted, victim_keys and victim_scores come back None). force: a
    key of a full bucket evicts the bucket's lowest-score row not used by the call even
    where that score is above its own. Twin: claim_reference.claim_reference."""
    n = keys.numel()
    # the kernel reads these per lane: a shorter one would be read past its end
    per_lane = {"tids": tids, "barred": barred, "scores": None if table_scores else scores}
    for name, x in per_lane.items():
        if x is not None and x.numel() != n:
            raise ValueError(f"claim: {name} has {x.numel()} entries for {n} keys")
    words, flag_bytes = _output_strides(n)
    flag_words = 2 * flag_bytes // 8
    out = keys.new_empty((3 * words if victims else words) + flag_words)  # (int64, as keys)
    if n:
        if count is None:
            first, second = _grid(n, PLACE_BLOCK), _grid(n, EVICT_BLOCK * EVICT_SPAN)
        else:
            first = resident_grid(cdiv(n, GROUP_PLACE_BLOCK), keys.device, PLACE_PROGRAMS)
            second = resident_grid(cdiv(n, EVICT_BLOCK * EVICT_SPAN), keys.device, EVICT_PROGRAMS)
        d = rows.shape[1] if rows is not None else 0
        # the host's time to issue the launches is time the device waits (a first phase
        # that only probes ends before the host issues the second): the arguments are read
        # once for both, the launches' constants are bound once per kind of call, and no
        # tensor views are made before them
        args = (
            keys, tids if tids is not None else keys, scores, n, count if count is not None else keys, stack.desc, out, new_call(),
            counts if counts is not None else keys, refuse if refuse is not None else keys,
            barred.view(torch.int8) if barred is not None else keys, rows if rows is not None else keys, d, row_stride, score_offset,
        )
        phase0, phase1 = _claim_launches(
            len(args), bucket_size, tids is not None, table_scores, counts is not None, count is not None, refuse is not None,
            barred is not None, 0 if rows is None else (ASSIGN if assign else FETCH).value, d, victims, force,
        )
        launch_each(args, ((first, phase0), (second, phase1)))
    slots, flags = out[:n], out[out.numel() - flag_words :].view(torch.int8).view(2, flag_bytes)[:, :n]
    inserted, evicted = flags.view(torch.bool).unbind(0)
    if not victims:
        return slots, inserted, None, None, None
    return slots, inserted, evicted, out[words : words + n], out[2 * words : 2 * words + n]


def _output_strides(n: int) -> tuple[int, int]:
    """Where the claim's outputs of n keys lie in its one int64 allocation: (int64 words
    per output of keys, bytes per flag row), so that each output starts ALIGN_BYTES-aligned
    whatever n is (a kernel handed a view that is not would compile again mid-run)."""
    return aligned_size(n, 8), aligned_size(n, 1)


@functools.cache
def _claim_launches(
    n_args: int, bucket_size: int, multi: bool, table_scores: bool, counts: bool, counted: bool, refuse: bool,
    barred: bool, rows: int, d: int, victims: bool, force: bool,
):
    """The claim's two launches of _claim_kernel on n_args arguments, prepared (its
    constants and options)."""
    constants = dict(
        BUCKET=bucket_size, MULTI=multi, TABLE_SCORES=table_scores, COUNT=counts, ALIGN=min(bucket_size, 16),
        COUNTED=counted, REFUSE=refuse, BARRED=barred, ROWS=rows, DIM_BLOCK=min(CLAIM_DIM_BLOCK, next_power_of_2(max(d, 1))),
        VICTIMS=victims, LISTS=EVICT_LISTS, HISTORY=max(1, min(EVICT_HISTORY, bucket_size // 2)),
        ROW_TILE=min(EVICT_ROW_TILE, next_power_of_2(max(d, 1))), FORCE=force,
    )
    place, place_warps = (GROUP_PLACE_BLOCK, GROUP_PLACE_WARPS) if counted else (PLACE_BLOCK, PLACE_WARPS)
    return (
        prepare(_claim_kernel, n_args, BLOCK=place, SPAN=1, PHASE=0, num_warps=place_warps, **constants),
        prepare(
            _claim_kernel, n_args, BLOCK=EVICT_BLOCK, SPAN=EVICT_SPAN, PHASE=1, num_warps=EVICT_WARPS,
            maxnreg=EVICT_REGISTERS, **constants,
        ),
    )
