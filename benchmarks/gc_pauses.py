"""The garbage collector's pauses over a window of training steps: how many collections
of each generation ran and how long they held the host (gc.callbacks, on while started).

A collection stops the Python thread that triggered it; in a training process that is
the thread launching the step, so a long one is a late step, and under several processes
every rank's late step at the next collective. lightning_modules.callbacks.FrozenSetup
keeps the objects of the setup out of the collections; this shows what is left.
"""
import gc
import time

GENERATIONS = (0, 1, 2)


class GcPauses:
    def __init__(self):
        self.count = dict.fromkeys(GENERATIONS, 0)
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self.longest = 0.0
        self._began = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            pause = time.perf_counter() - self._began
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += pause
            self.longest = max(self.longest, pause)
            self._began = None

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self, steps: int) -> dict:
        """{generation: collections, ms in all}, the longest pause and the ms per step."""
        return {
            "collections": {str(g): self.count[g] for g in GENERATIONS},
            "ms": {str(g): round(1000 * self.seconds[g], 3) for g in GENERATIONS},
            "longest_ms": round(1000 * self.longest, 3),
            "ms_per_step": round(1000 * sum(self.seconds.values()) / max(steps, 1), 4),
        }
