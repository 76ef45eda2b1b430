"""A GPU call captured once in a CUDA graph and replayed: what a benchmark times to see
the GPU's part of a call alone, as a training step that replays its graphs sees it (no
host time between the kernels: Python, autograd's engine, the launches)."""
from typing import Callable

import torch

WARMUP_CALLS = 3  # calls before the capture: kernel tuning and compilation, lazily made state


def replayed(fn: Callable[[], object]) -> Callable[[], None]:
    """The replay of fn's CUDA graph. fn is called WARMUP_CALLS times on a side stream,
    then captured once; it must not wait on the device (no .item(), no data-dependent
    shapes), as anything captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
