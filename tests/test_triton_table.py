"""The Triton table against its oracle, the reference table: long random op sequences,
compared state for state (keys, scores, rows: the layouts are the same, bit for bit).
On CPU the kernels run under TRITON_INTERPRET=1 at small sizes; on a GPU at larger ones."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, ReferenceHashTable
from kernels.dynamic_embedding.table_base import EvictedBuffers
from kernels.dynamic_embedding.triton_table import TritonHashTable
from kernels.dynamic_embedding.hashing import EMPTY_KEY, bucket_of, hash64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 64 if DEVICE == "cuda" else 1  # batch sizes on a GPU
# hypothesis examples of the fast-mode property tests: the interpreter's runs are the
# suite's longest, so fewer on a CPU
FAST_MODE_EXAMPLES = 25 if DEVICE == "cuda" else 10
NO_WAIT_EXAMPLES = 20 if DEVICE == "cuda" else 12
OPS = ["find", "find_scores", "find_or_insert", "find_or_insert_values", "insert_or_assign", "assign", "accumulate", "erase", "export", "find_values"]

op_lists = st.lists(
    st.tuples(
        st.sampled_from(OPS),
        st.integers(min_value=0, max_value=48),  # batch size
        st.integers(min_value=0, max_value=2**31 - 1),  # seed of the batch's keys, rows, scores
    ),
    min_size=1,
    max_size=40,
)


def batch(n: int, seed: int, row_dim: int, key_range: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-key_range, key_range, (n,), generator=g)
    if seed % 3 == 0 and n:  # sometimes far-apart raw ids, int64 extremes included
        keys[0], keys[-1] = 2**63 - 1, -(2**63) + 1
    rows = torch.randn(n, row_dim, generator=g)
    scores = torch.randint(0, 20, (n,), generator=g)
    return keys.to(DEVICE), rows.to(DEVICE), scores.to(DEVICE)


def assert_same_state(ref, tri):
    assert ref.capacity == tri.capacity
    for name in ("keys", "scores", "values"):
        a, b = getattr(ref, name), getattr(tri, name)
        differ = (a != b).reshape(len(a), -1).any(1).nonzero().flatten()[:4].tolist()
        assert not differ, f"{name} differ at slots {differ}: reference {a[differ].tolist()}, triton {b[differ].tolist()}"


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"reference {a.tolist()[:8]}... triton {b.tolist()[:8]}..."
    elif isinstance(a, (tuple, list)):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif hasattr(a, "keys") and hasattr(a, "rows"):  # Evicted
        assert_same((a.keys, a.rows, a.scores), (b.keys, b.rows, b.scores))
    else:
        assert a == b


def apply(table, op, keys, rows, scores):
    if op == "find":
        return table.find(keys)
    if op == "find_scores":
        return table.find_scores(keys)
    if op == "find_or_insert":
        out = table.find_or_insert(keys, scores)
        slots, inserted, _ = out
        # the caller initializes new rows; from the key, so that copies of a key write the
        # same row (which copy's write lands is unspecified on CUDA)
        init = (keys[:, None] % 997).float() + torch.arange(table.row_dim, device=keys.device)
        table.values[slots[inserted]] = init[inserted]
        return out
    if op == "find_or_insert_values":
        buffer = rows.clone()
        return table.find_or_insert_values(keys, scores, buffer), buffer
    if op == "insert_or_assign":
        return table.insert_or_assign(keys, rows, scores)
    if op == "assign":
        return table.assign(keys, rows, scores)
    if op == "accumulate":
        return table.accumulate(keys, rows, scores)
    if op == "erase":
        return table.erase(keys)
    if op == "export":
        return table.export(min_score=int(scores[0]) if len(scores) else None)
    if op == "find_values":
        slots = table.find(keys)
        out = torch.zeros(len(keys), 2, device=keys.device)
        found = slots != -1
        out[found] = table.values[slots[found], :2]
        return found, out


@pytest.mark.parametrize("max_capacity", [32, 1 << 12], ids=["evicting", "growing"])
@pytest.mark.parametrize("bucket_size", [8, 16])  # 16: probes read a bucket's digests in two halves
@settings(max_examples=25, deadline=None)  # x 4 parameter sets: the suite's longest test under the interpreter
@given(sequence=op_lists, host_rows=st.booleans())
def test_triton_table_matches_reference(max_capacity, bucket_size, sequence, host_rows):
    """host_rows: the Triton table's rows in pinned host memory (on a GPU, reached in place)."""
    kw = dict(row_dim=3, capacity=16 * SCALE, max_capacity=max_capacity * SCALE, bucket_size=bucket_size, device=DEVICE)
    ref, tri = ReferenceHashTable(**kw), TritonHashTable(**kw, host_rows=host_rows)
    for i, (op, n, seed) in enumerate(sequence):
        keys, rows, scores = batch(n * SCALE, seed, 3, key_range=40 * SCALE)
        try:
            if op == "find_values":  # the fused kernel against the reference's find + gather
                out = torch.zeros(len(keys), 2, device=keys.device)
                assert_same(apply(ref, op, keys, rows, scores), (tri.find_values(keys, out), out))
            else:
                assert_same(apply(ref, op, keys, rows, scores), apply(tri, op, keys, rows, scores))
            assert_same_state(ref, tri)
            assert ref.size() == tri.size() and ref.load_factor() == tri.load_factor()
        except AssertionError as e:
            raise AssertionError(f"after op {i} ({op} of {n * SCALE} keys): {e}") from None


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad", "rowwise_adagrad"])
def test_fused_update_kernel_matches_the_reference_update(optimizer):
    from kernels.dynamic_embedding import OptimizerConfig
    from kernels.dynamic_embedding.optimizers import update
    from kernels.dynamic_embedding.triton_optimizers import fused_update

    for clip in (None, 0.5):
        cfg = OptimizerConfig(name=optimizer, lr=0.1, weight_decay=0.01, max_grad_norm=clip)
        g = torch.Generator().manual_seed(1)
        values = torch.randn(12, 5 + cfg.state_dim(5), generator=g).abs().to(DEVICE)
        expected = values.clone()
        slots = torch.tensor([3, -1, 7, 0, 11], device=DEVICE)  # -1: an id without a row
        for _ in range(3):
            grads = torch.randn(5, 5, generator=g).to(DEVICE)
            ok = slots >= 0
            expected[slots[ok]] = update(cfg, expected[slots[ok]], grads[ok], 5)
            fused_update(cfg, values, slots, grads, 5)
        torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6)


def test_embedding_on_the_triton_backend_trains_like_the_reference():
    results = []
    for backend in ("reference", "triton"):
        config = EmbeddingConfig(dim=4, capacity=16, max_capacity=64, bucket_size=8, backend=backend, deterministic=True)
        e = DynamicEmbedding(config, DEVICE)
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            ids = torch.randint(-100, 100, (40,), generator=g).to(DEVICE)
            rows = e.lookup(ids).requires_grad_(True)
            rows.square().sum().backward()
            e.apply_gradients(ids, rows.grad)
        results.append((e.table.keys.clone(), e.table.values.clone(), e.stats()))
    # the same rows in the same slots; values equal up to float rounding (the fused Triton
    # update computes Adam's bias correction as exp(t·log β), the reference as β**t)
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)
    assert results[0][2] == results[1][2] and results[0][2].evictions > 0


def test_triton_table_refuses_odd_bucket_sizes_and_handles_empty_calls():
    with pytest.raises(ValueError, match="power-of-two"):
        TritonHashTable(row_dim=2, bucket_size=6, device=DEVICE)
    t = TritonHashTable(row_dim=2, capacity=16, bucket_size=8, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert t.find(empty).numel() == 0 and t.export()[0].numel() == 0
    assert t.find_values(empty, torch.empty(0, 2, device=DEVICE)).numel() == 0
    assert t.accumulate(empty, torch.empty(0, 2, device=DEVICE), empty).keys.numel() == 0


@pytest.mark.parametrize("max_capacity", [16, 64], ids=["evicting", "growing"])
def test_triton_find_never_finds_the_reserved_key_and_inserts_refuse_it(max_capacity):
    t = TritonHashTable(row_dim=2, capacity=16, max_capacity=max_capacity, bucket_size=8, device=DEVICE, deterministic=False)
    keys = torch.tensor([3, 4], device=DEVICE)
    t.find_or_insert(keys, torch.zeros_like(keys))
    probe = torch.tensor([EMPTY_KEY, 3, 5], device=DEVICE)
    slots = t.find(probe)  # the empty slots hold EMPTY_KEY: a plain key compare would match them
    assert slots[0].item() == -1 and slots[1].item() >= 0 and slots[2].item() == -1
    out = torch.zeros(3, 2, device=DEVICE)
    assert t.find_values(probe, out).tolist() == [False, True, False]
    before = t.export()
    # the refusal is read after the claim launches, which do nothing for such a batch
    with pytest.raises(ValueError, match="reserved"):
        t.find_or_insert(probe, torch.full_like(probe, 7))
    with pytest.raises(ValueError, match="reserved"):
        t.insert_or_assign(probe, torch.ones(3, 2, device=DEVICE), torch.full_like(probe, 7))
    for a, b in zip(before, t.export()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("count", [None, 5])
def test_probe_returns_the_stored_scores_of_several_tables(count):
    """probe(scores=) across a stack of tables: each found key's score in its own table
    (the reference table's, for the same inserts), 0 for missing keys; past a device
    count nothing is written."""
    from kernels.dynamic_embedding.probe_kernels import TableStack, probe

    g = torch.Generator().manual_seed(3)
    tables, refs = [], []
    for t in range(3):
        keys = torch.randint(-1000, 1000, (40,), generator=g).unique()
        scores = torch.randint(1, 10**12, (keys.numel(),), generator=g)
        tri = TritonHashTable(row_dim=2, capacity=64, bucket_size=8, device=DEVICE)
        ref = ReferenceHashTable(row_dim=2, capacity=64, bucket_size=8)
        tri.find_or_insert(keys.to(DEVICE), scores.to(DEVICE))
        ref.find_or_insert(keys, scores)
        tables.append(tri)
        refs.append(ref)
    query = torch.randint(-1000, 1000, (30,), generator=g)
    tids = torch.randint(0, 3, (30,), generator=g)
    stack = TableStack(torch.stack([t.descriptor() for t in tables]), tables)
    got = torch.full((30,), -7, dtype=torch.int64, device=DEVICE)
    n = torch.tensor([count], dtype=torch.int32, device=DEVICE) if count is not None else None
    slots = probe(stack, query.to(DEVICE), 8, 0, tids.to(DEVICE), count=n, scores=got)
    expected = []
    for k, t in zip(query.tolist(), tids.tolist()):
        s = refs[t].find(torch.tensor([k]))
        expected.append(int(refs[t].scores[s]) if s.item() >= 0 else 0)
    used = count if count is not None else 30
    assert got[:used].tolist() == expected[:used]
    assert (got[used:] == -7).all()  # past the count: left as they were
    assert ((slots[:used] >= 0).cpu() == torch.tensor(expected[:used]).ne(0)).all()


def keys_sharing_a_digest(n: int, num_buckets: int, bucket: int) -> torch.Tensor:
    """n keys of one bucket whose hashes share their top byte (the probe's digest)."""
    pool = torch.arange(1, 400_000, dtype=torch.int64)
    pool = pool[bucket_of(pool, num_buckets) == bucket]
    top = (hash64(pool) >> 56) & 0xFF
    return pool[top == torch.bincount(top).argmax()][:n]


@pytest.mark.parametrize("bucket_size,capacity,bucket", [(128, 256, 1), (4, 16, 3), (8, 16, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_keys_with_the_same_digest_are_told_apart(bucket_size, capacity, bucket, deterministic):
    """Probes compare digests 8 columns at a time and load keys only for the columns that
    match: with every key of a bucket sharing one digest, each probe walks all of its
    candidates. Small buckets share a digest word with their neighbours, which hold keys."""
    kw = dict(row_dim=2, capacity=capacity, max_capacity=capacity, bucket_size=bucket_size)
    num_buckets = capacity // bucket_size
    same = keys_sharing_a_digest(bucket_size + 2, num_buckets, bucket)
    stored, absent = same[: bucket_size - 1], same[bucket_size - 1 :]
    pool = torch.arange(10_000, 20_000)
    others = torch.cat([pool[bucket_of(pool, num_buckets) == b][: bucket_size // 2] for b in range(num_buckets) if b != bucket])
    ref = ReferenceHashTable(**kw, device="cpu")
    fast = TritonHashTable(**kw, device=DEVICE, deterministic=deterministic)
    for keys in (others, stored):
        zeros = torch.zeros_like(keys)
        ref.insert_or_assign(keys, torch.ones(len(keys), 2), zeros)
        fast.insert_or_assign(keys.to(DEVICE), torch.ones(len(keys), 2, device=DEVICE), zeros.to(DEVICE))
    slots = fast.find(same.to(DEVICE)).cpu()
    assert bool((slots[: bucket_size - 1] >= 0).all()) and bool((slots[bucket_size - 1 :] == -1).all())
    assert torch.equal(fast.keys[slots[: bucket_size - 1]].cpu(), stored)
    assert set(fast.export()[0].tolist()) == set(ref.export()[0].tolist())
    # one slot of the bucket is free: the first absent key takes it, the next two evict
    scores = torch.full_like(absent, 5)
    got, inserted, evicted = fast.find_or_insert(absent.to(DEVICE), scores.to(DEVICE))
    _, want_inserted, want_evicted = ref.find_or_insert(absent, scores)
    assert torch.equal(inserted.cpu(), want_inserted) and torch.equal(fast.keys[got].cpu(), absent)
    lost = set(evicted.keys.tolist())
    assert len(lost) == len(want_evicted.keys) == 2 and lost <= set(stored.tolist())
    if deterministic:  # the reference's victims; fast mode's depend on where its keys landed
        assert lost == set(want_evicted.keys.tolist())
    assert set(fast.export()[0].tolist()) == set(others.tolist()) | set(stored.tolist()) - lost | set(absent.tolist())
    assert torch.equal(fast.find(same.to(DEVICE)).cpu() >= 0, torch.tensor([k not in lost for k in same.tolist()]))


@pytest.mark.parametrize("max_capacity", [64, 1 << 12], ids=["evicting", "growing"])
@settings(max_examples=FAST_MODE_EXAMPLES, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(0, 48), st.integers(0, 2**31 - 1)), min_size=1, max_size=15))
def test_fast_mode_keeps_the_tables_promises(max_capacity, batches):
    """Fast mode places keys by compare-and-swap (layout depends on timing); what it
    promises: every returned slot holds its key, no key is stored twice, one copy of each
    new key is reported inserted, evicted keys are not from the call, and below max
    capacity the stored keys are the reference's."""
    kw = dict(row_dim=2, capacity=16 * SCALE, max_capacity=max_capacity * SCALE, bucket_size=8, device=DEVICE)
    ref, fast = ReferenceHashTable(**kw), TritonHashTable(**kw, deterministic=False)
    for step, (n, seed) in enumerate(batches, start=1):
        keys, rows, _ = batch(n * SCALE, seed, 2, key_range=60 * SCALE)
        step_scores = torch.full_like(keys, step)
        before = set(fast.export()[0].tolist())
        _, ref_inserted, _ = ref.find_or_insert(keys, step_scores)
        slots, inserted, evicted = fast.find_or_insert(keys, step_scores)
        stored = slots >= 0
        assert torch.equal(fast.keys[slots[stored]], keys[stored])
        table_keys = fast.export()[0].tolist()
        assert len(table_keys) == len(set(table_keys)) == fast.size()
        new_reported = keys[inserted].tolist()
        assert len(new_reported) == len(set(new_reported)) and not set(new_reported) & before
        assert not set(evicted.keys.tolist()) & set(keys.tolist())
        assert set(evicted.keys.tolist()) <= before
        # scores rise with the step, so a new key goes unstored only where every row of
        # its bucket is used by this call
        call = set(keys.tolist())
        for key in keys[~stored].tolist():
            bucket = int(bucket_of(torch.tensor([key]), fast.num_buckets))
            assert set(fast.keys.view(fast.num_buckets, -1)[bucket].tolist()) <= call
        if max_capacity > 64:
            assert bool(stored.all())
            assert set(table_keys) == set(ref.export()[0].tolist())
            assert set(new_reported) == set(keys[ref_inserted].tolist())


def keys_in_bucket(bucket: int, num_buckets: int, count: int, start: int) -> torch.Tensor:
    """The first `count` integers from `start` on that hash to `bucket`."""
    candidates = torch.arange(start, start + 64 * count * num_buckets)
    return candidates[bucket_of(candidates, num_buckets) == bucket][:count].to(DEVICE)


@pytest.mark.parametrize("call", ["find_or_insert", "find_or_insert_values", "insert_or_assign"])
@pytest.mark.parametrize("returning", [True, False])
@pytest.mark.parametrize("dim", [3, 130])
def test_keys_waiting_on_a_full_bucket_take_its_rows_in_turn(call, returning, dim):
    """At max capacity every new key of a full bucket waits for the eviction launch, where
    one program takes the bucket's waiting keys one after the other: copies of a new key
    share one row, rows the call uses are never taken, keys past the bucket's unused rows
    are not stored, and the next call starts clean. (Rows of 130 values: wider than the
    part of a row the eviction reads ahead.)"""
    t = TritonHashTable(row_dim=dim, capacity=16, max_capacity=16, bucket_size=8, device=DEVICE, deterministic=False)
    old, other = keys_in_bucket(0, 2, 8, 0), keys_in_bucket(1, 2, 8, 0)
    t.insert_or_assign(torch.cat([old, other]), torch.zeros(16, dim, device=DEVICE), torch.zeros(16, dtype=torch.int64, device=DEVICE))
    assert t.size() == 16
    used = old[:2]
    g = torch.Generator().manual_seed(0)
    for step, distinct in ((1, 5), (2, 8)):  # 2 found keys leave 6 rows to take: 5 new keys fit, then 8 do not
        new = keys_in_bucket(0, 2, distinct, 1000 * step)
        keys = torch.cat([new.repeat(3), used, other])  # with found keys of the other bucket, all interleaved
        keys = keys[torch.randperm(len(keys), generator=g).to(DEVICE)]
        rows = torch.randn(len(keys), dim, device=DEVICE)
        scores = torch.full_like(keys, step)
        before = stored_rows(t)
        if call == "insert_or_assign":
            lost = t.insert_or_assign(keys, rows, scores, return_evicted=returning)
            slots = t.find(keys)
        elif call == "find_or_insert_values":
            buffer = rows.clone()
            slots, inserted, lost = t.find_or_insert_values(keys, scores, buffer, return_evicted=returning)
            stored = slots >= 0
            assert torch.equal(buffer[stored], t.values[slots[stored]]) and torch.equal(buffer[~stored], rows[~stored])
        else:
            slots, inserted, lost = t.find_or_insert(keys, scores, return_evicted=returning)
        if call != "insert_or_assign":
            assert sorted(keys[inserted].tolist()) == sorted(set(keys[inserted].tolist()))  # one copy each
            assert set(keys[inserted].tolist()) == set(keys[slots >= 0].tolist()) - set(before)
        stored_new = {k for k in new.tolist() if int(t.find(torch.tensor([k], device=DEVICE))) >= 0}
        assert len(stored_new) == min(distinct, 6)
        assert set(used.tolist()) <= set(t.export()[0].tolist())  # the call's found rows stay
        for k in new.tolist():  # every copy of a key has its row, or none has
            at = slots[keys == k]
            assert bool((at == at[0]).all()) and (int(at[0]) >= 0) == (k in stored_new)
            if k in stored_new and call == "insert_or_assign":
                assert any(torch.equal(t.values[at[0]], r) for r in rows[keys == k])
        assert t.size() == 16 and len(set(t.export()[0].tolist())) == 16 and set(other.tolist()) <= set(t.export()[0].tolist())
        assert not bool(t._heads.any())  # the lists' heads are left empty for the next call
        if returning:  # the victims: the keys gone, with their rows
            assert set(lost.keys.tolist()) == set(before) - set(t.export()[0].tolist())
            assert [tuple(r) for r in lost.rows.tolist()] == [before[k] for k in lost.keys.tolist()]
        else:
            assert lost.keys.numel() == 0
        used = new[:2]


@pytest.mark.parametrize("call", ["insert_or_assign", "find_or_insert_values"])
def test_fast_inserts_return_the_rows_they_evict(call):
    """A fast insert's evicted rows are the victims' rows, read before the new keys' rows
    are written into the same slots."""
    t = TritonHashTable(row_dim=3, capacity=16, max_capacity=16, bucket_size=8, device=DEVICE, deterministic=False)
    def rows_of(keys):
        return keys.to(torch.float32)[:, None].repeat(1, 3) * torch.tensor([1.0, -1.0, 0.5], device=DEVICE)
    old = torch.arange(100, 116, device=DEVICE)
    t.insert_or_assign(old, rows_of(old), torch.zeros_like(old))
    new = torch.arange(500, 510, device=DEVICE)
    values = rows_of(new)
    if call == "insert_or_assign":
        lost = t.insert_or_assign(new, values, torch.ones_like(new))
    else:
        lost = t.find_or_insert_values(new, torch.ones_like(new), values.clone())[2]
    assert lost.keys.numel() > 0 and set(lost.keys.tolist()) <= set(old.tolist())
    assert torch.equal(lost.rows, rows_of(lost.keys))
    out = torch.zeros(len(new), 3, device=DEVICE)
    stored = t.find_values(new, out)
    assert torch.equal(out[stored], values[stored]) and int(stored.sum()) >= len(lost.keys)


@pytest.mark.parametrize("deterministic", [False, True])
def test_inserts_can_drop_their_evictions(deterministic):
    """return_evicted=False: the same table, no evicted rows returned; in fast mode at max
    capacity no wait for the GPU, so the reserved key is not refused but never stored."""
    kw = dict(row_dim=2, capacity=16, max_capacity=16, bucket_size=8, device=DEVICE, deterministic=deterministic)
    kept, dropped = TritonHashTable(**kw), TritonHashTable(**kw)
    for step in range(1, 4):
        keys = torch.arange(step * 10, step * 10 + 12, device=DEVICE)
        rows = torch.randn(12, 2, device=DEVICE)
        scores = torch.full_like(keys, step)
        lost = kept.insert_or_assign(keys, rows, scores)
        assert dropped.insert_or_assign(keys, rows, scores, return_evicted=False).keys.numel() == 0
        assert dropped.size() == kept.size() and (step == 1 or lost.keys.numel() > 0)
        if deterministic:
            assert set(dropped.export()[0].tolist()) == set(kept.export()[0].tolist())
    values = torch.randn(3, 2, device=DEVICE)
    keys = torch.tensor([7, 8, 9], device=DEVICE)
    slots, inserted, lost = dropped.find_or_insert_values(keys, torch.full_like(keys, 9), values.clone(), return_evicted=False)
    assert lost.keys.numel() == 0 and bool(inserted.all()) and torch.equal(dropped.keys[slots], keys)
    with_reserved = torch.tensor([EMPTY_KEY, 5], device=DEVICE)
    if deterministic:
        with pytest.raises(ValueError, match="reserved"):
            dropped.find_or_insert(with_reserved, torch.full_like(with_reserved, 9), return_evicted=False)
    else:
        slots, inserted, _ = dropped.find_or_insert(with_reserved, torch.full_like(with_reserved, 9), return_evicted=False)
        assert slots.tolist()[0] == -1 and slots.tolist()[1] >= 0 and inserted.tolist() == [False, True]


@pytest.mark.parametrize("deterministic", [False, True])
def test_find_or_insert_values_moves_rows_both_ways(deterministic):
    table = TritonHashTable(row_dim=3, capacity=16 * SCALE, max_capacity=1 << 12, bucket_size=8, device=DEVICE, deterministic=deterministic)
    old = torch.arange(10, device=DEVICE)
    table.insert_or_assign(old, torch.full((10, 3), 5.0, device=DEVICE), torch.zeros_like(old))
    keys = torch.tensor([3, 100, 100, 4, 101], device=DEVICE)
    buffer = torch.arange(15, dtype=torch.float32, device=DEVICE).reshape(5, 3)
    given = buffer.clone()
    slots, inserted, _ = table.find_or_insert_values(keys, torch.ones_like(keys), buffer)
    assert torch.equal(buffer[[0, 3]], torch.full((2, 3), 5.0, device=DEVICE))  # found: the stored row
    assert torch.equal(table.values[slots[4]], given[4]) and torch.equal(buffer[4], given[4])  # new: stored
    stored_100 = table.values[slots[1]]
    assert any(torch.equal(stored_100, given[i]) for i in (1, 2))  # one copy's row ...
    assert torch.equal(buffer[1], stored_100) and torch.equal(buffer[2], stored_100)  # ... that both get back
    if deterministic:
        assert torch.equal(stored_100, given[1])  # the first copy
    assert int(inserted.sum()) == 2


def stored_rows(table) -> dict:
    keys, values, _ = table.export()
    return dict(zip(keys.tolist(), map(tuple, values.tolist())))


@settings(max_examples=NO_WAIT_EXAMPLES, deadline=None)
@given(batches=st.lists(
    st.tuples(st.sampled_from(["find_or_insert_values", "insert_or_assign"]), st.integers(0, 40), st.integers(0, 2**31 - 1)),
    min_size=1, max_size=10,
))
def test_fast_inserts_that_do_not_wait_move_rows_right(batches):
    """At max capacity with return_evicted=False (no wait for the GPU; find_or_insert_values
    moves its rows inside the claim, victims' rows simply overwritten), with duplicated
    keys and evictions: a stored key's row is its old row (found by
    find_or_insert_values) or one of its copies' rows, which every copy gets back; keys
    not stored keep their input; rows of keys the call does not touch are unchanged; no
    key is stored twice."""
    t = TritonHashTable(row_dim=3, capacity=32 * SCALE, max_capacity=32 * SCALE, bucket_size=8, device=DEVICE, deterministic=False)
    for step, (call, n, seed) in enumerate(batches, start=1):
        keys, rows, _ = batch(n * SCALE, seed, 3, key_range=40 * SCALE)
        before = stored_rows(t)
        scores = torch.full_like(keys, step)
        if call == "insert_or_assign":
            assert t.insert_or_assign(keys, rows, scores, return_evicted=False).keys.numel() == 0
            slots = t.find(keys)
        else:
            buffer = rows.clone()
            slots, inserted, lost = t.find_or_insert_values(keys, scores, buffer, return_evicted=False)
            assert lost.keys.numel() == 0
            assert torch.equal(buffer[slots < 0], rows[slots < 0])
            stored = slots >= 0
            assert torch.equal(buffer[stored], t.values[slots[stored]])
            assert torch.equal(t.values[slots[inserted]], rows[inserted])
        after = stored_rows(t)
        assert len(after) == t.size(), "a key is stored twice"
        copies: dict = {}
        for key, row in zip(keys.tolist(), map(tuple, rows.tolist())):
            copies.setdefault(key, set()).add(row)
        for key, row in after.items():
            if key not in copies:
                assert row == before[key], f"row of untouched key {key} changed"
            elif call == "find_or_insert_values" and key in before:
                assert row == before[key], f"row of found key {key} changed"
            else:
                assert row in copies[key], f"row of key {key} is none of its copies'"
        assert set(after) >= set(keys[slots >= 0].tolist())


def stored_entries(table) -> dict:
    keys, values, scores = table.export()
    return {k: (tuple(r), s) for k, r, s in zip(keys.tolist(), values.tolist(), scores.tolist())}


@pytest.mark.parametrize("kind", ["reference", "deterministic", "fast"])
@settings(max_examples=10, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2**31 - 1)), min_size=1, max_size=8))
def test_insert_and_evict_returns_every_row_it_pushes_out(kind, batches):
    """insert_and_evict at max capacity, with duplicated keys, int64 extremes and the
    reserved key (skipped, never stored): the keys stored before the call and gone after
    it are exactly the first `count` evicted entries, each with the row and score it had;
    the call's stored keys hold one of their copies' rows; other rows are unchanged.
    Buffers too small for the call are refused."""
    kw = dict(row_dim=3, capacity=32 * SCALE, max_capacity=32 * SCALE, bucket_size=8, device=DEVICE)
    table = ReferenceHashTable(**kw) if kind == "reference" else TritonHashTable(**kw, deterministic=kind == "deterministic")
    kept = EvictedBuffers.allocate(40 * SCALE, 3, torch.float32, DEVICE)
    for step, (n, seed) in enumerate(batches, start=1):
        keys, rows, _ = batch(n * SCALE, seed, 3, key_range=40 * SCALE)
        if seed % 5 == 0 and n:
            keys[n // 2] = EMPTY_KEY
        before = stored_entries(table)
        # every other call into buffers kept from call to call (their count starts again)
        out = table.insert_and_evict(keys, rows, torch.full_like(keys, step), kept if step % 2 else None)
        assert out.count.shape == (1,) and out.count.dtype == torch.int64 and out.count.device == keys.device
        e = int(out.count)
        after = stored_entries(table)
        evicted = out.keys[:e].tolist()
        assert out.evicted().keys.tolist() == evicted and torch.equal(out.evicted().rows, out.rows[:e])
        assert len(set(evicted)) == e and set(evicted) == set(before) - set(after)
        for key, row, score in zip(evicted, out.rows[:e].tolist(), out.scores[:e].tolist()):
            assert (tuple(row), score) == before[key]
        assert EMPTY_KEY not in after
        copies: dict = {}
        for key, row in zip(keys.tolist(), map(tuple, rows.tolist())):
            copies.setdefault(key, set()).add(row)
        for key, (row, _) in after.items():
            assert row in copies[key] if key in copies else row == before[key][0], f"row of key {key}"
    keys = torch.arange(2, device=DEVICE)
    with pytest.raises(ValueError, match="needs 2"):
        table.insert_and_evict(keys, torch.zeros(2, 3, device=DEVICE), keys, EvictedBuffers.allocate(1, 3, torch.float32, DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="only a GPU has waits to count")
def test_fast_insert_and_evict_never_waits_for_the_gpu():
    t = TritonHashTable(row_dim=4, capacity=1024, max_capacity=1024, bucket_size=8, device=DEVICE, deterministic=False)
    kept = EvictedBuffers.allocate(4096, 4, torch.float32, DEVICE)
    t.insert_and_evict(torch.arange(4096, device=DEVICE), torch.ones(4096, 4, device=DEVICE), torch.zeros(4096, dtype=torch.int64, device=DEVICE))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            keys = torch.arange(4096 * step, 4096 * (step + 1), device=DEVICE)
            t.insert_and_evict(keys, torch.ones(4096, 4, device=DEVICE), torch.full_like(keys, step), kept)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(kept.count) > 0
