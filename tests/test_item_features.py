"""Item side features in the model: genre bags, the pooled item embedding, its gradients,
and the model directory that carries them."""
import lightning as L
import numpy as np
import pytest
import torch

from kernels.dynamic_embedding import DumpError
from lightning_modules import model_files
from lightning_modules.config import HSTUConfig
from lightning_modules.data import jagged_batch
from lightning_modules.hstu import HSTU
from lightning_modules.item_embedding import GENRE, ITEM, ItemEmbedding
from lightning_modules.item_features import ItemFeatures, items_table
from lightning_modules.module import HSTULightningModule

SMALL = HSTUConfig(
    num_blocks=1, num_heads=1, attention_dim=8, linear_dim=8, embedding_dim=8, max_seq_len=12, num_negatives=5,
    batch_size=4, item_features=True, embedding_optimizer="sgd", lr=0.5,
)
GENRES = {3: [2, 0], 5: [], 9: [1], 2**40: [0, 1, 2]}  # item id -> genre ids


def features() -> ItemFeatures:
    ids = sorted(GENRES)
    offsets = np.cumsum([0] + [len(GENRES[i]) for i in ids])
    return ItemFeatures(torch.tensor(ids), torch.tensor(offsets), torch.tensor([g for i in ids for g in GENRES[i]]))


def test_bags_of_any_ids_follow_the_table():
    f = features()
    ids = torch.tensor([9, 4, 3, 2**40, 9, -1, 5, 2**62])
    genres, offsets = f.bags(ids)
    expected = [GENRES.get(i, []) for i in ids.tolist()]
    assert offsets.tolist() == np.cumsum([0] + [len(g) for g in expected]).tolist()
    assert genres.tolist() == [g for bag in expected for g in bag]
    empty_genres, empty_offsets = f.bags(torch.empty(0, dtype=torch.int64))
    assert empty_genres.numel() == 0 and empty_offsets.tolist() == [0]


def test_features_read_from_items_parquet_and_checked(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(items_table({7: ["b", "a"], 1: [], 4: ["b"]}), tmp_path / "items.parquet")
    f = ItemFeatures.read(tmp_path)
    assert f.item_ids.tolist() == [1, 4, 7] and f.offsets.tolist() == [0, 0, 1, 3] and f.genre_ids.tolist() == [1, 1, 0]
    assert ItemFeatures.read(tmp_path / "missing") is None
    bad = f.as_tensors() | {"item_ids": torch.tensor([1, 7, 4])}
    with pytest.raises(Exception, match="x.safetensors: field 'item_id': ids must be sorted and distinct"):
        ItemFeatures.from_tensors(bad, "x.safetensors")


def test_an_item_is_its_row_plus_the_mean_of_its_genres_rows_and_both_tables_learn():
    emb = ItemEmbedding(SMALL, "cpu", features())
    ids = torch.tensor([3, 9, 3, 5, 77])
    looked = emb.lookup(ids, train=True)
    item_rows = emb.tables[ITEM].lookup(ids, train=False)
    genre_rows = {g: emb.tables[GENRE].lookup(torch.tensor([g]), train=False)[0] for g in (0, 1, 2)}
    expected = item_rows.clone()
    for n, i in enumerate(ids.tolist()):
        if GENRES.get(i):
            expected[n] += torch.stack([genre_rows[g] for g in GENRES[i]]).mean(0)
    torch.testing.assert_close(looked.embeddings, expected)

    # SGD on the loss sum(w · embedding): an item row moves by lr · (copies) · w, a genre
    # row by lr · w · the sum over the items holding it of copies / bag size
    w = torch.randn(SMALL.embedding_dim)
    (looked.embeddings @ w).sum().backward()
    emb.apply_gradients(looked)
    lr = SMALL.lr
    torch.testing.assert_close(emb.tables[ITEM].lookup(torch.tensor([3]), train=False)[0], item_rows[0] - lr * 2 * w)
    torch.testing.assert_close(emb.tables[ITEM].lookup(torch.tensor([77]), train=False)[0], item_rows[4] - lr * w)
    share = {0: 2 / 2, 1: 1 / 1, 2: 2 / 2}  # item 3 (twice, genres 2 and 0), item 9 (genre 1)
    for g, s in share.items():
        torch.testing.assert_close(emb.tables[GENRE].lookup(torch.tensor([g]), train=False)[0], genre_rows[g] - lr * s * w)


def test_a_training_step_with_features_and_the_model_directory_round_trip(tmp_path):
    module = HSTULightningModule(SMALL, catalog=torch.tensor([3, 5, 9, 11, 2**40]), features=features())
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    seqs = [(np.array([3, 9, 5, 2**40, 11]), np.arange(5)), (np.array([9, 3]), np.array([1, 2]))]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([jagged_batch(seqs)] * 2, batch_size=None))
    stats = module.items.stats()
    assert stats[GENRE].size == 3 and stats[ITEM].size == 5

    path = model_files.save(tmp_path / "model", module.model, module.items)
    model, items, info = model_files.load_model(path)
    ids = torch.tensor([3, 5, 9, 11, 2**40, 123])
    torch.testing.assert_close(items.embed(ids), module.items.embed(ids))
    assert isinstance(model, HSTU) and info["config"]["item_features"]

    (path / "item_features.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(DumpError, match="item_features.safetensors: missing or checksum mismatch"):
        model_files.load_model(path)


def test_configs_saved_before_item_features_load_without_them():
    d = HSTUConfig().to_dict()
    del d["item_features"]
    assert HSTUConfig.from_dict(d).item_features is False
