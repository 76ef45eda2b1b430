"""Raw interactions → per-user sequences with a leave-one-out split (the `prepare` step).

Sources: MovieLens 1M (`ratings.dat`, `::`), 20M and latest (`ratings.csv`), 100K
(`u.data`, tab-separated), a generic CSV or Parquet of `user_id,item_id,timestamp[,rating]`,
and a seeded synthetic generator. Ids stay raw int64 values (no remapping).

Output directory:
    train.parquet  valid.parquet  test.parquet   user_id, item_ids (list), timestamps (list)
    stats.json
`test` holds each user's whole sequence (its last item is the target), `valid` drops the
last item (so its last is the validation target), `train` drops the last two.

A file that cannot be parsed raises DataError naming the file, the line and the field.
Rows with bad values (rating missing or out of range) and exact duplicates are dropped and
counted in the statistics.
"""
import io
import json
import os
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from kernels.files import file_digest

GROUPLENS = "https://files.grouplens.org/datasets/movielens/"
MIRROR_ENV = "HSTU_DATASET_MIRROR"  # a base URL (or file:// directory) serving the same zips
CACHE_ENV = "HSTU_CACHE_DIR"


@dataclass(frozen=True)
class MovieLens:
    archive: str
    checksum: tuple[str, str]  # (algorithm, hex digest) of the archive
    member: str  # ratings file inside the archive
    fmt: str  # "dat" (::), "csv" (header), "tsv" (no header)


MOVIELENS = {
    "ml-1m": MovieLens("ml-1m.zip", ("md5", "c4d9eecfca2ab87c1945afe126590906"), "ml-1m/ratings.dat", "dat"),
    "ml-20m": MovieLens("ml-20m.zip", ("md5", "cd245b17a1ae2cc31bb14903e1204af3"), "ml-20m/ratings.csv", "csv"),
    "ml-latest-small": MovieLens(
        "ml-latest-small.zip",
        ("sha256", "696d65a3dfceac7c45750ad32df2c259311949efec81f0f144fdfb91ebc9e436"),
        "ml-latest-small/ratings.csv",
        "csv",
    ),
    "ml-100k": MovieLens("ml-100k.zip", ("md5", "0e33842e24a9c977be4e0107933c0723"), "ml-100k/u.data", "tsv"),
}
DATASETS = (*MOVIELENS, "csv", "synthetic")
RATING_RANGE = (0.0, 10.0)


class DataError(ValueError):
    """Input that cannot be read; the message names the file, the line and the field."""


SPLITS = ("train", "valid", "test")  # the prepared Parquet files, <split>.parquet


def check_prepared(data_dir: str | Path) -> Path:
    """data_dir as a Path, where `prepare` wrote every split there; else a DataError that
    names the missing files. Training calls it before starting workers, so that missing
    data is one message, not a read error in every worker."""
    path = Path(data_dir)
    missing = [f"{s}.parquet" for s in SPLITS if not (path / f"{s}.parquet").is_file()]
    if missing:
        what = "no such directory" if not path.is_dir() else f"no {', '.join(missing)}"
        raise DataError(f"{path}: not prepared data ({what}; `hstu prepare --out {path}` writes it)")
    return path


# ---- fetching -----------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """Where fetched archives are kept: $HSTU_CACHE_DIR, else ~/.cache/hstu."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hstu")


def fetch(name: str, cache_dir: str | Path | None = None) -> Path:
    """The verified archive of a named MovieLens set, downloaded into the cache if needed."""
    spec = MOVIELENS[name]
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / spec.archive
    algorithm, expected = spec.checksum
    if dest.is_file() and file_digest(dest, algorithm) == expected:
        return dest
    url = os.environ.get(MIRROR_ENV, GROUPLENS).rstrip("/") + "/" + spec.archive
    tmp = dest.with_name(dest.name + ".download")
    with urllib.request.urlopen(url) as response, open(tmp, "wb") as out:
        while block := response.read(1 << 20):
            out.write(block)
    got = file_digest(tmp, algorithm)
    if got != expected:
        tmp.unlink()
        raise DataError(f"{url}: {algorithm} {got} does not match the expected {expected}")
    os.replace(tmp, dest)
    return dest


def locate(name: str, data_dir: str | Path, member: str | None = None) -> tuple[Path, bytes]:
    """Finds a named set's ratings file (or another member of its archive) under data_dir
    (in its zip, or the extracted folder) → (path, bytes)."""
    spec = MOVIELENS[name]
    root = Path(data_dir)
    member = Path(member or spec.member)
    for candidate in (root / member, root / member.name):
        if candidate.is_file():
            return candidate, candidate.read_bytes()
    archive = root / spec.archive
    if archive.is_file():
        return archive, _read_member(archive, str(member))
    raise DataError(f"{root}: neither {spec.archive} nor {member} found")


def _read_member(archive: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(archive) as z:
            return z.read(member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{archive}: cannot read {member}: {e}") from None


# ---- parsing ------------------------------------------------------------------------------
@dataclass
class Interactions:
    user: np.ndarray  # int64
    item: np.ndarray  # int64
    timestamp: np.ndarray  # int64
    rating: np.ndarray  # float64, NaN where the source has none


_INT = r"^\s*[-+]?\d+\s*$"
_FLOAT = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$|^\s*(nan|NaN)\s*$"


def _parse_column(table: pa.Table, field: str, pattern: str, dtype, where: str, first_line: int):
    col = table.column(field)
    ok = pc.fill_null(pc.match_substring_regex(col, pattern), False)
    if not pc.all(ok).as_py() and len(col):
        i = int(np.flatnonzero(~ok.to_numpy(zero_copy_only=False))[0])
        raise DataError(
            f"{where}:{first_line + i}: field '{field}': expected {'an integer' if dtype == 'int64' else 'a number'}, "
            f"got {col[i].as_py()!r}"
        )
    try:
        return pc.cast(pc.utf8_trim_whitespace(col), dtype).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid as e:
        raise DataError(f"{where}: field '{field}': {e}") from None


def parse_delimited(
    data: bytes, where: str, delimiter: str, names: list[str], header: bool
) -> Interactions:
    """Parses delimited text with the given column names; `header` skips (and checks) line 1."""
    if delimiter == "::":  # pyarrow takes one-character delimiters
        data, delimiter = data.replace(b"::", b"\t"), "\t"
    data = data.rstrip(b"\r\n") + b"\n"
    first_line = 2 if header else 1

    bad_rows = []

    def invalid(row):  # exceptions raised here are swallowed by pyarrow: record, then stop
        bad_rows.append(row)
        return "error"

    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=int(header), use_threads=False),
            parse_options=pacsv.ParseOptions(
                delimiter=delimiter, invalid_row_handler=invalid, ignore_empty_lines=False
            ),
            convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names}),
        )
    except pa.ArrowInvalid as e:
        if bad_rows:
            row = bad_rows[0]
            raise DataError(
                f"{where}:{row.number}: expected {row.expected_columns} fields, got {row.actual_columns} ({row.text!r})"
            ) from None
        raise DataError(f"{where}: {e}") from None
    cols = {}
    for field, dtype, pattern in (("user_id", "int64", _INT), ("item_id", "int64", _INT), ("timestamp", "int64", _INT)):
        cols[field] = _parse_column(table, field, pattern, dtype, where, first_line)
    if "rating" in names:
        rating = _parse_column(table, "rating", _FLOAT, "float64", where, first_line)
    else:
        rating = np.full(len(cols["user_id"]), np.nan)
    return Interactions(cols["user_id"], cols["item_id"], cols["timestamp"], rating)


def read_movielens(name: str, data: bytes, where: str) -> Interactions:
    fmt = MOVIELENS[name].fmt
    if fmt == "dat":
        return parse_delimited(data, where, "::", ["user_id", "item_id", "rating", "timestamp"], header=False)
    if fmt == "tsv":
        return parse_delimited(data, where, "\t", ["user_id", "item_id", "rating", "timestamp"], header=False)
    head = data.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    if head.split(",") != ["userId", "movieId", "rating", "timestamp"]:
        raise DataError(f"{where}:1: expected header userId,movieId,rating,timestamp, got {head!r}")
    return parse_delimited(data, where, ",", ["user_id", "item_id", "rating", "timestamp"], header=True)


REQUIRED = ("user_id", "item_id", "timestamp")


def read_generic(path: str | Path) -> Interactions:
    """A CSV (with header) or Parquet file of user_id,item_id,timestamp[,rating]."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".parquet":
        return _read_generic_parquet(path)
    data = path.read_bytes()
    header = [h.strip() for h in data.split(b"\n", 1)[0].decode("utf-8", "replace").strip().split(",")]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise DataError(f"{path}:1: header lacks field(s) {', '.join(missing)} (has {', '.join(header)})")
    return parse_delimited(data, str(path), ",", header, header=True)


def _read_generic_parquet(path: Path) -> Interactions:
    try:
        table = pq.read_table(path)
    except pa.ArrowException as e:
        raise DataError(f"{path}: not a readable Parquet file: {e}") from None
    cols = {}
    for field in (*REQUIRED, "rating"):
        if field not in table.column_names:
            if field == "rating":
                continue
            raise DataError(f"{path}: field '{field}' is missing (has {', '.join(table.column_names)})")
        col = table.column(field)
        want = pa.float64() if field == "rating" else pa.int64()
        if field != "rating" and not pa.types.is_integer(col.type):
            raise DataError(f"{path}: field '{field}': expected integers, column type is {col.type}")
        if field != "rating" and col.null_count:
            row = int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{path}:row {row}: field '{field}': missing value")
        cols[field] = pc.cast(col, want).to_numpy(zero_copy_only=False)
    rating = cols.get("rating", np.full(table.num_rows, np.nan))
    return Interactions(cols["user_id"], cols["item_id"], cols["timestamp"], np.asarray(rating, dtype=np.float64))


# ---- synthetic ----------------------------------------------------------------------------
REDRAWS = 8  # synthetic(): draws of a genre's items before drawing among its unseen ones alone


def synthetic(
    users: int = 6040, items: int = 3706, genres: int = 18, seed: int = 0, mean_length: float = 165.0
) -> Interactions:
    """Seeded interactions shaped like ML-1M: Zipf item popularity, log-normal sequence
    lengths (at least 20), users with a few favourite genres, a sequential habit (often the
    next item follows the previous one in its genre), so that a sequence model has
    something to learn beyond popularity, and no item twice in a user's sequence (a user
    rates a movie once). Item ids are sparse 40-bit values."""
    rng = np.random.default_rng(seed)
    item_ids = rng.choice(1 << 40, size=items, replace=False).astype(np.int64)
    genre_of = rng.integers(0, genres, size=items)
    members = [np.flatnonzero(genre_of == g) for g in range(genres)]
    members = [m if len(m) else np.array([0]) for m in members]
    popularity = [1.0 / np.arange(1, len(m) + 1) ** 1.1 for m in members]
    popularity = [p / p.sum() for p in popularity]
    cumulative = [np.cumsum(p) for p in popularity]  # a draw: the first item whose sum passes a uniform
    position = np.empty(items, dtype=np.int64)
    weight = np.empty(items)  # each item's popularity within its genre
    for m, p in zip(members, popularity):
        position[m] = np.arange(len(m))
        weight[m] = p

    def draw(g: int, seen: np.ndarray) -> int:
        """An unseen item of genre g by popularity (a few draws of the whole genre, then
        its unseen items alone, then any unseen item)."""
        m = members[g]
        for _ in range(REDRAWS):
            item = m[min(int(np.searchsorted(cumulative[g], rng.random(), side="right")), len(m) - 1)]
            if not seen[item]:
                return item
        w = np.where(seen[m], 0.0, popularity[g])
        if w.sum() > 0:
            return m[rng.choice(len(m), p=w / w.sum())]
        w = np.where(seen, 0.0, weight)
        return rng.choice(items, p=w / w.sum())

    sigma = 0.95
    lengths = rng.lognormal(np.log(mean_length) - sigma**2 / 2, sigma, size=users)
    lengths = np.clip(lengths, 20, min(2000, items)).astype(np.int64)
    out_u, out_i, out_t = [], [], []
    for u in range(users):
        n = int(lengths[u])
        favourites = rng.choice(genres, size=2, replace=False)
        seq = np.empty(n, dtype=np.int64)
        seen = np.zeros(items, dtype=bool)
        prev = -1
        for t in range(n):
            item = -1
            if prev >= 0 and rng.random() < 0.35:  # habit: the next item of the same genre not seen yet
                m = members[genre_of[prev]]
                for step in range(1, len(m)):
                    after = m[(position[prev] + step) % len(m)]
                    if not seen[after]:
                        item = after
                        break
            if item < 0:
                item = draw(favourites[rng.integers(2)] if rng.random() < 0.8 else rng.integers(genres), seen)
            seq[t] = prev = item
            seen[item] = True
        start = rng.integers(946_684_800, 1_046_476_800)  # 2000-2003, as ML-1M
        out_u.append(np.full(n, 1 + u, dtype=np.int64))
        out_i.append(item_ids[seq])
        out_t.append(start + np.cumsum(rng.exponential(3600.0, size=n)).astype(np.int64))
    return Interactions(
        np.concatenate(out_u), np.concatenate(out_i), np.concatenate(out_t), np.full(sum(lengths), np.nan)
    )


# ---- sequences and split ------------------------------------------------------------------
def build_sequences(x: Interactions, min_length: int = 3) -> tuple[dict[str, pa.Table], dict]:
    """Sorts each user's interactions by time (ties keep input order), drops bad rows,
    duplicates and too-short users, and makes the leave-one-out split."""
    n_rows = len(x.user)
    bad = ~np.isnan(x.rating) & ((x.rating < RATING_RANGE[0]) | (x.rating > RATING_RANGE[1]))
    keep = ~bad
    user, item, ts = x.user[keep], x.item[keep], x.timestamp[keep]
    order = np.lexsort((np.arange(len(user)), ts, user))  # by user, then time, then input order
    user, item, ts = user[order], item[order], ts[order]
    # a repeated (user, item, time) is dropped after its first row, wherever it sits among
    # that user's other items of the same time: ordered by item as well, repeats are adjacent
    by_item = np.lexsort((np.arange(len(user)), item, ts, user))
    repeat = (np.diff(user[by_item]) == 0) & (np.diff(item[by_item]) == 0) & (np.diff(ts[by_item]) == 0)
    dup = np.zeros(len(user), dtype=bool)
    dup[by_item[1:][repeat]] = True
    user, item, ts = user[~dup], item[~dup], ts[~dup]

    starts = np.flatnonzero(np.r_[True, user[1:] != user[:-1]]) if len(user) else np.array([], dtype=np.int64)
    lengths = np.diff(np.r_[starts, len(user)])
    long_enough = lengths >= min_length
    row_keep = np.repeat(long_enough, lengths)
    user, item, ts = user[row_keep], item[row_keep], ts[row_keep]
    starts, lengths = starts[long_enough], lengths[long_enough]
    starts = np.r_[0, np.cumsum(lengths)[:-1]] if len(lengths) else starts

    def table(cut: int) -> pa.Table:
        lens = lengths - cut
        offsets = np.r_[0, np.cumsum(lens)].astype(np.int32)
        take = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]) if len(lens) else np.array([], dtype=np.int64)
        return pa.table(
            {
                "user_id": pa.array(user[starts], pa.int64()),
                "item_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(item[take], pa.int64())),
                "timestamps": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ts[take], pa.int64())),
            }
        )

    splits = {"train": table(2), "valid": table(1), "test": table(0)}
    stats = {
        "rows_read": int(n_rows),
        "rows_dropped_bad_rating": int(bad.sum()),
        "rows_dropped_duplicate": int(dup.sum()),
        "rows_dropped_short_user": int((~row_keep).sum()),
        "users_dropped_short": int((~long_enough).sum()),
        "interactions": int(len(user)),
        "users": int(len(lengths)),
        "items": int(len(np.unique(item))),
        "seq_len_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "seq_len_median": float(np.median(lengths)) if len(lengths) else 0.0,
        "seq_len_max": int(lengths.max()) if len(lengths) else 0,
        "min_length": min_length,
    }
    return splits, stats


def load_interactions(
    dataset: str, data_dir: str | None = None, input: str | None = None, seed: int = 0, synthetic_users: int = 6040
) -> tuple[Interactions, str]:
    """Reads a source by name → (interactions, description of where they came from)."""
    if dataset == "synthetic":
        return synthetic(users=synthetic_users, seed=seed), f"synthetic(users={synthetic_users}, seed={seed})"
    if dataset == "csv":
        if not input:
            raise DataError("dataset 'csv' needs --input FILE (CSV or Parquet)")
        return read_generic(input), str(input)
    if dataset not in MOVIELENS:
        raise DataError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    if data_dir:
        path, data = locate(dataset, data_dir)
    else:
        path = fetch(dataset)
        data = _read_member(path, MOVIELENS[dataset].member)
    where = str(path) if path.suffix != ".zip" else f"{path}!{MOVIELENS[dataset].member}"
    return read_movielens(dataset, data, where), where


def prepare(
    dataset: str,
    out_dir: str | Path,
    data_dir: str | None = None,
    input: str | None = None,
    seed: int = 0,
    min_length: int = 3,
    synthetic_users: int = 6040,
) -> dict:
    """The whole step: read, clean, sequence, split, write Parquet (the splits, and the
    items' genres where a MovieLens set has them: item_features.py) and stats.json."""
    interactions, source = load_interactions(dataset, data_dir, input, seed, synthetic_users)
    splits, stats = build_sequences(interactions, min_length)
    if stats["users"] == 0:
        raise DataError(f"{source}: no user has {min_length} or more valid interactions")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, table in splits.items():
        pq.write_table(table, out / f"{name}.parquet")
    from .item_features import write_item_features  # (it reads the sets as this module finds them)

    stats = {"dataset": dataset, "source": source, **stats, "items_with_features": write_item_features(dataset, out, data_dir)}
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats
