"""Training throughput of HSTU on the dynamic embedding: samples (sequences) per second.

    python benchmarks/train_throughput.py --device cpu
    python benchmarks/train_throughput.py --device cuda --preset hstu-large

Synthetic ML-1M-like data (seeded), one process, the real LightningModule and Trainer
(manual optimization, table lookups and fused sparse updates included). The first
`--warmup` steps are not timed; on CUDA every timed step ends with a synchronize.
Prints a table and writes JSON to benchmarks/results/.
"""
import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402
from lightning_modules.config import PRESETS, preset  # noqa: E402
from lightning_modules.data import SequenceDataModule  # noqa: E402
from lightning_modules.datasets import prepare  # noqa: E402
from lightning_modules.module import HSTULightningModule  # noqa: E402


class StepTimer(L.Callback):
    def __init__(self, warmup: int, device: str):
        self.warmup, self.device = warmup, device
        self.start, self.samples, self.positions, self.steps = None, 0, 0, 0

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._sync()
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        elif trainer.global_step > self.warmup:
            self.samples += len(batch["lengths"])
            self.positions += int(batch["lengths"].sum())
            self.steps += 1
            self.elapsed = time.perf_counter() - self.start


def run(device: str, preset_name: str, users: int, steps: int, warmup: int, batch_size: int | None) -> dict:
    config = preset(preset_name).override(batch_size=batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        stats = prepare("synthetic", tmp, synthetic_users=users, seed=0)
        data = SequenceDataModule(tmp, config.max_seq_len, config.batch_size, num_workers=2)
        module = HSTULightningModule(config, data.catalog())
        timer = StepTimer(warmup, device)
        trainer = L.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=warmup + steps,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[timer],
        )
        trainer.fit(module, datamodule=data)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return {
        "device": device, "device_name": name, "threads": torch.get_num_threads(), "preset": preset_name,
        "batch_size": config.batch_size, "max_seq_len": config.max_seq_len, "num_negatives": config.num_negatives,
        "users": stats["users"], "timed_steps": timer.steps, "seconds": timer.elapsed,
        "samples_per_s": timer.samples / timer.elapsed, "positions_per_s": timer.positions / timer.elapsed,
        "ms_per_step": 1000 * timer.elapsed / timer.steps, "embedding_rows": module.item_table.stats().size,
        "torch": torch.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", nargs="+", default=["hstu", "hstu-large"], choices=sorted(PRESETS))
    p.add_argument("--users", type=int, default=6040)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_throughput_<device>.json)")
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    rows = [run(args.device, name, args.users, args.steps, args.warmup, args.batch_size) for name in args.preset]
    print(f"\n{'device':<28}{'preset':<12}{'batch':>6}{'samples/s':>12}{'positions/s':>14}{'ms/step':>10}")
    for r in rows:
        print(f"{r['device_name'][:27]:<28}{r['preset']:<12}{r['batch_size']:>6}{r['samples_per_s']:>12.1f}{r['positions_per_s']:>14.0f}{r['ms_per_step']:>10.1f}")
    write_results("train_throughput", rows, args.out, device=args.device)


if __name__ == "__main__":
    main()
