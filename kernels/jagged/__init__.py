"""Jagged tensor ops: one entry point per op that runs the Triton kernel on CUDA and its
pure-PyTorch twin elsewhere (backend="triton" or "reference" picks one; "auto" by device).

A jagged tensor is `values` ((total, D), sequences' rows one after the other) plus
`offsets` ((B + 1,) int64, offsets[0] = 0). Empty sequences and empty batches are legal.
Every op is differentiable: the Triton path's backward is the op that undoes it, run by
the same kernels (padded ↔ jagged, concat ↔ split).
"""
import torch

from ..backend import use_triton
from . import reference, triton_kernels


def _ops(backend: str, device: torch.device):
    """The module whose ops run: triton_kernels or reference."""
    return triton_kernels if use_triton(backend, device, "jagged") else reference


def check_offsets(offsets: torch.Tensor) -> None:
    """Refuses offsets that are not a 1-D int64 tensor of B + 1 entries."""
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype != torch.int64:
        raise ValueError(f"offsets must be a 1-D int64 tensor of B + 1 entries, got {offsets.dtype} {tuple(offsets.shape)}")


def _check(values: torch.Tensor, offsets: torch.Tensor, name: str = "values") -> None:
    if values.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, D), got shape {tuple(values.shape)}")
    check_offsets(offsets)


class _JaggedToPadded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, max_len, padding_value):
        ctx.save_for_backward(offsets)
        ctx.total = values.shape[0]
        return triton_kernels.jagged_to_padded(values, offsets, max_len, padding_value)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return triton_kernels.padded_to_jagged(grad, offsets, ctx.total), None, None, None


class _PaddedToJagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, offsets, total):
        ctx.save_for_backward(offsets)
        ctx.max_len = padded.shape[1]
        return triton_kernels.padded_to_jagged(padded, offsets, total)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return triton_kernels.jagged_to_padded(grad, offsets, ctx.max_len, 0.0), None, None


class _Concat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_values, a_offsets, b_values, b_offsets):
        ctx.save_for_backward(a_offsets, b_offsets)
        ctx.a_total = a_values.shape[0]
        values, _ = triton_kernels.jagged_concat(a_values, a_offsets, b_values, b_offsets)
        return values

    @staticmethod
    def backward(ctx, grad):
        a_offsets, b_offsets = ctx.saved_tensors
        a_grad, b_grad = triton_kernels.jagged_split(grad, a_offsets, b_offsets, ctx.a_total)
        return a_grad, None, b_grad, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, a_offsets, b_offsets, a_total):
        ctx.save_for_backward(a_offsets, b_offsets)
        return triton_kernels.jagged_split(values, a_offsets, b_offsets, a_total)

    @staticmethod
    def backward(ctx, a_grad, b_grad):
        a_offsets, b_offsets = ctx.saved_tensors
        values, _ = triton_kernels.jagged_concat(a_grad.contiguous(), a_offsets, b_grad.contiguous(), b_offsets)
        return values, None, None, None


def offsets_from_lengths(lengths: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """(B + 1,) int64 offsets of sequences of these lengths."""
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    return _ops(backend, lengths.device).offsets_from_lengths(lengths)


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0.0, backend: str = "auto"
) -> torch.Tensor:
    """(B, max_len, D): sequence b's first max_len rows, padding_value past its length."""
    _check(values, offsets)
    if _ops(backend, values.device) is reference:
        return reference.jagged_to_padded(values, offsets, max_len, padding_value)
    return _JaggedToPadded.apply(values, offsets, max_len, padding_value)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int | None = None, backend: str = "auto") -> torch.Tensor:
    """(total, D) rows of the jagged tensor with these offsets: row j of sequence b is
    padded[b, j] (zero for j >= max_len). total: offsets[-1]; giving it saves reading it
    from the device."""
    check_offsets(offsets)
    if padded.dim() != 3 or padded.shape[0] != offsets.numel() - 1:
        raise ValueError(f"padded must be (B, max_len, D) with B = {offsets.numel() - 1}, got shape {tuple(padded.shape)}")
    if total is None:
        total = int(offsets[-1])
    if _ops(backend, padded.device) is reference:
        return reference.padded_to_jagged(padded, offsets, total)
    return _PaddedToJagged.apply(padded, offsets, total)


def jagged_concat(
    a_values: torch.Tensor, a_offsets: torch.Tensor, b_values: torch.Tensor, b_offsets: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets): sequence b is a's sequence b followed by b's sequence b (as HSTU
    joins a history with its candidates, or a context prefix with a history)."""
    _check(a_values, a_offsets, "a_values")
    _check(b_values, b_offsets, "b_values")
    if a_offsets.numel() != b_offsets.numel() or a_values.shape[1] != b_values.shape[1]:
        raise ValueError(
            f"a and b must have as many sequences and columns: {a_offsets.numel() - 1} x {a_values.shape[1]} "
            f"and {b_offsets.numel() - 1} x {b_values.shape[1]}"
        )
    if _ops(backend, a_values.device) is reference:
        return reference.jagged_concat(a_values, a_offsets, b_values, b_offsets)
    return _Concat.apply(a_values, a_offsets, b_values, b_offsets), a_offsets + b_offsets


def jagged_split(
    values: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor, a_total: int | None = None, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_values, b_values): jagged_concat undone, given the offsets of its two parts.
    a_total: a_offsets[-1]; giving it saves reading it from the device."""
    _check(values, a_offsets)
    if a_offsets.numel() != b_offsets.numel():
        raise ValueError(f"a_offsets and b_offsets must have as many entries: {a_offsets.numel()} and {b_offsets.numel()}")
    if a_total is None:
        a_total = int(a_offsets[-1])
    if _ops(backend, values.device) is reference:
        return reference.jagged_split(values, a_offsets, b_offsets, a_total)
    return _Split.apply(values, a_offsets, b_offsets, a_total)
