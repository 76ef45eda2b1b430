"""Dropout(LayerNorm(x) ⊙ u) in plain PyTorch: the twin of triton_kernels.py, with its mask.

The layer norm is over the last dimension in float32 (float64 for float64 inputs), the
product and the dropout follow in that dtype, and the result takes x's and u's promoted
dtype.

The dropout's mask is a function of a seed and of each element's place, so that the
backward can make it again instead of keeping it: element (r, c) of the (rows, D) input
is kept where word c % 4 of Philox-4x32 (ten rounds, Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) at counter r · ⌈D / 4⌉ + c // 4, keyed by the
seed's low and high 32 bits, is at least keep_threshold(p) as an unsigned 32-bit integer;
kept elements are scaled by 1 / (1 - p). Here the rounds run on int64 tensors holding
32-bit values.
"""
import torch
import torch.nn.functional as F

WORD = 1 << 32
LOW = WORD - 1
HALF = 1 << 16
# Philox-4x32's round multipliers and key increments (the published constants)
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
WORDS = 4  # words per counter: the mask's columns per counter


def check_probability(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")


def keep_threshold(p: float) -> int:
    """The least word that keeps an element: a share p of the 2^32 words drop it."""
    check_probability(p)
    return round(p * WORD)


def keep_scale(p: float) -> float:
    """What a kept element is multiplied by: 1 / (1 - p) (0 where nothing is kept)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _multiply(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a · b for 32-bit a (int64 tensor) and b, in halves of
    16 bits so that no int64 product overflows."""
    a_high, a_low = a >> 16, a & (HALF - 1)
    t = a_low * b  # < 2^48
    u = a_high * b + (t >> 16)  # a · b = u · 2^16 + (t mod 2^16)
    return u >> 16, ((u & (HALF - 1)) << 16) | (t & (HALF - 1))


def philox_words(seed: int, counters: torch.Tensor) -> list[torch.Tensor]:
    """The four 32-bit words (int64 tensors) of Philox-4x32-10 at each int64 counter
    (its low and high words the first two of the block, the others 0) under the key
    (seed's low word, seed's high word)."""
    c = [counters & LOW, (counters >> 32) & LOW, torch.zeros_like(counters), torch.zeros_like(counters)]
    k0, k1 = seed & LOW, (seed >> 32) & LOW
    for _ in range(ROUNDS):
        hi_b, lo_b = _multiply(c[2], ROUND_B)
        hi_a, lo_a = _multiply(c[0], ROUND_A)
        c = [hi_b ^ c[1] ^ k0, lo_b, hi_a ^ c[3] ^ k1, lo_a]
        k0, k1 = (k0 + KEY_A) & LOW, (k1 + KEY_B) & LOW
    return c


def kept(seed: int, rows: int, dim: int, p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, dim) bool: the elements the dropout keeps under seed (the module's docstring)."""
    r = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
    c = torch.arange(dim, dtype=torch.int64, device=device)[None, :]
    groups = -(-dim // WORDS)
    words = philox_words(seed, r * groups + c // WORDS)
    word = torch.where(c % WORDS == 0, words[0], torch.where(c % WORDS == 1, words[1], torch.where(c % WORDS == 2, words[2], words[3])))
    return word >= keep_threshold(p)


def norm_mul_dropout(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, p: float, seed: int,
) -> torch.Tensor:
    """(rows, D) Dropout(LayerNorm(x) · u) of x, u (rows, D) under seed's mask (p = 0: no
    dropout); differentiable in x, u, weight and bias."""
    wide = torch.promote_types(torch.promote_types(x.dtype, u.dtype), torch.float32)
    y = F.layer_norm(x.to(wide), (x.shape[-1],), weight.to(wide), bias.to(wide), eps) * u.to(wide)
    if p > 0:
        y = torch.where(kept(seed, x.shape[0], x.shape[1], p, x.device), y * keep_scale(p), 0.0)
    return y.to(torch.promote_types(x.dtype, u.dtype))
