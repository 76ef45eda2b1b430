"""Validation during training: early stopping, the best checkpoint kept and restored, and
runs that repeat exactly with the same seed."""
import json

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from lightning_modules import model_files
from lightning_modules.callbacks import LOSS, EpochCheckpoint, Validation
from lightning_modules.evaluate import HSTURanker, catalog_of, evaluate_rankers, whole_histories
from pipelines.cli import main as hstu

# six users: history 10-13, validation target 16, test targets 20-25 (the other candidates)
USERS = [[10, 11, 12, 13, 16, 20 + k] for k in range(6)]
TARGET = 16


def write_split(directory, users: list[list[int]]) -> None:
    """train/valid/test Parquet files whose test sequences are `users`."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, cut in (("train", 2), ("valid", 1), ("test", 0)):
        seqs = [u[: len(u) - cut] for u in users]
        pq.write_table(pa.table({
            "user_id": pa.array(range(len(users)), pa.int64()),
            "item_ids": pa.array(seqs, pa.list_(pa.int64())),
            "timestamps": pa.array([list(range(len(s))) for s in seqs], pa.list_(pa.int64())),
        }), directory / f"{name}.parquet")


class ScriptedRanker:
    """Puts the validation target at a scripted rank among the candidates 20-25."""

    max_seq_len = 4

    def __init__(self, catalog: torch.Tensor, rank: int):
        self.catalog, self.rank = catalog, rank

    def scores(self, items, timestamps, lengths):
        scores = -self.catalog.double().expand(len(lengths), -1).clone()  # lower ids first
        scores[:, self.catalog == TARGET] = -(20 + self.rank) + 0.5  # below items 20 .. 19 + rank
        return scores


class ScriptedModule(L.LightningModule):
    """A module whose validation quality follows a script, and whose one weight records
    the epoch that trained it last."""

    def __init__(self, ranks: list[int]):
        super().__init__()
        self.ranks = ranks
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.weight.fill_(self.current_epoch)
        return (self.weight * 0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)

    def rankers(self, catalog):
        return {"model": ScriptedRanker(catalog, self.ranks[self.current_epoch])}


def test_training_stops_once_validation_stops_improving_and_keeps_the_best_checkpoint(tmp_path):
    write_split(tmp_path / "data", USERS)
    # the target's rank per epoch: best at epoch 2, then worse for 2 validations
    module = ScriptedModule(ranks=[5, 3, 0, 1, 4, 0, 0])
    validation = Validation(tmp_path / "data", patience=2)
    checkpoints = EpochCheckpoint(tmp_path / "ckpt", validation)
    trainer = L.Trainer(max_epochs=7, callbacks=[validation, checkpoints], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    assert trainer.current_epoch == 5  # epochs 0-4 ran: 3 and 4 did not improve on 2
    assert validation.best_epoch == 2 and validation.best_value == 1.0
    assert checkpoints.best_path.name == "epoch=0002.ckpt"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == ["epoch=0002.ckpt", "epoch=0003.ckpt", "epoch=0004.ckpt"]
    best = torch.load(checkpoints.best_path, weights_only=True)
    assert best["state_dict"]["weight"].item() == 2.0  # the weights of epoch 2, not of the last epoch


class DivergingModule(ScriptedModule):
    """A ScriptedModule whose logged training loss turns NaN from epoch `nan_from` on."""

    def __init__(self, ranks: list[int], nan_from: int):
        super().__init__(ranks)
        self.nan_from = nan_from

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log(LOSS, float("nan") if self.current_epoch >= self.nan_from else 1.0, on_step=True)
        return loss


def test_a_run_whose_loss_turns_nan_stops_at_that_epoch_and_keeps_the_best_checkpoint(tmp_path, capsys):
    write_split(tmp_path / "data", USERS)
    module = DivergingModule(ranks=[3, 1, 5, 5, 5, 5], nan_from=2)  # diverged, it ranks the target last
    validation = Validation(tmp_path / "data", patience=10)
    checkpoints = EpochCheckpoint(tmp_path / "ckpt", validation)
    trainer = L.Trainer(max_epochs=6, callbacks=[validation, checkpoints], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module)
    assert trainer.current_epoch == 3  # epochs 0-2 ran; the NaN loss of epoch 2 stopped it
    assert "train/loss is not finite (training diverged)" in capsys.readouterr().out
    assert validation.since_best == 1 < validation.patience  # patience alone would have trained on
    assert checkpoints.best_path.name == "epoch=0001.ckpt"


def test_the_trained_model_is_the_best_validated_checkpoint_and_same_seed_runs_repeat(tmp_path):
    data = tmp_path / "data"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "40", "--out", str(data)])
    tiny = "--max-seq-len 16 --batch-size 8 --num-negatives 16 --seed 3"
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        hstu(["train", "--data-dir", str(data), "--out", str(out), "--workers", "2", "--epochs", "4", "--patience", "2",
              "--train-args", tiny])
        info = json.loads((out / "model" / "model.json").read_text())
        runs.append((out, info["metadata"]))
    (a, meta_a), (b, meta_b) = runs
    assert meta_a == meta_b and meta_a["seed"] == 3
    best = torch.load(a / "checkpoints" / meta_a["best_checkpoint"], weights_only=True)
    dense = load_file(a / "model" / "dense.safetensors")
    for name, value in dense.items():
        assert torch.equal(value, best["state_dict"][f"model.{name}"]), name
    for name, value in load_file(b / "model" / "dense.safetensors").items():
        assert torch.equal(value, dense[name]), name  # the same seed trained the same weights
    catalog = catalog_of(data)
    metrics = [evaluate_rankers({"model": HSTURanker(*model_files.load_model(o / "model")[:2], catalog)}, whole_histories(data, "valid"), catalog)
               for o in (a, b)]
    assert metrics[0] == metrics[1]
    assert metrics[0]["model"]["ndcg@10"] == meta_a["best_val_ndcg@10"]  # the restored model is the best validated one


class _Tiny(L.LightningModule):
    """A model whose steps record how many objects the garbage collector holds frozen, and
    which fails at step `fail_at` if given."""

    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.layer, self.frozen, self.fail_at = torch.nn.Linear(4, 1), [], fail_at

    def training_step(self, batch, batch_idx):
        import gc

        self.frozen.append(gc.get_freeze_count())
        if batch_idx == self.fail_at:
            raise RuntimeError("a step that fails")
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_objects_alive_when_training_starts_are_frozen_during_the_steps_and_unfrozen_after():
    """FrozenSetup: the steps run with the objects of the setup (torch's, Lightning's, the
    model's) in the collector's permanent generation, and none is left there after
    training, whether it ends or fails."""
    import gc

    import pytest
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_modules.callbacks import FrozenSetup

    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    for fail_at in (None, 1):
        model = _Tiny(fail_at)
        trainer = L.Trainer(max_steps=3, callbacks=[FrozenSetup()], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        assert gc.get_freeze_count() == 0
        if fail_at is None:
            trainer.fit(model, loader)
        else:
            with pytest.raises(RuntimeError, match="a step that fails"):
                trainer.fit(model, loader)
        assert len(model.frozen) == (3 if fail_at is None else 2)
        assert min(model.frozen) > 10_000  # the libraries' objects at least
        assert gc.get_freeze_count() == 0
