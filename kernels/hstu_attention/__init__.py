"""HSTU attention on jagged sequences, forward and backward: the Triton kernels on CUDA and
the pure-PyTorch twin elsewhere (backend "triton" or "reference" picks one; "auto" by
device). reference.py states the computation and its masks (causal, target tokens, a
context prefix); both paths are differentiable in q, k, v and the two bias tables. Inside
torch.compile the Triton path is a pair of custom ops (graph_ops.py), so a model compiled
whole keeps one graph.
"""
import torch

from ..backend import use_triton
from . import graph_ops, reference, triton_kernels
from .reference import TIME_BUCKET_LOG, allowed_pairs, time_buckets

__all__ = ["hstu_attention", "TIME_BUCKET_LOG", "allowed_pairs", "time_buckets"]


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len, backward_follows):
        # saved as the kernels read them, so that the backward makes no copy of its own
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, kept_biases = triton_kernels.attention_forward(
            q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len,
            keep_biases=backward_follows,
        )
        # (kept_biases: the prepass's pair biases where kept for the backward, else None)
        ctx.save_for_backward(q, k, v, offsets, timestamps, position_bias, time_bias, num_targets, kept_biases)
        ctx.max_seq_len, ctx.context_len = max_seq_len, context_len
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, offsets, timestamps, position_bias, time_bias, num_targets, kept_biases = ctx.saved_tensors
        bias_grads = ctx.needs_input_grad[5] or ctx.needs_input_grad[6]
        dq, dk, dv, d_position, d_time = triton_kernels.hstu_attention_backward(
            grad, q, k, v, offsets, timestamps, position_bias, time_bias, ctx.max_seq_len, num_targets, ctx.context_len,
            bias_grads=bias_grads, kept_biases=kept_biases,
        )
        if bias_grads:
            d_position, d_time = d_position.to(position_bias.dtype), d_time.to(time_bias.dtype)
        return dq, dk, dv, None, None, d_position, d_time, None, None, None, None


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0, backend: str = "auto",
) -> torch.Tensor:
    """(total, H, dv) attention output of jagged sequences: q, k (total, H, dqk), v (total,
    H, dv), offsets (B + 1,) int64, timestamps (total,) int64, position_bias
    (2 · max_seq_len - 1,), time_bias (num_buckets + 1,), num_targets (B,) or None, no
    sequence longer than max_seq_len."""
    triton = use_triton(backend, q.device, "attention")
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be (total, H, dqk) and v (total, H, dv): got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if offsets.dim() != 1 or offsets.dtype != torch.int64 or timestamps.shape != q.shape[:1]:
        raise ValueError("offsets must be 1-D int64 (B + 1) and timestamps (total,)")
    if position_bias.shape != (2 * max_seq_len - 1,):
        raise ValueError(f"position_bias must have 2 * max_seq_len - 1 = {2 * max_seq_len - 1} entries, got {tuple(position_bias.shape)}")
    if num_targets is not None and num_targets.shape != (offsets.numel() - 1,):
        raise ValueError(f"num_targets must have one entry per sequence ({offsets.numel() - 1}), got {tuple(num_targets.shape)}")
    if triton:
        # (inside the Function's forward grad mode is off, and needs_input_grad ignores no_grad)
        backward_follows = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, position_bias, time_bias))
        args = (q, k, v, offsets, timestamps.to(torch.int64), position_bias, time_bias, max_seq_len, num_targets, context_len,
                backward_follows)
        if torch.compiler.is_compiling():  # (one op of the compiled graph: graph_ops.py)
            return graph_ops.attention(*args)[0]
        return _Attention.apply(*args)
    return reference.hstu_attention(q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len)
