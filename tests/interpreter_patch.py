"""Triton's interpreter, without its repeated patching of triton.language.

The interpreter runs a kernel by swapping triton.language's builtins for interpreted ones
(`_patch_lang`) for the launch, and restores them after it. It also calls `_patch_lang`
again at every call of a jitted helper inside the kernel, program by program: a scan of
every member of the language (`inspect.getmembers`) that finds the builtins already
swapped and swaps nothing, about 1.6 ms each. The dynamic-embedding kernels call helpers
thousands of times per test, so that scan was a third of their tests' time.

`install()` skips the scan for a helper whose language modules the running kernel has
patched already; what runs is otherwise Triton's own code. It also gives the interpreter a
`_get_np_dtype` that looks each element type's NumPy dtype up once: Triton's builds a table
of every type at each call, and a test of the embedding kernels makes hundreds of
thousands of calls. A Triton without these internals is left as it is.
"""
import inspect

import numpy as np
import triton.language as tl


def install() -> bool:
    """Installs the skip; False where this Triton's interpreter lacks what it wraps."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if getattr(original, "skips_patched", False):  # installed already
        return True
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:
        return False
    running: set[int] | None = None  # the language modules the running kernel's launch patched (launches do not nest)
    modules: dict = {}  # per function: the language modules its globals hold

    def patch_lang(fn):
        nonlocal running
        langs = modules.get(fn)
        if langs is None:
            langs = modules[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if running is not None and langs <= running:  # a helper inside a kernel that patched its language
            return scope_type()
        scope = original(fn)
        if running is not None:  # a helper with modules of its own: patched from now on (Triton leaves it so)
            running |= langs
            return scope
        running = set(langs)  # a kernel's launch: its scope is restored when the launch ends
        restore = scope.restore

        def restore_and_forget():
            nonlocal running
            running = None
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang.skips_patched = True
    interpreter._patch_lang = patch_lang
    _install_np_dtype(interpreter)
    return True


def _install_np_dtype(interpreter) -> None:
    """The interpreter's `_get_np_dtype` (a Triton type, scalar, pointer or block, to the
    NumPy dtype of its values) with each scalar type's answer remembered by its name (Triton's
    types are equal when their names are); pointers and blocks of pointers are uint64."""
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "remembers", False):
        return
    known: dict[str, object] = {}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return pointer
        found = known.get(element.name)
        if found is None:
            found = known[element.name] = original(element)
        return found

    get_np_dtype.remembers = True
    get_np_dtype.original = original
    interpreter._get_np_dtype = get_np_dtype
