"""Softmax cross-entropy of queries against every row of a key matrix, in plain PyTorch:
the twin of triton_kernels.py.

    loss = mean_p −log softmax(q_p · keysᵀ)[target_p]

The (P, M) logits are never held whole: a block of positions at a time, each block's
logits turn into its softmax in place and then into that block's gradients while still in
cache (the gradient of cross-entropy with respect to the logits is softmax − one-hot), so
the backward is a multiplication by the upstream gradient. Under autocast the products run
in its dtype and the softmax in float32, as autocast runs a matmul and cross_entropy.
"""
import torch

from ..backend import matmul_dtype

# logits per block (rows × keys): on a CPU a block that stays in cache (2 MB of fp32; 2.7x
# faster than the whole matrix at once on 10,000 keys); on a GPU a block large enough to
# fill the device, few launches per step
BLOCK_LOGITS_CPU = 1 << 19
BLOCK_LOGITS_GPU = 1 << 26


def block_rows(num_keys: int, device: torch.device) -> int:
    """Positions per block over num_keys keys."""
    budget = BLOCK_LOGITS_CPU if device.type == "cpu" else BLOCK_LOGITS_GPU
    return max(1, budget // max(num_keys, 1))


class _BlockwiseSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, keys: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        want_q, want_keys = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = q.new_zeros((), dtype=torch.float64)
        grad_q = torch.empty_like(q) if want_q else None
        grad_keys = torch.zeros_like(keys) if want_keys else None
        device, mm_dtype = q.device.type, matmul_dtype(q)
        step = block_rows(keys.shape[0], q.device)
        with torch.autocast(device, enabled=False):
            q_mm, keys_mm = q.to(mm_dtype), keys.to(mm_dtype)
            for start in range(0, q.shape[0], step):
                qb, tb = q_mm[start : start + step], target[start : start + step]
                logits = (qb @ keys_mm.T).to(q.dtype)
                rows = torch.arange(len(tb), device=q.device)
                target_logit = logits[rows, tb]
                top = logits.amax(1, keepdim=True)
                probs = logits.sub_(top).exp_()  # in place: the block's logits become its softmax
                norm = probs.sum(1, keepdim=True)
                total += (norm.log().squeeze(1) + top.squeeze(1) - target_logit).sum(dtype=torch.float64)
                if want_q or want_keys:
                    probs.div_(norm)
                    probs[rows, tb] -= 1.0  # d(summed loss)/d(logits)
                    if mm_dtype == q.dtype:  # in place into the gradients: no block-sized temporaries
                        if want_q:
                            torch.mm(probs, keys_mm, out=grad_q[start : start + step])
                        if want_keys:
                            grad_keys.addmm_(probs.T, qb)
                    else:
                        probs = probs.to(mm_dtype)
                        if want_q:
                            grad_q[start : start + step] = probs @ keys_mm
                        if want_keys:
                            grad_keys += probs.T @ qb
        count = max(q.shape[0], 1)
        ctx.save_for_backward(grad_q, grad_keys)
        ctx.count = count
        return (total / count).to(q.dtype) if q.shape[0] else q.new_tensor(float("nan"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_q, grad_keys = ctx.saved_tensors
        scale = grad / ctx.count
        return (
            grad_q * scale if grad_q is not None else None,
            grad_keys * scale if grad_keys is not None else None,
            None,
        )


def softmax_cross_entropy(q: torch.Tensor, keys: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """() mean over the P rows of q (P, D) of −log softmax(q · keysᵀ)[target] (keys (M, D),
    target (P,) int64 in [0, M)); NaN for P = 0."""
    return _BlockwiseSoftmaxCE.apply(q, keys, target)
