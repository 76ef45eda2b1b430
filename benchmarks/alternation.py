"""One setting switched between values in blocks of steps within one training run, and the
steps' times per value: an A/B whose arms share the process, the machine's state and the
data stream, for differences smaller than what separates two processes (about a
millisecond at `hstu-long`: benchmarks/train_throughput.md).

    python benchmarks/train_throughput.py --preset hstu-long --steps 120 --warmup 60 --compile-blocks \\
        --alternate kernels.hstu_attention.triton_kernels.REUSE_BATCH_EXTREMES=True,False

A setting is a module attribute that the code reads when it runs, outside torch.compile (a
compiled function keeps the value it was traced with, or recompiles). The values take turns
every `every` steps from the first step on, so the warmup runs, and compiles, each of them.
A block's first step is left out of its value's figures: its host work overlapped the last
block's GPU work.
"""
import ast
import contextlib
import importlib
from dataclasses import dataclass

import numpy as np

ALTERNATE_EVERY = 5  # steps a value holds before the next takes over


@dataclass(frozen=True)
class Alternation:
    module: str
    attribute: str
    values: tuple
    every: int = ALTERNATE_EVERY

    @classmethod
    def parse(cls, spec: str, every: int = ALTERNATE_EVERY) -> "Alternation":
        """From "MODULE.ATTRIBUTE=V1,V2[,...]", each value a Python literal."""
        target, sep, values = spec.partition("=")
        module, _, attribute = target.rpartition(".")
        if not (sep and module and attribute and values):
            raise ValueError(f"--alternate {spec!r}: expected MODULE.ATTRIBUTE=V1,V2")
        try:
            parsed = tuple(ast.literal_eval(v.strip()) for v in values.split(","))
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"--alternate {spec!r}: the values must be Python literals ({e})") from None
        if len(parsed) < 2:
            raise ValueError(f"--alternate {spec!r}: at least two values")
        if every < 2:
            raise ValueError(f"--alternate-every must be at least 2 (a block's first step is not counted), got {every}")
        if not hasattr(importlib.import_module(module), attribute):
            raise ValueError(f"--alternate {spec!r}: {module} has no attribute {attribute!r}")
        return cls(module, attribute, parsed, every)

    def arm(self, step: int) -> int:
        """The index of the value that step (0: the run's first) runs with."""
        return (step // self.every) % len(self.values)

    def apply(self, step: int) -> None:
        """Sets the attribute to the value of `step`."""
        setattr(importlib.import_module(self.module), self.attribute, self.values[self.arm(step)])

    @contextlib.contextmanager
    def restoring(self):
        """The attribute's value as it was on entry, set again on leaving (a run leaves the
        setting as it found it)."""
        module = importlib.import_module(self.module)
        before = getattr(module, self.attribute)
        try:
            yield
        finally:
            setattr(module, self.attribute, before)

    def summary(self, first_step: int, times_ms: list[float]) -> dict:
        """Per value, the counted steps' times (times_ms[i]: step first_step + i's): their
        count, median and mean in ms, and the times themselves in step order."""
        arms = [[] for _ in self.values]
        for i, t in enumerate(times_ms):
            step = first_step + i
            if step % self.every:  # (a block's first step is not counted)
                arms[self.arm(step)].append(t)
        return {
            "setting": f"{self.module}.{self.attribute}", "every": self.every,
            "values": [
                {"value": repr(v), "steps": len(a), "median_ms": float(np.median(a)) if a else None,
                 "mean_ms": float(np.mean(a)) if a else None, "steps_ms": [float(t) for t in a]}
                for v, a in zip(self.values, arms)
            ],
        }
