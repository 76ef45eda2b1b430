"""What Triton's compiler makes of every kernel under kernels/, checked without a GPU.

Every Triton kernel and helper reads only module globals that the compiler accepts
(constexprs, jitted functions, modules, triton.language objects). The interpreter, which
runs the kernels in CI, accepts any global; the compiler refuses the others on a GPU
("Cannot access global variable").

No kernel specializes on a count that changes from call to call (a batch's rows): Triton
compiles a kernel again for an int divisible by 16 or not, so the first batch of the other
kind would compile one in the middle of training, on every rank's critical path.

Every launched kernel has a name no other kernel has: profilers and traces list GPU time
by the kernel's name, so two ops' kernels of one name read as one op's."""
import ast
import importlib
import inspect
import pkgutil
import textwrap
from types import ModuleType

import triton.language as tl
from triton.runtime.jit import KernelInterface  # a jitted function, compiled or interpreted

import kernels


def _python_function(k):
    """The Python function under a jitted one (autotuned and heuristics kernels wrap a
    jitted function in turn)."""
    while not inspect.isfunction(k):
        k = k.fn
    return k


def _jitted_objects() -> list:
    """Every jitted function defined under kernels/, as Triton wraps it (once each)."""
    found = {}
    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, KernelInterface):
                fn = _python_function(value)
                if fn.__module__ == info.name:
                    found[fn.__qualname__, info.name] = value
    return list(found.values())


def _jitted() -> list:
    """The Python functions of every jitted function defined under kernels/."""
    return [_python_function(k) for k in _jitted_objects()]


def _jit_function(k):
    """The jitted function itself (compiled or interpreted) under autotuners and heuristics."""
    while not inspect.isfunction(k.fn):
        k = k.fn
    return k


def _not_specialized(k) -> set[str]:
    """The parameters a jitted function is told not to specialize on (by name or index)."""
    jit = _jit_function(k)
    names = (getattr(jit, "kwargs", None) or {}).get("do_not_specialize", None)
    if names is None:
        names = getattr(jit, "do_not_specialize", None) or []
    return {jit.arg_names[n] if isinstance(n, int) else n for n in names}


def _globals_read(fn) -> set[str]:
    """Names a function reads that are neither its parameters nor assigned in it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    stored = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    stored |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - stored


def _accepted(value) -> bool:
    return (isinstance(value, (ModuleType, KernelInterface, tl.constexpr, tl.dtype))
            or getattr(value, "__module__", "").startswith("triton.language"))


def test_kernels_read_only_globals_the_compiler_accepts():
    kernels_found = _jitted()
    assert len(kernels_found) > 50  # every kernel module was walked
    refused = []
    for fn in kernels_found:
        scope = fn.__globals__
        refused += [f"{fn.__module__}.{fn.__name__} reads {name}" for name in sorted(_globals_read(fn))
                    if name in scope and not _accepted(scope[name])]
    assert not refused, refused


# the names kernels give a per-call count (lanes, rows, pairs)
PER_CALL_COUNTS = {"n", "rows", "P"}


def _launched() -> list:
    """The jitted functions launched as kernels (named *_kernel; the rest are helpers the
    compiler inlines)."""
    return [k for k in _jitted_objects() if _python_function(k).__name__.endswith("_kernel")]


def test_kernels_do_not_specialize_on_per_call_counts():
    launched = _launched()
    assert len(launched) > 40
    specialized = []
    for k in launched:
        counts = PER_CALL_COUNTS & set(_jit_function(k).arg_names)
        fn = _python_function(k)
        specialized += [f"{fn.__module__}.{fn.__name__} specializes on {name}"
                        for name in sorted(counts - _not_specialized(k))]
    assert not specialized, specialized


def test_every_launched_kernel_has_a_name_of_its_own():
    where = {}
    for k in _launched():
        fn = _python_function(k)
        where.setdefault(fn.__name__, []).append(fn.__module__)
    assert len(where) > 40
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not shared, shared
