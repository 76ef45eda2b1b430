"""Kernel launches that cost the host less time than Triton's own.

Triton's launch binds and specializes every argument, builds a cache key and checks the
kernel's globals on every call. An idle GPU waits that long for a call's first kernel:
on an H100 lease (Triton 3.6) find_values took 53 us of host time with Triton's launch
and 36 us with this one, find_or_insert_values (two launches) 150 and 90 us
(benchmarks/launch_overhead.py).
`launch` looks the compiled kernel up by a key of its own and hands the arguments
straight to the compiled kernel's launcher, on the current stream, without the launch
metadata that Triton builds for launch hooks when none is registered (a profiler that
adds hooks gets Triton's launch). The key holds the constants and, per runtime
argument, what Triton specializes on: a tensor's dtype and 16-byte alignment; an int's
equality to 1, divisibility by 16, and 32- or 64-bit range (floats: none). Tensors go
to the launcher as their addresses, read once here (given a tensor, the launcher asks
it again and has the driver check the address: the claim's first launch, 9 tensors,
took 9.7 us of host time against 7.8 given addresses, on a lent H100 host);
a launch with a tensor not on a CUDA device goes through Triton, which refuses it. The
first launch of each key goes through Triton, which compiles; under the interpreter
every launch does.
Kernels launched here must not read globals that change after their first launch.
"""
import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import JITFunction

_compiled: dict = {}
_constexpr_flags: dict = {}  # id(kernel): whether each parameter is a constexpr
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launch asks torch
# False: every launch goes through Triton's (for comparison, or a Triton whose compiled
# kernels launch differently: here their launcher takes every parameter in order)
DIRECT = hasattr(CompiledKernel, "__getitem__")


def _spec(arg) -> tuple:
    """What Triton's specialization of a runtime argument other than a tensor can depend on
    (a superset)."""
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63
    if isinstance(arg, float):
        return (float,)
    return type(arg), arg


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), where args are the first parameters in order and
    kwargs name every other parameter, then launch options (num_warps, maxnreg, ...)."""
    launch_each(kernel, args, ((grid, kwargs),))


def launch_each(kernel, args: tuple, launches) -> None:
    """launch(kernel, grid, *args, **kwargs) for each (grid, kwargs) of launches, in order:
    launches of one kernel on the same first arguments (the phases of a computation),
    which are read once for all of them."""
    if not (DIRECT and isinstance(kernel, JITFunction)):
        for grid, kwargs in launches:
            kernel[grid](*args, **kwargs)
        return
    # kernels by id: a JITFunction's own hash is computed in Python on every lookup
    flags = _constexpr_flags.get(id(kernel))
    if flags is None:
        flags = _constexpr_flags[id(kernel)] = tuple(p.is_constexpr for p in kernel.params)
    head = _bind(args, flags)
    device = torch.cuda.current_device()
    for grid, kwargs in launches:
        kwargs = dict(kwargs)
        rest = tuple(kwargs.pop(name) for name in kernel.arg_names[len(args):])  # kwargs keeps the options
        tail = _bind(rest, flags[len(args):])
        if head is None or tail is None:  # a tensor off the GPU: Triton refuses it
            kernel[grid](*args, *rest, **kwargs)
            continue
        key = (id(kernel), device, tuple(kwargs.items()), head[0], tail[0])
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = kernel[grid](*args, *rest, **kwargs)
            _compiled[key] = compiled.result() if hasattr(compiled, "result") else compiled
            continue
        grid = (*grid, 1, 1)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _raw_stream is None or _hooked(enter) or _hooked(leave):
            compiled[grid[:3]](*args, *rest)
            continue
        compiled.run(
            grid[0], grid[1], grid[2], _raw_stream(device), compiled.function, compiled.packed_metadata, None, enter,
            leave, *head[1], *tail[1],
        )


def _bind(values: tuple, constant: tuple) -> tuple[tuple, list] | None:
    """(the key's part for values, what the launcher gets for them), constant[i] telling
    whether values[i] is a constexpr; None if a tensor is not on a CUDA device."""
    spec, passed = [], []
    for v, c in zip(values, constant):
        if c:
            spec.append(v)
        elif isinstance(v, torch.Tensor):
            if not v.is_cuda:
                return None
            address = v.data_ptr()
            spec.append((v.dtype, address % 16 == 0))
            v = address
        else:
            spec.append(_spec(v))
        passed.append(v)
    return tuple(spec), passed


def _hooked(hook) -> bool:
    """Whether a launch hook of Triton's knobs (None, or a chain of calls) would do anything."""
    return hook is not None and bool(getattr(hook, "calls", True))
