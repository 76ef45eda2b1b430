"""The single-process training step replayed from CUDA graphs: the model, the full-catalog
softmax loss, the backward and the optimizer's update of the dense weights, one graph
per row bucket (cuda_graphs.GraphedHSTU's buckets and padding).

GraphedHSTU replays the forward and the backward as two graphs that autograd joins: each
step still runs autograd's engine over them, hands every weight its gradient (a copy per
weight) and steps the optimizer from Python, host work that bounds the paper presets'
steps (benchmarks/train_throughput.md). With one process nothing runs between the
backward and the update (under several, DDP's all-reduce does), so one graph holds all of
it. A replay leaves the weights and the optimizer's state updated and returns the loss
and the gradients of the graph's inputs (the input rows and the catalog's rows); the
caller takes those back to the looked-up embedding rows.

The update in the graph is the optimizer's own step (a capturable AdamW), captured with
the weights' gradients in the graph's buffers. Outside the graph no weight has a .grad,
so a step() of the optimizer (Lightning counts steps by it) changes nothing. Capturing
a bucket first runs a few steps on a side stream (kernel tuning, the optimizer's lazily
made state) and then puts the weights and the state back as they were. A graph holds the
state's tensors and the hyperparameters of the moment it was captured: after a
load_state_dict of the optimizer (new state tensors) or a change of a hyperparameter, the
next call captures again.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cuda_graphs import CapturedLoss, GraphedHSTU, autocast_dtype, capture_autocast

WARMUP_STEPS = 3  # steps run before a capture: kernel tuning, the optimizer's state
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")  # what a captured AdamW step holds as constants


@dataclass
class _Bucket:
    """One bucket's graph and the tensors it reads and writes."""
    x: torch.Tensor  # (rows, D) the input rows, a leaf: its .grad is the graph's
    timestamps: torch.Tensor
    offsets: torch.Tensor
    item_emb: torch.Tensor  # (M, D) the catalog's rows, a leaf: its .grad is the graph's
    target_index: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    loss: torch.Tensor | None = None
    weight_grads: list = field(default_factory=list)  # kept alive: the graph writes them


class GraphedTrainingStep:
    """One training step of `graphed`'s model on the full-catalog softmax loss, the
    update by `optimizer` (an AdamW over the model's weights, capturable), replayed from
    one CUDA graph per bucket (module docstring)."""

    def __init__(self, graphed: GraphedHSTU, optimizer: torch.optim.Optimizer):
        if not all(g["capturable"] for g in optimizer.param_groups):
            raise ValueError("GraphedTrainingStep needs an optimizer made with capturable=True")
        self.graphed, self.optimizer = graphed, optimizer
        self.buckets: dict[tuple, _Bucket] = {}  # (rows, autocast dtype, items, temperature) -> its bucket
        self._state, self._hyper = None, None  # the optimizer's state and hyperparameters the graphs hold

    def __call__(
        self, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, item_emb: torch.Tensor,
        target_index: torch.Tensor, temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """One step on a jagged batch (x (P, D), timestamps, offsets) and the catalog's rows
        item_emb (M, D) with each row's target's index in it: the weights updated, and
        returned the loss, the gradient of x and that of item_emb (views of the graph's
        buffers: read them before the next call). None where no graph serves (evaluation,
        CPU tensors, a batch larger than the buckets, no rows): the caller runs the step
        itself."""
        g = self.graphed
        if not g.graphable(x, offsets) or not x.shape[0]:
            return None
        hyper = tuple(tuple(group[k] for k in HYPERPARAMETERS) for group in self.optimizer.param_groups)
        if self._state is not self.optimizer.state or self._hyper != hyper:
            self.buckets.clear()  # graphs of other state tensors or constants
            self._state, self._hyper = self.optimizer.state, hyper
        P, rows, dtype = x.shape[0], g.rows_for(x.shape[0]), autocast_dtype()

        def key(rows: int) -> tuple:
            return rows, dtype, item_emb.shape[0], temperature

        if key(rows) not in self.buckets:
            self._capture_all(key, x, timestamps, offsets, item_emb, target_index, dtype, temperature)
        b = self.buckets[key(rows)]
        px, pts, poff = g.padded(x.detach(), timestamps, offsets, rows)
        b.x.detach().copy_(px)
        b.timestamps.copy_(pts)
        b.offsets.copy_(poff)
        b.item_emb.detach().copy_(item_emb.detach())
        b.target_index.copy_(F.pad(target_index, (0, rows - P)))  # padding rows: any item (their queries are zeroed)
        b.graph.replay()
        return b.loss.clone(), b.x.grad[:P], b.item_emb.grad

    def _capture_all(self, key, x, timestamps, offsets, item_emb, target_index, dtype, temperature) -> None:
        """Captures every bucket's step at once (no capture, and no kernel tuning, in the
        middle of training), each on a batch of padding rows alone: a graph depends on the
        shapes, not the values. The warm-up steps' changes to the weights and the
        optimizer's state are undone before each capture."""
        g = self.graphed
        pool = g.graph_pool()
        module = CapturedLoss(g.model, g.batch_slots, temperature)
        saved = self._saved()
        extra = (item_emb.detach().requires_grad_(True), target_index.new_zeros(0))  # (copied per bucket)
        with capture_autocast(dtype):
            for rows, sample in g.samples(x, timestamps, offsets, extra):
                b = _Bucket(*sample)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_STEPS):
                        self._step(module, b)
                torch.cuda.current_stream().wait_stream(side)
                self._restore(saved)
                b.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(b.graph, pool=pool):
                    b.loss = self._step(module, b).detach()  # (no autograd graph kept alive past the capture)
                b.weight_grads = [p.grad for p in self._params()]
                self.buckets[key(rows)] = b
        self.optimizer.zero_grad(set_to_none=True)  # outside the graphs no weight has a gradient

    def _step(self, module: CapturedLoss, b: _Bucket) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        b.x.grad = b.item_emb.grad = None
        loss = module(b.x, b.timestamps, b.offsets, b.item_emb, b.target_index)
        loss.backward()
        self.optimizer.step()
        return loss

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _saved(self) -> tuple[list, dict]:
        state = {p: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in self.optimizer.state.items()}
        return [(p, p.detach().clone()) for p in self._params()], state

    @torch.no_grad()
    def _restore(self, saved: tuple[list, dict]) -> None:
        """The weights and the optimizer's state as saved, in place (the graphs hold their
        addresses); state the warm-up made anew is zeroed, as AdamW makes it."""
        params, state = saved
        for p, value in params:
            p.copy_(value)
        for p, s in self.optimizer.state.items():
            for k, v in s.items():
                if torch.is_tensor(v) and p in state:
                    v.copy_(state[p][k])
                elif torch.is_tensor(v):
                    v.zero_()
