"""Tiered tables (device_capacity) in one launch per kernel: a collection's TieredTableGroup
against the same tables served one by one by their own DynamicEmbedding. Which rows sit on
the device after a call depends on the order the claim meets ids (a group meets them by
segment, a table in sorted order), so promotions and demotions may differ; everything a
user reads (lookups, rows in either tier, the other statistics) is the same."""
import torch
from conftest import assert_same_rows

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, OptimizerConfig
from kernels.dynamic_embedding.collection import DynamicEmbeddingCollection
from kernels.dynamic_embedding.table_group import TableGroup
from kernels.dynamic_embedding.tiered_group import TieredTableGroup

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIM, DEVICE_ROWS = 4, 32


def configs() -> dict[str, EmbeddingConfig]:
    kw = dict(dim=DIM, optimizer=OptimizerConfig("adam", lr=0.1), bucket_size=8, backend="triton", capacity=16,
              max_capacity=1 << 10, device_capacity=DEVICE_ROWS)
    return {
        "user": EmbeddingConfig(**kw),
        "counted": EmbeddingConfig(**kw, seed=7, eviction="lfu"),
        "ranked": EmbeddingConfig(**kw, seed=9, eviction="custom"),
        "shared": EmbeddingConfig(**kw, seed=5, read_only=True),
        "admitted": EmbeddingConfig(**kw, seed=11, admission_threshold=2),
    }


def test_tiered_tables_form_groups_of_their_own():
    kw = dict(dim=DIM, bucket_size=8, backend="triton", capacity=16, max_capacity=1 << 10)
    cfg = {
        "a": EmbeddingConfig(**kw, device_capacity=DEVICE_ROWS), "b": EmbeddingConfig(**kw, device_capacity=DEVICE_ROWS, seed=1),
        "plain": EmbeddingConfig(**kw), "admitted": EmbeddingConfig(**kw, device_capacity=DEVICE_ROWS, admission_threshold=2),
    }
    c = DynamicEmbeddingCollection(cfg, DEVICE)
    assert [(type(g), g.names) for g in c.groups] == [(TieredTableGroup, ["a", "b", "admitted"]), (TableGroup, ["plain"])]
    assert c.single == []


def test_tiered_collection_trains_like_its_tables_one_by_one():
    """Every eviction policy, a read-only member and an admitting one, device tiers that
    overflow on every call; train and read-only lookups, prefetches of the next batch, updates of other ids
    than the lookup's. Nothing is lost: every row lives in one tier or the other."""
    cfg = configs()
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

    upcoming = batch(40)
    for step in range(4):
        ids, upcoming = upcoming, batch(40)
        scores = {"ranked": torch.randint(0, 1000, (40,), generator=gen).to(DEVICE)}
        train = step != 2
        got = coll.lookup(ids, train=train, scores=scores)
        for name, x in ids.items():
            want = alone[name].lookup(x, train=train, scores=scores.get(name))
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")
        grads = {name: torch.randn(40, DIM, generator=gen).to(DEVICE) for name in cfg}
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
    admitting = coll["admitted"].stats()
    assert admitting.admissions > 0 and admitting.admission_rejections > 0  # ids stored on their second sighting
