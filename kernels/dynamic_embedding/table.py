"""The hash table behind a dynamic embedding: the pure-PyTorch reference engine, the test
oracle of the Triton table. The semantics it keeps, its configuration and the types its
calls return: table_base.py."""
import torch

from .batch_keys import highest_per_key, last_copy
from .hashing import EMPTY_KEY, bucket_of
from .host_memory import host_mapped
from .table_base import MISSING, Evicted, HashTableBase


class ReferenceHashTable(HashTableBase):
    """Bucketed int64 → row table in plain PyTorch (CPU or CUDA); the test oracle."""

    # ---- storage -------------------------------------------------------------------------
    def _new_values(self, capacity: int) -> torch.Tensor:
        if self.host_rows:
            return host_mapped((capacity, self.row_dim), self.dtype, self.device)[1]
        return torch.zeros(capacity, self.row_dim, dtype=self.dtype, device=self.device)

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
        last = last_copy(keys)
        slots, _, evicted = self.find_or_insert(keys[last], scores.to(self.device)[last], return_evicted)
        ok = slots != MISSING
        self.values[slots[ok]] = rows.to(self.device, self.dtype)[last][ok]
        return evicted

    def assign(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Overwrites the rows (and scores, if given) of keys already stored, last copy
        winning; never inserts. Returns which keys were found."""
        keys = self._check_keys(keys)
        slots = self.find(keys)
        found = slots != MISSING
        last = last_copy(keys)
        write = found & last
        self.values[slots[write]] = rows.to(self.device, self.dtype)[write]
        if scores is not None:
            self.scores[slots[write]] = scores.to(self.device, torch.int64)[write]
        return found

    def _write_sums(self, slots: torch.Tensor, inserted: torch.Tensor, sums: torch.Tensor) -> None:
        self.values[slots[inserted]] = sums[inserted]
        old = (slots != MISSING) & ~inserted
        self.values[slots[old]] += sums[old]

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
