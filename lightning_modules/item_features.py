"""Item side features of the MovieLens sets: each movie's genres, written by the prepare
step as `items.parquet` (item_id int64, genres list<string>, genre_ids list<int64>).

Genre ids number the set's genre names in sorted order (the same names give the same ids
in every run on the same file); a movie listed without genres has an empty list. Sources:
ml-100k `u.item` (19 genre flags, named as its `u.genre`), ml-1m `movies.dat`
(`id::title::A|B`), ml-latest-small and ml-20m `movies.csv` (`movieId,title,genres`,
"(no genres listed)" meaning none).

`ItemFeatures` is the model's view of that file: each item's genre ids as a jagged table
on a device, and `bags(ids)`, the genre bags of any batch of item ids.
"""
import csv
import io
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kernels.jagged import offsets_from_lengths

from .datasets import DataError, default_cache_dir, locate

ITEMS_FILE = "items.parquet"
ML100K_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
    "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)
NO_GENRES = "(no genres listed)"
# the archive member holding each set's movies, and its format
MOVIES = {
    "ml-100k": ("ml-100k/u.item", "item"),
    "ml-1m": ("ml-1m/movies.dat", "dat"),
    "ml-latest-small": ("ml-latest-small/movies.csv", "csv"),
    "ml-20m": ("ml-20m/movies.csv", "csv"),
}


def _item_id(text: str, where: str, line: int, field: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(f"{where}:{line}: field '{field}': expected an integer, got {text!r}") from None


def parse_movies(data: bytes, fmt: str, where: str) -> dict[int, list[str]]:
    """{item id: its genre names} from a movies file's bytes; errors name file, line, field."""
    genres: dict[int, list[str]] = {}
    if fmt == "csv":
        rows = csv.reader(io.StringIO(data.decode("utf-8")))
        header = next(rows, None)
        if header != ["movieId", "title", "genres"]:
            raise DataError(f"{where}:1: expected the header movieId,title,genres, got {header}")
        for line, row in enumerate(rows, start=2):
            if len(row) != 3:
                raise DataError(f"{where}:{line}: expected 3 fields, got {len(row)}")
            names = [] if row[2] == NO_GENRES else [g for g in row[2].split("|") if g]
            genres[_item_id(row[0], where, line, "movieId")] = names
        return genres
    for line, text in enumerate(data.decode("latin-1").splitlines(), start=1):
        if not text.strip():
            continue
        if fmt == "dat":
            fields = text.split("::")
            if len(fields) != 3:
                raise DataError(f"{where}:{line}: expected 3 fields separated by '::', got {len(fields)}")
            genres[_item_id(fields[0], where, line, "movie_id")] = [g for g in fields[2].split("|") if g]
        else:  # ml-100k u.item: id|title|date|video date|url|19 flags
            fields = text.split("|")
            if len(fields) != 5 + len(ML100K_GENRES):
                raise DataError(f"{where}:{line}: expected {5 + len(ML100K_GENRES)} fields separated by '|', got {len(fields)}")
            flags = fields[5:]
            if any(f not in ("0", "1") for f in flags):
                raise DataError(f"{where}:{line}: genre flags must be 0 or 1, got {'|'.join(flags)}")
            genres[_item_id(fields[0], where, line, "movie_id")] = [g for g, f in zip(ML100K_GENRES, flags) if f == "1"]
    return genres


def items_table(genres: dict[int, list[str]]) -> pa.Table:
    """The items.parquet table, items sorted by id."""
    vocabulary = {name: i for i, name in enumerate(sorted({g for names in genres.values() for g in names}))}
    ids = sorted(genres)
    return pa.table({
        "item_id": pa.array(ids, pa.int64()),
        "genres": pa.array([genres[i] for i in ids], pa.list_(pa.string())),
        "genre_ids": pa.array([[vocabulary[g] for g in genres[i]] for i in ids], pa.list_(pa.int64())),
    })


def write_item_features(dataset: str, out_dir: str | Path, data_dir: str | None = None) -> int:
    """Writes out_dir/items.parquet for a MovieLens set whose movies file is found (beside
    its ratings under data_dir, or in the archive prepare fetched) → the number of items; 0, and
    nothing written, where the set has no movies file there."""
    if dataset not in MOVIES:
        return 0
    member, fmt = MOVIES[dataset]
    try:
        # the ratings were read from data_dir or from the archive fetch verified in the cache
        path, data = locate(dataset, data_dir or default_cache_dir(), member)
    except DataError:
        return 0  # the ratings alone (a trimmed copy): no side features
    where = str(path) if path.suffix != ".zip" else f"{path}!{member}"
    table = items_table(parse_movies(data, fmt, where))
    pq.write_table(table, Path(out_dir) / ITEMS_FILE)
    return table.num_rows


@dataclass
class ItemFeatures:
    """Items' genre ids, jagged: item item_ids[i] has genre_ids[offsets[i]:offsets[i + 1]];
    item_ids sorted and distinct. Items not listed have no genres."""

    item_ids: torch.Tensor  # (M,) int64
    offsets: torch.Tensor  # (M + 1,) int64
    genre_ids: torch.Tensor  # (offsets[-1],) int64

    @staticmethod
    def read(data_dir: str | Path) -> "ItemFeatures | None":
        """From <data_dir>/items.parquet; None where prepare wrote none (no movies file)."""
        path = Path(data_dir) / ITEMS_FILE
        if not path.is_file():
            return None
        table = pq.read_table(path, columns=["item_id", "genre_ids"])
        genres = table.column("genre_ids").combine_chunks()
        return ItemFeatures.from_tensors({
            "item_ids": torch.from_numpy(table.column("item_id").to_numpy().copy()),
            "offsets": torch.from_numpy(genres.offsets.to_numpy().astype("int64")),
            "genre_ids": torch.from_numpy(genres.values.to_numpy().copy()),
        }, str(path))

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor], where: str) -> "ItemFeatures":
        """From as_tensors()' dict, checked (errors name `where`)."""
        f = ItemFeatures(t["item_ids"].to(torch.int64), t["offsets"].to(torch.int64), t["genre_ids"].to(torch.int64))
        ids, off = f.item_ids, f.offsets
        if off.numel() != ids.numel() + 1 or off[0] != 0 or off[-1] != f.genre_ids.numel() or bool((off[1:] < off[:-1]).any()):
            raise DataError(f"{where}: genre offsets do not describe {ids.numel()} items")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise DataError(f"{where}: field 'item_id': ids must be sorted and distinct")
        if bool((f.genre_ids < 0).any()):
            raise DataError(f"{where}: field 'genre_ids': ids must be >= 0")
        return f

    def as_tensors(self) -> dict[str, torch.Tensor]:
        return {"item_ids": self.item_ids, "offsets": self.offsets, "genre_ids": self.genre_ids}

    def to(self, device: torch.device | str) -> "ItemFeatures":
        return ItemFeatures(*(t.to(device) for t in (self.item_ids, self.offsets, self.genre_ids)))

    @property
    def num_genres(self) -> int:
        return int(self.genre_ids.max()) + 1 if self.genre_ids.numel() else 0

    def bags(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Genre bags of item ids (N,) on this table's device → (genre ids of every bag one
        after the other, bag offsets (N + 1,)); an unknown item's bag is empty."""
        if self.item_ids.numel() == 0:
            return self.genre_ids[:0], torch.zeros(ids.numel() + 1, dtype=torch.int64, device=ids.device)
        pos = torch.searchsorted(self.item_ids, ids).clamp(max=self.item_ids.numel() - 1)
        found = self.item_ids[pos] == ids
        starts = self.offsets[pos]
        lengths = torch.where(found, self.offsets[pos + 1] - starts, 0)
        offsets = offsets_from_lengths(lengths)
        total = int(offsets[-1])  # the bags' size: a host read
        # the k-th genre of bag b is genre_ids[starts[b] + k]
        shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=total)
        return self.genre_ids[shift + torch.arange(total, device=ids.device)], offsets
