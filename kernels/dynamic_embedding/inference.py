"""The inference table: a trained table's rows served read-only from three tiers.

    device cache   the engine's hash table (Triton on CUDA), rows of the hottest ids
    host cache     the same kind of table with its rows in pinned host memory
    disk store     every row (disk_store.DiskStore, LMDB): the source of truth

The caches hold copies of disk rows (an inclusive hierarchy): a lookup serves each id
from the highest tier holding it, copies what it read from a lower tier up into the
caches above (LRU: a row's score is the clock of its last use; a full bucket evicts its
lowest score), and serves an id found nowhere `missing`'s fallback: the row a training
lookup gives an unseen id (its seeded initial embedding), or zeros.

- Cache locking: `acquire(ids)` brings the rows of ids to the device cache and locks them
  (score LOCKED: eviction takes a lower score, never a locked row) until `release`. Locks
  count: an id locked by two batches stays locked until both release it.
- Background prefetch: `prefetch(ids)` runs `acquire` on the table's prefetch thread (and
  on a CUDA stream of its own), so the rows of a queued batch move up while the current
  one computes; the batch passes the lease to `lookup` and releases it afterwards.
- Streaming updates: `update(ids, rows)` writes the disk store and every cached copy in
  one step; `apply_dump(path)` does so with a dump's rows (an incremental dump of training).
- Consistency: every call holds the table's lock for its whole length, so a lookup's rows
  are all of one moment: the state after every update that returned before it began.
"""
import threading
import time
from contextlib import contextmanager, nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .disk_store import DiskStore
from .dump import read_manifest, read_shard
from .embedding import EmbeddingConfig, initial_embeddings, make_table
from .optimizers import OptimizerConfig
from .hashing import EMPTY_KEY
from .table_base import MISSING, reserved_key_error

LOCKED = torch.iinfo(torch.int64).max  # the score of a locked row: above every clock value
MISSING_ROWS = ("initial", "zeros")


@dataclass(frozen=True)
class InferenceConfig:
    table: EmbeddingConfig  # the trained table's config: dim, and the seed of initial rows
    device_rows: int  # rows the device cache holds
    host_rows: int = 0  # rows the host cache holds (0: no host tier)
    bucket_size: int = 32
    missing: str = "initial"  # what an id found in no tier is served: see MISSING_ROWS

    def __post_init__(self):
        if self.missing not in MISSING_ROWS:
            raise ValueError(f"missing={self.missing!r}: choose from {MISSING_ROWS}")
        if self.device_rows < self.bucket_size:
            raise ValueError(f"device_rows {self.device_rows} is less than one bucket ({self.bucket_size})")


@dataclass
class InferenceStats:
    lookups: int = 0  # distinct ids looked up (per call)
    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    missing: int = 0  # ids found in no tier: served the fallback
    device_rows: int = 0
    host_rows: int = 0
    disk_rows: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    device_evictions: int = 0  # rows pushed out of the device cache by others
    host_evictions: int = 0
    prefetched: int = 0  # ids brought up (or found up) by prefetch/acquire
    prefetch_hits: int = 0  # lookups of ids found on the device under their batch's lease
    locked: int = 0  # ids locked now
    updates: int = 0  # rows written by update/apply_dump
    update_lag_s: float = 0.0  # the last applied dump's age when applied (0 for direct updates)

    def hit_rate(self, tier: str) -> float:
        return getattr(self, f"{tier}_hits") / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {f"{t}_hit_rate": self.hit_rate(t) for t in ("device", "host", "disk")}


@dataclass
class Lease:
    """Ids whose device rows stay locked until `InferenceTable.release`."""

    keys: torch.Tensor  # distinct ids
    released: bool = False


class InferenceTable:
    def __init__(self, config: InferenceConfig, store: DiskStore, device: torch.device | str = "cpu"):
        if store.dim != config.table.dim:
            raise ValueError(f"disk store has dim {store.dim}, the table's config {config.table.dim}")
        self.config, self.store, self.device = config, store, torch.device(device)
        self.dim = config.table.dim
        # rows of embeddings alone (SGD keeps no state in the row); scores given: LRU clock or LOCKED
        cache = EmbeddingConfig(dim=self.dim, optimizer=OptimizerConfig("sgd"), bucket_size=config.bucket_size, eviction="custom",
                                backend=config.table.backend)
        self.device_cache = make_table(cache, self.device, capacity=config.device_rows, evict=True, preallocate=True)
        self.host_cache = (
            make_table(cache, self.device, capacity=config.host_rows, evict=True, host_rows=self.device.type == "cuda",
                       preallocate=True)
            if config.host_rows else None
        )
        self._lock = threading.RLock()
        self._clock = 0
        self._locks: dict[int, int] = {}  # id -> how many leases hold it
        self._locked = torch.empty(0, dtype=torch.int64, device=self.device)
        self._stats = InferenceStats()
        self._prefetcher: ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._done: torch.cuda.Event | None = None  # the last call's work, for a call on another stream

    # ---- building -------------------------------------------------------------------------
    @staticmethod
    def from_dump(dump_dir: str | Path, store_dir: str | Path, device_rows: int, host_rows: int = 0,
                  device: torch.device | str = "cpu", missing: str = "initial", bucket_size: int = 32) -> "InferenceTable":
        """A table serving a verified dump's embeddings (optimizer state left out), its disk
        store built at store_dir."""
        manifest = read_manifest(dump_dir)
        config = EmbeddingConfig.from_dict(manifest["config"])
        shards = [read_shard(Path(dump_dir), entry, config.dim) for entry in manifest["shards"]]
        keys = torch.cat([s["keys"] for s in shards]) if shards else torch.empty(0, dtype=torch.int64)
        rows = torch.cat([s["embeddings"] for s in shards]) if shards else torch.empty(0, config.dim)
        store = DiskStore.build(store_dir, keys, rows)
        table_config = InferenceConfig(config, device_rows, host_rows, bucket_size, missing)
        return InferenceTable(table_config, store, device)

    # ---- reads ----------------------------------------------------------------------------
    def lookup(self, ids: torch.Tensor, lease: Lease | None = None) -> torch.Tensor:
        """Rows (N, dim) float32 on the table's device for int64 ids (N,). `lease`: the
        batch's prefetch (its device hits are counted as prefetch hits)."""
        with self._lock, self._on_stream(None):
            ids = ids.to(self.device, torch.int64)
            if ids.numel() == 0:
                return torch.empty(0, self.dim, device=self.device)
            uniq, inverse = torch.unique(ids, return_inverse=True)
            rows, on_device = self._bring_up(uniq, lock=False)
            if lease is not None:
                self._stats.prefetch_hits += int((on_device & torch.isin(uniq, lease.keys.to(self.device))).sum())
            return rows[inverse]

    def peek(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows as lookup serves them, read from the disk store alone: the caches and the
        statistics are left as they are (bulk reads: a whole catalog)."""
        with self._lock:
            rows, found = self.store.read(ids.cpu())
            rows, found = rows.to(self.device), found.to(self.device)
            absent = (~found).nonzero().squeeze(1)
            rows[absent] = self._fallback(ids.to(self.device)[absent])
            return rows

    def acquire(self, ids: torch.Tensor) -> Lease:
        """Brings the rows of ids to the device cache (where their buckets have room) and
        locks them there until release(lease)."""
        with self._lock, self._on_stream(self._stream):
            uniq = torch.unique(ids.to(self.device, torch.int64))
            self._bring_up(uniq, lock=True)
            for k in uniq.tolist():
                self._locks[k] = self._locks.get(k, 0) + 1
            self._refresh_locked()
            self._stats.prefetched += uniq.numel()
            return Lease(uniq)

    def release(self, lease: Lease) -> None:
        """Unlocks a lease's ids (those no other lease holds): they become LRU rows again,
        as of their last use."""
        with self._lock, self._on_stream(None):
            if lease.released:
                return
            lease.released = True
            free = []
            for k in lease.keys.tolist():
                left = self._locks[k] - 1
                if left:
                    self._locks[k] = left
                else:
                    del self._locks[k]
                    free.append(k)
            self._refresh_locked()
            if free:
                keys = torch.tensor(free, dtype=torch.int64, device=self.device)
                slots = self.device_cache.find(keys)
                found = slots != MISSING
                self.device_cache.scores[slots[found]] = self._clock

    def prefetch(self, ids: torch.Tensor) -> "Future[Lease]":
        """acquire(ids) on the prefetch thread; the future's lease goes to lookup, then to
        release."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="inference-prefetch")
        return self._prefetcher.submit(self.acquire, ids)

    # ---- writes ---------------------------------------------------------------------------
    def update(self, ids: torch.Tensor, rows: torch.Tensor, lag_s: float = 0.0) -> None:
        """Writes rows (N, dim) under ids (last copy wins) to the disk store and to every
        cached copy; a lookup that begins after this returns sees them."""
        with self._lock, self._on_stream(None):
            ids = ids.to(torch.int64)
            if rows.shape != (ids.numel(), self.dim):
                raise ValueError(f"rows of shape {tuple(rows.shape)} for {ids.numel()} ids of dim {self.dim}")
            if ids.numel() == 0:
                return
            bad = ~torch.isfinite(rows).all(1)
            if bad.any():  # a NaN row would rank its item first for every request (topk)
                raise ValueError(f"{int(bad.sum())} rows hold NaN or inf values, the first under id {int(ids[bad.nonzero()[0, 0]])}")
            self.store.write(ids, rows)
            dev_ids, dev_rows = ids.to(self.device), rows.to(self.device, torch.float32)
            for cache in self._caches():
                cache.assign(dev_ids, dev_rows)  # rows of ids cached there; scores kept
            self._stats.updates += ids.numel()
            self._stats.update_lag_s = lag_s

    def apply_dump(self, path: str | Path) -> torch.Tensor:
        """Applies a (full or incremental) dump's embeddings as updates; the lag recorded is
        the dump's age. Returns the ids applied."""
        path = Path(path)
        manifest = read_manifest(path)
        if manifest["config"]["dim"] != self.dim:
            raise ValueError(f"{path}: dump of dim {manifest['config']['dim']}, table of dim {self.dim}")
        applied = [torch.empty(0, dtype=torch.int64)]
        for entry in manifest["shards"]:
            shard = read_shard(path, entry, self.dim)
            lag = time.time() - (path / "manifest.json").stat().st_mtime
            try:
                self.update(shard["keys"], shard["embeddings"], lag_s=lag)
            except ValueError as e:
                raise ValueError(f"{path / entry['file']}: {e}") from None
            applied.append(shard["keys"])
        return torch.cat(applied)

    # ---- state ----------------------------------------------------------------------------
    def stats(self) -> InferenceStats:
        with self._lock:
            s = InferenceStats(**asdict(self._stats))
            s.device_rows = self.device_cache.size()
            s.device_bytes = self.device_cache.capacity * self.device_cache.values.stride(0) * 4
            if self.host_cache is not None:
                s.host_rows = self.host_cache.size()
                s.host_bytes = self.host_cache.capacity * self.host_cache.values.stride(0) * 4
            s.disk_rows, s.disk_bytes = len(self.store), self.store.bytes_on_disk()
            s.locked = len(self._locks)
            return s

    def on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """(N,) bool: which ids the device cache holds now (tests, statistics)."""
        with self._lock:
            return self.device_cache.find(ids.to(self.device, torch.int64)) != MISSING

    def close(self, remove_files: bool = False) -> None:
        """Stops the prefetch thread and frees the caches; remove_files deletes the disk
        store's files too."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        with self._lock:
            self.device_cache = self.host_cache = None
            self.store.remove() if remove_files else self.store.close()

    # ---- inside ---------------------------------------------------------------------------
    @staticmethod
    def _insert(cache, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Copies rows of keys missing from a cache into it → (their slots, MISSING where a
        full bucket kept them out; how many rows they pushed out)."""
        size = cache.size()
        cache.insert_or_assign(keys, rows, scores, return_evicted=False)  # the rows are on the disk still
        slots = cache.find(keys)
        return slots, int((slots != MISSING).sum()) - (cache.size() - size)

    def _fallback(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows of ids in no tier (see MISSING_ROWS)."""
        if self.config.missing == "zeros" or keys.numel() == 0:
            return torch.zeros(keys.numel(), self.dim, device=self.device)
        return initial_embeddings(keys, self.config.table).to(self.device)

    def _caches(self):
        return [c for c in (self.device_cache, self.host_cache) if c is not None]

    def _refresh_locked(self) -> None:
        self._locked = torch.tensor(sorted(self._locks), dtype=torch.int64, device=self.device)

    def _bring_up(self, uniq: torch.Tensor, lock: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (U, dim) of distinct ids from the highest tier holding each, what a lower
        tier gave copied up into the caches above, scores bumped (LOCKED with `lock`, or
        for ids locked already). Returns (rows, found on the device)."""
        if uniq.numel() and uniq[0] == EMPTY_KEY:  # ascending: the reserved key would be first
            raise reserved_key_error()
        self._clock += 1
        held = torch.isin(uniq, self._locked) if self._locks else torch.zeros_like(uniq, dtype=torch.bool)
        keep = held | lock  # rows to lock: scored LOCKED once stored (below)
        scores = torch.where(keep, LOCKED, self._clock)
        dev = self.device_cache
        slots = dev.find(uniq)
        on_device = slots != MISSING
        rows = torch.zeros(uniq.numel(), self.dim, device=self.device)
        hit = on_device.nonzero().squeeze(1)
        rows[hit] = dev.values.index_select(0, slots[hit])[:, : self.dim].float()
        dev.scores[slots[hit]] = scores[hit]
        miss = (~on_device).nonzero().squeeze(1)
        n_host = n_disk = n_missing = 0
        if miss.numel():
            keys = uniq[miss]
            found = torch.zeros(keys.numel(), dtype=torch.bool, device=self.device)
            below = torch.zeros(keys.numel(), self.dim, device=self.device)
            if self.host_cache is not None:
                hslots = self.host_cache.find(keys)
                in_host = (hslots != MISSING).nonzero().squeeze(1)
                below[in_host] = self.host_cache.values.index_select(0, hslots[in_host])[:, : self.dim].to(self.device).float()
                self.host_cache.scores[hslots[in_host]] = self._clock
                found[in_host] = True
                n_host = in_host.numel()
            on_disk = (~found).nonzero().squeeze(1)
            if on_disk.numel():
                disk_rows, disk_found = self.store.read(keys[on_disk].cpu())
                disk_found = disk_found.to(self.device)
                below[on_disk] = disk_rows.to(self.device)
                got = on_disk[disk_found]
                found[got] = True
                n_disk = got.numel()
                absent = on_disk[~disk_found]
                n_missing = absent.numel()
                below[absent] = self._fallback(keys[absent])
                if self.host_cache is not None and n_disk:
                    self._stats.host_evictions += self._insert(self.host_cache, keys[got], below[got],
                                                               torch.full_like(keys[got], self._clock))[1]
            rows[miss] = below
            up = found.nonzero().squeeze(1)  # copies of stored rows go up to the device cache
            if up.numel():
                # inserted below LOCKED, so that a full bucket gives up an unlocked row or
                # none (a tie would take a locked one); then locked where they are to be
                up_keys, up_locked = keys[up], keep[miss][up]
                stored, evictions = self._insert(dev, up_keys, below[up], scores[miss][up].clamp(max=LOCKED - 1))
                self._stats.device_evictions += evictions
                dev.scores[stored[up_locked & (stored != MISSING)]] = LOCKED
        self._stats.lookups += uniq.numel()
        self._stats.device_hits += hit.numel()
        self._stats.host_hits += n_host
        self._stats.disk_hits += n_disk
        self._stats.missing += n_missing
        return rows, on_device

    @contextmanager
    def _on_stream(self, stream):
        """Runs a call's GPU work on `stream` (None: the caller's), after the last call's
        (whichever stream that ran on)."""
        if self._stream is None:  # CPU
            yield
            return
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if self._done is not None:
                torch.cuda.current_stream(self.device).wait_event(self._done)
            try:
                yield
            finally:
                self._done = torch.cuda.current_stream(self.device).record_event()
