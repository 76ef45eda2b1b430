"""A dynamic embedding whose rows are spread over a process group by key hash: ids go to
their owners with all-to-all, rows come back, gradients follow (their mean over ranks)."""
from dataclasses import asdict

import torch
import torch.distributed as dist

from .embedding import DynamicEmbedding, EmbeddingConfig, TableStats
from .hashing import shard_of
from .batch_keys import sum_by_key


class ShardedDynamicEmbedding:
    """A dynamic embedding whose rows are spread over a process group by key hash.

    Every rank must make the same sequence of calls (each call is a collective), with its
    own ids; ids may repeat within and across ranks. With one rank no communication happens.
    """

    def __init__(self, config: EmbeddingConfig, device: torch.device | str = "cpu", group=None, local: "DynamicEmbedding | None" = None):
        """`local`: this rank's table when it exists already (a collection's), else a new one."""
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.local = local if local is not None else DynamicEmbedding(config, device)
        self._routed = None  # the last lookup's ids (and version) and their routing

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

    def _route_again(self, ids: torch.Tensor):
        """_route of ids; the lookup's, kept, when these are the ids it routed (the same
        tensor, unchanged since): an update then exchanges only its gradients."""
        kept = self._routed
        if kept is not None and kept[0] is ids and kept[1] == ids._version:
            return kept[2]
        return self._route(ids)

    def lookup(self, ids: torch.Tensor, train: bool = True) -> torch.Tensor:
        if self.world_size == 1:
            return self.local.lookup(ids, train)
        route = self._route(ids)
        self._routed = (ids, ids._version, route)
        recv_ids, order, inverse, send, recv = route
        rows = self._exchange(self.local.lookup(recv_ids, train), recv, send)
        emb = torch.empty_like(rows)
        emb[order] = rows
        return emb[inverse]

    def apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Gradients are of each rank's own loss; as with DDP's averaging of dense
        gradients, the update uses their mean over ranks."""
        if self.world_size == 1:
            return self.local.apply_gradients(ids, grads)
        recv_ids, order, inverse, send, recv = self._route_again(ids)
        self._routed = None
        _, summed, _ = sum_by_key(
            ids.to(self.local.device), grads.to(self.local.device, torch.float32), self.local.table.deterministic
        )
        recv_grads = self._exchange(summed[order] / self.world_size, send, recv)
        self.local.apply_gradients(recv_ids, recv_grads)

    def assign(self, ids: torch.Tensor, embeddings: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """DynamicEmbedding.assign on the ranks that own the ids (a collective: every rank
        calls it, with its own ids, distinct over all ranks)."""
        if self.world_size == 1:
            return self.local.assign(ids, embeddings, scores)
        recv_ids, order, inverse, send, recv = self._route(ids)
        if inverse.numel() and int(inverse.max()) + 1 != ids.numel():
            raise ValueError("assign: ids must be distinct")
        sent = torch.argsort(inverse)[order]  # each routed id's place in ids (they are distinct)
        recv_emb = self._exchange(embeddings.to(self.local.device, torch.float32)[sent], send, recv)
        recv_scores = None if scores is None else self._exchange(scores.to(self.local.device)[sent], send, recv)
        self.local.assign(recv_ids, recv_emb, recv_scores)

    def stats(self) -> TableStats:
        """Statistics summed over ranks."""
        s = self.local.stats()
        if self.world_size == 1:
            return s
        names = list(asdict(s))
        t = torch.tensor([getattr(s, n) for n in names], dtype=torch.float64, device=self.local.device)
        dist.all_reduce(t, group=self.group)
        return TableStats(**{n: int(v) for n, v in zip(names, t.tolist())})
