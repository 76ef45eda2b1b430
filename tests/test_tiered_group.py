"""Tiered tables (device_capacity) in one launch per kernel: a collection's TieredTableGroup
against the same tables served one by one by their own DynamicEmbedding. Which rows sit on
the device after a call depends on the order the claim meets ids (a group meets them by
segment, a table in sorted order), so promotions and demotions may differ; everything a
user reads (lookups, rows in either tier, the other statistics) is the same."""
import pytest
import torch
from conftest import assert_same_rows

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, OptimizerConfig
from kernels.dynamic_embedding.collection import DynamicEmbeddingCollection
from kernels.dynamic_embedding.table_group import TableGroup
from kernels.dynamic_embedding.tiered_group import TieredTableGroup

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIM, DEVICE_ROWS = 4, 32


def configs(promote_on_miss: bool = False) -> dict[str, EmbeddingConfig]:
    """Every eviction policy, a read-only member and (not with promote_on_miss, which a
    table with admission refuses) an admitting one."""
    kw = dict(dim=DIM, optimizer=OptimizerConfig("adam", lr=0.1), bucket_size=8, backend="triton", capacity=16,
              max_capacity=1 << 10, device_capacity=DEVICE_ROWS, promote_on_miss=promote_on_miss)
    out = {
        "user": EmbeddingConfig(**kw),
        "counted": EmbeddingConfig(**kw, seed=7, eviction="lfu"),
        "ranked": EmbeddingConfig(**kw, seed=9, eviction="custom"),
        "shared": EmbeddingConfig(**kw, seed=5, read_only=True),
    }
    if not promote_on_miss:
        out["admitted"] = EmbeddingConfig(**kw, seed=11, admission_threshold=2)
    return out


def test_tiered_tables_form_groups_of_their_own():
    kw = dict(dim=DIM, bucket_size=8, backend="triton", capacity=16, max_capacity=1 << 10)
    cfg = {
        "a": EmbeddingConfig(**kw, device_capacity=DEVICE_ROWS), "b": EmbeddingConfig(**kw, device_capacity=DEVICE_ROWS, seed=1),
        "plain": EmbeddingConfig(**kw), "admitted": EmbeddingConfig(**kw, device_capacity=DEVICE_ROWS, admission_threshold=2),
    }
    cfg["promoting"] = EmbeddingConfig(**kw, device_capacity=DEVICE_ROWS, promote_on_miss=True)
    c = DynamicEmbeddingCollection(cfg, DEVICE)
    assert [(type(g), g.names) for g in c.groups] == [
        (TieredTableGroup, ["a", "b", "admitted"]), (TableGroup, ["plain"]), (TieredTableGroup, ["promoting"]),
    ]
    assert c.single == []


@pytest.mark.parametrize("promote_on_miss", [False, True])
def test_tiered_collection_trains_like_its_tables_one_by_one(promote_on_miss):
    """configs(), device tiers that overflow on every call; train and read-only lookups,
    prefetches of the next batch, updates of other ids than the lookup's. Nothing is lost:
    every row lives in one tier or the other."""
    cfg = configs(promote_on_miss)
    coll = DynamicEmbeddingCollection(cfg, DEVICE)
    assert [type(g) for g in coll.groups] == [TieredTableGroup] and coll.single == []
    alone = {n: DynamicEmbedding(c, DEVICE) for n, c in cfg.items()}
    gen = torch.Generator().manual_seed(0)
    known = torch.arange(0, 60, device=DEVICE)  # the read-only table's rows, written from outside
    rows = torch.randn(60, DIM, generator=gen).to(DEVICE)
    for e in (coll["shared"], alone["shared"]):
        e.assign(known, rows)

    def batch(n: int) -> dict:
        return {name: torch.randint(0, 80, (n,), generator=gen).to(DEVICE) for name in cfg}

    sizes = [40, 55, 30, 45, 20]  # batches of varying sizes (a prefetch carries the one before)
    upcoming = batch(sizes[0])
    for step in range(4):
        ids, upcoming = upcoming, batch(sizes[step + 1])
        n = ids["user"].numel()
        scores = {"ranked": torch.randint(0, 1000, (n,), generator=gen).to(DEVICE)}
        train = step != 2
        got = coll.lookup(ids, train=train, scores=scores)
        for name, x in ids.items():
            want = alone[name].lookup(x, train=train, scores=scores.get(name))
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")
        grads = {name: torch.randn(n, DIM, generator=gen).to(DEVICE) for name in cfg}
        if step == 3:  # an update of other ids than the lookup's
            ids = {name: x.flip(0) for name, x in ids.items()}
        coll.apply_gradients(ids, grads)
        for name, x in ids.items():
            alone[name].apply_gradients(x, grads[name])
        if step % 2 == 1:
            coll.prefetch(upcoming)
            for name, x in upcoming.items():
                alone[name].prefetch(x)
    for name in cfg:
        assert_same_rows(coll[name], alone[name])
        a, b = coll[name].stats(), alone[name].stats()
        assert (a.promotions, a.demotions) != (0, 0) or name == "shared", name
        a.promotions, a.demotions, b.promotions, b.demotions = 0, 0, 0, 0
        assert a == b, name
        assert a.evictions == 0 and a.rejections == 0
        assert coll[name].table.size() <= DEVICE_ROWS
    assert coll["user"].stats().size > DEVICE_ROWS  # the host tier holds the rest
    if not promote_on_miss:
        admitting = coll["admitted"].stats()
        assert admitting.admissions > 0 and admitting.admission_rejections > 0  # ids stored on their second sighting


def test_a_promoting_group_moves_every_missed_id_up():
    """As a promote_on_miss table alone (test_embedding.py): in an lfu group, an id used
    once takes the device slot of its bucket's least used row, which moves down; without
    the option it stays in host memory."""
    kw = dict(dim=DIM, optimizer=OptimizerConfig("sgd", lr=0.1), bucket_size=32, backend="triton", capacity=32,
              max_capacity=1 << 10, device_capacity=32, eviction="lfu")
    for promote in (False, True):
        cfg = {n: EmbeddingConfig(**kw, seed=s, promote_on_miss=promote) for s, n in enumerate(("a", "b"))}
        coll = DynamicEmbeddingCollection(cfg, DEVICE)
        assert [type(g) for g in coll.groups] == [TieredTableGroup]

        def step(x: torch.Tensor) -> None:
            ids = {n: x for n in cfg}
            got = coll.lookup(ids)
            coll.apply_gradients(ids, {n: torch.zeros_like(r) for n, r in got.items()})

        resident = torch.arange(100, 132, device=DEVICE)  # one device bucket's worth
        step(resident.repeat(3))
        step(resident[:-1])  # every resident used 4 times but id 131 (3)
        step(torch.tensor([5], device=DEVICE))
        for n in cfg:
            on_device = coll[n].table.find(torch.tensor([5, 131], device=DEVICE)) >= 0
            assert on_device.tolist() == ([True, False] if promote else [False, True]), (promote, n)
            assert coll[n].host.find(torch.tensor([131 if promote else 5], device=DEVICE)).item() >= 0


@pytest.mark.parametrize("backend,grouped,promote", [
    ("reference", False, False), ("triton", False, False), ("triton", True, False), ("triton", False, True), ("triton", True, True),
])
@pytest.mark.parametrize("batches", [[[0, 100]], [[0], [100]]])
def test_a_prefetch_evicts_no_device_row_of_its_batch_or_the_one_before(backend, grouped, promote, batches):
    """lfu: a prefetch of ids 0 and 100 (or of id 0, then of id 100: the batch prefetched
    before is the one being trained, or about to be) leaves the least used device row,
    id 0's, where it is while id 100's host row may come up. With promote_on_miss the next
    least used row, of neither batch, moves down for it; without, it stays in host memory
    (no other row is used as little), and id 0's row is not made to change places with it."""
    cfg = EmbeddingConfig(dim=2, optimizer=OptimizerConfig("sgd"), capacity=64, bucket_size=64, max_capacity=1024,
                          device_capacity=64, eviction="lfu", backend=backend, promote_on_miss=promote)
    device = DEVICE if backend == "triton" else "cpu"
    coll = DynamicEmbeddingCollection({"t": cfg}, device)
    table = coll["t"]
    assert [type(g) for g in coll.groups] == ([TieredTableGroup] if backend == "triton" else [])

    def step(x: torch.Tensor) -> None:
        if grouped or backend == "reference":  # (a reference table is served alone by the collection)
            coll.apply_gradients({"t": x}, {"t": torch.zeros_like(coll.lookup({"t": x})["t"])})
        else:
            table.apply_gradients(x, torch.zeros_like(table.lookup(x)))

    ids = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    step(ids(100).repeat(10))  # id 100: 10 uses
    step(torch.arange(64, device=device).repeat(10))  # 64 rows of 10 uses: one takes id 100's row, which moves down
    assert table.host.find(ids(100)).item() >= 0
    step(torch.arange(1, 64, device=device))  # every device row but id 0's: 11 uses
    for b in batches:
        coll.prefetch({"t": ids(*b)}) if grouped else table.prefetch(ids(*b))
    both = ids(0, 100)
    assert (table.table.find(both) >= 0).tolist() == [True, promote]
    promotions = table.stats().promotions
    step(both)  # id 100 then has 11 uses, as many as the rows outside the batch: it moves up now if not before
    assert (table.table.find(both) >= 0).all()
    assert table.stats().promotions == promotions + (0 if promote else 1)


def test_a_prefetch_counts_each_members_moves_after_keeping_the_batch_before():
    """An lfu group's prefetch carries the batch prefetched before as extra lanes, after
    the batch's own: the promotions and demotions are still each member's own."""
    kw = dict(dim=2, optimizer=OptimizerConfig("sgd"), capacity=64, bucket_size=64, max_capacity=1024, device_capacity=64,
              eviction="lfu", backend="triton")
    coll = DynamicEmbeddingCollection({"a": EmbeddingConfig(**kw), "b": EmbeddingConfig(**kw, seed=1)}, DEVICE)
    assert [type(g) for g in coll.groups] == [TieredTableGroup]
    ids = lambda *v: torch.tensor(v, device=DEVICE)  # noqa: E731

    def step(x: dict) -> None:
        coll.apply_gradients(x, {n: torch.zeros_like(r) for n, r in coll.lookup(x).items()})

    step({"a": ids(5), "b": ids(100).repeat(10)})
    step({"b": torch.arange(64, device=DEVICE).repeat(10)})  # b's id 100 (10 uses) moves down for one of these
    assert coll["b"].host.find(ids(100)).item() >= 0
    coll.prefetch({"a": ids(5), "b": ids(7)})  # nothing to move
    before = {n: (coll[n].stats().promotions, coll[n].stats().demotions) for n in ("a", "b")}
    coll.prefetch({"a": ids(5), "b": ids(100)})  # b's id 100 up, a row of b's down
    after = {n: (coll[n].stats().promotions, coll[n].stats().demotions) for n in ("a", "b")}
    assert after["a"] == before["a"]
    assert after["b"] == (before["b"][0] + 1, before["b"][1] + 1)
