"""Fault injection: kill one training worker with SIGKILL, mid-epoch or mid-checkpoint,
again and again, and check every resume.

    python benchmarks/kill_resume.py --kills 20

Each round starts (or resumes) a two-process `hstu train` job that checkpoints every step,
waits a random moment (odd rounds: until a checkpoint is being written), SIGKILLs one of
its two training processes, and then checks the resume: the job started again resumes
from the newest complete checkpoint, which loads clean, and the model it holds at that
step equals the checkpoint's embedding dump bit for bit (keys, rows, optimizer state and
scores). Prints a table and writes JSON to benchmarks/results/kill_resume_cpu.json. The
tests (tests/test_training.py) use the same functions for one kill of each kind.
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402
from kernels.dynamic_embedding import ShardedDynamicEmbedding, load  # noqa: E402
from lightning_modules import model_files  # noqa: E402
from lightning_modules.callbacks import LEFTOVER_PATTERNS, latest_checkpoint  # noqa: E402
from lightning_modules.config import HSTUConfig  # noqa: E402

TINY = "--max-seq-len 16 --batch-size 8 --num-negatives 16"  # small steps: many per second on two cores
# No validation: the model a job writes is then the state it ended in, not its best
# validated checkpoint, so that a job resumed and stopped at once writes the resumed state.
NO_VALIDATION = "--val-every 1000000"


def descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        children = [c for c, parent in parents.items() if parent == p]
        out += children
        frontier += children
    return out


def training_workers(job_pid: int) -> list[int]:
    """The training processes of an `hstu train` job (not torchrun's agent)."""
    found = []
    for p in descendants(job_pid):
        try:
            cmdline = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if b"lightning_modules.train" in cmdline and b"torchrun" not in cmdline and b"torch.distributed.run" not in cmdline:
            found.append(p)
    return found


def train_command(data: Path, train: Path, extra: str = "", epochs: int = 1) -> list[str]:
    hstu = shutil.which("hstu", path=os.path.dirname(sys.executable))
    return [hstu, "train", "--data-dir", str(data), "--out", str(train), "--workers", "2", "--epochs", str(epochs),
            "--train-args", f"{TINY} {NO_VALIDATION} {extra}".strip()]


def leftovers(checkpoints: Path) -> list[Path]:
    """What an interrupted checkpoint left behind."""
    return [p for pattern in LEFTOVER_PATTERNS for p in checkpoints.glob(pattern)]


def checkpoint_state(ckpt: Path) -> tuple[int, Path]:
    """A checkpoint's step and the embedding dump beside it."""
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    return state["global_step"], ckpt.parent / state["embedding_dump"]


def rows_equal_dump(model_dir: Path, dump: Path) -> bool:
    """Whether the item table of a model directory holds exactly the rows of a dump:
    keys, embeddings, optimizer state and scores, bit for bit."""
    _, items, info = model_files.load_model(model_dir)
    saved = ShardedDynamicEmbedding(HSTUConfig.from_dict(info["config"]).embedding_config())
    load(saved, dump)
    resumed, at_checkpoint = items.item_table.local.export_rows(), saved.local.export_rows()
    a, b = resumed[0].argsort(), at_checkpoint[0].argsort()
    return resumed[0].numel() > 0 and all(torch.equal(x[a], y[b]) for x, y in zip(resumed, at_checkpoint))


def kill_one_worker(job: subprocess.Popen, checkpoints: Path, mid_checkpoint: bool, delay_s: float, timeout_s: float = 300):
    """Waits until the job has written a checkpoint of its own, then `delay_s` more (and,
    with `mid_checkpoint`, until a checkpoint is being written), SIGKILLs one of its
    training processes and waits for the job to fail → (the newest complete checkpoint
    when the kill was sent, whether the kill left an interrupted checkpoint behind)."""
    deadline = time.monotonic() + timeout_s
    before = latest_checkpoint(checkpoints)  # a resumed job's first: it has cleared what the last kill left
    while latest_checkpoint(checkpoints) in (None, before):
        assert job.poll() is None and time.monotonic() < deadline, "the job wrote no checkpoint"
        time.sleep(0.01)
    time.sleep(delay_s)
    workers = training_workers(job.pid)
    while mid_checkpoint and not leftovers(checkpoints):
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint was being written"
        time.sleep(0.001)
    complete = latest_checkpoint(checkpoints)
    os.kill(random.choice(workers), signal.SIGKILL)
    assert job.wait(timeout=120) != 0, "the job survived a killed worker"
    return complete, bool(leftovers(checkpoints))


def resume_to(data: Path, train: Path, step: int) -> str:
    """The job started again, stopping at `step` → its output. The model it writes is then
    the resumed state."""
    done = subprocess.run(train_command(data, train, f"--max-steps {step}", epochs=1000), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"resume failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr


def one_round(data: Path, train: Path, mid_checkpoint: bool, delay_s: float) -> dict:
    """Train, kill, resume to the checkpoint's step, compare: the round's record."""
    checkpoints = train / "checkpoints"
    job = subprocess.Popen(train_command(data, train, "--checkpoint-every 1", epochs=1000),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        complete, interrupted = kill_one_worker(job, checkpoints, mid_checkpoint, delay_s)
    finally:
        job.kill()
        job.wait()
    newest = latest_checkpoint(checkpoints)
    step, dump = checkpoint_state(newest)
    log = resume_to(data, train, step)
    return {
        "kill": "mid-checkpoint" if mid_checkpoint else "mid-epoch", "step": step, "interrupted_checkpoint": interrupted,
        # an interrupted checkpoint must not be the one resumed: the one complete at the kill is
        "resumed_from_complete": newest == complete or not interrupted,
        "resume_logged": f"resuming from {newest}" in log, "leftovers_removed": not leftovers(checkpoints),
        "rows_bit_equal": rows_equal_dump(train / "model", dump),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--users", type=int, default=400, help="synthetic users (steps per epoch: users / 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="default: a temporary directory")
    p.add_argument("--out", help="JSON path (default benchmarks/results/kill_resume_cpu.json)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    random.seed(args.seed)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kill-resume-"))
    data, train = work / "data", work / "train"
    subprocess.run([shutil.which("hstu", path=os.path.dirname(sys.executable)), "prepare", "--dataset", "synthetic",
                    "--synthetic-users", str(args.users), "--out", str(data)], check=True, capture_output=True)
    rows = []
    print(f"{'round':>5} {'kill':>14} {'step':>6} {'interrupted':>11} {'clean resume':>12}")
    for i in range(args.kills):
        row = one_round(data, train, mid_checkpoint=i % 2 == 1, delay_s=rng.uniform(0.0, 3.0))
        row["clean"] = row["resumed_from_complete"] and row["resume_logged"] and row["leftovers_removed"] and row["rows_bit_equal"]
        rows.append({"round": i, **row})
        print(f"{i:>5} {row['kill']:>14} {row['step']:>6} {str(row['interrupted_checkpoint']):>11} {str(row['clean']):>12}",
              flush=True)
    clean = sum(r["clean"] for r in rows)
    print(f"{clean} of {len(rows)} resumes clean")
    write_results("kill_resume", rows, args.out, device="cpu", kills=len(rows), clean=clean)
    if clean != len(rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
