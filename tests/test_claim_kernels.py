"""The claim (claim_kernels.claim) against its twin (claim_reference.py) on fresh random
tables with full and partly full buckets, one table and several.

Where no two distinct new keys of a call meet in one bucket and the copies of a key carry
one score (as a table's calls give them) the outcome does not depend on thread timing, and kernel and twin must agree exactly: slots, which keys are
inserted and what they evict, the tables after (keys, scores, digests, rows), the
counters, in every insertion mode, with per-table scores, barred keys, a device count and
rows moved both ways. Where they meet, each bucket's outcome depends on the order its keys
take, so both are held to what any order must give. On CPU the kernel runs under
TRITON_INTERPRET=1."""
import pytest
import torch

from kernels.dynamic_embedding.claim_kernels import claim
from kernels.dynamic_embedding.claim_reference import claim_reference
from kernels.dynamic_embedding.counters import NUM_COUNTED
from kernels.dynamic_embedding.hashing import EMPTY_KEY, bucket_of
from kernels.dynamic_embedding.probe_kernels import EVICT, GROW, KEEP, READ_ONLY, TableStack
from kernels.dynamic_embedding.triton_table import TritonHashTable
from kernels.launch import ALIGN_BYTES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUCKET, BUCKETS, DIM = 8, 8, 4
SCORES = 5  # scores drawn below this: ties between rows, and between a key and the row it may evict
CLAIMS = (claim, claim_reference)


def stacks(seed: int, tables: int, mode: int | None = None, stored: int = 44) -> list[TableStack]:
    """Two equal stacks (one per claim) of `tables` tables at max capacity, about `stored`
    random keys each (some buckets full), descriptors in `mode` (default: the tables')."""
    out = []
    for _ in CLAIMS:
        g = torch.Generator().manual_seed(seed)
        made = []
        for _ in range(tables):
            t = TritonHashTable(DIM, capacity=BUCKET * BUCKETS, max_capacity=BUCKET * BUCKETS, bucket_size=BUCKET, device=DEVICE)
            keys = torch.randint(-500, 500, (stored,), generator=g).unique()
            t.insert_or_assign(keys.to(DEVICE), torch.randn(keys.numel(), DIM, generator=g).to(DEVICE),
                               torch.randint(1, SCORES, (keys.numel(),), generator=g).to(DEVICE))
            made.append(t)
        out.append(TableStack(torch.stack([t.descriptor(mode) for t in made]), made))
    return out


def stored_keys(stack: TableStack, t: int) -> torch.Tensor:
    k = stack.tables[t].keys
    return k[k != EMPTY_KEY]


def uncontended_lanes(seed: int, stack: TableStack, n: int):
    """(keys, tids) of n lanes: stored keys, new keys (at most one distinct new key per
    bucket of a table), copies of both, the reserved key."""
    g = torch.Generator().manual_seed(seed)
    T = len(stack.tables)
    keys, tids, taken = [], [], set()
    while len(keys) < n:
        t = int(torch.randint(0, T, (1,), generator=g))
        r = float(torch.rand(1, generator=g))
        if r < 0.35:
            old = stored_keys(stack, t)
            k = int(old[int(torch.randint(0, old.numel(), (1,), generator=g))])
        elif r < 0.55 and keys:
            j = int(torch.randint(0, len(keys), (1,), generator=g))  # a copy of an earlier lane
            k, t = keys[j], tids[j]
        elif r < 0.6:
            k = EMPTY_KEY
        else:
            k = int(torch.randint(-2000, 2000, (1,), generator=g))
            b = int(bucket_of(torch.tensor([k]), BUCKETS))
            if bool((stored_keys(stack, t) == k).any()):
                pass
            elif (t, b) in taken:
                continue
            else:
                taken.add((t, b))
        keys.append(k)
        tids.append(t)
    return torch.tensor(keys, device=DEVICE), torch.tensor(tids, device=DEVICE)


def key_scores(keys: torch.Tensor, tids: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A score in [0, SCORES] per lane, the same for every copy of a (table, key): which
    copy of a new key reaches a full bucket first is up to thread timing, and with scores
    of their own the copies could find a victim or not by that order."""
    pairs = list(zip(keys.tolist(), tids.tolist()))
    drawn = torch.randint(0, SCORES + 1, (len(pairs),), generator=g).tolist()
    first = {}
    for pair, s in zip(pairs, drawn):
        first.setdefault(pair, s)
    return torch.tensor([first[pair] for pair in pairs], dtype=torch.int64, device=DEVICE)


def per_key(keys, tids, flags) -> dict:
    """(table, key) -> how many of its lanes are flagged."""
    out: dict = {}
    for k, t, f in zip(keys.tolist(), tids.tolist(), flags.tolist()):
        out[(t, k)] = out.get((t, k), 0) + int(f)
    return out


def victims_of(keys, tids, out) -> dict:
    """(table, key) -> (victim key, victim score), of the keys that evicted a row."""
    evicted, victim_keys, victim_scores = out[2], out[3], out[4]
    return {(t, k): (v, s) for k, t, e, v, s in zip(keys.tolist(), tids.tolist(), evicted.tolist(), victim_keys.tolist(),
                                                   victim_scores.tolist()) if e}


def table_state(stack: TableStack) -> list:
    return [(t.keys.clone(), t.scores.clone(), t.digests.clone(), t.values.clone()) for t in stack.tables]


@pytest.mark.parametrize("mode, force", [(EVICT, False), (GROW, False), (KEEP, False), (READ_ONLY, False), (EVICT, True)])
@pytest.mark.parametrize("tables", [1, 3])
def test_an_uncontended_claim_equals_its_twin(mode, force, tables):
    """force: keys of full buckets evict whatever their own scores (a tiered table's
    promote_on_miss)."""
    pair = stacks(mode * 10 + tables, tables, mode)
    keys, tids = uncontended_lanes(mode + tables, pair[0], 120)
    g = torch.Generator().manual_seed(tables)
    # barred keys: every copy of a key or none (a barred copy of a key that another copy
    # inserts in the same call finds it or not by timing)
    bar = {k: bool(torch.rand(1, generator=g) < 0.15) for k in set(zip(keys.tolist(), tids.tolist()))}
    barred = torch.tensor([bar[k] for k in zip(keys.tolist(), tids.tolist())], device=DEVICE)
    scores = key_scores(keys, tids, g)
    results = []
    for fn, stack in zip(CLAIMS, pair):
        counts = torch.zeros(tables, NUM_COUNTED, dtype=torch.int64, device=DEVICE)
        out = fn(stack, keys, scores, BUCKET, tids if tables > 1 else None, counts=counts, barred=barred, force=force)
        results.append((out, counts, table_state(stack)))
    (got, got_counts, got_state), (want, want_counts, want_state) = results
    slots, inserted, evicted, victim_keys, victim_scores = got
    assert torch.equal(slots, want[0])
    assert per_key(keys, tids, inserted) == per_key(keys, tids, want[1])  # which copy reports it: any one
    assert max(per_key(keys, tids, inserted).values()) <= 1
    assert per_key(keys, tids, evicted) == per_key(keys, tids, want[2])
    assert victims_of(keys, tids, got) == victims_of(keys, tids, want)
    assert torch.equal(got_counts, want_counts)
    for a, b in zip(got_state, want_state):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert bool((slots[barred & (slots >= 0)] >= 0).all()) and not bool(inserted[barred].any())  # barred: found, never stored
    if mode == EVICT:
        assert bool(evicted.any())  # the case reaches the second phase
        assert force or not bool((evicted & (victim_scores > scores)).any())  # unforced: no victim above its key
    if mode == GROW:
        assert bool((slots == -2).any())


@pytest.mark.parametrize("fn", CLAIMS)
def test_a_forced_claim_evicts_rows_scored_above_its_keys(fn):
    """A full bucket of rows scored 9 and a new key scored 1: unforced, the key is not
    stored; forced, it takes the lowest (score, column) row and reports its victim."""
    t = TritonHashTable(DIM, capacity=BUCKET * BUCKETS, max_capacity=BUCKET * BUCKETS, bucket_size=BUCKET, device=DEVICE)
    candidates = torch.arange(-4000, 4000)
    bucket = candidates[bucket_of(candidates, BUCKETS) == 0]
    residents, newcomer = bucket[:BUCKET], bucket[BUCKET : BUCKET + 1]
    resident_scores = torch.tensor([9, 9, 9, 7, 9, 7, 9, 9])
    t.insert_or_assign(residents.to(DEVICE), torch.zeros(BUCKET, DIM, device=DEVICE), resident_scores.to(DEVICE))
    stack = TableStack(t.descriptor(EVICT)[None], [t])
    ones = torch.ones(1, dtype=torch.int64, device=DEVICE)
    slots, inserted, evicted, _, _ = fn(stack, newcomer.to(DEVICE), ones, BUCKET)
    assert int(slots[0]) == -1 and not bool(inserted[0]) and not bool(evicted[0])
    slots, inserted, evicted, victim_keys, victim_scores = fn(stack, newcomer.to(DEVICE), ones, BUCKET, force=True)
    lowest = residents[3]  # the lower of the two columns scored 7
    assert bool(inserted[0]) and bool(evicted[0]) and int(victim_keys[0]) == int(lowest) and int(victim_scores[0]) == 7
    assert int(t.keys[slots[0]]) == int(newcomer[0]) and int(t.scores[slots[0]]) == 1


def test_per_lane_inputs_of_another_length_are_refused():
    """A barred mask, table ids or scores shorter than the keys would be read past their
    end by the kernel: the claim names the input instead."""
    stack = stacks(3, 2)[0]
    keys = torch.arange(10, device=DEVICE)
    tids = torch.zeros(10, dtype=torch.int32, device=DEVICE)
    scores = torch.ones(10, dtype=torch.int64, device=DEVICE)
    for kw, name in [(dict(barred=torch.zeros(7, dtype=torch.bool, device=DEVICE)), "barred"),
                     (dict(tids=tids[:9]), "tids"), (dict(scores=scores[:3]), "scores")]:
        args = dict(tids=tids, scores=scores) | kw
        with pytest.raises(ValueError, match=f"claim: {name} has"):
            claim(stack, keys, args.pop("scores"), BUCKET, **args)
    per_table = torch.ones(2, dtype=torch.int64, device=DEVICE)  # one score per table: not per lane
    slots = claim(stack, keys, per_table, BUCKET, tids, table_scores=True)[0]
    assert slots.numel() == 10


@pytest.mark.parametrize("n", [117, 122])
def test_every_output_starts_aligned_whatever_the_count(n):
    """The outputs share one allocation; each starts 16-byte aligned (a kernel handed a
    view that is not compiles again mid-run), and they hold what the twin's do."""
    pair = stacks(7, 1, EVICT)
    keys, tids = uncontended_lanes(3, pair[0], n)
    scores = key_scores(keys, tids, torch.Generator().manual_seed(1))
    got, want = (fn(stack, keys, scores, BUCKET) for fn, stack in zip(CLAIMS, pair))
    assert all(x.data_ptr() % ALIGN_BYTES == 0 for x in got)
    assert torch.equal(got[0], want[0]) and per_key(keys, tids, got[1]) == per_key(keys, tids, want[1])
    assert per_key(keys, tids, got[2]) == per_key(keys, tids, want[2]) and victims_of(keys, tids, got) == victims_of(keys, tids, want)


def test_per_table_scores_and_a_device_count():
    pair = stacks(5, 3)
    keys, tids = uncontended_lanes(6, pair[0], 90)
    per_table = torch.tensor([4, 30, 11], device=DEVICE)
    count = torch.tensor([70], dtype=torch.int32, device=DEVICE)
    outs = [fn(stack, keys, per_table, BUCKET, tids, table_scores=True, score_offset=3, count=count)
            for fn, stack in zip(CLAIMS, pair)]
    assert torch.equal(outs[0][0][:70], outs[1][0][:70])
    assert per_key(keys[:70], tids[:70], outs[0][1][:70]) == per_key(keys[:70], tids[:70], outs[1][1][:70])
    for a, b in zip(table_state(pair[0]), table_state(pair[1])):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("assign", [False, True])
def test_rows_move_with_the_claim(assign):
    """One table: rows of buf stored for inserted keys (assign: for every key stored),
    stored rows fetched back for the others. Copies of a key carry the same row here."""
    pair = stacks(7, 1)
    keys, tids = uncontended_lanes(8, pair[0], 100)
    scores = key_scores(keys, tids, torch.Generator().manual_seed(9))
    buf = torch.sin(keys.double()[:, None] * torch.arange(1, DIM + 1, device=DEVICE)).float()  # a row per key
    results = []
    for fn, stack in zip(CLAIMS, pair):
        rows = buf.clone()
        out = fn(stack, keys, scores, BUCKET, rows=rows, row_stride=stack.tables[0].row_stride, victims=False, assign=assign)
        results.append((out[0], rows, stack.tables[0].values.clone()))
    (slots, rows, values), (want_slots, want_rows, want_values) = results
    assert torch.equal(slots, want_slots) and torch.equal(values, want_values)
    if not assign:
        assert torch.equal(rows, want_rows)
    stored = slots >= 0
    if assign:
        assert torch.equal(values[slots[stored]], buf[stored])
    else:
        assert bool((rows[stored] == values[slots[stored]]).all())


def test_a_refused_claim_changes_nothing():
    pair = stacks(11, 2)
    keys, tids = uncontended_lanes(12, pair[0], 40)
    before = table_state(pair[0])
    for fn, stack in zip(CLAIMS, pair):
        fn(stack, keys, torch.ones_like(keys), BUCKET, tids, refuse=torch.ones(1, dtype=torch.int8, device=DEVICE))
        for a, b in zip(table_state(stack), before):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def check_claim(before: list, stack: TableStack, keys, tids, scores, out) -> None:
    """What any order of a contended claim gives (EVICT, a score per key)."""
    slots, inserted, evicted, victim_keys, victim_scores = out
    T = len(stack.tables)
    old = {(t, int(k)): s for t in range(T) for s, k in enumerate(before[t][0].tolist()) if k != EMPTY_KEY}
    after = {(t, int(k)): s for t in range(T) for s, k in enumerate(stack.tables[t].keys.tolist()) if k != EMPTY_KEY}
    lanes = list(zip(keys.tolist(), tids.tolist(), slots.tolist(), inserted.tolist(), evicted.tolist()))
    called = {(t, k) for k, t, *_ in lanes}
    for k, t, s, ins, ev in lanes:
        if k == EMPTY_KEY:
            assert s == -1 and not ins
        elif (t, k) in old:  # found where it was, and kept: a row the call uses is never evicted
            assert s == old[(t, k)] and not ins and after.get((t, k)) == s
        elif s >= 0:
            assert after.get((t, k)) == s
        else:
            assert s == -1 and (t, k) not in after
    assert max(per_key(keys, tids, inserted).values()) <= 1
    assert {key for key, n in per_key(keys, tids, inserted).items() if n} == set(after) - set(old)
    victims = {(t, int(v)) for v, t in zip(victim_keys[evicted].tolist(), tids[evicted].tolist())}
    assert victims == set(old) - set(after) and not victims & called
    for i in torch.nonzero(evicted).squeeze(1).tolist():
        assert int(victim_scores[i]) <= int(scores[i])
    # a new key left out: every row of its bucket that the call did not use scores above it
    # (rows are only taken as the call goes, so those were free when the key's turn came)
    used = {(t, s) for k, t, s, *_ in lanes if s >= 0}
    for i, (k, t, s, _, _) in enumerate(lanes):
        if s == -1 and k != EMPTY_KEY and (t, k) not in old:
            b = int(bucket_of(torch.tensor([k]), BUCKETS))
            free = [c for c in range(b * BUCKET, (b + 1) * BUCKET) if (t, c) not in used]
            assert all(int(stack.tables[t].scores[c]) > int(scores[i]) for c in free), (k, t)
    for (t, k), s in old.items():  # rows the call left alone
        if (t, k) not in called and (t, k) in after:
            assert int(stack.tables[t].scores[s]) == int(before[t][1][s])


@pytest.mark.parametrize("tables", [1, 3])
def test_a_contended_claim_keeps_what_any_order_keeps(tables):
    pair = stacks(20 + tables, tables, stored=60)
    g = torch.Generator().manual_seed(tables)
    n = 150
    keys = torch.randint(-600, 600, (n,), generator=g).to(DEVICE)
    keys[::13] = EMPTY_KEY
    tids = torch.randint(0, tables, (n,), generator=g).to(DEVICE)
    scores = key_scores(keys, tids, g)
    for fn, stack in zip(CLAIMS, pair):
        before = table_state(stack)
        out = fn(stack, keys, scores, BUCKET, tids if tables > 1 else None)
        check_claim(before, stack, keys, tids if tables > 1 else torch.zeros_like(tids), scores, out)
        assert bool(out[2].any()) and bool((out[0] == -1).any())  # evictions, and keys that lost
