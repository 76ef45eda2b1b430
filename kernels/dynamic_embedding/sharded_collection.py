"""Named dynamic embedding tables sharded over a process group, looked up and trained
together: the tables of one model (an item table and its side features' tables).

    tables = ShardedDynamicEmbeddingCollection({"item": item_config, "genre": genre_config}, "cuda")
    rows = tables.lookup({"item": item_ids, "genre": genre_ids})     # name -> (N_f, dim)
    tables.prefetch({"item": next_item_ids})                          # tiered tables: rows up ahead
    tables.apply_gradients({"item": item_ids, ...}, {"item": grad, ...})
    dump(tables["genre"], path)                                       # each table dumps alone

This rank's tables are one DynamicEmbeddingCollection, so its tables share launches. With
several ranks a call routes the distinct ids of every table to their owners (by key hash,
as ShardedDynamicEmbedding does) in one exchange for all tables: one all-to-all of counts
(the call's one host wait), one of ids, one of rows back (rows of narrower tables padded
to the widest), and for the update one of gradients (each distinct id's copies summed
before they travel; means over ranks), the update reusing its lookup's routing for the
same ids. The owners serve what they receive as one call of their collection.
`tables[name]` is each table's own sharded view (dump, load, stats). Every rank makes the
same calls with the same tables.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collection import DynamicEmbeddingCollection
from .embedding import EmbeddingConfig, TableStats
from .sharded import ShardedDynamicEmbedding
from .hashing import shard_of
from .run_sum_kernels import sum_runs


@dataclass
class _Route:
    """One call's ids of every table: which distinct ids are sent where, and what comes back."""

    names: list[str]
    ids: tuple  # the id tensors routed (an update of the same ones reuses this)
    versions: tuple
    sizes: list[int]  # per table: ids in the call
    slot: torch.Tensor  # (Σ sizes,) each id's place among the distinct ids sent
    order: torch.Tensor  # the call's ids sorted by (owner, table, key): their places in the call
    run: torch.Tensor  # slot of each id in that sorted order (runs of equal ids)
    send: list[int]  # per rank: distinct ids sent
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
        # the gradient copies' sums by the run-sum kernel: on CUDA (tests turn it on under
        # Triton's interpreter); elsewhere index_add_, in order on a CPU
        self.sum_by_runs = self.device.type == "cuda"
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
        packed = torch.empty(r.perm.numel(), r.width, device=self.device)
        packed[r.perm] = self._padded([served[n] for n in r.names], r.width)
        back = self._exchange(packed, r.recv, r.send)  # the distinct ids' rows, in the order sent
        return {
            n: back[slot][:, : self.tables[n].dim] for n, slot in zip(r.names, r.slot.split(r.sizes))
        }

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
        sent = self._sum_copies(r, [grads[n].to(self.device, torch.float32) for n in r.names]) / self.world_size
        received = self._exchange(sent, r.send, r.recv)[r.perm]
        self.local.apply_gradients(r.recv_ids, {
            n: part[:, : self.tables[n].dim] for n, part in zip(r.names, received.split([x.numel() for x in r.recv_ids.values()]))
        })

    def prefetch(self, ids: dict[str, torch.Tensor]) -> None:
        """Moves the host rows of each table's ids (the next batch's) to the device ahead of
        their lookup, as DynamicEmbeddingCollection.prefetch; a collective with several
        ranks: each rank's distinct ids go to their owners (one exchange, as a lookup's),
        which prefetch them. The routing of the lookup before stays for its update."""
        if self.world_size == 1:
            return self.local.prefetch(ids)
        self.local._check(ids)
        self.local.prefetch(self._route(ids).recv_ids)

    def _sum_copies(self, r: _Route, grads: list[torch.Tensor]) -> torch.Tensor:
        """(distinct ids, width): each distinct id's gradient rows summed (narrower tables'
        padded with zeros); in the call's order where a table is deterministic, else by
        runs of the routing's order (sum_by_runs: one atomic add per run and tile of
        lanes) or by index_add_."""
        distinct = sum(r.send)
        if any(self.local[n].table.deterministic for n in r.names) and r.slot.numel():
            lengths = torch.zeros(distinct, dtype=torch.int64, device=self.device).index_add_(0, r.run, torch.ones_like(r.run))
            return torch.segment_reduce(self._padded(grads, r.width)[r.order], "sum", lengths=lengths, axis=0)
        out = torch.zeros(distinct, r.width, device=self.device)
        if self.sum_by_runs:
            sum_runs(self._padded(grads, r.width), r.order, r.run, out)
            return out
        for g, slot in zip(grads, r.slot.split(r.sizes)):
            out[:, : g.shape[1]].index_add_(0, slot, g)
        return out

    # ---- routing --------------------------------------------------------------------------
    @staticmethod
    def _same(r: _Route, ids: dict) -> bool:
        return list(ids) == r.names and all(a is b and a._version == v for a, b, v in zip(ids.values(), r.ids, r.versions))

    def _route(self, ids: dict[str, torch.Tensor]) -> _Route:
        """Each table's distinct ids to their owners. One host wait: the counts of the
        exchange (sorts, not torch.unique, find the distinct ids, so that nothing else
        reads a size back)."""
        names, world, T, dev = list(ids), self.world_size, len(ids), self.device
        sizes = [ids[n].numel() for n in names]
        keys = torch.cat([ids[n].to(dev) for n in names])
        tids = torch.cat([torch.full((k,), t, dtype=torch.int64, device=dev) for t, k in enumerate(sizes)])
        bins = shard_of(keys, world) * T + tids  # (owner, table)
        by_key = torch.argsort(keys, stable=True)
        order = by_key[torch.argsort(bins[by_key], stable=True)]  # by (owner, table, key)
        skeys, sbins = keys[order], bins[order]
        first = torch.ones_like(skeys, dtype=torch.bool)
        first[1:] = (skeys[1:] != skeys[:-1]) | (sbins[1:] != sbins[:-1])
        run = torch.cumsum(first, 0) - 1  # each sorted id's place among the distinct ids
        slot = torch.empty_like(run)
        slot[order] = run
        distinct_keys = torch.empty_like(skeys)
        distinct_keys[run] = skeys  # copies write the same key
        # distinct ids per (owner, table): sbins is sorted, so each bin is one span of it; the
        # distinct ids before a span's start, by a running count (no atomics on a few bins)
        before = torch.cat([run.new_zeros(1), run + 1])
        spans = torch.searchsorted(sbins, torch.arange(world * T + 1, device=dev))
        send_counts = before[spans].diff()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.stack([send_counts, recv_counts]).view(2, world, T).cpu()  # the call's one host wait
        send, recv = counts[0].sum(1).tolist(), counts[1].sum(1).tolist()
        received = self._exchange(distinct_keys[: sum(send)], send, recv)  # per source rank, per table
        recv_tids = torch.repeat_interleave(torch.arange(T, device=dev).repeat(world), recv_counts, output_size=sum(recv))
        perm = torch.argsort(recv_tids, stable=True)
        by_table = dict(zip(names, received[perm].split(counts[1].sum(0).tolist())))
        width = max(self.tables[n].dim for n in names)
        return _Route(names, tuple(ids.values()), tuple(x._version for x in ids.values()), sizes, slot, order, run,
                      send, recv, perm, by_table, width)

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def _padded(self, parts: list[torch.Tensor], width: int) -> torch.Tensor:
        """Rows of several tables stacked, each padded with zeros to `width` columns."""
        if all(p.shape[1] == width for p in parts):
            return torch.cat(parts)
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
