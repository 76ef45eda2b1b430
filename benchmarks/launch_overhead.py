"""Host time of the table's calls with kernels launched by kernels.launch or by Triton.

    python benchmarks/launch_overhead.py

Per call (dim 64, 1,048,576 keys, a table of 4M rows at max capacity, fast mode, no
victims returned): the median host time to issue the call while the GPU is kept busy
(nothing waits), and the median wall time from the call to a synchronize after it (as
benchmarks/hash_table.py times), launching through kernels.launch (DIRECT) and through
Triton's own launch. The two launch modes alternate in blocks of calls.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels import launch  # noqa: E402
from kernels.dynamic_embedding.triton_table import TritonHashTable  # noqa: E402

DIM, CAPACITY, BATCH = 64, 1 << 22, 1 << 20
ROUNDS, CALLS = 6, 40  # per round and mode: CALLS host timings, CALLS // 4 wall timings


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = TritonHashTable(DIM, capacity=CAPACITY, max_capacity=CAPACITY, bucket_size=128, device="cuda", deterministic=False)
    for _ in range(4):
        keys = torch.randint(-(2**62), 2**62, (BATCH,), device="cuda", generator=gen)
        table.insert_or_assign(keys, torch.randn(BATCH, DIM, device="cuda", generator=gen), torch.zeros_like(keys))
    keys = torch.randint(-(2**62), 2**62, (BATCH,), device="cuda", generator=gen)
    rows, out, scores = torch.randn(BATCH, DIM, device="cuda", generator=gen), torch.empty(BATCH, DIM, device="cuda"), torch.ones_like(keys)
    ops = {
        "find_values": lambda: table.find_values(keys, out),
        "find_or_insert_values": lambda: table.find_or_insert_values(keys, scores, out, return_evicted=False),
        "insert_or_assign": lambda: table.insert_or_assign(keys, rows, scores, return_evicted=False),
    }
    times = {(op, mode, kind): [] for op in ops for mode in (True, False) for kind in ("host", "wall")}
    for _ in range(ROUNDS):
        for mode in (True, False):
            launch.DIRECT = mode
            for op, call in ops.items():
                call()  # compiles, fills the launch cache
                for i in range(CALLS):
                    if i % 20 == 0:
                        torch.cuda.synchronize()
                        torch.cuda._sleep(100_000_000)  # the GPU stays busy: issuing never waits
                    start = time.perf_counter()
                    call()
                    times[op, mode, "host"].append(time.perf_counter() - start)
                for _ in range(CALLS // 4):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    call()
                    torch.cuda.synchronize()
                    times[op, mode, "wall"].append(time.perf_counter() - start)
    launch.DIRECT = True
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1e6  # noqa: E731
    results = [
        {"op": op, "launch": "kernels.launch" if mode else "triton", "host_us": median(times[op, mode, "host"]),
         "wall_us": median(times[op, mode, "wall"])}
        for op in ops for mode in (True, False)
    ]
    print(f"\n{torch.cuda.get_device_name()}, dim {DIM}, {BATCH} keys per call, medians (us)")
    print(f"{'op':<24}{'launch':<16}{'host':>8}{'wall':>8}")
    for r in results:
        print(f"{r['op']:<24}{r['launch']:<16}{r['host_us']:>8.1f}{r['wall_us']:>8.1f}")
    write_results(
        "launch_overhead", results, None, dim=DIM, capacity=CAPACITY, batch=BATCH, rounds=ROUNDS, calls=CALLS,
        timing="host: issuing the call with the GPU busy; wall: call to a synchronize after it",
    )


if __name__ == "__main__":
    main()
