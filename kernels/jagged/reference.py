"""Jagged tensor ops in plain PyTorch: the twins of triton_kernels.py and the test oracle.

A jagged tensor is `values` (rows of all sequences one after the other, (total, D)) and
`offsets` ((B + 1,) int64, offsets[0] = 0): sequence b holds rows offsets[b] to
offsets[b + 1]. Every op here is differentiable through torch's own indexing, runs on any
device, and accepts empty sequences and empty batches (B = 0).
"""
import torch


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """(B + 1,) int64 offsets of sequences of these lengths."""
    return torch.cat([lengths.new_zeros(1, dtype=torch.int64), torch.cumsum(lengths.to(torch.int64), 0)])


def _sequence_of_rows(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sequence of each row, the row's position in its sequence), both (total,)."""
    lengths = offsets[1:] - offsets[:-1]
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)
    return sequence, torch.arange(total, device=offsets.device) - offsets[sequence]


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0.0) -> torch.Tensor:
    """(B, max_len, D): sequence b's first max_len rows, padding_value past its length."""
    total = values.shape[0]
    sequence, position = _sequence_of_rows(offsets, total)
    kept = position < max_len
    padded = values.new_full((offsets.numel() - 1, max_len, values.shape[1]), padding_value)
    return padded.index_put((sequence[kept], position[kept]), values[kept])


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """(total, D) rows of the jagged tensor with these offsets: row j of sequence b is
    padded[b, j], zero where j >= max_len. total: offsets[-1] (read from the device if not
    given)."""
    if total is None:
        total = int(offsets[-1])
    sequence, position = _sequence_of_rows(offsets, total)
    kept = position < padded.shape[1]
    rows = padded.new_zeros((total, padded.shape[2]))
    return rows.index_put((kept,), padded[sequence[kept], position[kept]])


def _interleaved_rows(a_offsets: torch.Tensor, b_offsets: torch.Tensor, a_total: int, b_total: int):
    """Where the rows of a and of b go in their concatenation (each (total,))."""
    offsets = a_offsets + b_offsets
    a_sequence, a_position = _sequence_of_rows(a_offsets, a_total)
    b_sequence, b_position = _sequence_of_rows(b_offsets, b_total)
    a_lengths = a_offsets[1:] - a_offsets[:-1]
    return offsets[a_sequence] + a_position, offsets[b_sequence] + a_lengths[b_sequence] + b_position


def jagged_concat(
    a_values: torch.Tensor, a_offsets: torch.Tensor, b_values: torch.Tensor, b_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets) of the jagged tensor whose sequence b is a's sequence b followed by
    b's sequence b."""
    a_rows, b_rows = _interleaved_rows(a_offsets, b_offsets, a_values.shape[0], b_values.shape[0])
    rows = torch.cat([a_rows, b_rows])
    values = torch.cat([a_values, b_values]).new_zeros((rows.numel(), a_values.shape[1]))
    return values.index_put((rows,), torch.cat([a_values, b_values])), a_offsets + b_offsets


def jagged_split(
    values: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor, a_total: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_values, b_values): jagged_concat undone, given the offsets of the two parts.
    a_total: a_offsets[-1] (read from the device if not given)."""
    if a_total is None:
        a_total = int(a_offsets[-1])
    a_rows, b_rows = _interleaved_rows(a_offsets, b_offsets, a_total, values.shape[0] - a_total)
    return values[a_rows], values[b_rows]
