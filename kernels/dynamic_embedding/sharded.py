"""A dynamic embedding whose rows are spread over the ranks of a process group by key
hash; ids, rows and gradients travel by all-to-all. Each rank's share is served through a
one-feature DynamicEmbeddingCollection, so on a GPU its lookups and updates take the
grouped kernels' path (few launches, no waits for the GPU at max capacity).
"""
from dataclasses import asdict

import torch
import torch.distributed as dist

from .collection import DynamicEmbeddingCollection
from .embedding import EmbeddingConfig, TableStats
from .hashing import shard_of
from .table import sum_by_key


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
        self.tables = DynamicEmbeddingCollection({"ids": config}, device)
        self.local = self.tables["ids"]  # this rank's DynamicEmbedding: dumps, statistics, epoch

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

    def _lookup_local(self, ids: torch.Tensor, train: bool) -> torch.Tensor:
        return self.tables.lookup({"ids": ids}, train)["ids"]

    def _apply_local(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self.tables.apply_gradients({"ids": ids}, {"ids": grads})

    def lookup(self, ids: torch.Tensor, train: bool = True) -> torch.Tensor:
        if self.world_size == 1:
            return self._lookup_local(ids, train)
        recv_ids, order, inverse, send, recv = self._route(ids)
        rows = self._exchange(self._lookup_local(recv_ids, train), recv, send)
        emb = torch.empty_like(rows)
        emb[order] = rows
        return emb[inverse]

    def apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Gradients are of each rank's own loss; as with DDP's averaging of dense
        gradients, the update uses their mean over ranks."""
        if self.world_size == 1:
            return self._apply_local(ids, grads)
        recv_ids, order, inverse, send, recv = self._route(ids)
        _, summed, _ = sum_by_key(
            ids.to(self.local.device), grads.to(self.local.device, torch.float32), self.local.table.deterministic
        )
        recv_grads = self._exchange(summed[order] / self.world_size, send, recv)
        self._apply_local(recv_ids, recv_grads)

    def stats(self) -> TableStats:
        """Statistics summed over ranks."""
        s = self.local.stats()
        if self.world_size == 1:
            return s
        names = list(asdict(s))
        t = torch.tensor([getattr(s, n) for n in names], dtype=torch.float64, device=self.local.device)
        dist.all_reduce(t, group=self.group)
        return TableStats(**{n: int(v) for n, v in zip(names, t.tolist())})
