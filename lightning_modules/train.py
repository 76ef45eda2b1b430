"""The training worker: the command every `torchrun` process runs, locally or in a PyTorchJob.

    torchrun --nproc-per-node N -m lightning_modules.train --data-dir D --out-dir O ...

torchrun (or a PyTorchJob's PET_* variables) sets up the processes; Lightning sees a
TorchElastic environment and runs DDP over gloo (CPU) or NCCL (GPU). After every epoch
the model is validated on the `valid` split (full ranking) and checkpointed; training
stops at --epochs, or once validation NDCG@10 has not improved for --patience
validations, and `<out-dir>/model` is written from the best validated checkpoint. The
run resumes from the newest checkpoint in `<out-dir>/checkpoints`. --model sasrec trains
the SASRec baseline the same way. MLflow is used only when a tracking URI is given.
"""
import argparse
import os
from pathlib import Path

import lightning as L
import torch

from . import model_files
from .arguments import FRACTION, NON_NEGATIVE, POSITIVE, POSITIVE_NUMBER, at_least
from .callbacks import EpochCheckpoint, FrozenSetup, Validation, latest_checkpoint
from .config import PRESETS, preset
from .data_module import SequenceDataModule
from .datasets import DataError, check_prepared
from .flops import sequence_cost
from .item_features import ITEMS_FILE, ItemFeatures
from .module import HSTULightningModule, SASRecLightningModule
from .sasrec import SASRecConfig

MODELS = ("hstu", "sasrec")
MONITOR = "ndcg@10"  # the validation metric that picks the best checkpoint
GPU_LOADER_WORKERS = 4  # loader processes per training process on a GPU: batches built ahead
GPU_LOG_EVERY = 50  # steps between metric logs on GPUs: a log waits for the GPU to read its values


def precision_for(accelerator: str, precision: str = "auto") -> str:
    """Lightning's precision setting: bf16 autocast on GPUs, float32 on CPUs, or as given."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if accelerator == "gpu" else "32-true"


def strategy_for(world: int, **ddp_options):
    """Lightning's strategy for `world` processes: the single-device default for one, else
    DDP with the gradients as views of its all-reduce buckets, so that the averaged buckets
    are not copied back into the gradients every step (a device copy per weight tensor);
    ddp_options go to DDPStrategy as well."""
    if world <= 1:
        return "auto"
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(gradient_as_bucket_view=True, **ddp_options)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hstu-train", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="output of the prepare step")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--model", default="hstu", choices=MODELS, help="HSTU, or the SASRec baseline")
    p.add_argument("--preset", default="hstu", choices=sorted(PRESETS))
    p.add_argument("--epochs", type=POSITIVE, default=1, help="the most epochs to train")
    p.add_argument("--patience", type=NON_NEGATIVE, default=None,
                   help="stop once validation has not improved for this many validations (default: never)")
    p.add_argument("--val-every", type=POSITIVE, default=1, help="epochs between validations")
    p.add_argument("--val-users", type=POSITIVE, default=10_000, help="validate on a fixed sample of this many users at most")
    p.add_argument("--max-steps", type=at_least(-1), default=-1, help="stop early (benchmarks, smoke tests)")
    p.add_argument("--batch-size", type=POSITIVE, help="sequences per step, over all processes")
    p.add_argument("--max-seq-len", type=POSITIVE)
    p.add_argument("--num-negatives", type=POSITIVE)
    p.add_argument("--lr", type=POSITIVE_NUMBER)
    p.add_argument("--dropout", type=FRACTION)
    p.add_argument("--seed", type=int)
    p.add_argument("--cuda-graph-buckets", type=NON_NEGATIVE,
                   help="on GPUs, CUDA graphs of the model's training step, one per bucket of padded rows (0: none; default: the preset's)")
    p.add_argument("--row-multiple", type=NON_NEGATIVE,
                   help="on GPUs, a step the graphs do not serve pads its rows up to a multiple of this (0: none; default: the preset's)")
    p.add_argument("--compile-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="each block's work around the attention through torch.compile (default: the preset's setting)")
    p.add_argument("--compile-model", action=argparse.BooleanOptionalAction, default=None,
                   help="the whole model's forward as one torch.compile graph, the attention kernels as custom ops in it (default: the preset's setting)")
    p.add_argument("--layer-norm-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="the blocks' layer norms through kernels.layer_norm (default: the preset's setting)")
    p.add_argument("--norm-mul-dropout-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="on GPUs, each block's Dropout(LayerNorm(A V) ⊙ U) through kernels.norm_mul_dropout (default: the preset's setting)")
    p.add_argument("--ddp-step-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="under DDP on GPUs, the whole dense step in one CUDA graph, the gradients' all-reduce in it (default: the preset's setting)")
    p.add_argument("--item-features", action=argparse.BooleanOptionalAction, default=None,
                   help="pool each item's genres (items.parquet) into its embedding (default: the preset's setting)")
    p.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    p.add_argument("--precision", default="auto",
                   help="Lightning precision: auto is bf16-mixed (bf16 autocast) on GPUs and 32-true on CPUs")
    p.add_argument("--loader-workers", type=NON_NEGATIVE,
                   help="data loader worker processes per training process (default: 4 on GPUs, 0 on CPUs)")
    p.add_argument("--checkpoint-every", type=POSITIVE, default=None, metavar="STEPS",
                   help="also checkpoint every this many steps within an epoch (the newest one kept)")
    p.add_argument("--checkpoint-minutes", type=POSITIVE_NUMBER, default=None,
                   help="also checkpoint once this many minutes have passed since the last checkpoint")
    p.add_argument("--log-every", type=POSITIVE, default=None,
                   help="steps between metric logs (default: 1 on CPUs; 50 on GPUs, where each log reads values back from the GPU)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI; no MLflow without it")
    p.add_argument("--run-id", help="MLflow run to log into")
    p.add_argument("--no-progress-bar", action="store_true")
    return p.parse_args(argv)


def model_config(args, catalog_size: int):
    """HSTU's config (the preset with the flags given), or for --model sasrec SASRec's
    published settings with the flags given."""
    given = {"batch_size": args.batch_size, "max_seq_len": args.max_seq_len, "lr": args.lr, "dropout": args.dropout, "seed": args.seed}
    if args.model == "sasrec":
        return SASRecConfig(num_items=catalog_size, **{k: v for k, v in given.items() if v is not None})
    return preset(args.preset).override(
        num_negatives=args.num_negatives, item_features=args.item_features, cuda_graph_buckets=args.cuda_graph_buckets,
        row_multiple=args.row_multiple,
        compile_blocks=args.compile_blocks, compile_model=args.compile_model, layer_norm_kernel=args.layer_norm_kernel,
        norm_mul_dropout_kernel=args.norm_mul_dropout_kernel, ddp_step_graph=args.ddp_step_graph, **given
    )


def main(argv=None) -> Path:
    args = parse_args(argv)
    try:
        check_prepared(args.data_dir)
    except DataError as e:  # the message, not a reader's traceback, in every worker's log
        raise SystemExit(f"hstu-train: error: {e}") from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    out = Path(args.out_dir)
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"

    probe = SequenceDataModule(args.data_dir, 1, 1)
    catalog = probe.catalog()
    config = model_config(args, len(catalog))
    L.seed_everything(config.seed, workers=True, verbose=False)
    if config.batch_size % world:
        raise SystemExit(f"--batch-size {config.batch_size} does not split over {world} processes")
    workers = args.loader_workers if args.loader_workers is not None else (GPU_LOADER_WORKERS if accelerator == "gpu" else 0)
    balanced = args.model == "hstu" and config.balanced_batches
    data = SequenceDataModule(  # SASRec keeps its published sampling: each sequence's last window
        args.data_dir, config.max_seq_len, config.batch_size // world, num_workers=workers,
        random_windows=getattr(config, "random_windows", False), seed=config.seed,
        cost=sequence_cost(config, len(catalog)) if balanced else None,
    )
    if args.model == "hstu":
        features = ItemFeatures.read(args.data_dir) if config.item_features else None
        if config.item_features and features is None and int(os.environ.get("RANK", "0")) == 0:
            print(f"no {ITEMS_FILE} in {args.data_dir}: training without item features", flush=True)
        module = HSTULightningModule(config, catalog, checkpoint_dir=ckpt_dir, features=features)
    else:
        module = SASRecLightningModule(config, catalog)

    logger, monitor = False, None
    if args.tracking_uri:
        from .tracking_logger import BufferedMLFlowLogger, limit_http_retries, start_system_metrics  # mlflow only when asked

        limit_http_retries()
        logger = BufferedMLFlowLogger(experiment_name="hstu", tracking_uri=args.tracking_uri, run_id=args.run_id)
        prefix = "model/" if args.model == "hstu" else f"{args.model}/"
        logger.log_hyperparams({f"{prefix}{k}": v for k, v in config.to_dict().items()})
        nodes = max(1, world // per_node)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and (args.run_id or int(os.environ.get("RANK", "0")) == 0):
            # one monitor per node: the machine's, not the process's, figures
            monitor = start_system_metrics(args.tracking_uri, args.run_id or logger.run_id,
                                           node=int(os.environ.get("GROUP_RANK", "0")) if nodes > 1 else None)

    validation = Validation(args.data_dir, args.val_every, args.val_users, MONITOR, args.patience)
    checkpoints = EpochCheckpoint(ckpt_dir, validation, every_steps=args.checkpoint_every, every_minutes=args.checkpoint_minutes)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=per_node,
        num_nodes=max(1, world // per_node),
        strategy=strategy_for(world),
        precision=precision_for(accelerator, args.precision),
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=logger,
        log_every_n_steps=args.log_every or (GPU_LOG_EVERY if accelerator == "gpu" else 1),
        enable_checkpointing=False,
        callbacks=[validation, checkpoints, FrozenSetup()],  # validation before checkpoints: see callbacks.py
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    resume = latest_checkpoint(ckpt_dir)
    if resume and trainer.is_global_zero:
        print(f"resuming from {resume}", flush=True)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=resume, weights_only=True)
    finally:
        if monitor is not None:
            from .tracking_logger import stop_system_metrics

            stop_system_metrics(monitor)
    best = checkpoints.best_path
    if best is not None:  # the model of the best validation, not the last epoch's
        if trainer.is_global_zero:
            print(f"best validation {MONITOR} {validation.best_value:.4f}: {best.name}", flush=True)
        state = torch.load(best, map_location=module.device, weights_only=True)
        module.load_state_dict(state["state_dict"])
        module.on_load_checkpoint(state)
    metadata = {"global_step": trainer.global_step, "best_checkpoint": best.name if best else None,
                f"best_val_{MONITOR}": validation.best_value, "seed": config.seed}
    if args.model == "hstu":
        return model_files.save(out / "model", module.model, module.items, metadata=metadata)
    if trainer.is_global_zero:
        model_files.save_sasrec(out / "model", module.model, catalog, metadata=metadata)
    if world > 1:
        torch.distributed.barrier()
    return out / "model"


if __name__ == "__main__":
    main()
