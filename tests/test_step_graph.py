"""The whole training step (model, full-catalog loss, backward, AdamW) from one CUDA graph
per bucket: the same losses, input gradients, weights and optimizer state as the step run
eagerly and as the model's graphs with AdamW stepped outside them (GPU); what it refuses
(CPU)."""
import copy

import pytest
import torch
from conftest import run_distributed, sequence_batch

from lightning_modules.config import HSTUConfig
from lightning_modules.cuda_graphs import GraphedHSTU
from lightning_modules.hstu import HSTU
from lightning_modules.losses import catalog_softmax_loss
from lightning_modules.module import catalog_rows_gradient, rows_gradient
from lightning_modules.step_graph import GraphedTrainingStep, average_gradients

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = HSTUConfig(num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, embedding_dim=16, max_seq_len=12, dropout=0.0)
ITEMS, TEMPERATURE, LR = 9, 0.05, 1e-2
BATCHES = [[5, 12, 0, 3], [7, 1, 12, 10], [12, 12, 12, 9, 11], [2, 4], [3, 3, 3]]  # several buckets, one reused


def adamw(model: HSTU, capturable: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=capturable or None, capturable=capturable)


def step_inputs(lengths: list[int], seed: int):
    x, ts, offsets = (t.to(DEVICE) for t in sequence_batch(lengths, CONFIG.embedding_dim, seed))
    gen = torch.Generator().manual_seed(seed)
    items = torch.randn(ITEMS, CONFIG.embedding_dim, generator=gen).to(DEVICE)
    return x, ts, offsets, items, torch.randint(0, ITEMS, (x.shape[0],), generator=gen).to(DEVICE)


def test_an_optimizer_that_cannot_be_captured_is_refused():
    model = HSTU(CONFIG)
    with pytest.raises(ValueError, match="capturable"):
        GraphedTrainingStep(GraphedHSTU(model, batch_slots=4, buckets=2), adamw(model, capturable=False))


def test_no_graph_serves_cpu_tensors():
    model = HSTU(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    step = GraphedTrainingStep(GraphedHSTU(model, batch_slots=4, buckets=2), opt)
    x, ts, offsets = sequence_batch([5, 3], CONFIG.embedding_dim, seed=0)
    assert step(x.requires_grad_(True), ts, offsets, torch.randn(ITEMS, CONFIG.embedding_dim), torch.zeros(8, dtype=torch.int64), 0.1) is None
    assert not step.buckets and not opt.state


def _average_on_ranks(rank: int, world: int) -> None:
    """Rank r's gradients are r + 1 times a fixed pattern (the last parameter has none on
    rank 0): after average_gradients each is the ranks' mean, in its own shape."""
    params = [torch.zeros(3, 2), torch.zeros(5), torch.zeros(2, 2)]
    patterns = [torch.arange(p.numel(), dtype=torch.float32).view_as(p) - 2 for p in params]
    for i, (p, pattern) in enumerate(zip(params, patterns)):
        p.grad = None if (rank == 0 and i == 2) else (rank + 1) * pattern
    average_gradients(params, group=None)  # (the default group: every rank)
    scale = sum(range(1, world + 1)) / world
    assert torch.equal(params[0].grad, scale * patterns[0]) and torch.equal(params[1].grad, scale * patterns[1])
    assert torch.equal(params[2].grad, sum(range(2, world + 1)) / world * patterns[2])  # rank 0 counted zeros
    assert all(p.grad.shape == p.shape for p in params)


def test_gradients_are_averaged_over_the_ranks_in_one_all_reduce():
    """The step graph's gradient averaging under several processes (two gloo processes;
    in a graph on GPUs it is the same calls, captured)."""
    run_distributed(2, _average_on_ranks)


def step_outside(loss_of, opt, x, ts, offsets, items, index):
    """A step whose loss loss_of(x, ts, offsets, items, index) gives, AdamW stepped after
    its backward: the loss and the inputs' gradients."""
    x, items = x.clone().requires_grad_(True), items.clone().requires_grad_(True)
    loss = loss_of(x, ts, offsets, items, index)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), x.grad, items.grad


def assert_same_training(a: HSTU, opt_a, b: HSTU, opt_b) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)
        for k, v in opt_a.state[p].items():
            torch.testing.assert_close(v, opt_b.state[q][k], atol=2e-5, rtol=1e-4, msg=f"{name} {k}")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_the_step_graph_trains_as_the_eager_step():
    """Float32, no dropout, three copies of one model: eager, the model's loss graphs with
    AdamW outside, and the whole step in a graph. After each batch: the same loss and input
    gradients; after all of them, the same weights and AdamW state. Then the step graph's
    optimizer reloads its own state (new state tensors) and its rate changes: the graphs
    are captured again and training goes on as the eager copy's."""
    torch.manual_seed(0)
    eager = HSTU(CONFIG).to(DEVICE)
    looped, whole = copy.deepcopy(eager), copy.deepcopy(eager)
    opt_eager, opt_looped, opt_whole = adamw(eager, True), adamw(looped, True), adamw(whole, True)
    graphed = GraphedHSTU(looped, batch_slots=5, buckets=3)
    step = GraphedTrainingStep(GraphedHSTU(whole, batch_slots=5, buckets=3), opt_whole)

    def eager_loss(x, ts, offsets, items, index):
        return catalog_softmax_loss(eager(x, ts, offsets), items, index, TEMPERATURE)

    def looped_loss(x, ts, offsets, items, index):
        return graphed.catalog_loss(x, ts, offsets, items, index, TEMPERATURE)

    def train(seeds, loss_graphs=False):
        for seed in seeds:
            inputs = step_inputs(BATCHES[seed % len(BATCHES)], seed)
            want = step_outside(eager_loss, opt_eager, *inputs)
            x, ts, offsets, items, index = inputs
            got = step(x.clone().requires_grad_(True), ts, offsets, items, index, TEMPERATURE)
            for w, g, name in zip(want, got, ("loss", "dx", "ditems")):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=f"batch {seed}: {name}")
            assert all(p.grad is None for p in whole.parameters())  # the update happened inside the graph
            if loss_graphs:
                for w, g, name in zip(want, step_outside(looped_loss, opt_looped, *inputs), ("loss", "dx", "ditems")):
                    torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=f"batch {seed}, loss graphs: {name}")

    train(range(len(BATCHES)), loss_graphs=True)
    assert sorted(rows for rows, *_ in step.buckets) == [20, 40, 60]
    assert_same_training(whole, opt_whole, eager, opt_eager)
    assert_same_training(looped, opt_looped, eager, opt_eager)

    for change in ("state", "rate"):
        graphs = {k: b.graph for k, b in step.buckets.items()}
        if change == "state":  # new state tensors, the same values
            opt_whole.load_state_dict(copy.deepcopy(opt_whole.state_dict()))
        else:
            for opt in (opt_whole, opt_eager):
                opt.param_groups[0]["lr"] = LR / 4
        train(range(len(BATCHES), 2 * len(BATCHES)))
        assert all(step.buckets[k].graph is not graphs[k] for k in graphs), change
        assert_same_training(whole, opt_whole, eager, opt_eager)


def test_the_rows_gradient_is_autograds():
    """module.rows_gradient against autograd's backward of the indexing and split the
    training step makes: rows (the batch's items, then the catalog's), x = rows[sources]."""
    gen = torch.Generator().manual_seed(0)
    batch_rows, catalog, dim = 11, 6, 4
    rows = torch.randn(batch_rows + catalog, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    sources = torch.tensor([0, 1, 2, 4, 5, 8, 9])  # every row but each sequence's last (ends at 3, 7, 10)
    x, items = rows[:batch_rows][sources], rows[batch_rows:]
    x_grad, items_grad = torch.randn(x.shape, generator=gen, dtype=torch.float64), torch.randn(items.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward((x, items), (x_grad, items_grad))
    got = rows_gradient(rows, sources, x_grad, items_grad)
    torch.testing.assert_close(got, rows.grad, rtol=0, atol=0)
    assert not got[[3, 7, 10]].any()


def test_the_catalog_rows_gradient_is_autograds():
    """module.catalog_rows_gradient against autograd's backward of the gather and the
    concatenation the training step makes under several processes: rows = the catalog's
    rows at the batch's items, then the catalog's rows; x = rows[sources]."""
    gen = torch.Generator().manual_seed(1)
    catalog, dim = 6, 4
    emb = torch.randn(catalog, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    at = torch.tensor([5, 0, 0, 3, 2, 2, 2, 1, 4, 0, 5])  # the batch's 11 items, repeats included
    sources = torch.tensor([0, 1, 2, 4, 5, 8, 9])
    rows = torch.cat([emb[at], emb])
    x, items = rows[: len(at)][sources], rows[len(at) :]
    x_grad, items_grad = torch.randn(x.shape, generator=gen, dtype=torch.float64), torch.randn(items.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward((x, items), (x_grad, items_grad))
    got = catalog_rows_gradient(at, sources, x_grad, items_grad)
    torch.testing.assert_close(got, emb.grad)
    assert not torch.equal(got, items_grad)  # the batch's rows did add
