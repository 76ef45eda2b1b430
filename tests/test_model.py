"""The HSTU model, the loss, the metrics, and a training step on an empty batch."""
import lightning as L
import pytest
import torch

from lightning_modules.config import HSTUConfig, preset
from lightning_modules.data import pad_batch
from lightning_modules.evaluate import ranking_metrics, target_ranks
from lightning_modules.hstu import HSTU
from lightning_modules import losses
from lightning_modules.losses import catalog_softmax_loss, sampled_softmax_loss
from lightning_modules.module import HSTULightningModule

SMALL = HSTUConfig(num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, embedding_dim=16, max_seq_len=12, num_negatives=5, batch_size=4)


def test_presets_are_the_papers_ml1m_settings():
    base, large = preset("hstu"), preset("hstu-large")
    assert (base.num_blocks, base.num_heads, base.attention_dim, base.embedding_dim) == (2, 1, 50, 50)
    assert (large.num_blocks, large.num_heads, large.attention_dim, large.linear_dim) == (8, 2, 25, 25)
    for c in (base, large):
        assert (c.max_seq_len, c.dropout, c.lr, c.betas, c.batch_size, c.temperature) == (200, 0.2, 4e-3, (0.9, 0.98), 128, 0.1)


def test_output_is_causal_normalized_and_ignores_padding():
    model = HSTU(SMALL).eval()
    emb = torch.randn(2, 10, 16)
    ts = torch.randint(0, 10**6, (2, 10)).sort(1).values
    lengths = torch.tensor([10, 6])
    out = model(emb, ts, lengths)
    torch.testing.assert_close(out[0].norm(dim=-1), torch.ones(10))
    assert out[1, 6:].abs().sum() == 0
    changed = emb.clone()
    changed[0, 7:] = torch.randn(3, 16)  # the future
    changed[1, 6:] = torch.randn(4, 16)  # padding
    out2 = model(changed, ts, lengths)
    torch.testing.assert_close(out2[0, :7], out[0, :7])
    torch.testing.assert_close(out2[1], out[1])


def test_sampled_softmax_masks_accidental_hits():
    out = torch.nn.functional.normalize(torch.randn(3, 4), dim=-1)
    target = torch.randn(3, 4)
    target_ids = torch.tensor([1, 2, 3])
    negatives = torch.cat([target[:1], torch.randn(2, 4)])  # negative 0 is position 0's own target
    loss = sampled_softmax_loss(out, target, target_ids, negatives, torch.tensor([1, 8, 9]), 0.05)
    manual_logits = torch.cat([(out * torch.nn.functional.normalize(target, dim=-1)).sum(-1, keepdim=True),
                               out @ torch.nn.functional.normalize(negatives, dim=-1).T], 1) / 0.05
    manual_logits[0, 1] = float("-inf")
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(manual_logits, torch.zeros(3, dtype=torch.long)))


def test_the_catalog_softmax_is_the_sampled_softmax_over_every_item():
    out = torch.nn.functional.normalize(torch.randn(5, 4), dim=-1)
    catalog_emb = torch.randn(7, 4)
    target = torch.tensor([0, 3, 3, 6, 2])
    full = catalog_softmax_loss(out, catalog_emb, target, 0.05)
    sampled = sampled_softmax_loss(out, catalog_emb[target], target, catalog_emb, torch.arange(7), 0.05)
    torch.testing.assert_close(full, sampled)


@pytest.mark.parametrize("positions", [0, 1, 63, 64, 200])
def test_the_blockwise_catalog_softmax_equals_the_plain_one_with_its_gradients(positions, monkeypatch):
    monkeypatch.setattr(losses, "BLOCK_LOGITS_CPU", 64 * 37)  # blocks of 64 positions: more and fewer than one, and none
    g = torch.Generator().manual_seed(positions)
    out = torch.nn.functional.normalize(torch.randn(positions, 8, generator=g, dtype=torch.float64), dim=-1).requires_grad_(True)
    emb = torch.randn(37, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    target = torch.randint(0, 37, (positions,), generator=g)
    loss = catalog_softmax_loss(out, emb, target, 0.1)
    out2, emb2 = out.detach().clone().requires_grad_(True), emb.detach().clone().requires_grad_(True)
    plain = torch.nn.functional.cross_entropy((out2 / 0.1) @ torch.nn.functional.normalize(emb2, dim=-1).T, target)
    torch.testing.assert_close(loss, plain, equal_nan=True)
    if positions:
        (3.0 * loss).backward()
        (3.0 * plain).backward()
        torch.testing.assert_close(out.grad, out2.grad)
        torch.testing.assert_close(emb.grad, emb2.grad)


def test_ranking_metrics_and_history_exclusion():
    m = ranking_metrics(torch.tensor([0, 9, 10, 199]), ks=(10, 200))
    assert m["hr@10"] == 0.5 and m["hr@200"] == 1.0
    torch.testing.assert_close(torch.tensor(m["ndcg@10"]), torch.tensor((1 + 1 / torch.log2(torch.tensor(11.0)).item()) / 4))
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    assert target_ranks(scores, torch.tensor([2]), torch.zeros(1, 4, dtype=torch.bool)).item() == 2
    exclude = torch.tensor([[True, False, True, False]])  # item 0 is history; the target is never excluded
    assert target_ranks(scores, torch.tensor([2]), exclude).item() == 1


def test_training_step_on_batches_with_and_without_targets():
    module = HSTULightningModule(SMALL, catalog=torch.arange(100, 130))
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    batches = [
        pad_batch([]),  # an empty batch
        pad_batch([(torch.tensor([101]).numpy(), torch.tensor([5]).numpy())]),  # one item: no target
        pad_batch([(torch.arange(100, 108).numpy(), torch.arange(8).numpy()), (torch.tensor([120, 121]).numpy(), torch.tensor([1, 2]).numpy())]),
    ]
    weights = [p.detach().clone() for p in module.model.parameters()]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 3
    assert module.item_table.stats().size > 2  # items and negatives got rows
    assert any(not torch.equal(w, p) for w, p in zip(weights, module.model.parameters()))


def test_outputs_by_length_groups_equal_one_padded_run():
    module = HSTULightningModule(SMALL, catalog=torch.arange(100, 130)).eval()
    lengths = torch.tensor([1, 3, 12, 5, 7, 0, 12, 2, 9])  # sorted or not, empty and full rows
    lengths = lengths.sort().values
    B, L = len(lengths), 12
    emb = torch.randn(B, L, 16)
    ts = torch.randint(0, 10**6, (B, L)).sort(1).values
    keep = torch.arange(L)[None] < (lengths - 1).clamp(min=0)[:, None]
    with torch.no_grad():
        grouped = module.outputs_at(emb, ts, lengths, keep)
        padded = module.model(emb, ts, lengths)[keep]
    assert grouped.shape == (int(keep.sum()), 16)
    torch.testing.assert_close(grouped, padded)
