"""argparse types shared by `hstu` (pipelines/cli.py) and the training worker's command
line (train.py): a count below its least sensible value, a rate or fraction out of its
range, or an item id that is not one, is refused when the flags are parsed, with
argparse's usage message, not deep in a run (a division by zero workers, a pipeline that
trains no epoch)."""
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


def number_in(low: float, high: float = float("inf"), low_included: bool = True):
    """An argparse type: a real number in [low, high) (or (low, high) without low_included)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((low <= value) if low_included else (low < value)) or not value < high:
            raise argparse.ArgumentTypeError(f"{value} is outside {'[' if low_included else '('}{low}, {high})")
        return value

    parse.__name__ = "number"
    return parse


POSITIVE_NUMBER, NON_NEGATIVE_NUMBER, FRACTION = number_in(0.0, low_included=False), number_in(0.0), number_in(0.0, 1.0)


def int64_values(what: str):
    """An argparse type: comma-separated int64 values (item ids or timestamps, as the data
    holds them), at least one; errors name each value as `what`."""

    def parse(text: str) -> list[int]:
        values = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                values.append(int(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} is not an {what} (a whole number)") from None
            if not -(2**63) <= values[-1] < 2**63:
                raise argparse.ArgumentTypeError(f"{part} is outside int64, which {what}s are")
        if not values:
            raise argparse.ArgumentTypeError(f"no {what} given")
        return values

    parse.__name__ = f"{what}s"
    return parse


item_ids = int64_values("item id")  # a history: at least one id, as the server's requests need
timestamps = int64_values("timestamp")
