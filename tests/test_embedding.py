"""DynamicEmbedding: rows on first sight, fused sparse optimizers against torch.optim."""
import pytest
import torch

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, OptimizerConfig


# the Triton backend runs on the GPU where there is one, else under Triton's interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


def make(opt: str = "adam", **kw) -> DynamicEmbedding:
    return DynamicEmbedding(EmbeddingConfig(dim=4, optimizer=OptimizerConfig(name=opt, lr=0.1, **kw), capacity=16))


def test_rows_are_created_on_first_sight_with_a_seeded_initializer():
    a, b = make(), make()
    ids = torch.tensor([5, -3, 2**62, 5])
    ea = a.lookup(ids)
    eb = b.lookup(ids.flip(0)).flip(0)  # another order, same rows
    assert torch.equal(ea, eb) and torch.equal(ea[0], ea[3])
    assert a.stats().size == 3 and a.stats().inserts == 3
    assert 0 < ea.std() < 0.1  # init_std 0.02
    c = DynamicEmbedding(EmbeddingConfig(dim=4, seed=1))
    assert not torch.equal(c.lookup(ids), ea)


def test_read_only_lookup_neither_inserts_nor_changes_scores():
    e = make()
    e.lookup(torch.tensor([1, 2]))
    scores = e.table.scores.clone()
    out = e.lookup(torch.tensor([1, 99]), train=False)
    assert e.stats().size == 2 and torch.equal(e.table.scores, scores)
    assert torch.equal(out[1], e.initial_rows(torch.tensor([99]))[0, :4])  # served, not stored


@pytest.mark.parametrize("opt", ["sgd", "adam", "adagrad"])
def test_fused_update_matches_torch_optim_with_duplicate_ids(opt):
    ids = torch.tensor([3, 1, 3, 3, 7, 1])
    e = make(opt, eps=1e-10, beta1=0.9, beta2=0.99)
    weight = torch.nn.Parameter(e.lookup(torch.tensor([1, 3, 7])).clone())  # dense twin: rows of 1, 3, 7
    index = torch.tensor([1, 0, 1, 1, 2, 0])
    dense_opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adam": lambda p: torch.optim.Adam(p, lr=0.1, betas=(0.9, 0.99), eps=1e-10),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10),
    }[opt]([weight])
    target = torch.randn(6, 4)
    for _ in range(3):
        rows = e.lookup(ids).requires_grad_(True)
        ((rows - target) ** 2).sum().backward()
        e.apply_gradients(ids, rows.grad)
        dense_opt.zero_grad()
        ((weight[index] - target) ** 2).sum().backward()
        dense_opt.step()
    torch.testing.assert_close(e.lookup(torch.tensor([1, 3, 7]), train=False), weight.detach(), rtol=1e-5, atol=1e-6)


def test_rowwise_adagrad_and_clipping():
    e = make("rowwise_adagrad", max_grad_norm=1.0)
    ids = torch.tensor([4])
    before = e.lookup(ids).clone()
    g = torch.tensor([[30.0, 40.0, 0.0, 0.0]])  # norm 50 → clipped to 1
    e.apply_gradients(ids, g)
    clipped = g / 50
    expected = before - 0.1 * clipped / ((clipped**2).mean().sqrt() + 1e-8)
    torch.testing.assert_close(e.lookup(ids, train=False), expected)


def test_lfu_scores_count_uses():
    e = DynamicEmbedding(EmbeddingConfig(dim=2, eviction="lfu"))
    e.lookup(torch.tensor([1, 1, 2]))
    e.lookup(torch.tensor([1]))
    keys, _, _, scores = e.export_rows()
    assert dict(zip(keys.tolist(), scores.tolist())) == {1: 3, 2: 1}


def test_empty_batches():
    e = make()
    assert e.lookup(torch.empty(0, dtype=torch.int64)).shape == (0, 4)
    e.apply_gradients(torch.empty(0, dtype=torch.int64), torch.empty(0, 4))
    assert e.stats().size == 0


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerConfig(name="lamb")
    with pytest.raises(ValueError, match="eviction"):
        EmbeddingConfig(dim=2, eviction="fifo")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_admission_stores_an_id_once_its_count_reaches_the_threshold(backend):
    device = on(backend)
    t = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    e = DynamicEmbedding(EmbeddingConfig(dim=4, admission_threshold=3, backend=backend), device)
    initial = e.initial_rows(t(7))[0, :4]
    first = e.lookup(t(7, 8))  # count 1 each
    assert e.stats().size == 0 and torch.equal(first[0], initial)  # served its initial row, not stored
    e.lookup(t(7, 7))  # count 3: admitted
    assert e.table.find(t(7)).item() != -1 and e.table.find(t(8)).item() == -1
    s = e.stats()
    assert (s.admissions, s.admission_rejections, s.size) == (1, 2, 1)
    assert e.counters.find(t(7)).item() == -1  # its counter is gone
    rows = e.lookup(t(8, 9)).requires_grad_(True)
    rows.sum().backward()
    e.apply_gradients(t(8, 9), rows.grad)  # ids without rows: nothing to update
    assert e.stats().size == 1


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_read_only_feature_never_writes(backend):
    e = DynamicEmbedding(EmbeddingConfig(dim=4, read_only=True, backend=backend), on(backend))
    out = e.lookup(torch.tensor([1, 2, 1], device=on(backend)))
    assert e.stats().size == 0 and torch.equal(out[0], out[2])


def test_eviction_policies_score_rows_as_documented():
    ids = torch.tensor([5, 5, 6])
    scores = {}
    for policy in ("lru", "lfu", "epoch_lru", "epoch_lfu"):
        e = DynamicEmbedding(EmbeddingConfig(dim=2, eviction=policy, backend="reference"))
        e.step, e.epoch = 7, 2
        e.lookup(ids)
        e.lookup(torch.tensor([5]))
        keys, _, _, s = e.export_rows()
        scores[policy] = dict(zip(keys.tolist(), s.tolist()))
    assert scores["lru"] == {5: 7, 6: 7}
    assert scores["lfu"] == {5: 3, 6: 1}
    assert scores["epoch_lru"] == {5: (2 << 32) | 7, 6: (2 << 32) | 7}
    assert scores["epoch_lfu"] == {5: (2 << 32) | 3, 6: (2 << 32) | 1}
    e = DynamicEmbedding(EmbeddingConfig(dim=2, eviction="epoch_lfu", backend="reference"))
    e.lookup(torch.tensor([5, 5]))
    e.epoch = 1  # a new epoch restarts the count
    e.lookup(torch.tensor([5]))
    assert e.export_rows()[3].tolist() == [(1 << 32) | 1]
    custom = DynamicEmbedding(EmbeddingConfig(dim=2, eviction="custom", backend="reference"))
    custom.lookup(ids, scores=torch.tensor([4, 9, 1]))
    assert dict(zip(custom.export_rows()[0].tolist(), custom.export_rows()[3].tolist())) == {5: 9, 6: 1}
    with pytest.raises(ValueError, match="needs scores"):
        custom.lookup(ids)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_eviction_policy_grows_then_rejects(backend):
    config = EmbeddingConfig(dim=2, eviction="none", capacity=8, max_capacity=16, bucket_size=8, backend=backend)
    e = DynamicEmbedding(config, on(backend))
    e.lookup(torch.arange(40, device=on(backend)))
    s = e.stats()
    assert s.evictions == 0 and s.size <= 16 and s.rejections == 40 - s.size > 0
    kept = set(e.export_rows()[0].tolist())
    e.lookup(torch.arange(100, 140, device=on(backend)))
    assert set(e.export_rows()[0].tolist()) == kept  # nothing stored is ever pushed out


def test_memory_budget():
    c = EmbeddingConfig(dim=128, optimizer=OptimizerConfig(name="adam"), bucket_size=128, max_capacity=1 << 20)
    assert c.bytes_per_row() == 400 * 4 + 21  # row of 385 values padded to 400; key, score, digest, mark
    assert c.table_bytes() == (1 << 20) * c.bytes_per_row()
    budget = 10 * 2**30
    cap = c.capacity_for_budget(budget)
    assert cap * c.bytes_per_row() <= budget < 2 * cap * c.bytes_per_row()
    assert EmbeddingConfig(dim=128, max_capacity=cap, bucket_size=128).table_bytes() == cap * EmbeddingConfig(dim=128).bytes_per_row()
    with pytest.raises(ValueError, match="no bucket"):
        c.capacity_for_budget(1000)


@pytest.mark.parametrize("backend,deterministic", [("reference", True), ("triton", True), ("triton", False)])
def test_device_tier_caches_a_host_tier_and_loses_nothing(backend, deterministic):
    """A table of 64 device rows in front of host memory trains like a table with every
    row on the device: rows move between tiers, none is lost or changed on the way. The
    Triton table in fast mode moves them in one pass of kernels (tiers.swap_in)."""
    device = on(backend)
    tiered_cfg = EmbeddingConfig(dim=3, optimizer=OptimizerConfig(name="adam", lr=0.1), capacity=64, bucket_size=8,
                                 max_capacity=4096, device_capacity=64, backend=backend, deterministic=deterministic)
    flat_cfg = EmbeddingConfig(dim=3, optimizer=OptimizerConfig(name="adam", lr=0.1), capacity=64, bucket_size=8,
                               max_capacity=4096, backend="reference")
    tiered, flat = DynamicEmbedding(tiered_cfg, device), DynamicEmbedding(flat_cfg)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 300, (24,), generator=g) for _ in range(12)]
    for i, ids in enumerate(batches):
        if i + 1 < len(batches):
            tiered.prefetch(batches[i + 1].to(device))
        for e in (tiered, flat):
            rows = e.lookup(ids.to(e.device)).requires_grad_(True)
            (rows.sum(1) * torch.arange(24, device=e.device)).sum().backward()
            e.apply_gradients(ids.to(e.device), rows.grad)
    s = tiered.stats()
    assert s.promotions > 0 and s.demotions > 0 and s.evictions == 0
    assert tiered.table.size() <= 64 < s.size == flat.stats().size
    assert s.bytes_host > s.bytes_device > 0
    everything = torch.arange(0, 300)
    torch.testing.assert_close(tiered.lookup(everything.to(device), train=False).cpu(), flat.lookup(everything, train=False), rtol=1e-5, atol=1e-6)
    keys, emb, state, _ = tiered.export_rows()
    assert len(set(keys.tolist())) == len(keys) == s.size  # each row in one tier


def tiny_tiered(backend: str, eviction: str = "lru", **overrides) -> DynamicEmbedding:
    """64 device rows in one bucket (eviction by score across the whole tier) in front of
    host memory."""
    cfg = EmbeddingConfig(dim=2, optimizer=OptimizerConfig(name="sgd"), capacity=64, bucket_size=64, max_capacity=1024,
                          device_capacity=64, eviction=eviction, backend=backend, **overrides)
    return DynamicEmbedding(cfg, on(backend))


def train_step(e: DynamicEmbedding, ids: torch.Tensor) -> None:
    e.apply_gradients(ids, torch.zeros_like(e.lookup(ids)))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_prefetched_rows_stay_on_the_device_until_their_lookup(backend):
    """Under LRU a prefetched batch's rows get the next step's score: the current batch's
    inserts evict older rows instead, and the next lookup finds all of them on the device."""
    e = tiny_tiered(backend)
    ids = lambda a, b: torch.arange(a, b, device=e.device)  # noqa: E731
    for start in range(0, 256, 32):  # rows 192..255 on the device, the rest in host memory
        train_step(e, ids(start, start + 32))
    nxt, cur = ids(0, 20), ids(100, 120)
    e.prefetch(nxt)
    promoted = e.stats().promotions
    assert promoted == 20 and (e.table.find(nxt) >= 0).all()
    train_step(e, cur)  # 20 more promotions, which must not evict the prefetched rows
    assert e.stats().promotions == promoted + 20
    hits = e.stats().hits
    train_step(e, nxt)
    assert e.stats().promotions == promoted + 20 and e.stats().hits == hits + 20


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lfu_counts_survive_a_trip_through_host_memory(backend):
    e = tiny_tiered(backend, eviction="lfu")
    five = torch.tensor([5], device=e.device)
    for _ in range(3):
        train_step(e, five)
    train_step(e, torch.arange(100, 164, device=e.device).repeat(4))  # 64 rows of count 4 push id 5 out
    assert e.table.find(five).item() == -1 and e.host.find(five).item() >= 0
    train_step(e, five.repeat(2))  # 3 uses before, 2 now: outranks the rows of count 4
    slot = e.table.find(five).item()
    assert slot >= 0 and e.table.scores[slot].item() == 5


def test_promote_on_miss_gives_a_rarely_used_id_the_least_used_rows_device_slot():
    """lfu in a tiered table: an id used once, meeting a device tier full of rows used
    more, is kept and trained in host memory; with promote_on_miss it takes the device
    slot of the least used row, which moves down with its row and count."""
    held = tiny_tiered("triton", eviction="lfu")
    promoting = tiny_tiered("triton", eviction="lfu", promote_on_miss=True)
    new, least = torch.tensor([5], device=held.device), torch.tensor([163], device=held.device)
    for e in (held, promoting):
        e.lookup(torch.arange(100, 164, device=e.device))
        e.apply_gradients(torch.arange(100, 164, device=e.device), torch.randn(64, 2, device=e.device))
        train_step(e, torch.arange(100, 164, device=e.device).repeat(2))  # 64 rows of count 3
        train_step(e, torch.arange(100, 163, device=e.device))  # ... all but id 163 of count 4
    row = promoting.lookup(least, train=False)
    for e in (held, promoting):
        train_step(e, new)
    assert held.table.find(new).item() == -1 and held.host.find(new).item() >= 0
    assert held.table.find(least).item() >= 0
    slot = promoting.table.find(new).item()
    assert slot >= 0 and promoting.table.scores[slot].item() == 1
    assert promoting.table.find(least).item() == -1 and promoting.host.scores[promoting.host.find(least)].item() == 3
    torch.testing.assert_close(promoting.lookup(least, train=False), row)
    assert (promoting.stats().promotions, promoting.stats().demotions) == (0, 1)
    with pytest.raises(ValueError, match="promote_on_miss needs a tiered Triton table"):
        tiny_tiered("reference", eviction="lfu", promote_on_miss=True)
    with pytest.raises(ValueError, match="promote_on_miss applies to tiered tables"):
        EmbeddingConfig(dim=2, promote_on_miss=True)


def test_an_update_after_ids_changed_in_place_sums_the_ids_it_is_given():
    """The update reuses its lookup's deduplication only for the same, unchanged ids."""
    e, fresh = make("sgd"), make("sgd")
    for t in (e, fresh):
        t.lookup(torch.tensor([1, 2]))
    ids = torch.tensor([1, 1])
    e.lookup(ids)
    ids[1] = 2
    grads = torch.tensor([[1.0] * 4, [10.0] * 4])
    e.apply_gradients(ids, grads)
    fresh.apply_gradients(torch.tensor([1, 2]), grads)
    everything = torch.tensor([1, 2])
    torch.testing.assert_close(e.lookup(everything, train=False), fresh.lookup(everything, train=False))


@pytest.mark.parametrize("backend,tiered", [("reference", False), ("reference", True), ("triton", False), ("triton", True)])
def test_assign_writes_rows_keeps_optimizer_state_and_training_continues_from_them(backend, tiered):
    """assign() on ids with rows (in either tier) and without: lookups return the rows
    written, stored ids keep their Adam state, new ids get fresh state, and the next
    update starts from the written row."""
    cfg = EmbeddingConfig(dim=3, optimizer=OptimizerConfig(name="adam", lr=0.1), capacity=64, bucket_size=8,
                          max_capacity=4096, device_capacity=16 if tiered else None, backend=backend)
    e = DynamicEmbedding(cfg, on(backend))
    trained = torch.arange(0, 40, device=e.device)
    rows = e.lookup(trained).requires_grad_(True)
    rows.sum().backward()
    e.apply_gradients(trained, rows.grad)
    keys, _, state, _ = e.export_rows()
    state_of = {k: s for k, s in zip(keys.tolist(), state)}
    if tiered:
        assert len(state_of) == 40 and e.table.size() <= 16  # some of them live on the host

    ids = torch.tensor([39, 1000, 5, -7, 17], device=e.device)  # three trained, two new
    written = torch.arange(15, dtype=torch.float32).view(5, 3)
    e.assign(ids, written)
    assert torch.equal(e.lookup(ids, train=False).cpu(), written)
    keys, emb, state, _ = e.export_rows()
    at = {k: i for i, k in enumerate(keys.tolist())}
    for k in (39, 5, 17):
        assert torch.equal(state[at[k]].cpu(), state_of[k].cpu())  # m, v and the step count kept
    for k in (1000, -7):
        assert not state[at[k]].any()  # fresh Adam state
    assert e.stats().size == 42

    grad = torch.ones(5, 3, device=e.device)
    e.lookup(ids)
    e.apply_gradients(ids, grad)
    after = e.lookup(ids, train=False).cpu()
    assert torch.all(after < written)  # a positive gradient moves every value down from the written one
    torch.testing.assert_close(after[1], written[1] - 0.1)  # a first Adam step is -lr * sign(g)


def test_assign_refuses_what_it_cannot_write():
    e = make()
    with pytest.raises(ValueError, match="distinct"):
        e.assign(torch.tensor([1, 2, 1]), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"embeddings must be \(2, 4\)"):
        e.assign(torch.tensor([1, 2]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="reserved"):
        e.assign(torch.tensor([-(2**63)]), torch.zeros(1, 4))
    custom = DynamicEmbedding(EmbeddingConfig(dim=4, eviction="custom"))
    with pytest.raises(ValueError, match="custom eviction policy needs scores"):
        custom.assign(torch.tensor([1]), torch.zeros(1, 4))
    custom.assign(torch.tensor([1]), torch.ones(1, 4), scores=torch.tensor([7]))
    assert custom.table.scores[custom.table.find(torch.tensor([1]))].item() == 7
    assert e.stats().size == 0  # nothing was written by the refused calls


@pytest.mark.parametrize("fields,message", [
    (dict(dim=0), "dim must be at least 1, got 0"),
    (dict(capacity=64, max_capacity=32), "capacity 64 is above max_capacity 32"),
    (dict(capacity=64, max_capacity=256, device_capacity=1024), "device_capacity must lie in \\[1, max_capacity 256\\], got 1024"),
    (dict(admission_threshold=0), "admission_threshold must be at least 1"),
    (dict(max_load_factor=1.5), "max_load_factor must lie in \\(0, 1\\], got 1.5"),
    (dict(bucket_size=0), "bucket_size must be at least 1"),
    (dict(init_std=-0.1), "init_std must not be negative"),
])
def test_a_config_out_of_range_is_refused_naming_its_field(fields, message):
    with pytest.raises(ValueError, match=f"EmbeddingConfig.{message}"):
        EmbeddingConfig(**{"dim": 8, **fields})


@pytest.mark.parametrize("fields,message", [
    (dict(lr=-0.1), "lr and weight_decay must not be negative"),
    (dict(eps=0.0), "eps must be positive"),
    (dict(beta2=1.0), "beta1 and beta2 must lie in \\[0, 1\\), got 0.9, 1.0"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be positive"),
])
def test_an_optimizer_config_out_of_range_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**fields)
