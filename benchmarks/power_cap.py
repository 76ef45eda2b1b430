"""HSTU attention held at the GPU's power cap: the forward, and the forward + backward
replayed from a CUDA graph, each run back to back for seconds while nvidia-smi samples
the board's power, SM clock and throttle reasons; with --tilings, each configuration of
the forward, dK dV and dQ kernels pinned in turn and timed the same way.

    python benchmarks/power_cap.py [--seconds 8] [--tilings] [--batch 32] [--out FILE]

A training step keeps the GPU busy for minutes, and a board at its power limit lowers
its clocks until it draws no more: times taken by do_bench's short windows (100 ms,
started cooler) then read faster than the step sees. "back to back" is the median time of
a call over the run; power and clocks are the medians of the samples taken at
BUSY_UTILIZATION or more; a throttle reason of 0x4 is the software power cap. The shape
is benchmarks/hstu_attention.py's B N4096 H4 D128 bf16. In a --tilings row the forward
is timed for the forward's configurations, and the forward + backward (eager) for the
dK dV and dQ kernels'.
"""
import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_replay import replayed  # noqa: E402
from benchmarks.hstu_attention import inputs  # noqa: E402
from benchmarks.results_path import write_results  # noqa: E402
from kernels.autotune import config_label, tuned_to  # noqa: E402
from kernels.hstu_attention import attention_kernels, hstu_attention, score_grads  # noqa: E402

NVIDIA_SMI_QUERY = "power.draw,clocks.sm,clocks_throttle_reasons.active,utilization.gpu"
SAMPLE_PERIOD_S = 0.1
BUSY_UTILIZATION = 90  # percent: samples below it caught the GPU between runs
CALLS_PER_EVENT = 10  # calls timed between two CUDA events
HEAT_S = 3.0  # back to back before the first timed run, so that it starts at the cap
TILING_S = 2.5  # back to back per configuration with --tilings
LENGTH = 4096
HEADS, DIM = 4, 128


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class PowerSamples:
    """nvidia-smi's power, SM clock, throttle reasons and utilization, sampled every
    SAMPLE_PERIOD_S on a thread while the block runs."""

    def __enter__(self):
        self.rows, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            line = subprocess.run(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True).stdout.splitlines()[0]
            self.rows.append([field.strip() for field in line.split(",")])
            time.sleep(SAMPLE_PERIOD_S)

    def summary(self) -> dict:
        busy = [r for r in self.rows if len(r) == 4 and float(r[3]) >= BUSY_UTILIZATION]
        clocks = [float(r[1]) for r in busy]
        return {"busy_samples": len(busy), "samples": len(self.rows), "power_w": _median([float(r[0]) for r in busy]),
                "sm_mhz": _median(clocks), "sm_mhz_least": min(clocks, default=None),
                "throttle_reasons": sorted({r[2] for r in busy})}


def back_to_back(fn, seconds: float) -> float:
    """The median ms of a call of fn, called back to back for `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, t0 = [], time.time()
    while time.time() - t0 < seconds:
        start.record()
        for _ in range(CALLS_PER_EVENT):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_EVENT)
    return _median(times)


def timed(name: str, fn, seconds: float, **extra) -> dict:
    with PowerSamples() as power:
        hot = back_to_back(fn, seconds)
    return {"run": name, **extra, "back_to_back_ms": hot, "do_bench_ms": do_bench(fn, warmup=5, rep=100, return_mode="median"),
            **power.summary()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0, help="back to back per run (the two default runs)")
    p.add_argument("--tilings", action="store_true", help="also each configuration of the forward, dK dV and dQ kernels")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", help="JSON path (default benchmarks/results/power_cap_<device>.json)")
    args = p.parse_args()

    (q, k, v), offsets, timestamps, position_bias, time_bias, _ = inputs(args.batch, LENGTH, HEADS, DIM)
    grad = torch.randn_like(q)
    leaves = (q, k, v, position_bias, time_bias)

    def forward():
        return hstu_attention(q, k, v, offsets, timestamps, position_bias, time_bias, LENGTH, backend="triton")

    def step():
        return torch.autograd.grad(forward(), leaves, grad)

    step()  # (tunes every kernel)
    back_to_back(step, HEAT_S)
    rows = [timed("forward", forward, args.seconds), timed("forward + backward, replayed", replayed(step), args.seconds)]
    if args.tilings:
        kernels = [("forward", attention_kernels._forward, attention_kernels.CONFIGS, forward),
                   ("dK dV", attention_kernels._backward_kv, attention_kernels.CONFIGS, step),
                   ("dQ", score_grads._dq, score_grads.DQ_CONFIGS, step)]
        for name, kernel, configs, fn in kernels:
            picked = {str(config) for config in kernel.chosen.values()}
            for config in configs:
                with tuned_to((kernel, config)):
                    fn()  # (compiles it)
                    rows.append(timed(name, fn, TILING_S, config=config_label(config), picked=str(config) in picked))
    print(f"{'run':30} {'config':36} {'back to back':>12} {'do_bench':>9} {'W':>6} {'MHz':>6}")
    for r in rows:
        config = r.get("config", "") + (" (picked)" if r.get("picked") else "")
        print(f"{r['run']:30} {config:36} {r['back_to_back_ms']:12.3f} {r['do_bench_ms']:9.3f} {r['power_w'] or 0:6.0f} "
              f"{r['sm_mhz'] or 0:6.0f}")
    write_results("power_cap", rows, args.out, batch=args.batch, shape=f"B{args.batch} N{LENGTH} H{HEADS} D{DIM} bf16")


if __name__ == "__main__":
    main()
