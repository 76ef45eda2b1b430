"""Rank 0's flag taken by every rank one call later (rank_zero_flag.py), on two gloo
processes: the flag itself, and the step checkpoints that rank 0's clock makes due."""
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from conftest import run_distributed

from lightning_modules.callbacks import EpochCheckpoint
from lightning_modules.rank_zero_flag import DeferredFlag

POSTS = {0: [True, False, False, True], 1: [False, True, True, False]}  # each rank's own values


def _flags(rank, world, out):
    flag = DeferredFlag(torch.device("cpu"))
    reads = []
    for value in POSTS[rank]:
        reads.append(flag.read())
        flag.post(value)
    reads.append(flag.read())
    reads.append(flag.read())  # nothing posted since: False
    Path(f"{out}.{rank}").write_text(json.dumps(reads))


def test_every_rank_reads_rank_0s_value_one_call_later(tmp_path):
    run_distributed(2, _flags, str(tmp_path / "reads"))
    want = [False, *POSTS[0], False]
    assert [json.loads(Path(f"{tmp_path / 'reads'}.{r}").read_text()) for r in range(2)] == [want, want]


def _clock_saves(rank, world, out, seconds_per_step):
    """EpochCheckpoint's per-step decision on a fake clock that moves seconds_per_step[rank]
    a step (every_minutes 1): the steps each rank saves at (a save restarts the clock)."""
    from lightning_modules import callbacks

    now = [0.0]
    callbacks.time = SimpleNamespace(monotonic=lambda: now[0])
    checkpoint = EpochCheckpoint(Path(out).parent, every_minutes=1.0)
    saved = []

    def save(trainer, module, path):
        saved.append(trainer.global_step)
        checkpoint._last_save = now[0]

    checkpoint._save = save
    trainer = SimpleNamespace(world_size=world, strategy=SimpleNamespace(root_device=torch.device("cpu")), global_step=0)
    for step in range(1, 9):
        now[0] += seconds_per_step[rank]
        trainer.global_step = step
        checkpoint.on_train_batch_end(trainer, None, None, None, step)
    Path(f"{out}.{rank}").write_text(json.dumps(saved))


def test_both_ranks_save_at_the_step_after_rank_0s_clock_says_so(tmp_path):
    """Rank 0's clock reaches a minute at step 2 and again 60 s after each save; rank 1's
    (faster) is not asked. Both save at step 3, then at step 6: the decision posted at a
    saving step comes after the save, so no rank saves twice in a row."""
    run_distributed(2, _clock_saves, str(tmp_path / "saves"), [30.0, 70.0])
    assert [json.loads(Path(f"{tmp_path / 'saves'}.{r}").read_text()) for r in range(2)] == [[3, 6], [3, 6]]


def test_one_process_saves_at_the_step_its_clock_says_so(tmp_path):
    checkpoint = EpochCheckpoint(tmp_path, every_minutes=1.0)
    saved = []
    checkpoint._save = lambda trainer, module, path: saved.append(trainer.global_step)
    trainer = SimpleNamespace(world_size=1, global_step=0)
    for step in range(1, 6):
        trainer.global_step = step
        checkpoint._clock_due = lambda: trainer.global_step == 3
        checkpoint.on_train_batch_end(trainer, None, None, None, step)
    assert saved == [3] and checkpoint._clock is None
