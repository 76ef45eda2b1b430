"""benchmarks/trace_summary.py on a small Chrome trace written by hand: kernels per step,
busy time as the union of kernels on two streams and a copy, and the idle gaps with the
host call that held the host during each."""
import json

import pytest

from benchmarks import trace_summary


def event(name, ts, dur, cat="kernel", tid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


EVENTS = [
    # step 1: a, then b on one stream overlapping c on another; a gap the host spent in a
    # synchronize; then a
    event("a", 0, 10), event("b", 12, 8), event("c", 15, 10, tid=8),
    event("cudaLaunchKernel", 24, 3, cat="cuda_runtime", tid=1),
    event("cudaStreamSynchronize", 30, 68, cat="cuda_runtime", tid=1),
    event("a", 100, 10),
    # step 2: a, a gap with no host call (the host's own work), a copy, b
    event("a", 200, 10), event("Memcpy HtoD (Pinned -> Device)", 225, 5, cat="gpu_memcpy", tid=9), event("b", 250, 20),
    {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5},  # (not a complete event: ignored)
    event("aten::mm", 0, 300, cat="cpu_op", tid=1),  # (not a kernel: ignored)
]


def test_kernels_busy_time_and_gaps_per_step():
    s = trace_summary.summarize(EVENTS, steps=2)
    assert s["kernels_per_step"] == 3.5
    assert {k["kernel"]: (k["ms_per_step"], k["launches_per_step"]) for k in s["kernels"]} == {
        "a": (0.015, 1.5), "b": (0.014, 1.0), "c": (0.005, 0.5), "Memcpy HtoD (Pinned -> Device)": (0.0025, 0.5),
    }
    assert s["kernels"][0]["kernel"] == "a"  # by time, longest first
    # busy: [0, 10] + [12, 25] + [100, 110] + [200, 210] + [225, 230] + [250, 270] = 68 µs; kernel time 73
    assert s["busy_ms_per_step"] == pytest.approx(0.034) and s["kernel_ms_per_step"] == pytest.approx(0.0365)
    assert s["window_ms_per_step"] == pytest.approx(0.135)
    # gaps of 5 µs or more: 75 (25-100), 90 (110-200), 15 (210-225), 20 (230-250); the 2 µs
    # one is spacing
    copy = "Memcpy HtoD (Pinned -> Device)"
    assert [(g["us"], g["after_kernel"], g["before_kernel"]) for g in s["longest_gaps"]] == [
        (90, "a", "a"), (75, "c", "a"), (20, copy, "b"), (15, "a", copy),
    ]
    assert s["idle_ms_per_step"] == pytest.approx(0.1)
    held = {g["us"]: (g["host_call"], g["host_call_overlap_us"]) for g in s["longest_gaps"]}
    assert held == {75: ("cudaStreamSynchronize", 68), 90: (None, 0.0), 20: (None, 0.0), 15: (None, 0.0)}
    # a higher floor keeps the longer gaps alone, and the summary says which floor it used
    coarse = trace_summary.summarize(EVENTS, steps=2, min_gap_us=18)
    assert coarse["min_gap_us"] == 18 and [g["us"] for g in coarse["longest_gaps"]] == [90, 75, 20]


def test_the_command_line_writes_the_summary_and_refuses_a_trace_without_kernels(tmp_path, capsys):
    trace, out = tmp_path / "trace.json", tmp_path / "summary.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    trace_summary.main([str(trace), "--steps", "2", "--top", "2", "--out", str(out)])
    written = json.loads(out.read_text())
    assert [k["kernel"] for k in written["kernels"]] == ["a", "b"] and len(written["longest_gaps"]) == 2
    assert "cudaStreamSynchronize (68)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no GPU kernels or copies"):
        trace_summary.summarize([e for e in EVENTS if e["cat"] not in ("kernel", "gpu_memcpy")], steps=1)


def test_idle_gaps_are_charged_to_the_host_ops_around_the_next_launch():
    """Each gap goes to the CPU ops open at the call that launched the work after it (by
    correlation id), outermost first; launches outside every op and work launched by no
    call in the trace get their own rows."""
    def launched(name, ts, dur, correlation, cat="kernel", tid=7):
        return dict(event(name, ts, dur, cat, tid), args={"correlation": correlation})

    events = [
        launched("a", 0, 10, 1),
        event("step", 5, 200, cat="cpu_op", tid=1), event("attention", 20, 30, cat="cpu_op", tid=1),
        event("prepass", 25, 10, cat="cpu_op", tid=1), event("aten::empty", 55, 5, cat="cpu_op", tid=1),
        launched("cudaLaunchKernel", 30, 2, 2, cat="cuda_runtime", tid=1),
        launched("b", 40, 10, 2),  # 30 µs after a: launched inside step > attention > prepass
        launched("cudaLaunchKernel", 70, 2, 3, cat="cuda_runtime", tid=1),
        launched("c", 80, 10, 3),  # 30 µs after b: inside step alone (attention had ended)
        launched("cudaLaunchKernel", 300, 2, 4, cat="cuda_runtime", tid=1),
        launched("d", 310, 10, 4),  # 220 µs after c: outside every op
        launched("e", 330, 10, 99),  # 10 µs after d: no call carries its correlation
        launched("f", 342, 3, 98),  # 2 µs after e: spacing, not a gap
    ]
    summary = trace_summary.summarize(events, steps=2)
    rows = {r["host_ops"]: (r["us_per_step"], r["gaps_per_step"]) for r in summary["idle_by_host_op"]}
    assert rows == {
        "(no op)": (110, 0.5), "step > attention > prepass": (15, 0.5), "step": (15, 0.5),
        "(launch not in the trace)": (5, 0.5),
    }
    # every gap is charged once: the rows sum to the idle time
    assert sum(us for us, _ in rows.values()) == pytest.approx(1000 * summary["idle_ms_per_step"])
