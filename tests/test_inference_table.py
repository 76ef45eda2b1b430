"""The inference table (device cache, host cache, disk store) held to a plain dict model:
lookups, updates and snapshot swaps from several threads, cache locking, prefetch, the
fallback for unknown ids, dumps in and out, statistics."""
import random
import threading
import time

import pytest
import torch

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, OptimizerConfig, ShardedDynamicEmbedding, dump
from kernels.dynamic_embedding.disk_store import DiskStore
from kernels.dynamic_embedding.inference import InferenceConfig, InferenceTable
from kernels.dynamic_embedding.snapshots import Snapshots

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIM = 8
EXTREMES = [torch.iinfo(torch.int64).min + 1, torch.iinfo(torch.int64).max, -1, 0]  # int64 min itself is reserved


def stored(n: int, seed: int, dim: int = DIM):
    g = torch.Generator().manual_seed(seed)
    keys = torch.cat([torch.randperm(10 * n, generator=g)[: n - len(EXTREMES)] * 3 - 5 * n, torch.tensor(EXTREMES)])
    return keys, torch.randn(n, dim, generator=g)


def table_over(tmp_path, keys, rows, name="store", device_rows=64, host_rows=256, bucket_size=8, missing="initial",
               backend="auto"):
    store = DiskStore.build(tmp_path / name, keys, rows)
    table = EmbeddingConfig(dim=rows.shape[1], seed=7, backend=backend)
    config = InferenceConfig(table, device_rows, host_rows, bucket_size, missing)
    return InferenceTable(config, store, DEVICE)


class VersionModel:
    """One snapshot's rows as a dict, with every update's rows kept by update number, so
    that the state after any number of updates can be read back."""

    def __init__(self, keys, rows, config):
        self.history = {int(k): [(0, r.clone())] for k, r in zip(keys, rows)}
        self.config = config
        self.applied = 0  # updates done
        self.started = 0  # updates begun

    def row(self, key: int, after: int) -> torch.Tensor:
        """The row of key after `after` updates (the fallback where it was never stored)."""
        rows = [r for n, r in self.history.get(key, []) if n <= after]
        if rows:
            return rows[-1]
        from kernels.dynamic_embedding.embedding import initial_embeddings

        return initial_embeddings(torch.tensor([key]), self.config)[0]


MIN_ANSWERS = 100  # answers the threaded test checks at least


def test_threads_of_lookups_updates_and_snapshot_swaps_match_a_dict(tmp_path):
    """Readers, an updater, a prefetcher and a swapper at once. Every answer equals the
    model's state of the version it names after some number of updates between those done
    when it began and those begun when it ended (all its rows of that one moment)."""
    keys, rows = stored(600, seed=0)
    models = {"v0": VersionModel(keys, rows, EmbeddingConfig(dim=DIM, seed=7))}
    snapshots = Snapshots("v0", table_over(tmp_path, keys, rows, "v0"), lambda t: t.close(remove_files=True))
    known = keys.tolist()
    update_lock = threading.Lock()  # the model's bookkeeping of an update, around the table's
    stop = threading.Event()
    errors, answers = [], []

    def reader(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            n = rng.choice([0, 1, 5, 40, 200])
            ids = [rng.choice(known) if rng.random() < 0.8 else rng.randrange(-10**12, 10**12) for _ in range(n)]
            ids += ids[: n // 4]  # duplicates
            with snapshots.use() as (version, table):
                model = models[version]
                begun_done = model.applied
                out = table.lookup(torch.tensor(ids, dtype=torch.int64)).cpu()
                end_started = model.started
            answers.append((version, ids, out, begun_done, end_started))

    def updater():
        rng = random.Random(1)
        while not stop.is_set():
            ids = [rng.choice(known) if rng.random() < 0.7 else rng.randrange(-10**12, 10**12) for _ in range(rng.choice([1, 10, 50]))]
            new = torch.randn(len(ids), DIM)
            with snapshots.use() as (version, table):
                model = models[version]
                with update_lock:
                    model.started += 1
                    n = model.started
                    table.update(torch.tensor(ids), new)
                    for k, r in zip(ids, new):  # the last copy of an id wins, as in the table
                        model.history.setdefault(k, []).append((n, r))
                    model.applied = n

    def prefetcher():
        rng = random.Random(2)
        while not stop.is_set():
            with snapshots.use() as (_, table):
                lease = table.prefetch(torch.tensor([rng.choice(known) for _ in range(30)])).result()
                time.sleep(0.001)
                table.release(lease)

    def swapper():
        for i in range(1, 4):
            time.sleep(0.3)
            deadline = time.monotonic() + 60
            while not any(a[0] == f"v{i - 1}" for a in answers[-50:]):  # each version answers before the next comes
                assert time.monotonic() < deadline and not stop.is_set(), f"no answer of v{i - 1}"
                time.sleep(0.01)
            k, r = stored(600, seed=i)
            models[f"v{i}"] = VersionModel(k, r, EmbeddingConfig(dim=DIM, seed=7))
            known.extend(k.tolist()[:100])
            snapshots.swap(f"v{i}", table_over(tmp_path, k, r, f"v{i}"))

    threads = [threading.Thread(target=f, args=a) for f, a in
               [(reader, (10,)), (reader, (11,)), (reader, (12,)), (updater, ()), (prefetcher, ()), (swapper, ())]]

    def guarded(t):
        try:
            t._target(*t._args)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            stop.set()

    runners = [threading.Thread(target=guarded, args=(t,)) for t in threads]
    for t in runners:
        t.start()
    runners[-1].join()  # the swapper: three swaps
    deadline = time.monotonic() + 60
    # enough answers to check, the last version's among them (a GPU compiling its first
    # launches can be slow to give them)
    while (len(answers) <= MIN_ANSWERS or not any(a[0] == "v3" for a in answers[-50:])) and time.monotonic() < deadline \
            and not stop.is_set():
        time.sleep(0.05)
    stop.set()
    for t in runners:
        t.join()
    assert not errors, errors
    assert snapshots.version == "v3" and sorted(snapshots.closed) == ["v0", "v1", "v2"]  # old versions released, each once its readers left
    assert not (tmp_path / "v0").exists()
    assert {a[0] for a in answers} == {"v0", "v1", "v2", "v3"} and len(answers) > MIN_ANSWERS
    for version, ids, out, lo, hi in answers:
        model = models[version]
        assert out.shape == (len(ids), DIM)
        moments = [n for n in range(lo, hi + 1)
                   if all(torch.equal(out[i], model.row(k, n)) for i, k in enumerate(ids))]
        assert moments, f"{version}: an answer matches no moment between {lo} and {hi} updates"
    snapshots.close()


def test_a_locked_batch_survives_a_flood_of_other_ids(tmp_path):  # Triton's tables on a GPU (the interpreter: 12 min)
    keys, rows = stored(2000, seed=3)
    table = table_over(tmp_path, keys, rows, device_rows=64, host_rows=0, bucket_size=8)
    batch = keys[:20]
    lease = table.acquire(batch)
    assert table.on_device(batch).all()

    def flood():
        for s in range(30):
            table.lookup(keys[torch.randperm(2000, generator=torch.Generator().manual_seed(s))[:300]])

    threads = [threading.Thread(target=flood) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert table.stats().device_evictions > 100  # the flood did evict
    assert table.on_device(batch).all()  # but none of the locked rows
    before = table.stats().device_hits
    assert torch.equal(table.lookup(batch, lease).cpu(), rows[:20])
    assert table.stats().device_hits - before == 20 and table.stats().locked == 20
    table.release(lease)
    assert table.stats().locked == 0
    for s in range(30):
        table.lookup(keys[20:][torch.randperm(1980, generator=torch.Generator().manual_seed(100 + s))[:300]])
    assert table.on_device(batch).float().mean() < 0.5  # unlocked, they are evicted as any other


def test_prefetch_brings_a_queued_batch_up_while_the_current_one_computes(tmp_path):
    keys, rows = stored(3000, seed=4)
    table = table_over(tmp_path, keys, rows, device_rows=512, host_rows=1024, bucket_size=16)
    batches = [keys[torch.randperm(3000, generator=torch.Generator().manual_seed(s))[:64]] for s in range(12)]
    lease = table.prefetch(batches[0]).result()
    for i, batch in enumerate(batches):
        following = table.prefetch(batches[i + 1]) if i + 1 < len(batches) else None  # while this one "computes"
        assert table.on_device(batch).all()  # before its lookup runs
        out = table.lookup(batch, lease)
        assert torch.equal(out.cpu(), rows[torch.tensor([int((keys == k).nonzero()) for k in batch])])
        table.release(lease)
        lease = following.result() if following else None
    s = table.stats()
    assert s.prefetch_hits == sum(b.unique().numel() for b in batches)  # every id of every batch was up in time
    assert s.prefetched == s.prefetch_hits


def test_unknown_ids_get_the_training_tables_initial_row_or_zeros(tmp_path):
    keys, rows = stored(100, seed=5)
    unknown = torch.tensor([123456789, -987654321, 42])
    table = table_over(tmp_path, keys, rows, "a")
    trained = DynamicEmbedding(EmbeddingConfig(dim=DIM, seed=7))
    assert torch.equal(table.lookup(unknown).cpu(), trained.lookup(unknown, train=False))
    assert table.stats().missing == 3
    zeros = table_over(tmp_path, keys, rows, "b", missing="zeros")
    assert torch.equal(zeros.lookup(unknown).cpu(), torch.zeros(3, DIM))
    with pytest.raises(ValueError, match="reserved"):
        table.lookup(torch.tensor([torch.iinfo(torch.int64).min]))
    with pytest.raises(ValueError, match="rows of shape"):
        table.update(keys[:2], torch.zeros(3, DIM))
    before = table.lookup(keys[:2]).cpu()
    with pytest.raises(ValueError, match=f"1 rows hold NaN or inf values, the first under id {int(keys[1])}"):
        table.update(keys[:2], torch.stack([torch.ones(DIM), torch.full((DIM,), float("inf"))]))
    assert torch.equal(table.lookup(keys[:2]).cpu(), before)  # nothing of that update was written
    with pytest.raises(ValueError, match="missing="):
        InferenceConfig(EmbeddingConfig(dim=DIM), 64, missing="nan")


def test_serves_a_trained_dump_and_applies_an_incremental_one(tmp_path):
    config = EmbeddingConfig(dim=DIM, optimizer=OptimizerConfig("adam", lr=0.1), seed=3)
    trained = ShardedDynamicEmbedding(config)
    ids = torch.arange(500) * 11
    for step in range(3):
        rows = trained.lookup(ids[step * 100 : step * 100 + 300]).requires_grad_(True)
        rows.square().sum().backward()
        trained.apply_gradients(ids[step * 100 : step * 100 + 300], rows.grad)
    dump(trained, tmp_path / "full")
    served = InferenceTable.from_dump(tmp_path / "full", tmp_path / "store", device_rows=128, host_rows=256, device=DEVICE,
                                      bucket_size=8)
    probe = torch.cat([ids, torch.tensor([7, 8])])  # two never trained: their initial rows
    assert torch.equal(served.lookup(probe).cpu(), trained.lookup(probe, train=False))

    step = trained.step
    rows = trained.lookup(ids[:50]).requires_grad_(True)
    rows.sum().backward()
    trained.apply_gradients(ids[:50], rows.grad)
    dump(trained, tmp_path / "incremental", min_score=step)  # rows used since the full dump
    assert served.apply_dump(tmp_path / "incremental").sort().values.tolist() == ids[:50].tolist()
    assert torch.equal(served.lookup(probe).cpu(), trained.lookup(probe, train=False))
    s = served.stats()
    assert s.updates == 50 and s.update_lag_s > 0 and s.disk_rows == 500
    assert s.device_bytes > 0 and s.host_bytes > 0 and s.disk_bytes > 0 and s.device_rows <= 128

    # a dump from a run that diverged (a NaN gradient) is refused, naming its file
    step = trained.step
    rows = trained.lookup(ids[:2]).requires_grad_(True)
    trained.apply_gradients(ids[:2], torch.full_like(rows, float("nan")))
    dump(trained, tmp_path / "diverged", min_score=step)
    with pytest.raises(ValueError, match=r"diverged/.*\.safetensors: 2 rows hold NaN or inf"):
        served.apply_dump(tmp_path / "diverged")
    assert torch.isfinite(served.lookup(ids[:2])).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])  # triton: under the interpreter on CPUs
def test_statistics_count_each_tier(tmp_path, backend):
    keys, rows = stored(400, seed=6)
    table = table_over(tmp_path, keys, rows, device_rows=256, host_rows=512, bucket_size=16, backend=backend)
    table.lookup(keys[:100])  # from disk, copied up to both caches
    table.lookup(keys[:100])  # from the device cache
    s = table.stats()
    assert (s.lookups, s.disk_hits, s.device_hits, s.host_hits, s.missing) == (200, 100, 100, 0, 0)
    assert s.hit_rate("device") == 0.5 and s.host_rows == 100 and s.device_rows == 100
    assert table.lookup(torch.empty(0, dtype=torch.int64)).shape == (0, DIM)


def test_the_disk_store_reads_what_it_holds_and_refuses_appends_out_of_order(tmp_path):
    keys, rows = stored(300, seed=8)
    store = DiskStore.build(tmp_path / "s", keys, rows)
    probe = torch.cat([keys[:50], torch.tensor([12345678901])])
    got, found = store.read(probe)
    assert torch.equal(got[:50], rows[:50]) and found.tolist() == [True] * 50 + [False] and not got[50].any()
    store.write(keys[:2], torch.ones(2, DIM))
    assert torch.equal(store.read(keys[:2])[0], torch.ones(2, DIM)) and len(store) == 300
    with pytest.raises(ValueError, match="ascending"):
        store.append(torch.tensor([keys.min() - 1]), torch.zeros(1, DIM))  # below stored keys
    assert len(store) == 300  # nothing of it written
    store.remove()
    assert not (tmp_path / "s").exists()
    with pytest.raises(FileNotFoundError):
        DiskStore(tmp_path / "s", DIM)
