"""The fused sparse update in Triton: the twin of optimizers.update, applied in place.

One program updates BLOCK rows: it reads each row's summed gradient and its table row
(embedding followed by optimizer state), applies clipping, weight decay and the optimizer,
and writes the row back where it lives. Slots of -1 (ids with no row) are skipped.
_load_rows and _step_rows are the optimizer step itself, shared with the kernel that
sums and applies the gradients of a group of tables (multi_table_kernels.py).
"""
import torch
import triton
import triton.language as tl

from ..launch import cdiv, launch, next_power_of_2
from .optimizers import OptimizerConfig
from .probe_kernels import ROW_ALIGN

# embedding values per program (rows = this / dim) and warps of the update kernel
UPDATE_ELEMENTS, UPDATE_WARPS = 512, 2

# the kernels' optimizer codes (OPT), by OptimizerConfig.name
SGD, ADAM, ADAGRAD, ROWWISE_ADAGRAD = (tl.constexpr(i) for i in range(4))
_OPTIMIZERS = {"sgd": SGD, "adam": ADAM, "adagrad": ADAGRAD, "rowwise_adagrad": ROWWISE_ADAGRAD}


@triton.jit
def _load_rows(row_ptr, live, cols, dim, OPT: tl.constexpr):
    """The rows starting at row_ptr (BLOCK,) where live: the embedding (BLOCK, DIM) and
    the optimizer state (two tensors and a per-row value; unused ones are 0), loaded
    apart from _step_rows so that a kernel can issue these loads early."""
    m = live[:, None] & (cols[None, :] < dim)
    base = row_ptr[:, None]
    w = tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if OPT == ADAM:  # state = m (dim), v (dim), per-row step (1)
        first = tl.load(base + dim + cols[None, :], mask=m, other=0.0)
        second = tl.load(base + 2 * dim + cols[None, :], mask=m, other=0.0)
        per_row = tl.load(row_ptr + 3 * dim, mask=live, other=0.0)
    elif OPT == ADAGRAD:  # state = sum of squares (dim)
        first, second, per_row = tl.load(base + dim + cols[None, :], mask=m, other=0.0), 0.0, 0.0
    elif OPT == ROWWISE_ADAGRAD:  # state = mean of squares, summed over steps (1)
        first, second, per_row = 0.0, 0.0, tl.load(row_ptr + dim, mask=live, other=0.0)
    else:  # sgd: no state
        first, second, per_row = 0.0, 0.0, 0.0
    return w, first, second, per_row


@triton.jit
def _step_rows(
    row_ptr, live, g, cols, dim, w, first, second, per_row, lr, beta1, beta2, eps, weight_decay, max_norm,
    OPT: tl.constexpr, CLIP: tl.constexpr,
):
    """One optimizer step on the rows _load_rows loaded (w, first, second, per_row), with
    their summed gradients g (BLOCK, DIM), stored in place."""
    m = live[:, None] & (cols[None, :] < dim)
    base = row_ptr[:, None]
    if CLIP:
        norm = tl.maximum(tl.sqrt(tl.sum(g * g, axis=1)), 1e-12)
        g = g * tl.minimum(max_norm / norm, 1.0)[:, None]
    g = g + weight_decay * w
    if OPT == SGD:
        w = w - lr * g
    elif OPT == ADAM:
        t = per_row + 1.0
        mom = beta1 * first + (1.0 - beta1) * g
        vel = beta2 * second + (1.0 - beta2) * g * g
        m_hat = mom / (1.0 - tl.exp(t * tl.log(beta1)))[:, None]
        v_hat = vel / (1.0 - tl.exp(t * tl.log(beta2)))[:, None]
        w = w - lr * m_hat / (tl.sqrt(v_hat) + eps)
        tl.store(base + dim + cols[None, :], mom, mask=m)
        tl.store(base + 2 * dim + cols[None, :], vel, mask=m)
        tl.store(row_ptr + 3 * dim, t, mask=live)
    elif OPT == ADAGRAD:
        acc = first + g * g
        w = w - lr * g / (tl.sqrt(acc) + eps)
        tl.store(base + dim + cols[None, :], acc, mask=m)
    else:  # row-wise adagrad
        acc = per_row + tl.sum(g * g, axis=1) / dim
        w = w - lr * g / (tl.sqrt(acc) + eps)[:, None]
        tl.store(row_ptr + dim, acc, mask=live)
    tl.store(base + cols[None, :], w, mask=m)


@triton.jit(do_not_specialize=["n"])  # n changes from call to call (multi_table_kernels.py)
def _update_kernel(
    values_ptr, slot_ptr, grad_ptr, n, dim, row_stride, lr, beta1, beta2, eps, weight_decay, max_norm,
    OPT: tl.constexpr, CLIP: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + rows, mask=rows < n, other=-1)
    live = (rows < n) & (slot >= 0)
    row_ptr = tl.multiple_of(values_ptr + slot * row_stride, ROW_ALIGN)  # rows start aligned
    cols = tl.arange(0, DIM)
    m = live[:, None] & (cols[None, :] < dim)
    g = tl.load(grad_ptr + rows[:, None].to(tl.int64) * dim + cols[None, :], mask=m, other=0.0).to(tl.float32)
    w, first, second, per_row = _load_rows(row_ptr, live, cols, dim, OPT)
    _step_rows(row_ptr, live, g, cols, dim, w, first, second, per_row, lr, beta1, beta2, eps, weight_decay, max_norm, OPT, CLIP)


def optimizer_args(cfg: OptimizerConfig) -> dict:
    """The optimizer's arguments of the kernels that call _step_rows."""
    return dict(
        lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
        max_norm=cfg.max_grad_norm or 0.0, OPT=_OPTIMIZERS[cfg.name], CLIP=cfg.max_grad_norm is not None,
    )


def fused_update(cfg: OptimizerConfig, values: torch.Tensor, slots: torch.Tensor, grads: torch.Tensor, dim: int) -> None:
    """values[slots] ← optimizer step with grads (N, dim), in place; slots -1 skipped.
    Slots must be distinct (sum duplicate ids' gradients first)."""
    n = slots.numel()
    if n == 0:
        return
    if values.dtype != torch.float32:
        raise TypeError("the fused update needs float32 rows")
    block = max(1, min(64, UPDATE_ELEMENTS // next_power_of_2(dim)))
    launch(
        _update_kernel, (cdiv(n, block),),
        values, slots.contiguous(), grads.contiguous().to(torch.float32), n, dim, values.stride(0),
        **optimizer_args(cfg), BLOCK=block, DIM=next_power_of_2(dim), num_warps=UPDATE_WARPS,
    )
