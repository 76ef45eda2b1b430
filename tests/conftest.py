import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

# Triton kernels run under Triton's interpreter where there is no GPU; set before any
# kernel module is imported (Triton reads it when a kernel is defined)
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, fn, *args) -> None:
    """Runs fn(rank, world, *args) in `world` gloo processes; fails if any process fails."""
    mp.start_processes(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="spawn")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "datasets").is_dir():
        pytest.skip("../shared/datasets is not present")
    return SHARED


@pytest.fixture
def poisoned_memory():
    """torch.empty returns NaN-filled memory (deterministic mode's fill), so that an output
    element a kernel leaves unwritten shows as NaN."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before)
