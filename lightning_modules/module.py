"""The LightningModules: HSTU, and the SASRec baseline trained on the same batches.

HSTU: dense weights under DDP, item rows in a sharded dynamic table (with item features,
a genre table beside it: item_embedding.py). Manual optimization: each step embeds the
batch's items and the step's negatives, runs the model, back-propagates once (DDP
all-reduces dense gradients), steps AdamW on the dense weights, and hands the embedding
gradients to the tables' fused sparse optimizers (which route them to the ranks owning
the rows). On GPUs the model's forward and backward replay CUDA graphs, with the loss
inside them where it is the full-catalog softmax (cuda_graphs.py; under DDP too: the
graphed backward hands each weight its gradient, and DDP's all-reduce hooks run on them
outside the graph); with that loss, one graph holds the whole dense step, the gradients'
average over the ranks and AdamW's update included (step_graph.py; DDP's own gradient
sync is then off). Only every log_every_n_steps-th step logs (a
log waits for the GPU). Under several processes the ranks agree on a SIGTERM one step
late, without a wait for the GPU per step (sigterm.py).

Both offer `rankers(catalog)`, what validation scores (callbacks.Validation).
"""
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from .callbacks import LOSS
from .config import HSTUConfig
from .cuda_graphs import GraphedHSTU
from .evaluate import HSTURanker, SASRecRanker
from .data import padded
from .hstu import HSTU, valid_mask
from .item_embedding import ItemEmbedding
from .item_features import ItemFeatures
from .losses import catalog_softmax_loss, sampled_softmax_loss
from .row_padding import pad_to_multiple
from .sasrec import SASRec, SASRecConfig, bce_loss, catalog_indices, negatives_outside_history
from .sigterm import defer_sigterm_broadcast
from .step_graph import GraphedTrainingStep

EMBEDDING_DUMP_KEY = "embedding_dump"


def step_generator(seed: int, step: int, rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for each run seed, step and rank, on `device`: a step's draws
    differ across ranks and steps, and repeat when the run is repeated or resumed (on the
    same kind of device: a CUDA generator draws other numbers than a CPU one)."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step * 1009 + rank)


def rows_gradient(rows: torch.Tensor, sources: torch.Tensor, x_grad: torch.Tensor, items_grad: torch.Tensor) -> torch.Tensor:
    """The gradient of a step's looked-up rows (the batch's items, then the catalog's)
    from those of the model's input rows x = rows[sources] and of the catalog's rows: what
    autograd's backward of the indexing and the split gives, in two launches (the model's
    step graph hands back the latter two)."""
    grad = torch.zeros_like(rows)
    grad[: rows.shape[0] - items_grad.shape[0]].index_add_(0, sources, x_grad)
    grad[rows.shape[0] - items_grad.shape[0] :] = items_grad
    return grad


def catalog_rows_gradient(at: torch.Tensor, sources: torch.Tensor, x_grad: torch.Tensor, items_grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the catalog's looked-up rows where the batch's rows are gathered from
    them (rows = cat([catalog rows[at], catalog rows]), x = rows[sources]), from those of x
    and of the catalog's rows: one launch, where autograd's backward of the gather and the
    concatenation is a dozen (each with its host dispatch) and a sort."""
    return items_grad.index_add(0, at[sources], x_grad.to(items_grad.dtype))


def count_optimizer_step(opt) -> None:
    """Counts an optimizer step that a step graph made, as a LightningOptimizer's step()
    counts one (Lightning's global step under manual optimization), without the step:
    its hooks around the step alone, not the strategy's and the precision plugin's calls
    and AdamW's pass over the weights, which would find no gradient (host time the GPU
    waits for at every step). A Lightning without those hooks gets the step itself."""
    before, after = getattr(opt, "_on_before_step", None), getattr(opt, "_on_after_step", None)
    if before is None or after is None:
        opt.step()
        return
    before()
    after()


STEP_GRAPH_UNDER_DDP = "step graphs under DDP"  # what the log says when they are made


class HSTULightningModule(L.LightningModule):
    def __init__(
        self, config: HSTUConfig, catalog: torch.Tensor, checkpoint_dir: str | Path | None = None,
        features: ItemFeatures | None = None,
    ):
        """features: the items' genres, used where config.item_features is set."""
        super().__init__()
        self.automatic_optimization = False
        self.config = config
        self.model = HSTU(config)
        self.register_buffer("catalog", catalog.to(torch.int64), persistent=False)
        # every rank reads the same catalog: DDP need not broadcast it before every forward
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, ["catalog"])
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.features = features if config.item_features else None
        self.items: ItemEmbedding | None = None
        self.graphed: GraphedHSTU | None = None  # the model's CUDA graphs, where setup makes them
        self.step_graph: GraphedTrainingStep | None = None  # the whole step's, where _graphed_step makes them
        # whether a step without graphs pads its rows to a multiple of config.row_multiple
        # (row_padding.py); None: on a GPU, decided in setup
        self.pad_rows: bool | None = None
        self._last_logged: float | None = None  # when _log_step last logged, and the samples trained since
        self._samples = 0

    def setup(self, stage: str) -> None:
        # after the process group exists, so the table knows its rank and world size
        if self.items is None:
            self.items = self._new_items()
        c, trainer = self.config, self.trainer
        on_cuda = trainer.strategy.root_device.type == "cuda"
        if self.pad_rows is None:
            self.pad_rows = on_cuda
        if self.graphed is None and c.cuda_graph_buckets and on_cuda:
            # a graph's batch is one process's: batch_size counts the sequences of all of them
            self.graphed = GraphedHSTU(self.model, c.batch_size // trainer.world_size, c.cuda_graph_buckets)

    def _new_items(self) -> ItemEmbedding:
        # the strategy's device: the module itself may not have moved there yet
        return ItemEmbedding(self.config, self.trainer.strategy.root_device, self.features)

    def configure_optimizers(self):
        c = self.config
        # on CUDA: one fused kernel, not one per tensor group, and capturable (step_graph.py)
        on_cuda = all(p.is_cuda for p in self.model.parameters())
        return torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay, fused=on_cuda or None,
                                 capturable=on_cuda)

    def sample_negatives(self) -> torch.Tensor:
        """The step's negatives, shared by every position: the whole catalog when it has
        no more than num_negatives items (the loss is then the full softmax), else
        num_negatives distinct items drawn uniformly, different on every rank and step,
        reproducible. Drawn where the catalog is: a permutation of a catalog of a million
        items takes the host about 5 ms, with the GPU waiting on it (train_throughput.md)."""
        n = self.config.num_negatives
        if n >= len(self.catalog):
            return self.catalog
        device = self.catalog.device
        g = step_generator(self.config.seed, self.global_step, self.global_rank, device)
        return self.catalog[torch.randperm(len(self.catalog), generator=g, device=device)[:n]]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # a jagged batch (data.jagged_batch): the model reads every row but each sequence's
        # last, and row r's output predicts row r + 1
        ids, sources = batch["item_ids"], batch["input_rows"]
        negatives = self.sample_negatives()
        looked, rows, at = self._look_up(ids, negatives)
        seq_rows, neg_rows = rows[: ids.numel()], rows[ids.numel() :]
        inputs = (seq_rows[sources], batch["timestamps"][sources], batch["input_offsets"])
        targets = sources + 1
        step_graph = self._graphed_step()  # (made at the same step on every rank, whatever its batch)
        if negatives is self.catalog:  # the full softmax, in the model's graphs where it has them
            index = torch.searchsorted(self.catalog, ids[targets])
            # (called without targets too: every rank captures the graphs at the same step)
            done = step_graph(*inputs, neg_rows, index, self.config.temperature) if step_graph is not None else None
            if done is not None:  # the whole step replayed: the weights are updated
                loss, x_grad, emb_grad = done
                if at is None:
                    looked_rows, grad = rows, rows_gradient(rows, sources, x_grad, emb_grad)
                else:  # the batch's rows were gathered from the catalog's: straight to those
                    looked_rows, grad = looked.embeddings, catalog_rows_gradient(at, sources, x_grad, emb_grad)
                if looked_rows.is_leaf and looked_rows.grad is None:  # the item rows alone: what backward would leave in .grad
                    looked_rows.grad = grad
                else:  # through the pooled genres too
                    looked_rows.backward(grad)
                return self._step(loss, looked, batch, dense_done=True)
            if targets.numel():
                if self.graphed is not None:
                    loss = self.graphed.catalog_loss(*inputs, neg_rows, index, self.config.temperature)
                else:
                    loss = catalog_softmax_loss(self.model(*inputs), neg_rows, index, self.config.temperature)
                return self._step(loss, looked, batch)
        P = targets.numel()
        if self.pad_rows and self.graphed is None and self.config.row_multiple:
            inputs = pad_to_multiple(*inputs, self.config.row_multiple, self.config.max_seq_len)
        out = (self.graphed or self.model)(*inputs)  # (P rows, then any padding rows, D)
        if P:
            pad = out.shape[0] - P
            loss = sampled_softmax_loss(
                out, F.pad(seq_rows[targets], (0, 0, 0, pad)), F.pad(ids[targets], (0, pad)), neg_rows, negatives,
                self.config.temperature, real_rows=P, compile=self.config.compile_blocks,
            )
        else:  # no targets here: a zero that still touches every weight, so DDP's all-reduce runs
            loss = out.sum() * 0.0 + sum(p.sum() for p in self.model.parameters()) * 0.0 + rows.sum() * 0.0
        return self._step(loss, looked, batch)

    def _look_up(self, ids: torch.Tensor, negatives: torch.Tensor):
        """The training lookup of a step's items and negatives: (the lookup, whose rows are
        leaves that collect their gradients; the rows of ids then negatives). Under several
        processes with the catalog as negatives, the catalog alone is looked up, as a static
        lookup (its routing kept: no wait for the exchange's counts), and the batch's rows
        are gathered from its rows: the tables see the same distinct ids as a lookup of
        both (every training item is in the catalog, checked without a wait). The third
        value: each batch item's place in the catalog where its row was gathered so, else
        None."""
        if negatives is not self.catalog or self.trainer.world_size == 1:
            looked = self.items.lookup(torch.cat([ids, negatives]), train=True)
            return looked, looked.embeddings, None
        looked = self.items.lookup(self.catalog, train=True, static=True)
        at = torch.searchsorted(self.catalog, ids).clamp_(max=len(self.catalog) - 1)
        torch._assert_async((self.catalog[at] == ids).all(), "a training item is not in the catalog")
        return looked, torch.cat([looked.embeddings[at], looked.embeddings]), at

    def _graphed_step(self) -> GraphedTrainingStep | None:
        """The step graphs, where the model has graphs and the loss is the full softmax
        (what they compute), under one process, or under DDP over NCCL where the config's
        ddp_step_graph is set; made at the first step, after the optimizer. Under DDP the
        graphs average the gradients themselves, so DDP's own gradient sync is turned off
        for good, and _step averages the gradients of a step no graph serves
        (step_graph.py). Not where the optimizer cannot be captured: a checkpoint's
        optimizer settings replace configure_optimizers' when a run resumes, and one saved
        by a CPU run, or before AdamW was made capturable, keeps them."""
        several = self.trainer.world_size > 1
        if self.step_graph is not None or self.graphed is None or self.config.num_negatives < len(self.catalog):
            return self.step_graph
        if several and not self.config.ddp_step_graph:
            return None
        opt = self.optimizers().optimizer
        if not all(group["capturable"] for group in opt.param_groups):
            return None
        if not several:
            self.step_graph = GraphedTrainingStep(self.graphed, opt)
            return self.step_graph
        ddp = self.trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel) and dist.get_backend() == "nccl":
            ddp.require_backward_grad_sync = False
            self.step_graph = GraphedTrainingStep(self.graphed, opt, group=dist.group.WORLD)
            rank_zero_info(f"{STEP_GRAPH_UNDER_DDP}: the dense step and the gradients' all-reduce over "
                           f"{self.trainer.world_size} processes in one CUDA graph per bucket")
        return self.step_graph

    def _step(self, loss: torch.Tensor, looked, batch: dict[str, torch.Tensor], dense_done: bool = False) -> torch.Tensor:
        """The step's backward, dense and sparse updates, and logs. dense_done: a step graph
        did the backward and the dense update already."""
        opt = self.optimizers()
        if dense_done:  # no weight has a gradient: AdamW's step and zero_grad would change nothing
            count_optimizer_step(opt)
        else:
            self.manual_backward(loss)
            if self.step_graph is not None:  # (under DDP its sync is off: the step graph's averaging, eagerly)
                self.step_graph.average_gradients()
            opt.step()
            opt.zero_grad()  # no gradient outlives its step: a step graph's optimizer step must see none
        self.items.apply_gradients(looked)

        self._log_step(loss, len(batch["lengths"]))
        return loss.detach()

    def _log_step(self, loss: torch.Tensor, batch_size: int) -> None:
        """Every log_every_n_steps steps (the steps whose logs Lightning hands its loggers;
        a value logged makes the host wait for the device, which at every step would stall
        the GPU): the loss, samples/s over the steps since the last logged one, and the
        tables' statistics. The loss goes through self.log (the progress bar, Lightning's
        step metrics); the others are numbers on the host already, handed to the loggers
        at the step Lightning logs the loss at: self.log would copy each to the device and
        update a metric object there, host time that the logged steps' GPU waits for
        (benchmarks/train_throughput.md). The loss goes to self.log as a host copy (the
        logged step's one wait): Lightning reads the progress bar's values back at every
        step until the epoch ends, and a read of a device tensor would make every step
        after the first logged one wait for the device."""
        self._samples += batch_size * self.trainer.world_size
        if self.global_step % max(1, self.trainer.log_every_n_steps):
            return
        self.log(LOSS, loss.detach().float().cpu(), prog_bar=True, on_step=True, batch_size=batch_size)
        now = time.perf_counter()
        values = {}
        if self._last_logged is not None:
            values["train/samples_per_s"] = self._samples / (now - self._last_logged)
        self._last_logged, self._samples = now, 0
        values |= self.items.metrics("emb/")  # (summed over the ranks: every rank takes part)
        if self.trainer.is_global_zero:
            # Lightning's step for this step's logs (the steps before this one; its count of
            # them where this Lightning keeps it)
            step = getattr(self.trainer.fit_loop.epoch_loop, "_batches_that_stepped", self.global_step - 1)
            for logger in self.loggers:
                logger.log_metrics(values, step=step)

    def on_train_start(self) -> None:
        defer_sigterm_broadcast(self.trainer)  # the ranks agree on a SIGTERM without a host wait per step

    def on_train_end(self) -> None:
        if self.step_graph is not None and self.step_graph.group is not None:
            self.step_graph.release()  # its graphs hold NCCL's collectives: gone before the process group

    def on_train_epoch_start(self) -> None:
        self._last_logged, self._samples = None, 0  # the first step's time includes data start-up
        self.items.set_epoch(self.current_epoch)  # the epoch_* eviction policies

    def rankers(self, catalog: torch.Tensor) -> dict:
        """What validation scores: the model over its item embeddings (collective: every
        rank reads the catalog's rows)."""
        return {"model": HSTURanker(self.model, self.items, catalog, self.device)}

    # ---- checkpoints: Lightning saves dense state; the tables are dumped beside it ---------
    def dump_name(self) -> str:
        """The embedding dump the next checkpoint writes beside itself (item_embedding.py
        says where each table goes in it)."""
        return f"embeddings-step-{self.global_step:08d}"

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.checkpoint_dir is None:
            raise RuntimeError("HSTULightningModule needs checkpoint_dir to save checkpoints")
        name = self.dump_name()
        # replace: a crash after this dump but before its checkpoint left one behind
        self.items.dump(self.checkpoint_dir / name, metadata={"global_step": self.global_step}, replace=True)
        checkpoint[EMBEDDING_DUMP_KEY] = name

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.items = self._new_items()
        self.items.load(self.checkpoint_dir / checkpoint[EMBEDDING_DUMP_KEY])


class SASRecLightningModule(L.LightningModule):
    """SASRec trained as published: Adam on every weight (the item embedding included),
    binary cross-entropy with one negative per position. Items are numbered by their
    place in `catalog` (the training split's items, sorted)."""

    def __init__(self, config: SASRecConfig, catalog: torch.Tensor):
        super().__init__()
        self.config = config
        self.model = SASRec(config)
        self.register_buffer("catalog", catalog.to(torch.int64), persistent=False)

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=self.config.lr, betas=self.config.betas)

    def on_train_start(self) -> None:
        defer_sigterm_broadcast(self.trainer)

    def indices(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Raw ids (B, L) → catalog indices 1..M, 0 at padding."""
        return catalog_indices(self.catalog, ids) * valid_mask(lengths, ids.shape[1])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        items = self.indices(padded(batch["item_ids"], batch["lengths"]), batch["lengths"])
        B, L = items.shape
        in_len = (batch["lengths"] - 1).clamp(min=0)
        hidden = self.model(items[:, :-1], in_len) if L > 1 else items.new_zeros(B, 0, self.config.hidden_dim).float()
        targets, mask = items[:, 1:], valid_mask(in_len, max(L - 1, 0))
        if not mask.any():  # no targets: a zero that still touches every weight, for DDP
            return sum(p.sum() for p in self.model.parameters()) * 0.0
        history = torch.zeros(B, self.config.num_items + 1, dtype=torch.bool, device=items.device)
        history.scatter_(1, items, True)
        g = step_generator(self.config.seed, self.global_step, self.global_rank)
        negatives = negatives_outside_history(targets, self.config.num_items, history, g)
        loss = bce_loss(hidden, targets, negatives, self.model.items.weight, mask)
        self.log(LOSS, loss.detach(), prog_bar=True, on_step=True, batch_size=B)
        return loss

    def rankers(self, catalog: torch.Tensor) -> dict:
        return {"model": SASRecRanker(self.model, self.catalog.cpu(), catalog, self.device)}
