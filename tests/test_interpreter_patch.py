"""The interpreter patch of the test suite (interpreter_patch.py): kernels that call jitted
helpers compute what they did, and the language is patched once per launch, not again at
every helper call."""
import os

import pytest
import torch
import triton
import triton.language as tl

import interpreter_patch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _plus_one(x):
    return _twice(x) // 2 + 1  # a helper calling a helper


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n
    x = tl.load(x_ptr + cols, mask=live)
    tl.store(out_ptr + cols, _plus_one(x) + tl.maximum(x, 0), mask=live)


@triton.jit
def _plain_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n
    tl.store(out_ptr + cols, tl.load(x_ptr + cols, mask=live) + 1, mask=live)


def test_helpers_compute_as_before_and_the_language_is_patched_once_per_launch(monkeypatch):
    from triton.runtime import interpreter

    assert interpreter_patch.install()  # conftest installed it: installing again keeps it
    assert getattr(interpreter._patch_lang, "skips_patched", False)
    scans = []
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a, _scan=interpreter._patch_builtin: (scans.append(a[0]), _scan(*a))[1])
    x = torch.arange(-20, 20, dtype=torch.int32)
    out = torch.full_like(x, -999)
    _plain_kernel[(4,)](x, out, x.numel(), BLOCK=16)
    one_patch = len(scans)  # the scans of the launch's own patch
    assert one_patch > 0 and torch.equal(out, x + 1)
    _kernel[(4,)](x, out, x.numel(), BLOCK=16)  # 4 programs, 3 of them live, each calling helpers
    assert torch.equal(out, x + 1 + x.clamp(min=0))
    assert len(scans) == 2 * one_patch  # none per helper call or program
    # after a launch the language is Triton's own again (the launch's patch restored)
    assert tl.core.is_builtin(tl.maximum)


def test_the_remembered_numpy_dtypes_are_the_interpreters():
    """The patched _get_np_dtype answers as Triton's own for scalar, pointer and block types,
    the second time from memory; kernels over every width still compute."""
    from triton.runtime import interpreter

    assert getattr(interpreter._get_np_dtype, "remembers", False)
    original = interpreter._get_np_dtype.original
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64]
    types = scalars + [tl.pointer_type(tl.float32), tl.pointer_type(tl.int64)]
    types += [tl.block_type(t, [4, 8]) for t in types]
    for t in types + types:  # (the second pass from memory)
        assert interpreter._get_np_dtype(t) == original(t), t
    # (bfloat16 + 1 is wrong under Triton's interpreter with its own _get_np_dtype too: not run)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64):
        x = torch.arange(-20, 20).to(dtype)
        out = torch.zeros_like(x)
        _plain_kernel[(4,)](x, out, x.numel(), BLOCK=16)
        assert torch.equal(out, x + 1), dtype


def _attributes(obj) -> dict:
    """An object's attributes as comparable values (Triton's tuples and constexprs compare
    by value only through their own operators)."""
    return {k: repr(v) for k, v in vars(obj).items()}


def test_remembered_block_types_and_tensors_hold_what_tritons_constructors_give():
    """The patched constructors of block types and tensors set the attributes Triton's set,
    at the first sight of a type and from memory after it, for shapes as lists and as
    Triton tuples; a shape Triton refuses is refused still."""
    block_init, tensor_init = tl.block_type.__init__, tl.tensor.__init__
    assert getattr(block_init, "remembers", False) and getattr(tensor_init, "remembers", False)
    elements = [tl.int1, tl.int32, tl.int64, tl.float16, tl.bfloat16, tl.float32, tl.pointer_type(tl.float32),
                tl.pointer_type(tl.int64)]
    shapes = [[4], [4, 8], [8, 4], [1, 16], [2, 4, 8]]
    for element in elements:
        for shape in shapes:
            theirs = tl.block_type.__new__(tl.block_type)
            block_init.original(theirs, element, shape)
            for given in (list(shape), tl.core.tuple(list(shape)), list(shape)):  # (the last from memory)
                ours = tl.block_type(element, given)
                assert _attributes(ours) == _attributes(theirs) and ours == theirs
                assert ours.element_ty is element
                for t in (ours, element):  # a block's tensor and a scalar's
                    mine, triton_s = tl.tensor.__new__(tl.tensor), tl.tensor.__new__(tl.tensor)
                    tensor_init.original(triton_s, "handle", t)
                    tl.tensor("handle", t)  # (seen once)
                    tensor_init(mine, "handle", t)
                    assert _attributes(mine) == _attributes(triton_s) and mine.type is t
    with pytest.raises(AssertionError):  # a Python tuple: Triton's own assertion
        tl.block_type(tl.int32, (4, 8))
    with pytest.raises(TypeError, match="0d block_type"):
        tl.block_type(tl.int32, [])
