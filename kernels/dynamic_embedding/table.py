"""The hash table behind a dynamic embedding: the pure-PyTorch reference engine.

Storage is bucketed like HierarchicalKV: `capacity = num_buckets * bucket_size` slots, a key
lives only in bucket `bucket_of(key)`, and each slot holds a key, a 64-bit score and one row
of `row_dim` values (embedding followed by optimizer state). Calls address rows by slot
index; a slot index stays valid until the next call that inserts (growth re-hashes).

Stated semantics, for every backend:
- keys are int64; `EMPTY_KEY` (int64 min) is reserved and refused.
- duplicate keys in one call are resolved once: every copy gets the same slot.
- new keys of one call are placed in ascending key order within their bucket, so the
  table's layout is a function of the call sequence alone (deterministic).
- a full bucket, at `max_capacity`, evicts its lowest-score rows not used by this call
  (ties broken by slot index); a new key whose score is below that victim's is not stored.
  With evict=False (grow only) a new key that finds its bucket full there is not stored.
  Evicted keys, rows and scores are returned so a lower tier can take them.
- below `max_capacity` the table grows (doubling) instead of evicting, when a bucket is
  full or the load factor would pass `max_load_factor`.
"""
from dataclasses import dataclass

import torch

from .hashing import EMPTY_KEY, bucket_of
from .host_memory import host_mapped

MISSING = -1  # slot index returned for a key that is not stored


def reserved_key_error() -> ValueError:
    return ValueError(f"key {EMPTY_KEY} is reserved (marks an empty slot)")


def highest_per_key(n_keys: int, inverse: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(n_keys,) int64: the highest of the scores whose inverse index names each key."""
    out = torch.full((n_keys,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=inverse.device)
    return out.scatter_reduce_(0, inverse, scores.to(inverse.device, torch.int64), "amax")


def sum_by_key(
    keys: torch.Tensor, rows: torch.Tensor, deterministic: bool = True, dedup: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique keys ascending, sum of each key's rows, inverse index). deterministic: rows
    are added in a fixed order on every device; else on CUDA with atomics (index_add_),
    much faster, in an order that varies in the last bits. dedup: torch.unique's (keys,
    inverse, counts) of `keys`, when known."""
    uniq, inverse, counts = dedup or torch.unique(keys, return_inverse=True, return_counts=True)
    if deterministic and keys.is_cuda and keys.numel():
        order = torch.argsort(inverse, stable=True)
        return uniq, torch.segment_reduce(rows[order], "sum", lengths=counts, axis=0), inverse
    sums = rows.new_zeros(uniq.numel(), *rows.shape[1:]).index_add_(0, inverse, rows)  # in order on CPU
    return uniq, sums, inverse


def _nth_occurrence(keys: torch.Tensor, reduce: str) -> torch.Tensor:
    """(N,) bool: True at the first (amin) or last (amax) copy of each key."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    pick = torch.zeros(uniq.numel(), dtype=torch.int64, device=keys.device)
    pick.scatter_reduce_(0, inverse, torch.arange(keys.numel(), device=keys.device), reduce, include_self=False)
    mask = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
    mask[pick] = True
    return mask


def _first_occurrence(keys: torch.Tensor) -> torch.Tensor:
    return _nth_occurrence(keys, "amin")


def _last_occurrence(keys: torch.Tensor) -> torch.Tensor:
    return _nth_occurrence(keys, "amax")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass
class Evicted:
    keys: torch.Tensor  # (E,) int64
    rows: torch.Tensor  # (E, row_dim)
    scores: torch.Tensor  # (E,) int64

    @staticmethod
    def empty(row_dim: int, dtype: torch.dtype, device) -> "Evicted":
        return Evicted(
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, row_dim, dtype=dtype, device=device),
            torch.empty(0, dtype=torch.int64, device=device),
        )


@dataclass
class EvictedBuffers:
    """insert_and_evict's evicted rows, in buffers of one entry per key of the call: the
    first `count` entries are the evicted keys, rows and scores, the rest undefined.
    count: (1,) int64 on the table's device, so that no caller waits for the GPU to
    learn it (HierarchicalKV's insert_and_evict returns its count the same way)."""

    keys: torch.Tensor  # (N,) int64
    rows: torch.Tensor  # (N, row_dim)
    scores: torch.Tensor  # (N,) int64
    count: torch.Tensor  # (1,) int64

    @staticmethod
    def allocate(n: int, row_dim: int, dtype: torch.dtype, device) -> "EvictedBuffers":
        return EvictedBuffers(
            torch.empty(n, dtype=torch.int64, device=device),
            torch.empty(n, row_dim, dtype=dtype, device=device),
            torch.empty(n, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
        )

    def evicted(self) -> Evicted:
        """The evicted rows as an Evicted (reads the count: waits for the GPU)."""
        e = int(self.count)
        return Evicted(self.keys[:e], self.rows[:e], self.scores[:e])


class ReferenceHashTable:
    """Bucketed int64 → row table in plain PyTorch (CPU or CUDA); the test oracle."""

    deterministic = True

    def __init__(
        self,
        row_dim: int,
        capacity: int = 1024,
        max_capacity: int | None = None,
        bucket_size: int = 32,
        max_load_factor: float = 0.75,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        evict: bool = True,
        host_rows: bool = False,
    ):
        if bucket_size <= 0 or row_dim <= 0:
            raise ValueError("bucket_size and row_dim must be positive")
        self.row_dim = row_dim
        # counts calls that may move keys between slots (inserts, erasures, growth): a
        # slot looked up earlier is still the key's while it is unchanged
        self.placements = 0
        self.bucket_size = bucket_size
        self.max_load_factor = max_load_factor
        self.evict = evict
        # rows in pinned host memory, reached in place from a CUDA device (host_memory.py);
        # keys and scores stay on the device
        self.host_rows = host_rows
        self.dtype = dtype
        self.device = torch.device(device)
        # power-of-two bucket counts: doubling splits each bucket in two, so a re-hash
        # never overflows a bucket
        num_buckets = _pow2_at_least(-(-capacity // bucket_size))
        max_capacity = max(max_capacity or 0, num_buckets * bucket_size)
        self.max_num_buckets = _pow2_at_least(-(-max_capacity // bucket_size))
        self._allocate(num_buckets)

    # ---- storage -------------------------------------------------------------------------
    def _allocate(self, num_buckets: int) -> None:
        self.placements += 1
        cap = num_buckets * self.bucket_size
        self.num_buckets = num_buckets
        self.keys = torch.full((cap,), EMPTY_KEY, dtype=torch.int64, device=self.device)
        self.scores = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self.values = self._new_values(cap)

    def _new_values(self, capacity: int) -> torch.Tensor:
        if self.host_rows:
            return host_mapped((capacity, self.row_dim), self.dtype, self.device)[1]
        return torch.zeros(capacity, self.row_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.keys.numel()

    @property
    def max_capacity(self) -> int:
        return self.max_num_buckets * self.bucket_size

    def size(self) -> int:
        return int(self.size_on_device())

    def size_on_device(self) -> torch.Tensor:
        """The number of stored keys as a () int64 tensor on the table's device (no wait
        for the GPU until it is read)."""
        return (self.keys != EMPTY_KEY).sum()

    def load_factor(self) -> float:
        return self.size() / self.capacity

    def _check_keys(self, keys: torch.Tensor, reserved_ok: bool = False) -> torch.Tensor:
        """keys on the table's device; refuses the reserved key unless reserved_ok (a read
        that never matches it), which saves waiting for the GPU to check."""
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise TypeError(f"keys must be a 1-D int64 tensor, got {keys.dtype} {tuple(keys.shape)}")
        if not reserved_ok and keys.numel() and bool((keys == EMPTY_KEY).any()):
            raise reserved_key_error()
        return keys.to(self.device)

    # ---- lookups -------------------------------------------------------------------------
    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, or MISSING. Never inserts, never changes scores."""
        keys = self._check_keys(keys)
        if keys.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        buckets = bucket_of(keys, self.num_buckets)
        bucket_keys = self.keys.view(self.num_buckets, self.bucket_size)[buckets]  # (N, S)
        match = bucket_keys == keys[:, None]
        slot = buckets * self.bucket_size + match.to(torch.int8).argmax(1)
        return torch.where(match.any(1), slot, torch.full_like(slot, MISSING))

    def find_scores(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot of each key or MISSING, its stored score or 0). Changes nothing."""
        slots = self.find(keys)
        return slots, torch.where(slots != MISSING, self.scores[slots.clamp(min=0)], 0)

    def find_or_insert(
        self, keys: torch.Tensor, scores: torch.Tensor, return_evicted: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, Evicted]:
        """Slot of each key, inserting missing ones with the given score.

        `scores` (N,) int64 is the score each key's row gets (for existing keys the caller's
        policy already folded the old score in). Returns (slots, inserted, evicted); a slot
        is MISSING only for a new key that lost to every row of its full bucket. A new row's
        values are unspecified (a reused slot keeps old values) until the caller writes them.
        return_evicted=False: evicted rows are dropped (evicted is empty), as
        HierarchicalKV's find_or_insert does; the Triton table's fast mode then does not
        wait for the GPU at max capacity (see TritonHashTable).
        """
        keys = self._check_keys(keys)
        self.placements += 1
        evicted = Evicted.empty(self.row_dim, self.dtype, self.device)
        if keys.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty.bool(), evicted
        uniq, inverse = torch.unique(keys, return_inverse=True)  # ascending keys
        uscores = highest_per_key(uniq.numel(), inverse, scores)  # a duplicate key's highest
        slots = self.find(uniq)
        missing = slots == MISSING
        new_keys = uniq[missing]
        if new_keys.numel():
            self._make_room(new_keys.numel())
            evicted = self._place(new_keys, uscores[missing], used_keys=uniq[~missing])
            slots = self.find(uniq)  # growth may have moved rows; losers stay MISSING
        found = slots != MISSING
        self.scores[slots[found]] = uscores[found]
        inserted = torch.zeros_like(missing)
        inserted[missing] = slots[missing] != MISSING
        if not return_evicted:
            evicted = Evicted.empty(self.row_dim, self.dtype, self.device)
        return slots[inverse], inserted[inverse], evicted

    def find_or_insert_values(
        self, keys: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, return_evicted: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, Evicted]:
        """find_or_insert whose `values` (N, row_dim) go both ways, as HierarchicalKV's: a
        new key is stored with its row of values (of several copies, the one reported
        inserted), then every row of values receives its key's stored row (rows of keys
        not stored keep their input). Returns find_or_insert's result."""
        slots, inserted, evicted = self.find_or_insert(keys, scores, return_evicted)
        if self.deterministic and keys.numel():  # the first copy of a new key is the one
            inserted = inserted & _first_occurrence(keys)
        self._store_rows(slots, inserted, values)
        self._load_rows(torch.where(inserted, MISSING, slots), values)  # inserted rows hold their values already
        return slots, inserted, evicted

    def _store_rows(self, slots, inserted, values):
        self.values[slots[inserted]] = values[inserted]

    def _load_rows(self, slots, values):
        ok = slots != MISSING
        values[ok] = self.values[slots[ok]]

    # ---- writes --------------------------------------------------------------------------
    def insert_or_assign(
        self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, return_evicted: bool = True
    ) -> Evicted:
        """Stores rows under keys (last copy wins for duplicates), inserting where missing.
        Returns the rows evicted (none with return_evicted=False, see find_or_insert)."""
        keys = self._check_keys(keys)
        if keys.numel() == 0:
            return Evicted.empty(self.row_dim, self.dtype, self.device)
        last = _last_occurrence(keys)
        slots, _, evicted = self.find_or_insert(keys[last], scores.to(self.device)[last], return_evicted)
        ok = slots != MISSING
        self.values[slots[ok]] = rows.to(self.device, self.dtype)[last][ok]
        return evicted

    def insert_and_evict(
        self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, out: EvictedBuffers | None = None
    ) -> EvictedBuffers:
        """insert_or_assign, its evicted rows returned in buffers with their count on the
        device (EvictedBuffers): `out`'s, of at least N entries (a caller calling often
        keeps them), or new ones. The reserved key is skipped, not refused: refusing it
        would take a wait for the GPU, which this call exists to avoid."""
        keys = keys.to(self.device, torch.int64).reshape(-1)
        out = self._evicted_buffers(keys.numel(), out)
        kept = keys != EMPTY_KEY
        lost = self.insert_or_assign(keys[kept], rows.to(self.device)[kept], scores.to(self.device)[kept])
        e = lost.keys.numel()
        out.keys[:e], out.rows[:e], out.scores[:e] = lost.keys, lost.rows, lost.scores
        out.count.fill_(e)
        return out

    def _evicted_buffers(self, n: int, out: EvictedBuffers | None) -> EvictedBuffers:
        """`out` checked, its count zeroed; or new buffers of n entries."""
        if out is None:
            return EvictedBuffers.allocate(n, self.row_dim, self.dtype, self.device)
        if out.keys.shape[0] < n or out.scores.shape[0] < n or out.rows.shape[0] < n or out.rows.shape[1:] != (self.row_dim,):
            raise ValueError(f"out holds {out.keys.shape[0]} entries of rows {tuple(out.rows.shape[1:])}: the call needs {n} of ({self.row_dim},)")
        if out.rows.dtype != self.dtype or not out.rows.is_contiguous() or out.count.shape != (1,):
            raise ValueError("out.rows must be contiguous rows of the table's dtype and out.count a (1,) int64 tensor")
        out.count.zero_()
        return out

    def assign(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Overwrites the rows (and scores, if given) of keys already stored, last copy
        winning; never inserts. Returns which keys were found."""
        keys = self._check_keys(keys)
        slots = self.find(keys)
        found = slots != MISSING
        last = _last_occurrence(keys)
        write = found & last
        self.values[slots[write]] = rows.to(self.device, self.dtype)[write]
        if scores is not None:
            self.scores[slots[write]] = scores.to(self.device, torch.int64)[write]
        return found

    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor, scores: torch.Tensor) -> Evicted:
        """Adds deltas to the rows of keys (copies of a key summed); a missing key is
        inserted with its summed delta as its row."""
        keys = self._check_keys(keys)
        if keys.numel() == 0:
            return Evicted.empty(self.row_dim, self.dtype, self.device)
        uniq, summed, inverse = sum_by_key(keys, deltas.to(self.device, self.dtype), self.deterministic)
        slots, inserted, evicted = self.find_or_insert(uniq, highest_per_key(uniq.numel(), inverse, scores))
        ok = slots != MISSING
        self.values[slots[inserted]] = summed[inserted]
        old = ok & ~inserted
        self.values[slots[old]] += summed[old]
        return evicted

    def erase(self, keys: torch.Tensor) -> int:
        """Removes keys; returns how many were present."""
        slots = self.find(keys)
        slots = torch.unique(slots[slots != MISSING])
        self._clear(slots)
        return slots.numel()

    def _clear(self, slots: torch.Tensor) -> None:
        self.placements += 1
        self.keys[slots] = EMPTY_KEY
        self.scores[slots] = 0

    def export(self, min_score: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, rows, scores) of every stored row, or of rows whose score >= min_score,
        in slot order."""
        keep = self.keys != EMPTY_KEY
        if min_score is not None:
            keep &= self.scores >= min_score
        return self.keys[keep], self.values[keep], self.scores[keep]

    # ---- placement -----------------------------------------------------------------------
    def _make_room(self, new_rows: int) -> None:
        """Grows until new_rows more rows keep the load factor; counting the stored rows
        (a pass over every key) only while the table can still grow."""
        if self.num_buckets >= self.max_num_buckets:
            return
        target = self.size() + new_rows
        while target > self.max_load_factor * self.capacity and self.num_buckets < self.max_num_buckets:
            self._grow()

    def _grow(self) -> None:
        keys, rows, scores = self.export()
        self._allocate(min(self.num_buckets * 2, self.max_num_buckets))
        evicted = self._place(keys, scores, used_keys=keys[:0])
        assert evicted.keys.numel() == 0, "doubling a power-of-two table cannot overflow"
        self.values[self.find(keys)] = rows

    def _place(
        self, new_keys: torch.Tensor, new_scores: torch.Tensor, used_keys: torch.Tensor
    ) -> Evicted:
        """Puts sorted, unique, absent keys into free slots of their buckets, growing the
        table or evicting where a bucket is full. Rows of `used_keys` are never evicted."""
        S = self.bucket_size
        buckets, keys_sorted, scores_sorted, rank = self._by_bucket(new_keys, new_scores)
        bucket_keys = self.keys.view(self.num_buckets, S)[buckets]  # (M, S)
        free = bucket_keys == EMPTY_KEY
        n_free = free.sum(1)
        overflow = rank >= n_free
        if bool(overflow.any()) and self.num_buckets < self.max_num_buckets:
            self._grow()
            return self._place(new_keys, new_scores, used_keys)

        slots_sorted = torch.full_like(keys_sorted, MISSING)
        # the r-th new key of a bucket takes the bucket's r-th free slot
        nth_free = (free & (torch.cumsum(free, 1) == (rank + 1)[:, None])).to(torch.int8).argmax(1)
        fits = ~overflow
        slots_sorted[fits] = buckets[fits] * S + nth_free[fits]

        evicted = Evicted.empty(self.row_dim, self.dtype, self.device)
        if self.evict and bool(overflow.any()):
            evicted, victim_slots = self._evict(
                buckets[overflow], rank[overflow] - n_free[overflow], scores_sorted[overflow], used_keys
            )
            slots_sorted[overflow] = victim_slots
        ok = slots_sorted != MISSING
        self.keys[slots_sorted[ok]] = keys_sorted[ok]
        self.scores[slots_sorted[ok]] = scores_sorted[ok]
        return evicted

    def _by_bucket(self, keys: torch.Tensor, scores: torch.Tensor):
        """(buckets, keys, scores, rank) sorted by bucket, keys ascending within a bucket
        (they come in ascending), rank = position among the bucket's new keys."""
        buckets, order = torch.sort(bucket_of(keys, self.num_buckets), stable=True)
        _, counts = torch.unique_consecutive(buckets, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(buckets.numel(), device=self.device) - torch.repeat_interleave(starts, counts)
        return buckets, keys[order].contiguous(), scores[order].contiguous(), rank

    def _evict(
        self, buckets: torch.Tensor, nth: torch.Tensor, scores: torch.Tensor, used_keys: torch.Tensor
    ) -> tuple[Evicted, torch.Tensor]:
        """For each overflowing key, the slot of its bucket's nth lowest-score evictable row,
        or MISSING where that row's score beats the key's own."""
        S = self.bucket_size
        protected = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        used = self.find(used_keys)
        protected[used[used != MISSING]] = True
        bucket_slots = buckets[:, None] * S + torch.arange(S, device=self.device)  # (M, S)
        cand = self.scores[bucket_slots]
        blocked = protected[bucket_slots] | (self.keys[bucket_slots] == EMPTY_KEY)
        # order candidates by (score, slot); blocked slots sort last
        big = torch.iinfo(torch.int64).max
        cand = torch.where(blocked, torch.full_like(cand, big), cand)
        _, by_score = torch.sort(cand, dim=1, stable=True)
        n_evictable = (~blocked).sum(1)
        pick = nth.clamp(max=S - 1)
        victim = bucket_slots.gather(1, by_score.gather(1, pick[:, None])).squeeze(1)
        ok = (nth < n_evictable) & (self.scores[victim] <= scores)
        victim = torch.where(ok, victim, torch.full_like(victim, MISSING))
        v = victim[ok]
        evicted = Evicted(self.keys[v].clone(), self.values[v].clone(), self.scores[v].clone())
        return evicted, victim
