"""DynamicEmbedding: rows on first sight, fused sparse optimizers against torch.optim."""
import pytest
import torch

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, OptimizerConfig


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
