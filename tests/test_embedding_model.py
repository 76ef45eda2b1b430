"""DynamicEmbedding held against a plain dict model of the table over long random call
sequences: train lookups, read-only lookups, updates, prefetches, empty batches, duplicate
ids and int64 extremes. The model: an id's row is its initial row once it has one (admission: once its
count reaches the threshold), then that row minus lr times the sum of its gradients. The
tables are sized so that no tier runs out of room, so nothing may be lost: a tiered table
whose device tier overflows on every call keeps every update in its host tier."""
import pytest
import torch

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, OptimizerConfig, ShardedDynamicEmbedding, dump, load

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
LR = 0.25
DIM = 3
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# name -> (backend, config overrides); every kind of table the engine has
TABLES = {
    "plain-reference": ("reference", {}),
    "tiered-reference": ("reference", dict(device_capacity=64)),
    "admission-reference": ("reference", dict(admission_threshold=2)),
    "tiered-admission-reference": ("reference", dict(device_capacity=64, admission_threshold=2)),
    "plain-triton": ("triton", {}),
    "deterministic-triton": ("triton", dict(deterministic=True)),
    "tiered-triton": ("triton", dict(device_capacity=64)),
    "tiered-deterministic-triton": ("triton", dict(device_capacity=64, deterministic=True)),
    "tiered-lfu-reference": ("reference", dict(device_capacity=64, eviction="lfu")),
    "tiered-lfu-triton": ("triton", dict(device_capacity=64, eviction="lfu")),
    "tiered-lfu-promoting-triton": ("triton", dict(device_capacity=64, eviction="lfu", promote_on_miss=True)),
    "admission-triton": ("triton", dict(admission_threshold=2)),
}


def id_pool(g: torch.Generator, n: int) -> torch.Tensor:
    """n distinct ids: int64 extremes (never the reserved int64 min), small ids and ids
    spread over the whole int64 range."""
    extremes = torch.tensor([INT64_MIN + 1, INT64_MIN + 2, -1, 0, 1, INT64_MAX - 1, INT64_MAX])
    spread = torch.randint(INT64_MIN + 1, INT64_MAX, (4 * n,), generator=g)
    pool = torch.unique(torch.cat([extremes, torch.arange(2, 2 + n // 4), spread]))
    pool = pool[torch.randperm(pool.numel(), generator=g)]
    keep = torch.cat([extremes, pool[~torch.isin(pool, extremes)][: n - extremes.numel()]])
    return keep[torch.randperm(n, generator=g)]


class DictModel:
    """The table as a dict: id -> row (float64), plus admission counts."""

    def __init__(self, table: DynamicEmbedding, threshold: int):
        self.table, self.threshold = table, threshold
        self.rows: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def initial(self, ids: list[int]) -> torch.Tensor:
        return self.table.initial_rows(torch.tensor(ids, device=self.table.device))[:, :DIM].double().cpu()

    def expected(self, ids: list[int]) -> torch.Tensor:
        init = self.initial(ids)
        return torch.stack([self.rows.get(i, init[n]) for n, i in enumerate(ids)]) if ids else torch.empty(0, DIM, dtype=torch.float64)

    def train_lookup(self, ids: list[int]) -> None:
        """Ids that reach the threshold get their initial row (before the lookup serves it)."""
        batch: dict[int, int] = {}
        for i in ids:
            batch[i] = batch.get(i, 0) + 1
        init = self.initial(sorted(batch))
        for n, (i, c) in enumerate(sorted(batch.items())):
            if i in self.rows:
                continue
            self.counts[i] = self.counts.get(i, 0) + c
            if self.counts[i] >= self.threshold:
                self.rows[i] = init[n]
                del self.counts[i]

    def update(self, ids: list[int], grads: torch.Tensor) -> None:
        for i, g in zip(ids, grads.double()):
            if i in self.rows:
                self.rows[i] = self.rows[i] - LR * g


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=2e-5, msg=lambda m: f"{what}: {m}")


def check_exported(table: DynamicEmbedding, model: DictModel, name: str, device_rows: int = 64):
    """A tiered table of device_rows device rows holds the model's ids and rows, lost and
    refused none, and moved rows down; returns its statistics."""
    keys, emb, _, _ = table.export_rows()
    assert sorted(keys.tolist()) == sorted(model.rows), f"{name}: exported ids differ from the model's"
    check(emb.cpu()[torch.argsort(keys.cpu())], model.expected(sorted(model.rows)), f"{name}: exported rows")
    s = table.stats()
    assert s.rejections == 0 and s.evictions == 0 and s.size == len(model.rows), name
    assert table.table.size() <= device_rows and s.demotions > 0, name  # rows moved between the tiers
    return s


@pytest.mark.parametrize("kind", list(TABLES))
def test_lookups_and_exported_rows_equal_a_dict_model(kind):
    backend, overrides = TABLES[kind]
    device = DEVICE if backend == "triton" else "cpu"
    # the interpreter runs Triton kernels on the CPU slowly: fewer, smaller calls there
    steps, batch, distinct = (300, 700, 600) if ON_GPU else (24, 96, 160)
    if backend == "reference":
        steps = 300
    config = EmbeddingConfig(
        dim=DIM, optimizer=OptimizerConfig("sgd", lr=LR), capacity=64, max_capacity=1 << 15, bucket_size=8,
        backend=backend, **overrides,
    )
    table = DynamicEmbedding(config, device)
    model = DictModel(table, config.admission_threshold)
    g = torch.Generator().manual_seed(sum(map(ord, kind)))
    pool = id_pool(g, distinct)
    for step in range(steps):
        kind_of_call = torch.randint(0, 10, (1,), generator=g).item()
        n = 0 if kind_of_call == 0 else int(torch.randint(1, batch + 1, (1,), generator=g))
        # skewed draws: a few ids recur in most batches, with many copies
        ranks = (torch.rand(n, generator=g) ** 3 * distinct).long()
        ids = pool[ranks]
        ids_list = ids.tolist()
        if step % 3 == 0:  # rows of a batch drawn alike moved up ahead (tiered tables): nothing a lookup reads changes
            ahead = int(torch.randint(0, batch + 1, (1,), generator=g))  # (of any size: a prefetch keeps the one before)
            table.prefetch(pool[(torch.rand(ahead, generator=g) ** 3 * distinct).long()].to(device))
        if kind_of_call <= 2:  # read-only lookup (the empty one too)
            check(table.lookup(ids.to(device), train=False), model.expected(ids_list), f"step {step}: read-only lookup")
            continue
        model.train_lookup(ids_list)
        rows = table.lookup(ids.to(device))
        check(rows, model.expected(ids_list), f"step {step}: train lookup")
        if kind_of_call <= 8:  # a train lookup is usually followed by its update
            grads = (torch.randint(-8, 9, (n, DIM), generator=g) / 16.0).float()
            table.apply_gradients(ids.to(device), grads.to(device))
            model.update(ids_list, grads)
    everything = sorted(set(pool.tolist()))
    check(table.lookup(torch.tensor(everything, device=device), train=False), model.expected(everything), "final read-only lookup")
    keys, emb, _, _ = table.export_rows()
    assert sorted(keys.tolist()) == sorted(model.rows), "exported ids differ from the model's"
    order = torch.argsort(keys.cpu())
    check(emb.cpu()[order], model.expected(sorted(model.rows)), "exported rows")
    s = table.stats()
    assert s.rejections == 0 and s.evictions == 0 and s.size == len(model.rows)
    if "tiered" in kind:
        assert table.table.size() <= 64 < s.size and s.demotions > 0  # the device tier overflowed


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_tiered_collection_with_prefetches_equals_a_dict_model(pipelined):
    """Tiered tables grouped in a collection, batches of varying sizes, the next batch
    prefetched in every training step: before the lookup (prefetch(i + 1), lookup(i),
    apply_gradients(i)), or in a pipelined loop's order (lookup(i), prefetch(i + 1),
    apply_gradients(i)), where the prefetch may move rows of batch i between its lookup
    and its update, which must then find them where they are; read-only lookups and
    statistics come between the prefetch and the update too. Every lookup and the rows at
    the end against the dict model, per member (lru, lfu, admission and epoch_lfu, the
    epoch moving every five steps)."""
    from kernels.dynamic_embedding.collection import DynamicEmbeddingCollection
    from kernels.dynamic_embedding.tiered_group import TieredTableGroup

    steps, batch, distinct = (300, 700, 600) if ON_GPU else (10, 64, 120)
    device_rows = 64 if ON_GPU else 16  # (device tiers that overflow in the steps run)
    base = dict(dim=DIM, optimizer=OptimizerConfig("sgd", lr=LR), capacity=64, max_capacity=1 << 15, bucket_size=8,
                backend="triton", device_capacity=device_rows)
    configs = {"recent": EmbeddingConfig(**base), "counted": EmbeddingConfig(**base, eviction="lfu", seed=3),
               "admitted": EmbeddingConfig(**base, admission_threshold=2, seed=5),
               "epochs": EmbeddingConfig(**base, eviction="epoch_lfu", seed=7)}
    coll = DynamicEmbeddingCollection(configs, DEVICE)
    assert [type(grp) for grp in coll.groups] == [TieredTableGroup] and coll.single == []
    models = {n: DictModel(coll[n], c.admission_threshold) for n, c in configs.items()}
    g = torch.Generator().manual_seed(11 + pipelined)
    pool = id_pool(g, distinct)

    def draw() -> dict[str, torch.Tensor]:
        n = int(torch.randint(0, batch + 1, (1,), generator=g))
        return {name: pool[(torch.rand(n, generator=g) ** 3 * distinct).long()] for name in configs}

    def check_all(got: dict, ids: dict, what: str) -> None:
        for name, x in ids.items():
            check(got[name], models[name].expected(x.tolist()), f"{what}, {name}")

    upcoming = draw()
    for step in range(steps):
        ids, upcoming = upcoming, draw()
        on_device = {n: x.to(DEVICE) for n, x in ids.items()}
        coll.set_epoch(step // 5)
        if step % 7 == 3:  # a read-only step
            check_all(coll.lookup(on_device, train=False), ids, f"step {step}: read-only lookup")
            continue
        if not pipelined:
            coll.prefetch({n: x.to(DEVICE) for n, x in upcoming.items()})
        for name, x in ids.items():
            models[name].train_lookup(x.tolist())
        check_all(coll.lookup(on_device), ids, f"step {step}: train lookup")
        if pipelined:
            coll.prefetch({n: x.to(DEVICE) for n, x in upcoming.items()})
        if step % 5 == 1:  # other calls before the update
            check_all(coll.lookup(on_device, train=False), ids, f"step {step}: read-only lookup before the update")
            assert coll["counted"].stats().rejections == 0
        grads = {n: (torch.randint(-8, 9, (x.numel(), DIM), generator=g) / 16.0).float() for n, x in ids.items()}
        coll.apply_gradients(on_device, {n: gr.to(DEVICE) for n, gr in grads.items()})
        for name, x in ids.items():
            models[name].update(x.tolist(), grads[name])
    everything = sorted(set(pool.tolist()))
    final = {n: torch.tensor(everything) for n in configs}
    check_all(coll.lookup({n: x.to(DEVICE) for n, x in final.items()}, train=False), final, "final read-only lookup")
    for name, model in models.items():
        s = check_exported(coll[name], model, name, device_rows)
        assert s.size > device_rows and s.promotions > 0, name


@pytest.mark.parametrize("pipelined", [False, True])
def test_features_sharing_tiered_tables_equal_a_dict_model(pipelined):
    """Features on tiered tables in one collection: "a" and "b" share table "t" (b
    write_first: an id's gradient counts from a alone where a holds it in the call), "c"
    reads t without training it, "d" trains table "u" (admission); batches of varying
    sizes, some features absent from some calls, the next batch prefetched before the
    lookup or between it and the update. Every lookup and the rows at the end against a
    dict model per table."""
    from kernels.dynamic_embedding.collection import DynamicEmbeddingCollection, FeatureConfig

    steps, batch, distinct = (200, 500, 400) if ON_GPU else (12, 64, 120)
    base = dict(dim=DIM, optimizer=OptimizerConfig("sgd", lr=LR), capacity=64, max_capacity=1 << 15, bucket_size=8,
                backend="triton", device_capacity=64)
    configs = {"t": EmbeddingConfig(**base, eviction="lfu"), "u": EmbeddingConfig(**base, admission_threshold=2, seed=4)}
    features = {"a": FeatureConfig("t"), "b": FeatureConfig("t", "write_first"), "c": FeatureConfig("t", "read_only"),
                "d": FeatureConfig("u")}
    coll = DynamicEmbeddingCollection(configs, DEVICE, features)
    models = {n: DictModel(coll[n], c.admission_threshold) for n, c in configs.items()}
    trained = {"t": ["a", "b"], "u": ["d"]}  # each table's trained features, in the collection's order
    g = torch.Generator().manual_seed(21 + pipelined)
    pool = id_pool(g, distinct)

    def draw() -> dict[str, torch.Tensor]:
        present = [f for f in features if f == "a" or bool(torch.rand(1, generator=g) < 0.7)]
        return {f: pool[(torch.rand(int(torch.randint(0, batch + 1, (1,), generator=g)), generator=g) ** 3 * distinct).long()]
                for f in present}

    def check_all(got: dict, ids: dict, what: str) -> None:
        for f, x in ids.items():
            check(got[f], models[features[f].table].expected(x.tolist()), f"{what}, feature {f}")

    upcoming = draw()
    for step in range(steps):
        ids, upcoming = upcoming, draw()
        on_device = {f: x.to(DEVICE) for f, x in ids.items()}
        ahead = {f: x.to(DEVICE) for f, x in upcoming.items()}
        if not pipelined:
            coll.prefetch(ahead)
        for table, names in trained.items():
            models[table].train_lookup(sum((ids[f].tolist() for f in names if f in ids), []))
        check_all(coll.lookup(on_device), ids, f"step {step}: lookup")
        if pipelined:
            coll.prefetch(ahead)
        grads = {f: (torch.randint(-8, 9, (x.numel(), DIM), generator=g) / 16.0).float() for f, x in ids.items()}
        coll.apply_gradients(on_device, {f: gr.to(DEVICE) for f, gr in grads.items()})
        for table, names in trained.items():
            held: set = set()  # ids of the table's earlier features in this call
            for f in (f for f in names if f in ids):
                x = ids[f].tolist()
                if features[f].mode == "write_first":
                    keep = [i not in held for i in x]
                    models[table].update([i for i, k in zip(x, keep) if k], grads[f][torch.tensor(keep, dtype=torch.bool)])
                else:
                    models[table].update(x, grads[f])
                held.update(x)
    for table, model in models.items():
        check_exported(coll[table], model, table)
    assert coll["t"].stats().size > 64


@pytest.mark.parametrize("backend,deterministic", [("reference", True), ("triton", True), ("triton", False)])
def test_a_dump_loads_whole_into_a_tiered_table_smaller_on_the_device(tmp_path, backend, deterministic):
    """200 rows loaded into a table of 64 device rows: each row is kept, in one tier, with
    its values and score, including rows that a second load overwrites in the host tier."""
    device = DEVICE if backend == "triton" else "cpu"
    base = dict(dim=DIM, optimizer=OptimizerConfig("adam", lr=LR), capacity=64, max_capacity=1 << 12, bucket_size=8)
    source = ShardedDynamicEmbedding(EmbeddingConfig(backend="reference", **base))
    g = torch.Generator().manual_seed(7)
    ids = id_pool(g, 200)
    source.local.lookup(ids)
    source.local.apply_gradients(ids, torch.randn(200, DIM, generator=g))
    dump(source, tmp_path / "d")
    cfg = EmbeddingConfig(backend=backend, deterministic=deterministic, device_capacity=64, **base)
    tiered = ShardedDynamicEmbedding(cfg, device)
    for _ in range(2):  # the second load finds every row stored, most of them in the host tier
        load(tiered, tmp_path / "d")
    want, got = source.local.export_rows(), tiered.local.export_rows()
    s = tiered.stats()
    assert s.size == 200 == got[0].numel() and s.evictions == 0 and tiered.local.table.size() <= 64
    order_w, order_g = torch.argsort(want[0]), torch.argsort(got[0].cpu())
    assert torch.equal(want[0][order_w], got[0].cpu()[order_g])
    for w, gt in zip(want[1:], got[1:]):
        torch.testing.assert_close(gt.cpu()[order_g], w[order_w], rtol=0, atol=0)
