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

Every interpreted operation also builds the Triton types of its result: a `block_type`
(its shape unwrapped and validated, its name formatted) and a `tensor` (its shape as a
Triton tuple of constexprs, whose type is built in turn). The patch builds each block type's
and each tensor type's derived attributes once and copies them into later objects of the
same type: a block type's depend on its element type's name and its shape alone, a tensor's
on its type alone. What the objects hold is Triton's own values; they are built by Triton's
code at their first sight.
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
    _install_block_types()
    _install_tensors()
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


def _install_block_types() -> None:
    """`block_type(element_ty, shape)`: for a shape of plain ints (a list or a Triton tuple),
    what Triton's constructor sets is a function of the element type's name and the shape;
    the element type itself is the caller's."""
    triton_tuple = getattr(tl.core, "tuple", None)  # (what Triton's types hold their shapes in)
    if triton_tuple is None:
        return

    def key(element_ty, shape):
        dims = shape.values if type(shape) is triton_tuple else shape
        if type(dims) is not list or not all(type(s) is int for s in dims):
            return None
        return str(element_ty), tuple(dims)

    _remember_construction(tl.block_type, key, ("element_ty",))


def _install_tensors() -> None:
    """`tensor(handle, type)`: what Triton's constructor sets from the type (its shape as a
    tuple of constexprs, its element count, its scalar type) is a function of the type's
    class and name; the handle and the type are the caller's. Triton does not change a
    tensor's shape in place, so tensors of one type share it."""

    def key(handle, type):
        name = getattr(type, "name", None)
        return None if name is None else (type.__class__, name)

    _remember_construction(tl.tensor, key, ("handle", "type"))


def _remember_construction(cls, key, given: tuple[str, ...]) -> None:
    """cls.__init__ replaced by one that, for arguments whose `key` it has seen, copies the
    attributes Triton's constructor set on the first object of that key, then sets the
    attributes named `given` from the leading arguments (the caller's objects). Arguments
    whose key is None, and keyword calls, go through Triton's constructor."""
    original = cls.__init__
    if getattr(original, "remembers", False):
        return
    known: dict[tuple, dict] = {}

    def init(self, *args, **kwargs):
        k = None if kwargs else key(*args)
        state = None if k is None else known.get(k)
        if state is None:
            original(self, *args, **kwargs)
            if k is not None:
                known[k] = {name: v for name, v in self.__dict__.items() if name not in given}
            return
        self.__dict__.update(state)
        for name, value in zip(given, args):
            setattr(self, name, value)

    init.remembers = True
    init.original = original
    cls.__init__ = init
