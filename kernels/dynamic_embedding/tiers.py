"""Moving rows between the device tier and the host tier of tiered tables in one pass.

`swap_in` gives a call's keys device rows: rows found in host memory move up, the device
rows their inserts evict move down, and new keys get their initial rows, all by lanes
(one key of one table each) with masks, so that nothing waits for the GPU. The tables are
addressed together (`Tiers`): one table's calls (DynamicEmbedding) and a collection's
group of tiered tables (TieredTableGroup) run the same launches. It serves Triton tables
in fast mode whose tiers are allocated at their full capacity (they never grow); other
tables take DynamicEmbedding's general path, its oracle in the tests.
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .claim_kernels import claim
from .hashing import EMPTY_KEY
from .multi_table_kernels import init_rows
from .probe_kernels import TableStack, probe
from .tier_kernels import PROTECT, RELEASE, exchange_tier_rows, host_claim_lanes, mark_tier_slots, swap_outcome


@dataclass(frozen=True)
class Tiers:
    """T tiered tables addressed together. stack: their T device tiers, then their T host
    tiers in the same order (table t's host tier is t + T); seeds and scales (2T,) on the
    device: each tier's initial rows' (both tiers of a table alike); dim: the embedding's
    width within a row; host_rows: the most slots of any host tier (they never grow)."""

    stack: TableStack
    tables: int
    bucket_size: int
    seeds: torch.Tensor
    scales: torch.Tensor
    dim: int
    host_rows: int

    @property
    def row_dim(self) -> int:
        return self.stack.tables[0].row_dim


class Swapped(NamedTuple):
    """swap_in's result, on the device, per lane (N,). slots: the device slot (-1: none);
    inserted: whether the lane's key was inserted there (one copy of a key is);
    promoted: whether its row came up from the host tier; held: whether a key without a
    device row has a host row after the call, at host_slots; made: whether that host row
    was made by the call; demoted: whether the lane's insert moved a device row down;
    lost: whether the lane's insert cost a row that no tier kept (its device victim, or
    a host row its victim or its key evicted)."""

    slots: torch.Tensor
    inserted: torch.Tensor
    promoted: torch.Tensor
    held: torch.Tensor
    host_slots: torch.Tensor
    made: torch.Tensor
    demoted: torch.Tensor
    lost: torch.Tensor


def swap_in(
    tiers: Tiers, keys: torch.Tensor, tids: torch.Tensor, scores: torch.Tensor, count: torch.Tensor | None = None,
    table_scores: bool = False, score_offset: int = 0, barred: torch.Tensor | None = None,
    from_host: torch.Tensor | None = None, force: bool = False, ordered: bool = False,
) -> Swapped:
    """Device rows for `keys` (N,) of tables `tids` (N,), with `scores` (N,), or with
    table_scores one per table plus score_offset (as claim takes them). EMPTY_KEY lanes,
    and lanes from count[0] on where a count is given, are skipped; copies of a key share
    its row, and one of them is reported inserted. barred (N,) bool: keys the call finds on
    the device if stored there but gives no row otherwise (admission: new keys below the
    threshold; a prefetch: keys not in host memory).
    from_host (N,): the keys' slots in their host tiers (-1: not there), where the caller
    has probed them already (else they are probed after the claim, for the keys it
    inserted: no other key moves up). force: a key the device tier does not hold takes
    its bucket's lowest-score row not used by the call whatever its own score
    (promote_on_miss). ordered: the exchange takes the moving lanes first, in the order of
    their host rows (_host_order), for a call that moves many rows (a prefetch): host
    memory serves rows in address order faster than scattered ones, by more than the sort
    costs there (benchmarks/embedding_tuning.md).

    A key found in host memory moves to the device (promoted); a key in neither tier is
    inserted with its initial row. Device rows that the inserts evict move to host memory
    (demoted). A key the device tier cannot take (its bucket's rows all used by this
    call, or, unforced, of higher scores) keeps its host row, whose score it raises, or is given one
    there with its initial row: its row is then trained in host memory. The host tier
    takes both in one claim, so none of them evicts another's row; a full host bucket
    evicts its lowest-score row not used by the call (lost). The host rows that move up
    are kept from that claim (their slots are emptied after it: the rows demoted in the
    same call go elsewhere), so no row is staged in a buffer.
    """
    stack, host = tiers.stack, tiers.tables
    host_tids = tids + host
    slots, inserted, evicted, victim_keys, victim_scores = claim(
        stack, keys, scores, tiers.bucket_size, tids, table_scores=table_scores, count=count, score_offset=score_offset,
        barred=barred, force=force,
    )
    if from_host is None:  # only a key the claim inserted can come up: the others are left out of the probe
        from_host = probe(stack, torch.where(inserted, keys, EMPTY_KEY), tiers.bucket_size, 0, host_tids, count=count)
    # one host claim per lane: an evicting lane's victim (its slot still holds the
    # victim's row: it moves down before the new row comes in), or a key left without a
    # device row (rowless)
    inserted, evicted, promoted, moving_up, rowless, host_keys, host_scores = host_claim_lanes(
        keys, tids, slots, inserted, evicted, victim_keys, victim_scores, from_host, barred, scores, score_offset,
        table_scores, count,
    )
    mark_tier_slots(stack, tids, moving_up, host, PROTECT, count)
    down, down_inserted, host_evicted, _, _ = claim(stack, host_keys, host_scores, tiers.bucket_size, host_tids, count=count)
    going, fresh, made, held, demoted, lost = swap_outcome(
        keys, inserted, evicted, promoted, rowless, down, down_inserted, host_evicted, count,
    )
    counted = _counted(count, keys)
    # victims down and host rows up, in one pass over PCIe both ways
    if ordered:  # the moving lanes first, by host address (table, then slot): rows up, then rows down alone
        order = _host_order(tiers, tids, moving_up, going)  # (lanes past a count move nothing: no count needed)
        exchange_tier_rows(stack, tids[order], slots[order], going[order], moving_up[order], host, tiers.row_dim)
    else:
        exchange_tier_rows(stack, tids, slots, going, moving_up, host, tiers.row_dim, count)
    init_rows(keys, tids, slots, fresh, counted, stack, tiers.seeds, tiers.scales, tiers.dim)
    init_rows(keys, host_tids, down, made, counted, stack, tiers.seeds, tiers.scales, tiers.dim, whole_rows=True)
    mark_tier_slots(stack, tids, moving_up, host, RELEASE, count)
    for t in stack.tables:
        t.placements += 1
    return Swapped(slots, inserted, promoted, held, down, made, demoted, lost)


def _host_order(tiers: Tiers, tids: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The lanes in the order of their host rows: those moving up by (table, up slot), then
    those moving down alone by (table, down slot), then the rest. The keys are int32 where
    they fit (a sort of half the passes)."""
    span = tiers.host_rows
    t = tids.to(torch.int64) * span
    key = torch.where(up >= 0, t + up, torch.where(down >= 0, tiers.tables * span + t + down, 2 * tiers.tables * span))
    return (key.to(torch.int32) if 2 * tiers.tables * span < 2**31 else key).argsort()


def _counted(count: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """init_rows' count: the given one, or every lane."""
    return count if count is not None else torch.full((1,), keys.numel(), dtype=torch.int32, device=keys.device)


def tiers_of(devices: list, hosts: list, inits: list[tuple[int, float, int]], modes: list[int | None]) -> Tiers:
    """Tiers of tables given by their device tiers, host tiers (Triton tables, in one
    order), initial rows' (seed, scale, dim) and claim modes (None: each table's own)."""
    tables = list(devices) + list(hosts)
    first = tables[0]
    desc = torch.stack([t.descriptor(m) for t, m in zip(tables, list(modes) * 2)])
    seeds = torch.tensor([i[0] for i in inits] * 2, dtype=torch.int64).to(first.device)
    scales = torch.tensor([i[1] for i in inits] * 2, dtype=torch.float64).to(first.device)
    host_rows = max(t.keys.numel() for t in hosts)
    return Tiers(TableStack(desc, tables), len(devices), first.bucket_size, seeds, scales, inits[0][2], host_rows)
