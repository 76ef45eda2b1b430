"""torch.compile for the model's functions of jagged tensors: one compilation for every row
count. A jagged batch's total row count is new nearly every step; compiled as is, each
count would be a new specialization until torch gave up compiling (its recompile limit).
Marking the row dimension dynamic makes the first call's graph serve them all."""
import contextlib
import functools

import torch


@functools.cache
def compiled(fn, jagged: tuple[int, ...], data_dependent_sizes: bool = False):
    """fn through torch.compile, the first dimension of its arguments at the places `jagged`
    marked as varying between calls (a jagged batch's total). data_dependent_sizes: ops
    whose outputs' sizes depend on their inputs' values (the attention's kept biases,
    kernels/hstu_attention/graph_ops.py) stay in the graph instead of ending it."""
    compiled_fn = torch.compile(fn)

    def call(*args):
        for i in jagged:
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True) if data_dependent_sizes else contextlib.nullcontext():
            return compiled_fn(*args)

    return call


def compiled_if(compile: bool, fn, jagged: tuple[int, ...] = (0, 1)):
    """compiled(fn, jagged) where compile is set, else fn itself; fn itself too while
    torch.compile traces the caller (a model compiled whole), whose graph takes fn's ops in."""
    return compiled(fn, jagged) if compile and not torch.compiler.is_compiling() else fn
