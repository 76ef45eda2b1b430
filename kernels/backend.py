"""Which implementation of a kernel op runs: the Triton kernels on CUDA and the pure-PyTorch
reference elsewhere ("auto"), or one forced ("triton", "reference": tests, benchmarks;
Triton on a CPU needs TRITON_INTERPRET=1); and the dtype an op's matrix products take
(autocast's where it is on), which both implementations follow; and a GPU's memory, which
ops size their buffers by."""
import functools

import torch

BACKENDS = ("auto", "reference", "triton")


def use_triton(backend: str, device: torch.device, what: str) -> bool:
    """Whether `what` (named in the error for an unknown backend) runs its Triton kernels."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown {what} backend {backend!r}; choose from {BACKENDS}")
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def matmul_dtype(q: torch.Tensor) -> torch.dtype:
    """The products' dtype: autocast's where it is on for q's device, else q's."""
    device = q.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype


@functools.cache
def device_memory(device: torch.device) -> int:
    """The GPU's memory in bytes."""
    return torch.cuda.get_device_properties(device).total_memory
