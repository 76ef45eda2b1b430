"""Training callbacks: validation after each epoch with early stopping, checkpoints
(every epoch, keeping the best one, and every N steps or M minutes within an epoch), and
the garbage collector's view of the objects alive when training starts (FrozenSetup).

`Validation` runs first at the end of an epoch: it logs `val/*`, tracks the best value of
its monitored metric and stops training once that has not improved for `patience`
validations, or once the last logged training loss is not finite on any rank (a diverged
run: its weights and rows are NaN from then on). `EpochCheckpoint`, after it in the
trainer's callback list, saves the epoch and keeps it as the best checkpoint when the
validation just improved.
"""
import gc
import os
import shutil
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

from kernels.files import fsync_path

from .evaluate import catalog_of, evaluate_rankers, whole_histories
from .rank_zero_flag import DeferredFlag

CHECKPOINT_PATTERNS = ("epoch=*.ckpt", "step=*.ckpt")  # each epoch's; the newest within an epoch
DUMP_PATTERN = "embeddings-step-*"
LEFTOVER_PATTERNS = (".*.partial*", ".*.old")  # what an interrupted checkpoint or dump leaves
LOSS = "train/loss"  # the training loss the modules log, which Validation checks for divergence


class Validation(Callback):
    """Full-ranking metrics of the module's ranker on the `valid` split (a fixed sample of
    max_users users where larger) every `every` epochs and after the last, logged as
    val/<metric> (val/ndcg_at_10, ...). Every rank scores its share of the users; the
    metrics, and so the decision to stop, are the same on all of them. `monitor` (higher is better) picks the
    best validation; with `patience`, training stops after that many validations without
    a better one."""

    def __init__(
        self, data_dir: str | Path, every: int = 1, max_users: int | None = 10_000, monitor: str = "ndcg@10",
        patience: int | None = None,
    ):
        self.data_dir, self.every, self.max_users = Path(data_dir), every, max_users
        self.monitor, self.patience = monitor, patience
        self.catalog = catalog_of(self.data_dir)
        self.histories = whole_histories(self.data_dir, "valid")  # read once, not every epoch
        self.best_value: float | None = None
        self.best_epoch: int | None = None
        self.since_best = 0  # validations since the best
        self.improved = False  # the last epoch's validation was the best so far

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        self.improved = False
        if (epoch + 1) % self.every and epoch + 1 != trainer.max_epochs:
            return
        module.eval()
        try:
            metrics = evaluate_rankers(module.rankers(self.catalog), self.histories, self.catalog, self.max_users)["model"]
        finally:
            module.train()
        for name, value in metrics.items():
            if name != "users":  # named as the pipeline's test metrics: val/ndcg_at_10
                # Every rank holds the same all-reduced value; sync_dist averages equal numbers.
                module.log(f"val/{name.replace('@', '_at_')}", value, on_epoch=True, sync_dist=True)
        value = metrics[self.monitor]
        if self.best_value is None or value > self.best_value:
            self.best_value, self.best_epoch, self.since_best, self.improved = value, epoch, 0, True
        else:
            self.since_best += 1
        if self.patience is not None and self.since_best >= self.patience:
            trainer.should_stop = True
        loss = trainer.callback_metrics.get(LOSS)
        diverged = trainer.strategy.reduce_boolean_decision(loss is not None and not bool(loss.isfinite().all()), all=False)
        if diverged:
            trainer.should_stop = True
        if trainer.is_global_zero:
            shown = "  ".join(f"{k} {metrics[k]:.4f}" for k in ("hr@10", "ndcg@10", "hr@50", "mrr"))
            note = " (best)" if self.improved else f" (best: epoch {self.best_epoch})"
            print(f"epoch {epoch}: validation {shown}, {metrics['users']} users{note}", flush=True)
            if diverged:
                print(f"epoch {epoch}: {LOSS} is not finite (training diverged): stopping; the best validated "
                      f"checkpoint is epoch {self.best_epoch}'s", flush=True)

    def state_dict(self) -> dict:
        return {"best_value": self.best_value, "best_epoch": self.best_epoch, "since_best": self.since_best}

    def load_state_dict(self, state: dict) -> None:
        self.best_value, self.best_epoch, self.since_best = state["best_value"], state["best_epoch"], state["since_best"]


class EpochCheckpoint(Callback):
    """Saves `epoch=N.ckpt` after every epoch, renamed into place once complete, keeps the
    newest `keep` checkpoints, and keeps the best one by `validation` (the epoch whose
    validation was the best so far), each with its embedding dump. `best_path` names the
    best checkpoint (None before any validation).

    Within an epoch, every `every_steps` steps or `every_minutes` minutes (whichever comes
    first; None: never) it also saves `step=S.ckpt` the same way, keeping only the newest:
    a job killed mid-epoch resumes from there (latest_checkpoint). Rank 0's clock decides
    for every rank; under several processes at the step after it says so."""

    def __init__(
        self, directory: Path, validation: Validation | None = None, keep: int = 2,
        every_steps: int | None = None, every_minutes: float | None = None,
    ):
        self.directory, self.validation, self.keep = Path(directory), validation, keep
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.best_name: str | None = None
        self.dumps: dict[str, str] = {}  # checkpoint name -> the embedding dump it names
        self._last_save = time.monotonic()
        self._clock: DeferredFlag | None = None  # rank 0's clock under several processes

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Removes what a job killed mid-checkpoint left: hidden partial files and dump
        directories (never loaded: only complete ones are renamed into place)."""
        if trainer.is_global_zero:
            for left in [p for pattern in LEFTOVER_PATTERNS for p in self.directory.glob(pattern)]:
                shutil.rmtree(left) if left.is_dir() else left.unlink()
        trainer.strategy.barrier()

    @property
    def best_path(self) -> Path | None:
        return self.directory / self.best_name if self.best_name else None

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        final = self.directory / f"epoch={trainer.current_epoch:04d}.ckpt"
        if self.validation is not None and self.validation.improved:
            self.best_name = final.name
        self._save(trainer, module, final)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        due = bool(self.every_steps) and step % self.every_steps == 0
        several = trainer.world_size > 1
        if self.every_minutes:
            # rank 0's clock decides, so that every rank saves at the same step; under several
            # processes a step late (rank_zero_flag.py), so that no step waits for the GPU
            if several and self._clock is None:
                self._clock = DeferredFlag(trainer.strategy.root_device)
            due = due or (self._clock.read() if several else self._clock_due())
        if due and step > 0:
            self._save(trainer, module, self.directory / f"step={step:08d}.ckpt")
        if self.every_minutes and several:  # (after any save: its time restarts the clock)
            self._clock.post(self._clock_due())

    def _clock_due(self) -> bool:
        return time.monotonic() - self._last_save >= 60 * self.every_minutes

    def _save(self, trainer: L.Trainer, module: L.LightningModule, final: Path) -> None:
        dump = getattr(module, "dump_name", lambda: None)()
        if dump:
            self.dumps[final.name] = dump  # before saving: the saved state knows its own dump
        tmp = final.with_name(f".{final.name}.partial")
        trainer.save_checkpoint(tmp, weights_only=False)  # every rank: the module dumps its table shard
        if trainer.is_global_zero:
            fsync_path(tmp)  # on disk before its name says it is complete
            os.replace(tmp, final)
            self._prune(keep_step=final.name if final.name.startswith("step=") else None)
        # no rank goes on before the checkpoint is in place: after the last epoch every rank
        # loads the best one (train.py), and a rank past a prune could read a removed dump
        trainer.strategy.barrier()
        self._last_save = time.monotonic()

    def _prune(self, keep_step: str | None = None) -> None:
        """Keeps the newest `keep` epoch checkpoints and the best, the newest step
        checkpoint if it is newer than every epoch's, and the dumps they name."""
        ckpts = sorted(self.directory.glob("epoch=*.ckpt"))
        keep = {p.name for p in ckpts[-self.keep :]} | ({self.best_name} if self.best_name else set())
        if keep_step is not None:
            keep.add(keep_step)
        for old in ckpts + sorted(self.directory.glob("step=*.ckpt")):
            if old.name not in keep:
                old.unlink()
        self.dumps = {c: d for c, d in self.dumps.items() if c in keep}
        for dump in self.directory.glob(DUMP_PATTERN):
            if dump.name not in self.dumps.values():
                shutil.rmtree(dump)

    def state_dict(self) -> dict:
        return {"best_name": self.best_name, "dumps": dict(self.dumps)}

    def load_state_dict(self, state: dict) -> None:
        self.best_name, self.dumps = state["best_name"], dict(state["dumps"])


class FrozenSetup(Callback):
    """Every object alive when training starts (the libraries', the modules', the data's:
    about half a million in a training process) collected once and moved to the garbage
    collector's permanent generation (gc.freeze), so that no collection during the steps
    scans them again: a full collection of them takes about 0.5 s on this project's CPU
    machines, and the first collection of the middle generation inside the steps took 10
    ms at `hstu` there against 0.8 ms frozen (benchmarks/train_throughput.md). Under several
    processes one rank's pause holds every rank at the next collective. Objects made
    later are collected as usual; unfrozen when training ends."""

    def on_train_start(self, trainer, pl_module):
        gc.collect()
        gc.freeze()

    def on_train_end(self, trainer, pl_module):
        gc.unfreeze()

    def on_exception(self, trainer, pl_module, exception):
        gc.unfreeze()


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint, of an epoch or within one (rank 0 writes them one
    after another, each renamed into place once complete: the newest file is the latest)."""
    found = [p for pattern in CHECKPOINT_PATTERNS for p in directory.glob(pattern)]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None
