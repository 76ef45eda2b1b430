"""The Triton hash table: the semantics of table_base.py (those the reference table keeps),
with the memory-bound work in Triton kernels. It shares no algorithm with the reference:
a differential test between the two can catch a bug in either.

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
mask, insert mode), so one launch can serve the many tables of a collection. The kernels:
probe_kernels.py (hashing, digests, descriptors, find), claim_kernels.py (the fast
insert), slot_kernels.py (deterministic placement, release, export, row copies).
"""
import weakref

import torch

from .batch_keys import highest_per_key, last_copy
from .claim_kernels import claim, new_call
from .hashing import EMPTY_KEY, bucket_of
from .host_memory import host_mapped
from .probe_kernels import (
    _DIGESTS, _HEADS, _KEYS, _MARKS, _MASK, _MODE, _SCORES, _VALUES, _WAITS, DESCRIPTOR_WORDS, EVICT, GROW, KEEP,
    ROW_ALIGN, TableStack, probe,
)
from .slot_kernels import choose_slots, copy_rows, count_rows, export_rows, gather_victims, release_slots, write_slots
from .table_base import MISSING, Evicted, EvictedBuffers, HashTableBase, reserved_key_error


class TritonHashTable(HashTableBase):
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

    def __init__(self, *args, deterministic: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bucket_size & (self.bucket_size - 1):
            raise ValueError("the Triton table needs a power-of-two bucket_size")
        self.deterministic = deterministic

    def _clear(self, slots: torch.Tensor) -> None:
        """As the reference's, and slots < 0 are skipped (callers may mask lanes)."""
        self.placements += 1
        release_slots(slots, self.keys, self.scores, self.digests)

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
        leaves the table as it was), and below max capacity to decide whether to grow.
        At max capacity with return_evicted=False it does not wait: the reserved key is
        then not refused but never stored (slot -1), as in a collection's lookup."""
        if self.deterministic:
            return self._insert_in_order(keys, scores, return_evicted)
        keys, scores = self._claim_input(keys, scores)
        if keys.numel() == 0:
            return keys.clone(), keys.bool(), Evicted.empty(self.row_dim, self.dtype, self.device)
        if self._without_waiting(return_evicted):
            slots, inserted, _, _, _ = claim(self.stack, keys, scores, self.bucket_size, victims=False)
            return slots, inserted, Evicted.empty(self.row_dim, self.dtype, self.device)
        mode = self.insert_mode
        lost = Evicted.empty(self.row_dim, self.dtype, self.device)
        # the reserved key is refused: the claim does nothing when the batch holds it, and
        # the flag is read at the call's one wait for the GPU
        refused = (keys == EMPTY_KEY).any()
        slots, inserted, evicted, victim_keys, victim_scores = claim(
            self.stack, keys, scores, self.bucket_size, refuse=refused.view(torch.int8)
        )
        if mode == EVICT:
            n_lost, refused = torch.stack([evicted.sum(dtype=torch.int64), refused.long()]).tolist()
        elif mode == GROW:  # ids without a slot in their bucket, or the load: grow
            refused, no_slot, size = torch.stack([refused.long(), (slots == -2).any().long(), self.size_on_device()]).tolist()
        if bool(refused):
            raise reserved_key_error()
        if mode == GROW:
            if no_slot or size > self.max_load_factor * self.capacity:
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
            self.stack, keys, scores, self.bucket_size, rows=values, row_stride=self.row_stride, victims=False
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
        rows = rows.to(self.device, self.dtype).contiguous()
        self._check_buffer(rows, keys.numel())
        if self.deterministic:  # the last copy of a key wins
            keys = self._check_keys(keys)
            if keys.numel() == 0:
                return Evicted.empty(self.row_dim, self.dtype, self.device)
            last = last_copy(keys)
            slots, _, evicted = self.find_or_insert(keys[last], scores.to(self.device)[last], return_evicted)
            copy_rows(rows[last].contiguous(), None, self.values, slots, self.row_dim, self.host_rows)
            return evicted
        if self._rows_in_claim(return_evicted):
            keys, scores = self._claim_input(keys, scores)
            claim(self.stack, keys, scores, self.bucket_size, rows=rows, row_stride=self.row_stride, victims=False, assign=True)
            return Evicted.empty(self.row_dim, self.dtype, self.device)
        slots, _, evicted = self.find_or_insert(keys, scores, return_evicted)
        # lanes not stored (slot -1) skip; of a duplicated key's copies one writes
        copy_rows(rows, None, self.values, slots, self.row_dim, self.host_rows, marks=self._marks)
        return evicted

    def insert_and_evict(
        self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, out: EvictedBuffers | None = None
    ) -> EvictedBuffers:
        """As the reference's. In fast mode without growth it never waits for the GPU: the
        claim marks the lanes whose slot held a victim, whose keys, scores and rows
        gather_victims appends to the buffers, counting them on the device, before the
        new rows overwrite them."""
        if self.deterministic or self.insert_mode == GROW:
            return super().insert_and_evict(keys, rows, scores, out)
        rows = rows.to(self.device, self.dtype).contiguous()
        self._check_buffer(rows, keys.numel())
        keys, scores = self._claim_input(keys, scores)
        out = self._evicted_buffers(keys.numel(), out)
        if keys.numel():
            slots, _, evicted, victim_keys, victim_scores = claim(self.stack, keys, scores, self.bucket_size)
            gather_victims(evicted, slots, victim_keys, victim_scores, self.values, out.keys, out.scores, out.rows, out.count)
            # lanes not stored (slot -1) skip; of a duplicated key's copies one writes
            copy_rows(rows, None, self.values, slots, self.row_dim, self.host_rows, marks=self._marks)
        return out

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
        # this table alone, as the kernels and their twins take tables (through a proxy: the
        # table holding itself would make a cycle that only the garbage collector frees, and
        # the table's memory with it)
        self.stack = TableStack(self._descriptor.view(1, -1), [weakref.proxy(self)])

    def _probe(self, keys: torch.Tensor, out: torch.Tensor | None = None, found_only: bool = False) -> torch.Tensor:
        """Slots of keys (-1 if absent), or whether each is stored; `out` receives found
        rows' values."""
        return probe(self.stack, keys, self.bucket_size, self.row_stride, out=out, found_only=found_only)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """As the reference's, but the reserved key is not refused: it is never found (its
        digest never matches an empty slot's)."""
        return self._probe(self._check_keys(keys, reserved_ok=True).contiguous())

    def find_scores(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As the reference's, in the probe's one launch (the reserved key: never found, as
        in find)."""
        keys = self._check_keys(keys, reserved_ok=True).contiguous()
        scores = torch.empty_like(keys)  # the probe writes every lane
        return probe(self.stack, keys, self.bucket_size, self.row_stride, scores=scores), scores

    def find_values(self, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fused probe and copy: out[i] = first out.shape[1] values of key i's row where
        found (other rows untouched); returns the found mask."""
        keys = self._check_keys(keys, reserved_ok=True).contiguous()  # never found, as in find
        if out.dtype != self.dtype or not out.is_contiguous() or out.shape[0] != keys.numel():
            raise ValueError("out must be a contiguous (N, d) tensor of the table's dtype")
        return self._probe(keys, out, found_only=True)

    def _place(self, new_keys: torch.Tensor, new_scores: torch.Tensor, used_keys: torch.Tensor) -> Evicted:
        S = self.bucket_size
        # by bucket (stable: ascending keys stay so within one), each key's rank among its
        # bucket's new keys: its place past the first of its bucket
        buckets, order = torch.sort(bucket_of(new_keys, self.num_buckets), stable=True)
        rank = torch.arange(order.numel(), device=self.device) - torch.searchsorted(buckets, buckets)
        keys_sorted, scores_sorted = new_keys[order].contiguous(), new_scores[order].contiguous()
        at_max = self.num_buckets >= self.max_num_buckets
        if not at_max:  # grow instead of evicting when any bucket lacks room
            free = (self.digests.view(self.num_buckets, S)[buckets] == 0).sum(1)
            if bool((rank >= free).any()):
                self._grow()
                return self._place(new_keys, new_scores, used_keys)
        evicted = Evicted.empty(self.row_dim, self.dtype, self.device)
        evicting = at_max and self.evict  # else keys past a full bucket's free slots are not stored
        call = 0
        if evicting:
            used = self._probe(used_keys.contiguous())
            call = new_call()
            self._marks[used[used != MISSING]] = call  # rows this call uses are never evicted
        slots, victim_keys, victim_scores, victim = choose_slots(
            buckets.contiguous(), rank.contiguous(), scores_sorted, self.keys, self.digests, self.scores, self._marks, call, S,
            evicting,
        )
        if evicting:
            v = victim.bool()
            evicted = Evicted(victim_keys[v], self.values[slots[v]].clone(), victim_scores[v])
        write_slots(slots, keys_sorted, scores_sorted, self.keys, self.scores, self.digests)
        return evicted

    def _insert_in_order(self, keys: torch.Tensor, scores: torch.Tensor, return_evicted: bool):
        """Deterministic find_or_insert: the batch deduplicated in torch (ascending keys, each
        with its copies' highest score), probed, and its new keys placed by the slot
        kernels in ascending key order within their buckets."""
        keys = self._check_keys(keys)
        self.placements += 1
        lost = Evicted.empty(self.row_dim, self.dtype, self.device)
        if keys.numel() == 0:
            return keys.clone(), keys.bool(), lost
        uniq, inverse = torch.unique(keys, return_inverse=True)
        top = highest_per_key(uniq.numel(), inverse, scores)
        slots = self._probe(uniq)
        new = slots == MISSING
        n_new = int(new.sum())
        if n_new:
            self._make_room(n_new)
            lost = self._place(uniq[new], top[new], used_keys=uniq[~new])
            slots = self._probe(uniq)  # growth moves rows; keys that lost stay absent
        stored = slots != MISSING
        self.scores[slots[stored]] = top[stored]
        if not return_evicted:
            lost = Evicted.empty(self.row_dim, self.dtype, self.device)
        return slots[inverse], (new & stored)[inverse], lost

    def assign(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Overwrites the rows (and scores, if given) of keys already stored, last copy
        winning; never inserts. Returns which keys were found."""
        keys = self._check_keys(keys).contiguous()
        rows = rows.to(self.device, self.dtype).contiguous()
        self._check_buffer(rows, keys.numel())
        if keys.numel() == 0:
            return keys.bool()
        slots = self._probe(keys)
        found = slots != MISSING
        write = torch.where(found & last_copy(keys), slots, MISSING)
        copy_rows(rows, None, self.values, write, self.row_dim, self.host_rows)
        if scores is not None:
            w = write != MISSING
            self.scores[write[w]] = scores.to(self.device, torch.int64)[w]
        return found

    def _write_sums(self, slots: torch.Tensor, inserted: torch.Tensor, sums: torch.Tensor) -> None:
        copy_rows(sums.contiguous(), None, self.values, torch.where(inserted, slots, MISSING), self.row_dim, self.host_rows)
        added = (slots != MISSING) & ~inserted
        self.values[slots[added]] += sums[added]

    def erase(self, keys: torch.Tensor) -> int:
        """Removes keys; returns how many were present."""
        keys = self._check_keys(keys).contiguous()
        if keys.numel() == 0:
            return 0
        slots = self._probe(keys)
        present = torch.unique(slots[slots != MISSING]).numel()
        self._clear(slots)  # absent keys' lanes (-1) skip
        return present

    def _grow(self) -> None:
        keys, rows, scores = self.export()
        self._allocate(min(2 * self.num_buckets, self.max_num_buckets))
        self._place(keys, scores, used_keys=keys[:0])  # a doubled power-of-two table has room for every row
        copy_rows(rows, None, self.values, self._probe(keys), self.row_dim, self.host_rows)

    def export(self, min_score: int | None = None):
        starts, total = count_rows(self.keys, self.scores, min_score)
        keys = torch.empty(total, dtype=torch.int64, device=self.device)
        scores = torch.empty(total, dtype=torch.int64, device=self.device)
        if self.host_rows:  # exported to pinned host memory, not to the device's
            values = host_mapped((total, self.row_dim), self.dtype, self.device)[1]
        else:
            values = torch.empty(total, self.row_dim, dtype=self.dtype, device=self.device)
        export_rows(self.keys, self.scores, self.values, min_score, starts, keys, values, scores)
        return keys, values, scores
