"""benchmarks/train_throughput.py's step timer on a CPU: the window's time and each timed
step's own time, from the steps' ends as Lightning reports them."""
import time
from types import SimpleNamespace

import torch

from benchmarks.train_throughput import StepTimer, step_spread


def test_each_timed_step_has_its_own_time_and_the_slow_one_is_named():
    timer = StepTimer(warmup=2, device="cpu")
    sleeps = {3: 0.002, 4: 0.002, 5: 0.030, 6: 0.002}  # the step -> how long it takes
    trainer = SimpleNamespace(global_step=0, max_steps=6)
    batch = {"input_offsets": torch.tensor([0, 3, 5])}
    for step in range(1, 7):
        time.sleep(sleeps.get(step, 0.0))
        trainer.global_step = step
        timer.on_train_batch_end(trainer, None, None, batch, step - 1)
    times = timer.step_times_ms()
    assert timer.steps == len(times) == 4  # steps 3-6, after the warmup's 2
    assert abs(sum(times) - 1000 * timer.elapsed) < 1.0  # the steps fill the window
    spread = step_spread(times)
    assert spread["slowest_step"] == 2 and spread["max"] >= 30 and spread["median"] < 30
    assert [len(x) for x in timer.input_lengths()] == [2] * 4
