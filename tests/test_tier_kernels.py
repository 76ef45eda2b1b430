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
def test_exchange_tier_rows(counted):
    """Device rows down to host slots and host rows up into the same device slots; some
    lanes move one way only, some none (a whole program's lanes among them). Host slots going up are not written by the lanes
    going down, as swap_in guarantees (it protects them)."""
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
    # a program's worth of lanes (TIER_BLOCK) that move nothing, then lanes that only move up
    block = kernels.TIER_BLOCK
    slots[block : 2 * block] = -1
    down[2 * block :] = -1
    count = torch.tensor([n - 3], dtype=torch.int32).to(DEVICE) if counted else None
    outs = []
    for f in (kernels.exchange_tier_rows, twins.exchange_tier_rows_reference):
        stack = tiers(3)
        f(stack, tids.to(DEVICE), slots.to(DEVICE), down.to(DEVICE), up.to(DEVICE), TABLES, ROW_DIM, count)
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
