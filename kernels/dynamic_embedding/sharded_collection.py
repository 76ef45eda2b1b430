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
same ids. The distinct ids come from one sort of route codes (route_kernels.py). The
owners serve what they receive as one call of their collection. `tables[name]` is each
table's own sharded view (dump, load, stats). Every rank makes the same calls with the
same tables.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collection import DynamicEmbeddingCollection
from .embedding import EmbeddingConfig, TableStats
from .sharded import ShardedDynamicEmbedding
from ..backend import use_triton
from .route_kernels import route_codes
from .route_reference import route_codes_reference
from .run_sum_kernels import sum_runs
from .table_group import lane_tables, to_device_nowait


@dataclass
class _Route:
    """One call's ids of every table: which distinct ids are sent where, and what comes back."""

    names: list[str]
    ids: tuple  # the id tensors routed (an update of the same ones reuses this)
    versions: tuple
    sizes: list[int]  # per table: ids in the call
    slot: torch.Tensor  # (Σ sizes,) each id's place among the distinct ids sent
    order: torch.Tensor  # the call's ids sorted by (owner, table, route code): their places in the call
    run: torch.Tensor  # slot of each id in that sorted order (runs of equal ids)
    send: list[int]  # per rank: distinct ids sent
    recv: list[int]  # per rank: ids received
    perm: torch.Tensor | None  # the received ids in table order (by source rank within a table); None: one table
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
        self.backend = "auto"  # the route codes' kernel: Triton on CUDA, its twin elsewhere
        self._routed: _Route | None = None
        self._static: _Route | None = None  # the routing of the last static lookup's ids
        self._lanes: tuple | None = None  # (sizes, each lane's table) of the last call

    def __getitem__(self, name: str) -> ShardedDynamicEmbedding:
        return self.tables[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    def lookup(self, ids: dict[str, torch.Tensor], train: bool = True, static: bool = False) -> dict[str, torch.Tensor]:
        """(N_f, dim) rows for each feature's int64 ids (N_f,); a collective with several ranks.
        static: these id tensors recur in later static calls as the same objects, unchanged
        (a model's catalog), on every rank alike: their routing is kept and reused, so such
        a call waits for nothing and exchanges only rows. A static call with other tensors
        routes them afresh (every rank's must change at the same call)."""
        if self.world_size == 1:
            return self.local.lookup(ids, train)
        self.local._check(ids)
        if static and self._static is not None and self._same(self._static, ids):
            r = self._static
        else:
            r = self._route(ids)
            if static:
                self._static = r
        self._routed = r
        served = self.local.lookup(r.recv_ids, train)
        if r.perm is None:
            packed = served[r.names[0]]
        else:
            packed = torch.empty(r.perm.numel(), r.width, device=self.device)
            packed[r.perm] = self._padded([served[n] for n in r.names], r.width)
        back = self._exchange(packed, r.recv, r.send)  # the distinct ids' rows, in the order sent
        rows = back[r.slot].split(r.sizes)
        return {n: part[:, : self.tables[n].dim] for n, part in zip(r.names, rows)}

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
        sent = self._sum_copies(r, [grads[n].to(self.device, torch.float32) for n in r.names])
        received = self._exchange(sent, r.send, r.recv)
        if r.perm is not None:
            received = received[r.perm]
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
        padded with zeros) and divided by the ranks (the update takes their mean); in the
        call's order where a table is deterministic, else by runs of the routing's order
        (sum_by_runs: one atomic add per run and tile of lanes) or by index_add_."""
        distinct = sum(r.send)
        if any(self.local[n].table.deterministic for n in r.names) and r.slot.numel():
            lengths = torch.zeros(distinct, dtype=torch.int64, device=self.device).index_add_(0, r.run, torch.ones_like(r.run))
            return torch.segment_reduce(self._padded(grads, r.width)[r.order], "sum", lengths=lengths, axis=0) / self.world_size
        out = torch.zeros(distinct, r.width, device=self.device)
        if self.sum_by_runs:  # each table's rows read where they lie
            sum_runs([g if g.stride(1) == 1 else g.contiguous() for g in grads], r.order, r.run, out, 1 / self.world_size)
            return out
        for g, slot in zip(grads, r.slot.split(r.sizes)):
            out[:, : g.shape[1]].index_add_(0, slot, g, alpha=1 / self.world_size)
        return out

    # ---- routing --------------------------------------------------------------------------
    @staticmethod
    def _same(r: _Route, ids: dict) -> bool:
        return list(ids) == r.names and all(a is b and a._version == v for a, b, v in zip(ids.values(), r.ids, r.versions))

    def _route(self, ids: dict[str, torch.Tensor]) -> _Route:
        """Each table's distinct ids to their owners. One sort of the lanes' route codes
        (owner, table, then the id's hash: route_kernels.py) finds the distinct ids of each
        (owner, table); one host wait: the counts of the exchange."""
        names, world, T, dev = list(ids), self.world_size, len(ids), self.device
        sizes = [ids[n].numel() for n in names]
        parts = [ids[n].to(dev, torch.int64).reshape(-1) for n in names]
        keys = torch.cat(parts) if T > 1 else parts[0]
        shift = 63 - max(1, (world * T - 1).bit_length())  # the bins' bits above it
        codes = (route_codes if use_triton(self.backend, self.device, "routing") else route_codes_reference)(
            keys, self._lane_tables(tuple(sizes)), world, T, shift,
        )
        scodes, order = torch.sort(codes, stable=True)
        skeys = keys[order]
        # copies of an id share a code; ids whose codes collide may interleave, so a key
        # that differs from the one before also begins a distinct id (then sent twice,
        # which its owner serves and sums as one)
        first = torch.ones_like(skeys, dtype=torch.bool)
        first[1:] = (scodes[1:] != scodes[:-1]) | (skeys[1:] != skeys[:-1])
        run = torch.cumsum(first, 0) - 1  # each sorted id's place among the distinct ids
        slot = torch.empty_like(run)
        slot[order] = run
        distinct_keys = torch.empty_like(skeys)
        distinct_keys[run] = skeys  # copies write the same key
        # distinct ids per (owner, table): the bins are sorted, so each is one span of the
        # lanes; the distinct ids before a span's start, by a running count
        before = torch.cat([run.new_zeros(1), run + 1])
        spans = torch.searchsorted(scodes >> shift, torch.arange(world * T + 1, device=dev))
        send_counts = before[spans].diff()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.stack([send_counts, recv_counts]).view(2, world, T).cpu()  # the call's one host wait
        send, recv = counts[0].sum(1).tolist(), counts[1].sum(1).tolist()
        received = self._exchange(distinct_keys[: sum(send)], send, recv)  # per source rank, per table
        if T == 1:
            perm, by_table = None, {names[0]: received}
        else:
            perm = self._table_order(counts[1])
            by_table = dict(zip(names, received[perm].split(counts[1].sum(0).tolist())))
        width = max(self.tables[n].dim for n in names)
        return _Route(names, tuple(ids.values()), tuple(x._version for x in ids.values()), sizes, slot, order, run,
                      send, recv, perm, by_table, width)

    def _lane_tables(self, sizes: tuple) -> torch.Tensor:
        """Each lane's table for these per-table sizes (the last call's again if the same)."""
        if self._lanes is None or self._lanes[0] != sizes:
            self._lanes = (sizes, lane_tables(sizes, self.device))
        return self._lanes[1]

    def _table_order(self, recv_counts: torch.Tensor) -> torch.Tensor:
        """The received ids' places, in table order: received from each source rank by
        table, recv_counts (world, T) on the host; out, each table's ids by source rank. Per
        (table, source) block, a place is its place in out plus the block's offset between
        the two orders, repeated over the block on the device (no wait, no sort)."""
        world, T = recv_counts.shape
        received_start = (recv_counts.reshape(-1).cumsum(0) - recv_counts.reshape(-1)).view(world, T)
        by_table = recv_counts.t().reshape(-1)  # block sizes in out's order
        out_start = by_table.cumsum(0) - by_table
        offset = received_start.t().reshape(-1) - out_start
        total = int(by_table.sum())
        moves = to_device_nowait(torch.stack([offset, by_table]).tolist(), torch.int64, self.device)
        return torch.arange(total, device=self.device) + torch.repeat_interleave(moves[0], moves[1], output_size=total)

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def _padded(self, parts: list[torch.Tensor], width: int) -> torch.Tensor:
        """Rows of several tables stacked, each padded with zeros to `width` columns."""
        if len(parts) == 1 and parts[0].shape[1] == width and parts[0].stride(1) == 1:
            return parts[0]
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
