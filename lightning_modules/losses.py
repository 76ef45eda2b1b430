"""HSTU's training losses: softmax cross-entropy on cosine similarity, over shared sampled
negatives or over the whole catalog.

The catalog softmax is the costly one: its (positions × items) logits are hundreds of
megabytes per step on a catalog of ten thousand items. `catalog_softmax_loss` never holds
them: it runs a block of positions at a time, and each block's logits turn into that
block's gradients while still in cache (the gradient of cross-entropy with respect to the
logits is softmax − one-hot), so the backward is a multiplication by the upstream gradient.
"""
import torch
import torch.nn.functional as F

# logits per block of the catalog softmax (rows × items): on a CPU a block that stays in
# cache (2 MB of fp32; 2.7x faster than the whole matrix at once on 10,000 items); on a
# GPU a block large enough to fill the device, few launches per step
BLOCK_LOGITS_CPU = 1 << 19
BLOCK_LOGITS_GPU = 1 << 26


def block_rows(num_items: int, device: torch.device) -> int:
    """Positions per block of the catalog softmax over num_items items."""
    budget = BLOCK_LOGITS_CPU if device.type == "cpu" else BLOCK_LOGITS_GPU
    return max(1, budget // max(num_items, 1))


def sampled_softmax_loss(
    out: torch.Tensor,
    target_emb: torch.Tensor,
    target_ids: torch.Tensor,
    negative_emb: torch.Tensor,
    negative_ids: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Cross-entropy of each target against shared sampled negatives, on cosine similarity.

    out (P, D) normalized outputs, target_emb (P, D), negative_emb (N, D); a negative equal
    to the position's own target is masked out.
    """
    target = F.normalize(target_emb, dim=-1)
    negatives = F.normalize(negative_emb, dim=-1)
    pos_logit = (out * target).sum(-1, keepdim=True)  # (P, 1)
    neg_logits = out @ negatives.T  # (P, N)
    neg_logits = neg_logits.masked_fill(negative_ids[None, :] == target_ids[:, None], float("-inf"))
    logits = torch.cat([pos_logit, neg_logits], 1) / temperature
    labels = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
    return F.cross_entropy(logits, labels)


class _BlockwiseSoftmaxCE(torch.autograd.Function):
    """mean_p −log softmax(q_p · keysᵀ)[target_p], computed block_rows positions at a
    time; the gradients are computed with the loss and scaled in backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, keys: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        want_q, want_keys = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = q.new_zeros((), dtype=torch.float64)
        grad_q = torch.empty_like(q) if want_q else None
        grad_keys = torch.zeros_like(keys) if want_keys else None
        # under autocast the products run in its dtype (bf16 on a GPU) and the softmax in
        # float32, as autocast runs a matmul and cross_entropy; otherwise in q's dtype
        device = q.device.type
        mm_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
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


def catalog_softmax_loss(out: torch.Tensor, item_emb: torch.Tensor, target_index: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cross-entropy of each position's target over every item of the catalog (the full
    softmax), on cosine similarity. out (P, D) normalized outputs, item_emb (M, D) the
    catalog's rows, target_index (P,) each target's row in it. Equal to
    F.cross_entropy((out / temperature) @ normalize(item_emb).T, target_index)."""
    return _BlockwiseSoftmaxCE.apply(out / temperature, F.normalize(item_emb, dim=-1), target_index)
