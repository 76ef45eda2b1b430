"""A group of dynamic embedding tables of one row layout, looked up and trained in one
launch per kernel (a DynamicEmbeddingCollection's groups).

Tables that are Triton tables in fast mode, with float32 rows (fusable), and that share
dim, optimizer, bucket size and whether they have a host tier form a group (tiered ones a
TieredTableGroup, tiered_group.py), whatever their eviction
policies and admission thresholds. A group of step-scored tables (lru, epoch_lru, none)
passes one score per table to the claim; where a member counts uses (lfu, epoch_lfu) or
is scored by the caller (custom, `lookup(..., scores=)`), the claim gets a score per id,
computed on the device from the ids' stored scores, which the probe returns. A member with
an admission threshold counts its ids in its counter table first: the claim may find an
id whose count is below the threshold but not insert it (admission_gate); after the
claim, the ids it did not find are settled (admit: counts stored or dropped).

A group's lookup numbers its lanes (one id of one table each) by distinct id, then
launches each kernel once for all its tables over the distinct ids (lookup and claim of
empty slots, evictions, row initialisation, counting) and once over the lanes (gather,
and initial embeddings of ids without a row). Its update sorts the lanes by distinct id,
so that the copies of an id sit together, then sums each distinct id's gradients and runs
the optimizer in one kernel. None of this waits for the GPU: below max capacity, a
training lookup copies whether a table must grow to the host without waiting, and the
group's next call (the update, as a rule) reads it and grows where it says so
(_settle); only a growth waits.

A group differs from its tables' own lookups in two ways: the reserved key (int64 min)
is served its initial embedding and never stored instead of raising, and the gradients
of an id's copies are summed in another order (the same sum to rounding).
"""
import weakref
from dataclasses import dataclass
from itertools import accumulate

import torch

from .counters import HITS, REJECTIONS
from .embedding import STEP_POLICIES, DynamicEmbedding, epoch_use_score
from .multi_table_kernels import (
    Gradients, TableStack, admission_gate, admit, gather_embeddings, growth_checks, init_rows, number_segments, segment_rows,
    update_segments,
)
from .claim_kernels import claim
from .probe_kernels import GROW, READ_ONLY, probe
from .triton_table import TritonHashTable

# members whose scores are a function of the table alone (one score per table and call);
# the others (lfu, epoch_lfu, custom) score each id: see TableGroup._key_scores
TABLE_SCORED = STEP_POLICIES
MAX_GROUP = 127  # tables per group (the statistics kernel loops over a group's tables)


STEP_SCORED, LFU, EPOCH_LFU, CUSTOM = 0, 1, 2, 3  # how a member scores ids (device codes)
POLICY_CODES = {"lfu": LFU, "epoch_lfu": EPOCH_LFU, "custom": CUSTOM}


# the lowest score: a claim raises a stored score to a key's, never lowers it, so a key
# given this one leaves its row's score as it was (read-only members, rows only kept)
LOWEST_SCORE = torch.iinfo(torch.int64).min


def fusable(emb: DynamicEmbedding) -> bool:
    """Whether a table can join a group: a TableGroup, or with a host tier a
    TieredTableGroup."""
    t = emb.table
    return isinstance(t, TritonHashTable) and not t.deterministic and t.dtype == torch.float32


def to_device_nowait(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the GPU: a non-blocking copy
    from pageable memory, which the driver stages before the call returns (pinning a
    buffer first would cost more than the copy)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def lane_tables(sizes: tuple, device: torch.device) -> torch.Tensor:
    """For lanes of T tables laid end to end, sizes[t] lanes of table t: the (N,) int32
    table of each lane; nothing waits for the GPU."""
    total = sum(sizes)
    if len(sizes) == 1:  # one table: every lane is table 0's
        return torch.zeros(total, dtype=torch.int32, device=device)
    # repeated on the device from counts copied without waiting (sizes vary per call)
    tables = torch.arange(len(sizes), dtype=torch.int32, device=device)
    return torch.repeat_interleave(tables, to_device_nowait(list(sizes), torch.int64, device), output_size=total)


@dataclass
class _Routing:
    """A call's lanes numbered by segment (copies of one id of one table share one); a
    lookup's is kept for the update of the same ids. Per-segment tensors have N entries,
    the first `count` used."""

    ids: tuple  # the id tensors looked up (the update checks it gets the same ones)
    number: torch.Tensor  # (N,) int32: each lane's segment
    count: torch.Tensor  # (1,) int32: number of segments
    keys: torch.Tensor  # each segment's id
    tids: torch.Tensor  # each segment's table
    rows: torch.Tensor  # each segment's packed row (table << SLOT_BITS | slot); < 0: no row
    rowless: torch.Tensor  # (1,) set if some segment has no row
    # set by a lookup after its claim: the tables' placement counts (the update checks that
    # nothing moved since)
    placements: tuple = ()


@dataclass
class _PendingGrowth:
    """A training lookup's growth check, settled later (TableGroup._settle): the growing
    members, their checks on the way to the host, and what claiming again needs."""

    growing: list
    checks: tuple
    routing: "_Routing"
    scored: tuple
    barred: torch.Tensor  # segments the claim again may find but not insert: all but those without a slot


@dataclass
class _Stored:
    """Per segment of a call, before its claim (N entries, the first `count` used)."""

    tids: torch.Tensor  # its table (0 past the count)
    slots: torch.Tensor  # its slot in its table; < 0: not stored
    old: torch.Tensor | None  # its stored score (0 if not stored); None where no member counts uses
    uses: torch.Tensor  # the call's copies of its id


@dataclass
class _Gate:
    """Admission before a claim, per segment (N entries, the first `count` used)."""

    tids: torch.Tensor  # its table (the kernels read only the first `count`)
    found: torch.Tensor  # its slot in its table's counter table; < 0: not counted yet
    seen: torch.Tensor  # its count: the stored one plus the call's copies
    barred: torch.Tensor  # the claim may find it but not insert it (below the threshold)


class TableGroup:
    """Tables of one row layout, addressed by one stack of descriptors."""

    def __init__(self, names: list[str], members: list[DynamicEmbedding]):
        self.names, self.members = names, members
        first = members[0]
        # the storage's device, with its index ("cuda" alone compares unequal to a tensor's
        # "cuda:0": every id tensor would take the converting path)
        self.device = first.table.keys.device
        self.dim = first.dim
        self.bucket_size, self.optimizer = first.config.bucket_size, first.config.optimizer
        self._seeds = to_device_nowait([m._init[0] for m in members], torch.int64, self.device)
        self._scales = to_device_nowait([m._init[1] for m in members], torch.float64, self.device)
        self._inserting = to_device_nowait([not m.config.read_only for m in members], torch.int64, self.device)
        self._policies = [m.config.eviction for m in members]
        self.per_key_scores = any(p not in TABLE_SCORED for p in self._policies)
        self.counting = any(p in ("lfu", "epoch_lfu") for p in self._policies)  # scores from stored uses
        self.admitting = any(m.counters is not None for m in members)
        self._admits = to_device_nowait([m.counters is not None for m in members], torch.int8, self.device)
        self._thresholds = to_device_nowait([m.config.admission_threshold for m in members], torch.int64, self.device)
        # how each member scores ids in the claim (a read-only member: its step score, never)
        codes = [STEP_SCORED if m.config.read_only else POLICY_CODES.get(p, STEP_SCORED) for m, p in zip(members, self._policies)]
        self._score_codes = to_device_nowait(codes, torch.int64, self.device)
        # the members' one code where they share it: _key_scores then takes it alone, with
        # no per-lane choice among the codes and no copy of per-member scores to the device
        self._uniform_code = codes[0] if len(set(codes)) == 1 else None
        # members count into rows of one tensor, so one add serves them all
        self._counts = torch.stack([m._counts for m in members])
        for i, m in enumerate(members):
            m._counts = self._counts[i]
        self._cache: dict = {}
        self.empty = torch.empty(0, dtype=torch.int64, device=self.device)  # ids of a feature not in a call
        self.routing: _Routing | None = None
        self._pending: _PendingGrowth | None = None  # a growth check to settle
        self._check_buffer: tuple | None = None  # (pinned (T, 2) int64, event): growth checks on their way to the host
        for m in members:  # the members' own calls settle it first (weakly: no cycle)
            m._group_settle = weakref.WeakMethod(self._settle)

    def _cached(self, name: str, key, make):
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            hit = (key, make())
            self._cache[name] = hit
        return hit[1]

    def _storage(self) -> tuple:
        return tuple((m.table.keys.data_ptr(), m.table.num_buckets, m.table.insert_mode) for m in self.members)

    def _placements(self) -> tuple:
        return tuple(m.table.placements for m in self.members)

    def _stack(self) -> TableStack:
        return self._cached("desc", self._storage(), lambda: TableStack(torch.stack([
            m.table.descriptor(READ_ONLY if m.config.read_only else None) for m in self.members
        ]), [m.table for m in self.members]))

    def _lanes(self, sizes: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """For these per-table counts: the table of each lane, and where each table's lanes
        begin (T + 1 values, the last one past the end)."""
        return self._cached("lanes", sizes, lambda: (
            lane_tables(sizes, self.device), to_device_nowait(list(accumulate(sizes, initial=0)), torch.int64, self.device)
        ))

    def _table_scores(self) -> tuple[torch.Tensor, int]:
        def score(m: DynamicEmbedding) -> int:
            if m.config.read_only:
                return LOWEST_SCORE
            if m.config.eviction == "epoch_lru":
                return (m.epoch << 32) | (m.step & 0xFFFFFFFF)
            return m.step
        scores = [score(m) for m in self.members]
        # scores move together from call to call: the device keeps them less the lowest
        # one, the offset the claim adds (a launch argument costs the host less than a copy)
        offset = min((s for s in scores if s != LOWEST_SCORE), default=0)
        base = [s if s == LOWEST_SCORE else s - offset for s in scores]
        return self._cached("scores", tuple(base), lambda: to_device_nowait(base, torch.int64, self.device)), offset

    def _stored(self, r: _Routing) -> "_Stored":
        """Before the claim: where each segment's id is stored in its table, and its copies."""
        # segments past the count: table 0's (never written; _key_scores indexes by them)
        tids = torch.where(torch.arange(r.keys.numel(), device=self.device) < r.count, r.tids, 0)
        old = torch.zeros_like(r.keys) if self.counting else None  # lfu scores read them
        slots = probe(self._stack(), r.keys, self.bucket_size, 0, tids, count=r.count, scores=old)
        return _Stored(tids, slots, old, self._uses(r))

    def _uses(self, r: _Routing) -> torch.Tensor:
        """Each segment's copies in the call (N entries)."""
        uses = torch.zeros_like(r.keys)
        uses.index_add_(0, r.number.long(), torch.ones_like(r.number, dtype=torch.int64))  # bincount waits for the GPU
        return uses

    def _key_scores(self, r: _Routing, stored: "_Stored", lane_scores: torch.Tensor | None) -> torch.Tensor:
        """Each segment's score for the claim, as its table's DynamicEmbedding scores an id:
        the table's step score; lfu: the uses stored plus this call's copies; epoch_lfu: the
        same within the epoch (the epoch in the high 32 bits); custom: the highest of its
        copies' given scores; read-only tables: int64 min (the claim never lowers a score)."""
        tids, old, uses = stored.tids, stored.old, stored.uses
        if self._uniform_code == LFU:
            return old + uses
        if self._uniform_code == EPOCH_LFU and len(epochs := {m.epoch for m in self.members}) == 1:
            return epoch_use_score(old, uses, epochs.pop())
        # per member, as of this call: its step score (never: read-only) and its epoch
        per_table = to_device_nowait([
            [LOWEST_SCORE if m.config.read_only else (m._step_score(m.step) if p in TABLE_SCORED else 0) for m, p in zip(self.members, self._policies)],
            [m.epoch for m in self.members],
        ], torch.int64, self.device)
        code = self._score_codes[tids]
        scores = per_table[0][tids]
        if self.counting:
            scores = torch.where(code == LFU, old + uses, scores)
            scores = torch.where(code == EPOCH_LFU, epoch_use_score(old, uses, per_table[1][tids]), scores)
        if lane_scores is not None:
            given = torch.full_like(scores, LOWEST_SCORE)
            given.scatter_reduce_(0, r.number.long(), lane_scores, "amax")
            scores = torch.where(code == CUSTOM, given, scores)
        return scores

    def _flat_ids(self, x: torch.Tensor) -> torch.Tensor:
        if x.device == self.device and x.dtype == torch.int64 and x.dim() == 1:
            return x
        return x.to(self.device, torch.int64).reshape(-1)

    def _flat_lanes(self, given: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The members' ids as one call's lanes: (keys, each lane's member), or None for
        a call without ids."""
        ids = [self._flat_ids(x) for x in given]
        sizes = tuple(x.numel() for x in ids)
        if sum(sizes) == 0:
            return None
        return torch.cat(ids), self._lanes(sizes)[0]

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, given: list[torch.Tensor], train: bool, scores: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """scores: each member's given scores (custom policy members), else None."""
        self._settle()
        ids = [self._flat_ids(x) for x in given]
        sizes = tuple(x.numel() for x in ids)
        n = sum(sizes)
        out = torch.empty(n, self.dim, dtype=torch.float32, device=self.device)
        if n == 0:
            return list(out.split(sizes))
        keys = torch.cat(ids)
        tids, _ = self._lanes(sizes)
        r = self._route(tuple(given), keys, tids)
        if train:
            for m in self.members:
                m.table.placements += 1  # the claim below inserts and evicts
            self._train_rows(r, ids, scores)
        else:
            self._find_rows(r, counted=False)
        gather_embeddings(r.number, r.rows, r.keys, r.tids, r.rowless, self._stack(), self._seeds, self._scales, out)
        r.placements = self._placements()
        self.routing = r
        return list(out.split(sizes))

    def _train_rows(self, r: _Routing, ids: list[torch.Tensor], scores: list | None) -> None:
        """A training lookup's rows: claimed (admitted first where a member admits), new
        ones initialised; sets r.rows and counts the lookup."""
        stored = self._stored(r) if self.per_key_scores else None
        gate = self._gate(r, stored) if self.admitting else None
        slots, inserted = self._claim(r, self._claim_scores(r, stored, ids, scores), gate.barred if gate else None)
        if gate is not None:
            self._admit(r, gate, slots, inserted)
        init_rows(r.keys, r.tids, slots, inserted, r.count, self._stack(), self._seeds, self._scales, self.dim)
        self._rows(r, slots, counted=True)

    def _find_rows(self, r: _Routing, counted: bool | None) -> None:
        """Sets r.rows from the rows stored (nothing inserted); counted as _rows."""
        self._rows(r, probe(self._stack(), r.keys, self.bucket_size, 0, r.tids, count=r.count), counted)

    def _claim_scores(self, r: _Routing, stored, ids: list[torch.Tensor], scores: list | None) -> tuple[torch.Tensor, int, bool]:
        """The claim's scores: (per table, their offset, True), or (per segment, 0, False)."""
        if not self.per_key_scores:
            return (*self._table_scores(), True)
        scores = scores or [None] * len(ids)
        for x, given, p, name in zip(ids, scores, self._policies, self.names):
            if p == "custom" and given is None and x.numel():
                raise ValueError(f"{name}: the custom eviction policy needs scores in lookup()")
        lane_scores = None
        if any(s is not None for s in scores):
            lane_scores = torch.cat([s.reshape(-1).to(self.device, torch.int64) if s is not None
                                     else torch.zeros(x.numel(), dtype=torch.int64, device=self.device)
                                     for s, x in zip(scores, ids)])
        return self._key_scores(r, stored, lane_scores), 0, False

    def _gate(self, r: _Routing, stored: _Stored | None) -> _Gate:
        """Before the claim, for members with an admission threshold, counted as
        DynamicEmbedding._count_new counts their new ids: each segment's slot in its
        member's counter table, its count (stored count plus this call's copies), and
        whether the claim may not insert it (below the threshold). No host wait."""
        counters = self._counter_stack()
        counted = torch.zeros_like(r.keys)
        tids = stored.tids if stored is not None else r.tids  # (past the count, unread)
        found = probe(counters, r.keys, self.bucket_size, 0, tids, count=r.count, scores=counted)
        uses = stored.uses if stored is not None else self._uses(r)
        seen, barred = admission_gate(tids, counted, uses, r.count, self._admits, self._thresholds)
        return _Gate(tids, found, seen, barred)

    def _admit(self, r: _Routing, gate: _Gate, slots: torch.Tensor, inserted: torch.Tensor) -> None:
        """After the claim: new ids at their threshold were admitted (their counts
        dropped), those below it refused (their counts stored in the counter tables).
        Refused ids count as lookups, not as rejections."""
        counters = self._counter_stack()
        claim_keys = admit(
            r.keys, gate.tids, slots, inserted, gate.found, gate.seen, r.count, self._admits, self._thresholds, counters,
            self._counts,
        )
        # the refused ids' counts stored (the claim skips the reserved key: the others)
        claim(counters, claim_keys, gate.seen, self.bucket_size, gate.tids, count=r.count, victims=False)

    def _counter_stack(self) -> TableStack:
        """The members' counter tables (a member without one: another's; no key of that
        member is ever looked up in it)."""
        tables = [m.counters for m in self.members if m.counters is not None]
        mine = [m.counters if m.counters is not None else tables[0] for m in self.members]
        return self._cached("counter_desc", tuple(t.keys.data_ptr() for t in mine),
                            lambda: TableStack(torch.stack([t.descriptor() for t in mine]), mine))

    def _claim(self, r: _Routing, scored: tuple[torch.Tensor, int, bool], barred: torch.Tensor | None = None):
        """find_or_insert of the segments' ids in their tables with `scored` (_claim_scores):
        their slots and whether each was inserted. barred: segments found if stored, never
        inserted. While some table can still grow, whether one must (an id found its
        bucket full, or the table passed its load factor) is copied to the host without
        waiting and settled later (_settle): an id without a slot is new, and is served
        its initial embedding, which is what a row inserted after growing holds."""
        slots, inserted = self._find_or_insert(r, scored, barred)
        growing = self._growing()
        if growing:
            # claiming again later, only the segments without a slot may be inserted (ids
            # erased since, or stored, stay as they are)
            settled = slots != -2 if barred is None else barred | (slots != -2)
            self._pending = _PendingGrowth(growing, self._growth_checks(r, slots, growing), r, scored, settled)
        return slots, inserted

    def _find_or_insert(self, r: _Routing, scored: tuple[torch.Tensor, int, bool], barred: torch.Tensor | None):
        """One claim of the segments' ids (slots, -2 for an id its full bucket could not
        take; inserted), counted into the statistics."""
        scores, offset, per_table = scored
        slots, inserted, _, _, _ = claim(
            self._stack(), r.keys, scores, self.bucket_size, r.tids, table_scores=per_table,
            counts=self._counts, count=r.count, victims=False, score_offset=offset, barred=barred,
        )
        return slots, inserted

    def _growing(self) -> list[int]:
        """The members whose tables can still grow."""
        return [i for i, m in enumerate(self.members) if m.table.insert_mode == GROW]

    def _flagged_per_member(self, r: _Routing, flags: torch.Tensor) -> torch.Tensor:
        """(T,) int64: the segments (of the count) with their flag set, per member."""
        used = torch.arange(flags.numel(), device=self.device) < r.count
        out = torch.zeros(len(self.members), dtype=torch.int64, device=self.device)
        out.index_add_(0, torch.where(used, r.tids, 0).long(), (used & flags).long())
        return out

    def _growth_checks(self, r: _Routing, slots: torch.Tensor, growing: list[int]):
        """(checks, event): per member (T, 2), the ids it had no slot for and, for the
        growing ones, its size, on their way to the host (one kernel, then a copy to
        pinned memory and an event after it); on a CPU the tensor itself and None.
        _read_checks reads them. The pinned buffer and the event are the group's own, used
        again by each check: a check is read (settled) before the next one is made."""
        members = tuple(growing)
        on_device = self._cached("growing", members, lambda: to_device_nowait(list(members), torch.int64, self.device))
        capacity = max(self.members[i].table.capacity for i in growing)
        checks = growth_checks(r.tids, slots, r.count, self._stack(), on_device, self.bucket_size, capacity)
        if self.device.type != "cuda":
            return checks, None
        if self._check_buffer is None:
            self._check_buffer = torch.empty(checks.shape, dtype=checks.dtype, pin_memory=True), torch.cuda.Event()
        host, event = self._check_buffer
        host.copy_(checks, non_blocking=True)
        event.record()
        return host, event

    @staticmethod
    def _read_checks(checks: tuple) -> list:
        """_growth_checks' values on the host, once their copy's event has passed (a wait for
        that event alone)."""
        values, event = checks
        if event is not None:
            event.synchronize()
        return values.tolist()

    def _settle(self) -> None:
        """Acts on the last training lookup's growth check: waits for its event alone (the
        claim's end, long passed: the work queued since stays queued), and where a table
        must grow, grows it, claims the lookup's segments again (those without a slot are
        inserted with their initial rows) and moves the lookup's rows to the new slots.
        Growing waits for the GPU, as it always has; most calls grow nothing."""
        p, self._pending = self._pending, None
        if p is None:
            return
        grow = self._must_grow(p.growing, self._read_checks(p.checks))
        if not grow:
            return
        for t in grow:
            t._grow()
        r = p.routing
        slots, inserted = self._claim_growing(r, p.scored, p.barred)
        init_rows(r.keys, r.tids, slots, inserted, r.count, self._stack(), self._seeds, self._scales, self.dim)
        # the lookup counted the ids without a slot as rejections; inserted now, they are
        # inserts (the claim counted them so, less a hit)
        late = self._flagged_per_member(r, inserted)
        self._counts[:, HITS] += late
        self._counts[:, REJECTIONS] -= late
        self._rows(r, slots, counted=None)
        r.placements = self._placements()

    def _must_grow(self, growing: list[int], checks: list) -> list:
        """The tables of the growing members that must grow, by their checks (per member:
        ids without a slot, size): an id found its bucket full, or the table passed its
        load factor (as a table alone grows)."""
        return [
            self.members[i].table for i in growing
            if checks[i][0] or checks[i][1] > self.members[i].table.max_load_factor * self.members[i].table.capacity
        ]

    def _claim_growing(self, r: _Routing, scored: tuple[torch.Tensor, int, bool], barred: torch.Tensor | None):
        """The claim again after growing, growing and claiming again until every id that
        may be inserted has a slot and every table keeps its load factor (each check waits
        for the GPU)."""
        slots, inserted = self._find_or_insert(r, scored, barred)
        growing = self._growing()
        if not growing:
            return slots, inserted
        grow = self._must_grow(growing, self._read_checks(self._growth_checks(r, slots, growing)))
        if not grow:
            return slots, inserted
        for t in grow:
            t._grow()
        again, inserted_again = self._claim_growing(r, scored, barred)
        return again, inserted | inserted_again

    def _rows(self, r: _Routing, slots: torch.Tensor, counted: bool | None, tids: torch.Tensor | None = None) -> None:
        """Sets r.rows from the segments' slots in their tables (tids: the stack's tables
        they are in, if not the segments' own); counted (train or not): also counts the
        lookup in the members' statistics."""
        segment_rows(r.tids if tids is None else tids, slots, r.count, r.rows, r.rowless, self._counts, self._inserting, counted)

    def _route(self, ids: tuple, keys, tids) -> _Routing:
        """Numbers the lanes by segment, one per distinct (table, id): each lane's taker,
        the first lane with its id (_distinct_kernel), then the takers in lane order."""
        number, count, seg_keys, seg_tids, rows, rowless = number_segments(keys, tids)
        return _Routing(ids, number, count, seg_keys, seg_tids, rows, rowless)

    # ---- update ---------------------------------------------------------------------------
    def apply_gradients(self, given: list[torch.Tensor], grads: list[torch.Tensor], present: list[bool]) -> None:
        """present[i]: member i takes part (its step advances)."""
        self._settle()
        for m, p in zip(self.members, present):
            m.step += p
        r, self.routing = self.routing, None
        if r is None or len(r.ids) != len(given) or any(a is not b for a, b in zip(r.ids, given)) or r.placements != self._placements():
            lanes = self._flat_lanes(given)
            if lanes is None:
                return
            r = self._route(tuple(given), *lanes)
            self._find_rows(r, counted=None)
        grads = [g if g.device == self.device and g.dtype == torch.float32 and g.is_contiguous()
                 else g.to(self.device, torch.float32).contiguous() for g in grads]
        _, lane_bounds = self._lanes(tuple(x.numel() for x in r.ids))
        ptrs = [g.data_ptr() for g in grads]
        grad_ptrs = self._cached("grads", tuple(ptrs), lambda: to_device_nowait(ptrs, torch.int64, self.device))
        update_segments(r.number, r.rows, r.count, Gradients(grads, grad_ptrs, lane_bounds), self._stack(), self.dim, self.optimizer)
