"""The fused sparse update in Triton: the twin of optimizers.update, applied in place.

One program updates BLOCK rows: it reads each row's summed gradient and its table row
(embedding followed by optimizer state), applies clipping, weight decay and the optimizer,
and writes the row back where it lives. Slots of -1 (ids with no row) are skipped. Rows
of several tables are updated in one launch when slots are packed as (table << 40) | slot
and the tables' descriptors are given.
"""
import torch
import triton
import triton.language as tl

from .optimizers import OptimizerConfig
from .triton_table import ROW_ALIGN, _VALUES, _field

SLOT_BITS = tl.constexpr(40)  # packed (table, slot): the slot's bits
SLOT_MASK = tl.constexpr((1 << 40) - 1)
# embedding values per program (rows = this / dim) and warps of the update kernel
UPDATE_ELEMENTS, UPDATE_WARPS = 512, 2

_OPTIMIZERS = {"sgd": 0, "adam": 1, "adagrad": 2, "rowwise_adagrad": 3}


@triton.jit
def _update_kernel(
    values_ptr, slot_ptr, grad_ptr, n, count_ptr, desc_ptr, dim, row_stride,
    lr, beta1, beta2, eps, weight_decay, max_norm,
    OPT: tl.constexpr, CLIP: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, MULTI: tl.constexpr,
):
    """MULTI: slots are packed (table, slot), tables addressed by desc, and the number of
    rows is read from count_ptr (n bounds it)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if MULTI:
        n = tl.load(count_ptr)
    slot = tl.load(slot_ptr + rows, mask=rows < n, other=-1)
    live = (rows < n) & (slot >= 0)
    if MULTI:
        table_values = _field(desc_ptr, tl.where(live, slot >> SLOT_BITS, 0), _VALUES).to(tl.pointer_type(tl.float32))
        slot = slot & SLOT_MASK
    else:
        table_values = values_ptr
    row_ptr = tl.multiple_of(table_values + slot * row_stride, ROW_ALIGN)  # rows start aligned
    cols = tl.arange(0, DIM)
    m = live[:, None] & (cols[None, :] < dim)
    base = row_ptr[:, None]
    g = tl.load(grad_ptr + rows[:, None].to(tl.int64) * dim + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if CLIP:
        norm = tl.maximum(tl.sqrt(tl.sum(g * g, axis=1)), 1e-12)
        g = g * tl.minimum(max_norm / norm, 1.0)[:, None]
    w = tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g = g + weight_decay * w
    if OPT == 0:  # sgd
        w = w - lr * g
    elif OPT == 1:  # adam: state = m (dim), v (dim), per-row step (1)
        mom = tl.load(base + dim + cols[None, :], mask=m, other=0.0)
        vel = tl.load(base + 2 * dim + cols[None, :], mask=m, other=0.0)
        t = tl.load(row_ptr + 3 * dim, mask=live, other=0.0) + 1.0
        mom = beta1 * mom + (1.0 - beta1) * g
        vel = beta2 * vel + (1.0 - beta2) * g * g
        m_hat = mom / (1.0 - tl.exp(t * tl.log(beta1)))[:, None]
        v_hat = vel / (1.0 - tl.exp(t * tl.log(beta2)))[:, None]
        w = w - lr * m_hat / (tl.sqrt(v_hat) + eps)
        tl.store(base + dim + cols[None, :], mom, mask=m)
        tl.store(base + 2 * dim + cols[None, :], vel, mask=m)
        tl.store(row_ptr + 3 * dim, t, mask=live)
    elif OPT == 2:  # adagrad: state = sum of squares (dim)
        acc = tl.load(base + dim + cols[None, :], mask=m, other=0.0) + g * g
        w = w - lr * g / (tl.sqrt(acc) + eps)
        tl.store(base + dim + cols[None, :], acc, mask=m)
    else:  # row-wise adagrad: state = mean of squares, summed over steps (1)
        acc = tl.load(row_ptr + dim, mask=live, other=0.0) + tl.sum(g * g, axis=1) / dim
        w = w - lr * g / (tl.sqrt(acc) + eps)[:, None]
        tl.store(row_ptr + dim, acc, mask=live)
    tl.store(base + cols[None, :], w, mask=m)


def fused_update(
    cfg: OptimizerConfig, values: torch.Tensor, slots: torch.Tensor, grads: torch.Tensor, dim: int,
    desc: torch.Tensor | None = None, count: torch.Tensor | None = None,
) -> None:
    """values[slots] ← optimizer step with grads (N, dim), in place; slots -1 skipped.
    Slots must be distinct (sum duplicate ids' gradients first). With desc (T tables'
    descriptors): slots are packed (table << SLOT_BITS) | slot, `values` only names the
    dtype and row width, and `count` (a device scalar) says how many of the N rows are
    used, so no host sync is needed."""
    n = slots.numel()
    if n == 0:
        return
    if values.dtype != torch.float32:
        raise TypeError("the fused update needs float32 rows")
    block = max(1, min(64, UPDATE_ELEMENTS // triton.next_power_of_2(dim)))
    multi = desc is not None
    _update_kernel[(triton.cdiv(n, block),)](
        values, slots.contiguous(), grads.contiguous().to(torch.float32), n, count if multi else slots,
        desc if multi else slots, dim, values.stride(0),
        cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.max_grad_norm or 0.0,
        OPT=_OPTIMIZERS[cfg.name], CLIP=cfg.max_grad_norm is not None, BLOCK=block, DIM=triton.next_power_of_2(dim),
        MULTI=multi, num_warps=UPDATE_WARPS,
    )
