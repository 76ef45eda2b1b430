"""The Triton attention as torch.library custom ops, for models compiled whole by
torch.compile: Dynamo and Inductor see each call as one opaque op (the kernels launch at
run time, as in eager mode), so the model's work around the attention joins one graph
instead of stopping at every attention call. hstu_attention calls these while compiling;
eager calls keep the autograd Function in __init__.py, which costs the host less a call.

The forward op returns the prepass's pair biases where it keeps them for the backward
(triton_kernels.attention_forward), flattened, and else an empty tensor: whether they are
kept depends on the device's memory held at run time, so their size is a data-dependent
one to the compiler.
"""
import torch

from . import triton_kernels


@torch.library.custom_op("hstu::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int, num_targets: torch.Tensor | None,
    context_len: int, keep_biases: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the attention's output, the kept pair biases flattened or an empty tensor)."""
    out, kept = triton_kernels.attention_forward(
        q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len, keep_biases=keep_biases,
    )
    return out, kept.view(-1) if kept is not None else q.new_empty(0)


@attention.register_fake
def _attention_fake(q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len, keep_biases):
    return v.new_empty(v.shape), q.new_empty(torch.library.get_ctx().new_dynamic_size())


@torch.library.custom_op("hstu::attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int, num_targets: torch.Tensor | None,
    context_len: int, kept: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d position_bias, d time_bias), the biases' gradients float32; kept: the
    forward op's second output."""
    kept_biases = kept.view(offsets.numel() - 1, max_seq_len, -1) if kept.numel() else None
    dq, dk, dv, d_position, d_time = triton_kernels.hstu_attention_backward(
        grad, q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len,
        kept_biases=kept_biases,
    )
    # (the two are views of one tensor, and a custom op's outputs may not alias each other)
    return dq, dk, dv, d_position.clone(), d_time.clone()


@attention_backward.register_fake
def _attention_backward_fake(grad, q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets,
                             context_len, kept):
    float32 = dict(dtype=torch.float32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), position_bias.new_empty(position_bias.shape, **float32),
            time_bias.new_empty(time_bias.shape, **float32))


def _save(ctx, inputs, output) -> None:
    q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len, _ = inputs
    ctx.save_for_backward(q, k, v, offsets, timestamps, position_bias, time_bias, num_targets, output[1])
    ctx.max_seq_len, ctx.context_len = max_seq_len, context_len


def _backward(ctx, grad, _kept_grad):
    q, k, v, offsets, timestamps, position_bias, time_bias, num_targets, kept = ctx.saved_tensors
    dq, dk, dv, d_position, d_time = attention_backward(
        grad.contiguous(), q, k, v, offsets, timestamps, position_bias, time_bias, ctx.max_seq_len, num_targets,
        ctx.context_len, kept,
    )
    return dq, dk, dv, None, None, d_position.to(position_bias.dtype), d_time.to(time_bias.dtype), None, None, None, None


attention.register_autograd(_backward, setup_context=_save)
