"""Many tables in one launch: a collection's grouped features against the same features
trained one by one by their own DynamicEmbedding."""
import pytest
import torch
from conftest import assert_same_rows
from hypothesis import example, given, settings, strategies as st

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, EMPTY_KEY, OptimizerConfig
from kernels.dynamic_embedding.collection import DynamicEmbeddingCollection
from kernels.dynamic_embedding.hashing import bucket_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ADAM = OptimizerConfig("adam", lr=0.1)


def configs(max_capacity: int) -> dict[str, EmbeddingConfig]:
    kw = dict(dim=8, optimizer=ADAM, bucket_size=8, backend="triton", capacity=16, max_capacity=max_capacity)
    return {
        "user": EmbeddingConfig(**kw),
        "item": EmbeddingConfig(**kw, seed=3, eviction="epoch_lru"),
        "shared": EmbeddingConfig(**kw, seed=5, read_only=True),
        "counted": EmbeddingConfig(**kw, seed=7, eviction="epoch_lfu"),
        "ranked": EmbeddingConfig(**kw, seed=9, eviction="custom"),
        "admitted": EmbeddingConfig(**kw, seed=11, admission_threshold=2),
        "tag": EmbeddingConfig(dim=4, bucket_size=8, backend="triton", eviction="lfu", capacity=16, max_capacity=max_capacity),
        "clipped": EmbeddingConfig(
            dim=4, optimizer=OptimizerConfig("rowwise_adagrad", lr=0.1, max_grad_norm=0.5), bucket_size=8, backend="triton",
            capacity=16, max_capacity=max_capacity,
        ),
    }


def test_collection_groups_features_by_layout():
    c = DynamicEmbeddingCollection(configs(256), DEVICE)
    groups = [g.names for g in c.groups]
    assert groups == [["user", "item", "shared", "counted", "ranked", "admitted"], ["tag"], ["clipped"]] and c.single == []
    assert [g.per_key_scores for g in c.groups] == [True, True, False]
    with pytest.raises(KeyError, match="no table for features"):
        c.lookup({"nope": torch.zeros(1, dtype=torch.int64)})


@settings(max_examples=8, deadline=None)
@given(steps=st.lists(
    st.tuples(st.integers(0, 80), st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([1, 30])), min_size=1, max_size=6,
))
# a growth settled at the update whose claim again passes the load factor: the table grows
# once more, as alone
@example(steps=[(32, 1439, True, 30), (66, 717967170, False, 1)])
def test_collection_trains_like_its_tables_one_by_one(steps):
    """Growing tables (three groups, of every eviction policy and with admission): lookups, rows, scores (lfu and epoch_lfu counts, custom scores included),
    optimizer state and statistics equal those of each feature's own DynamicEmbedding; some
    features sit out some calls, some calls do not train, some updates get ids other than
    the lookup's, and some calls repeat two ids more often than the update sums in one
    program (collection.LONG_SEGMENT)."""
    cfg = configs(1 << 10)
    coll = DynamicEmbeddingCollection(cfg, DEVICE)
    alone = {n: DynamicEmbedding(c, DEVICE) for n, c in cfg.items()}
    for step, (n, seed, train, width) in enumerate(steps):
        gen = torch.Generator().manual_seed(seed)
        names = [name for i, name in enumerate(cfg) if (seed >> i) & 1 or i == 0]
        ids = {name: torch.randint(-width, width, (n,), generator=gen).to(DEVICE) for name in names}
        coll.set_epoch(step // 2)
        for e in alone.values():
            e.epoch = step // 2
        scores = {name: torch.randint(0, 1000, (n,), generator=gen).to(DEVICE) for name in names if cfg[name].eviction == "custom"}
        got = coll.lookup(ids, train=train, scores=scores)
        for name in names:
            # rows equal to rounding: copies' gradients are summed in another order
            expected = alone[name].lookup(ids[name], train=train, scores=scores.get(name))
            torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6)
        grads = {name: torch.randn(n, cfg[name].dim, generator=gen).to(DEVICE) for name in names}
        if seed % 3 == 0:  # an update of other ids than the lookup's
            ids = {name: x.flip(0) for name, x in ids.items()}
            grads = {name: g.flip(0) for name, g in grads.items()}
        coll.apply_gradients(ids, grads)
        for name in names:
            alone[name].apply_gradients(ids[name], grads[name])
    for name in cfg:
        assert_same_rows(coll[name], alone[name])
        assert coll[name].stats() == alone[name].stats(), name
        assert coll[name].step == alone[name].step


@pytest.mark.parametrize("policy", ["lfu", "epoch_lfu"])
def test_a_group_of_one_counting_policy_scores_as_its_tables(policy):
    """A group whose members all count uses (the claim's scores computed for all at once,
    with no per-lane choice among policies) stores the same counts and trains the same
    rows as each table alone, across epochs."""
    kw = dict(dim=8, optimizer=ADAM, bucket_size=8, backend="triton", capacity=16, max_capacity=1 << 10, eviction=policy)
    cfg = {"a": EmbeddingConfig(**kw), "b": EmbeddingConfig(**kw, seed=1)}
    coll = DynamicEmbeddingCollection(cfg, DEVICE)
    assert [g.names for g in coll.groups] == [["a", "b"]]
    alone = {n: DynamicEmbedding(c, DEVICE) for n, c in cfg.items()}
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        coll.set_epoch(step // 3)
        for e in alone.values():
            e.epoch = step // 3
        ids = {n: torch.randint(-40, 40, (50,), generator=gen).to(DEVICE) for n in cfg}
        grads = {n: torch.randn(50, 8, generator=gen).to(DEVICE) for n in cfg}
        got = coll.lookup(ids)
        coll.apply_gradients(ids, grads)
        for n in cfg:
            torch.testing.assert_close(got[n], alone[n].lookup(ids[n]), rtol=1e-5, atol=1e-6)
            alone[n].apply_gradients(ids[n], grads[n])
    for n in cfg:
        assert_same_rows(coll[n], alone[n])
        assert coll[n].stats() == alone[n].stats(), n
    counts = coll["a"].export_rows()[3]
    assert int(counts.max() & 0xFFFFFFFF) > 1  # ids seen more than once hold counts above one


@settings(max_examples=8, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 2**31 - 1)), min_size=1, max_size=6))
def test_evicting_collection_keeps_the_tables_promises(batches):
    """At max capacity placement depends on timing; what holds: every id gets its row's
    embedding (or its initial one when not stored), no key is stored twice, and an id goes
    unstored only where every row of its bucket is used by the same call."""
    cfg = {n: c for n, c in configs(64).items() if n in ("user", "item")}
    coll = DynamicEmbeddingCollection(cfg, DEVICE)
    for n, seed in batches:
        gen = torch.Generator().manual_seed(seed)
        ids = {name: torch.randint(-100, 100, (n,), generator=gen).to(DEVICE) for name in cfg}
        got = coll.lookup(ids)
        for name, x in ids.items():
            coll[name].stats()  # a growth the lookup's check asks for is settled by the table's next call
            table = coll[name].table
            slots = table.find(x)
            stored = slots >= 0
            assert torch.equal(got[name][stored], table.values[slots[stored], : cfg[name].dim])
            assert torch.equal(got[name][~stored], coll[name].initial_rows(x[~stored])[:, : cfg[name].dim])
            keys = table.export()[0].tolist()
            assert len(keys) == len(set(keys))
            call = set(x.tolist())
            for key in x[~stored].tolist():
                bucket = int(bucket_of(torch.tensor([key]), table.num_buckets))
                assert set(table.keys.view(table.num_buckets, -1)[bucket].tolist()) <= call
        coll.apply_gradients(ids, {name: torch.ones_like(e) for name, e in got.items()})
    s = coll["user"].stats()
    assert s.size <= 64 and s.inserts - s.evictions == s.size


def test_reserved_key_and_empty_calls():
    coll = DynamicEmbeddingCollection(configs(256), DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert coll.lookup({"user": empty, "tag": empty})["user"].shape == (0, 8)
    coll.apply_gradients({"user": empty}, {"user": torch.empty(0, 8, device=DEVICE)})
    ids = torch.tensor([EMPTY_KEY, 7], device=DEVICE)
    got = coll.lookup({"user": ids})["user"]
    user = coll["user"]
    assert torch.equal(got[0], user.initial_rows(ids[:1])[0, :8])  # served, never stored
    assert user.export_rows()[0].tolist() == [7]
    assert user.stats().rejections == 1


def test_calls_of_one_id():
    """One id in a call (kernels whose sizes come to 1 are compiled apart on a GPU): it
    trains as its table alone trains it."""
    cfg = configs(256)["user"]
    coll, alone = DynamicEmbeddingCollection({"user": cfg}, DEVICE), DynamicEmbedding(cfg, DEVICE)
    ids = torch.tensor([11], device=DEVICE)
    grads = torch.ones(1, 8, device=DEVICE)
    for _ in range(2):
        torch.testing.assert_close(coll.lookup({"user": ids})["user"], alone.lookup(ids))
        coll.apply_gradients({"user": ids}, {"user": grads})
        alone.apply_gradients(ids, grads)
    assert_same_rows(coll["user"], alone)


def test_update_after_the_tables_changed_looks_rows_up_again():
    """Erasing and inserting between a lookup and its update move keys between slots: the
    update must not reuse the lookup's slots."""
    cfg = configs(256)["user"]
    coll, alone = DynamicEmbeddingCollection({"user": cfg}, DEVICE), DynamicEmbedding(cfg, DEVICE)
    ids = torch.arange(20, device=DEVICE)
    coll.lookup({"user": ids})
    alone.lookup(ids)
    new = torch.arange(100, 140, device=DEVICE)
    for table in (coll["user"].table, alone.table):
        table.erase(ids[:5])
        table.insert_or_assign(new, torch.zeros(40, table.row_dim, device=DEVICE), torch.zeros_like(new))
    grads = torch.randn(20, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    coll.apply_gradients({"user": ids}, {"user": grads})
    alone.apply_gradients(ids, grads)
    assert_same_rows(coll["user"], alone)


def test_hot_ids_gradients_are_summed_across_programs():
    """Ids with hundreds of copies in a call (their sums span many programs of the
    update, whole tiles of one id among them) train as their table alone trains them, and
    the update reuses the lookup's routing."""
    cfg = configs(256)
    names = ["user", "item"]
    coll = DynamicEmbeddingCollection({n: cfg[n] for n in names}, DEVICE)
    alone = {n: DynamicEmbedding(cfg[n], DEVICE) for n in names}
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = {n: torch.cat([torch.full((150,), 7), torch.arange(5), torch.full((70,), -3)])[torch.randperm(225, generator=gen)].to(DEVICE)
               for n in names}
        grads = {n: torch.randn(225, 8, generator=gen).to(DEVICE) for n in names}
        coll.lookup(ids)
        routing = coll.groups[0].routing
        coll.apply_gradients(ids, grads)
        assert routing.placements == coll.groups[0]._placements()  # so the update reused it
        for n in names:
            alone[n].lookup(ids[n])
            alone[n].apply_gradients(ids[n], grads[n])
    for n in names:
        assert_same_rows(coll[n], alone[n])


SGD = OptimizerConfig("sgd", lr=0.5)


def shared_table(modes: dict[str, str]):
    """A collection whose features (name -> mode) all read one grouped table "movies",
    beside a second table so that the group has two members, and the table alone."""
    from kernels.dynamic_embedding.collection import FeatureConfig

    kw = dict(dim=4, optimizer=SGD, bucket_size=8, backend="triton", capacity=16, max_capacity=256)
    cfg = {"movies": EmbeddingConfig(**kw), "users": EmbeddingConfig(**kw, seed=9)}
    features = {n: FeatureConfig("movies", m) for n, m in modes.items()} | {"user": FeatureConfig("users")}
    coll = DynamicEmbeddingCollection(cfg, DEVICE, features=features)
    assert [sorted(g.names) for g in coll.groups] == [["movies", "users"]]
    return coll, DynamicEmbedding(cfg["movies"], DEVICE)


def test_features_sharing_a_table_read_and_train_it_as_one_id_space():
    coll, alone = shared_table({"watched": "read_write", "liked": "read_write"})
    ids = {"watched": torch.tensor([1, 2, 3, 2], device=DEVICE), "liked": torch.tensor([3, 9], device=DEVICE),
           "user": torch.tensor([5], device=DEVICE)}
    grads = {n: torch.randn(x.numel(), 4, generator=torch.Generator().manual_seed(len(n))).to(DEVICE) for n, x in ids.items()}
    joined = torch.cat([ids["watched"], ids["liked"]])
    for _ in range(2):
        rows = coll.lookup(ids)
        torch.testing.assert_close(torch.cat([rows["watched"], rows["liked"]]), alone.lookup(joined))
        coll.apply_gradients(ids, grads)
        alone.apply_gradients(joined, torch.cat([grads["watched"], grads["liked"]]))
    assert_same_rows(coll["movies"], alone)  # id 3 of both features: one row, both gradients
    assert coll["users"].stats().size == 1


def test_a_read_only_feature_neither_inserts_nor_bumps_scores_nor_trains():
    coll, _ = shared_table({"watched": "read_write", "browsed": "read_only"})
    first = {"watched": torch.tensor([1, 2], device=DEVICE)}
    coll.lookup(first)
    coll.apply_gradients(first, {"watched": torch.zeros(2, 4, device=DEVICE)})
    keys, emb, _, scores = coll["movies"].export_rows()
    ids = {"watched": torch.tensor([2], device=DEVICE), "browsed": torch.tensor([1, 7], device=DEVICE)}
    rows = coll.lookup(ids)
    torch.testing.assert_close(rows["browsed"][1], coll["movies"].initial_rows(torch.tensor([7], device=DEVICE))[0, :4])
    coll.apply_gradients(ids, {"watched": torch.zeros(1, 4, device=DEVICE), "browsed": torch.ones(2, 4, device=DEVICE)})
    k2, e2, _, s2 = coll["movies"].export_rows()
    o1, o2 = keys.argsort(), k2.argsort()
    assert k2[o2].tolist() == [1, 2]  # 7 was never stored
    torch.testing.assert_close(e2[o2], emb[o1])  # the read-only gradients moved nothing
    assert s2[o2][0] == scores[o1][0] and s2[o2][1] > scores[o1][1]  # only the read-write id's score rose


def test_write_first_counts_an_ids_gradient_from_its_first_feature_only():
    coll, _ = shared_table({"watched": "read_write", "liked": "write_first", "shared": "write_first"})
    ids = {"watched": torch.tensor([1, 2], device=DEVICE), "liked": torch.tensor([2, 3, 3], device=DEVICE),
           "shared": torch.tensor([3, 4], device=DEVICE)}
    rows = coll.lookup(ids)
    before = {int(i): r.clone() for n in ids for i, r in zip(ids[n].tolist(), rows[n])}
    g = {"watched": torch.tensor([[1.0] * 4, [2.0] * 4]), "liked": torch.tensor([[10.0] * 4, [20.0] * 4, [30.0] * 4]),
         "shared": torch.tensor([[100.0] * 4, [200.0] * 4])}
    coll.apply_gradients(ids, {n: x.to(DEVICE) for n, x in g.items()})
    # 1 and 2 from "watched" (2's copy in "liked" dropped), 3 from "liked" (both copies;
    # its copy in "shared" dropped), 4 from "shared"
    expected = {1: 1.0, 2: 2.0, 3: 50.0, 4: 200.0}
    after = coll.lookup({"watched": torch.tensor(list(expected), device=DEVICE)}, train=False)["watched"]
    for (i, step), row in zip(expected.items(), after):
        torch.testing.assert_close(row, before[i] - SGD.lr * step)


@pytest.mark.parametrize("empty", ["watched", "liked"])
def test_a_shared_tables_feature_may_come_without_ids(empty):
    """A call where one feature of a shared table (read_write or write_first) has no ids
    trains the other's as the table alone would."""
    coll, alone = shared_table({"watched": "read_write", "liked": "write_first"})
    ids = {"watched": torch.tensor([1, 2, 2], device=DEVICE), "liked": torch.tensor([2, 5], device=DEVICE)}
    ids[empty] = ids[empty][:0]
    got = coll.lookup(ids)
    kept = ids["liked" if empty == "watched" else "watched"]
    torch.testing.assert_close(got[empty], torch.empty(0, 4, device=DEVICE))
    torch.testing.assert_close(torch.cat([got["watched"], got["liked"]]), alone.lookup(kept))
    grads = {n: torch.ones(x.numel(), 4, device=DEVICE) for n, x in ids.items()}
    coll.apply_gradients(ids, grads)
    alone.apply_gradients(kept, torch.ones(kept.numel(), 4, device=DEVICE))
    assert_same_rows(coll["movies"], alone)


@pytest.mark.skipif(DEVICE != "cuda", reason="only a GPU has waits to count")
def test_a_write_first_update_never_waits_for_the_gpu():
    """Lookups and updates of a table shared by a read_write and a write_first feature
    (tables at their full size: no growth check to settle) make no call that waits."""
    from kernels.dynamic_embedding.collection import FeatureConfig

    cfg = EmbeddingConfig(dim=4, optimizer=SGD, bucket_size=8, backend="triton", capacity=1024, max_capacity=1024)
    coll = DynamicEmbeddingCollection({"t": cfg}, DEVICE, {"a": FeatureConfig("t"), "b": FeatureConfig("t", "write_first")})

    def step(seed: int) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        ids = {n: torch.randint(0, 300, (64,), device=DEVICE, generator=g) for n in ("a", "b")}
        rows = coll.lookup(ids)
        coll.apply_gradients(ids, {n: torch.ones_like(r) for n, r in rows.items()})

    step(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for seed in range(1, 4):
            step(seed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert coll["t"].stats().size > 0


def test_admission_in_a_group_counts_new_ids_before_storing_them():
    """A member with admission threshold 2 grouped with an lru member: a new id is served
    its initial row and not stored on its first sighting (a lookup, not a rejection), and
    stored on its second; the same as its own table's, statistics included."""
    kw = dict(dim=8, optimizer=ADAM, bucket_size=8, backend="triton", capacity=16, max_capacity=1 << 10)
    cfg = {"plain": EmbeddingConfig(**kw), "admitted": EmbeddingConfig(**kw, seed=11, admission_threshold=2)}
    coll = DynamicEmbeddingCollection(cfg, DEVICE)
    alone = DynamicEmbedding(cfg["admitted"], DEVICE)
    assert [g.names for g in coll.groups] == [["plain", "admitted"]] and coll.groups[0].admitting
    first, again = torch.tensor([5, 6, 6, 7], device=DEVICE), torch.tensor([5, 8], device=DEVICE)
    for ids in (first, again, again):
        got = coll.lookup({"plain": ids, "admitted": ids})
        torch.testing.assert_close(got["admitted"], alone.lookup(ids), rtol=0, atol=0)
        grads = torch.ones(ids.numel(), 8, device=DEVICE)
        coll.apply_gradients({"plain": ids, "admitted": ids}, {"plain": grads, "admitted": grads})
        alone.apply_gradients(ids, grads)
    assert sorted(coll["admitted"].export_rows()[0].tolist()) == [5, 6, 8]  # 6 twice in one call; 5 and 8 on their second
    assert sorted(coll["plain"].export_rows()[0].tolist()) == [5, 6, 7, 8]
    s = coll["admitted"].stats()
    assert s == alone.stats() and s.rejections == 0 and (s.admissions, s.admission_rejections) == (3, 3)
    assert_same_rows(coll["admitted"], alone)
