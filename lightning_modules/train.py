"""The training worker: the command every `torchrun` process runs, locally or in a PyTorchJob.

    torchrun --nproc-per-node N -m lightning_modules.train --data-dir D --out-dir O ...

torchrun (or a PyTorchJob's PET_* variables) sets up the processes; Lightning sees a
TorchElastic environment and runs DDP over gloo (CPU) or NCCL (GPU). The run resumes from
the newest checkpoint in `<out-dir>/checkpoints`, and ends by writing `<out-dir>/model`.
MLflow is used only when a tracking URI is given.
"""
import argparse
import os
import re
import shutil
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from . import model_files
from .config import PRESETS, preset
from .data import SequenceDataModule
from .module import HSTULightningModule

CHECKPOINT_RE = re.compile(r"epoch=(\d+)\.ckpt$")


class EpochCheckpoint(Callback):
    """Saves `epoch=N.ckpt` after every epoch, renamed into place once complete, and keeps
    the newest `keep` checkpoints with their embedding dumps."""

    def __init__(self, directory: Path, keep: int = 2):
        self.directory, self.keep = directory, keep

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        final = self.directory / f"epoch={trainer.current_epoch:04d}.ckpt"
        tmp = final.with_name(f".{final.name}.partial")
        trainer.save_checkpoint(tmp, weights_only=False)  # every rank: the module dumps its table shard
        if trainer.is_global_zero:
            os.replace(tmp, final)
            # one dump per checkpoint, both named in increasing order
            for pattern in ("epoch=*.ckpt", "embeddings-step-*"):
                for old in sorted(self.directory.glob(pattern))[: -self.keep]:
                    shutil.rmtree(old) if old.is_dir() else old.unlink()


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted((int(m.group(1)), p) for p in directory.glob("epoch=*.ckpt") if (m := CHECKPOINT_RE.search(p.name)))
    return found[-1][1] if found else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hstu-train", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="output of the prepare step")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--preset", default="hstu", choices=sorted(PRESETS))
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1, help="stop early (benchmarks, smoke tests)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--max-seq-len", type=int)
    p.add_argument("--num-negatives", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--dropout", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    p.add_argument("--log-every", type=int, default=1, help="steps between metric logs")
    p.add_argument("--tracking-uri", help="MLflow tracking URI; no MLflow without it")
    p.add_argument("--run-id", help="MLflow run to log into")
    p.add_argument("--no-progress-bar", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    config = preset(args.preset).override(
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        num_negatives=args.num_negatives,
        lr=args.lr,
        dropout=args.dropout,
        seed=args.seed,
    )
    L.seed_everything(config.seed, workers=True, verbose=False)
    out = Path(args.out_dir)
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    logger = False
    if args.tracking_uri:
        from lightning.pytorch.loggers import MLFlowLogger  # imports mlflow only when asked

        logger = MLFlowLogger(experiment_name="hstu", tracking_uri=args.tracking_uri, run_id=args.run_id)
        logger.log_hyperparams({f"model/{k}": v for k, v in config.to_dict().items()})

    data = SequenceDataModule(args.data_dir, config.max_seq_len, config.batch_size)
    module = HSTULightningModule(config, data.catalog(), checkpoint_dir=ckpt_dir)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=per_node,
        num_nodes=max(1, world // per_node),
        strategy="ddp" if world > 1 else "auto",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=logger,
        log_every_n_steps=args.log_every,
        enable_checkpointing=False,
        callbacks=[EpochCheckpoint(ckpt_dir)],
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    resume = latest_checkpoint(ckpt_dir)
    if resume and trainer.is_global_zero:
        print(f"resuming from {resume}", flush=True)
    trainer.fit(module, datamodule=data, ckpt_path=resume, weights_only=True)
    return model_files.save(
        out / "model", module.model, module.item_table, metadata={"global_step": trainer.global_step}
    )


if __name__ == "__main__":
    main()
