"""The HSTU model's training forward and backward, replayed from CUDA graphs.

At the paper's lengths the training step is bound by the host: the model is hundreds of
small kernels, each launched from Python (benchmarks/train_throughput.md). A CUDA graph
replays a whole forward, or a whole backward, as one launch. A graph has fixed shapes and
a jagged batch's row count varies, so each batch is padded up to a bucket: `buckets` row
counts evenly spaced up to batch_size · max_seq_len, every one captured
(torch.cuda.make_graphed_callables) at the first training call.

Padding keeps the batch a valid jagged batch (pad_jagged): empty sequences fill it up to
batch_size sequences, and the padding rows follow as sequences of their own, none longer
than max_seq_len. No real row attends to a padding row, and the padding rows' outputs are
dropped, so the real rows' outputs and every gradient are those of the unpadded batch.

Where the step's loss is the full-catalog softmax, the loss joins the model in the same
graphs (`catalog_loss`): its launches and autograd functions cost the host about as much
as the model's graph replays did (benchmarks/train_throughput.md). The loss of a padded
batch is that of its real rows (losses.padded_catalog_softmax_loss), whose count the
graph reads from the padded offsets.

Where the loss is the full-catalog softmax and the optimizer can be captured,
step_graph.py puts the whole step (this loss, the backward, the gradients' average over
the ranks and AdamW's update) in one graph per bucket instead; these graphs serve the
other cases.

Graphs replace only the training forward and backward with gradients to the input rows;
evaluation, CPU tensors and batches outside the buckets run the model as it is. These
graphs hold no collective: the graphed backward returns each weight's gradient and DDP's
all-reduce hooks fire on them as on an eager backward's.
"""
import bisect
import math

import torch
import torch.nn.functional as F
from torch import nn

from .hstu import HSTU
from .losses import catalog_softmax_loss, padded_catalog_softmax_loss
from .row_padding import pad_jagged


class _Captured(nn.Module):
    """The model as one bucket's graph sees it (make_graphed_callables replaces this
    module's forward, not the model's)."""

    def __init__(self, model: HSTU):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.model(x, timestamps, offsets)


class CapturedLoss(nn.Module):
    """The model and the full-catalog softmax loss of its outputs, as one bucket's graph
    sees them: the real rows' count is the padded offsets' entry at batch_slots (pad_jagged
    keeps the batch's end there)."""

    def __init__(self, model: HSTU, batch_slots: int, temperature: float):
        super().__init__()
        self.model, self.batch_slots, self.temperature = model, batch_slots, temperature

    def forward(self, x, timestamps, offsets, item_emb, target_index) -> torch.Tensor:
        out = self.model(x, timestamps, offsets)
        return padded_catalog_softmax_loss(out, item_emb, target_index, self.temperature, offsets[self.batch_slots])


class GraphedHSTU:
    """Calls `model` as the model itself is called, training forwards and backwards
    replayed from one CUDA graph per row bucket (module docstring). `batch_slots`: the
    most sequences a batch holds (the per-process batch size)."""

    def __init__(self, model: HSTU, batch_slots: int, buckets: int):
        if buckets < 1:
            raise ValueError(f"buckets must be at least 1, got {buckets}")
        self.model, self.batch_slots = model, batch_slots
        self.max_rows = batch_slots * model.config.max_seq_len
        step = math.ceil(self.max_rows / buckets)
        self.sizes = sorted({min(k * step, self.max_rows) for k in range(1, buckets + 1)})  # the buckets' rows
        self.graphs: dict[tuple, nn.Module] = {}  # (rows, autocast dtype or None) -> the graphed module
        # (rows, autocast dtype, items, temperature) -> the graphed model and loss
        self.loss_graphs: dict[tuple, nn.Module] = {}
        self.pool = None  # one memory pool for every bucket: a step replays one bucket's forward, then its backward

    def rows_for(self, rows: int) -> int:
        """The bucket a batch of `rows` (at most max_rows) rows is padded to: the smallest
        that holds it."""
        return self.sizes[bisect.bisect_left(self.sizes, rows)]

    def training_call(self, x: torch.Tensor) -> bool:
        """Whether a call on x is a training call on the GPU (the same on every rank of a
        step, whatever its batch)."""
        return self.model.training and torch.is_grad_enabled() and x.is_cuda and x.requires_grad

    def graphable(self, x: torch.Tensor, offsets: torch.Tensor) -> bool:
        """Whether a call on this batch replays a graph: a training call on the GPU whose
        batch fits the largest bucket."""
        return self.training_call(x) and x.shape[0] <= self.max_rows and offsets.numel() - 1 <= self.batch_slots

    def __call__(self, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if not self.graphable(x, offsets):
            return self.model(x, timestamps, offsets)
        P, rows, dtype = x.shape[0], self.rows_for(x.shape[0]), autocast_dtype()
        if (rows, dtype) not in self.graphs:
            self._capture_all(self.graphs, lambda rows: (rows, dtype), lambda: _Captured(self.model), x, timestamps, offsets, dtype)
        return self.graphs[(rows, dtype)](*self.padded(x, timestamps, offsets, rows))[:P]

    def catalog_loss(
        self, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, item_emb: torch.Tensor,
        target_index: torch.Tensor, temperature: float,
    ) -> torch.Tensor:
        """catalog_softmax_loss(model(x, timestamps, offsets), item_emb, target_index,
        temperature), the model and the loss replayed from one graph per row bucket for a
        training call (as __call__ replays the model alone)."""
        if not self.graphable(x, offsets) or not x.shape[0]:
            return catalog_softmax_loss(self.model(x, timestamps, offsets), item_emb, target_index, temperature)
        P, rows, dtype = x.shape[0], self.rows_for(x.shape[0]), autocast_dtype()

        def key(rows: int) -> tuple:
            return rows, dtype, item_emb.shape[0], temperature

        if key(rows) not in self.loss_graphs:
            extra = (item_emb.detach().requires_grad_(True), target_index.new_zeros(0))  # (copied per bucket)
            self._capture_all(self.loss_graphs, key, lambda: CapturedLoss(self.model, self.batch_slots, temperature),
                              x, timestamps, offsets, dtype, extra)
        # (padding rows' targets: any item; their queries are zeroed)
        loss = self.loss_graphs[key(rows)](*self.padded(x, timestamps, offsets, rows), item_emb, F.pad(target_index, (0, rows - P)))
        return loss.clone()  # the graph's output is overwritten by its next replay; a caller may keep the loss longer

    def _capture_all(
        self, graphs: dict, key, make, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor,
        dtype: torch.dtype | None, extra: tuple = (),
    ) -> None:
        """Captures every bucket's forward and backward of a module make() gives (one per
        bucket: make_graphed_callables replaces its forward) at once into graphs[key(rows)]
        (so that no capture, and no kernel tuning in its warm-up runs, lands in the middle
        of training), each on a batch of padding rows alone: a graph depends on the batch's
        shapes, not its values. extra: the module's arguments after the batch, copied for
        each bucket, those with a first dimension of 0 padded to its rows."""
        pool = self.graph_pool()
        with capture_autocast(dtype):
            for rows, sample in self.samples(x, timestamps, offsets, extra):
                graphs[key(rows)] = torch.cuda.make_graphed_callables(make(), sample, pool=pool)

    def padded(self, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, rows: int) -> tuple:
        """A batch padded to `rows` rows as the graphs take it (pad_jagged)."""
        return pad_jagged(x, timestamps, offsets, rows, self.batch_slots, self.model.config.max_seq_len)

    def samples(self, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, extra: tuple = ()):
        """(rows, a capture's arguments) for every bucket: a batch of padding rows alone
        shaped as (x, timestamps, offsets), x a leaf requiring gradients, then extra's
        tensors copied, those with a first dimension of 0 padded to the bucket's rows."""
        empty = (x[:0].detach(), timestamps[:0], offsets[:1])
        for rows in self.sizes:
            px, pts, poff = self.padded(*empty, rows)
            rest = tuple((F.pad(e, (0, rows)) if e.shape[0] == 0 else e.detach().clone()).requires_grad_(e.requires_grad) for e in extra)
            yield rows, (px.requires_grad_(True), pts, poff, *rest)

    def graph_pool(self):
        """The memory pool every graph made for this model captures into."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool


def capture_autocast(dtype: torch.dtype | None):
    """Autocast as a capture records it: at `dtype` (None: off), without autocast's cache
    of cast weights (a graph records the casts; it cannot use the cache)."""
    return torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=False)


def autocast_dtype() -> torch.dtype | None:
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
