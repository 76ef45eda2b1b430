"""Where a training run's host threads spend their time, from py-spy's samples: per thread,
its functions' time per step, with their callees (inclusive) and on their own (the
sampled frame: a line calling into C, such as a launch or an allocation, is its own).

    py-spy record -r 200 --nonblocking --threads --idle -f raw -o SAMPLES.txt -- \\
        python benchmarks/train_throughput.py --preset hstu-long --steps 300 --warmup 60 --compile-blocks
    python benchmarks/host_samples.py SAMPLES.txt --steps 360 --rate 200 --within training_step
    python benchmarks/host_samples.py SAMPLES.txt --steps 360 --rate 200 --threads 4

py-spy (a wheel carried to the device: py-spy's README) samples the process from outside,
so the steps run at their own speed, unlike under cProfile (`train_throughput.py
--host-profile`), whose per-call cost is of the order of the step. --steps is every step
the run made, warmup included: samples cannot tell them apart, so the figures are means
over the run; the samples in compilation and autotuning (COMPILING frames) are left out,
which leaves the warmup's steps little else. CUDA's backward runs on autograd's own
thread, which py-spy names by number: the main thread waits in Tensor.backward meanwhile.
--within keeps the samples with a frame that names it (the training step's, say, without
the data's preparation and the Trainer's setup).
"""
import argparse
import re
from collections import Counter

# frames of one-time work: torch.compile's, Inductor's and Triton's compilation, autotuning, imports
COMPILING = re.compile(
    r"convert_frame|compile_fx|autotun|do_bench|triton/compiler/|codecache|async_compile|_lazy_init|_find_and_load|precompile"
)


def load(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) samples: (the thread, then its frames outermost first; count)."""
    samples = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                raise ValueError(f"{path}:{number}: not a line of py-spy's raw output (frames;... count)")
            samples.append((stack.split(";"), int(count)))
    return samples


def summarize(samples: list[tuple[list[str], int]], steps: int, rate: float, top: int = 30, within: str | None = None) -> dict:
    """Per thread (most time first): ms per step in all, and its `top` functions by
    inclusive and by own ms per step, over the samples outside COMPILING frames (and with a
    frame naming `within`, if given)."""
    to_ms = 1000.0 / rate / steps
    threads: dict[str, dict] = {}
    for stack, count in samples:
        if any(COMPILING.search(frame) for frame in stack):
            continue
        if within is not None and not any(within in frame for frame in stack[1:]):
            continue
        thread = threads.setdefault(stack[0], {"total": 0, "inclusive": Counter(), "own": Counter()})
        thread["total"] += count
        for frame in set(stack[1:]):
            thread["inclusive"][frame] += count
        if len(stack) > 1:
            thread["own"][stack[-1]] += count
    return {
        name: {
            "ms_per_step": t["total"] * to_ms,
            "inclusive": [(frame, n * to_ms) for frame, n in t["inclusive"].most_common(top)],
            "own": [(frame, n * to_ms) for frame, n in t["own"].most_common(top)],
        }
        for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["total"])
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("samples", help="py-spy record -f raw output")
    p.add_argument("--steps", type=int, required=True, help="every step the run made, warmup included")
    p.add_argument("--rate", type=float, default=100.0, help="py-spy's samples per second (its -r)")
    p.add_argument("--top", type=int, default=30, help="functions listed per thread")
    p.add_argument("--threads", type=int, default=3, help="threads listed, most time first")
    p.add_argument("--within", help="only samples with a frame that names this (training_step, say)")
    args = p.parse_args(argv)
    summary = summarize(load(args.samples), args.steps, args.rate, args.top, args.within)
    for name, t in list(summary.items())[: args.threads]:
        print(f"\n{name}: {t['ms_per_step']:.2f} ms a step outside compilation")
        for kind in ("inclusive", "own"):
            print(f"  {kind}:")
            for frame, ms in t[kind]:
                print(f"  {ms:8.2f}  {frame[:140]}")
    return summary


if __name__ == "__main__":
    main()
