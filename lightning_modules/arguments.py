"""argparse types shared by `hstu` (pipelines/cli.py) and the training worker's command
line (train.py): a count below its least sensible value is refused when the flags are
parsed, with argparse's usage message, not deep in a run (a division by zero workers, a
pipeline that trains no epoch)."""
import argparse


def at_least(minimum: int):
    """An argparse type: a whole number not below minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    parse.__name__ = f"whole number >= {minimum}"  # (argparse names the type in its messages)
    return parse


POSITIVE, NON_NEGATIVE = at_least(1), at_least(0)
