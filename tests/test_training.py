"""Distributed training through the CLI: 2 processes on gloo, resume, dump to one shard."""
import json

import pyarrow.parquet as pq
import torch

from kernels.dynamic_embedding import read_manifest
from lightning_modules import model_files
from lightning_modules.data import Sequences
from lightning_modules.item_features import ITEMS_FILE, items_table
from pipelines.cli import main as hstu

TINY = "--max-seq-len 16 --batch-size 8 --num-negatives 16"


def trained_steps(train_dir) -> int:
    return json.loads((train_dir / "model" / "model.json").read_text())["metadata"]["global_step"]


def test_two_process_training_resumes_and_dumps_to_one_shard(tmp_path, capfd):
    data, train = tmp_path / "data", tmp_path / "train"
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


def _descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc)."""
    import os

    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        children = [c for c, parent in parents.items() if parent == p]
        out += children
        frontier += children
    return out


def test_a_worker_killed_mid_epoch_resumes_from_the_step_checkpoint_bit_for_bit(tmp_path, capfd):
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from kernels.dynamic_embedding import ShardedDynamicEmbedding, load
    from lightning_modules.config import HSTUConfig

    data, train = tmp_path / "data", tmp_path / "train"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "160", "--out", str(data)])
    command = [shutil.which("hstu", path=os.path.dirname(sys.executable)), "train", "--data-dir", str(data), "--out", str(train),
               "--workers", "2", "--epochs", "1", "--train-args", TINY + " --checkpoint-every 2"]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list((train / "checkpoints").glob("step=*.ckpt")):
        assert job.poll() is None and time.monotonic() < deadline, "no step checkpoint was written"
        time.sleep(0.05)
    workers = [p for p in _descendants(job.pid) if b"lightning_modules.train" in open(f"/proc/{p}/cmdline", "rb").read()
               and b"torchrun" not in open(f"/proc/{p}/cmdline", "rb").read()]
    os.kill(workers[-1], signal.SIGKILL)  # one of the two training processes, mid-epoch
    assert job.wait(timeout=120) != 0
    assert not list((train / "checkpoints").glob("epoch=*.ckpt"))  # killed within the first epoch

    ckpt = max((train / "checkpoints").glob("step=*.ckpt"))
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    step, dump = state["global_step"], train / "checkpoints" / state["embedding_dump"]
    # the job again, stopping where it resumes: the model it writes is the resumed state
    capfd.readouterr()
    hstu(["train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", "1",
          "--train-args", TINY + f" --max-steps {step}"])
    captured = capfd.readouterr()
    assert f"resuming from {ckpt}" in captured.out + captured.err
    assert trained_steps(train) == step
    _, items, info = model_files.load_model(train / "model")
    saved = ShardedDynamicEmbedding(HSTUConfig.from_dict(info["config"]).embedding_config())
    load(saved, dump)
    resumed = items.item_table.local.export_rows()
    at_checkpoint = saved.local.export_rows()
    a, b = resumed[0].argsort(), at_checkpoint[0].argsort()
    assert resumed[0].numel() > 0
    for x, y in zip(resumed, at_checkpoint):
        assert torch.equal(x[a], y[b])  # keys, rows, optimizer state and scores, bit for bit

    # and from there the job trains to its end
    hstu(["train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", "1", "--train-args", TINY])
    assert trained_steps(train) > step and list((train / "checkpoints").glob("epoch=0000.ckpt"))
