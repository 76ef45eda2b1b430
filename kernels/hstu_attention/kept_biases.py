"""The forward's pair-bias buffers (bias_tiles.py) kept until the backward, within a budget.

A forward that reads the prepass's buffer may hand it to its backward, which then reads it
instead of running the prepass again (triton_kernels.KEEP_PAIR_BIASES). Each kept buffer
is held from a layer's forward to its backward, as large as one head's stored dS: a model
of many layers holds one per layer at once. So the buffers held at once on a device stay
within 1 / KEPT_MEMORY_SHARE of its memory: a forward whose buffer would pass that keeps
nothing, and its backward runs the prepass again. A buffer counts as held until the
tensor is freed (after its backward, or with its autograd graph).
"""
import threading
import weakref

import torch

from ..backend import device_memory

KEPT_MEMORY_SHARE = 8
CPU_BUDGET_BYTES = 1 << 30  # on a CPU (the interpreter's runs): a fixed budget

_lock = threading.Lock()  # (the backward, which frees buffers, may run on autograd's threads)
_held: dict = {}  # device: bytes of the kept buffers not yet freed


def budget(device: torch.device) -> int:
    """Bytes of kept buffers a device may hold at once."""
    if device.type != "cuda":
        return CPU_BUDGET_BYTES
    return device_memory(device) // KEPT_MEMORY_SHARE


def held(device: torch.device) -> int:
    """Bytes of the kept buffers on device not yet freed."""
    with _lock:
        return _held.get(device, 0)


def keep(biases: torch.Tensor) -> torch.Tensor | None:
    """biases, counted as held until the tensor is freed, where they fit the device's
    budget beside the buffers held; else None (the backward makes its own)."""
    size, device = biases.numel() * biases.element_size(), biases.device
    with _lock:
        if _held.get(device, 0) + size > budget(device):
            return None
        _held[device] = _held.get(device, 0) + size
    weakref.finalize(biases, _release, device, size)
    return biases


def _release(device: torch.device, size: int) -> None:
    with _lock:
        _held[device] -= size
