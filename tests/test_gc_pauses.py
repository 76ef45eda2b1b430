"""benchmarks/gc_pauses.py: the collector's pauses counted by generation while on, none after."""
import gc

from benchmarks.gc_pauses import GcPauses


def test_collections_are_counted_by_generation_only_while_started():
    pauses = GcPauses()
    enabled = gc.isenabled()
    gc.disable()  # only the collections made here
    try:
        pauses.start()
        for _ in range(100):  # reference cycles for the collector to find
            a = []
            a.append(a)
        gc.collect(0)
        gc.collect(1)
        gc.collect(0)
        pauses.stop()
        gc.collect(0)  # after stop: not counted
    finally:
        if enabled:
            gc.enable()
    summary = pauses.summary(steps=2)
    assert summary["collections"] == {"0": 2, "1": 1, "2": 0}
    assert summary["ms"]["0"] > 0 and summary["longest_ms"] > 0
    assert abs(summary["ms_per_step"] - sum(summary["ms"].values()) / 2) < 1e-3
