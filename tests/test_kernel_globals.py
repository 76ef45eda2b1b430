"""Every Triton kernel and helper under kernels/ reads only module globals that Triton's
compiler accepts (constexprs, jitted functions, modules, triton.language objects). The
interpreter, which runs the kernels in CI, accepts any global; the compiler refuses the
others on a GPU ("Cannot access global variable")."""
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


def _jitted() -> list:
    """The Python functions of every jitted function defined under kernels/."""
    found = {}
    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, KernelInterface):
                fn = _python_function(value)
                if fn.__module__ == info.name:
                    found[fn.__qualname__, info.name] = fn
    return list(found.values())


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
