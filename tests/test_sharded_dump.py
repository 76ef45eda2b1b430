"""Sharded tables over gloo, and dumps: re-sharding, incremental, refusal of bad dumps."""
import dataclasses
import json
import os

import pytest
import torch

from conftest import run_distributed
from kernels.dynamic_embedding import (
    DumpError, EmbeddingConfig, OptimizerConfig, ShardedDynamicEmbedding, dump, dump_async, load, read_manifest, shard_of,
)

CONFIG = EmbeddingConfig(dim=6, optimizer=OptimizerConfig(name="adam", lr=0.05), capacity=64)
ALL_IDS = torch.arange(-40, 200, dtype=torch.int64) * 1_000_003


def batches(rank: int, world: int, steps: int = 4):
    """Each rank's ids per step (overlapping across ranks, with duplicates), and a target."""
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        ids = ALL_IDS[torch.randint(len(ALL_IDS), (50,), generator=g)]
        yield ids, torch.randn(50, CONFIG.dim, generator=g)


def train(table, rank, world):
    for ids, target in batches(rank, world):
        rows = table.lookup(ids).requires_grad_(True)
        ((rows - target) ** 2).sum().backward()
        table.apply_gradients(ids, rows.grad)


def _train_and_dump(rank, world, path, incremental_path):
    table = ShardedDynamicEmbedding(CONFIG)
    train(table, rank, world)
    record(table, f"{path}.rank{rank}.pt")
    since = table.step
    dump(table, path)
    # one more step touching a few ids, then an incremental dump of what changed
    ids = ALL_IDS[rank * 3 : rank * 3 + 3]
    rows = table.lookup(ids).requires_grad_(True)
    rows.sum().backward()
    table.apply_gradients(ids, rows.grad)
    dump(table, incremental_path, min_score=since)
    record(table, f"{path}.rank{rank}.after.pt")


def record(table, file):
    """The test's own copy of a rank's rows (torch.save is test-side only)."""
    keys, emb, _, _ = table.local.export_rows()
    torch.save({"keys": keys, "emb": emb}, file)


def expected_lookups(files) -> torch.Tensor:
    """Lookups of ALL_IDS from the union of ranks' recorded rows; unseen ids get their
    initial rows."""
    shards = [torch.load(f) for f in files]
    rows = {k: e for s in shards for k, e in zip(s["keys"].tolist(), s["emb"])}
    init = ShardedDynamicEmbedding(CONFIG).local.initial_rows(ALL_IDS)[:, : CONFIG.dim]
    return torch.stack([rows.get(k, init[i]) for i, k in enumerate(ALL_IDS.tolist())])


def _load_and_compare(rank, world, path, incremental_path, expect_file):
    table = ShardedDynamicEmbedding(CONFIG)
    load(table, path)
    load(table, incremental_path)
    keys, _, _, _ = table.local.export_rows()
    assert bool((shard_of(keys, world) == rank).all())
    out = table.lookup(ALL_IDS, train=False)
    expect = torch.load(expect_file)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


def test_two_rank_training_matches_one_process_with_mean_gradients(tmp_path):
    # one process replays both ranks' batches step by step, averaging the gradients
    single = ShardedDynamicEmbedding(CONFIG)
    for (ids0, t0), (ids1, t1) in zip(batches(0, 2), batches(1, 2)):
        ids = torch.cat([ids0, ids1])
        rows = single.lookup(ids).requires_grad_(True)
        (((rows - torch.cat([t0, t1])) ** 2).sum() / 2).backward()
        single.apply_gradients(ids, rows.grad)
    expect = single.lookup(ALL_IDS, train=False)
    torch.save(expect, tmp_path / "expect.pt")
    run_distributed(2, _train_and_dump, str(tmp_path / "full"), str(tmp_path / "inc"))
    shards = [torch.load(tmp_path / f"full.rank{r}.pt") for r in range(2)]
    keys = torch.cat([s["keys"] for s in shards])
    assert len(set(keys.tolist())) == len(keys) == single.stats().size  # disjoint shards
    got = torch.cat([s["emb"] for s in shards])[torch.argsort(keys)]
    order = torch.argsort(single.local.export_rows()[0])
    # rows before the extra step: compare against the single process at the same point
    torch.testing.assert_close(got, single.local.export_rows()[1][order], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [1, 3])
def test_dump_from_two_ranks_loads_on_other_world_sizes(tmp_path, world):
    run_distributed(2, _train_and_dump, str(tmp_path / "full"), str(tmp_path / "inc"))
    full, inc = read_manifest(tmp_path / "full"), read_manifest(tmp_path / "inc")
    assert full["kind"] == "full" and full["world_size"] == 2 and len(full["shards"]) == 2
    assert inc["kind"] == "incremental" and 0 < inc["total_rows"] <= 6 < full["total_rows"]
    expect = expected_lookups([tmp_path / f"full.rank{r}.after.pt" for r in range(2)])
    # the incremental dump really moved rows: without it lookups differ
    base = ShardedDynamicEmbedding(CONFIG)
    load(base, tmp_path / "full")
    assert not torch.equal(base.lookup(ALL_IDS, train=False), expect)
    torch.save(expect, tmp_path / "expect.pt")
    if world == 1:
        _load_and_compare(0, 1, tmp_path / "full", tmp_path / "inc", tmp_path / "expect.pt")
    else:
        run_distributed(world, _load_and_compare, tmp_path / "full", tmp_path / "inc", tmp_path / "expect.pt")


def _dumped(tmp_path):
    table = ShardedDynamicEmbedding(CONFIG)
    table.lookup(ALL_IDS[:20])
    return dump(table, tmp_path / "d")


def test_truncated_corrupted_or_partial_dumps_are_refused(tmp_path):
    path = _dumped(tmp_path)
    shard = next(path.glob("shard-*"))
    data = shard.read_bytes()

    shard.write_bytes(data[:-10])
    with pytest.raises(DumpError, match="truncated"):
        load(ShardedDynamicEmbedding(CONFIG), path)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(DumpError, match="checksum"):
        load(ShardedDynamicEmbedding(CONFIG), path)
    shard.write_bytes(data)
    load(ShardedDynamicEmbedding(CONFIG), path)  # intact again: loads

    (path / "manifest.json").unlink()
    with pytest.raises(DumpError, match="partial"):
        load(ShardedDynamicEmbedding(CONFIG), path)


def test_dump_refuses_overwrite_and_mismatched_tables(tmp_path):
    path = _dumped(tmp_path)
    table = ShardedDynamicEmbedding(CONFIG)
    with pytest.raises(DumpError, match="exists"):
        dump(table, path)
    other = ShardedDynamicEmbedding(EmbeddingConfig(dim=3))
    with pytest.raises(DumpError, match="dim"):
        load(other, path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["total_rows"] == 20 and "shards" in manifest


def test_empty_table_dumps_and_loads(tmp_path):
    path = dump(ShardedDynamicEmbedding(CONFIG), tmp_path / "empty")
    table = ShardedDynamicEmbedding(CONFIG)
    assert load(table, path)["total_rows"] == 0 and table.stats().size == 0


def _snapshot_while_training(rank, world, path, expect_file):
    table = ShardedDynamicEmbedding(CONFIG)
    train(table, rank, world)
    record(table, f"{expect_file}.rank{rank}.pt")
    pending = dump_async(table, path, metadata={"note": "background"})
    train(table, rank, world)  # training goes on (collectives included) while the dump is written
    pending.wait(timeout=60)


def test_non_blocking_dump_is_the_snapshot_at_the_call(tmp_path):
    path = tmp_path / "async"
    run_distributed(2, _snapshot_while_training, str(path), str(tmp_path / "expect"))
    manifest = read_manifest(path)
    assert manifest["world_size"] == 2 and manifest["metadata"] == {"note": "background"}
    expect = expected_lookups([tmp_path / f"expect.rank{r}.pt" for r in range(2)])
    table = ShardedDynamicEmbedding(CONFIG)
    load(table, path)
    torch.testing.assert_close(table.lookup(ALL_IDS, train=False), expect, rtol=0, atol=0)
    assert not list(tmp_path.glob(".async.partial-*"))  # committed by rename


def test_non_blocking_dump_reports_failure(tmp_path):
    table = ShardedDynamicEmbedding(CONFIG)
    table.lookup(ALL_IDS[:5])
    (tmp_path / "blocked").write_text("a file where the dump's folder should go")
    pending = dump_async(table, tmp_path / "blocked" / "d")
    with pytest.raises(DumpError, match="background dump failed"):
        pending.wait(timeout=30)


def _dump_twice(rank, world, path):
    table = ShardedDynamicEmbedding(CONFIG)
    table.lookup(ALL_IDS[:10])
    dump(table, path)
    with pytest.raises(DumpError, match="exists"):
        dump(table, path)  # every rank refuses: none is left waiting at a barrier
    dump(table, path, replace=True)


def test_existing_dump_is_refused_on_every_rank(tmp_path):
    run_distributed(2, _dump_twice, tmp_path / "d")
    assert read_manifest(tmp_path / "d")["world_size"] == 2


def _assign_on_two_ranks(rank, world, out):
    table = ShardedDynamicEmbedding(CONFIG)
    mine = ALL_IDS[rank::world][:30].flip(0)  # distinct over the ranks, not sorted
    table.assign(mine, (mine.double() / 1e6).float()[:, None].expand(-1, CONFIG.dim).contiguous())
    everything = ALL_IDS[: 30 * world]
    torch.save({"rows": table.lookup(everything, train=False), "local": table.local.export_rows()[0]}, f"{out}.rank{rank}.pt")


def test_assign_on_two_ranks_writes_each_row_on_its_owner(tmp_path):
    run_distributed(2, _assign_on_two_ranks, str(tmp_path / "a"))
    everything = ALL_IDS[:60]
    expect = (everything.double() / 1e6).float()[:, None].expand(-1, CONFIG.dim)
    for r in range(2):
        got = torch.load(tmp_path / f"a.rank{r}.pt")
        assert torch.equal(got["rows"], expect)  # every rank sees every row written
        assert bool((shard_of(got["local"], 2) == r).all())  # each row stored by its owner


def _update_of_other_ids(rank, world, out):
    """The update reuses its lookup's routing only for the very ids it routed."""
    torch.manual_seed(rank)
    a, b = ALL_IDS[torch.randint(len(ALL_IDS), (30,))], ALL_IDS[torch.randint(len(ALL_IDS), (30,))]
    grads = torch.randn(30, CONFIG.dim)
    tables = [ShardedDynamicEmbedding(CONFIG) for _ in range(3)]
    tables[0].lookup(a)
    tables[0].apply_gradients(b, grads)  # other ids than the lookup's
    tables[1].lookup(a)
    tables[1].apply_gradients(b.clone(), grads)  # the same ids in a new tensor: routed afresh
    a.add_(0)  # (a no-op that still bumps a's version)
    tables[2].lookup(b)
    b_again = b
    tables[2].apply_gradients(b_again, grads)  # the lookup's own ids: its routing reused
    expect = ShardedDynamicEmbedding(CONFIG)
    expect.lookup(b.clone())
    expect.apply_gradients(b.clone(), grads)
    got = [t.lookup(ALL_IDS, train=False) for t in tables + [expect]]
    torch.save(got, f"{out}.rank{rank}.pt")


def test_an_update_routes_its_own_ids_unless_they_are_the_lookups(tmp_path):
    run_distributed(2, _update_of_other_ids, str(tmp_path / "got"))
    for rank in range(2):
        zero, one, two, expect = torch.load(tmp_path / f"got.rank{rank}.pt")
        torch.testing.assert_close(zero, one, rtol=0, atol=0)
        torch.testing.assert_close(two, expect, rtol=0, atol=0)


COLLECTION = {
    "a": CONFIG,
    "b": EmbeddingConfig(dim=6, optimizer=OptimizerConfig(name="sgd", lr=0.1), capacity=64, seed=3, eviction="lfu"),
    "c": EmbeddingConfig(dim=4, optimizer=OptimizerConfig(name="adam", lr=0.05), capacity=64, seed=5),
}


def _collision_codes(keys, tids, world, tables, shift):
    """Route codes without the hash bits: every id of an (owner, table) shares one code."""
    return (shard_of(keys, world) * tables + tids.to(torch.int64)) << shift


def _collection_against_tables(rank, world, out, sums, names, codes):
    """A sharded collection (one exchange for all tables) and each table sharded alone,
    given the same calls: the same rows, the same tables after. sums: how the collection
    sums each distinct id's gradient copies: "in order" (deterministic tables, by sorted
    segments); else its tables say they need no fixed order (as fast-mode Triton tables)
    and it sums by "index_add" or by "runs" (the run-sum kernel, as on CUDA; here under
    Triton's interpreter). codes: the route codes by "twin", by the "kernel" (under the
    interpreter), or "colliding" (ids of a bin interleave: some are sent twice)."""
    from kernels.dynamic_embedding import ShardedDynamicEmbeddingCollection, sharded_collection

    if codes == "colliding":
        sharded_collection.route_codes_reference = _collision_codes
    together = ShardedDynamicEmbeddingCollection({n: COLLECTION[n] for n in names})
    together.sum_by_runs = sums == "runs"
    together.backend = "triton" if codes == "kernel" else "reference"
    for n in names:
        together.local[n].table.deterministic = sums == "in order"
    alone = {n: ShardedDynamicEmbedding(COLLECTION[n]) for n in names}
    g = torch.Generator().manual_seed(7 + rank)
    for step in range(5):
        # sizes differ between the ranks; feature b is empty on both ranks at step 1, and on
        # one rank alone at steps 2 (rank 0) and 3 (rank 1)
        sizes = {"a": 40 + 9 * rank, "b": 0 if step == 1 or step == 2 + rank else 25 - 4 * rank, "c": 30 + step}
        ids = {n: ALL_IDS[torch.randint(len(ALL_IDS), (sizes[n],), generator=g)] for n in names}
        got = together.lookup(ids)
        for n, x in ids.items():
            torch.testing.assert_close(got[n], alone[n].lookup(x), rtol=0, atol=0)
        grads = {n: torch.randn(x.numel(), COLLECTION[n].dim, generator=g) for n, x in ids.items()}
        if step == 3:  # an update of other ids than the lookup's
            ids = {n: x.flip(0) for n, x in ids.items()}
        together.apply_gradients(ids, grads)
        for n, x in ids.items():
            alone[n].apply_gradients(x, grads[n])
    rows = {n: (together[n].lookup(ALL_IDS, train=False), alone[n].lookup(ALL_IDS, train=False)) for n in names}
    torch.save(rows, f"{out}.rank{rank}.pt")


# Triton kernels given CPU tensors run only under the interpreter, which conftest turns on
# where there is no GPU
ON_CPU_TRITON = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors: the interpreter is off")


@pytest.mark.parametrize("sums, names, codes", [
    ("in order", "abc", "twin"),
    ("index_add", "abc", "twin"),
    pytest.param("runs", "abc", "kernel", marks=ON_CPU_TRITON),  # the kernels CUDA runs
    ("index_add", "a", "twin"),  # one table: received ids need no reordering
    ("in order", "abc", "colliding"),
    ("index_add", "b", "colliding"),
])
def test_a_sharded_collection_exchanges_all_tables_at_once_with_the_tables_results(tmp_path, sums, names, codes):
    run_distributed(2, _collection_against_tables, str(tmp_path / "rows"), sums, list(names), codes)
    for rank in range(2):
        rows = torch.load(tmp_path / f"rows.rank{rank}.pt")
        assert sorted(rows) == sorted(names)
        for n, (together, alone) in rows.items():
            torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6, msg=n)  # sums in another order on GPUs


TIERED = {n: dataclasses.replace(c, device_capacity=32, max_capacity=1 << 12) for n, c in COLLECTION.items()}


def _prefetching_against_not(rank, world, out):
    """Tiered tables sharded over the ranks, trained with and without prefetches of the
    next batch (before the lookup, or between the lookup and its update): the same rows in
    the end; the prefetches move rows up."""
    from kernels.dynamic_embedding import ShardedDynamicEmbeddingCollection

    ahead, plain = ShardedDynamicEmbeddingCollection(TIERED), ShardedDynamicEmbeddingCollection(TIERED)
    g = torch.Generator().manual_seed(11 + rank)
    batches = [{n: ALL_IDS[torch.randint(len(ALL_IDS), (int(torch.randint(0, 60, (1,), generator=g)),), generator=g)]
                for n in TIERED} for _ in range(7)]
    moved = []  # rows each prefetch moved up, on every rank together

    def prefetch(batch: dict) -> None:
        before = sum(s.promotions for s in ahead.stats().values())
        ahead.prefetch(batch)
        moved.append(sum(s.promotions for s in ahead.stats().values()) - before)

    for step, ids in enumerate(batches[:-1]):
        grads = {n: torch.randn(x.numel(), TIERED[n].dim, generator=g) for n, x in ids.items()}
        if step % 2 == 0:
            prefetch(batches[step + 1])
        got = ahead.lookup(ids)
        if step % 2 == 1:
            prefetch(batches[step + 1])
        for n, x in plain.lookup(ids).items():
            torch.testing.assert_close(got[n], x, rtol=0, atol=0)
        ahead.apply_gradients(ids, grads)
        plain.apply_gradients(ids, grads)
    rows = {n: (ahead[n].lookup(ALL_IDS, train=False), plain[n].lookup(ALL_IDS, train=False)) for n in TIERED}
    torch.save((rows, moved), f"{out}.rank{rank}.pt")


def test_a_sharded_collection_prefetches_the_rows_its_ranks_own(tmp_path):
    run_distributed(2, _prefetching_against_not, str(tmp_path / "rows"))
    for rank in range(2):
        rows, moved = torch.load(tmp_path / f"rows.rank{rank}.pt")
        for n, (ahead, plain) in rows.items():
            torch.testing.assert_close(ahead, plain, rtol=1e-5, atol=1e-6, msg=n)
        assert sum(moved) > 0


def _runs_against_index_add(rank, world, out, device):
    """On `device` (GPU `rank` over NCCL, or a CPU over gloo with the kernel under Triton's
    interpreter): the collection's gradient copies summed by the run-sum kernel and by
    index_add_, from the same state and calls (skewed ids: many copies of a few): each
    lookup's rows and the rows at the end."""
    from kernels.dynamic_embedding import ShardedDynamicEmbeddingCollection

    if device == "cuda":
        torch.cuda.set_device(rank)
    results = []
    for by_runs in (True, False):
        tables = ShardedDynamicEmbeddingCollection(COLLECTION, device)
        tables.sum_by_runs = by_runs
        for n in COLLECTION:  # no fixed order of sums asked (as fast-mode Triton tables): not sorted segments
            tables.local[n].table.deterministic = False
        g = torch.Generator().manual_seed(rank)
        looked = []
        for step in range(4):
            ids = {n: ALL_IDS[torch.randint(1, 16, (200 + 50 * rank,), generator=g) ** 2 % len(ALL_IDS)].to(device) for n in COLLECTION}
            rows = tables.lookup(ids)
            looked.append({n: r.cpu() for n, r in rows.items()})
            tables.apply_gradients(ids, {n: torch.randn(r.shape, generator=g).to(device) for n, r in rows.items()})
        results.append((looked, {n: tables[n].lookup(ALL_IDS.to(device), train=False).cpu() for n in COLLECTION}))
    torch.save(results, f"{out}.rank{rank}.pt")


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=ON_CPU_TRITON),
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL over two GPUs")),
])
def test_gradient_sums_by_runs_equal_index_add(tmp_path, device):
    run_distributed(2, _runs_against_index_add, str(tmp_path / "rows"), device, backend="nccl" if device == "cuda" else "gloo")
    for rank in range(2):
        (looked_runs, end_runs), (looked_add, end_add) = torch.load(tmp_path / f"rows.rank{rank}.pt")
        for a, b in zip(looked_runs, looked_add):
            for n in a:
                torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-5, msg=n)  # float sums in another order
        for n in end_runs:
            torch.testing.assert_close(end_runs[n], end_add[n], rtol=1e-5, atol=1e-5, msg=n)


def _static_against_plain(rank, world, out):
    """Static lookups of a fixed ids dict (the same tensors every call; other ids from step
    2) and plain lookups of copies of it, trained alike: the same rows at every step and
    after; a static call of the same tensors as the one before exchanges only rows (one
    all-to-all a lookup, one an update)."""
    import torch.distributed as dist

    from kernels.dynamic_embedding import ShardedDynamicEmbeddingCollection

    exchanges = []
    plain_exchange = dist.all_to_all_single

    def counted(*args, **kwargs):
        exchanges.append(1)
        return plain_exchange(*args, **kwargs)

    dist.all_to_all_single = counted
    static, plain = ShardedDynamicEmbeddingCollection(COLLECTION), ShardedDynamicEmbeddingCollection(COLLECTION)
    g = torch.Generator().manual_seed(3 + rank)
    fixed = {n: ALL_IDS[torch.randint(len(ALL_IDS), (20 + 5 * rank,), generator=g)] for n in COLLECTION}
    per_call = []
    for step in range(4):
        if step == 2:  # new static tensors (on every rank): routed afresh
            fixed = {n: ALL_IDS[torch.randint(len(ALL_IDS), (12 + 3 * rank,), generator=g)] for n in COLLECTION}
        grads = {n: torch.randn(x.numel(), COLLECTION[n].dim, generator=g) for n, x in fixed.items()}
        exchanges.clear()
        got = static.lookup(fixed, static=True)
        static.apply_gradients(fixed, grads)
        per_call.append(len(exchanges))
        want = plain.lookup({n: x.clone() for n, x in fixed.items()})
        plain.apply_gradients({n: x.clone() for n, x in fixed.items()}, grads)
        for n in fixed:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
    rows = {n: (static[n].lookup(ALL_IDS, train=False), plain[n].lookup(ALL_IDS, train=False)) for n in COLLECTION}
    torch.save((rows, per_call), f"{out}.rank{rank}.pt")


def test_static_lookups_reuse_their_routing_with_the_same_results(tmp_path):
    run_distributed(2, _static_against_plain, str(tmp_path / "rows"))
    for rank in range(2):
        rows, per_call = torch.load(tmp_path / f"rows.rank{rank}.pt")
        assert per_call == [4, 2, 4, 2]  # counts, ids, rows, gradients; then rows and gradients
        for n, (static, plain) in rows.items():
            torch.testing.assert_close(static, plain, rtol=1e-6, atol=1e-7, msg=n)


def _catalog_lookups(rank, world, out):
    """The training step's lookup (HSTULightningModule._look_up) with the catalog as
    negatives under two processes: the catalog alone, statically, the batch's rows gathered
    from it; against the lookup of the batch and the catalog together (as one process
    makes it), trained alike from the same losses: the same rows and tables."""
    from types import SimpleNamespace

    from lightning_modules.config import HSTUConfig
    from lightning_modules.item_embedding import ItemEmbedding
    from lightning_modules.item_features import ItemFeatures
    from lightning_modules.module import HSTULightningModule

    config = HSTUConfig(embedding_dim=8)
    catalog = torch.arange(3, 60, 3)
    features = ItemFeatures(catalog, torch.arange(0, 2 * len(catalog) + 1, 2), torch.arange(2 * len(catalog)) % 5)
    step = SimpleNamespace(catalog=catalog, trainer=SimpleNamespace(world_size=world))
    g = torch.Generator().manual_seed(rank)
    tables = {}
    for mode in ("static", "together"):
        items = ItemEmbedding(config, features=features)
        for _ in range(3):
            ids = catalog[torch.randint(len(catalog), (30,), generator=g)]
            weights = torch.randn(len(ids) + len(catalog), config.embedding_dim, generator=g)
            if mode == "static":
                looked, rows, at = HSTULightningModule._look_up(SimpleNamespace(**vars(step), items=items), ids, catalog)
                assert torch.equal(catalog[at], ids)
            else:
                looked = items.lookup(torch.cat([ids, catalog]), train=True)
                rows = looked.embeddings
            (rows * weights).sum().backward()
            items.apply_gradients(looked)
        tables[mode] = {n: items.tables[n].lookup(catalog if n == "item" else torch.arange(5), train=False)
                        for n in items.tables.tables}
        g = torch.Generator().manual_seed(rank)  # the same batches and losses for the second mode
    torch.save(tables, f"{out}.rank{rank}.pt")


def test_the_training_lookup_of_the_catalog_is_static_under_several_processes(tmp_path):
    run_distributed(2, _catalog_lookups, str(tmp_path / "rows"))
    for rank in range(2):
        tables = torch.load(tmp_path / f"rows.rank{rank}.pt")
        for n in tables["static"]:
            torch.testing.assert_close(tables["static"][n], tables["together"][n], rtol=1e-5, atol=1e-6, msg=n)
