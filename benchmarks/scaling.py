"""Weak scaling on the GPUs of one host: the sharded embedding alone, and HSTU training.

    python benchmarks/scaling.py --procs 1 2 4 8                       # NCCL, one process per GPU
    python benchmarks/scaling.py --device cpu --procs 1 2 --small      # gloo on CPUs (the test's run)

For each process count G the driver runs `torchrun --standalone --nproc-per-node G` of this
file in worker mode (NCCL with NVLink multicast off, NCCL_NVLS_ENABLE=0, the machine's
other NCCL settings kept; gloo on CPUs) and collects rank 0's row. The per-GPU batch is
fixed (weak scaling); reported per G: ms per step, samples/s per GPU, the weak-scaling
efficiency (per-GPU rate at G over the rate at 1), and the time spent in communication
(ms per step and share of the step). A run that fails is reported as such and the others
go ahead; the JSON is rewritten after every run.

Workloads:
- `embedding`: dynamicemb's workload on a ShardedDynamicEmbeddingCollection: 10 tables of
  dim 128, Adam, `--ids` ids per table per GPU from a power law (α 1.05) over an id range
  of `--rows` per table per GPU (every id inserted before timing); a step is the lookup
  (all-to-all of ids and rows), the given output gradient's backward and the sparse update
  (all-to-all of gradients). A sample is one id of every table.
- `hstu`: training steps of the real LightningModule under DDP (the presets given; per-GPU
  batch = the preset's; CUDA graphs as the preset sets them at every G, or as
  `--cuda-graph-buckets` says; each global batch split over the ranks by the sequences'
  FLOPs, lightning_modules/balanced_sampler.py, or with `--unbalanced` at random as
  Lightning's DistributedSampler does), TFLOP/s as lightning_modules/flops.py counts them.

Communication share: the step is timed twice, plain (the ms and samples/s reported), then
with every collective (the embedding's all-to-alls, DDP's all-reduce through a comm hook)
made blocking and timed alone; the share is their time over that step's. It counts what a
collective costs the step when nothing overlaps it: an upper bound where DDP overlaps.
Where the step graphs serve (the full-catalog loss on GPUs: lightning_modules/step_graph.py)
the dense gradients' all-reduce is inside the graph, not timed apart: such rows say so
(`dense_all_reduce_in_graph`), and their comm is the embedding's all-to-alls alone.
Prints a table and writes JSON to benchmarks/results/scaling_<device>.json.

Each HSTU row also holds every rank's own view of the plain pass (`ranks`): its slowest
and median step as its host saw them, and what it compiled during the pass (torch.compile
frames, Triton kernels by their specialization). One rank's stall, a kernel compiled
mid-run, is every rank's at the next collective: the step times alone do not say whose.
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TABLES, DIM, ALPHA = 10, 128, 1.05
FULL = {"ids": 65_536, "rows": 1_677_721, "users": 0}  # dynamicemb's sizes per GPU
SMALL = {"ids": 512, "rows": 4_096, "users": 0}  # the CPU test's


# ---- timing of collectives ------------------------------------------------------------------
class CommTimer:
    """While on: every all_to_all_single made blocking and timed (the embedding's exchanges)."""

    def __init__(self, device: str):
        self.device, self.seconds, self.on = device, 0.0, False
        self._all_to_all = dist.all_to_all_single
        dist.all_to_all_single = self._timed

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _timed(self, *args, **kwargs):
        if not self.on:
            return self._all_to_all(*args, **kwargs)
        self._sync()
        start = time.perf_counter()
        out = self._all_to_all(*args, **kwargs)
        self._sync()
        self.seconds += time.perf_counter() - start
        return out

    def ddp_hook(self, state, bucket):
        """DDP's gradient all-reduce (mean), blocking and timed while on."""
        world = dist.get_world_size()
        if self.on:
            self._sync()
        start = time.perf_counter()
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        if self.on:
            work.wait()
            self._sync()
            self.seconds += time.perf_counter() - start
        return work.get_future().then(lambda f: f.value()[0].div_(world))


def comm(timer: CommTimer, instrumented_s: float, steps: int, world: int) -> dict:
    """The instrumented pass's collectives: ms per step, and their share of its step."""
    if world == 1:
        return {"comm_ms_per_step": 0.0, "comm_share": 0.0}
    return {"comm_ms_per_step": 1000 * timer.seconds / steps, "comm_share": timer.seconds / instrumented_s}


@contextlib.contextmanager
def profiled(on: bool, device: str, label: str, trace_dir: str | None = None):
    """Where asked (--profile): torch.profiler over the block, then its top operations
    printed by host and by device time, and with trace_dir (--trace) its timeline written
    there as a Chrome trace. Its start and stop stay outside a timed window inside the
    block, but the operations it records run slower."""
    if not on:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    # with a trace, the Python frames too: what the host ran while the GPU waited
    with torch.profiler.profile(activities=activities, with_stack=bool(trace_dir)) as profiler:
        yield
    for sort in ("self_cpu_time_total", "self_device_time_total"):
        print(f"{label}, rank 0's plain pass by {sort}:\n" + profiler.key_averages().table(sort_by=sort, row_limit=25), flush=True)
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(trace_dir) / (label.replace(", ", "_").replace(" ", "-") + ".json")))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


# ---- the embedding workload -------------------------------------------------------------------
def power_law(n: int, high: int, gen: torch.Generator, device: str) -> torch.Tensor:
    u = torch.rand(n, generator=gen, dtype=torch.float64).to(device)
    a = 1.0 - ALPHA
    return ((((high**a - 1.0) * u + 1.0) ** (1.0 / a)).floor().long() - 1).clamp(0, high - 1)


def embedding_worker(args, device: str, timer: CommTimer) -> dict:
    from kernels.dynamic_embedding import EmbeddingConfig, OptimizerConfig, ShardedDynamicEmbeddingCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    rows_total = args.rows * world  # the id range of a table: each GPU's shard holds about args.rows
    config = EmbeddingConfig(dim=DIM, optimizer=OptimizerConfig("adam", lr=1e-3), capacity=args.rows, max_capacity=2 * args.rows,
                             bucket_size=128 if device == "cuda" else 32)
    names = [f"t{i}" for i in range(TABLES)]
    tables = ShardedDynamicEmbeddingCollection({n: config for n in names}, device)
    chunk = 1 << 18
    mine = torch.arange(rank, rows_total, world, device=device)  # each id once, over the ranks
    for start in range(0, mine.numel(), chunk):
        tables.lookup({n: mine[start : start + chunk] for n in names})
    gen = torch.Generator().manual_seed(rank)
    steps = args.warmup + 2 * args.steps
    batches = [{n: power_law(args.ids, rows_total, gen, device) for n in names} for _ in range(steps)]
    grads = {n: torch.randn(args.ids, DIM, generator=gen).to(device) for n in names}

    def step(ids):
        tables.lookup(ids)
        tables.apply_gradients(ids, grads)

    for i in range(args.warmup):
        step(batches[i])
    seconds = []
    # the plain pass's steps on the GPU's clock (an event between steps, read after the
    # pass: no wait inside it); their median is steadier than the mean, which one stalled
    # step moves
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)] if device == "cuda" else []
    for instrumented in (False, True):
        timer.on, timer.seconds = instrumented, 0.0
        with profiled(args.profile and not instrumented and rank == 0, device, f"embedding, {world} processes", args.trace):
            sync(device)
            start = time.perf_counter()
            for i in range(args.steps):
                if marks and not instrumented:
                    marks[i].record()
                step(batches[args.warmup + instrumented * args.steps + i])
            if marks and not instrumented:
                marks[-1].record()
            sync(device)
            seconds.append(time.perf_counter() - start)
    timer.on = False
    steps_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    return {
        "workload": "embedding", "tables": TABLES, "dim": DIM, "ids_per_gpu": args.ids, "rows_per_gpu": args.rows,
        "ms_per_step": 1000 * seconds[0] / args.steps, "samples_per_s_per_gpu": args.ids * args.steps / seconds[0],
        "median_ms_per_step": statistics.median(steps_ms) if steps_ms else None,
        **comm(timer, seconds[1], args.steps, world),
    }


# ---- the HSTU workload ------------------------------------------------------------------------
def hstu_worker(args, device: str, timer: CommTimer) -> dict:
    import lightning as L

    from lightning_modules.callbacks import FrozenSetup
    from lightning_modules.config import preset
    from lightning_modules.data_module import SequenceDataModule
    from lightning_modules.flops import sequence_cost, step_flops, step_negatives
    from lightning_modules.module import HSTULightningModule
    from lightning_modules.train import precision_for, strategy_for

    world = int(os.environ["WORLD_SIZE"])
    per_gpu = args.batch_size or preset(args.preset).batch_size
    config = preset(args.preset).override(batch_size=per_gpu * world, cuda_graph_buckets=args.cuda_graph_buckets,
                                          compile_blocks=args.compile_blocks, ddp_step_graph=args.ddp_step_graph,
                                          balanced_batches=False if args.unbalanced else None)
    catalog = SequenceDataModule(args.data_dir, 1, 1).catalog()
    data = SequenceDataModule(args.data_dir, config.max_seq_len, per_gpu, num_workers=2 if device == "cuda" else 0,
                              random_windows=config.random_windows, seed=config.seed,
                              cost=sequence_cost(config, len(catalog)) if config.balanced_batches else None)
    module = HSTULightningModule(config, catalog)
    negatives = step_negatives(config, len(catalog))

    class Passes(L.Callback):
        """Steps warmup .. warmup+steps plain, the next `steps` with collectives timed. A
        synchronize only where a pass starts or ends: a step need not wait for the last
        one's kernels, as in training, so the timed batches' lengths stay on the device."""

        def __init__(self):
            self.bounds, self.lengths, self.starts, self.compiled = [], [], [], []
            self.triton = TritonCompiles()
            self.profiler = profiled(args.profile and int(os.environ["RANK"]) == 0, device, f"{args.preset}, {world} processes", args.trace)

        def _mark(self, trainer):
            if device == "cuda":
                torch.cuda.synchronize()
            trainer.strategy.barrier()
            self.bounds.append(time.perf_counter())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.warmup <= trainer.global_step <= args.warmup + args.steps:  # the plain pass's steps, and its end
                self.starts.append(time.perf_counter())
            if trainer.global_step == args.warmup:
                self.profiler.__enter__()
            if trainer.global_step in (args.warmup, args.warmup + args.steps):
                self._mark(trainer)
                self.triton.on = trainer.global_step == args.warmup
                self.compiled.append(frames_compiled())  # at the plain pass's start and end
                timer.on, timer.seconds = trainer.global_step > args.warmup, 0.0
            if trainer.global_step == args.warmup + args.steps:
                self.profiler.__exit__(None, None, None)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.warmup < trainer.global_step <= args.warmup + args.steps:  # the plain pass's steps
                self.lengths.append(batch["input_offsets"].diff())

        def on_train_end(self, trainer, pl_module):
            self._mark(trainer)
            timer.on = False

    passes = Passes()
    accelerator = "gpu" if device == "cuda" else "cpu"
    strategy = strategy_for(world, ddp_comm_hook=timer.ddp_hook)
    trainer = L.Trainer(
        accelerator=accelerator, devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=1, strategy=strategy,
        max_steps=args.warmup + 2 * args.steps, precision=precision_for(accelerator), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[passes, FrozenSetup()],  # (as training has it)
    )
    trainer.fit(module, datamodule=data)
    plain_s, instrumented_s = passes.bounds[1] - passes.bounds[0], passes.bounds[2] - passes.bounds[1]
    lengths = [x.cpu().numpy() for x in passes.lengths]
    # each rank's own view of the plain pass: a rank that stalls (compiling, tuning) makes
    # the others wait in the next collective, which the step time alone does not say
    host_ms = [1000 * (b - a) for a, b in zip(passes.starts, passes.starts[1:])]
    mine = {"rank": int(os.environ["RANK"]), "slowest_step_ms": max(host_ms, default=0.0),
            "median_step_ms": sorted(host_ms)[len(host_ms) // 2] if host_ms else 0.0,
            "frames_compiled": frames_compiled(), "frames_compiled_in_plain_pass": passes.compiled[-1] - passes.compiled[0],
            "triton_compiles_in_plain_pass": passes.triton.kernels}
    ranks = [None] * world
    if world > 1:
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    flops = sum(step_flops(config, x, negatives) for x in lengths)
    return {
        "workload": "hstu", "preset": args.preset, "batch_per_gpu": per_gpu, "max_seq_len": config.max_seq_len,
        "cuda_graph_buckets": config.cuda_graph_buckets if device == "cuda" else 0, "balanced_batches": config.balanced_batches,
        "compile_blocks": config.compile_blocks, "inductor_cache_per_rank": bool(args.inductor_cache),
        "dense_all_reduce_in_graph": world > 1 and module.step_graph is not None,
        "ms_per_step": 1000 * plain_s / args.steps, "samples_per_s_per_gpu": sum(len(x) for x in lengths) / plain_s,
        "tflops_per_gpu": flops / plain_s / 1e12, **comm(timer, instrumented_s, args.steps, world), "ranks": ranks,
    }


class TritonCompiles:
    """The @triton.jit kernels this process compiles (or loads from Triton's disk cache)
    while `on`: a kernel compiled mid-training (a new specialization of its arguments)
    stalls its rank for as long, and under several processes every rank with it."""

    def __init__(self):
        from triton import knobs

        self.on, self.kernels = False, []
        chained = knobs.runtime.jit_post_compile_hook

        def hook(*, fn, compile: dict, **kwargs):
            if self.on:
                self.kernels.append(self._specialization(fn, compile))
            return chained(fn=fn, compile=compile, **kwargs) if chained else None

        knobs.runtime.jit_post_compile_hook = hook

    @staticmethod
    def _specialization(fn, compile: dict) -> str:
        """The kernel's name and the arguments it was specialized on (pointers 16-byte
        aligned, ints divisible by 16): the ones a second variant differs in."""
        try:
            attrs, names = (compile.get("configs") or [{}])[0], fn.jit_function.arg_names
            special = sorted(names[path[0]] for path, value in attrs.items() if value and path and path[0] < len(names))
        except (AttributeError, IndexError, TypeError):  # another Triton's layout: the name alone
            return f"{getattr(fn, 'name', fn)}: ?"
        return f"{fn.name}: {', '.join(special) or 'nothing'}"


def frames_compiled() -> int:
    """Frames torch.compile has compiled in this process so far (first compilations and
    recompilations)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def worker(args) -> None:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if args.inductor_cache:  # read by Inductor when it first compiles, after this
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.inductor_cache) / f"rank{os.environ['RANK']}")
    if args.workload == "embedding":  # Lightning makes its own process group for hstu
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        timer = CommTimer(device)
        row = embedding_worker(args, device, timer)
    else:
        timer = CommTimer(device)
        row = hstu_worker(args, device, timer)
    if int(os.environ["RANK"]) == 0:
        Path(args.row).write_text(json.dumps(row | {"procs": int(os.environ["WORLD_SIZE"])}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---- the driver -------------------------------------------------------------------------------
def hstu_data(root: Path, preset_name: str, users: int) -> Path:
    """Synthetic data for a preset (ML-1M-like; uniform long sequences for hstu-long)."""
    from benchmarks.train_throughput import ML1M_LIKE_MAX_LEN, uniform_lengths_data
    from lightning_modules.config import preset
    from lightning_modules.datasets import prepare

    path = root / f"data-{preset_name}"
    path.mkdir(parents=True, exist_ok=True)
    if preset(preset_name).max_seq_len > ML1M_LIKE_MAX_LEN:
        uniform_lengths_data(path, users, preset(preset_name).max_seq_len, seed=0)
    else:
        prepare("synthetic", path, synthetic_users=users, seed=0)
    return path


def launch(procs: int, worker_args: list[str], device: str) -> dict:
    """Rank 0's row of one torchrun of `procs` workers, or {"error": ...} where it failed
    (the other runs still go ahead)."""
    with tempfile.TemporaryDirectory() as tmp:
        row = Path(tmp) / "row.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        if device == "cuda":
            env["NCCL_NVLS_ENABLE"] = "0"
        else:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", __file__,
                   "--worker", "--row", str(row), "--device", device, *worker_args]
        done = subprocess.run(command, env=env)
        if done.returncode or not row.exists():
            return {"procs": procs, "error": f"torchrun exited with {done.returncode}"}
        return json.loads(row.read_text())


def table_line(row: dict) -> str:
    preset = row.get("preset", "") + ("/random" if row.get("balanced_batches") is False else "")  # shares drawn at random
    head = f"{row['workload']:<10}{preset:<17}{row['procs']:>6}"
    if "error" in row:
        return f"{head}  {row['error']}"
    efficiency = f"{row['efficiency']:>12.1%}" if row["efficiency"] is not None else f"{'-':>12}"  # no 1-GPU run to divide by
    in_graph = " (dense all-reduce in the step graph, not counted)" if row.get("dense_all_reduce_in_graph") else ""
    median = f" (median step {row['median_ms_per_step']:.2f} ms)" if row.get("median_ms_per_step") else ""
    return (f"{head}{row['ms_per_step']:>10.2f}{row['samples_per_s_per_gpu']:>16,.0f}{efficiency}"
            f"{row['comm_ms_per_step']:>10.2f}{row['comm_share']:>12.1%}{in_graph}{median}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--workloads", nargs="+", default=["embedding", "hstu"], choices=["embedding", "hstu"])
    p.add_argument("--presets", nargs="+", default=["hstu", "hstu-large", "hstu-long"])
    p.add_argument("--small", action="store_true", help="CPU-sized tables and batches (the test's)")
    p.add_argument("--steps", type=int, default=20, help="timed steps, in each of the two passes")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, help="HSTU sequences per GPU (default: the preset's)")
    p.add_argument("--cuda-graph-buckets", type=int, help="the presets' CUDA graph buckets replaced (0: no graphs)")
    p.add_argument("--compile-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="the blocks' work around the attention through torch.compile (default: the preset's)")
    p.add_argument("--ddp-step-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="HSTU under DDP: the whole dense step in one CUDA graph, its all-reduce in it (default: the preset's)")
    p.add_argument("--unbalanced", action="store_true", help="HSTU: the ranks' shares of a batch drawn at random, not split by cost")
    p.add_argument("--profile", action="store_true", help="print rank 0's top operations in each run's plain pass (which then runs slower)")
    p.add_argument("--trace", help="with --profile: a folder for rank 0's Chrome trace of each run's plain pass")
    p.add_argument("--inductor-cache", metavar="DIR",
                   help="with --compile-blocks: each rank compiles into DIR/rank<R> (TORCHINDUCTOR_CACHE_DIR), not a cache all share")
    p.add_argument("--out")
    # worker mode (torchrun runs this file again with these)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--ids", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    from benchmarks.results_path import write_results
    from lightning_modules.config import preset

    sizes = SMALL if args.small else FULL
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.cuda_graph_buckets is not None:
        common += ["--cuda-graph-buckets", str(args.cuda_graph_buckets)]
    if args.compile_blocks is not None:
        common += ["--compile-blocks" if args.compile_blocks else "--no-compile-blocks"]
    if args.ddp_step_graph is not None:
        common += ["--ddp-step-graph" if args.ddp_step_graph else "--no-ddp-step-graph"]
    common += ["--profile"] if args.profile else []
    common += ["--trace", str(Path(args.trace).resolve())] if args.trace else []
    common += ["--unbalanced"] if args.unbalanced else []
    common += ["--inductor-cache", str(Path(args.inductor_cache).resolve())] if args.inductor_cache else []
    runs = ["embedding"] if "embedding" in args.workloads else []
    runs += args.presets if "hstu" in args.workloads else []
    rows = []
    print(f"{'workload':<10}{'preset':<17}{'GPUs':>6}{'ms/step':>10}{'samples/s/GPU':>16}{'efficiency':>12}"
          f"{'comm ms':>10}{'comm share':>12}", flush=True)
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        for run in runs:
            if run == "embedding":
                worker_args = ["--workload", "embedding", "--ids", str(sizes["ids"]), "--rows", str(sizes["rows"])]
            else:  # each preset's data just before its runs
                per_gpu = args.batch_size or preset(run).batch_size
                data = hstu_data(Path(tmp), run, per_gpu * max(args.procs) * (args.warmup + 2 * args.steps + 2))
                worker_args = ["--workload", "hstu", "--preset", run, "--data-dir", str(data)]
                worker_args += ["--batch-size", str(args.batch_size)] if args.batch_size else []
            base = None
            for procs in args.procs:
                row = {"workload": "embedding" if run == "embedding" else "hstu"} | ({} if run == "embedding" else {"preset": run})
                row |= launch(procs, worker_args + common, args.device)
                if "error" not in row:
                    base = base or (row["samples_per_s_per_gpu"] if procs == 1 else None)
                    row["efficiency"] = row["samples_per_s_per_gpu"] / base if base else None
                rows.append(row)
                print(table_line(row), flush=True)
                # after every run, so that a run cut short keeps the rows before it
                write_results("scaling", rows, args.out, device=args.device, procs=args.procs, small=args.small)


if __name__ == "__main__":
    main()
