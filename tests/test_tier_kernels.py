"""Each launcher of tier_kernels.py against its PyTorch twin (tier_reference.py) on fresh
random inputs: two tiers of three tables, lanes with negative slots, lanes past a count.
On CPU the kernels run under TRITON_INTERPRET=1; on a GPU the same cases run there."""
import pytest
import torch

from kernels.dynamic_embedding import tier_kernels as kernels
from kernels.dynamic_embedding import tier_reference as twins
from kernels.dynamic_embedding.probe_kernels import TableStack
from kernels.dynamic_embedding.triton_table import TritonHashTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TABLES, CAPACITY, ROW_DIM = 3, 32, 7  # rows of 7 values, 16 apart: padding to write or keep


def tiers(seed: int) -> TableStack:
    """TABLES device tiers then TABLES host tiers, each holding random keys, rows (padding
    included) and scores; the same seed gives equal stacks."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for host in (False, True):
        for _ in range(TABLES):
            t = TritonHashTable(ROW_DIM, capacity=CAPACITY, max_capacity=CAPACITY, bucket_size=8, device=DEVICE, host_rows=host)
            keys = torch.randint(-500, 500, (20,), generator=g).unique()
            t.insert_or_assign(keys.to(DEVICE), torch.randn(keys.numel(), ROW_DIM, generator=g).to(DEVICE),
                               torch.randint(0, 9, (keys.numel(),), generator=g).to(DEVICE))
            v = t.values
            torch.as_strided(v, (v.shape[0], v.stride(0)), (v.stride(0), 1))[:, ROW_DIM:] = float(seed + 1)  # padding
            made.append(t)
    return TableStack(torch.stack([t.descriptor() for t in made]), made)


def state(stack: TableStack) -> list:
    out = []
    for t in stack.tables:
        v = t.values
        out += [t.keys.clone(), t.scores.clone(), t.digests.clone(), torch.as_strided(v, (v.shape[0], v.stride(0)), (v.stride(0), 1)).clone()]
    return out


def distinct_slots(g: torch.Generator, tids: torch.Tensor) -> torch.Tensor:
    """A slot per lane, no two lanes of one table on one slot; about a fifth of them -1."""
    slots = torch.empty_like(tids, dtype=torch.int64)
    for t in range(TABLES):
        mine = (tids == t).nonzero().flatten()
        slots[mine] = torch.randperm(CAPACITY, generator=g)[: mine.numel()]
    return torch.where(torch.rand(tids.numel(), generator=g) < 0.2, -1, slots)


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("tiles", [kernels.TIER_TILING, (8, 4, 8)])
def test_exchange_tier_rows(counted, tiles):
    """Device rows down to host slots and host rows up into the same device slots; some
    lanes move one way only, some none (a whole program's lanes among them), with the
    kernel's tiling and with a small one (lanes per program, warps, columns at a time:
    a row in two steps). Host slots going up are not written by the lanes going down, as
    swap_in guarantees (it protects them)."""
    g = torch.Generator().manual_seed(int(counted))
    n = 40
    tids = torch.randint(0, TABLES, (n,), generator=g).to(torch.int32)
    slots = distinct_slots(g, tids)
    # host slots: a permutation per table split into the two directions (never shared)
    down, up = torch.full((n,), -1), torch.full((n,), -1)
    for t in range(TABLES):
        mine = (tids == t).nonzero().flatten()
        perm = torch.randperm(CAPACITY, generator=g)
        down[mine], up[mine] = perm[: mine.numel()], perm[mine.numel() : 2 * mine.numel()]
    down = torch.where(torch.rand(n, generator=g) < 0.3, -1, down)
    up = torch.where(torch.rand(n, generator=g) < 0.3, -1, up)
    # a program's worth of lanes that move nothing (the last program's where it is shorter),
    # and lanes that only move up
    block = tiles[0]
    slots[block : 2 * block] = -1
    down[:6] = -1
    count = torch.tensor([n - 3], dtype=torch.int32).to(DEVICE) if counted else None
    outs = []
    for f in (kernels.exchange_tier_rows, twins.exchange_tier_rows_reference):
        stack = tiers(3)
        f(stack, tids.to(DEVICE), slots.to(DEVICE), down.to(DEVICE), up.to(DEVICE), TABLES, ROW_DIM, count, tiles=tiles)
        outs.append(state(stack))
    for x, y in zip(*outs):
        assert torch.equal(x, y)
    assert any(not torch.equal(x, y) for x, y in zip(outs[0], state(tiers(3))))  # something moved


@pytest.mark.parametrize("action", [kernels.PROTECT, kernels.RELEASE])
@pytest.mark.parametrize("counted", [False, True])
def test_mark_tier_slots(action, counted):
    g = torch.Generator().manual_seed(action * 2 + counted)
    n = 50
    tids = torch.randint(0, TABLES, (n,), generator=g).to(torch.int32)
    slots = distinct_slots(g, tids)
    count = torch.tensor([31], dtype=torch.int32).to(DEVICE) if counted else None
    outs = []
    for f in (kernels.mark_tier_slots, twins.mark_tier_slots_reference):
        stack = tiers(5)
        f(stack, tids.to(DEVICE), slots.to(DEVICE), TABLES, action, count)
        outs.append(state(stack))
    for x, y in zip(*outs):
        assert torch.equal(x, y)
    assert any(not torch.equal(x, y) for x, y in zip(outs[0], state(tiers(5))))


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("ordered", [False, True])
def test_count_swap(train, counted, ordered):
    """A swap's statistics per table from random flags: lanes in table order (as a call's
    are) and in none, programs spanning several tables, reserved keys, lanes past a
    count; counters start from random values, which both add to."""
    from kernels.dynamic_embedding.tiers import Swapped

    g = torch.Generator().manual_seed(train * 4 + counted * 2 + ordered)
    n, tables = 3 * kernels.COUNT_BLOCK + 17, 5
    tids = torch.randint(0, tables, (n,), generator=g)
    if ordered:
        tids = tids.sort().values
    keys = torch.where(torch.rand(n, generator=g) < 0.1, -(2**63), torch.randint(0, 1000, (n,), generator=g))
    flags = [torch.rand(n, generator=g) < p for p in (0.5, 0.3, 0.2, 0.3, 0.4, 0.1)]
    slots = torch.where(torch.rand(n, generator=g) < 0.7, torch.randint(0, 100, (n,), generator=g), -1)
    s = Swapped(slots.to(DEVICE), *[f.to(DEVICE) for f in flags[:3]], slots.to(DEVICE), *[f.to(DEVICE) for f in flags[3:]])
    inserting = torch.tensor([1, 0, 1, 1, 0]).to(DEVICE)
    count = torch.tensor([n - 700], dtype=torch.int32).to(DEVICE) if counted else None
    start_counts = torch.randint(0, 50, (tables, 7), generator=g).to(DEVICE)
    start_moves = torch.randint(0, 50, (tables, 2), generator=g).to(DEVICE)
    outs = []
    for f in (kernels.count_swap, twins.count_swap_reference):
        counts, moves = start_counts.clone(), start_moves.clone()
        f(tids.to(DEVICE).to(torch.int32), keys.to(DEVICE), s, count, inserting, counts, moves, train)
        outs.append((counts, moves))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    live = n - 700 if counted else n
    assert int((outs[0][1] - start_moves).sum()) == int(flags[1][:live].sum() + flags[4][:live].sum())  # promoted, demoted
    changed = (outs[0][0] != start_counts).any(0).nonzero().flatten().tolist()
    assert changed == ([0, 1, 2, 3, 4] if train else [4])  # lookups .. evictions, or evictions alone


@pytest.mark.parametrize("host_rows", [CAPACITY, 2**30])
def test_host_order_puts_moving_lanes_first_by_host_address(host_rows):
    """swap_in's order for a prefetch's exchange: lanes moving a row up by (table, up slot),
    then lanes moving one down alone by (table, down slot), then the rest; int32 keys for
    small host tiers, int64 where 2 · tables · rows passes int32 (host_rows 2^30)."""
    from types import SimpleNamespace

    from kernels.dynamic_embedding.tiers import _host_order

    g = torch.Generator().manual_seed(host_rows % 97)
    n = 200
    tids = torch.randint(0, TABLES, (n,), generator=g).to(torch.int32)
    up = torch.where(torch.rand(n, generator=g) < 0.4, torch.randint(0, CAPACITY, (n,), generator=g), -1)
    down = torch.where(torch.rand(n, generator=g) < 0.5, torch.randint(0, CAPACITY, (n,), generator=g), -1)
    tiers = SimpleNamespace(tables=TABLES, host_rows=host_rows)
    order = _host_order(tiers, tids.to(DEVICE), up.to(DEVICE), down.to(DEVICE)).cpu()
    assert torch.equal(order.sort().values, torch.arange(n))  # a permutation
    kind = torch.where(up >= 0, 0, torch.where(down >= 0, 1, 2))
    slot = torch.where(up >= 0, up, torch.where(down >= 0, down, 0))
    seen = list(zip(kind[order].tolist(), tids[order].tolist(), slot[order].tolist()))
    moving = [s for s in seen if s[0] < 2]
    assert moving == sorted(moving) and all(s[0] == 2 for s in seen[len(moving):])
    assert {s[0] for s in seen} == {0, 1, 2}


def swap_lanes(g: torch.Generator, n: int):
    """Random lanes of a swap: keys (a tenth reserved), tables, device slots (a third -1)
    and flags as a claim leaves them."""
    keys = torch.where(torch.rand(n, generator=g) < 0.1, -(2**63), torch.randint(0, 10**6, (n,), generator=g))
    tids = torch.randint(0, TABLES, (n,), generator=g).to(torch.int32)
    slots = torch.where(torch.rand(n, generator=g) < 0.3, -1, torch.randint(0, CAPACITY, (n,), generator=g))
    flag = lambda p: torch.rand(n, generator=g) < p  # noqa: E731
    return keys, tids, slots, flag


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("table_scores", [False, True])
@pytest.mark.parametrize("with_barred", [False, True])
def test_host_claim_lanes(counted, table_scores, with_barred):
    """The host claim's lanes after a device claim: flags masked to live lanes (reserved
    keys and lanes past a count unset), promotions where a host slot is known, victims and
    rowless keys with their scores (per lane, or per table plus an offset)."""
    g = torch.Generator().manual_seed(counted * 4 + table_scores * 2 + with_barred)
    n = 2 * kernels.FLAGS_BLOCK + 37
    keys, tids, slots, flag = swap_lanes(g, n)
    inserted, evicted, barred = flag(0.4), flag(0.3), flag(0.2) if with_barred else None
    victim_keys, victim_scores = torch.randint(0, 10**6, (n,), generator=g), torch.randint(0, 99, (n,), generator=g)
    from_host = torch.where(flag(0.5), torch.randint(0, CAPACITY, (n,), generator=g), -1)
    scores = torch.randint(0, 50, (TABLES,) if table_scores else (n,), generator=g)
    count = torch.tensor([n - 500], dtype=torch.int32).to(DEVICE) if counted else None
    args = [x.to(DEVICE) if x is not None else None for x in (keys, tids, slots, inserted, evicted, victim_keys, victim_scores, from_host, barred, scores)]
    got = kernels.host_claim_lanes(*args, 7, table_scores, count)
    want = twins.host_claim_lanes_reference(*args, 7, table_scores, count)
    names = ("inserted", "evicted", "promoted", "up", "rowless", "host_keys", "host_scores")
    for name, x, y in zip(names, got, want):
        assert torch.equal(x.cpu(), y.cpu()), name
    assert int(got[2].sum()) > 0 and int(got[4].sum()) > 0 and int(got[1].sum()) > 0  # some of each


@pytest.mark.parametrize("counted", [False, True])
def test_swap_outcome(counted):
    """A swap's outcome per lane from its flags and the host claim's slots."""
    g = torch.Generator().manual_seed(int(counted))
    n = 2 * kernels.FLAGS_BLOCK + 37
    keys, _, _, flag = swap_lanes(g, n)
    inserted, evicted, promoted, rowless = flag(0.4), flag(0.3), flag(0.2), flag(0.3)
    down = torch.where(flag(0.7), torch.randint(0, CAPACITY, (n,), generator=g), -1)
    down_inserted, host_evicted = flag(0.5), flag(0.1)
    count = torch.tensor([n - 500], dtype=torch.int32).to(DEVICE) if counted else None
    args = [x.to(DEVICE) for x in (keys, inserted, evicted, promoted, rowless, down, down_inserted, host_evicted)]
    got = kernels.swap_outcome(*args, count)
    want = twins.swap_outcome_reference(*args, count)
    for name, x, y in zip(("going", "fresh", "made", "held", "demoted", "lost"), got, want):
        assert torch.equal(x.cpu(), y.cpu()), name
        assert name == "going" or int(x.sum()) > 0
