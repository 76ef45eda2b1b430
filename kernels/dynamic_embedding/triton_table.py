"""The Triton hash table: the reference table's semantics, with the memory-bound work in
Triton kernels.

Each slot also carries a one-byte digest (the hash's top byte): a probe reads a bucket's
digests (bucket_size bytes, compared 8 at a time, the second half only for keys not in
the first) and loads full keys only where the digest matches, and the id of the last
call that used it (a row used by a call is never evicted by that call).
Rows are padded to a multiple of ROW_ALIGN values so they start aligned.

Fast mode (the default) inserts in kernels that race safely: a new key claims an empty
slot by compare-and-swap; keys whose bucket is full join a list per bucket, whose head
takes them one after the other in a second launch, the bucket's only writer there.
Deterministic mode keeps batch bookkeeping (deduplication, per-bucket ranks) in torch
and places new keys in two launches, one that only reads (choose a slot) and one that
only writes, so the layout is the reference's, bit for bit.

Probe and claim kernels address tables through descriptors (storage addresses, bucket
mask, insert mode), so one launch can serve the many tables of a collection.
"""
import functools
import itertools

import torch
import triton
import triton.language as tl

from ..launch import cdiv, launch, launch_each, next_power_of_2, prepare
from .host_memory import host_mapped
from .hashing import EMPTY_KEY
from .table import MISSING, Evicted, ReferenceHashTable, reserved_key_error

@triton.jit
def _hash(k):
    """MurmurHash3 fmix64 on int64 keys (as uint64); equals hashing.hash64."""
    h = k.to(tl.uint64, bitcast=True)
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    h = h ^ (h >> 33)
    return h


@triton.jit
def _digest(h):
    """One byte of the hash for the probe; 0 is kept for empty slots."""
    d = (h >> 56).to(tl.uint8)
    return tl.where(d == 0, 1, d).to(tl.uint8)


ROW_ALIGN = tl.constexpr(16)  # elements; a row's stride in a Triton table is a multiple

# A table descriptor: int64 words that let one kernel address any of several tables (the
# tables of a collection): storage addresses (HEADS: the claim's per-bucket list heads;
# WAITS: the word where a claim on the descriptors whose first is this table's records
# that some key waits to evict), bucket mask and insertion mode
# (kernels may only read module globals that are constexpr)
_KEYS, _DIGESTS, _SCORES, _VALUES, _MARKS, _HEADS, _MASK, _MODE, _WAITS = (tl.constexpr(i) for i in range(9))
DESCRIPTOR_WORDS = tl.constexpr(9)
# insertion modes: a key whose bucket has no empty slot is refused (slot -1) under KEEP,
# reported as slot -2 under GROW (the caller grows the table), evicts under EVICT
READ_ONLY, GROW, EVICT, KEEP = 0, 1, 2, 3
# what the claim does with rows of a buffer (_claim_kernel's ROWS; 0: nothing)
FETCH, ASSIGN = tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _field(desc_ptr, t, word: tl.constexpr):
    return tl.load(desc_ptr + t * DESCRIPTOR_WORDS + word)


@triton.jit
def _lane_bucket(offs, live, query_ptr, tid_ptr, desc_ptr, MULTI: tl.constexpr):
    """(table, key, hash, bucket) of the keys at offs: key i is in table tid[i] (MULTI), else
    all are in table 0, whose fields are then scalars."""
    if MULTI:
        t = tl.load(tid_ptr + offs, mask=live, other=0).to(tl.int64)
    else:
        t = 0
    key = tl.load(query_ptr + offs, mask=live, other=0)
    h = _hash(key)
    return t, key, h, (h & _field(desc_ptr, t, _MASK).to(tl.uint64)).to(tl.int64)


# A probe reads a bucket's digests as 64-bit words, 8 columns each (byte j of word w is
# column 8w + j), and compares them a word at a time: per key, a bucket of 128 costs 16
# values in registers instead of 128, which doubles the claim kernel's occupancy.
LOW7 = tl.constexpr(0x7F7F7F7F7F7F7F7F)
BYTE_ONES = tl.constexpr(0x0101010101010101)


@triton.jit
def _digest_words(
    digests_base, bucket, live, BUCKET: tl.constexpr, ALIGN: tl.constexpr, CACHE: tl.constexpr, FIRST: tl.constexpr,
    WORDS: tl.constexpr, POLICY: tl.constexpr,
):
    """The digests of each lane's bucket as uint64 words, (BLOCK, max(BUCKET // 8, 1)), or
    WORDS words from word FIRST on if WORDS > 0. A bucket of fewer than 8 slots shares its
    word: its bytes are shifted to the bottom and the others zeroed (the table pads its
    digests to whole words). POLICY: the load's L2 eviction policy."""
    words_base = digests_base.to(tl.pointer_type(tl.uint64))
    if BUCKET >= 8:
        row = tl.multiple_of(words_base + bucket * (BUCKET // 8), ALIGN)  # ALIGN bytes
        cols = FIRST + tl.arange(0, WORDS if WORDS > 0 else BUCKET // 8)
        return tl.load(row[:, None] + cols[None, :], mask=live[:, None], other=0, cache_modifier=CACHE, eviction_policy=POLICY)
    else:
        first = bucket * BUCKET
        word = tl.load(words_base + first // 8, mask=live, other=0, cache_modifier=CACHE, eviction_policy=POLICY)
        word = (word >> ((first % 8) * 8).to(tl.uint64)) & ((1 << (8 * BUCKET)) - 1)
        return word[:, None]


@triton.jit
def _zero_bytes(words):
    """0x80 in each byte of words that is zero, else 0 (exact: no carry crosses a byte)."""
    return ~(((words & LOW7) + LOW7) | words | LOW7)


@triton.jit
def _bytes_equal(words, byte):
    """0x80 in each byte of words that equals the lane's byte, else 0."""
    return _zero_bytes(words ^ (byte.to(tl.uint64) * BYTE_ONES)[:, None])


@triton.jit
def _lowest_column(flags, BUCKET: tl.constexpr):
    """The lowest column flagged in flags (BLOCK, words), or BUCKET if none below it."""
    low = flags & (~flags + 1)  # the lowest set bit; its float's exponent is its position
    bit = (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    col = tl.where(flags != 0, tl.arange(0, flags.shape[1])[None, :] * 8 + (bit >> 3), BUCKET)
    return tl.minimum(tl.min(col, axis=1), BUCKET)


@triton.jit
def _drop_column(flags, col):
    """flags without column col, which must be the lowest flagged of its word."""
    return tl.where(tl.arange(0, flags.shape[1])[None, :] == (col // 8)[:, None], flags & (flags - 1), flags)


@triton.jit
def _key_column(key_row, key, flags, BUCKET: tl.constexpr, CACHE: tl.constexpr):
    """The column of `key` in its bucket (BUCKET if absent), given the columns whose digest
    matches (flags, from _bytes_equal). Keys are loaded one per lane and candidate: the
    first two candidates at once, then one at a time for the rare bucket with more."""
    c1 = _lowest_column(flags, BUCKET)
    flags = _drop_column(flags, c1)
    c2 = _lowest_column(flags, BUCKET)
    k1 = tl.load(key_row + c1, mask=c1 < BUCKET, other=0, cache_modifier=CACHE)
    k2 = tl.load(key_row + c2, mask=c2 < BUCKET, other=0, cache_modifier=CACHE)
    col = tl.where((c1 < BUCKET) & (k1 == key), c1, tl.where((c2 < BUCKET) & (k2 == key), c2, BUCKET))
    pending = (col == BUCKET) & (c2 < BUCKET)
    last = c2
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        flags = _drop_column(flags, last)
        c = _lowest_column(flags, BUCKET)
        pending = pending & (c < BUCKET)
        k = tl.load(key_row + c, mask=pending, other=0, cache_modifier=CACHE)
        col = tl.where(pending & (k == key), c, col)
        pending = pending & (k != key)
        last = c
    return col


@triton.jit
def _find_column(
    digests_base, key_row, bucket, key, digest, live, BUCKET: tl.constexpr, ALIGN: tl.constexpr, CACHE: tl.constexpr,
    POLICY: tl.constexpr,
):
    """(the column of `key` in its bucket, BUCKET if absent; where it is absent, the
    bucket's lowest column with a zero digest, BUCKET if none). The digests are read in
    halves, the second only for keys not in the first: a key found in the first half
    moves 64 bytes of digests instead of 128 (a bucket of 128), and the claim kernel's
    first phase needs 72 registers instead of 94. POLICY: the digests' L2 eviction
    policy."""
    # the first half's words, or the whole bucket (WORDS 0) where it has fewer than 2 words
    words = _digest_words(digests_base, bucket, live, BUCKET, ALIGN, CACHE, 0, BUCKET // 16 if BUCKET >= 16 else 0, POLICY)
    col = _key_column(key_row, key, _bytes_equal(words, digest), BUCKET, CACHE)
    empty = _lowest_column(_zero_bytes(words), BUCKET)
    if BUCKET >= 16:
        rest = live & (col == BUCKET)
        if tl.max(rest.to(tl.int32), axis=0) > 0:
            words = _digest_words(digests_base, bucket, rest, BUCKET, ALIGN, CACHE, BUCKET // 16, BUCKET // 16, POLICY)
            c = _key_column(key_row + BUCKET // 2, key, _bytes_equal(words, digest), BUCKET, CACHE)
            col = tl.where(c < BUCKET, BUCKET // 2 + c, col)
            later = _lowest_column(_zero_bytes(words), BUCKET)
            empty = tl.where((empty == BUCKET) & (later < BUCKET), BUCKET // 2 + later, empty)
    return col, empty


@triton.jit
def _buf_rows(buf_ptr, lane, lanes, row_dim, TILE: tl.constexpr):
    """For lanes: the first TILE values of rows `lane` of buf (N, row_dim), (lanes, TILE)."""
    cols = tl.arange(0, TILE)[None, :]
    return tl.load(buf_ptr + lane[:, None].to(tl.int64) * row_dim + cols, mask=lanes[:, None] & (cols < row_dim))


@triton.jit
def _lane_rows(
    values_base, slot, row_stride, buf_ptr, offs, lanes, row_dim, TO_TABLE: tl.constexpr, DIM_BLOCK: tl.constexpr,
    CACHE: tl.constexpr, FIRST: tl.constexpr,
):
    """For lanes: values FIRST .. row_dim - 1 of the table row at `slot` to row offs of buf
    (N, row_dim), or back (TO_TABLE). CACHE: the table rows' load cache modifier."""
    row_ptr = tl.multiple_of(values_base + slot * row_stride, ROW_ALIGN)  # rows start 16-element aligned
    buf_row = buf_ptr + offs[:, None].to(tl.int64) * row_dim
    for c in range(FIRST, row_dim, DIM_BLOCK):
        cols = c + tl.arange(0, DIM_BLOCK)
        m = lanes[:, None] & (cols[None, :] < row_dim)
        if TO_TABLE:
            tl.store(row_ptr[:, None] + cols[None, :], tl.load(buf_row + cols[None, :], mask=m), mask=m)
        else:
            tl.store(buf_row + cols[None, :], tl.load(row_ptr[:, None] + cols[None, :], mask=m, cache_modifier=CACHE), mask=m)


@triton.jit
def _find_kernel(
    query_ptr, tid_ptr, n, count_ptr, desc_ptr, slot_ptr, out_ptr, out_dim, row_stride,
    BUCKET: tl.constexpr, BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, GATHER: tl.constexpr,
    MULTI: tl.constexpr, ALIGN: tl.constexpr, COUNTED: tl.constexpr, FOUND: tl.constexpr,
):
    """slot of each query key in its table (or -1); MULTI: table tid[i], else table 0.
    FOUND: slot_ptr (int8) gets whether each key is found instead.
    COUNTED: only the first count_ptr[0] keys (a device count) are looked up.
    GATHER: also copy the first out_dim values of found rows into out (rows of missing keys
    are left untouched)."""
    if COUNTED:
        n = tl.load(count_ptr)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    t, key, h, bucket = _lane_bucket(offs, live, query_ptr, tid_ptr, desc_ptr, MULTI)
    digests_base = _field(desc_ptr, t, _DIGESTS).to(tl.pointer_type(tl.uint8))
    key_row = tl.multiple_of(_field(desc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64)) + bucket * BUCKET, ALIGN)
    # the digests kept in L2: they are 1/8 of a key's traffic at dim 128
    col, _ = _find_column(digests_base, key_row, bucket, key, _digest(h), live, BUCKET, ALIGN, "", "evict_last")
    found = col < BUCKET
    slot = tl.where(found, bucket * BUCKET + col, -1)
    if FOUND:
        tl.store(slot_ptr + offs, found.to(tl.int8), mask=live)
    else:
        tl.store(slot_ptr + offs, slot, mask=live)
    if GATHER:
        values_base = _field(desc_ptr, t, _VALUES).to(tl.pointer_type(out_ptr.dtype.element_ty))
        _lane_rows(values_base, slot, row_stride, out_ptr, offs, found, out_dim, False, DIM_BLOCK, "", 0)


@triton.jit(do_not_specialize=["call"])
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
            best = tl.min(tl.where(cand, scores, 9223372036854775807), axis=1)
            at_best = cand & (scores == best[:, None])
            first = tl.min(tl.where(at_best, slots, 9223372036854775807), axis=1)
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


@triton.jit
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
    keep = live & (tl.load(table_keys_ptr + offs, mask=live, other=0) != -9223372036854775807 - 1)
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
    keep = live & (key != -9223372036854775807 - 1)
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


@triton.jit
def _key_scores(score_ptr, t, lanes, live, score_offset, TABLE_SCORES: tl.constexpr):
    """The claim's score of the keys at lanes: their table's, score_ptr[t] + score_offset,
    under TABLE_SCORES, else their own, score_ptr[lanes]."""
    if TABLE_SCORES:
        return tl.load(score_ptr + t, mask=live, other=0) + score_offset
    return tl.load(score_ptr + lanes, mask=live, other=0)


@triton.jit
def _claim_keys(
    offs, live, query_ptr, tid_ptr, score_ptr, desc_ptr, slot_ptr, inserted_ptr, counts_ptr, BUCKET: tl.constexpr,
    MULTI: tl.constexpr, TABLE_SCORES: tl.constexpr, COUNT: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr,
    call, score_offset,
):
    """_claim_kernel's phase 0 on the keys at offs (lanes live). Stores their slots and
    inserted flags, and returns their slots and whether each was inserted."""
    t, key, h, bucket = _lane_bucket(offs, live, query_ptr, tid_ptr, desc_ptr, MULTI)
    mode = _field(desc_ptr, t, _MODE) + tl.zeros(offs.shape, dtype=tl.int64)  # per key, also for one table
    slot = tl.full(offs.shape, -1, tl.int64)
    active = live & (key != -9223372036854775807 - 1)  # the reserved key: never found, never stored
    score = _key_scores(score_ptr, t, offs, active, score_offset, TABLE_SCORES)
    digest = _digest(h)
    keys_base = _field(desc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64))
    digests_base = _field(desc_ptr, t, _DIGESTS).to(tl.pointer_type(tl.uint8))
    scores_base = _field(desc_ptr, t, _SCORES).to(tl.pointer_type(tl.int64))
    marks = _field(desc_ptr, t, _MARKS).to(tl.pointer_type(tl.int32))
    key_row = tl.multiple_of(keys_base + bucket * BUCKET, ALIGN)
    inserted = tl.zeros(offs.shape, dtype=tl.int8)
    empty_key = tl.full(offs.shape, -9223372036854775807 - 1, tl.int64)
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
        has_empty = (empty < BUCKET) & (mode != 0)  # READ_ONLY tables only look up
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
        slot = tl.where(full, tl.where(mode == 1, -2, tl.where(mode == 2, -3, -1)), slot)
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
        tl.atomic_add(counts_ptr + t * 5 + 2, ones, mask=inserted != 0, sem="relaxed")
        tl.atomic_add(counts_ptr + t * 5 + 1, -ones, mask=inserted != 0, sem="relaxed")
    tl.store(inserted_ptr + offs, inserted, mask=live)
    return slot, inserted


@triton.jit
def _evict_lists(
    offs, live, query_ptr, tid_ptr, score_ptr, desc_ptr, slot_ptr, inserted_ptr, evicted_ptr, victim_key_ptr, victim_score_ptr,
    counts_ptr, values_base, buf_ptr, row_dim, row_stride, BUCKET: tl.constexpr, MULTI: tl.constexpr,
    TABLE_SCORES: tl.constexpr, COUNT: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr, DIM_BLOCK: tl.constexpr,
    VICTIMS: tl.constexpr, HISTORY: tl.constexpr, ROW_TILE: tl.constexpr, call, score_offset,
):
    """_claim_kernel's phase 1 for the lanes at offs (live) that head their bucket's list of
    waiting keys: each takes the keys of its list in turn, alone in the bucket (no other
    program writes it in this launch, so nothing is locked or fenced). A key takes the
    lowest (score, column) row not used by `call` if that score is <= its own, else is not
    stored (-1); a copy of a key stored before it in the list finds that row instead (no
    key of the list was in the bucket before: phase 0 found it full). Stores each key's
    slot and flags, and empties the lists' heads.
    The bucket's scores and marks are read once per list and kept in registers, as are the
    last HISTORY keys the list stored (their copies need no probe of the bucket), and the
    next key with the first ROW_TILE values of its row of buf is read a step ahead: a
    key's step waits on memory only for those reads, one trip where a scan of the bucket
    per key, the mark of its lowest row and its row's copy took about five."""
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
    kept_key = tl.full([offs.shape[0], HISTORY], -9223372036854775807 - 1, tl.int64)  # the reserved key: never waits
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
        low = tl.min(tl.where(free, row_scores, 9223372036854775807), axis=1)
        victim = tl.min(tl.where(free & (row_scores == low[:, None]), cols, BUCKET), axis=1)
        evicting = pending & ~copy & (victim < BUCKET) & (low <= score)
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
            tl.atomic_add(counts_ptr + t * 5 + 2, ones, mask=evicting, sem="relaxed")
            tl.atomic_add(counts_ptr + t * 5 + 1, -ones, mask=evicting, sem="relaxed")
            tl.atomic_add(counts_ptr + t * 5 + 4, ones, mask=evicting, sem="relaxed")
        pending, lane, key, link, score = more, next_lane, next_key, next_link, next_score
        if ROWS != 0:
            row = next_row
        h = _hash(key)
    tl.store(head, tl.zeros(offs.shape, dtype=tl.int64), mask=live)


@triton.jit(do_not_specialize=["call", "score_offset"])
def _claim_kernel(
    query_ptr, tid_ptr, score_ptr, n, count_ptr, desc_ptr, out_ptr, call, counts_ptr, refuse_ptr,
    buf_ptr, row_dim, row_stride, score_offset, BUCKET: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr,
    MULTI: tl.constexpr, TABLE_SCORES: tl.constexpr, COUNT: tl.constexpr, ALIGN: tl.constexpr, PHASE: tl.constexpr,
    COUNTED: tl.constexpr, REFUSE: tl.constexpr, ROWS: tl.constexpr, DIM_BLOCK: tl.constexpr, VICTIMS: tl.constexpr,
    LISTS: tl.constexpr, HISTORY: tl.constexpr, ROW_TILE: tl.constexpr,
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
    COUNT: each insert adds to counts[t, 2] and takes one from counts[t, 1] (a distinct id
    inserted is no hit), each eviction adds to counts[t, 4]. COUNTED: as _find_kernel.
    REFUSE: nothing is done if refuse_ptr[0] is set (the caller raises; slots are unset).
    ROWS (one table, no victims returned: their rows are overwritten), with buf (N, row_dim):
    FETCH, find_or_insert_values' rows: a key inserted stores its row of buf, the others
    get their stored row in buf. A key inserted in phase 0 writes its row there; rows go
    out in phase 1, which then runs over every key: a key found in phase 0 may be a copy of
    one whose row is written in the same launch (a launch of its own for them measured no
    faster: the copy is bound by bandwidth either way). There a key that evicts stores its
    row, and a copy of it gets that row. ASSIGN, insert_or_assign's: every key
    stored gets its row of buf, written by one of its copies (in phase 0 the first to mark
    the row, in phase 1 the one that evicts).
    Each program takes a run of consecutive blocks of BLOCK keys, its share of the batch
    (a grid smaller than the batch serves a device count, which leaves most of a grid
    sized for the batch without work). In phase 1 a program takes chunks of SPAN blocks
    and gathers each chunk's list heads, LISTS at a time (a step costs one chain of trips
    to memory however few of its lanes lead). HISTORY and ROW_TILE: see _evict_lists.
    Outputs, all in out (int64, one allocation: the host's time to make tensors before
    the first launch is time the device waits): the slots (n); with VICTIMS the evicted
    keys and their scores (2, n); then flags (2, n) int8, whether each key was inserted
    and whether it evicted (phase 0 writes both for every key, so nothing needs zeroing).
    Without VICTIMS neither victims nor the evicted flags are written. Phase 0 stores
    `call` in the first table's WAITS word if any key waits; phase 1 does nothing
    otherwise (a fresh call id needs no reset between calls)."""
    slot_ptr, victim_key_ptr, victim_score_ptr = out_ptr, out_ptr + n, out_ptr + 2 * n
    inserted_ptr = (out_ptr + (3 * n if VICTIMS else n)).to(tl.pointer_type(tl.int8))
    evicted_ptr = inserted_ptr + n
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
                offs, live, query_ptr, tid_ptr, score_ptr, desc_ptr, slot_ptr, inserted_ptr, counts_ptr, BUCKET, MULTI,
                TABLE_SCORES, COUNT, ALIGN, ROWS, call, score_offset,
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
                        COUNT, ALIGN, ROWS, DIM_BLOCK, VICTIMS, HISTORY, ROW_TILE, call, score_offset,
                    )


@triton.jit
def _release_slots_kernel(slot_ptr, n, keys_ptr, scores_ptr, digests_ptr, BLOCK: tl.constexpr):
    """Empties the slots given (those >= 0): key, score and digest."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + lanes, mask=lanes < n, other=-1)
    ok = slot >= 0
    tl.store(keys_ptr + slot, tl.full([BLOCK], -9223372036854775807 - 1, tl.int64), mask=ok)
    tl.store(scores_ptr + slot, tl.zeros([BLOCK], tl.int64), mask=ok)
    tl.store(digests_ptr + slot, tl.zeros([BLOCK], tl.uint8), mask=ok)


@triton.jit
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


_calls = itertools.count(1)


def new_call() -> int:
    """A fresh id for a call that evicts: rows marked with it are used by the call. Ids
    repeat after 2**31 - 1 calls (a row untouched that long could be spared once)."""
    return (next(_calls) - 1) % (2**31 - 1) + 1


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, cdiv(n, block)),)


# keys per block and warps of the probe (FIND) and of the claim's first phase (PLACE):
# small programs keep more memory requests in flight
FIND_BLOCK, FIND_WARPS, PLACE_BLOCK, PLACE_WARPS = 8, 2, 8, 1
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
    per_multiprocessor programs for each multiprocessor of the device (4 in all on a CPU,
    where the interpreter runs them)."""
    if device.type == "cuda":
        programs = per_multiprocessor * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    else:
        programs = 4
    return (max(1, min(blocks, programs)),)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _find_launch(n_args: int, bucket_size: int, out_dim: int, gather: bool, multi: bool, counted: bool, found: bool):
    """probe's launch of _find_kernel on n_args arguments, prepared."""
    return prepare(
        _find_kernel, n_args, BUCKET=bucket_size, BLOCK=FIND_BLOCK, DIM_BLOCK=min(128, next_power_of_2(max(out_dim, 1))),
        GATHER=gather, MULTI=multi, ALIGN=min(bucket_size, 16), COUNTED=counted, FOUND=found, num_warps=FIND_WARPS,
    )


def probe(
    desc: torch.Tensor, keys: torch.Tensor, bucket_size: int, row_stride: int, tids: torch.Tensor | None = None,
    out: torch.Tensor | None = None, count: torch.Tensor | None = None, found_only: bool = False,
) -> torch.Tensor:
    """Slots of keys (-1 if absent) in the tables of `desc` ((T, DESCRIPTOR_WORDS); key i in
    table tids[i], or all in table 0), or with found_only whether each is stored (bool).
    `out` (N, d) receives the first d values of found rows. count: a device scalar; only
    the first `count` keys are looked up (the other slots are left unset)."""
    n = keys.numel()
    slots = torch.empty(n, dtype=torch.bool if found_only else torch.int64, device=keys.device)
    if n == 0:
        return slots
    out_dim = out.shape[1] if out is not None else 0
    args = (
        keys, tids if tids is not None else keys, n, count if count is not None else keys, desc,
        slots.view(torch.int8) if found_only else slots, out if out is not None else slots, out_dim, row_stride,
    )
    find = _find_launch(len(args), bucket_size, out_dim, out is not None, tids is not None, count is not None, found_only)
    launch_each(args, ((_grid(n, FIND_BLOCK), find),))
    return slots


def claim(
    desc: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor, bucket_size: int, tids: torch.Tensor | None = None,
    table_scores: bool = False, counts: torch.Tensor | None = None, count: torch.Tensor | None = None,
    refuse: torch.Tensor | None = None, rows: torch.Tensor | None = None, row_stride: int = 0, victims: bool = True,
    assign: bool = False, score_offset: int = 0,
):
    """Fast find_or_insert on the tables of `desc` (_claim_kernel): found rows get their
    scores raised, missing keys are inserted. Returns (slots, inserted, evicted,
    victim_keys, victim_scores), all (N,): an evicted lane's slot still holds its victim's
    row. Found and inserted rows are marked used by this call: none of its keys evicts
    them. table_scores: `scores` are per table, each plus score_offset; counts: (T, 5)
    counters (see _claim_kernel); count: as probe's (flags past it are unset too);
    refuse: a device flag, if set nothing is done (slots and flags unset), so that a
    caller can check a batch without waiting before the claim.
    rows: a contiguous (N, d) buffer of find_or_insert_values (one table whose rows are
    row_stride apart): new keys' first d values are stored from it, the other keys' come
    back in it; victims' rows are overwritten. assign: rows is insert_or_assign's instead,
    every key stored gets its row (of copies of a key, one's). victims=False: the caller
    drops the victims (evicted, victim_keys and victim_scores come back None)."""
    n = keys.numel()
    flag_words = cdiv(2 * n, 8)
    out = keys.new_empty((3 * n if victims else n) + flag_words)  # (int64, as keys)
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
            keys, tids if tids is not None else keys, scores, n, count if count is not None else keys, desc, out, new_call(),
            counts if counts is not None else keys, refuse if refuse is not None else keys,
            rows if rows is not None else keys, d, row_stride, score_offset,
        )
        phase0, phase1 = _claim_launches(
            len(args), bucket_size, tids is not None, table_scores, counts is not None, count is not None, refuse is not None,
            0 if rows is None else (ASSIGN if assign else FETCH).value, d, victims,
        )
        launch_each(args, ((first, phase0), (second, phase1)))
    slots, flags = out[:n], out[out.numel() - flag_words :].view(torch.int8)[: 2 * n].view(2, n)
    inserted, evicted = flags.view(torch.bool).unbind(0)
    if not victims:
        return slots, inserted, None, None, None
    return slots, inserted, evicted, out[n : 2 * n], out[2 * n : 3 * n]


@functools.cache
def _claim_launches(
    n_args: int, bucket_size: int, multi: bool, table_scores: bool, counts: bool, counted: bool, refuse: bool, rows: int,
    d: int, victims: bool,
):
    """The claim's two launches of _claim_kernel on n_args arguments, prepared (its
    constants and options)."""
    constants = dict(
        BUCKET=bucket_size, MULTI=multi, TABLE_SCORES=table_scores, COUNT=counts, ALIGN=min(bucket_size, 16),
        COUNTED=counted, REFUSE=refuse, ROWS=rows, DIM_BLOCK=min(CLAIM_DIM_BLOCK, next_power_of_2(max(d, 1))),
        VICTIMS=victims, LISTS=EVICT_LISTS, HISTORY=max(1, min(EVICT_HISTORY, bucket_size // 2)),
        ROW_TILE=min(EVICT_ROW_TILE, next_power_of_2(max(d, 1))),
    )
    place, place_warps = (GROUP_PLACE_BLOCK, GROUP_PLACE_WARPS) if counted else (PLACE_BLOCK, PLACE_WARPS)
    return (
        prepare(_claim_kernel, n_args, BLOCK=place, SPAN=1, PHASE=0, num_warps=place_warps, **constants),
        prepare(
            _claim_kernel, n_args, BLOCK=EVICT_BLOCK, SPAN=EVICT_SPAN, PHASE=1, num_warps=EVICT_WARPS,
            maxnreg=EVICT_REGISTERS, **constants,
        ),
    )


def copy_rows(
    src: torch.Tensor, src_slots: torch.Tensor | None, dst: torch.Tensor, dst_slots: torch.Tensor | None, width: int,
    whole_rows: bool = False, marks: torch.Tensor | None = None,
) -> None:
    """dst[dst_slots[i], :width] = src[src_slots[i], :width] where both slots are >= 0
    (None: lane i). src and dst: 2-D with unit column stride (table storage or buffers).
    whole_rows: write each destination row up to its stride, zeros past width; for host
    memory, where a write ending inside a 64-byte line is a partial one over PCIe (rows of
    385 floats at a 400-float stride: 15x the time of whole lines, H100). marks: a table's
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


class TritonHashTable(ReferenceHashTable):
    """The reference table's calls on Triton kernels. Bucket sizes must be powers of two.

    deterministic=True: results and layout equal the reference's, bit for bit.
    deterministic=False (fast): find_or_insert and insert_or_assign insert in the claim's
    two launches, without sorting the batch: new keys take empty slots by compare-and-swap,
    and those of a full bucket join its list, whose head evicts for them one after the
    other. What differs from the reference:
    - the slot a new key lands in depends on thread timing (the set of keys does not,
      below max capacity);
    - of several copies of a new key in one call, one is reported inserted;
    - at max capacity, new keys of one bucket evict in their list's order (the reverse of
      the order they joined it, which thread timing sets), so which rows go (always
      unused ones of the lowest scores) can differ from the reference's when a bucket
      gets several new keys;
    - insert_or_assign stores one of the copies of a duplicated key (not the last).
    """

    EXPORT_BLOCK = 256

    def __init__(self, *args, deterministic: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bucket_size & (self.bucket_size - 1):
            raise ValueError("the Triton table needs a power-of-two bucket_size")
        self.deterministic = deterministic

    def _clear(self, slots: torch.Tensor) -> None:
        """As the reference's, and slots < 0 are skipped (callers may mask lanes)."""
        self.placements += 1
        n = slots.numel()
        if n:
            launch(_release_slots_kernel, _grid(n, 256), slots, n, self.keys, self.scores, self.digests, BLOCK=256)

    @property
    def insert_mode(self) -> int:
        if self.num_buckets < self.max_num_buckets:
            return GROW
        return EVICT if self.evict else KEEP

    def descriptor(self, mode: int | None = None) -> torch.Tensor:
        """(DESCRIPTOR_WORDS,) int64 on the device: where this table's storage lives, its
        bucket mask and insertion mode (default: the table's own). Valid until it grows."""
        mode = self.insert_mode if mode is None else mode
        if mode == self.insert_mode:
            return self._descriptor
        d = self._descriptor.clone()
        d[_MODE.value] = mode
        return d

    def find_or_insert(self, keys: torch.Tensor, scores: torch.Tensor, return_evicted: bool = True):
        """As the reference's. Fast mode waits for the GPU once per call, to read the count
        of evicted rows and to refuse a batch holding the reserved key (the claim then
        leaves the table as it was), or, below max capacity, to decide whether to grow.
        At max capacity with return_evicted=False it does not wait: the reserved key is
        then not refused but never stored (slot -1), as in a collection's lookup."""
        if self.deterministic:
            return super().find_or_insert(keys, scores, return_evicted)
        keys, scores = self._claim_input(keys, scores)
        if keys.numel() == 0:
            return keys.clone(), keys.bool(), Evicted.empty(self.row_dim, self.dtype, self.device)
        if self._without_waiting(return_evicted):
            slots, inserted, _, _, _ = claim(self._descriptor, keys, scores, self.bucket_size, victims=False)
            return slots, inserted, Evicted.empty(self.row_dim, self.dtype, self.device)
        mode = self.insert_mode
        lost = Evicted.empty(self.row_dim, self.dtype, self.device)
        # the reserved key is refused: the claim does nothing when the batch holds it, and
        # the flag is read at the call's one wait for the GPU
        refused = (keys == EMPTY_KEY).any()
        slots, inserted, evicted, victim_keys, victim_scores = claim(
            self._descriptor, keys, scores, self.bucket_size, refuse=refused.view(torch.int8)
        )
        if mode == EVICT:
            n_lost, refused = torch.stack([evicted.sum(dtype=torch.int64), refused.long()]).tolist()
        if bool(refused):
            raise reserved_key_error()
        if mode == GROW:
            if bool((slots == -2).any()) or self.size() > self.max_load_factor * self.capacity:
                self._grow()  # moves every row: look the whole batch up again
                again, inserted_again, lost = self.find_or_insert(keys, scores, return_evicted)
                return again, inserted | inserted_again, lost
        if mode == EVICT and n_lost:
            v = torch.nonzero_static(evicted, size=n_lost).squeeze(1)
            lost = Evicted(victim_keys[v], self.values[slots[v]].clone(), victim_scores[v])  # rows not yet overwritten
        return slots, inserted, lost

    def _claim_input(self, keys: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.placements += 1
        return self._check_keys(keys, reserved_ok=True).contiguous(), scores.to(self.device, torch.int64).contiguous()

    def _without_waiting(self, return_evicted: bool) -> bool:
        """Whether a fast insert needs no wait for the GPU: at max capacity (no growth),
        no victims returned."""
        return not (self.deterministic or return_evicted) and self.insert_mode != GROW

    def _rows_in_claim(self, return_evicted: bool) -> bool:
        """Whether a fast insert moves its rows inside the claim: without waiting, with
        device rows (a claim writing rows to host memory would write partial lines)."""
        return self._without_waiting(return_evicted) and not self.host_rows

    def find_or_insert_values(self, keys: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, return_evicted: bool = True):
        """As the reference's; rows move inside the claim where _rows_in_claim."""
        if not self._rows_in_claim(return_evicted):
            return super().find_or_insert_values(keys, scores, values, return_evicted)
        keys, scores = self._claim_input(keys, scores)
        self._check_buffer(values, keys.numel())
        if keys.numel() == 0:
            return keys.clone(), keys.bool(), Evicted.empty(self.row_dim, self.dtype, self.device)
        slots, inserted, _, _, _ = claim(
            self._descriptor, keys, scores, self.bucket_size, rows=values, row_stride=self.row_stride, victims=False
        )
        return slots, inserted, Evicted.empty(self.row_dim, self.dtype, self.device)

    def _store_rows(self, slots, inserted, values):
        self._move_rows(slots, inserted, values, to_table=True)

    def _load_rows(self, slots, values):
        self._move_rows(slots, slots, values, to_table=False)

    def _check_buffer(self, values: torch.Tensor, n: int) -> None:
        if values.dtype != self.dtype or not values.is_contiguous() or values.shape != (n, self.row_dim):
            raise ValueError("values must be a contiguous (N, row_dim) tensor of the table's dtype")

    def _move_rows(self, slots, mask, values, to_table: bool):
        self._check_buffer(values, slots.numel())
        if to_table:
            copy_rows(values, None, self.values, torch.where(mask.bool(), slots, MISSING), self.row_dim, self.host_rows)
        else:
            copy_rows(self.values, slots, values, None, self.row_dim)

    def insert_or_assign(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, return_evicted: bool = True) -> Evicted:
        if self.deterministic:
            return super().insert_or_assign(keys, rows, scores, return_evicted)
        rows = rows.to(self.device, self.dtype).contiguous()
        self._check_buffer(rows, keys.numel())
        if self._rows_in_claim(return_evicted):
            keys, scores = self._claim_input(keys, scores)
            claim(self._descriptor, keys, scores, self.bucket_size, rows=rows, row_stride=self.row_stride, victims=False, assign=True)
            return Evicted.empty(self.row_dim, self.dtype, self.device)
        slots, _, evicted = self.find_or_insert(keys, scores, return_evicted)
        # lanes not stored (slot -1) skip; of a duplicated key's copies one writes
        copy_rows(rows, None, self.values, slots, self.row_dim, self.host_rows, marks=self._marks)
        return evicted

    def _new_values(self, capacity: int) -> torch.Tensor:
        # rows padded to a multiple of ROW_ALIGN elements: aligned rows load in wide vectors
        self.row_stride = -(-self.row_dim // ROW_ALIGN.value) * ROW_ALIGN.value
        shape = (capacity, self.row_stride)
        values = host_mapped(shape, self.dtype, self.device)[1] if self.host_rows else torch.zeros(shape, dtype=self.dtype, device=self.device)
        return values[:, : self.row_dim]

    def _allocate(self, num_buckets: int) -> None:
        super()._allocate(num_buckets)
        # padded to whole 64-bit words, which probes read (_digest_words)
        self.digests = torch.zeros(-(-self.capacity // 8) * 8, dtype=torch.uint8, device=self.device)[: self.capacity]
        self._marks = torch.zeros(self.capacity, dtype=torch.int32, device=self.device)  # the last call that used a row
        # per bucket, the head of the claim's list of keys waiting to evict (zero between calls)
        self._heads = torch.zeros(num_buckets, dtype=torch.int64, device=self.device)
        self._waits = torch.zeros(1, dtype=torch.int64, device=self.device)  # the WAITS word
        words = [0] * DESCRIPTOR_WORDS.value
        for i, t in ((_KEYS, self.keys), (_DIGESTS, self.digests), (_SCORES, self.scores), (_VALUES, self.values),
                     (_MARKS, self._marks), (_HEADS, self._heads), (_WAITS, self._waits)):
            words[i.value] = t.data_ptr()
        words[_MASK.value], words[_MODE.value] = num_buckets - 1, self.insert_mode
        self._descriptor = torch.tensor(words, dtype=torch.int64, device=self.device)

    def _probe(self, keys: torch.Tensor, out: torch.Tensor | None = None, found_only: bool = False) -> torch.Tensor:
        """Slots of keys (-1 if absent), or whether each is stored; `out` receives found
        rows' values."""
        return probe(self._descriptor, keys, self.bucket_size, self.row_stride, out=out, found_only=found_only)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """As the reference's, but the reserved key is not refused: it is never found (its
        digest never matches an empty slot's)."""
        return self._probe(self._check_keys(keys, reserved_ok=True).contiguous())

    def find_values(self, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fused probe and copy: out[i] = first out.shape[1] values of key i's row where
        found (other rows untouched); returns the found mask."""
        keys = self._check_keys(keys, reserved_ok=True).contiguous()  # never found, as in find
        if out.dtype != self.dtype or not out.is_contiguous() or out.shape[0] != keys.numel():
            raise ValueError("out must be a contiguous (N, d) tensor of the table's dtype")
        return self._probe(keys, out, found_only=True)

    def _place(self, new_keys: torch.Tensor, new_scores: torch.Tensor, used_keys: torch.Tensor) -> Evicted:
        S = self.bucket_size
        buckets, keys_sorted, scores_sorted, rank = self._by_bucket(new_keys, new_scores)
        at_max = self.num_buckets >= self.max_num_buckets
        if not at_max:  # grow instead of evicting when any bucket lacks room
            free = (self.digests.view(self.num_buckets, S)[buckets] == 0).sum(1)
            if bool((rank >= free).any()):
                self._grow()
                return self._place(new_keys, new_scores, used_keys)
        M = keys_sorted.numel()
        slots = torch.empty(M, dtype=torch.int64, device=self.device)
        evicted = Evicted.empty(self.row_dim, self.dtype, self.device)
        evicting = at_max and self.evict  # else keys past a full bucket's free slots are not stored
        if evicting:
            victim_keys, victim_scores = torch.empty_like(slots), torch.empty_like(slots)
            victim = torch.empty(M, dtype=torch.int8, device=self.device)
            used = self._probe(used_keys.contiguous())
            call = new_call()
            self._marks[used[used != MISSING]] = call  # rows this call uses are never evicted
        else:
            victim_keys = victim_scores = victim = slots  # not touched without EVICT
            call = 0
        launch(
            _choose_slots_kernel, _grid(M, PLACE_BLOCK),
            buckets.contiguous(), rank.contiguous(), scores_sorted, M, self.keys, self.digests, self.scores, self._marks, call,
            slots, victim_keys, victim_scores, victim,
            BUCKET=S, BLOCK=PLACE_BLOCK, EVICT=evicting,
        )
        if evicting:
            v = victim.bool()
            evicted = Evicted(victim_keys[v], self.values[slots[v]].clone(), victim_scores[v])
        launch(
            _write_slots_kernel, _grid(M, FIND_BLOCK),
            slots, keys_sorted, scores_sorted, M, self.keys, self.scores, self.digests, BLOCK=FIND_BLOCK
        )
        return evicted

    def export(self, min_score: int | None = None):
        n_blocks = _grid(self.capacity, self.EXPORT_BLOCK)[0]
        counts = torch.empty(n_blocks, dtype=torch.int64, device=self.device)
        filt = min_score is not None
        ms = int(min_score) if filt else 0
        launch(_count_kernel, (n_blocks,), self.keys, self.scores, self.capacity, ms, counts, BLOCK=self.EXPORT_BLOCK, FILTER=filt)
        starts = torch.cumsum(counts, 0) - counts
        total = int(counts.sum())
        keys = torch.empty(total, dtype=torch.int64, device=self.device)
        scores = torch.empty(total, dtype=torch.int64, device=self.device)
        if self.host_rows:  # exported to pinned host memory, not to the device's
            values = host_mapped((total, self.row_dim), self.dtype, self.device)[1]
        else:
            values = torch.empty(total, self.row_dim, dtype=self.dtype, device=self.device)
        if total:
            launch(
                _export_kernel, (n_blocks,),
                self.keys, self.scores, self.values, self.capacity, ms, starts, keys, values, scores, self.row_dim, self.row_stride,
                BLOCK=self.EXPORT_BLOCK, DIM_BLOCK=min(64, next_power_of_2(self.row_dim)), FILTER=filt,
            )
        return keys, values, scores
