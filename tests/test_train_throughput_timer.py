"""benchmarks/train_throughput.py's step timer on a CPU: the window's time and each timed
step's own time, from the steps' ends as Lightning reports them; a setting alternated
between values within the run (benchmarks/alternation.py)."""
import statistics
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch

from benchmarks.alternation import Alternation
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


def test_an_alternated_setting_takes_turns_and_each_value_gets_its_steps_times(monkeypatch):
    """The setting changes every `every` steps from the first (the warmup runs each value);
    each value's figures are the timed steps it ran, but the first of each block."""
    setting = types.ModuleType("alternated_setting")
    setting.SLOW = False
    monkeypatch.setitem(sys.modules, "alternated_setting", setting)
    alternation = Alternation.parse("alternated_setting.SLOW=False,True", every=3)
    timer = StepTimer(warmup=2, device="cpu", alternation=alternation)
    trainer = SimpleNamespace(global_step=0, max_steps=14)
    batch = {"input_offsets": torch.tensor([0, 3, 5])}
    seen = []
    for step in range(14):  # the batch of global step `step`, then its end
        trainer.global_step = step
        timer.on_train_batch_start(trainer, None, batch, step)
        seen.append(setting.SLOW)
        time.sleep(0.012 if setting.SLOW else 0.001)
        trainer.global_step = step + 1
        timer.on_train_batch_end(trainer, None, None, batch, step)
    assert seen == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3 + [False] * 2
    summary = alternation.summary(2, timer.step_times_ms())  # timed: steps 2 .. 13
    fast, slow = summary["values"]
    # steps 2, 7, 8, 13 (False) and 4, 5, 10, 11 (True): 3, 6, 9 and 12 open a block
    assert (fast["value"], fast["steps"], slow["value"], slow["steps"]) == ("False", 4, "True", 4)
    assert slow["median_ms"] > 10 > fast["median_ms"]
    for value in (fast, slow):  # the counted steps' own times, in step order
        assert len(value["steps_ms"]) == value["steps"] and statistics.median(value["steps_ms"]) == pytest.approx(value["median_ms"])
    with alternation.restoring():  # (a run puts the setting back as it found it)
        alternation.apply(3)
        assert setting.SLOW is True
    assert setting.SLOW is False


@pytest.mark.parametrize("spec", ["SLOW=1,2", "alternated_setting.SLOW=1", "alternated_setting.SLOW=fast,slow",
                                  "alternated_setting.MISSING=1,2"])
def test_bad_alternations_are_refused_with_the_problem_named(monkeypatch, spec):
    setting = types.ModuleType("alternated_setting")
    setting.SLOW = False
    monkeypatch.setitem(sys.modules, "alternated_setting", setting)
    with pytest.raises(ValueError, match="--alternate"):
        Alternation.parse(spec)
