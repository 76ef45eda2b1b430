"""Pinned host memory that GPU kernels read and write in place.

With unified virtual addressing, page-locked host memory has one address for the CPU and
the GPU, so a CUDA tensor over it is an ordinary operand of PyTorch and Triton kernels:
its loads and stores cross PCIe (about 50 GB/s both ways for random 1.5 KB rows on an
H100's Gen5 x16 link, the same for torch's index kernels and Triton's). The host tier of
a tiered table keeps its rows there and every operation on it stays a GPU kernel.
"""
import torch


class _ArrayInterface:
    """Presents pinned bytes to torch.as_tensor as CUDA memory at their UVA address; the
    tensor made from it keeps it, and so the pinned tensor, alive."""

    def __init__(self, pinned: torch.Tensor):
        self.pinned = pinned
        self.__cuda_array_interface__ = {
            "shape": (pinned.numel(),), "typestr": "|u1", "data": (pinned.data_ptr(), False), "version": 3,
        }


def host_mapped(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(host, view): zeroed pinned CPU memory of `shape` and a tensor on the CUDA `device`
    over the same bytes (writes through either show in the other once the GPU's work is
    done). On a CPU device both are one plain tensor."""
    device = torch.device(device)
    if device.type != "cuda":
        t = torch.zeros(shape, dtype=dtype)
        return t, t
    if not all(shape):  # no bytes to map
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype, device=device)
    with torch.cuda.device(device):
        host = torch.empty(shape, dtype=dtype, pin_memory=True)
        view = torch.as_tensor(_ArrayInterface(host.view(-1).view(torch.uint8)), device=device)
    if view.data_ptr() != host.data_ptr():  # as_tensor copied instead of mapping
        raise RuntimeError(f"pinned host memory could not be mapped for {device}")
    view = view.view(dtype).view(shape)
    view.zero_()  # on the GPU: faster than a CPU memset of gigabytes
    return host, view
