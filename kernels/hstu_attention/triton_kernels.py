"""HSTU attention on jagged sequences as Triton kernels, with the signature of the twin in
reference.py (which states the computation and the masks).

Forward: a program per block of BLOCK_M query rows of one sequence and head steps through
the key blocks its rows may attend to, computing the scores in float32 with the two
biases looked up from their tables inside the kernel (no (L, L) tensor in memory), and
accumulates SiLU(scores) / max_seq_len · V. The grid is sized by max_seq_len, so no length
is read on the host; programs past their sequence's end return at once.
Backward, two kernels that recompute the scores: one per key block (dK, dV), one per query
block (dQ and the biases' gradients, added to float32 tables by atomic adds).
"""
import torch
import triton
import triton.language as tl

from ..autotune import TunedLaunches, autotuned
from ..launch import cdiv, next_power_of_2
from .reference import TIME_BUCKET_LOG

# blocks of query and key rows, warps and pipeline stages, tuned per head dims and length
CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
TUNING_KEY = ["dqk", "dv", "length_class"]  # length_class: max_seq_len's power of two
MIN_HEAD_DIM = 16  # tl.dot's least inner size: smaller heads are padded with masked columns
_TIME_BUCKET_LOG = tl.constexpr(TIME_BUCKET_LOG)  # (kernels read only constexpr globals)


@triton.jit
def _key_range(m0, n, history_end, context_len, BLOCK_M: tl.constexpr):
    """The end of the keys a block of query rows m0 .. m0 + BLOCK_M - 1 may attend to."""
    causal_end = tl.minimum(m0 + BLOCK_M, n)
    return tl.where(m0 < context_len, tl.maximum(history_end, causal_end), tl.maximum(causal_end, 0))


@triton.jit
def _scores(
    q, k, rows, cols, t_rows, t_cols, n, history_end, context_len, position_ptr, time_ptr, max_seq_len, num_buckets,
):
    """(float32 scores with both biases, whether each pair is allowed, position index, time
    bucket) of query rows `rows` against key rows `cols` of one sequence."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee" if q.dtype == tl.float32 else "tf32")
    rel = tl.minimum(tl.maximum(cols[None, :] - rows[:, None], 1 - max_seq_len), max_seq_len - 1) + max_seq_len - 1
    gap = tl.abs(t_rows[:, None] - t_cols[None, :])
    gap = tl.maximum(gap, 1).to(tl.float32)
    bucket = tl.minimum(tl.maximum(tl.floor(tl.log(gap) / _TIME_BUCKET_LOG), 0), num_buckets).to(tl.int32)
    s += tl.load(position_ptr + rel).to(tl.float32) + tl.load(time_ptr + bucket).to(tl.float32)
    in_history = cols[None, :] < history_end
    allowed = tl.where(
        rows[:, None] < context_len, in_history,
        tl.where(rows[:, None] < history_end, cols[None, :] <= rows[:, None], in_history | (cols[None, :] == rows[:, None])),
    )
    allowed = allowed & (rows[:, None] < n) & (cols[None, :] < n)
    return s, allowed, rel, bucket


@triton.jit
def _sequence(offsets_ptr, targets_ptr, b, HAS_TARGETS: tl.constexpr):
    start = tl.load(offsets_ptr + b)
    n = (tl.load(offsets_ptr + b + 1) - start).to(tl.int32)
    history_end = n
    if HAS_TARGETS:
        history_end = n - tl.load(targets_ptr + b).to(tl.int32)
    return start, n, history_end


@triton.jit
def _head_rows(ptr, start, idx, live, heads, h, width, BLOCK_D: tl.constexpr):
    """(pointers, mask) of rows start + idx (where live) of head h of a (total, heads,
    width) tensor, BLOCK_D columns (those past width masked)."""
    cols = tl.arange(0, BLOCK_D)
    return ptr + ((start + idx) * heads + h)[:, None] * width + cols[None, :], live[:, None] & (cols[None, :] < width)


@triton.jit
def _row_block(
    a_ptr, b_ptr, timestamps_ptr, start, first, n, heads, h, a_width, b_width, BLOCK: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Rows first .. first + BLOCK - 1 of a sequence of n rows at `start`: (their indices,
    which are live, their head-h rows of a (width a_width) and of b (width b_width), their
    timestamps, and a's and b's masks). A key block's a and b are K and V; a query
    block's, Q and dO."""
    idx = first + tl.arange(0, BLOCK)
    live = idx < n
    a_at, a_mask = _head_rows(a_ptr, start, idx, live, heads, h, a_width, BLOCK_A)
    b_at, b_mask = _head_rows(b_ptr, start, idx, live, heads, h, b_width, BLOCK_B)
    a = tl.load(a_at, mask=a_mask, other=0)
    b = tl.load(b_at, mask=b_mask, other=0)
    return idx, live, a, b, tl.load(timestamps_ptr + start + idx, mask=live, other=0), a_mask, b_mask


@triton.jit
def _program_block(offsets_ptr, targets_ptr, heads, BLOCK: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """(this program's first row, head, its sequence's start, length and history end)."""
    b = tl.program_id(1) // heads
    start, n, history_end = _sequence(offsets_ptr, targets_ptr, b, HAS_TARGETS)
    return tl.program_id(0) * BLOCK, tl.program_id(1) % heads, start, n, history_end


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr,
    heads, dqk, dv, max_seq_len, num_buckets, context_len, scale, length_class,
    HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    m0, h, start, n, history_end = _program_block(offsets_ptr, targets_ptr, heads, BLOCK_M, HAS_TARGETS)
    if m0 >= n:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_live = rows < n
    q_at, q_mask = _head_rows(q_ptr, start, rows, row_live, heads, h, dqk, BLOCK_DQK)
    q = tl.load(q_at, mask=q_mask, other=0)
    t_rows = tl.load(timestamps_ptr + start + rows, mask=row_live, other=0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(0, _key_range(m0, n, history_end, context_len, BLOCK_M), BLOCK_N):
        cols, _, k, v, t_cols, _, _ = _row_block(
            k_ptr, v_ptr, timestamps_ptr, start, n0, n, heads, h, dqk, dv, BLOCK_N, BLOCK_DQK, BLOCK_DV
        )
        s, allowed, _, _ = _scores(q, k, rows, cols, t_rows, t_cols, n, history_end, context_len, position_ptr, time_ptr, max_seq_len, num_buckets)
        a = tl.where(allowed, s * tl.sigmoid(s) * scale, 0.0)
        acc += tl.dot(a.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32 else "tf32")
    out_at, out_mask = _head_rows(out_ptr, start, rows, row_live, heads, h, dv, BLOCK_DV)
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _score_grads(s, allowed, do, v, scale):
    """(A, dS): the attention weights and the scores' gradient, given dO · Vᵀ's inputs."""
    sig = tl.sigmoid(s)
    a = tl.where(allowed, s * sig * scale, 0.0)
    da = tl.dot(do, tl.trans(v), input_precision="ieee" if v.dtype == tl.float32 else "tf32")
    ds = tl.where(allowed, da * sig * (1 + s * (1 - sig)) * scale, 0.0)
    return a, ds


@triton.jit
def _backward_kv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr,
    heads, dqk, dv, max_seq_len, num_buckets, context_len, scale, length_class,
    HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK and dV of a block of key rows: Σ over the query rows that attend to them."""
    n0, h, start, n, history_end = _program_block(offsets_ptr, targets_ptr, heads, BLOCK_N, HAS_TARGETS)
    if n0 >= n:
        return
    cols, col_live, k, v, t_cols, k_mask, v_mask = _row_block(
        k_ptr, v_ptr, timestamps_ptr, start, n0, n, heads, h, dqk, dv, BLOCK_N, BLOCK_DQK, BLOCK_DV
    )
    dk_acc = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # query rows before the block attend to it only from the context (rows < context_len)
    first = tl.where(context_len > 0, 0, (n0 // BLOCK_M) * BLOCK_M)
    for m0 in range(first, n, BLOCK_M):
        rows, _, q, do, t_rows, _, _ = _row_block(
            q_ptr, do_ptr, timestamps_ptr, start, m0, n, heads, h, dqk, dv, BLOCK_M, BLOCK_DQK, BLOCK_DV
        )
        s, allowed, _, _ = _scores(q, k, rows, cols, t_rows, t_cols, n, history_end, context_len, position_ptr, time_ptr, max_seq_len, num_buckets)
        a, ds = _score_grads(s, allowed, do, v, scale)
        precision: tl.constexpr = "ieee" if q.dtype == tl.float32 else "tf32"
        dv_acc += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=precision)
        dk_acc += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=precision)
    dk_at, _ = _head_rows(dk_ptr, start, cols, col_live, heads, h, dqk, BLOCK_DQK)
    tl.store(dk_at, dk_acc.to(dk_ptr.dtype.element_ty), mask=k_mask)
    dv_at, _ = _head_rows(dv_ptr, start, cols, col_live, heads, h, dv, BLOCK_DV)
    tl.store(dv_at, dv_acc.to(dv_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _backward_q_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr,
    position_grad_ptr, time_grad_ptr, heads, dqk, dv, max_seq_len, num_buckets, context_len, scale, length_class,
    HAS_TARGETS: tl.constexpr, BIAS_GRADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ of a block of query rows, and (BIAS_GRADS) its pairs' share of the biases'
    gradients."""
    m0, h, start, n, history_end = _program_block(offsets_ptr, targets_ptr, heads, BLOCK_M, HAS_TARGETS)
    if m0 >= n:
        return
    # no name bound here may be rebound in the loop below: Triton would carry it
    # through the loop and reject the change of type
    rows, row_live, q, do, t_rows, q_mask, do_mask = _row_block(
        q_ptr, do_ptr, timestamps_ptr, start, m0, n, heads, h, dqk, dv, BLOCK_M, BLOCK_DQK, BLOCK_DV
    )
    dq_acc = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    for n0 in range(0, _key_range(m0, n, history_end, context_len, BLOCK_M), BLOCK_N):
        cols, _, k, v, t_cols, _, _ = _row_block(
            k_ptr, v_ptr, timestamps_ptr, start, n0, n, heads, h, dqk, dv, BLOCK_N, BLOCK_DQK, BLOCK_DV
        )
        s, allowed, rel, bucket = _scores(q, k, rows, cols, t_rows, t_cols, n, history_end, context_len, position_ptr, time_ptr, max_seq_len, num_buckets)
        _, ds = _score_grads(s, allowed, do, v, scale)
        dq_acc += tl.dot(ds.to(k.dtype), k, input_precision="ieee" if k.dtype == tl.float32 else "tf32")
        if BIAS_GRADS:
            tl.atomic_add(position_grad_ptr + rel, ds, mask=allowed, sem="relaxed")
            # a tile's time buckets are few and consecutive (timestamps grow along a
            # sequence): one sum per bucket present, one atomic add each
            low = tl.min(tl.where(allowed, bucket, num_buckets))
            high = tl.max(tl.where(allowed, bucket, 0))
            for tb in range(low, high + 1):
                tl.atomic_add(time_grad_ptr + tb, tl.sum(tl.where(allowed & (bucket == tb), ds, 0.0)), sem="relaxed")
    dq_at, _ = _head_rows(dq_ptr, start, rows, row_live, heads, h, dqk, BLOCK_DQK)
    tl.store(dq_at, dq_acc.to(dq_ptr.dtype.element_ty), mask=q_mask)


_forward = TunedLaunches(autotuned(_forward_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))
_backward_kv = TunedLaunches(autotuned(_backward_kv_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))
# (adds into the biases' gradients: zeroed before each trial)
_backward_q = TunedLaunches(autotuned(
    _backward_q_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY, reset_to_zero=["position_grad_ptr", "time_grad_ptr"]
))


def _grid(rows_block: str, programs: int, max_seq_len: int):
    """The grid of a launch: blocks of rows_block rows over max_seq_len, one column per
    sequence and head."""
    return lambda meta: (cdiv(max_seq_len, meta[rows_block]), programs)


def _launch_shape(q, v, offsets, max_seq_len):
    heads, dqk, dv = q.shape[1], q.shape[2], v.shape[2]
    dims = dict(BLOCK_DQK=max(MIN_HEAD_DIM, next_power_of_2(dqk)), BLOCK_DV=max(MIN_HEAD_DIM, next_power_of_2(dv)))
    return heads, dqk, dv, (offsets.numel() - 1) * heads, dims


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    heads, dqk, dv, programs, dims = _launch_shape(q, v, offsets, max_seq_len)
    out = v.new_empty(v.shape)
    if out.numel() and programs:
        length_class = next_power_of_2(max_seq_len)
        constants = dict(HAS_TARGETS=num_targets is not None, **dims)
        _forward(
            _grid("BLOCK_M", programs, max_seq_len),
            (q, k, v, out, offsets, timestamps, num_targets if num_targets is not None else offsets, position_bias, time_bias,
             heads, dqk, dv, max_seq_len, time_bias.numel() - 1, context_len, 1.0 / max_seq_len, length_class),
            constants,
        )
    return out


def hstu_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0, bias_grads: bool = True,
):
    """(dq, dk, dv, d position_bias, d time_bias); the biases' gradients are float32 (None
    without bias_grads)."""
    q, k, v, grad = q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous()
    heads, dqk, dv, programs, dims = _launch_shape(q, v, offsets, max_seq_len)
    dq, dk, dvv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    position_grad = torch.zeros(position_bias.shape, dtype=torch.float32, device=q.device)
    time_grad = torch.zeros(time_bias.shape, dtype=torch.float32, device=q.device)
    if q.shape[0] and programs:
        targets = num_targets if num_targets is not None else offsets
        length_class = next_power_of_2(max_seq_len)
        common = dict(HAS_TARGETS=num_targets is not None, **dims)
        sizes = (heads, dqk, dv, max_seq_len, time_bias.numel() - 1, context_len, 1.0 / max_seq_len, length_class)
        _backward_kv(
            _grid("BLOCK_N", programs, max_seq_len),
            (q, k, v, grad, dk, dvv, offsets, timestamps, targets, position_bias, time_bias, *sizes), common,
        )
        _backward_q(
            _grid("BLOCK_M", programs, max_seq_len),
            (q, k, v, grad, dq, offsets, timestamps, targets, position_bias, time_bias, position_grad, time_grad, *sizes),
            dict(BIAS_GRADS=bias_grads, **common),
        )
    if not bias_grads:
        return dq, dk, dvv, None, None
    return dq, dk, dvv, position_grad, time_grad
