"""benchmarks/host_sections.py: sections timed only while the window is open, nested
sections each with their own time, inherited methods wrapped and unwrapped, missing ones
skipped."""
import time

from benchmarks.host_sections import HostSections

PAUSE_S = 0.01


class Base:
    def inherited(self) -> str:
        return "base"


class Worker(Base):
    def outer(self, x: int) -> int:
        time.sleep(PAUSE_S)
        return self.inner(x) + 1

    def inner(self, x: int) -> int:
        time.sleep(PAUSE_S)
        return 2 * x


def test_sections_time_the_window_and_restore_what_they_wrapped():
    here = __name__
    sections = HostSections((
        (here, "Worker.outer", "outer"), (here, "Worker.inner", "inner"), (here, "Worker.inherited", "inherited"),
        (here, "Worker.missing", "missing"), ("no_such_module", "f", "nowhere"),
    ))
    assert sections.labels == ["outer", "inner", "inherited"]
    w = Worker()
    assert w.outer(3) == 7  # before the window: not counted
    sections.start()
    for _ in range(2):
        assert w.outer(3) == 7 and w.inherited() == "base"
    sections.stop()
    w.outer(3)
    per_step = sections.per_step(2)
    assert sections.calls == {"outer": 2, "inner": 2, "inherited": 2}
    assert per_step["outer"] >= 2 * 1000 * PAUSE_S and per_step["inner"] >= 1000 * PAUSE_S
    assert per_step["outer"] > per_step["inner"]  # the outer section includes the inner one
    sections.restore()
    assert "inherited" not in vars(Worker) and Worker.inherited is Base.inherited
    assert Worker.outer.__name__ == "outer" and not hasattr(Worker.outer, "__wrapped__")
