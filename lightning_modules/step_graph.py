"""The training step replayed from CUDA graphs: the model, the full-catalog
softmax loss, the backward and the optimizer's update of the dense weights, one graph
per row bucket (cuda_graphs.GraphedHSTU's buckets and padding).

GraphedHSTU replays the forward and the backward as two graphs that autograd joins: each
step still runs autograd's engine over them, hands every weight its gradient (a copy per
weight) and steps the optimizer from Python, host work that bounds the paper presets'
steps (benchmarks/train_throughput.md). One graph holds all of it. A replay leaves the
weights and the optimizer's state updated and returns the loss and the gradients of the
graph's inputs (the input rows and the catalog's rows); the caller takes those back to
the looked-up embedding rows.

Under several processes (DDP over NCCL) the graph also averages the weights' gradients
over the ranks between the backward and the update: one all-reduce of the gradients laid
end to end, captured with the rest (NCCL's collectives can be). DDP's own hooks then stay
off (the caller turns its gradient sync off), and a step no graph serves averages the
gradients with the same one all-reduce (`average_gradients`), so every rank issues the
same collectives in the same order whichever of its steps a graph serves. For the same
reason every rank captures at the same step, also one whose own batch no graph serves.
A graph that holds a collective must be destroyed before its process group: NCCL's
teardown of a communicator waits for every graph that captured one of its collectives
to go, so a graph still alive then hangs the process at its exit. `release` drops the
graphs (the training module calls it when training ends), and an exit handler does it
where training never got there.

The update in the graph is the optimizer's own step (a capturable AdamW), captured with
the weights' gradients in the graph's buffers. Outside the graph no weight has a .grad,
so a step() of the optimizer would change nothing: the training module only counts the
step for Lightning (module.count_optimizer_step). Capturing
a bucket first runs a few steps on a side stream (kernel tuning, the optimizer's lazily
made state) and then puts the weights and the state back as they were. A graph holds the
state's tensors and the hyperparameters of the moment it was captured: after a
load_state_dict of the optimizer (new state tensors) or a change of a hyperparameter, the
next call captures again.
"""
import atexit
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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


def average_gradients(params: list[torch.Tensor], group) -> None:
    """Each parameter's gradient replaced by its mean over the ranks of `group`, in one
    all-reduce of the gradients laid end to end (a parameter without one counts zeros).
    No host wait: it can be captured in a CUDA graph."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for p, mean in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = mean.view_as(p)


class GraphedTrainingStep:
    """One training step of `graphed`'s model on the full-catalog softmax loss, the
    update by `optimizer` (an AdamW over the model's weights, capturable), replayed from
    one CUDA graph per bucket (module docstring). group: the process group whose ranks
    average the gradients in the graph (None: one process)."""

    def __init__(self, graphed: GraphedHSTU, optimizer: torch.optim.Optimizer, group=None):
        if not all(g["capturable"] for g in optimizer.param_groups):
            raise ValueError("GraphedTrainingStep needs an optimizer made with capturable=True")
        self.graphed, self.optimizer, self.group = graphed, optimizer, group
        self.buckets: dict[tuple, _Bucket] = {}  # (rows, autocast dtype, items, temperature) -> its bucket
        self._state, self._hyper = None, None  # the optimizer's state and hyperparameters the graphs hold
        if group is not None:  # exit handlers run last-registered first: this one before Lightning's process group teardown
            atexit.register(_release_if_alive, weakref.ref(self))

    def __call__(
        self, x: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, item_emb: torch.Tensor,
        target_index: torch.Tensor, temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """One step on a jagged batch (x (P, D), timestamps, offsets) and the catalog's rows
        item_emb (M, D) with each row's target's index in it: the weights updated, and
        returned the loss, the gradient of x and that of item_emb (views of the graph's
        buffers: read them before the next call). None where no graph serves (evaluation,
        CPU tensors, a batch larger than the buckets, no rows): the caller runs the step
        itself (and, under several processes, averages the gradients by average_gradients).
        The graphs are captured at the first training call on the GPU whatever its batch,
        and again after a change of the optimizer's state or hyperparameters: each the same
        step on every rank."""
        g = self.graphed
        if not g.training_call(x):
            return None
        hyper = tuple(tuple(group[k] for k in HYPERPARAMETERS) for group in self.optimizer.param_groups)
        if self._state is not self.optimizer.state or self._hyper != hyper:
            self.buckets.clear()  # graphs of other state tensors or constants
            self._state, self._hyper = self.optimizer.state, hyper
        dtype = autocast_dtype()

        def key(rows: int) -> tuple:
            return rows, dtype, item_emb.shape[0], temperature

        if key(g.sizes[-1]) not in self.buckets:  # (every bucket is captured at once)
            self._capture_all(key, x, timestamps, offsets, item_emb, target_index, dtype, temperature)
        if not g.graphable(x, offsets) or not x.shape[0]:
            return None
        P, rows = x.shape[0], g.rows_for(x.shape[0])
        b = self.buckets[key(rows)]
        px, pts, poff = g.padded(x.detach(), timestamps, offsets, rows)
        b.x.detach().copy_(px)
        b.timestamps.copy_(pts)
        b.offsets.copy_(poff)
        b.item_emb.detach().copy_(item_emb.detach())
        b.target_index[:P].copy_(target_index)  # padding rows: any item, as left (their queries are zeroed)
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
                # (several processes: the process group's watchdog thread queries the events
                # of collectives enqueued before the capture, which a global capture forbids)
                with torch.cuda.graph(b.graph, pool=pool, capture_error_mode="thread_local" if self.group is not None else "global"):
                    b.loss = self._step(module, b).detach()  # (no autograd graph kept alive past the capture)
                b.weight_grads = [p.grad for p in self._params()]
                self.buckets[key(rows)] = b
        self.optimizer.zero_grad(set_to_none=True)  # outside the graphs no weight has a gradient

    def _step(self, module: CapturedLoss, b: _Bucket) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        b.x.grad = b.item_emb.grad = None
        loss = module(b.x, b.timestamps, b.offsets, b.item_emb, b.target_index)
        loss.backward()
        self.average_gradients()
        self.optimizer.step()
        return loss

    def release(self) -> None:
        """Drops every graph (module docstring: before the process group goes); a later
        training call captures them again. A replay still running completes first (CUDA
        frees a graph in flight when it is done)."""
        self.buckets.clear()

    def average_gradients(self) -> None:
        """Under several processes, the weights' gradients averaged over the ranks as the
        graphs do it: in a graph, or eagerly after a step no graph serves (the same one
        all-reduce). Nothing under one process."""
        if self.group is not None:
            average_gradients(self._params(), self.group)

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


def _release_if_alive(step: weakref.ref) -> None:
    if (alive := step()) is not None:
        alive.release()
