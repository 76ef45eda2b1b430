"""Distributed training through the CLI: 2 processes on gloo, resume, dump to one shard."""
import json

import torch

from kernels.dynamic_embedding import read_manifest
from lightning_modules import model_files
from pipelines.cli import main as hstu

TINY = "--max-seq-len 16 --batch-size 8 --num-negatives 16"


def trained_steps(train_dir) -> int:
    return json.loads((train_dir / "model" / "model.json").read_text())["metadata"]["global_step"]


def test_two_process_training_resumes_and_dumps_to_one_shard(tmp_path, capfd):
    data, train = tmp_path / "data", tmp_path / "train"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "40", "--out", str(data)])
    hstu(["train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", "1", "--train-args", TINY])
    ckpts = sorted(p.name for p in (train / "checkpoints").glob("epoch=*.ckpt"))
    assert ckpts == ["epoch=0000.ckpt"]
    first = read_manifest(train / "model" / "embeddings")
    assert first["world_size"] == 2 and first["total_rows"] > 0
    steps_one_epoch = trained_steps(train)

    capfd.readouterr()
    hstu(["train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", "2", "--train-args", TINY])
    captured = capfd.readouterr()
    assert "resuming from" in captured.out + captured.err
    again = read_manifest(train / "model" / "embeddings")
    assert trained_steps(train) == 2 * steps_one_epoch  # the second run trained one more epoch, not two
    assert sorted(p.name for p in (train / "checkpoints").glob("epoch=*.ckpt")) == ["epoch=0000.ckpt", "epoch=0001.ckpt"]

    out = tmp_path / "model"
    hstu(["dump", "--train-dir", str(train), "--out", str(out)])
    single = read_manifest(out / "embeddings")
    assert single["world_size"] == 1 and single["total_rows"] == again["total_rows"]
    m2, t2, _ = model_files.load_model(train / "model")
    m1, t1, _ = model_files.load_model(out)
    ids = torch.cat([t1.local.export_rows()[0], torch.tensor([123456789])])
    assert torch.equal(t1.lookup(ids, train=False), t2.lookup(ids, train=False))
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
