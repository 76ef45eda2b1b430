"""Triton's interpreter, without its repeated patching of triton.language.

The interpreter runs a kernel by swapping triton.language's builtins for interpreted ones
(`_patch_lang`) for the launch, and restores them after it. It also calls `_patch_lang`
again at every call of a jitted helper inside the kernel, program by program: a scan of
every member of the language (`inspect.getmembers`) that finds the builtins already
swapped and swaps nothing, about 1.6 ms each. The dynamic-embedding kernels call helpers
thousands of times per test, so that scan was a third of their tests' time.

`install()` skips the scan for a helper whose language modules the running kernel has
patched already; what runs is otherwise Triton's own code. A Triton without these
internals is left as it is.
"""
import inspect

import triton.language as tl


def install() -> bool:
    """Installs the skip; False where this Triton's interpreter lacks what it wraps."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "skips_patched", False):
        return original is not None and getattr(original, "skips_patched", False)
    patched: list[set[int]] = []  # per kernel running now (outermost first): the language modules it patched
    modules: dict = {}  # per function: the language modules its globals hold

    def patch_lang(fn):
        langs = modules.get(fn)
        if langs is None:
            langs = modules[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if patched and langs <= patched[-1]:  # a helper inside a kernel that patched its language
            return scope_type()
        scope = original(fn)
        if patched:  # a helper with modules of its own: patched from now on (Triton leaves it so)
            patched[-1] = patched[-1] | langs
            return scope
        patched.append(set(langs))  # a kernel's launch: its scope is restored when the launch ends
        restore = scope.restore

        def restore_and_forget():
            patched.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang.skips_patched = True
    interpreter._patch_lang = patch_lang
    return True
