"""Dynamic embeddings: raw int64 ids → rows of a hash table, created on first sight.

`DynamicEmbedding` is one rank's table; `ShardedDynamicEmbedding` spreads rows across the
ranks of a process group by key hash and exchanges ids, rows and gradients with all-to-all.
Both have the same calls:

    emb = table.lookup(ids)                 # (N, dim); inserts unseen ids when training
    ...loss.backward() through emb (a leaf with requires_grad)...
    table.apply_gradients(ids, emb.grad)    # duplicate ids summed, one fused update

Rows are not autograd parameters: DDP and dense optimizers never see them.
"""
from dataclasses import dataclass, field, asdict

import torch
import torch.distributed as dist

from . import optimizers
from .hashing import shard_of, uniform_from_keys
from .optimizers import OptimizerConfig
from .table import MISSING, ReferenceHashTable, sum_by_key
from .triton_optimizers import fused_update

EVICTION_POLICIES = ("lru", "lfu")
BACKENDS = ("auto", "reference", "triton")


def table_class(backend: str, device: torch.device):
    """The table implementation: Triton on CUDA and the PyTorch reference elsewhere for
    "auto"; "reference" or "triton" force one (tests, benchmarks; Triton on CPU needs
    TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown table backend {backend!r}; choose from {BACKENDS}")
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        from .triton_table import TritonHashTable

        return TritonHashTable
    return ReferenceHashTable


def make_table(config: "EmbeddingConfig", device: torch.device):
    cls = table_class(config.backend, device)
    kwargs = {"deterministic": config.deterministic} if cls is not ReferenceHashTable else {}
    return cls(
        config.row_dim,
        capacity=config.capacity,
        max_capacity=config.max_capacity,
        bucket_size=config.bucket_size,
        max_load_factor=config.max_load_factor,
        device=device,
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
    eviction: str = "lru"  # score = step of last use (lru) or use count (lfu)
    backend: str = "auto"  # table implementation, see table_class
    deterministic: bool = False  # Triton table: the reference's layout bit for bit (slower inserts)

    def __post_init__(self):
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose from {EVICTION_POLICIES}")

    @property
    def row_dim(self) -> int:
        return self.dim + self.optimizer.state_dim(self.dim)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "EmbeddingConfig":
        d = dict(d)
        d["optimizer"] = OptimizerConfig(**d["optimizer"])
        return EmbeddingConfig(**d)


@dataclass
class TableStats:
    size: int = 0
    capacity: int = 0
    lookups: int = 0  # unique ids looked up
    hits: int = 0
    inserts: int = 0
    evictions: int = 0
    rejections: int = 0  # new ids that lost to a full bucket: served, not stored

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
        self.table = make_table(config, self.device)
        self.step = 0  # number of updates applied; the LRU clock
        self._stats = TableStats()
        # hits, inserts, rejections: counted on the device, so lookups never wait for it
        self._counts = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._fused = type(self.table) is not ReferenceHashTable  # Triton: fused update kernel

    @property
    def dim(self) -> int:
        return self.config.dim

    def initial_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Fresh rows for keys: seeded embedding (a function of key and seed) + zero state."""
        c = self.config
        u = uniform_from_keys(keys, c.dim, c.seed)
        emb = ((2 * u - 1) * (3**0.5 * c.init_std)).to(torch.float32)  # std = init_std
        state = optimizers.initial_state(c.optimizer, keys.numel(), c.dim, torch.float32, keys.device)
        return torch.cat([emb, state], 1)

    def lookup(self, ids: torch.Tensor, train: bool = True) -> torch.Tensor:
        """Embeddings (N, dim) for int64 ids (N,). With train, unseen ids get a row and every
        id's score is bumped; without it the table is read-only and unseen ids get their
        initial embedding without being stored."""
        ids = ids.to(self.device)
        if ids.numel() == 0:
            return torch.empty(0, self.dim, device=self.device)
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        if train:
            slots, inserted, evicted = self.table.find_or_insert(uniq, self._scores(uniq, counts))
            new = inserted.nonzero().squeeze(1)
            if new.numel():
                self.table.values[slots[new]] = self.initial_rows(uniq[new])
            present = slots != MISSING
            n_new = inserted.sum()
            self._counts += torch.stack([present.sum() - n_new, n_new, (~present).sum()])
            self._stats.evictions += evicted.keys.numel()
        else:
            slots = self.table.find(uniq)
            present = slots != MISSING
            self._counts[0] += present.sum()
        self._stats.lookups += uniq.numel()
        # gather only the embedding columns; ids without a row get their initial embedding
        emb = self.table.values[:, : self.dim].index_select(0, slots.clamp(min=0)).to(torch.float32)
        missing = (~present).nonzero().squeeze(1)
        if missing.numel():
            emb[missing] = self.initial_rows(uniq[missing])[:, : self.dim]
        return emb[inverse]

    def _scores(self, uniq: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.config.eviction == "lru":
            return torch.full_like(uniq, self.step)
        slots = self.table.find(uniq)  # lfu: use count so far + uses in this batch
        old = torch.where(slots != MISSING, self.table.scores[slots.clamp(min=0)], 0)
        return old + counts

    def apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Sums the gradients of duplicate ids and applies the optimizer to their rows."""
        self.step += 1
        ids = ids.to(self.device)
        if ids.numel() == 0:
            return
        uniq, summed, _ = sum_by_key(ids, grads.to(self.device, torch.float32), self.table.deterministic)
        slots = self.table.find(uniq)  # MISSING for rejected ids: they have no row
        if self._fused:
            fused_update(self.config.optimizer, self.table.values, slots, summed, self.dim)
            return
        present = slots != MISSING
        slots = slots[present]
        self.table.values[slots] = optimizers.update(
            self.config.optimizer, self.table.values[slots], summed[present], self.dim
        ).to(self.table.dtype)

    def stats(self) -> TableStats:
        s = TableStats(**asdict(self._stats))
        s.hits, s.inserts, s.rejections = self._counts.tolist()
        s.size, s.capacity = self.table.size(), self.table.capacity
        return s

    # ---- rows in and out (dump/load) ------------------------------------------------------
    def export_rows(self, min_score: int | None = None):
        """(keys, embeddings, optimizer_state, scores) of stored rows."""
        keys, rows, scores = self.table.export(min_score)
        return keys, rows[:, : self.dim], rows[:, self.dim :], scores

    def import_rows(self, keys, embeddings, state, scores) -> None:
        rows = torch.cat([embeddings.to(self.device, torch.float32), state.to(self.device, torch.float32)], 1)
        self.table.insert_or_assign(keys.to(self.device), rows, scores.to(self.device))


class ShardedDynamicEmbedding:
    """A dynamic embedding whose rows are spread over a process group by key hash.

    Every rank must make the same sequence of calls (each call is a collective), with its
    own ids; ids may repeat within and across ranks. With one rank no communication happens.
    """

    def __init__(self, config: EmbeddingConfig, device: torch.device | str = "cpu", group=None):
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.local = DynamicEmbedding(config, device)

    @property
    def config(self) -> EmbeddingConfig:
        return self.local.config

    @property
    def dim(self) -> int:
        return self.local.dim

    @property
    def step(self) -> int:
        return self.local.step

    def _route(self, ids: torch.Tensor):
        """Unique ids sorted by owner, and the exchange that sends them there."""
        ids = ids.to(self.local.device)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        owner = shard_of(uniq, self.world_size)
        owner, order = torch.sort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        recv_ids = self._exchange(uniq[order], send, recv)
        return recv_ids, order, inverse, send, recv

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def lookup(self, ids: torch.Tensor, train: bool = True) -> torch.Tensor:
        if self.world_size == 1:
            return self.local.lookup(ids, train)
        recv_ids, order, inverse, send, recv = self._route(ids)
        rows = self._exchange(self.local.lookup(recv_ids, train), recv, send)
        emb = torch.empty_like(rows)
        emb[order] = rows
        return emb[inverse]

    def apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Gradients are of each rank's own loss; as with DDP's averaging of dense
        gradients, the update uses their mean over ranks."""
        if self.world_size == 1:
            return self.local.apply_gradients(ids, grads)
        recv_ids, order, inverse, send, recv = self._route(ids)
        _, summed, _ = sum_by_key(
            ids.to(self.local.device), grads.to(self.local.device, torch.float32), self.local.table.deterministic
        )
        recv_grads = self._exchange(summed[order] / self.world_size, send, recv)
        self.local.apply_gradients(recv_ids, recv_grads)

    def stats(self) -> TableStats:
        """Statistics summed over ranks."""
        s = self.local.stats()
        if self.world_size == 1:
            return s
        names = list(asdict(s))
        t = torch.tensor([getattr(s, n) for n in names], dtype=torch.float64, device=self.local.device)
        dist.all_reduce(t, group=self.group)
        return TableStats(**{n: int(v) for n, v in zip(names, t.tolist())})
