"""The rows of a sampled softmax cross-entropy, in plain PyTorch: the twin of
triton_kernels.py.

Given each row's logits against N shared negatives (P, N), its positive's logit (P,), the
negatives' ids (N,) and each row's own id (P,): row p's softmax runs over its positive and
the negatives whose id is not its own (an accidental hit leaves the softmax), and its loss
is −log of the positive's probability. The logits are overwritten with the gradient of
the summed losses by them (each kept negative's probability, 0 where left out); the
positive's gradient, its probability − 1, is returned with the losses.
"""
import torch

ID_HASH_MULTIPLIER = -7046029254386353131  # (as in triton_kernels.py: 2⁶⁴ / golden ratio, odd, signed)


def softmax_rows(
    logits: torch.Tensor, positive: torch.Tensor, key_ids: torch.Tensor, row_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's loss, the gradient of the summed losses by each positive), (P,) in
    float32 (float64 for float64 logits); logits (P, N) become the gradient by them, in
    their dtype."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    hits = key_ids[None, :] == row_ids[:, None]
    full = torch.cat([positive.to(dtype)[:, None], logits.to(dtype).masked_fill(hits, float("-inf"))], dim=1)
    probs = torch.softmax(full, dim=1)
    logits.copy_(probs[:, 1:])
    return torch.logsumexp(full, dim=1) - full[:, 0], probs[:, 0] - 1.0


def id_bitmap(key_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """(2^(64 - shift) / 32,) int32 words: bit b (word b // 32, bit b % 32) is set where b
    is the top 64 - shift bits of some negative's id times the multiplier (as unsigned
    64-bit products)."""
    bits = 64 - shift
    product = key_ids.to(torch.int64) * ID_HASH_MULTIPLIER  # wraps modulo 2⁶⁴
    top = (product >> shift) & ((1 << bits) - 1)  # a logical shift of the unsigned product
    marked = torch.zeros(1 << bits, dtype=torch.bool, device=key_ids.device)
    marked[top] = True
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64, device=key_ids.device)
    words = (marked.view(-1, 32).to(torch.int64) * weights).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # bit 31 as the sign
