"""A jagged batch padded to a row count (row_padding.py): its shape, the model's outputs and
gradients on its real rows (CPU, float64), and a training step on padded batches against
one on the batches themselves."""
from dataclasses import replace

import lightning as L
import pytest
import torch
from conftest import sequence_batch

from lightning_modules.config import HSTUConfig
from lightning_modules.data import jagged_batch
from lightning_modules.hstu import HSTU
from lightning_modules.module import HSTULightningModule
from lightning_modules.row_padding import pad_jagged, pad_to_multiple

CONFIG = HSTUConfig(num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, embedding_dim=16, max_seq_len=12, dropout=0.0)


def batch(lengths, seed):
    return sequence_batch(lengths, CONFIG.embedding_dim, seed)


@pytest.mark.parametrize("lengths,rows,slots", [([5, 12, 0, 3], 20, 4), ([5, 12, 0, 3], 47, 6), ([], 13, 2), ([12, 12], 24, 2)])
def test_padding_makes_a_jagged_batch_of_fixed_shape_around_the_real_one(lengths, rows, slots):
    x, ts, offsets = batch(lengths, seed=0)
    px, pts, poff = pad_jagged(x, ts, offsets, rows, slots, CONFIG.max_seq_len)
    pad_sequences = -(-rows // CONFIG.max_seq_len)
    assert px.shape == (rows, CONFIG.embedding_dim) and pts.shape == (rows,) and poff.shape == (slots + pad_sequences + 1,)
    assert torch.equal(poff[: len(offsets)], offsets) and int(poff[-1]) == rows
    sizes = poff.diff()
    assert (sizes >= 0).all() and (sizes <= CONFIG.max_seq_len).all()
    assert (sizes[len(lengths) : slots] == 0).all()  # the batch's empty slots
    assert torch.equal(px[: len(x)], x) and not px[len(x) :].any() and torch.equal(pts[: len(ts)], ts)


def test_a_batch_that_does_not_fit_is_refused():
    x, ts, offsets = batch([5, 7], seed=0)
    with pytest.raises(ValueError, match="2 sequences and 12 rows"):
        pad_jagged(x, ts, offsets, 11, 2, CONFIG.max_seq_len)
    with pytest.raises(ValueError, match="does not fit 1 sequences"):
        pad_jagged(x, ts, offsets, 20, 1, CONFIG.max_seq_len)


def test_the_padded_batch_gives_the_real_rows_outputs_and_gradients():
    """The model on the padded batch, its padding rows' outputs dropped, is the model on the
    batch itself: outputs, input gradients and weight gradients (the twin on a CPU)."""
    model = HSTU(CONFIG).double()
    x, ts, offsets = batch([5, 12, 0, 1, 9], seed=1)
    x = x.double().requires_grad_(True)
    weight = torch.randn(x.shape[0], CONFIG.embedding_dim, dtype=torch.float64)
    plain = model(x, ts, offsets)
    (plain * weight).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_x, x.grad = x.grad.clone(), None
    model.zero_grad()
    padded = model(*pad_jagged(x, ts, offsets, 40, 7, CONFIG.max_seq_len))[: x.shape[0]]
    (padded * weight).sum().backward()
    torch.testing.assert_close(padded, plain)
    torch.testing.assert_close(x.grad, want_x)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)


@pytest.mark.parametrize("lengths,multiple,rows,pad_sequences", [
    ([5, 12, 0, 3], 8, 24, 1), ([5, 12, 0, 3], 32, 32, 1), ([5, 12, 0, 3], 48, 48, 3), ([5, 3], 8, 8, 0), ([], 16, 0, 0), ([12, 1], 4, 16, 1),
])
def test_padding_to_a_multiple_adds_the_fewest_padding_sequences(lengths, multiple, rows, pad_sequences):
    x, ts, offsets = batch(lengths, seed=3)
    px, pts, poff = pad_to_multiple(x, ts, offsets, multiple, CONFIG.max_seq_len)
    assert px.shape[0] == rows and pts.shape == (rows,) and poff.numel() == len(lengths) + 1 + pad_sequences
    assert torch.equal(poff[: len(offsets)], offsets) and int(poff[-1]) == rows
    assert (poff.diff() <= CONFIG.max_seq_len).all() and (poff.diff() >= 0).all()
    assert torch.equal(px[: len(x)], x) and not px[len(x) :].any()


def test_a_padded_training_step_trains_as_the_unpadded_one():
    """HSTULightningModule with pad_rows on (as on a GPU) and off, on a CPU without dropout:
    the model sees row counts that are multiples of row_multiple, and three steps of
    training end at the same weights and item rows as without padding."""
    config = replace(CONFIG, num_negatives=5, batch_size=4, row_multiple=16)
    data = [
        jagged_batch([(torch.arange(100, 108).numpy(), torch.arange(8).numpy()), (torch.tensor([120, 121, 125]).numpy(), torch.tensor([1, 2, 4]).numpy())]),
        jagged_batch([(torch.arange(110, 122).numpy(), torch.arange(12).numpy())]),
        jagged_batch([(torch.tensor([101]).numpy(), torch.tensor([5]).numpy()), (torch.arange(101, 106).numpy(), torch.arange(5).numpy())]),
    ]
    ids = torch.arange(100, 130)
    results = []
    for pad in (False, True):
        torch.manual_seed(0)
        module = HSTULightningModule(config, catalog=ids)
        module.pad_rows = pad
        rows = []
        module.model.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        results.append(([p.detach().clone() for p in module.model.parameters()], module.items.lookup(ids, train=False).embeddings, rows))
    (plain, plain_rows, plain_counts), (padded, padded_rows, padded_counts) = results
    assert plain_counts == [9, 11, 4] and padded_counts == [16, 16, 16]
    for a, b in zip(plain, padded):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(padded_rows, plain_rows)
