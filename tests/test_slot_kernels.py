"""Each slot and row operation of slot_kernels.py against its PyTorch twin
(slot_reference.py) on fresh random table states: empty and held slots, rows used by the
call, slots to skip (-1), row strides past the row. On CPU the kernels run under
TRITON_INTERPRET=1."""
import pytest
import torch

from kernels.dynamic_embedding import slot_kernels as kernels
from kernels.dynamic_embedding import slot_reference as twins
from kernels.dynamic_embedding.hashing import EMPTY_KEY, hash64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUCKET, BUCKETS = 8, 6
CAPACITY = BUCKET * BUCKETS


def table_state(seed: int, row_dim: int = 5, stride: int = 8):
    """(keys, scores, digests, marks, values): a table's storage, about a third of its
    slots empty; values a (CAPACITY, row_dim) view of rows `stride` apart."""
    g = torch.Generator().manual_seed(seed)
    held = torch.rand(CAPACITY, generator=g) < 0.65
    keys = torch.where(held, torch.randint(-(2**62), 2**62, (CAPACITY,), generator=g), EMPTY_KEY)
    scores = torch.where(held, torch.randint(0, 6, (CAPACITY,), generator=g), 0)
    digests = torch.where(held, torch.randint(1, 256, (CAPACITY,), generator=g), 0).to(torch.uint8)
    marks = torch.randint(0, 3, (CAPACITY,), generator=g).to(torch.int32)
    values = torch.randn(CAPACITY, stride, generator=g).to(DEVICE)[:, :row_dim]  # sliced there: a copy to a GPU drops the stride
    return [t.to(DEVICE) for t in (keys, scores, digests, marks)] + [values]


def copies(state):
    """Two independent copies of a state, the values keeping their row stride."""
    out = []
    for _ in range(2):
        full = torch.as_strided(state[4], (CAPACITY, state[4].stride(0)), (state[4].stride(0), 1)).clone()
        out.append([t.clone() for t in state[:4]] + [full[:, : state[4].shape[1]]])
    return out


def test_release_slots():
    a, b = copies(table_state(0))
    slots = torch.tensor([3, -1, 17, 40, -1, 3], device=DEVICE)
    kernels.release_slots(slots, a[0], a[1], a[2])
    twins.release_slots_reference(slots, b[0], b[1], b[2])
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert int(a[0][17]) == EMPTY_KEY


@pytest.mark.parametrize("evict", [False, True])
def test_choose_slots(evict):
    keys, scores, digests, marks, _ = table_state(1)
    g = torch.Generator().manual_seed(2)
    m = 60
    buckets = torch.randint(0, BUCKETS, (m,), generator=g)
    buckets = buckets.sort().values  # the placement's new keys, sorted by bucket, ranked within it
    ranks = torch.arange(m) - torch.searchsorted(buckets, buckets)
    new_scores = torch.randint(0, 6, (m,), generator=g)  # as the stored ones: ties decide too
    args = [t.to(DEVICE) for t in (buckets, ranks, new_scores)] + [keys, digests, scores, marks, 2, BUCKET, evict]
    got, want = kernels.choose_slots(*args), twins.choose_slots_reference(*args)
    assert torch.equal(got[0], want[0]) and int((got[0] >= 0).sum()) > 0
    if evict:
        flagged = want[3].bool()
        assert torch.equal(got[3], want[3]) and bool(flagged.any()) and bool((~flagged & (want[0] < 0)).any())
        assert torch.equal(got[1][flagged], want[1][flagged]) and torch.equal(got[2][flagged], want[2][flagged])


def test_write_slots():
    a, b = copies(table_state(3))
    slots = torch.tensor([0, 5, -1, 33, 47], device=DEVICE)
    zero_byte = next(k for k in range(10**6) if int(hash64(torch.tensor([k]))[0] >> 56) & 0xFF == 0)  # digest 0 is taken as 1
    new_keys = torch.tensor([7, -(2**63) + 1, 9, 2**63 - 1, zero_byte], device=DEVICE)
    new_scores = torch.arange(5, device=DEVICE)
    kernels.write_slots(slots, new_keys, new_scores, a[0], a[1], a[2])
    twins.write_slots_reference(slots, new_keys, new_scores, b[0], b[1], b[2])
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("min_score", [None, 3])
def test_count_and_export_rows(min_score):
    keys, scores, _, _, values = table_state(4)
    keys, scores, values = keys.repeat(11), scores.repeat(11), values.repeat(11, 1)  # more than one block
    (starts, total), (want_starts, want_total) = (f(keys, scores, min_score) for f in (kernels.count_rows, twins.count_rows_reference))
    assert torch.equal(starts, want_starts) and total == want_total and 0 < total < keys.numel()
    outs = []
    for f in (kernels.export_rows, twins.export_rows_reference):
        out = (torch.empty(total, dtype=torch.int64, device=DEVICE), torch.empty(total, 5, device=DEVICE), torch.empty(total, dtype=torch.int64, device=DEVICE))
        f(keys, scores, values, min_score, starts, *out)
        outs.append(out)
    for x, y in zip(*outs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("case", ["by_slots", "lanes_to_slots", "whole_rows", "marks"])
def test_copy_rows(case):
    src = table_state(5)[4]
    a, b = copies(table_state(6))
    g = torch.Generator().manual_seed(7)
    n = 30
    src_slots = torch.randint(-1, CAPACITY, (n,), generator=g).to(DEVICE)
    dst_slots = torch.randperm(CAPACITY, generator=g)[:n].to(DEVICE)
    dst_slots[::7] = -1
    if case == "marks":
        dst_slots[2::5] = dst_slots[1]  # copies writing one slot: one of them writes
    lane_rows = torch.randn(n, 5, generator=g).to(DEVICE)
    for f, state in ((kernels.copy_rows, a), (twins.copy_rows_reference, b)):
        if case == "by_slots":
            f(src, src_slots, state[4], dst_slots, 4)
        elif case == "lanes_to_slots":
            f(lane_rows, None, state[4], dst_slots, 5)
        elif case == "whole_rows":
            f(src, src_slots, state[4], dst_slots, 5, whole_rows=True)
        else:
            f(lane_rows, None, state[4], dst_slots, 5, marks=state[3])
    full = [torch.as_strided(s[4], (CAPACITY, 8), (8, 1)) for s in (a, b)]
    if case != "marks":
        assert torch.equal(full[0], full[1])
        return
    # which copy writes a shared slot is the kernel's race: the row is one of theirs
    shared = int(dst_slots[1])
    rows_for_shared = [tuple(r) for r, d in zip(lane_rows.tolist(), dst_slots.tolist()) if d == shared]
    assert tuple(a[4][shared].tolist()) in rows_for_shared
    others = torch.ones(CAPACITY, dtype=torch.bool, device=DEVICE)
    others[shared] = False
    assert torch.equal(full[0][others], full[1][others]) and torch.equal(a[3], b[3])


@pytest.mark.parametrize("n", [0, 1, 300, 1000])
def test_gather_victims(n):
    """Appending after entries already counted: the same count, and the same (key, score,
    row) entries (blocks of lanes may take their runs in another order)."""
    g = torch.Generator().manual_seed(n)
    values = torch.randn(64, 5, generator=g).to(DEVICE)[:, :3]  # rows of stride 5, 3 used
    evicted = (torch.rand(n, generator=g) < 0.4).to(DEVICE)
    slots = torch.randint(0, 64, (n,), generator=g).to(DEVICE)
    victim_keys, victim_scores = torch.randint(-(2**63), 2**63 - 1, (2, n), generator=g).to(DEVICE)
    outs = []
    for fn in (kernels.gather_victims, twins.gather_victims_reference):
        keys, scores = torch.full((n + 4,), 7, device=DEVICE), torch.full((n + 4,), 7, device=DEVICE)
        rows = torch.full((n + 4, 3), 7.0, device=DEVICE)
        count = torch.tensor([4], device=DEVICE)  # four entries already there
        fn(evicted, slots, victim_keys, victim_scores, values, keys, scores, rows, count)
        e = int(count)
        assert e == 4 + int(evicted.sum())
        assert torch.equal(keys[:4], torch.full((4,), 7, device=DEVICE))  # entries before the count are kept
        outs.append(sorted(zip(keys[4:e].tolist(), scores[4:e].tolist(), map(tuple, rows[4:e].tolist()))))
    assert outs[0] == outs[1]
