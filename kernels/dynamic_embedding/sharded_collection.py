"""Named dynamic embedding tables sharded over a process group, looked up and trained
together: the tables of one model (an item table and its side features' tables).

    tables = ShardedDynamicEmbeddingCollection({"item": item_config, "genre": genre_config}, "cuda")
    rows = tables.lookup({"item": item_ids, "genre": genre_ids})     # name -> (N_f, dim)
    tables.apply_gradients({"item": item_ids, ...}, {"item": grad, ...})
    dump(tables["genre"], path)                                       # each table dumps alone

This rank's tables are one DynamicEmbeddingCollection, so its tables share launches. With
several ranks a call routes the distinct ids of every table to their owners (by key hash,
as ShardedDynamicEmbedding does) in one exchange for all tables: one all-to-all of counts
(one host wait), one of ids, one of rows back (rows of narrower tables padded to the
widest), and for the update one of gradients (means over ranks), the update reusing its
lookup's routing for the same ids. The owners serve what they receive as one call of
their collection. `tables[name]` is each table's own sharded view (dump, load, stats).
Every rank makes the same calls with the same tables.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collection import DynamicEmbeddingCollection
from .embedding import EmbeddingConfig, TableStats
from .sharded import ShardedDynamicEmbedding
from .hashing import shard_of
from .table import sum_by_key


@dataclass
class _Route:
    """One call's distinct ids of every table, where they go and what comes back."""

    names: list[str]
    ids: tuple  # the id tensors routed (an update of the same ones reuses this)
    versions: tuple
    inverse: list[torch.Tensor]  # per table: each id's distinct id
    sizes: list[int]  # per table: distinct ids
    order: torch.Tensor  # the distinct ids of all tables, sorted by (owner, table)
    send: list[int]  # per rank: ids sent
    recv: list[int]  # per rank: ids received
    perm: torch.Tensor  # the received ids sorted by table (stable)
    recv_ids: dict  # per table: the ids this rank serves
    width: int  # the widest table's dim (rows travel padded to it)


class ShardedDynamicEmbeddingCollection:
    def __init__(self, configs: dict[str, EmbeddingConfig], device: torch.device | str = "cpu", group=None):
        self.local = DynamicEmbeddingCollection(configs, device)
        self.tables = {n: ShardedDynamicEmbedding(c, device, group, local=self.local[n]) for n, c in configs.items()}
        first = next(iter(self.tables.values()))
        self.world_size, self.rank, self.group = first.world_size, first.rank, group
        self.device = first.local.device
        self._routed: _Route | None = None

    def __getitem__(self, name: str) -> ShardedDynamicEmbedding:
        return self.tables[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    def lookup(self, ids: dict[str, torch.Tensor], train: bool = True) -> dict[str, torch.Tensor]:
        """(N_f, dim) rows for each feature's int64 ids (N_f,); a collective with several ranks."""
        if self.world_size == 1:
            return self.local.lookup(ids, train)
        self.local._check(ids)
        r = self._route(ids)
        self._routed = r
        served = self.local.lookup(r.recv_ids, train)
        packed = torch.zeros(r.perm.numel(), r.width, device=self.device)
        packed[r.perm] = self._padded([served[n] for n in r.names], r.width)
        back = self._exchange(packed, r.recv, r.send)  # in the order sent
        rows = torch.empty_like(back)
        rows[r.order] = back
        out = {}
        for n, part, inverse in zip(r.names, rows.split(r.sizes), r.inverse):
            out[n] = part[:, : self.tables[n].dim][inverse]
        return out

    def apply_gradients(self, ids: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step per table in ids, with the mean of the ranks' gradients."""
        if self.world_size == 1:
            return self.local.apply_gradients(ids, grads)
        self.local._check(ids)
        if set(grads) != set(ids):
            raise KeyError(f"gradients for {sorted(grads)} but ids for {sorted(ids)}")
        r, self._routed = self._routed, None
        if r is None or not self._same(r, ids):
            r = self._route(ids)
        summed = [
            sum_by_key(ids[n].to(self.device), grads[n].to(self.device, torch.float32), self.local[n].table.deterministic)[1]
            for n in r.names
        ]
        sent = self._padded(summed, r.width)[r.order] / self.world_size
        received = self._exchange(sent, r.send, r.recv)[r.perm]
        self.local.apply_gradients(r.recv_ids, {
            n: part[:, : self.tables[n].dim] for n, part in zip(r.names, received.split([x.numel() for x in r.recv_ids.values()]))
        })

    # ---- routing --------------------------------------------------------------------------
    @staticmethod
    def _same(r: _Route, ids: dict) -> bool:
        return list(ids) == r.names and all(a is b and a._version == v for a, b, v in zip(ids.values(), r.ids, r.versions))

    def _route(self, ids: dict[str, torch.Tensor]) -> _Route:
        names, world, T = list(ids), self.world_size, len(ids)
        uniq, inverse = zip(*(torch.unique(ids[n].to(self.device), return_inverse=True) for n in names))
        keys = torch.cat(uniq)
        tids = torch.repeat_interleave(torch.arange(T, device=self.device), torch.tensor([u.numel() for u in uniq], device=self.device))
        bins = shard_of(keys, world) * T + tids  # (owner, table)
        bins, order = torch.sort(bins, stable=True)
        send_counts = torch.bincount(bins, minlength=world * T)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.stack([send_counts, recv_counts]).view(2, world, T).cpu()  # the call's one host wait
        send, recv = counts[0].sum(1).tolist(), counts[1].sum(1).tolist()
        received = self._exchange(keys[order], send, recv)  # per source rank, per table
        recv_tids = torch.repeat_interleave(torch.arange(T).repeat(world), counts[1].reshape(-1)).to(self.device)
        perm = torch.argsort(recv_tids, stable=True)
        by_table = dict(zip(names, received[perm].split(counts[1].sum(0).tolist())))
        width = max(self.tables[n].dim for n in names)
        return _Route(names, tuple(ids.values()), tuple(x._version for x in ids.values()), list(inverse),
                      [u.numel() for u in uniq], order, send, recv, perm, by_table, width)

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def _padded(self, parts: list[torch.Tensor], width: int) -> torch.Tensor:
        """Rows of several tables stacked, each padded with zeros to `width` columns."""
        out = torch.zeros(sum(p.shape[0] for p in parts), width, device=self.device)
        at = 0
        for p in parts:
            out[at : at + p.shape[0], : p.shape[1]] = p
            at += p.shape[0]
        return out

    def set_epoch(self, epoch: int) -> None:
        self.local.set_epoch(epoch)

    def stats(self) -> dict[str, TableStats]:
        """Each table's statistics summed over ranks (a collective)."""
        return {n: t.stats() for n, t in self.tables.items()}
