"""Kernel launches that cost the host less time than Triton's own.

Triton's launch binds and specializes every argument, builds a cache key and checks the
kernel's globals on every call. An idle GPU waits that long for a call's first kernel
(host times with either launch: benchmarks/embedding_tuning.md).
A launch is `Prepared` once per kind of call: the constants (every parameter after the
runtime ones) and the launch options are split off and kept, with the kernels compiled
for them. `launch` prepares by its keyword arguments; hot callers keep their Prepared
launches and hand them to `launch_each`. A launch looks the compiled kernel up by what
Triton specializes the runtime arguments on (a tensor's dtype and 16-byte alignment;
an int's equality to 1, divisibility by 16, and 32- or 64-bit range; floats: none) and
hands the arguments straight to the compiled kernel's launcher, on the current stream,
without the launch metadata that Triton builds for launch hooks when none is registered
(a profiler that adds hooks gets Triton's launch). Tensors go to the launcher as their
addresses, read once here (given a tensor, the launcher asks it again and has the
driver check the address); a launch with a tensor not on a CUDA
device goes through Triton, which refuses it. The first launch of each key goes through
Triton, which compiles; under the interpreter every launch does.
Kernels launched here must not read globals that change after their first launch.
"""
import functools

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import JITFunction

_constexpr_flags: dict = {}  # id(kernel): whether each parameter is a constexpr
_runtime_counts: dict = {}  # id(kernel): _runtime_params(kernel)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launch asks torch
# False: every launch goes through Triton's (for comparison, or a Triton whose compiled
# kernels launch differently: here their launcher takes every parameter in order)
DIRECT = hasattr(CompiledKernel, "__getitem__")
CPU_MULTIPROCESSORS = 4  # what grids sized by multiprocessors take on a CPU (the interpreter)


_INT32_MIN, _INT32_MAX, _INT64_MAX = -(2**31), 2**31 - 1, 2**63 - 1


def _spec(arg) -> tuple:
    """What Triton's specialization of a runtime argument other than a tensor or a plain
    int (_bind's own case) can depend on (a superset)."""
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):  # an int subclass
        return int, arg == 1, arg % 16 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg <= _INT64_MAX
    if isinstance(arg, float):
        return (float,)
    return type(arg), arg


class Prepared:
    """A kernel's launches with every parameter after its first n_args (constexprs) and the
    launch options bound once: each launch then reads only its first n_args arguments.
    Holds the kernels compiled for it, by device and those arguments' key."""

    __slots__ = ("kernel", "kwargs", "rest", "compiled")

    def __init__(self, kernel, n_args: int, kwargs: dict):
        self.kernel, self.kwargs, self.compiled = kernel, kwargs, {}
        if isinstance(kernel, JITFunction):
            if not all(_flags(kernel)[n_args:]):
                raise TypeError(f"{kernel.__name__}: parameters after the first {n_args} must be constexprs to be prepared")
            self.rest = tuple(kwargs[name] for name in kernel.arg_names[n_args:])  # what the launcher gets for them


_prepared: dict = {}  # (id(kernel), n_args, kwargs' items): its Prepared


def prepare(kernel, n_args: int, **kwargs) -> Prepared:
    """The Prepared launch of kernel with kwargs (every parameter after the first n_args,
    then launch options such as num_warps); one per distinct kwargs."""
    key = (id(kernel), n_args, tuple(kwargs.items()))
    prepared = _prepared.get(key)
    if prepared is None:
        prepared = _prepared[key] = Prepared(kernel, n_args, kwargs)
    return prepared


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors, for grids sized to what runs at once; 4 on a CPU, where
    the interpreter runs the programs."""
    if device.type != "cuda":
        return CPU_MULTIPROCESSORS
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cdiv(n: int, d: int) -> int:
    """Ceiling division, for grids on the host: Triton's own cdiv is made to be called from
    kernels too, and a call from the host costs microseconds."""
    return -(-n // d)


# Triton specializes a pointer argument on its 16-byte alignment: the same kernel handed a
# pointer that is not compiles again, mid-run (seconds for the larger kernels, the first
# time a call brings the other alignment). Views of one allocation that kernels read each
# start at a multiple of this (aligned_size).
ALIGN_BYTES = 16


def aligned_size(n: int, itemsize: int) -> int:
    """n elements of itemsize bytes rounded up to whole ALIGN_BYTES: the room to leave for
    them so that what follows in the same allocation starts aligned."""
    per = max(1, ALIGN_BYTES // itemsize)
    return cdiv(n, per) * per


def aligned_empty(count: int, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """count uninitialized (n,) tensors from one allocation (one allocation costs the host
    less than count), each starting ALIGN_BYTES-aligned whatever n is: rows of a
    (count, aligned_size(n)) tensor."""
    return torch.empty(count, aligned_size(n, dtype.itemsize), dtype=dtype, device=device)[:, :n].unbind()


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1), as Triton's, on the host."""
    return 1 << max(n - 1, 0).bit_length()


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), where args are the first parameters in order and
    kwargs name every other parameter, then launch options (num_warps, maxnreg, ...)."""
    if not (DIRECT and isinstance(kernel, JITFunction)):
        kernel[grid](*args, **kwargs)
        return
    runtime = _runtime_params(kernel)
    # runtime parameters named: they join args, and kwargs (this call's own dict) keeps constants only
    if len(args) < runtime:
        args = (*args, *(kwargs.pop(name) for name in kernel.arg_names[len(args) : runtime]))
    launch_each(args, ((grid, prepare(kernel, len(args), **kwargs)),))


def launch_each(args: tuple, launches) -> None:
    """Each (grid, Prepared) of launches, in order, on the same first arguments: launches of
    one kernel (the phases of a computation), whose arguments are read once for all."""
    kernel = launches[0][1].kernel
    if not (DIRECT and isinstance(kernel, JITFunction)):
        for grid, prepared in launches:
            kernel[grid](*args, **prepared.kwargs)
        return
    head = _bind(args, _flags(kernel))
    device = torch.cuda.current_device()
    for grid, prepared in launches:
        if head is None:  # a tensor off the GPU: Triton refuses it
            kernel[grid](*args, **prepared.kwargs)
            continue
        compiled = prepared.compiled.get((device, head[0]))
        if compiled is None:
            compiled = kernel[grid](*args, **prepared.kwargs)
            prepared.compiled[device, head[0]] = compiled.result() if hasattr(compiled, "result") else compiled
            continue
        grid = (*grid, 1, 1)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _raw_stream is None or _hooked(enter) or _hooked(leave):
            compiled[grid[:3]](*args, *prepared.rest)
            continue
        compiled.run(
            grid[0], grid[1], grid[2], _raw_stream(device), compiled.function, compiled.packed_metadata, None, enter,
            leave, *head[1], *prepared.rest,
        )


def _flags(kernel) -> tuple:
    """Whether each parameter of kernel is a constexpr."""
    # kernels by id: a JITFunction's own hash is computed in Python on every lookup
    flags = _constexpr_flags.get(id(kernel))
    if flags is None:
        flags = _constexpr_flags[id(kernel)] = tuple(p.is_constexpr for p in kernel.params)
    return flags


def _runtime_params(kernel) -> int:
    """How many parameters of kernel come up to its last runtime (not constexpr) one."""
    count = _runtime_counts.get(id(kernel))
    if count is None:
        flags = _flags(kernel)
        count = _runtime_counts[id(kernel)] = len(flags) - flags[::-1].index(False) if False in flags else 0
    return count


def _bind(values: tuple, constant: tuple) -> tuple[tuple, list] | None:
    """(the key's part for values, what the launcher gets for them), constant[i] telling
    whether values[i] is a constexpr; None if a tensor is not on a CUDA device. A tensor
    passed several times (placeholders for unused pointers) is read once."""
    spec, passed, seen = [], [], {}
    for v, c in zip(values, constant):
        if c:
            spec.append(v)
        elif type(v) is int:  # the commonest argument after tensors: _spec's test inlined (a call costs more)
            spec.append((v == 1, v % 16 == 0, _INT32_MIN <= v <= _INT32_MAX, v <= _INT64_MAX))
        elif isinstance(v, torch.Tensor):
            key = id(v)
            bound = seen.get(key)
            if bound is None:
                if not v.is_cuda:
                    return None
                address = v.data_ptr()
                bound = seen[key] = ((v.dtype, address % ALIGN_BYTES == 0), address)
            spec.append(bound[0])
            v = bound[1]
        else:
            spec.append(_spec(v))
        passed.append(v)
    return tuple(spec), passed


def _hooked(hook) -> bool:
    """Whether a launch hook of Triton's knobs (None, or a chain of calls) would do anything."""
    return hook is not None and bool(getattr(hook, "calls", True))
