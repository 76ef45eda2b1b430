"""The LightningModule: dense HSTU weights under DDP, item rows in a sharded dynamic table.

Manual optimization: each step looks up the batch's items and sampled negatives in the
table, runs the model, back-propagates once (DDP all-reduces dense gradients), steps
AdamW on the dense weights, and hands the embedding gradients to the table's fused
sparse optimizer (which routes them to the ranks owning the rows).
"""
import time
from pathlib import Path

import lightning as L
import torch

from kernels.dynamic_embedding import ShardedDynamicEmbedding, dump, load

from .config import HSTUConfig
from .hstu import HSTU, sampled_softmax_loss, valid_mask

EMBEDDING_DUMP_KEY = "embedding_dump"


class HSTULightningModule(L.LightningModule):
    def __init__(self, config: HSTUConfig, catalog: torch.Tensor, checkpoint_dir: str | Path | None = None):
        super().__init__()
        self.automatic_optimization = False
        self.config = config
        self.model = HSTU(config)
        self.register_buffer("catalog", catalog.to(torch.int64), persistent=False)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.item_table: ShardedDynamicEmbedding | None = None
        self._last_step_end: float | None = None

    def setup(self, stage: str) -> None:
        # after the process group exists, so the table knows its rank and world size
        if self.item_table is None:
            self.item_table = self._new_table()

    def _new_table(self) -> ShardedDynamicEmbedding:
        # the strategy's device: the module itself may not have moved there yet
        return ShardedDynamicEmbedding(self.config.embedding_config(), self.trainer.strategy.root_device)

    def configure_optimizers(self):
        c = self.config
        return torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)

    def sample_negatives(self) -> torch.Tensor:
        """Uniform draws from the catalog, different on every rank and step, reproducible."""
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.global_step * 1009 + self.global_rank)
        idx = torch.randint(len(self.catalog), (self.config.num_negatives,), generator=g)
        return self.catalog[idx.to(self.catalog.device)]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, ts, lengths = batch["item_ids"], batch["timestamps"], batch["lengths"]
        B, L = ids.shape
        mask = valid_mask(lengths, L)
        seq_ids = ids[mask]  # the batch's items, jagged
        negatives = self.sample_negatives()
        all_ids = torch.cat([seq_ids, negatives])
        rows = self.item_table.lookup(all_ids).requires_grad_(True)  # leaf: gradients land in rows.grad
        seq_rows, neg_rows = rows[: seq_ids.numel()], rows[seq_ids.numel() :]

        # the model reads positions 0..L-2; position t predicts item t+1
        in_len = (lengths - 1).clamp(min=0)
        emb = torch.zeros(B, L, self.config.embedding_dim, device=rows.device, dtype=rows.dtype)
        emb[mask] = seq_rows
        out = self.model(emb[:, :-1], ts[:, :-1], in_len) if L > 1 else emb[:, :0]
        row_of = torch.full((B, L), -1, dtype=torch.long, device=ids.device)
        row_of[mask] = torch.arange(seq_ids.numel(), device=ids.device)
        has_target = mask[:, 1:]
        targets = row_of[:, 1:][has_target]
        if targets.numel():
            loss = sampled_softmax_loss(
                out[has_target], seq_rows[targets], seq_ids[targets], neg_rows, negatives, self.config.temperature
            )
        else:  # no targets here: a zero that still touches every weight, so DDP's all-reduce runs
            loss = out.sum() * 0.0 + sum(p.sum() for p in self.model.parameters()) * 0.0 + rows.sum() * 0.0

        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.item_table.apply_gradients(all_ids, rows.grad)

        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, batch_size=B)
        self._log_throughput(B)
        return loss.detach()

    def _log_throughput(self, batch_size: int) -> None:
        now = time.perf_counter()
        if self._last_step_end is not None:
            global_batch = batch_size * self.trainer.world_size
            self.log("train/samples_per_s", global_batch / (now - self._last_step_end), on_step=True, batch_size=batch_size)
        self._last_step_end = now
        if self.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            for name, value in self.item_table.stats().as_metrics("emb/").items():
                self.log(name, value, on_step=True, rank_zero_only=True, batch_size=batch_size)

    def on_train_epoch_start(self) -> None:
        self._last_step_end = None  # the first step's time includes data start-up
        self.item_table.local.epoch = self.current_epoch  # the epoch_* eviction policies

    # ---- checkpoints: Lightning saves dense state; the table is dumped beside it ----------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.checkpoint_dir is None:
            raise RuntimeError("HSTULightningModule needs checkpoint_dir to save checkpoints")
        name = f"embeddings-step-{self.global_step:08d}"
        # replace: a crash after this dump but before its checkpoint left one behind
        dump(self.item_table, self.checkpoint_dir / name, metadata={"global_step": self.global_step}, replace=True)
        checkpoint[EMBEDDING_DUMP_KEY] = name

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.item_table = self._new_table()
        load(self.item_table, self.checkpoint_dir / checkpoint[EMBEDDING_DUMP_KEY])
