"""A group of tiered tables (device_capacity set) trained in one launch per kernel, as a
TableGroup trains tables with every row on the device.

The group addresses both tiers of its T members through one stack of descriptors
(tiers.Tiers): the device tiers first, then the host tiers, so that a row is a packed
(table << SLOT_BITS | slot) wherever it lives, and the group's gather and fused update
read and write rows in host memory in place (they are GPU kernels over pinned memory).
A training lookup moves its rows with one swap_in for every member: host rows up, the
device rows they displace down, initial rows for new ids, and ids whose device bucket is
full kept and trained in host memory. Nothing waits for the GPU. Counting follows
DynamicEmbedding's tiered lookup: hits and inserts in either tier, promotions and
demotions apart.
"""
import torch

from .counters import LOOKUPS
from .embedding import STEP_POLICIES, DynamicEmbedding
from .hashing import EMPTY_KEY
from .multi_table_kernels import number_segments
from .probe_kernels import READ_ONLY, TableStack, probe
from .table_group import CUSTOM, LOWEST_SCORE, TableGroup, _Routing, to_device_nowait
from .tier_kernels import count_swap
from .tiers import Swapped, Tiers, swap_in, tiers_of


class TieredTableGroup(TableGroup):
    """Tiered tables of one row layout (TableGroup's)."""

    def __init__(self, names: list[str], members: list[DynamicEmbedding]):
        super().__init__(names, members)
        # promotions and demotions, counted into rows of one tensor as the statistics are
        self._moves = torch.stack([m._moves for m in members])
        for i, m in enumerate(members):
            m._moves = self._moves[i]
        self._custom = "custom" in self._policies
        stepped = [m.config.eviction in STEP_POLICIES for m in members]
        self._stepped, self._all_stepped = to_device_nowait(stepped, torch.bool, self.device), all(stepped)
        self._force = members[0].config.promote_on_miss  # (the collection groups tables that agree on it)
        self._prefetched: tuple[torch.Tensor, torch.Tensor] | None = None  # the last prefetch's lanes

    def _storage(self) -> tuple:
        return super()._storage() + tuple(m.host.keys.data_ptr() for m in self.members)

    def _placements(self) -> tuple:
        return super()._placements() + tuple(m.host.placements for m in self.members)

    def _tiers(self) -> Tiers:
        modes = [READ_ONLY if m.config.read_only else None for m in self.members]
        return self._cached("tiers", self._storage(), lambda: tiers_of(
            [m.table for m in self.members], [m.host for m in self.members], [m._init for m in self.members], modes,
        ))

    def _stack(self) -> TableStack:
        return self._tiers().stack

    def _host_tids(self, tids: torch.Tensor) -> torch.Tensor:
        return tids + len(self.members)

    def _train_rows(self, r: _Routing, ids: list[torch.Tensor], scores: list | None) -> None:
        """As TableGroup's, with one probe of the host tiers for the call. Where scores or
        admission read them, it comes before the claim: a stored score is the row's in
        either tier, an id stored in host memory is no new id (it moves up), a custom-scored
        row moving up keeps a higher score it had there (as a row found on the device
        does), and swap_in takes the host slots found. Else swap_in probes after its claim,
        for the keys the claim inserted alone (after a prefetch, few of them)."""
        stored = self._stored(r) if self.per_key_scores else None
        from_host = host_scores = None
        if stored is not None or self.admitting:
            host_scores = torch.zeros_like(r.keys)  # 0 where absent
            from_host = probe(self._stack(), r.keys, self.bucket_size, 0, self._host_tids(r.tids), count=r.count, scores=host_scores)
        if stored is not None and stored.old is not None:  # a row lives in one tier
            stored.old += host_scores
        gate = self._gate(r, stored) if self.admitting else None
        if gate is not None:
            gate.barred &= from_host < 0
        claim_scores, offset, per_table = self._claim_scores(r, stored, ids, scores)
        if self._custom:
            raise_ = (from_host >= 0) & (self._score_codes[stored.tids] == CUSTOM)
            claim_scores = torch.where(raise_, torch.maximum(claim_scores, host_scores), claim_scores)
        s = swap_in(
            self._tiers(), r.keys, r.tids, claim_scores, r.count, table_scores=per_table, score_offset=offset,
            barred=gate.barred if gate is not None else None, from_host=from_host, force=self._force,
        )
        on_device = s.slots >= 0
        slots = torch.where(on_device, s.slots, torch.where(s.held, s.host_slots, -1))
        self._rows(r, slots, counted=None, tids=torch.where(on_device, r.tids, self._host_tids(r.tids)))
        self._tally(r.tids, r.count, r.keys, s, train=True)
        if gate is not None:  # the rows the call made, in either tier, are its new ids admitted
            self._admit(r, gate, slots, (s.inserted & ~s.promoted) | s.made)

    def _find_rows(self, r: _Routing, counted: bool | None) -> None:
        stack = self._stack()
        slots = probe(stack, r.keys, self.bucket_size, 0, r.tids, count=r.count)
        host_tids = self._host_tids(r.tids)
        in_host = probe(stack, r.keys, self.bucket_size, 0, host_tids, count=r.count)
        on_device = slots >= 0
        self._rows(r, torch.where(on_device, slots, in_host), counted=None, tids=torch.where(on_device, r.tids, host_tids))
        if counted is not None:  # a lookup that does not train: lookups, and hits in either tier
            live = self._live(r)
            self._add(r.tids, live, [torch.ones_like(live), on_device | (in_host >= 0)], LOOKUPS)

    def _live(self, r: _Routing) -> torch.Tensor:
        return torch.arange(r.keys.numel(), device=self.device) < r.count

    def _per_member(self, tids: torch.Tensor, live: torch.Tensor, columns: list[torch.Tensor]) -> torch.Tensor:
        """(T, len(columns)): each column's live lanes summed per member. A call's lanes,
        and its segments, lie in member order, so each member's sum is the difference of
        a cumulative sum at its run's ends (an index_add of a million lanes onto a few
        counters would queue its atomic adds at those few addresses)."""
        t = torch.where(live, tids, len(self.members))  # lanes past a count: after every member
        ends = torch.searchsorted(t, torch.arange(len(self.members) + 1, dtype=t.dtype, device=self.device))
        # one scan over the columns laid end to end (a 1-D scan is one device-wide pass; a
        # scan of a few long rows, or along the outer dimension, runs far slower), so a
        # member's sum in column c is a difference within column c's stretch
        n = t.numel()
        sums = torch.stack(columns).to(torch.int32).view(-1).cumsum(0, dtype=torch.int64)
        sums = torch.cat([sums.new_zeros(1), sums])
        at = torch.arange(len(columns), device=self.device)[:, None] * n
        return (sums[at + ends[1:]] - sums[at + ends[:-1]]).T

    def _add(self, tids: torch.Tensor, live: torch.Tensor, columns: list[torch.Tensor], first: int) -> None:
        """Adds each column's live lanes, per member, to the statistics from counter
        `first` on."""
        self._counts[:, first : first + len(columns)] += self._per_member(tids, live, columns)

    def _tally(self, tids: torch.Tensor, count: torch.Tensor | None, keys: torch.Tensor, s: Swapped, train: bool) -> None:
        """A swap's statistics per member, over the lanes before count[0]: with train, a
        lookup's (lookups, hits and inserts in either tier, rejections of members that
        insert, rows lost); promotions and demotions, and rows lost, always."""
        count_swap(tids, keys, s, count, self._inserting, self._counts, self._moves, train)

    def prefetch(self, given: list[torch.Tensor]) -> None:
        """DynamicEmbedding.prefetch for every member at once (given: each member's ids;
        an empty tensor for a member without any). The ids are numbered into segments
        first, one lane per distinct id of a member (as a lookup's are), so that the probes
        and the claims meet each id once whatever its copies."""
        lanes = self._flat_lanes(given)
        if lanes is None:
            return
        _, count, keys, tids, _, _ = number_segments(*lanes)
        live = torch.arange(keys.numel(), device=self.device) < count
        keys, tids = torch.where(live, keys, EMPTY_KEY), torch.where(live, tids, 0)  # (segments past the count are unset)
        previous, self._prefetched = self._prefetched, (keys, tids)
        host_scores = torch.zeros_like(keys)
        from_host = probe(self._stack(), keys, self.bucket_size, 0, self._host_tids(tids), count=count, scores=host_scores)
        in_host = from_host >= 0
        # every stored id of the batch takes part, so that the claim evicts none of the
        # batch's device rows to make room for its host rows; an id not in host memory is
        # barred (the claim finds it on the device, or leaves it out: a prefetch makes no
        # row). Step-scored members: the batch's rows on either tier get the next step's
        # score; the others' host rows bring their scores, and their device rows keep
        # theirs (the claim never lowers one)
        stepped = self._stepped[tids.long()]
        next_scores = to_device_nowait([m._step_score(m.step + 1) for m in self.members], torch.int64, self.device)
        scores = torch.where(stepped, next_scores[tids.long()], torch.where(in_host, host_scores, LOWEST_SCORE))
        barred = ~in_host  # (past the count the probe left it unset, and the key is reserved)
        batch = count  # the lanes counted: the batch's
        if previous is not None and not self._all_stepped:
            # the batch prefetched before keeps its device rows (DynamicEmbedding.prefetch
            # says why): its ids join the call, barred, their scores unchanged, as lanes
            # after the batch's (uncounted: the statistics take the batch's alone)
            old_keys, old_tids = previous
            keys, tids = torch.cat([keys, old_keys]), torch.cat([tids, old_tids])
            scores = torch.cat([scores, torch.full_like(old_keys, LOWEST_SCORE)])
            from_host = torch.cat([torch.where(live, from_host, -1), from_host.new_full(old_keys.shape, -1)])
            barred = torch.cat([barred, torch.ones_like(old_keys, dtype=torch.bool)])
            count = None
        s = swap_in(  # (its exchange in host-address order: a prefetch moves most of an iteration's rows)
            self._tiers(), keys, tids, scores, count, barred=barred, from_host=from_host, force=self._force, ordered=True,
        )
        self._tally(tids, batch, keys, s, train=False)
