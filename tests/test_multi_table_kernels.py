"""Each operation of the grouped path (multi_table_kernels.py) against its PyTorch twin
(multi_table_reference.py) on fresh random inputs: several tables, duplicated ids, ids
without rows, segments past the count. On CPU the kernels run under TRITON_INTERPRET=1;
on a GPU the same cases run there."""
import pytest
import torch

from kernels.dynamic_embedding import multi_table_kernels as kernels
from kernels.dynamic_embedding import multi_table_reference as twins
from kernels.dynamic_embedding.counters import ADMISSIONS, NUM_COUNTED
from kernels.dynamic_embedding.hashing import EMPTY_KEY
from kernels.dynamic_embedding.optimizers import OptimizerConfig
from kernels.dynamic_embedding.triton_table import TritonHashTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TABLES, DIM, CAPACITY = 3, 5, 64


def tables(seed: int, row_dim: int, stored: int = 40) -> kernels.TableStack:
    """TABLES deterministic tables, each holding `stored` random keys with random rows and
    scores: calling this twice with one seed gives two equal stacks."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(TABLES):
        t = TritonHashTable(row_dim, capacity=CAPACITY, max_capacity=CAPACITY, bucket_size=8, device=DEVICE)
        keys = torch.randint(-1000, 1000, (stored,), generator=g).unique()
        t.insert_or_assign(keys.to(DEVICE), torch.randn(keys.numel(), row_dim, generator=g).to(DEVICE),
                           torch.randint(0, 9, (keys.numel(),), generator=g).to(DEVICE))
        made.append(t)
    return kernels.TableStack(torch.stack([t.descriptor() for t in made]), made)


def state(stack: kernels.TableStack) -> list:
    return [(t.keys.clone(), t.scores.clone(), t.digests.clone(), t.values.clone()) for t in stack.tables]


def lanes(seed: int, stack: kernels.TableStack, n: int):
    """n lanes: ids of the tables, stored ones and new ones, duplicated, with their slots."""
    g = torch.Generator().manual_seed(seed)
    tids = torch.randint(0, TABLES, (n,), generator=g).to(DEVICE)
    keys = torch.randint(-1000, 1000, (n,), generator=g).to(DEVICE)
    repeat = torch.rand(n, generator=g).to(DEVICE) < 0.3  # copies of earlier lanes' (table, id)
    src = (torch.rand(n, generator=g) * torch.arange(n)).long().to(DEVICE)
    keys, tids = torch.where(repeat, keys[src], keys), torch.where(repeat, tids[src], tids)
    slots = torch.stack([t.find(keys) for t in stack.tables])[tids, torch.arange(n, device=DEVICE)]
    return keys, tids, slots


def seeds_and_scales(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**40, (TABLES,), generator=g).to(DEVICE), (torch.rand(TABLES, generator=g, dtype=torch.float64) + 0.1).to(DEVICE)


@pytest.mark.parametrize("n", [1, 37, 300])
def test_number_segments(n):
    keys, tids, _ = lanes(n, tables(0, DIM), n)
    got, want = kernels.number_segments(keys, tids), twins.number_segments_reference(keys, tids)
    assert int(got[1]) == int(want[1])
    for number, count, seg_keys, seg_tids, _, rowless in (got, want):
        number = number.long()
        assert bool((number < int(count[0])).all()) and int(rowless[0]) == 0
        assert torch.equal(seg_keys[number], keys) and torch.equal(seg_tids[number], tids.long())
    # the same partition of the lanes: each lane's segment named by its first lane
    def first_lanes(number):
        first = torch.full((n,), n, device=DEVICE).scatter_reduce_(0, number.long(), torch.arange(n, device=DEVICE), "amin")
        return first[number.long()]
    assert torch.equal(first_lanes(got[0]), first_lanes(want[0]))


@pytest.mark.parametrize("counted", [None, False, True])
def test_segment_rows(counted):
    g = torch.Generator().manual_seed(1)
    n = 300
    seg_tids = torch.randint(0, TABLES, (n,), generator=g).to(DEVICE)
    slots = torch.where(torch.rand(n, generator=g) < 0.2, -1, torch.randint(0, CAPACITY, (n,), generator=g)).to(DEVICE)
    count = torch.tensor([250], dtype=torch.int32, device=DEVICE)
    inserting = torch.tensor([1, 0, 1], device=DEVICE)
    outs = []
    for fn in (kernels.segment_rows, twins.segment_rows_reference):
        rows = torch.full((n,), 7, dtype=torch.int64, device=DEVICE)
        rowless = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        counts = torch.arange(TABLES * NUM_COUNTED, device=DEVICE).view(TABLES, NUM_COUNTED).clone()
        fn(seg_tids, slots, count, rows, rowless, counts, inserting, counted)
        outs.append((rows, rowless, counts))
    (rows, rowless, counts), (want_rows, want_rowless, want_counts) = outs
    assert torch.equal(rows[:250], want_rows[:250]) and bool((rows[250:] == 7).all())  # past the count: untouched
    assert torch.equal(rowless, want_rowless) and int(rowless[0]) == 1
    assert torch.equal(counts, want_counts)


@pytest.mark.parametrize("whole_rows", [False, True])
def test_init_rows(whole_rows):
    row_dim = 2 * DIM + 1  # a row of 11 values, padded to 16 (whole rows zero the padding too)
    got, want = tables(2, row_dim), tables(2, row_dim)
    n = 120
    keys, tids, slots = lanes(3, got, n)
    g = torch.Generator().manual_seed(4)
    slots = torch.where(slots >= 0, slots, torch.randint(0, CAPACITY, (n,), generator=g).to(DEVICE))  # rows to write
    inserted = (torch.rand(n, generator=g) < 0.5).to(DEVICE)
    # one lane per (table, slot) inserted, as a claim reports
    owner = torch.full((TABLES * CAPACITY,), n, device=DEVICE).scatter_reduce_(0, tids * CAPACITY + slots, torch.arange(n, device=DEVICE), "amin")
    inserted &= owner[tids * CAPACITY + slots] == torch.arange(n, device=DEVICE)
    count = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    seeds, scales = seeds_and_scales(5)
    for stack in (got, want):  # padding that whole rows overwrite and the others keep
        for t in stack.tables:
            torch.as_strided(t.values, (CAPACITY, t.row_stride), (t.row_stride, 1))[:, row_dim:] = 7.0
    kernels.init_rows(keys, tids, slots, inserted, count, got, seeds, scales, DIM, whole_rows)
    twins.init_rows_reference(keys, tids, slots, inserted, count, want, seeds, scales, DIM, whole_rows)
    for a, b in zip(state(got), state(want)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for a, b in zip(got.tables, want.tables):
        full = [torch.as_strided(t.values, (CAPACITY, t.row_stride), (t.row_stride, 1)) for t in (a, b)]
        assert torch.equal(full[0], full[1])
        assert bool((full[0][:, row_dim:] == 0).any()) == whole_rows
    assert not all(torch.equal(x[3], y[3]) for x, y in zip(state(got), state(tables(2, row_dim))))  # rows were written


def test_gather_embeddings():
    stack = tables(6, DIM)
    n = 200
    keys, tids, _ = lanes(7, stack, n)
    number, count, seg_keys, seg_tids, rows, rowless = twins.number_segments_reference(keys, tids)
    slots = torch.stack([t.find(seg_keys) for t in stack.tables])[seg_tids, torch.arange(n, device=DEVICE)]
    twins.segment_rows_reference(seg_tids, slots, count, rows, rowless, torch.zeros(TABLES, NUM_COUNTED, dtype=torch.int64, device=DEVICE), None, None)
    assert int(rowless[0]) == 1 and bool((rows[: int(count[0])] >= 0).any())
    seeds, scales = seeds_and_scales(8)
    got, want = (torch.full((n, DIM), float("nan"), device=DEVICE) for _ in range(2))
    kernels.gather_embeddings(number, rows, seg_keys, seg_tids, rowless, stack, seeds, scales, got)
    twins.gather_embeddings_reference(number, rows, seg_keys, seg_tids, rowless, stack, seeds, scales, want)
    assert torch.equal(got, want)


def test_growth_checks():
    stack = tables(13, DIM)
    g = torch.Generator().manual_seed(14)
    n = 300
    seg_tids = torch.randint(0, TABLES, (n,), generator=g).to(DEVICE)
    # -2: left out by a full bucket; -1: not stored (refused, or a read)
    slots = torch.where(torch.rand(n, generator=g) < 0.2, -2, torch.randint(-1, CAPACITY, (n,), generator=g)).to(DEVICE)
    count = torch.tensor([250], dtype=torch.int32, device=DEVICE)
    growing = torch.tensor([0, 2], device=DEVICE)
    got = kernels.growth_checks(seg_tids, slots, count, stack, growing, 8, CAPACITY)
    want = twins.growth_checks_reference(seg_tids, slots, count, stack, growing, 8, CAPACITY)
    assert torch.equal(got, want)
    # every table's full segments of the count only; sizes of the growing tables only
    full = [int(((seg_tids[:250] == t) & (slots[:250] == -2)).sum()) for t in range(TABLES)]
    assert got[:, 0].tolist() == full and min(full) > 0
    assert got[:, 1].tolist() == [stack.tables[0].size(), 0, stack.tables[2].size()] and got[0, 1] > 0


def test_admission_gate():
    main = tables(10, DIM)
    n = 250
    keys, tids, _ = lanes(11, main, n)
    _, count, _, seg_tids, _, _ = twins.number_segments_reference(keys, tids)
    g = torch.Generator().manual_seed(12)
    counted, uses = torch.randint(0, 5, (n,), generator=g).to(DEVICE), torch.randint(1, 4, (n,), generator=g).to(DEVICE)
    admits = torch.tensor([1, 0, 1], dtype=torch.int8, device=DEVICE)
    thresholds = torch.tensor([3, 2, 6], device=DEVICE)
    got = kernels.admission_gate(seg_tids, counted, uses, count, admits, thresholds)
    want = twins.admission_gate_reference(seg_tids, counted, uses, count, admits, thresholds)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    barred = want[1]
    assert 0 < int(barred.sum()) < int(count) and not bool(barred[int(count):].any())  # some barred, none past the count


def test_admit():
    got, want = tables(9, 1), tables(9, 1)  # counter tables: a count per stored id
    main = tables(10, DIM)
    n = 250
    keys, tids, _ = lanes(11, main, n)
    _, count, seg_keys, seg_tids, _, _ = twins.number_segments_reference(keys, tids)
    g = torch.Generator().manual_seed(12)
    # after a claim: ids stored before keep their slots; of the others, some were inserted
    slots = torch.stack([t.find(seg_keys) for t in main.tables])[seg_tids, torch.arange(n, device=DEVICE)]
    inserted = (slots < 0) & (torch.rand(n, generator=g) < 0.5).to(DEVICE)
    slots = torch.where(inserted, torch.randint(0, CAPACITY, (n,), generator=g).to(DEVICE), slots)
    found = torch.stack([t.find(seg_keys) for t in got.tables])[seg_tids, torch.arange(n, device=DEVICE)]
    counted = torch.where(found >= 0, torch.stack([t.scores for t in got.tables])[seg_tids, found.clamp(min=0)], 0)
    seen = counted + torch.randint(1, 4, (n,), generator=g).to(DEVICE)
    admits = torch.tensor([1, 0, 1], dtype=torch.int8, device=DEVICE)
    thresholds = torch.tensor([3, 2, 6], device=DEVICE)
    counts = [torch.zeros(TABLES, NUM_COUNTED, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    out = kernels.admit(seg_keys, seg_tids, slots, inserted, found, seen, count, admits, thresholds, got, counts[0])
    ref = twins.admit_reference(seg_keys, seg_tids, slots, inserted, found, seen, count, admits, thresholds, want, counts[1])
    assert torch.equal(out, ref)
    refused = ref != EMPTY_KEY
    assert torch.equal(counts[0], counts[1]) and int(counts[0][:, ADMISSIONS].sum()) > 0 and int(refused.sum()) > 0  # some admitted, some refused
    for a, b in zip(state(got), state(want)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def with_host_tiers(stack: kernels.TableStack, seed: int, row_dim: int) -> kernels.TableStack:
    """The stack's tables, then TABLES more as their host tiers (tiers.Tiers' layout)."""
    host = tables(seed, row_dim)
    return kernels.TableStack(torch.cat([stack.desc, host.desc]), stack.tables + host.tables)


@pytest.mark.parametrize("optimizer,tiered", [("sgd", False), ("adam", False), ("rowwise_adagrad", False), ("adam", True)])
def test_update_segments(optimizer, tiered):
    """tiered: every other segment's row is in its table's host tier (table + TABLES), and
    takes its table's gradients."""
    cfg = OptimizerConfig(name=optimizer, lr=0.1)
    row_dim = DIM + cfg.state_dim(DIM)
    got, want = tables(13, row_dim), tables(13, row_dim)
    if tiered:
        got, want = with_host_tiers(got, 16, row_dim), with_host_tiers(want, 16, row_dim)
    for stack in (got, want):  # optimizer state as it starts: zeros
        for t in stack.tables:
            t.values[:, DIM:] = 0
    sizes = [90, 0, 140]
    keys, tids, _ = lanes(14, got, sum(sizes))
    tids = torch.repeat_interleave(torch.arange(TABLES, device=DEVICE), torch.tensor(sizes, device=DEVICE))  # lanes in table order
    keys[:30] = keys[0]  # a hot id: a segment longer than LONG_SEGMENT
    number, count, seg_keys, seg_tids, rows, rowless = twins.number_segments_reference(keys, tids)
    slots = torch.stack([t.find(seg_keys) for t in got.tables])[seg_tids, torch.arange(keys.numel(), device=DEVICE)]
    twins.segment_rows_reference(seg_tids, slots, count, rows, rowless, torch.zeros(TABLES, NUM_COUNTED, dtype=torch.int64, device=DEVICE), None, None)
    if tiered:
        host = (torch.arange(rows.numel(), device=DEVICE) % 2 == 1) & (rows >= 0)
        rows[:] = torch.where(host, rows + (TABLES << twins.SLOT_BITS), rows)
    g = torch.Generator().manual_seed(15)
    grads = [torch.randn(s, DIM, generator=g).to(DEVICE) for s in sizes]
    bounds = torch.tensor([0, 90, 90, 230], device=DEVICE)
    ptrs = torch.tensor([x.data_ptr() for x in grads], device=DEVICE)
    kernels.update_segments(number, rows, count, kernels.Gradients(grads, ptrs, bounds), got, DIM, cfg)
    twins.update_segments_reference(number, rows, count, kernels.Gradients(grads, ptrs, bounds), want, DIM, cfg)
    changed = 0
    before = tables(13, row_dim)
    if tiered:
        before = with_host_tiers(before, 16, row_dim)
    for a, b, before in zip(state(got), state(want), state(before)):
        torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=1e-6)
        changed += int((a[3][:, :DIM] != before[3][:, :DIM]).any(1).sum())
    assert changed > 0
