"""Sparse optimizers whose state lives in the embedding row, after the embedding itself.

A row is `[embedding (dim) | state (state_dim(dim))]`. `update` takes the rows of unique
ids and their summed gradients and returns the updated rows in one pass (the reference of
the fused update kernel).
"""
from dataclasses import dataclass, asdict

import torch


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"  # sgd | adam | adagrad | rowwise_adagrad
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None  # per-row clipping of the summed gradient

    def __post_init__(self):
        if self.name not in _STATE_DIM:
            raise ValueError(f"unknown embedding optimizer {self.name!r}; choose from {sorted(_STATE_DIM)}")
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig: lr and weight_decay must not be negative and eps must be positive, got {self}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"OptimizerConfig: beta1 and beta2 must lie in [0, 1), got {self.beta1}, {self.beta2}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be positive (or None), got {self.max_grad_norm}")

    def state_dim(self, dim: int) -> int:
        return _STATE_DIM[self.name](dim)

    def to_dict(self) -> dict:
        return asdict(self)


# Adam keeps m, v and a per-row step count (rows are updated at different rates)
_STATE_DIM = {
    "sgd": lambda d: 0,
    "adam": lambda d: 2 * d + 1,
    "adagrad": lambda d: d,
    "rowwise_adagrad": lambda d: 1,
}


def initial_state(cfg: OptimizerConfig, n: int, dim: int, dtype, device) -> torch.Tensor:
    return torch.zeros(n, cfg.state_dim(dim), dtype=dtype, device=device)


def update(cfg: OptimizerConfig, rows: torch.Tensor, grads: torch.Tensor, dim: int) -> torch.Tensor:
    """Applies one optimizer step to `rows` (N, dim + state) given `grads` (N, dim)."""
    g = grads.to(torch.float32)
    if cfg.max_grad_norm is not None:
        norm = g.norm(dim=1, keepdim=True).clamp(min=1e-12)
        g = g * (cfg.max_grad_norm / norm).clamp(max=1.0)
    rows = rows.to(torch.float32).clone()
    w = rows[:, :dim]
    if cfg.weight_decay:
        g = g + cfg.weight_decay * w
    if cfg.name == "sgd":
        w -= cfg.lr * g
    elif cfg.name == "adam":
        m, v, t = rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim], rows[:, 3 * dim :]
        t += 1
        m.mul_(cfg.beta1).add_((1 - cfg.beta1) * g)
        v.mul_(cfg.beta2).add_((1 - cfg.beta2) * g * g)
        m_hat = m / (1 - cfg.beta1**t)
        v_hat = v / (1 - cfg.beta2**t)
        w -= cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps)
    elif cfg.name == "adagrad":
        s = rows[:, dim : 2 * dim]
        s += g * g
        w -= cfg.lr * g / (s.sqrt() + cfg.eps)
    else:  # rowwise_adagrad
        s = rows[:, dim : dim + 1]
        s += (g * g).mean(1, keepdim=True)
        w -= cfg.lr * g / (s.sqrt() + cfg.eps)
    return rows
