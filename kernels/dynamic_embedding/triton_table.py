"""The Triton hash table: the reference table's semantics, with the memory-bound work in
Triton kernels.

Each slot also carries a one-byte digest (the hash's top byte): a probe reads a bucket's
digests (bucket_size bytes) and loads full keys only where the digest matches. Batch
bookkeeping (deduplication, per-bucket ranks) stays in torch; slot choice, eviction
victims, writes, value gathers and export compaction are kernels. New keys are placed in
two launches, one that only reads (choose a slot) and one that only writes, so no kernel
races with itself and the layout is the reference's, bit for bit.
"""
import torch
import triton
import triton.language as tl

from .table import MISSING, Evicted, ReferenceHashTable, highest_per_key

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


@triton.jit(do_not_specialize=["bucket_mask"])
def _find_kernel(
    query_ptr, n, table_keys_ptr, digests_ptr, slot_ptr, bucket_mask,
    values_ptr, out_ptr, row_dim, out_dim, score_ptr, scores_ptr,
    BUCKET: tl.constexpr, BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, GATHER: tl.constexpr, TOUCH: tl.constexpr,
):
    """slot of each query key (or -1). GATHER: also copy the first out_dim values of found
    rows into out (rows of missing keys are left untouched). TOUCH: a found row's score
    becomes the highest score any copy of its key brings (pass 1 of fast find_or_insert)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(query_ptr + offs, mask=live, other=0)
    h = _hash(key)
    bucket = (h & bucket_mask.to(tl.uint64)).to(tl.int64)
    slots = bucket[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    digests = tl.load(digests_ptr + slots, mask=live[:, None], other=0)
    maybe = (digests == _digest(h)[:, None]) & live[:, None]
    keys = tl.load(table_keys_ptr + slots, mask=maybe, other=0)
    hit = maybe & (keys == key[:, None])
    found = tl.max(hit.to(tl.int32), axis=1) > 0
    slot = tl.where(found, tl.sum(tl.where(hit, slots, 0), axis=1), -1)
    tl.store(slot_ptr + offs, slot, mask=live)
    if TOUCH:
        tl.atomic_max(scores_ptr + slot, tl.load(score_ptr + offs, mask=live, other=0), mask=found)
    if GATHER:
        for c in range(0, out_dim, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            m = found[:, None] & (cols[None, :] < out_dim)
            row = tl.load(values_ptr + slot[:, None] * row_dim + cols[None, :], mask=m)
            tl.store(out_ptr + offs[:, None].to(tl.int64) * out_dim + cols[None, :], row, mask=m)


@triton.jit
def _choose_slots_kernel(
    bucket_ptr, rank_ptr, new_score_ptr, n, table_keys_ptr, digests_ptr, scores_ptr, protected_ptr,
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
        protected = tl.load(protected_ptr + slots, mask=live[:, None], other=1) != 0
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
    out_keys_ptr, out_values_ptr, out_scores_ptr, row_dim,
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
        row = tl.load(values_ptr + offs[:, None].to(tl.int64) * row_dim + cols[None, :], mask=m)
        tl.store(out_values_ptr + dest[:, None] * row_dim + cols[None, :], row, mask=m)


@triton.jit(do_not_specialize=["bucket_mask"])
def _claim_kernel(
    query_ptr, score_ptr, n, table_keys_ptr, digests_ptr, scores_ptr, slot_ptr, inserted_ptr, dummy_ptr, bucket_mask,
    BUCKET: tl.constexpr, BLOCK: tl.constexpr,
):
    """Fast mode, pass 2, for keys pass 1 did not find: claim the bucket's first empty slot
    with a compare-and-swap of the key. Slots only fill during this launch, so a lost swap
    re-reads the bucket and copies of one key meet in one slot. A key whose bucket is full
    gets slot -2 (placed afterwards, with eviction or growth)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    slot = tl.load(slot_ptr + offs, mask=live, other=0)
    active = live & (slot < 0)
    key = tl.load(query_ptr + offs, mask=active, other=0)
    score = tl.load(score_ptr + offs, mask=active, other=0)
    h = _hash(key)
    digest = _digest(h)
    bucket = (h & bucket_mask.to(tl.uint64)).to(tl.int64)
    slots = bucket[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    cols = tl.arange(0, BUCKET)[None, :]
    inserted = tl.zeros([BLOCK], dtype=tl.int8)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # .cg: read through L2, where other programs' writes of this launch are visible
        digests = tl.load(digests_ptr + slots, mask=active[:, None], other=0, cache_modifier=".cg")
        maybe = active[:, None] & (digests == digest[:, None])
        keys = tl.load(table_keys_ptr + slots, mask=maybe, other=0, cache_modifier=".cg")
        hit = maybe & (keys == key[:, None])
        found = tl.max(hit.to(tl.int32), axis=1) > 0
        slot = tl.where(found, tl.sum(tl.where(hit, slots, 0), axis=1), slot)
        tl.atomic_max(scores_ptr + slot, score, mask=found)  # another copy inserted it
        active = active & ~found
        # a zero digest may trail its key by a moment: the swap below tells the truth
        empty = active[:, None] & (digests == 0)
        has_empty = tl.max(empty.to(tl.int32), axis=1) > 0
        slot = tl.where(active & ~has_empty, -2, slot)
        active = active & has_empty
        target = bucket * BUCKET + tl.min(tl.where(empty, cols, BUCKET), axis=1)
        empty_key = tl.full([BLOCK], -9223372036854775807 - 1, tl.int64)
        old = tl.atomic_cas(tl.where(active, table_keys_ptr + target, dummy_ptr), tl.where(active, empty_key, 1), tl.where(active, key, 1))
        won = active & (old == empty_key)
        slot = tl.where(won, target, slot)
        inserted = tl.where(won, 1, inserted).to(tl.int8)
        tl.store(scores_ptr + target, score, mask=won)
        tl.store(digests_ptr + target, digest, mask=won)
        active = active & ~won  # a lost swap: read the bucket again
    tl.store(slot_ptr + offs, slot, mask=live)
    tl.store(inserted_ptr + offs, inserted, mask=live)


@triton.jit
def _move_rows_kernel(slot_ptr, mask_ptr, buf_ptr, values_ptr, n, row_dim, TO_TABLE: tl.constexpr, BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr):
    """TO_TABLE: values[slot[i]] = buf[i] where mask[i]; else buf[i] = values[slot[i]]
    where slot[i] >= 0."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + rows, mask=rows < n, other=-1)
    live = (rows < n) & (slot >= 0)
    if TO_TABLE:
        live = live & (tl.load(mask_ptr + rows, mask=rows < n, other=0) != 0)
    for c in range(0, row_dim, DIM_BLOCK):
        cols = c + tl.arange(0, DIM_BLOCK)
        m = live[:, None] & (cols[None, :] < row_dim)
        table = values_ptr + slot[:, None] * row_dim + cols[None, :]
        buf = buf_ptr + rows[:, None].to(tl.int64) * row_dim + cols[None, :]
        if TO_TABLE:
            tl.store(table, tl.load(buf, mask=m), mask=m)
        else:
            tl.store(buf, tl.load(table, mask=m), mask=m)


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, block)),)


class TritonHashTable(ReferenceHashTable):
    """The reference table's calls on Triton kernels. Bucket sizes must be powers of two.

    deterministic=True: results and layout equal the reference's, bit for bit.
    deterministic=False (fast): find_or_insert and insert_or_assign insert with atomic
    compare-and-swap, without sorting the batch. What differs from the reference:
    - the slot a new key lands in depends on thread timing (the set of keys does not,
      below max capacity);
    - of several copies of a new key in one call, one is reported inserted;
    - keys that find their bucket full are placed afterwards by the deterministic
      placement (eviction as in the reference, protecting every row this call uses);
    - insert_or_assign stores one of the copies of a duplicated key (not the last).
    """

    # keys per program and warps: small programs keep more memory requests in flight.
    # Sweeps at dim 128 (B keys/s): H200 8/2 2.20, 4/2 2.52, 32/4 1.78; H100 8/2 1.92,
    # 4/2 1.72, 32/4 1.37. The claim kernel: 8/2 beats 16/4 by 10-15% on both.
    FIND_BLOCK = 8
    FIND_WARPS = 2
    PLACE_BLOCK = 8
    PLACE_WARPS = 2
    EXPORT_BLOCK = 256

    def __init__(self, *args, deterministic: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bucket_size & (self.bucket_size - 1):
            raise ValueError("the Triton table needs a power-of-two bucket_size")
        self.deterministic = deterministic
        self._dummy = torch.zeros(1, dtype=torch.int64, device=self.device)

    def _clear(self, slots: torch.Tensor) -> None:
        super()._clear(slots)
        self.digests[slots] = 0  # digest 0: empty

    def find_or_insert(self, keys: torch.Tensor, scores: torch.Tensor):
        if self.deterministic:
            return super().find_or_insert(keys, scores)
        keys = self._check_keys(keys).contiguous()
        scores = scores.to(self.device, torch.int64).contiguous()
        n = keys.numel()
        inserted = torch.zeros(n, dtype=torch.int8, device=self.device)
        evicted = Evicted.empty(self.row_dim, self.dtype, self.device)
        slots = self._probe(keys, touch=scores)
        if n == 0:
            return slots, inserted.bool(), evicted
        _claim_kernel[_grid(n, self.PLACE_BLOCK)](
            keys, scores, n, self.keys, self.digests, self.scores, slots, inserted, self._dummy,
            self.num_buckets - 1, BUCKET=self.bucket_size, BLOCK=self.PLACE_BLOCK, num_warps=self.PLACE_WARPS,
        )
        full = slots == -2
        at_max = self.num_buckets >= self.max_num_buckets
        if not at_max and (bool(full.any()) or self.size() > self.max_load_factor * self.capacity):
            self._grow()  # moves every row: look the whole batch up again
            again, inserted_again, evicted = self.find_or_insert(keys, scores)
            return again, inserted.bool() | inserted_again, evicted
        if at_max and bool(full.any()):
            # full buckets: the deterministic placement, which evicts only rows this call
            # does not use, for the distinct keys that found no room
            lanes = full.nonzero().squeeze(1)
            uniq, inverse = torch.unique(keys[lanes], return_inverse=True)
            evicted = self._place(uniq, highest_per_key(uniq.numel(), inverse, scores[lanes]), used_keys=keys[~full])
            placed = self._probe(uniq)
            slots[lanes] = placed[inverse]
            first = torch.full_like(uniq, n).scatter_reduce_(0, inverse, lanes, "amin")  # one copy reports the insert
            inserted[first] = (placed != MISSING).to(torch.int8)
        return slots, inserted.bool(), evicted

    def _store_rows(self, slots, inserted, values):
        self._move_rows(slots, inserted, values, to_table=True)

    def _load_rows(self, slots, values):
        self._move_rows(slots, slots, values, to_table=False)

    def _move_rows(self, slots, mask, values, to_table: bool):
        n = slots.numel()
        if n == 0:
            return
        if values.dtype != self.dtype or not values.is_contiguous() or values.shape != (n, self.row_dim):
            raise ValueError("values must be a contiguous (N, row_dim) tensor of the table's dtype")
        _move_rows_kernel[_grid(n, self.FIND_BLOCK)](
            slots, mask.to(torch.int8) if to_table else slots, values, self.values, n, self.row_dim,
            TO_TABLE=to_table, BLOCK=self.FIND_BLOCK, DIM_BLOCK=min(128, triton.next_power_of_2(self.row_dim)),
            num_warps=self.FIND_WARPS,
        )

    def insert_or_assign(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> Evicted:
        if self.deterministic:
            return super().insert_or_assign(keys, rows, scores)
        slots, _, evicted = self.find_or_insert(keys, scores)
        self._store_rows(slots, slots >= 0, rows.to(self.device, self.dtype).contiguous())
        return evicted

    def _allocate(self, num_buckets: int) -> None:
        super()._allocate(num_buckets)
        self.digests = torch.zeros(self.capacity, dtype=torch.uint8, device=self.device)
        self._protected = torch.zeros(self.capacity, dtype=torch.uint8, device=self.device)

    def _probe(self, keys: torch.Tensor, out: torch.Tensor | None = None, touch: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of keys (-1 if absent); `out` receives found rows' values; `touch` (scores)
        raises found rows' scores."""
        n = keys.numel()
        slots = torch.empty(n, dtype=torch.int64, device=self.device)
        if n == 0:
            return slots
        gather = out is not None
        out_dim = out.shape[1] if gather else 0
        _find_kernel[_grid(n, self.FIND_BLOCK)](
            keys, n, self.keys, self.digests, slots, self.num_buckets - 1,
            self.values, out if gather else self.values, self.row_dim, out_dim,
            touch if touch is not None else slots, self.scores,
            BUCKET=self.bucket_size, BLOCK=self.FIND_BLOCK,
            DIM_BLOCK=min(128, triton.next_power_of_2(max(out_dim, 1))), GATHER=gather, TOUCH=touch is not None,
            num_warps=self.FIND_WARPS,
        )
        return slots

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return self._probe(self._check_keys(keys).contiguous())

    def find_values(self, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fused probe and copy: out[i] = first out.shape[1] values of key i's row where
        found (other rows untouched); returns the found mask."""
        keys = self._check_keys(keys).contiguous()
        if out.dtype != self.dtype or not out.is_contiguous() or out.shape[0] != keys.numel():
            raise ValueError("out must be a contiguous (N, d) tensor of the table's dtype")
        return self._probe(keys, out) != MISSING

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
            used = used[used != MISSING]
            self._protected[used] = 1  # rows this call uses are never evicted
        else:
            victim_keys = victim_scores = victim = slots  # not touched without EVICT
        _choose_slots_kernel[_grid(M, self.PLACE_BLOCK)](
            buckets.contiguous(), rank.contiguous(), scores_sorted, M, self.keys, self.digests, self.scores, self._protected,
            slots, victim_keys, victim_scores, victim,
            BUCKET=S, BLOCK=self.PLACE_BLOCK, EVICT=evicting,
        )
        if evicting:
            self._protected[used] = 0
            v = victim.bool()
            evicted = Evicted(victim_keys[v], self.values[slots[v]].clone(), victim_scores[v])
        _write_slots_kernel[_grid(M, self.FIND_BLOCK)](
            slots, keys_sorted, scores_sorted, M, self.keys, self.scores, self.digests, BLOCK=self.FIND_BLOCK
        )
        return evicted

    def export(self, min_score: int | None = None):
        n_blocks = _grid(self.capacity, self.EXPORT_BLOCK)[0]
        counts = torch.empty(n_blocks, dtype=torch.int64, device=self.device)
        filt = min_score is not None
        ms = int(min_score) if filt else 0
        _count_kernel[(n_blocks,)](self.keys, self.scores, self.capacity, ms, counts, BLOCK=self.EXPORT_BLOCK, FILTER=filt)
        starts = torch.cumsum(counts, 0) - counts
        total = int(counts.sum())
        keys = torch.empty(total, dtype=torch.int64, device=self.device)
        scores = torch.empty(total, dtype=torch.int64, device=self.device)
        values = torch.empty(total, self.row_dim, dtype=self.dtype, device=self.device)
        if total:
            _export_kernel[(n_blocks,)](
                self.keys, self.scores, self.values, self.capacity, ms, starts, keys, values, scores, self.row_dim,
                BLOCK=self.EXPORT_BLOCK, DIM_BLOCK=min(64, triton.next_power_of_2(self.row_dim)), FILTER=filt,
            )
        return keys, values, scores
