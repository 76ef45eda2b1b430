"""Kernel launches that cost the host less time than Triton's own.

Triton's launch binds and specializes every argument, builds a cache key and checks the
kernel's globals on every call: a launch of the claim kernel took 64 us of host time
(Triton 3.6, an H100 machine), 31 us here. An idle GPU waits that long for a call's
first kernel (benchmarks/launch_overhead.py).
`launch` looks the compiled kernel up by a key of its own and hands the arguments
straight to the compiled kernel's launcher. The key holds the constants and, per runtime
argument, what Triton specializes on: a tensor's dtype and 16-byte alignment; an int's
equality to 1, divisibility by 16, and 32- or 64-bit range (floats: none). The first
launch of each key goes through Triton, which compiles; under the interpreter every
launch does.
Kernels launched here must not read globals that change after their first launch.
"""
import torch
from triton.compiler import CompiledKernel
from triton.runtime import JITFunction

_compiled: dict = {}
_constexpr_flags: dict = {}  # kernel: whether each parameter is a constexpr
# False: every launch goes through Triton's (for comparison, or a Triton whose compiled
# kernels launch differently: here their launcher takes every parameter in order)
DIRECT = hasattr(CompiledKernel, "__getitem__")


def _spec(arg) -> tuple:
    """What Triton's specialization of a runtime argument can depend on (a superset)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
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
    if not (DIRECT and isinstance(kernel, JITFunction)):
        kernel[grid](*args, **kwargs)
        return
    flags = _constexpr_flags.get(kernel)
    if flags is None:
        flags = _constexpr_flags[kernel] = tuple(p.is_constexpr for p in kernel.params)
    values = (*args, *(kwargs.pop(name) for name in kernel.arg_names[len(args):]))  # kwargs keeps the options
    key = (kernel, torch.cuda.current_device(), tuple(kwargs.items()), tuple(v if c else _spec(v) for v, c in zip(values, flags)))
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel[grid](*values, **kwargs)
        _compiled[key] = compiled.result() if hasattr(compiled, "result") else compiled
        return
    compiled[(*grid, 1, 1)[:3]](*values)
