"""Where a benchmark writes its JSON: benchmarks/results/<name>_<device>.json."""
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def device_slug(device: str = "cuda") -> str:
    """'h100' for an NVIDIA H100 80GB HBM3, 'cpu' on the CPU."""
    if device == "cpu":
        return "cpu"
    words = torch.cuda.get_device_name().lower().split()
    return next((w for w in words if any(c.isdigit() for c in w)), words[-1])


def result_path(name: str, device: str = "cuda") -> Path:
    return RESULTS / f"{name}_{device_slug(device)}.json"
