"""Where a benchmark writes its JSON: benchmarks/results/<name>_<device>.json."""
import json
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


def write_results(name: str, rows: list[dict], out: str | None, device: str = "cuda", **meta) -> Path:
    """{"meta": device, torch version and meta, "results": rows} to out or the default path."""
    path = Path(out) if out else result_path(name, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if device != "cpu" else "cpu"
    path.write_text(json.dumps({"meta": {"device": device_name, "torch": torch.__version__, **meta}, "results": rows}, indent=2))
    print(f"wrote {path}")
    return path
