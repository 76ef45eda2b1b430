"""Distributed training through the CLI: 2 processes on gloo, resume, dump to one shard."""
import json
import os

import pyarrow.parquet as pq
import torch

from kernels.dynamic_embedding import read_manifest
from lightning_modules import model_files
from lightning_modules.data import Sequences
from lightning_modules.item_features import ITEMS_FILE, items_table
from benchmarks import kill_resume
from pipelines.cli import main as hstu

TINY = "--max-seq-len 16 --batch-size 8 --num-negatives 16"

# Imported by every worker (PYTHONPATH): rank 0 renames each checkpoint into place a second
# late, as on a slow file system, so that a rank which reads one before it is in place fails.
SLOW_RENAME = """
import os, time
_replace = os.replace
def _late_replace(src, dst, *args, **kwargs):
    if os.environ.get("RANK") == "0" and str(dst).endswith(".ckpt"):
        time.sleep(1)
    return _replace(src, dst, *args, **kwargs)
os.replace = _late_replace
"""


def trained_steps(train_dir) -> int:
    return json.loads((train_dir / "model" / "model.json").read_text())["metadata"]["global_step"]


def test_two_process_training_resumes_and_dumps_to_one_shard(tmp_path, capfd, monkeypatch):
    data, train = tmp_path / "data", tmp_path / "train"
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_RENAME)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path / "slow"), os.environ.get("PYTHONPATH")) if p))
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "40", "--out", str(data)])
    # genres for the synthetic items (item i: i % 3 of them), so that the genre table is
    # sharded, dumped and resumed as well
    items = Sequences(data / "train.parquet", 1).all_items().tolist()
    pq.write_table(items_table({i: [f"g{(i + k) % 5}" for k in range(i % 3)] for i in items}), data / ITEMS_FILE)
    args = TINY + " --item-features"
    hstu(["train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", "1", "--train-args", args])
    ckpts = sorted(p.name for p in (train / "checkpoints").glob("epoch=*.ckpt"))
    assert ckpts == ["epoch=0000.ckpt"]
    first = read_manifest(train / "model" / "embeddings")
    assert first["world_size"] == 2 and first["total_rows"] > 0
    assert read_manifest(train / "model" / "embeddings" / "genre")["total_rows"] == 5
    steps_one_epoch = trained_steps(train)

    capfd.readouterr()
    hstu(["train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", "2", "--train-args", args])
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
    assert read_manifest(out / "embeddings" / "genre")["world_size"] == 1
    ids = torch.cat([t1.item_table.local.export_rows()[0], torch.tensor([123456789])])
    assert t1.features is not None and torch.equal(t1.embed(ids), t2.embed(ids))
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)


def test_a_worker_killed_mid_epoch_resumes_from_the_step_checkpoint_bit_for_bit(tmp_path, capfd):
    import subprocess

    data, train = tmp_path / "data", tmp_path / "train"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "160", "--out", str(data)])
    job = subprocess.Popen(kill_resume.train_command(data, train, "--checkpoint-every 2"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    complete, _ = kill_resume.kill_one_worker(job, train / "checkpoints", mid_checkpoint=False, delay_s=0.2)
    assert not list((train / "checkpoints").glob("epoch=*.ckpt"))  # killed within the first epoch
    # the newest complete checkpoint once the job is down: the one complete at the kill, or a
    # later one that the surviving process finished writing before the job stopped
    newest = kill_resume.latest_checkpoint(train / "checkpoints")
    assert complete.name.startswith("step=") and newest.name.startswith("step=") and newest.name >= complete.name

    step, dump = kill_resume.checkpoint_state(newest)
    # the job again, stopping where it resumes: the model it writes is the resumed state
    log = kill_resume.resume_to(data, train, step)
    assert f"resuming from {newest}" in log and trained_steps(train) == step
    assert kill_resume.rows_equal_dump(train / "model", dump)  # keys, rows, optimizer state and scores, bit for bit

    # and from there the job trains to its end
    hstu(["train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", "1", "--train-args", TINY])
    assert trained_steps(train) > step and list((train / "checkpoints").glob("epoch=0000.ckpt"))


def test_a_worker_killed_during_a_checkpoint_resumes_from_the_previous_one(tmp_path):
    """The kill lands while a checkpoint is written (every step checkpoints; the worker is
    killed once a partial checkpoint shows): the interrupted one is never loaded, the one
    complete before it is, clean, with every row as it was saved, and the leftovers go."""
    data, train = tmp_path / "data", tmp_path / "train"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "160", "--out", str(data)])
    for _ in range(3):  # a kill can land just after the write it aimed at: try again
        round_ = kill_resume.one_round(data, train, mid_checkpoint=True, delay_s=0.0)
        if round_["interrupted_checkpoint"]:
            break
    assert round_["interrupted_checkpoint"], "no kill landed during a checkpoint"
    assert round_["resumed_from_complete"] and round_["resume_logged"] and round_["leftovers_removed"]
    assert round_["rows_bit_equal"]


def test_ddp_broadcasts_no_buffer_of_the_hstu_module():
    """The catalog buffer is the same on every rank: DDP, which broadcasts a module's
    buffers before every forward, leaves it out (and still syncs every weight)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_modules.config import HSTUConfig
    from lightning_modules.module import HSTULightningModule

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = HSTULightningModule(HSTUConfig(embedding_dim=8, attention_dim=4, linear_dim=4), torch.arange(1, 50))
        ddp = DistributedDataParallel(module)
        assert [name for name, _ in module.named_buffers()] == ["catalog"]
        assert ddp.modules_buffers == []
        assert {id(p) for p in ddp.parameters() if p.requires_grad} == {id(p) for p in module.model.parameters()}
    finally:
        dist.destroy_process_group()


def test_several_processes_train_under_ddp_whose_buckets_hold_the_gradients():
    """strategy_for: one process, Lightning's default; several, DDP with the gradients as
    views of its all-reduce buckets (no copy back after each all-reduce) and the options
    given. Under those options a backward leaves every weight's gradient inside DDP's
    buckets, equal to the plain gradient (one process: the average of one)."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    from lightning_modules.train import strategy_for

    assert strategy_for(1) == "auto"

    def hook(state, bucket):
        return torch.futures.Future()

    several = strategy_for(2, ddp_comm_hook=hook)
    assert isinstance(several, DDPStrategy) and several._ddp_comm_hook is hook
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model, **several._ddp_kwargs)
        for _ in range(2):  # the second after zero_grad(set_to_none=True), as training steps
            ddp(x).square().sum().backward()
            storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
            assert len(storages) < len(plain)  # views of the buckets, not tensors of their own
            for p, g in zip(model.parameters(), plain):
                torch.testing.assert_close(p.grad, g)
            model.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()
