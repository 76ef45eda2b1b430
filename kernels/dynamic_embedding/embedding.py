"""Dynamic embeddings: raw int64 ids → rows of a hash table, created on first sight.

`DynamicEmbedding` is one rank's table; `ShardedDynamicEmbedding` (sharded.py) spreads rows across the
ranks of a process group by key hash and exchanges ids, rows and gradients with all-to-all.
Both have the same calls:

    emb = table.lookup(ids)                 # (N, dim); inserts unseen ids when training
    ...loss.backward() through emb (a leaf with requires_grad)...
    table.apply_gradients(ids, emb.grad)    # duplicate ids summed, one fused update

Rows are not autograd parameters: DDP and dense optimizers never see them.
"""
from dataclasses import dataclass, field, asdict

import torch

from ..backend import use_triton
from . import optimizers
from .counters import ADMISSION_REJECTIONS, ADMISSIONS, COUNTED, EVICTIONS, HITS, LOOKUPS, NUM_COUNTED, REJECTIONS
from .hashing import EMPTY_KEY, uniform_from_keys
from .optimizers import OptimizerConfig
from .batch_keys import highest_per_key, sum_by_key
from .table import ReferenceHashTable
from .table_base import MISSING, Evicted
from .triton_optimizers import fused_update
from .tiers import swap_in, tiers_of
from .probe_kernels import ROW_ALIGN
from .multi_table_kernels import SLOT_BITS, gather_embeddings

# score of a row: lru = step of last use; lfu = uses so far; epoch_lru / epoch_lfu = epoch in
# the high 32 bits, step or uses within the epoch in the low 32; custom = given by the
# caller; none = lru scores, but a full table never evicts (grow only)
SLOT_BYTES = 8 + 8 + 1 + 4  # per slot besides its row: key, score, digest, mark (always on the device)
EVICTION_POLICIES = ("lru", "lfu", "epoch_lru", "epoch_lfu", "custom", "none")
STEP_POLICIES = ("lru", "epoch_lru", "none")  # scores from the step (and epoch) alone


def table_class(backend: str, device: torch.device):
    """The table implementation: Triton on CUDA and the PyTorch reference elsewhere for
    "auto"; "reference" or "triton" force one (tests, benchmarks; Triton on CPU needs
    TRITON_INTERPRET=1)."""
    if use_triton(backend, device, "table"):
        from .triton_table import TritonHashTable

        return TritonHashTable
    return ReferenceHashTable


def make_table(
    config: "EmbeddingConfig", device: torch.device, row_dim: int | None = None, capacity: int | None = None,
    evict: bool | None = None, host_rows: bool = False, preallocate: bool = False,
):
    """The table for a config (row_dim, capacity, eviction overridable: admission counters,
    the tiers of a tiered table). host_rows: rows in pinned host memory; preallocate: all
    slots at once (tiers never grow: growing the host tier would stage every row through
    device memory, and tiers that cannot grow are moved between without waiting)."""
    cls = table_class(config.backend, device)
    kwargs = {"deterministic": config.deterministic} if cls is not ReferenceHashTable else {}
    max_capacity = capacity or config.max_capacity
    return cls(
        row_dim or config.row_dim,
        capacity=max_capacity if preallocate else min(config.capacity, max_capacity),
        max_capacity=max_capacity,
        bucket_size=config.bucket_size,
        max_load_factor=config.max_load_factor,
        device=device,
        evict=config.eviction != "none" if evict is None else evict,
        host_rows=host_rows,
        **kwargs,
    )


@dataclass(frozen=True)
class EmbeddingConfig:
    dim: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    init_std: float = 0.02
    seed: int = 0
    capacity: int = 4096  # initial slots per rank
    max_capacity: int = 1 << 22  # slots per rank; a full table evicts by score
    bucket_size: int = 32
    max_load_factor: float = 0.75
    eviction: str = "lru"  # see EVICTION_POLICIES
    backend: str = "auto"  # table implementation, see table_class
    deterministic: bool = False  # Triton table: the reference's layout bit for bit (slower inserts)
    # a new id gets a row once seen this many times (counted in a table of its own
    # capacity, allocated whole: a collection's group counts without growing it); until
    # then it is served its initial embedding without being stored
    admission_threshold: int = 1
    admission_capacity: int = 1 << 20
    read_only: bool = False  # never inserts, never bumps scores (serving, shared features)
    # rows kept in device memory; the rest, up to max_capacity, live in (pinned) host
    # memory. None: every row on the device
    device_capacity: int | None = None
    # tiered tables: a training lookup or a prefetch gives every id a device row, its
    # bucket's lowest-scored row not used by the call moving down whatever the id's own
    # score (the device tier a cache of the rows used last, its victims chosen by the
    # policy: with lfu the least used). False: an id whose device bucket holds only
    # higher-scored rows keeps or gets its row in host memory and is trained there. The
    # step-scored policies give a new id the highest score, so it changes lfu, epoch_lfu
    # and custom tables only
    promote_on_miss: bool = False

    def __post_init__(self):
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose from {EVICTION_POLICIES}")
        if self.promote_on_miss and self.device_capacity is None:
            raise ValueError("promote_on_miss applies to tiered tables: set device_capacity")
        for name in ("dim", "capacity", "max_capacity", "bucket_size", "admission_threshold", "admission_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"EmbeddingConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.capacity > self.max_capacity:
            raise ValueError(f"EmbeddingConfig.capacity {self.capacity} is above max_capacity {self.max_capacity}")
        if self.device_capacity is not None and not 1 <= self.device_capacity <= self.max_capacity:
            raise ValueError(f"EmbeddingConfig.device_capacity must lie in [1, max_capacity {self.max_capacity}], got {self.device_capacity}")
        if not 0.0 < self.max_load_factor <= 1.0:
            raise ValueError(f"EmbeddingConfig.max_load_factor must lie in (0, 1], got {self.max_load_factor}")
        if self.init_std < 0:
            raise ValueError(f"EmbeddingConfig.init_std must not be negative, got {self.init_std}")

    @property
    def row_dim(self) -> int:
        return self.dim + self.optimizer.state_dim(self.dim)

    def row_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Memory of one row as the Triton table keeps it: embedding + optimizer state,
        padded to a multiple of ROW_ALIGN values."""
        stride = -(-self.row_dim // ROW_ALIGN.value) * ROW_ALIGN.value
        return stride * torch.finfo(dtype).bits // 8

    def bytes_per_row(self, dtype: torch.dtype = torch.float32) -> int:
        """Memory of one slot as the Triton table keeps it: the row and SLOT_BYTES of key,
        score, digest and the mark of the last call that used it (the reference table
        needs less)."""
        return self.row_bytes(dtype) + SLOT_BYTES

    def table_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Memory one rank's table takes at max_capacity (rounded up to whole buckets)."""
        buckets = 1 << max(0, -(-self.max_capacity // self.bucket_size) - 1).bit_length()
        return buckets * self.bucket_size * self.bytes_per_row(dtype)

    def capacity_for_budget(self, bytes_per_rank: int, dtype: torch.dtype = torch.float32) -> int:
        """The largest max_capacity (a power-of-two number of buckets) that fits the budget."""
        buckets = bytes_per_rank // (self.bucket_size * self.bytes_per_row(dtype))
        if buckets < 1:
            raise ValueError(f"{bytes_per_rank} bytes hold no bucket of {self.bucket_size} rows of dim {self.dim}")
        return (1 << (int(buckets).bit_length() - 1)) * self.bucket_size

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "EmbeddingConfig":
        d = dict(d)
        d["optimizer"] = OptimizerConfig(**d["optimizer"])
        return EmbeddingConfig(**d)


def initial_embeddings(keys: torch.Tensor, config: EmbeddingConfig) -> torch.Tensor:
    """(N, dim) float32: the embedding an id starts from, a function of its key and the
    config's seed alone: uniform on (-s, s) with standard deviation init_std."""
    return ((2 * uniform_from_keys(keys, config.dim, config.seed) - 1) * init_scale(config)).to(torch.float32)


def epoch_use_score(old: torch.Tensor, uses: torch.Tensor, epoch) -> torch.Tensor:
    """The epoch_lfu score of ids used `uses` more times, from their scores `old` (0 where
    new): the epoch in the high 32 bits, the uses within it in the low 32 (a score of an
    earlier epoch starts the count again). `epoch`: an int, or one per id."""
    same_epoch = (old >> 32) == epoch
    return (epoch << 32) | ((torch.where(same_epoch, old & 0xFFFFFFFF, 0) + uses) & 0xFFFFFFFF)


def init_scale(config: EmbeddingConfig) -> float:
    """s of the initial uniform on (-s, s): its standard deviation is init_std."""
    return 3**0.5 * config.init_std


@dataclass
class TableStats:
    size: int = 0
    capacity: int = 0
    lookups: int = 0  # unique ids looked up
    hits: int = 0  # ids found, in either tier
    inserts: int = 0  # rows made, in either tier
    evictions: int = 0  # rows no tier kept: pushed out of a full bucket of the last tier
    rejections: int = 0  # new ids with no room in any tier (full buckets): served, not stored
    promotions: int = 0  # rows moved from host memory to the device (tiered tables)
    demotions: int = 0  # rows moved from the device to host memory
    bytes_device: int = 0
    bytes_host: int = 0
    admissions: int = 0  # new ids whose count reached the admission threshold
    admission_rejections: int = 0  # new ids served without a row: count below threshold

    @property
    def load_factor(self) -> float:
        return self.size / self.capacity if self.capacity else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_metrics(self, prefix: str = "emb_") -> dict[str, float]:
        d = asdict(self) | {"load_factor": self.load_factor, "hit_rate": self.hit_rate}
        return {prefix + k: float(v) for k, v in d.items()}


class DynamicEmbedding:
    """One rank's dynamic embedding table with a fused sparse optimizer."""

    def __init__(self, config: EmbeddingConfig, device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        # with device_capacity, `table` is the device tier and `host` the rest: a row lives
        # in one of them; lookups promote host rows, the device tier demotes what it evicts.
        # The host tier's rows are in pinned host memory, its keys and scores on the device:
        # both tiers are worked by GPU kernels
        self.host = None
        if config.device_capacity is None:
            self.table = make_table(config, self.device)
        else:
            self.table = make_table(config, self.device, capacity=config.device_capacity, evict=True, preallocate=True)
            self.host = make_table(config, self.device, host_rows=True, preallocate=True)
        # counts of ids not yet admitted, kept as the counter table's scores
        self.counters = (
            make_table(config, self.device, row_dim=1, capacity=config.admission_capacity, preallocate=True)
            if config.admission_threshold > 1
            else None
        )
        self.step = 0  # number of updates applied; the LRU clock
        self.epoch = 0  # the epoch_* policies' high bits; set by the training loop
        self._stats = TableStats()
        # counted on the device, so lookups never wait for it (order: COUNTED)
        self._counts = torch.zeros(NUM_COUNTED, dtype=torch.int64, device=self.device)
        self._dedup = None  # the last lookup's ids and their torch.unique
        self._moves = torch.zeros(2, dtype=torch.int64, device=self.device)  # tiered: promotions, demotions
        self._fused = type(self.table) is not ReferenceHashTable  # Triton: fused update kernel
        # tiered Triton tables in fast mode move rows between tiers in one pass (tiers.py)
        self._swaps = (
            self.host is not None and self._fused and not self.table.deterministic and self.counters is None
        )
        if config.promote_on_miss and not self._swaps:
            raise ValueError("promote_on_miss needs a tiered Triton table in fast mode (backend='triton', "
                             "deterministic=False) without admission_threshold")
        self._tier_stack = tiers_of([self.table], [self.host], [self._init], [None]) if self._swaps else None
        self._prefetched = None  # the ids of the last prefetch (see prefetch)
        self._group_settle = None  # the settle of a collection group this table is in (weak)

    def _settle(self) -> None:
        """Settles the pending growth check of the collection group this table is in
        (TableGroup._settle) before the table is read or written on its own."""
        settle = self._group_settle() if self._group_settle is not None else None
        if settle is not None:
            settle()

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def _tiers(self) -> tuple:
        """The tables holding rows (a row lives in one): the device's, then the host tier."""
        return (self.table,) if self.host is None else (self.table, self.host)

    def initial_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Fresh rows for keys: seeded embedding (a function of key and seed) + zero state."""
        emb = initial_embeddings(keys, self.config)
        dim = self.dim
        state = optimizers.initial_state(self.config.optimizer, keys.numel(), dim, torch.float32, keys.device)
        return torch.cat([emb, state], 1)

    def lookup(self, ids: torch.Tensor, train: bool = True, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings (N, dim) for int64 ids (N,). With train, admitted unseen ids get a row
        and every id's score is bumped; without it (or for a read_only table) nothing is
        written and ids without a row get their initial embedding. `scores` (N,): the
        scores of the custom policy (copies of an id: the highest)."""
        self._settle()
        ids = ids.to(self.device)
        if ids.numel() == 0:
            return torch.empty(0, self.dim, device=self.device)
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        # the update of the same ids (unchanged since: same version) reuses this, which
        # saves it waiting for the GPU
        self._dedup = (ids, ids._version, (uniq, inverse, counts))
        if train and not self.config.read_only:
            uscores = self._scores(uniq, counts, inverse, scores)
            if self._swaps:
                return self._swap_lookup(uniq, uscores)[inverse]
            keep = self._admit(uniq, counts) if self.counters is not None else None
            kept, kept_scores = (uniq, uscores) if keep is None else (uniq[keep], uscores[keep])
            kept_slots, inserted, evicted = self.table.find_or_insert(kept, kept_scores)
            new = inserted.nonzero().squeeze(1)
            promoted = 0
            if new.numel():
                rows, promoted = self._rows_off_device(kept[new], take=True)
                self.table.values[kept_slots[new]] = rows
            n_new = inserted.sum()
            # ids the device tier could not take (their bucket's rows all used by this call,
            # or of higher scores) keep or get a row in the host tier, trained there
            rowless = (kept_slots == MISSING).nonzero().squeeze(1)
            held, made = self._to_host(kept[rowless], kept_scores[rowless], None, evicted)
            self._counts[HITS : REJECTIONS + 1] += torch.stack([
                kept.numel() - rowless.numel() - n_new + promoted + (held & ~made).sum(),  # hits, in either tier
                n_new - promoted + made.sum(),  # inserts, in either tier
                (~held).sum(),  # rejections: ids with no row in any tier
            ])
            slots = kept_slots if keep is None else torch.full_like(uniq, MISSING).masked_scatter_(keep, kept_slots)
        else:
            slots = self.table.find(uniq)
            self._counts[HITS] += (slots != MISSING).sum()
        present = slots != MISSING
        self._counts[LOOKUPS] += uniq.numel()
        # gather only the embedding columns; ids without a device row: their host row or
        # their initial embedding
        emb = self.table.values[:, : self.dim].index_select(0, slots.clamp(min=0)).to(torch.float32)
        missing = (~present).nonzero().squeeze(1)
        if missing.numel():
            rows, in_host = self._rows_off_device(uniq[missing], take=False)
            emb[missing] = rows[:, : self.dim]
            if not train or self.config.read_only:  # (a training lookup counted its hits above)
                self._counts[HITS] += in_host
        return emb[inverse]

    def _swap_lookup(self, uniq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """A training lookup's distinct ids through swap_in: embeddings (U, dim), each id's
        row's where a tier holds it, else its initial embedding."""
        tids = torch.zeros_like(uniq, dtype=torch.int32)
        s = swap_in(self._tier_stack, uniq, tids, scores, force=self.config.promote_on_miss)
        stored = s.slots >= 0
        # each id's row as the grouped path addresses it: (tier << SLOT_BITS) | slot
        rows = torch.where(stored, s.slots, torch.where(s.held, (1 << SLOT_BITS.value) | s.host_slots, -1))
        rowless = (rows < 0).any().to(torch.int32).view(1)
        emb = torch.empty(uniq.numel(), self.dim, device=self.device)
        number = torch.arange(uniq.numel(), dtype=torch.int32, device=self.device)
        gather_embeddings(number, rows, uniq, tids, rowless, self._tier_stack.stack, self._tier_stack.seeds, self._tier_stack.scales, emb)
        n_promoted = s.promoted.sum()
        self._counts[: EVICTIONS + 1] += torch.stack([  # in COUNTED's order (a tiered table admits no ids)
            torch.tensor(uniq.numel(), device=self.device),
            (stored & ~s.inserted).sum() + n_promoted + (s.held & ~s.made).sum(),  # hits, in either tier
            (s.inserted & ~s.promoted).sum() + s.made.sum(),  # inserts, in either tier
            (~stored & ~s.held).sum(),  # rejections: ids with no row in any tier
            s.lost.sum(),
        ])
        self._moves += torch.stack([n_promoted, s.demoted.sum()])
        return emb

    @property
    def _init(self) -> tuple[int, float, int]:
        """What a row's initial embedding is a function of besides its key: seed, scale (a
        uniform on (-scale, scale) has std init_std) and dim."""
        return self.config.seed, init_scale(self.config), self.dim

    def _rows_off_device(self, keys: torch.Tensor, take: bool) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Rows for keys without a device row: their host row where the host tier stores
        one, else their initial row. take: the host rows move (they are removed there and
        counted as promotions). Returns (rows, how many came from the host: a device
        count)."""
        rows = self.initial_rows(keys)
        if self.host is None:
            return rows, 0
        slots = self.host.find(keys)
        rows = rows.to(self.host.dtype)
        self.host._load_rows(slots, rows)  # rows of keys found; the others keep their initial row
        found = slots != MISSING
        n = found.sum()
        if take:
            self.host._clear(slots[found])
            self._moves[0] += n
        return rows, n

    def _to_host(
        self, keys: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor | None, evicted: Evicted
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One call to the host tier for ids without a device row and for the rows the
        device tier evicted (demoted), so that none of them evicts another's host row. An
        id found there keeps its row (given `rows` (K, row_dim): takes it) and gets its
        score; a new one is stored with its row of `rows`, or its initial row. A full
        host bucket evicts its lowest-score row not used by the call (lost). Returns, for
        keys, whether each has a host row after the call and whether it was made by it.
        Without a host tier nothing is stored and evicted rows are lost."""
        k, n = keys.numel(), evicted.keys.numel()
        if self.host is None or k + n == 0:
            self._counts[EVICTIONS] += n
            none = torch.zeros(k, dtype=torch.bool, device=self.device)
            return none, none
        slots, inserted, lost = self.host.find_or_insert(torch.cat([keys, evicted.keys]), torch.cat([scores, evicted.scores]))
        stored = slots != MISSING
        write = (inserted | stored if rows is not None else inserted).nonzero().squeeze(1)
        if write.numel():
            incoming = torch.cat([rows if rows is not None else self.initial_rows(keys), evicted.rows.to(torch.float32)])
            self.host.values[slots[write]] = incoming[write].to(self.host.dtype)
        down = stored[k:]
        self._moves[1] += down.sum()
        self._counts[EVICTIONS] += (~down).sum() + lost.keys.numel()
        return stored[:k], inserted[:k]

    def prefetch(self, ids: torch.Tensor) -> None:
        """Moves the host rows of ids (the next batch's, looked up after this step's update)
        to the device ahead of their lookup (counted in stats().promotions), evicting none
        of the batch's rows on the device. Under the step-based policies (STEP_POLICIES)
        the batch's rows on the device get the score of the next step, which its lookup
        would give them, so that this step's inserts do not evict them first. Other
        policies keep the rows' scores, and the rows still on the device of the batch
        prefetched before (the one being trained, or about to be) are not evicted either:
        their scores do not say they are in use, and moving them down would move them
        up again at their lookup or train them in host memory. A no-op without a host
        tier."""
        self._settle()
        if self.host is None or ids.numel() == 0:
            return
        # swap_in takes copies of an id (one lane of them moves its row): no waiting for unique
        uniq = ids.to(self.device) if self._swaps else torch.unique(ids.to(self.device))
        previous, self._prefetched = self._prefetched, uniq
        host_slots, device_slots = self.host.find(uniq), self.table.find(uniq)
        in_host = host_slots != MISSING
        # every stored id takes part, so that no row of the batch on the device is evicted
        # to make room for another of its rows
        wanted = in_host | (device_slots != MISSING)
        if self.config.eviction in STEP_POLICIES:
            scores = torch.full_like(uniq, self._step_score(self.step + 1))
        else:  # rows keep their scores, on either tier
            scores = torch.where(in_host, self.host.scores[host_slots.clamp(min=0)], self.table.scores[device_slots.clamp(min=0)])
            if previous is not None:  # and the batch before keeps its device rows
                kept = self.table.find(previous)
                uniq, wanted = torch.cat([uniq, previous]), torch.cat([wanted, kept != MISSING])
                scores = torch.cat([scores, self.table.scores[kept.clamp(min=0)]])
        if self._swaps:  # ids in neither tier are left out
            s = swap_in(
                self._tier_stack, torch.where(wanted, uniq, EMPTY_KEY), torch.zeros_like(uniq, dtype=torch.int32), scores,
                force=self.config.promote_on_miss, ordered=True,
            )
            self._moves += torch.stack([s.promoted.sum(), s.demoted.sum()])
            self._counts[EVICTIONS] += s.lost.sum()
            return
        keys, scores = uniq[wanted], scores[wanted]
        slots, inserted, evicted = self.table.find_or_insert(keys, scores)
        moved = inserted.nonzero().squeeze(1)
        self.table.values[slots[moved]] = self._rows_off_device(keys[moved], take=True)[0]
        self._to_host(keys[:0], scores[:0], None, evicted)  # rows that stay behind keep their host row

    def _scores(self, uniq, counts, inverse, given) -> torch.Tensor:
        policy = self.config.eviction
        if policy == "custom":
            if given is None:
                raise ValueError("the custom eviction policy needs scores in lookup()")
            highest = highest_per_key(uniq.numel(), inverse, given)
            if self.host is None:
                return highest
            # a row that moves up from host memory keeps a higher score it had there, as a
            # row found on the device does
            slots, stored = self.host.find_scores(uniq)
            return torch.where(slots != MISSING, torch.maximum(highest, stored), highest)
        if policy in STEP_POLICIES:
            return torch.full_like(uniq, self._step_score(self.step))
        old = torch.zeros_like(uniq)  # lfu: uses so far (in either tier) + uses in this batch
        for table in self._tiers:
            slots, stored = table.find_scores(uniq)
            old = torch.where(slots != MISSING, stored, old)
        return old + counts if policy == "lfu" else epoch_use_score(old, counts, self.epoch)

    def _step_score(self, step: int) -> int:
        """The score of a row used at `step` under a step-based policy."""
        if self.config.eviction == "epoch_lru":
            return (self.epoch << 32) | (step & 0xFFFFFFFF)
        return step

    def _admit(self, uniq: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Which unique ids may have a row: those stored already (in either tier), and new
        ones whose count (kept in the counter table, bumped by this batch's uses) reaches
        the threshold."""
        keep = torch.stack([t.find(uniq) != MISSING for t in self._tiers]).any(0)
        new = (~keep).nonzero().squeeze(1)
        keep[new] = self._count_new(uniq[new], counts[new])
        return keep

    def _count_new(self, keys: torch.Tensor, uses: torch.Tensor) -> torch.Tensor:
        """Admission of distinct ids without a row, seen `uses` times in this call: adds
        the uses to their counts in the counter table; those whose count reaches the
        threshold are admitted (their counts dropped), counted in the statistics either
        way. Returns the admitted mask. (A collection's group counts the same way.)"""
        seen = self.counters.find_scores(keys)[1] + uses
        admitted = seen >= self.config.admission_threshold
        # a full counter table forgets its lowest counts
        self.counters.find_or_insert(keys[~admitted], seen[~admitted], return_evicted=False)
        self.counters.erase(keys[admitted])
        n_admitted = admitted.sum()
        self._counts[ADMISSIONS] += n_admitted
        self._counts[ADMISSION_REJECTIONS] += keys.numel() - n_admitted
        return admitted

    def apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Sums the gradients of duplicate ids and applies the optimizer to their rows."""
        self._settle()
        self.step += 1
        ids = ids.to(self.device)
        if ids.numel() == 0:
            return
        d = self._dedup
        known = d[2] if d is not None and d[0] is ids and d[1] == ids._version else None
        uniq, summed, _ = sum_by_key(ids, grads.to(self.device, torch.float32), self.table.deterministic, known)
        # a row lives in one tier: rows that stayed in the host tier (their device bucket
        # was full) train there, in place
        for table in self._tiers:
            slots = table.find(uniq)  # MISSING for ids without a row in this tier
            if self._fused:
                fused_update(self.config.optimizer, table.values, slots, summed, self.dim)
                continue
            present = slots != MISSING
            slots = slots[present]
            table.values[slots] = optimizers.update(
                self.config.optimizer, table.values[slots], summed[present], self.dim
            ).to(table.dtype)

    def stats(self) -> TableStats:
        self._settle()
        s = TableStats(**asdict(self._stats))
        for name, value in zip(COUNTED, self._counts.tolist()):
            setattr(s, name, value)
        s.size, s.capacity = self.table.size(), self.table.capacity
        s.bytes_device = self.table.capacity * self.config.bytes_per_row(self.table.dtype)
        if self.host is not None:
            s.promotions, s.demotions = self._moves.tolist()
            s.size += self.host.size()
            s.capacity += self.host.capacity
            s.bytes_host = self.host.capacity * self.config.row_bytes(self.host.dtype)
            s.bytes_device += self.host.capacity * SLOT_BYTES
        return s

    # ---- rows in and out (dump/load) ------------------------------------------------------
    def export_rows(self, min_score: int | None = None):
        """(keys, embeddings, optimizer_state, scores) of stored rows, both tiers (on the
        CPU when tiered)."""
        self._settle()
        keys, rows, scores = self.table.export(min_score)
        if self.host is not None:
            host = self.host.export(min_score)
            keys, rows, scores = (torch.cat([a.cpu(), b.cpu()]) for a, b in zip((keys, rows, scores), host))
        return keys, rows[:, : self.dim], rows[:, self.dim :], scores

    def assign(self, ids: torch.Tensor, embeddings: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Writes embedding rows from outside training (a streaming feature pipeline): ids
        (N,) distinct int64, embeddings (N, dim). An id with a row keeps its optimizer
        state and its tier; a new one gets a row with fresh optimizer state, where training
        would place it (evicting as training does). Each id's score is that of one use
        under the table's eviction policy (`scores` (N,) for the custom one). Neither
        admission nor read_only applies: the caller asked for the write."""
        self._settle()
        ids = ids.to(self.device)
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(f"assign: ids must be 1-D int64, got {tuple(ids.shape)} {ids.dtype}")
        if embeddings.shape != (ids.numel(), self.dim):
            raise ValueError(f"assign: embeddings must be ({ids.numel()}, {self.dim}), got {tuple(embeddings.shape)}")
        if ids.numel() == 0:
            return
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        if uniq.numel() != ids.numel():
            raise ValueError(f"assign: ids must be distinct; {ids.numel() - uniq.numel()} are repeated (e.g. {int(uniq[counts > 1][0])})")
        self.table._check_keys(uniq)
        self._dedup = None  # rows change: a cached lookup of these ids is stale
        emb = torch.empty_like(embeddings, dtype=torch.float32, device=self.device)
        emb[inverse] = embeddings.to(self.device, torch.float32)
        rows = self.initial_rows(uniq)
        for table in self._tiers:  # the optimizer state of ids that have a row
            stored = rows.to(table.dtype)
            table._load_rows(table.find(uniq), stored)  # rows of ids found; the others unchanged
            rows = stored.to(torch.float32)
        self.import_rows(uniq, emb, rows[:, self.dim :], self._scores(uniq, counts, inverse, scores))

    def import_rows(self, keys, embeddings, state, scores) -> None:
        """Stores rows of distinct keys with their scores, overwriting stored ones. In a
        tiered table a row stays in the tier that holds it; a new one goes to the device
        tier, or to the host tier where its device bucket has no room for it."""
        self._settle()
        keys, scores = keys.to(self.device), scores.to(self.device)
        rows = torch.cat([embeddings.to(self.device, torch.float32), state.to(self.device, torch.float32)], 1)
        if self.host is None:
            self._to_host(keys[:0], scores[:0], rows[:0], self.table.insert_or_assign(keys, rows, scores))
            return
        on_host = self.host.find(keys) != MISSING
        d = (~on_host).nonzero().squeeze(1)
        slots, _, evicted = self.table.find_or_insert(keys[d], scores[d])
        stored = slots != MISSING
        self.table.values[slots[stored]] = rows[d[stored]].to(self.table.dtype)
        rest = torch.cat([on_host.nonzero().squeeze(1), d[~stored]])
        self._to_host(keys[rest], scores[rest], rows[rest], evicted)
