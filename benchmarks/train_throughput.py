"""Training throughput of HSTU on the dynamic embedding: samples (sequences) per second,
TFLOP/s and MFU.

    python benchmarks/train_throughput.py --device cpu
    python benchmarks/train_throughput.py --device cuda --preset hstu hstu-large hstu-long

One process, the real LightningModule, data loader and Trainer (manual optimization, table
lookups and fused sparse updates included), bf16 autocast on CUDA as training runs there.
Data: synthetic ML-1M-like sequences (seeded) for the paper presets; for presets longer
than those (hstu-long) sequences of lengths uniform in [N/2, N] over a Zipf catalog. The
first `--warmup` steps are not timed, and never fewer than the steps up to the first logged
one (LOG_EVERY_N_STEPS): Lightning makes its metric objects at the first value logged, a
one-time 20 ms or so of host work that a short window would count as the steps' own. On
CUDA the timed window starts and ends with a synchronize and has none of its own between
steps. Besides the window's mean, each row gives the spread of the steps' own times
(`step_ms`: median, 90th percentile, the slowest and which it was), from a CUDA event
recorded at each step's end. On one CUDA device the model's forward and backward replay
CUDA graphs (lightning_modules/cuda_graphs.py) unless `--cuda-graph-buckets 0`.

`--alternate MODULE.ATTRIBUTE=V1,V2` switches a setting between values every few steps of
the one run and gives the steps' times per value (alternation.py): an A/B within a process.

The Trainer has training's FrozenSetup (the setup's objects out of the garbage
collector's way); each row gives the collector's pauses in the timed steps (gc_pauses.py).

FLOPs per step count the matrix products, by lightning_modules/flops.py's formula.
MFU divides TFLOP/s by the device's dense bf16 peak (PEAK_TFLOPS; none on a CPU).
Prints a table and writes JSON to benchmarks/results/.
"""
import argparse
import contextlib
import cProfile
import io
import pstats
import platform
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.alternation import ALTERNATE_EVERY, Alternation  # noqa: E402
from benchmarks.gc_pauses import GcPauses  # noqa: E402
from benchmarks.host_sections import HostSections  # noqa: E402
from benchmarks import trace_summary  # noqa: E402
from benchmarks.results_path import write_results  # noqa: E402
from kernels.hstu_attention import triton_kernels  # noqa: E402
from lightning_modules.callbacks import FrozenSetup  # noqa: E402
from lightning_modules.config import PRESETS, preset  # noqa: E402
from lightning_modules.data_module import SequenceDataModule  # noqa: E402
from lightning_modules.datasets import prepare  # noqa: E402
from lightning_modules.flops import step_flops, step_negatives  # noqa: E402
from lightning_modules.module import HSTULightningModule  # noqa: E402
from lightning_modules.train import precision_for  # noqa: E402

PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16, SXM parts, by a word of the device name
ML1M_LIKE_MAX_LEN = 2000  # the synthetic generator's longest sequence
CATALOG = 1 << 20  # items of the uniform-length data
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync debug mode warning
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")  # host calls that start GPU work
LOG_EVERY_N_STEPS = 50  # the Trainer's (Lightning's default): the module logs every this many steps
HOST_PROFILE_ROWS = 45  # functions --host-profile prints, by own time and by cumulative time


def uniform_lengths_data(path: Path, users: int, max_len: int, seed: int) -> None:
    """train.parquet of `users` sequences of max_len / 2 .. max_len items (plus the last
    one's target), items Zipf-distributed over CATALOG ids, timestamps a minute apart on
    average."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max_len // 2, max_len + 1, size=users) + 1
    items = (rng.zipf(1.2, size=int(lengths.sum())) - 1) % CATALOG
    times = np.cumsum(rng.exponential(60.0, size=int(lengths.sum()))).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.table({
        "user_id": np.arange(1, users + 1, dtype=np.int64),
        "item_ids": pa.ListArray.from_arrays(offsets, items.astype(np.int64)),
        "timestamps": pa.ListArray.from_arrays(offsets, times),
    })
    pq.write_table(table, path / "train.parquet")


class StepTimer(L.Callback):
    """Times the steps after `warmup` to the last one (max_steps): a synchronize where the
    window starts and where it ends, none between (a step need not wait for the last
    one's kernels, as in training). The timed batches' lengths stay on the device until
    the end. Each step's end is also marked (CUDA: an event on the stream, which the GPU
    reaches when the step's work is done; CPU: the clock), so each step's own time is
    known after the window (step_times_ms): a slow step within the window shows there."""

    def __init__(
        self, warmup: int, device: str, profiler=None, count_syncs: bool = False, host_profiler: cProfile.Profile | None = None,
        sections: HostSections | None = None, alternation: Alternation | None = None,
    ):
        self.warmup, self.device = warmup, device
        self.alternation = alternation  # a setting switched between values every few steps, or None
        self.start, self.elapsed, self.steps, self.lengths = None, None, 0, []
        self.profiler = profiler  # torch.profiler over the timed steps, or None
        self.host_profiler = host_profiler  # cProfile over the timed steps' main thread, or None
        self.sections = sections  # host time by section over the timed steps, or None
        # CUDA: torch warns at each operation of the timed steps that waits for the device;
        # Triton's kernels compiled in the timed steps are listed too
        self.count_syncs = count_syncs and device == "cuda"
        self.compiled: list[str] = []
        self.gc = GcPauses()  # the collector's pauses in the timed steps
        self.marks: list = []  # the window's start and each timed step's end (events on CUDA)

    def _on_compile(self, fn, **_) -> None:
        self.compiled.append(fn.name)

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.alternation is not None:
            self.alternation.apply(trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self._sync()
            if self.profiler is not None:
                self.profiler.start()
            if self.count_syncs:
                torch.cuda.set_sync_debug_mode("warn")
                triton.knobs.runtime.jit_post_compile_hook = self._on_compile
            if self.host_profiler is not None:
                self.host_profiler.enable()
            if self.sections is not None:
                self.sections.start()
            self.gc.start()
            self.start = time.perf_counter()
            self._mark()
        elif trainer.global_step > self.warmup:
            self.lengths.append(batch["input_offsets"].diff())  # no read back until the end
            self.steps += 1
            self._mark()
            if trainer.global_step == trainer.max_steps:
                self._sync()
                self.elapsed = time.perf_counter() - self.start
                self.gc.stop()
                if self.sections is not None:
                    self.sections.stop()
                if self.host_profiler is not None:
                    self.host_profiler.disable()
                if self.count_syncs:
                    torch.cuda.set_sync_debug_mode("default")
                    triton.knobs.runtime.jit_post_compile_hook = None
                if self.profiler is not None:
                    self.profiler.stop()

    def _mark(self) -> None:
        if self.device == "cuda":
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def step_times_ms(self) -> list[float]:
        """Each timed step's time, from the mark before it to its own (after the window)."""
        if self.device == "cuda":
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1000 * (b - a) for a, b in zip(self.marks, self.marks[1:])]

    def input_lengths(self) -> list[np.ndarray]:
        """Each timed step's input lengths (what the model read per sequence)."""
        return [x.cpu().numpy() for x in self.lengths]


def step_spread(times_ms: list[float]) -> dict:
    """The timed steps' own times: median, 90th percentile, the slowest and its index in the
    window (0: the first timed step)."""
    t = np.asarray(times_ms)
    return {"median": float(np.median(t)), "p90": float(np.percentile(t, 90)), "max": float(t.max()),
            "slowest_step": int(t.argmax())}


def sync_sites(caught: list) -> Counter:
    """Where the timed steps waited for the device: file:line of each synchronizing call
    torch warned of, with its count."""
    return Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message))


@dataclass(frozen=True)
class Settings:
    """The preset's settings a run replaces (None: the preset's own)."""
    batch_size: int | None = None
    cuda_graph_buckets: int | None = None
    row_multiple: int | None = None
    compile_blocks: bool | None = None
    compile_model: bool | None = None
    layer_norm_kernel: bool | None = None
    norm_mul_dropout_kernel: bool | None = None
    whole_item_table: int | None = None  # rows: the item table allocated whole (it never grows)

    def config(self, preset_name: str):
        return preset(preset_name).override(
            batch_size=self.batch_size, cuda_graph_buckets=self.cuda_graph_buckets, row_multiple=self.row_multiple,
            compile_blocks=self.compile_blocks, compile_model=self.compile_model, layer_norm_kernel=self.layer_norm_kernel,
            norm_mul_dropout_kernel=self.norm_mul_dropout_kernel,
            embedding_capacity=self.whole_item_table, embedding_max_capacity=self.whole_item_table,
        )


@dataclass(frozen=True)
class Diagnostics:
    """What a run records beside its time (each slows the timed steps but host_sections)."""
    profile: str | None = None  # a directory for torch.profiler's traces
    count_syncs: bool = False
    host_profile: bool = False
    host_sections: bool = False


def run(
    device: str, preset_name: str, users: int, steps: int, warmup: int, settings: Settings = Settings(),
    diagnostics: Diagnostics = Diagnostics(), workers: int = 2, alternation: Alternation | None = None,
) -> dict:
    config = settings.config(preset_name)
    profile = diagnostics.profile
    if warmup < LOG_EVERY_N_STEPS:
        print(f"{preset_name}: {LOG_EVERY_N_STEPS} warmup steps, not {warmup}: the first logged step's one-time work goes untimed")
        warmup = LOG_EVERY_N_STEPS
    with tempfile.TemporaryDirectory() as tmp:
        if config.max_seq_len > ML1M_LIKE_MAX_LEN:
            users = config.batch_size * (warmup + steps)
            uniform_lengths_data(Path(tmp), users, config.max_seq_len, seed=0)
        else:
            users = prepare("synthetic", tmp, synthetic_users=users, seed=0)["users"]
        data = SequenceDataModule(tmp, config.max_seq_len, config.batch_size, num_workers=workers, random_windows=config.random_windows)
        catalog = data.catalog()
        module = HSTULightningModule(config, catalog)
        profiler = None
        if profile:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
            profiler = torch.profiler.profile(activities=activities)
        host_profiler = cProfile.Profile() if diagnostics.host_profile else None
        sections = HostSections() if diagnostics.host_sections else None
        timer = StepTimer(warmup, device, profiler, diagnostics.count_syncs, host_profiler, sections, alternation)
        accelerator = "gpu" if device == "cuda" else "cpu"
        trainer = L.Trainer(
            accelerator=accelerator, devices=1, max_steps=warmup + steps, precision=precision_for(accelerator),
            log_every_n_steps=LOG_EVERY_N_STEPS,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[timer, FrozenSetup()],  # (as training has it)
        )
        with (warnings.catch_warnings(record=True) if timer.count_syncs else contextlib.nullcontext([]) as caught,
              alternation.restoring() if alternation is not None else contextlib.nullcontext()):
            if timer.count_syncs:
                warnings.simplefilter("always")
            try:
                trainer.fit(module, datamodule=data)
            finally:
                if sections is not None:
                    sections.restore()
    gpu_profile = None
    if profiler is not None:
        Path(profile).mkdir(parents=True, exist_ok=True)
        trace = Path(profile) / f"{preset_name}.json"
        profiler.export_chrome_trace(str(trace))
        sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        events = profiler.key_averages()
        print(f"\n{preset_name}: the timed steps by {sort}\n" + events.table(sort_by=sort, row_limit=30))
        print(f"{preset_name}: the timed steps by self CPU time\n" + events.table(sort_by="self_cpu_time_total", row_limit=30))
        print(f"{preset_name}: the timed steps' operations by count\n" + events.table(sort_by="count", row_limit=60))
        launches = {e.key: e.count for e in events if e.key in LAUNCH_CALLS}
        print(f"{preset_name}: launches per timed step: {sum(launches.values()) / timer.steps:.1f} {launches}")
        if device == "cuda":
            gpu_profile = trace_summary.summarize(trace_summary.load_events(trace), timer.steps)
            print(f"\n{preset_name}: the GPU in the timed steps (trace_summary.py)")
            trace_summary.print_summary(gpu_profile)
    if host_profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(host_profiler, stream=text)
        stats.sort_stats("tottime").print_stats(HOST_PROFILE_ROWS)
        stats.sort_stats("cumulative").print_stats(HOST_PROFILE_ROWS)
        print(f"\n{preset_name}: the timed steps' main thread (cProfile, {timer.steps} steps)\n{text.getvalue()}")
    if sections is not None:
        print(f"\n{preset_name}: host time per timed step by section (nested: each includes its callees)\n{sections.table(timer.steps)}")
    alternated = alternation.summary(warmup, timer.step_times_ms()) if alternation is not None else None
    if alternated is not None:
        print(f"\n{preset_name}: {alternated['setting']} alternated every {alternated['every']} steps (a block's first step not counted)")
        for v in alternated["values"]:
            figures = f"median {v['median_ms']:.2f} ms, mean {v['mean_ms']:.2f}" if v["steps"] else "no counted step"
            print(f"  {v['value']:>12}: {v['steps']} steps, {figures}")
    pauses = timer.gc.summary(timer.steps)
    print(f"{preset_name}: garbage collections in the timed steps {pauses}")
    sites = sync_sites(caught)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    lengths = timer.input_lengths()
    negatives = step_negatives(config, len(catalog))
    flops = sum(step_flops(config, x, negatives) for x in lengths)
    tflops = flops / timer.elapsed / 1e12
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name.split()), None) if device == "cuda" else None
    return {
        "device": device, "device_name": name, "threads": torch.get_num_threads(), "preset": preset_name,
        "precision": precision_for(accelerator), "batch_size": config.batch_size, "max_seq_len": config.max_seq_len,
        "num_negatives": config.num_negatives, "cuda_graph_buckets": config.cuda_graph_buckets, "compile_blocks": config.compile_blocks,
        "compile_model": config.compile_model, "row_multiple": config.row_multiple,
        "layer_norm_kernel": config.layer_norm_kernel, "norm_mul_dropout_kernel": config.norm_mul_dropout_kernel, "pair_bias_tiles": triton_kernels.reads_pair_biases(config.max_seq_len),
        "rows_by_descriptor": triton_kernels.ROWS_BY_DESCRIPTOR, "keep_pair_biases": triton_kernels.KEEP_PAIR_BIASES,
        "embedding_capacity": config.embedding_capacity, "embedding_max_capacity": config.embedding_max_capacity, "users": users, "workers": workers,
        "warmup_steps": warmup, "timed_steps": timer.steps, "seconds": timer.elapsed,
        "samples_per_s": sum(len(x) for x in lengths) / timer.elapsed,
        "positions_per_s": sum(int(x.sum()) for x in lengths) / timer.elapsed,
        "ms_per_step": 1000 * timer.elapsed / timer.steps, "step_ms": step_spread(timer.step_times_ms()),
        "TFLOPs": tflops, "MFU": tflops / peak if peak else None,
        "embedding_rows": module.items.item_table.stats().size, "torch": torch.__version__, "gc_pauses": pauses,
        "peak_memory_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        **({"syncs_per_step": sum(sites.values()) / timer.steps, "sync_sites": dict(sites.most_common()),
            "compiled_in_timed_steps": timer.compiled} if timer.count_syncs else {}),
        **({"host_sections_ms": sections.per_step(timer.steps)} if sections is not None else {}),
        **({"alternated": alternated} if alternated is not None else {}),
        **({"gpu_profile": gpu_profile} if gpu_profile is not None else {}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", nargs="+", default=["hstu", "hstu-large"], choices=sorted(PRESETS))
    p.add_argument("--users", type=int, default=6040)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=LOG_EVERY_N_STEPS, help="untimed steps (at least LOG_EVERY_N_STEPS)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--workers", type=int, default=2, help="data loader worker processes")
    p.add_argument("--cuda-graph-buckets", type=int, help="the presets' CUDA graph buckets replaced (0: no graphs)")
    p.add_argument("--row-multiple", type=int, help="a step without graphs pads its rows up to a multiple of this (0: none; default: the preset's)")
    p.add_argument("--compile-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="the blocks' work around the attention through torch.compile (default: the preset's)")
    p.add_argument("--compile-model", action=argparse.BooleanOptionalAction, default=None,
                   help="the whole model's forward as one torch.compile graph (default: the preset's)")
    p.add_argument("--layer-norm-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="the blocks' layer norms through kernels.layer_norm (default: the preset's)")
    p.add_argument("--norm-mul-dropout-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="each block's Dropout(LayerNorm(A V) ⊙ U) through kernels.norm_mul_dropout (default: the preset's)")
    p.add_argument("--count-syncs", action="store_true", help="CUDA: count the timed steps' waits for the device by call site, and list Triton compilations in them (slows the steps)")
    p.add_argument("--whole-item-table", type=int, metavar="ROWS",
                   help="the item table allocated whole at this many rows (capacity = max_capacity: it never grows, so no lookup checks whether it must)")
    p.add_argument("--profile", metavar="DIR", help="profile the timed steps: print the top ops and launches per step, write Chrome traces to DIR; on CUDA, each kernel's time, the GPU's busy and idle time per step and its longest idle gaps (trace_summary.py), also in the JSON")
    p.add_argument("--host-profile", action="store_true", help="cProfile the timed steps' main thread (the host's Python) and print its top functions")
    p.add_argument("--host-sections", action="store_true", help="the timed steps' host time by section of the step (host_sections.py)")
    p.add_argument("--alternate", metavar="MODULE.ATTRIBUTE=V1,V2",
                   help="switch a setting between these values every --alternate-every steps, and give the steps' times per value (alternation.py)")
    p.add_argument("--alternate-every", type=int, default=ALTERNATE_EVERY, help="steps a value of --alternate holds")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_throughput_<device>.json)")
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    settings = Settings(
        batch_size=args.batch_size, cuda_graph_buckets=args.cuda_graph_buckets, row_multiple=args.row_multiple,
        compile_blocks=args.compile_blocks, compile_model=args.compile_model, layer_norm_kernel=args.layer_norm_kernel,
        norm_mul_dropout_kernel=args.norm_mul_dropout_kernel, whole_item_table=args.whole_item_table,
    )
    diagnostics = Diagnostics(args.profile, args.count_syncs, args.host_profile, args.host_sections)
    alternation = Alternation.parse(args.alternate, args.alternate_every) if args.alternate else None
    rows = [run(args.device, name, args.users, args.steps, args.warmup, settings, diagnostics, args.workers, alternation)
            for name in args.preset]
    print(f"\n{'device':<28}{'preset':<12}{'batch':>6}{'samples/s':>12}{'positions/s':>14}{'ms/step':>10}{'TFLOP/s':>9}{'MFU':>7}")
    for r in rows:
        mfu = f"{100 * r['MFU']:6.1f}%" if r["MFU"] is not None else f"{'-':>7}"
        print(f"{r['device_name'][:27]:<28}{r['preset']:<12}{r['batch_size']:>6}{r['samples_per_s']:>12.1f}"
              f"{r['positions_per_s']:>14.0f}{r['ms_per_step']:>10.1f}{r['TFLOPs']:>9.2f}{mfu}")
    for r in rows:
        spread = r["step_ms"]
        print(f"{r['preset']}: each step's own time: median {spread['median']:.2f} ms, 90th percentile {spread['p90']:.2f}, "
              f"slowest {spread['max']:.2f} (timed step {spread['slowest_step']} of {r['timed_steps']})")
    for r in rows:
        if "syncs_per_step" in r:
            print(f"\n{r['preset']}: {r['syncs_per_step']:.1f} waits for the device per step; by site: {r['sync_sites']}; "
                  f"kernels compiled in the timed steps: {r['compiled_in_timed_steps']}")
    write_results("train_throughput", rows, args.out, device=args.device)


if __name__ == "__main__":
    main()
