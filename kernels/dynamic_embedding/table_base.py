"""What every hash table backend shares: the semantics its calls keep, its configuration
and storage shape, argument checks, the growth policy, and the types calls return. The
algorithms (probing, placement, eviction, growth, row copies) are each backend's own:
ReferenceHashTable (table.py, plain PyTorch, the test oracle) and TritonHashTable
(triton_table.py), so that a differential test between them can catch a bug in either.

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

from .batch_keys import first_copy, highest_per_key, sum_by_key
from .hashing import EMPTY_KEY

MISSING = -1  # slot index returned for a key that is not stored


def reserved_key_error() -> ValueError:
    return ValueError(f"key {EMPTY_KEY} is reserved (marks an empty slot)")


def pow2_at_least(n: int) -> int:
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


class HashTableBase:
    """A bucketed int64 → row table's configuration and bookkeeping. Backends implement
    _new_values (the rows' storage), _grow (doubling, re-placing every row), the row moves
    _store_rows, _load_rows and _write_sums (accumulate's rows), and the calls: find,
    find_scores, find_or_insert, insert_or_assign, assign, erase, export."""

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
        num_buckets = pow2_at_least(-(-capacity // bucket_size))
        max_capacity = max(max_capacity or 0, num_buckets * bucket_size)
        self.max_num_buckets = pow2_at_least(-(-max_capacity // bucket_size))
        self._allocate(num_buckets)

    def _allocate(self, num_buckets: int) -> None:
        """Empty storage for num_buckets buckets: every slot's key (EMPTY_KEY), score and
        row (the backend's _new_values); a backend adds what else its slots carry."""
        self.placements += 1
        self.num_buckets = num_buckets
        capacity = num_buckets * self.bucket_size
        self.keys = torch.full((capacity,), EMPTY_KEY, dtype=torch.int64, device=self.device)
        self.scores = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.values = self._new_values(capacity)

    def _new_values(self, capacity: int) -> torch.Tensor:
        """(capacity, row_dim) zero rows, in pinned host memory where host_rows."""
        raise NotImplementedError

    def _grow(self) -> None:
        """Doubles the bucket count (up to the maximum), every row re-placed."""
        raise NotImplementedError

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

    def _make_room(self, new_rows: int) -> None:
        """Grows until new_rows more rows keep the load factor; counting the stored rows
        (a pass over every key) only while the table can still grow."""
        if self.num_buckets >= self.max_num_buckets:
            return
        target = self.size() + new_rows
        while target > self.max_load_factor * self.capacity and self.num_buckets < self.max_num_buckets:
            self._grow()

    def find_or_insert_values(
        self, keys: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, return_evicted: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, "Evicted"]:
        """find_or_insert whose `values` (N, row_dim) go both ways, as HierarchicalKV's: a
        new key is stored with its row of values (of several copies, the one reported
        inserted), then every row of values receives its key's stored row (rows of keys
        not stored keep their input). Returns find_or_insert's result."""
        slots, inserted, evicted = self.find_or_insert(keys, scores, return_evicted)
        if self.deterministic and keys.numel():  # the first copy of a new key is the one
            inserted = inserted & first_copy(keys.to(self.device))
        self._store_rows(slots, inserted, values)
        self._load_rows(torch.where(inserted, MISSING, slots), values)  # inserted rows hold their values already
        return slots, inserted, evicted

    def _store_rows(self, slots: torch.Tensor, inserted: torch.Tensor, values: torch.Tensor) -> None:
        """The rows of values whose lanes are inserted, to their slots."""
        raise NotImplementedError

    def _load_rows(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """The stored rows of slots (not MISSING) into values."""
        raise NotImplementedError

    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor, scores: torch.Tensor) -> "Evicted":
        """Adds deltas to the rows of keys (copies of a key summed); a missing key is
        inserted with its summed delta as its row."""
        keys = self._check_keys(keys)
        if keys.numel() == 0:
            return Evicted.empty(self.row_dim, self.dtype, self.device)
        uniq, summed, inverse = sum_by_key(keys, deltas.to(self.device, self.dtype), self.deterministic)
        slots, inserted, evicted = self.find_or_insert(uniq, highest_per_key(uniq.numel(), inverse, scores))
        self._write_sums(slots, inserted, summed)
        return evicted

    def _write_sums(self, slots: torch.Tensor, inserted: torch.Tensor, sums: torch.Tensor) -> None:
        """accumulate's rows: an inserted slot's row is its sum, a stored one's grows by it
        (slots MISSING: not stored, skipped)."""
        raise NotImplementedError

    def insert_and_evict(
        self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, out: "EvictedBuffers | None" = None
    ) -> "EvictedBuffers":
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

    def _evicted_buffers(self, n: int, out: "EvictedBuffers | None") -> "EvictedBuffers":
        """`out` checked, its count zeroed; or new buffers of n entries."""
        if out is None:
            return EvictedBuffers.allocate(n, self.row_dim, self.dtype, self.device)
        if out.keys.shape[0] < n or out.scores.shape[0] < n or out.rows.shape[0] < n or out.rows.shape[1:] != (self.row_dim,):
            raise ValueError(f"out holds {out.keys.shape[0]} entries of rows {tuple(out.rows.shape[1:])}: the call needs {n} of ({self.row_dim},)")
        if out.rows.dtype != self.dtype or not out.rows.is_contiguous() or out.count.shape != (1,):
            raise ValueError("out.rows must be contiguous rows of the table's dtype and out.count a (1,) int64 tensor")
        out.count.zero_()
        return out
