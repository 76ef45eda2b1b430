"""What a profiled run's GPU did, from torch.profiler's Chrome trace: the time of each kernel
(and copy and memset) per step, how long the GPU was busy, and where it sat idle.

    python benchmarks/trace_summary.py TRACE.json --steps N [--top 30] [--out FILE]

`train_throughput.py --profile DIR` writes such traces (DIR/<preset>.json, the timed steps
only) and adds this summary to its JSON row.

- kernels: each kernel's, copy's or memset's name, total duration and count, divided by
  the steps;
- busy: the union of their intervals (work overlapping on several streams counts once),
  per step; kernel time: their durations summed, per step;
- idle: the gaps between the busy intervals from the first kernel's start to the last's end,
  per step, and the longest gaps, each with the kernels on either side and the CUDA runtime
  or driver call that overlapped it most (a wait such as cudaStreamSynchronize or a
  device-to-host copy names what held the host while the GPU drained; none, or a launch,
  says the host was busy with its own work);
- idle by host op: each gap charged to the CPU ops (torch's operators, autograd Functions,
  compiled regions) around the host call that launched the work after it, outermost first:
  what the host was doing when the GPU ran dry, summed per step.
"""
import argparse
import bisect
import json
from collections import Counter
from itertools import accumulate
from pathlib import Path

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of GPU activity
HOST_CALLS = ("cuda_runtime", "cuda_driver")  # the trace's categories of CUDA API calls
MIN_GAP_US = 5.0  # shorter gaps are the launch-to-launch spacing of a queued stream
HOST_OP_DEPTH = 4  # enclosing CPU ops named per gap, outermost first


def _intervals(events: list[dict], categories: tuple) -> list[tuple[float, float, str, int | None]]:
    """(start, end, name, correlation id or None) of the complete events of those
    categories, by start (then end and name)."""
    return sorted(
        ((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
         for e in events if e.get("ph") == "X" and e.get("cat") in categories),
        key=lambda x: x[:3],
    )


def busy_spans(kernels: list[tuple[float, float, str, int | None]]) -> list[tuple[float, float, str, str, int | None]]:
    """The union of kernel intervals (start-sorted): (start, end, first kernel, last kernel,
    the first kernel's correlation id)."""
    spans = []
    for start, end, name, correlation in kernels:
        if spans and start <= spans[-1][1]:
            s, e, first, last, first_correlation = spans[-1]
            spans[-1] = (s, max(e, end), first, name if end >= e else last, first_correlation)
        else:
            spans.append((start, end, name, name, correlation))
    return spans


def summarize(events: list[dict], steps: int, top: int = 30, min_gap_us: float = MIN_GAP_US) -> dict:
    """The summary of a trace's events over `steps` steps (times in ms per step)."""
    kernels = _intervals(events, DEVICE_WORK)
    if not kernels:
        raise ValueError("the trace has no GPU kernels or copies (a CPU run, or a profile without CUDA activity)")
    total, count = Counter(), Counter()
    for start, end, name, _ in kernels:
        total[name] += end - start
        count[name] += 1
    spans = busy_spans(kernels)
    calls = _intervals(events, HOST_CALLS)
    starts = [c[0] for c in calls]
    ends_so_far = list(accumulate((c[1] for c in calls), max))  # the latest end among calls[:i + 1]
    gaps, launched = [], []  # (launched: each gap's µs, the correlation id of the work after it)
    for (_, gap_start, _, before, _), (gap_end, _, after, _, correlation) in zip(spans, spans[1:]):
        if gap_end - gap_start < min_gap_us:
            continue
        overlap = {}
        # the calls that may overlap the gap: from the first whose predecessors' ends reach past
        # its start, to the last that starts before its end
        for s, e, name, _ in calls[bisect.bisect_right(ends_so_far, gap_start):bisect.bisect_left(starts, gap_end)]:
            shared = min(e, gap_end) - max(s, gap_start)
            if shared > overlap.get(name, 0):
                overlap[name] = shared
        host = max(overlap, key=overlap.get) if overlap else None
        gaps.append({"us": gap_end - gap_start, "after_kernel": before, "before_kernel": after, "host_call": host,
                     "host_call_overlap_us": overlap.get(host, 0.0)})
        launched.append((gap_end - gap_start, correlation))
    per_step = 1000.0 * steps
    return {
        "steps": steps,
        "min_gap_us": min_gap_us,
        "kernels_per_step": len(kernels) / steps,
        "busy_ms_per_step": sum(e - s for s, e, *_ in spans) / per_step,
        "kernel_ms_per_step": sum(total.values()) / per_step,
        "window_ms_per_step": (spans[-1][1] - spans[0][0]) / per_step,
        "idle_ms_per_step": sum(g["us"] for g in gaps) / per_step,
        "kernels": [{"kernel": name, "ms_per_step": t / per_step, "launches_per_step": count[name] / steps}
                    for name, t in total.most_common(top)],
        "longest_gaps": sorted(gaps, key=lambda g: -g["us"])[:top],
        "idle_by_host_op": idle_by_host_op(events, launched, steps, top),
    }


def idle_by_host_op(events: list[dict], launched: list[tuple[float, int | None]], steps: int, top: int = 30) -> list[dict]:
    """The idle gaps (µs, the correlation id of the work after each), each charged to the
    CPU ops open (on the launching thread) at the host call that launched that work: per
    chain of ops (outermost first, HOST_OP_DEPTH of them), µs and gaps per step, most
    first. "(launch not in the trace)" where no call carries the work's correlation id,
    "(no op)" where the call was outside every CPU op."""
    launches = {c: (e["tid"], e["ts"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in HOST_CALLS and (c := e.get("args", {}).get("correlation")) is not None}
    ops: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ops.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    gaps = [(us, launches.get(correlation)) for us, correlation in launched]
    chains = _open_ops(ops, [launch for _, launch in gaps if launch is not None])
    us, count = Counter(), Counter()
    for gap, launch in gaps:
        key = "(launch not in the trace)" if launch is None else " > ".join(chains[launch][:HOST_OP_DEPTH]) or "(no op)"
        us[key] += gap
        count[key] += 1
    return [{"host_ops": key, "us_per_step": t / steps, "gaps_per_step": count[key] / steps} for key, t in us.most_common(top)]


def _open_ops(ops: dict, points: list[tuple]) -> dict:
    """For each (thread, time) of points: the names of that thread's CPU ops open at that
    time, outermost first (ops on a thread nest: one sweep per thread, a stack of open ops)."""
    open_at = {}
    for tid in {tid for tid, _ in points}:
        spans, i, stack = sorted(ops.get(tid, [])), 0, []
        for t in sorted({t for p_tid, t in points if p_tid == tid}):
            while i < len(spans) and spans[i][0] <= t:
                while stack and stack[-1][1] < spans[i][0]:
                    stack.pop()
                stack.append(spans[i])
                i += 1
            while stack and stack[-1][1] < t:
                stack.pop()
            open_at[tid, t] = [name for _, end, name in stack if end >= t]
    return open_at


def load_events(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text())["traceEvents"]


def print_summary(s: dict, width: int = 110) -> None:
    print(f"{s['kernels_per_step']:.0f} kernels a step; GPU busy {s['busy_ms_per_step']:.2f} ms of a "
          f"{s['window_ms_per_step']:.2f} ms window a step (kernel time {s['kernel_ms_per_step']:.2f}), "
          f"idle {s['idle_ms_per_step']:.2f} ms in gaps of {s['min_gap_us']:g} µs or more")
    print(f"\n{'ms/step':>9}{'launches':>10}  kernel")
    for k in s["kernels"]:
        print(f"{k['ms_per_step']:>9.3f}{k['launches_per_step']:>10.1f}  {k['kernel'][:width]}")
    print(f"\n{'gap µs':>9}  {'host call (µs of it)':<34}  between kernels")
    for g in s["longest_gaps"]:
        host = f"{g['host_call']} ({g['host_call_overlap_us']:.0f})" if g["host_call"] else "-"
        print(f"{g['us']:>9.1f}  {host[:34]:<34}  {g['after_kernel'][:40]} → {g['before_kernel'][:40]}")
    print(f"\n{'µs/step':>9}{'gaps':>7}  the host ops around the launch after each gap (outermost first)")
    for g in s["idle_by_host_op"]:
        print(f"{g['us_per_step']:>9.1f}{g['gaps_per_step']:>7.1f}  {g['host_ops'][:width]}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, required=True, help="the steps the trace covers")
    p.add_argument("--top", type=int, default=30, help="kernels and gaps listed")
    p.add_argument("--out", help="write the summary as JSON here")
    args = p.parse_args(argv)
    s = summarize(load_events(args.trace), args.steps, args.top)
    print_summary(s)
    if args.out:
        Path(args.out).write_text(json.dumps(s, indent=2))
    return s


if __name__ == "__main__":
    main()
