"""Pinned host memory mapped for the GPU: one set of bytes seen from both sides."""
import torch

from kernels.dynamic_embedding.host_memory import host_mapped

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def settle() -> None:
    """Waits for the device's writes before the CPU reads host memory."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def test_host_mapped_memory_is_shared_by_the_cpu_and_the_device():
    host, view = host_mapped((5, 3), torch.float32, DEVICE)
    assert host.device.type == "cpu" and view.device.type == DEVICE and view.shape == host.shape == (5, 3)
    assert view.data_ptr() == host.data_ptr() and not host.any()
    view[1:3] = torch.arange(6.0, device=DEVICE).view(2, 3)  # a device kernel writes host memory
    host[4] = 7.0
    assert host.is_pinned() or DEVICE == "cpu"
    settle()
    assert host[1:3].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert view[4].tolist() == [7.0] * 3 and view[0].sum().item() == 0


def test_host_mapped_memory_of_other_dtypes_and_no_elements():
    host, view = host_mapped((4, 2), torch.bfloat16, DEVICE)
    view += 1.5
    settle()
    assert view.dtype == host.dtype == torch.bfloat16 and host.float().sum().item() == 12.0
    host, view = host_mapped((0, 8), torch.float32, DEVICE)
    assert host.shape == view.shape == (0, 8) and view.device.type == DEVICE
