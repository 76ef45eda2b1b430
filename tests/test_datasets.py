"""Data preparation through `hstu prepare` and the library: formats, errors, split, stats."""
import hashlib
import json
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_modules import datasets
from lightning_modules.datasets import DataError, prepare
from pipelines.cli import main as hstu


def sequences(out, split="test"):
    return {r["user_id"]: r["item_ids"] for r in pq.read_table(out / f"{split}.parquet").to_pylist()}


def test_ml1m_dat_format_sorted_split_and_stable_ties(tmp_path):
    lines = [
        "1::10::5::300", "1::11::3::100", "1::12::4::200", "1::13::4::200",  # a tie at 200: input order
        "1::10::5::300",  # exact duplicate: dropped
        "1::14::4::200", "1::12::4::200",  # a duplicate with another item of its time between: dropped
        "2::10::9.5::1", "2::20::4::2", "2::21::11::3",  # rating 11: out of range, dropped
        "3::5::1::1",  # too short: dropped
    ]
    (tmp_path / "ratings.dat").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert hstu(["prepare", "--dataset", "ml-1m", "--data-dir", str(tmp_path), "--out", str(out)]) == 0
    assert sequences(out) == {1: [11, 12, 13, 14, 10]}
    assert sequences(out, "valid") == {1: [11, 12, 13, 14]} and sequences(out, "train") == {1: [11, 12, 13]}
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows_read"] == 11 and stats["rows_dropped_duplicate"] == 2
    assert stats["rows_dropped_bad_rating"] == 1 and stats["users_dropped_short"] == 2
    ts = pq.read_table(out / "test.parquet").column("timestamps").to_pylist()
    assert ts == [[100, 200, 200, 200, 300]]


def test_ml20m_csv_inside_a_zip_and_ml100k_tsv(tmp_path):
    csv = "userId,movieId,rating,timestamp\n" + "\n".join(f"7,{i},4.0,{1000 + i}" for i in range(5)) + "\n"
    with zipfile.ZipFile(tmp_path / "ml-20m.zip", "w") as z:
        z.writestr("ml-20m/ratings.csv", csv)
    stats = prepare("ml-20m", tmp_path / "a", data_dir=str(tmp_path))
    assert stats["users"] == 1 and sequences(tmp_path / "a") == {7: [0, 1, 2, 3, 4]}
    (tmp_path / "u.data").write_text("".join(f"3\t{i}\t4\t{50 - i}\n" for i in range(4)))
    prepare("ml-100k", tmp_path / "b", data_dir=str(tmp_path))
    assert sequences(tmp_path / "b") == {3: [3, 2, 1, 0]}


def test_generic_csv_and_parquet(tmp_path):
    (tmp_path / "x.csv").write_text("timestamp,item_id,user_id\n5,100,1\n6,101,1\n7,102,1\n")
    prepare("csv", tmp_path / "c", input=str(tmp_path / "x.csv"))
    assert sequences(tmp_path / "c") == {1: [100, 101, 102]}
    table = pa.table({"user_id": [9, 9, 9], "item_id": [2**50, 3, 4], "timestamp": [3, 2, 1], "rating": [1.0, 2.0, 3.0]})
    pq.write_table(table, tmp_path / "x.parquet")
    prepare("csv", tmp_path / "p", input=str(tmp_path / "x.parquet"))
    assert sequences(tmp_path / "p") == {9: [4, 3, 2**50]}


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("ratings.dat", "1::2::3::4\n1::2::3\n", r"ratings.dat:2: expected 4 fields, got 3"),
        ("ratings.dat", "1::2::3::4\n1::2::3::4\n1::x::3::4\n", r"ratings.dat:3: field 'item_id': expected an integer, got 'x'"),
        ("ratings.dat", "1::2::3::4\n1::2::bad::4\n", r"ratings.dat:2: field 'rating': expected a number"),
        ("ratings.dat", "1::2::3::4\n\n1::2::3::4\n", r"ratings.dat:2: field 'user_id'"),
    ],
)
def test_malformed_files_name_file_line_and_field(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=message):
        prepare("ml-1m", tmp_path / "out", data_dir=str(tmp_path))


def test_malformed_generic_inputs(tmp_path):
    (tmp_path / "h.csv").write_text("user,item_id,timestamp\n1,2,3\n")
    with pytest.raises(DataError, match=r"h.csv:1: header lacks field\(s\) user_id"):
        prepare("csv", tmp_path / "o", input=str(tmp_path / "h.csv"))
    (tmp_path / "v.csv").write_text("user_id,item_id,timestamp\n1,2,3\n1,2,3.5\n")
    with pytest.raises(DataError, match=r"v.csv:3: field 'timestamp'"):
        prepare("csv", tmp_path / "o", input=str(tmp_path / "v.csv"))
    pq.write_table(pa.table({"user_id": [1.5], "item_id": [1], "timestamp": [1]}), tmp_path / "f.parquet")
    with pytest.raises(DataError, match=r"f.parquet: field 'user_id': expected integers"):
        prepare("csv", tmp_path / "o", input=str(tmp_path / "f.parquet"))
    with pytest.raises(DataError, match="needs --input"):
        prepare("csv", tmp_path / "o")
    with pytest.raises(DataError, match="neither ml-1m.zip"):
        prepare("ml-1m", tmp_path / "o", data_dir=str(tmp_path / "nowhere"))


def test_synthetic_is_seeded_and_ml1m_like(tmp_path):
    a = datasets.synthetic(users=50, seed=3)
    b = datasets.synthetic(users=50, seed=3)
    c = datasets.synthetic(users=50, seed=4)
    assert np.array_equal(a.item, b.item) and not np.array_equal(a.item, c.item)
    lengths = np.bincount(a.user)[1:]
    assert lengths.min() >= 20 and 60 < lengths.mean() < 400
    counts = np.sort(np.unique(a.item, return_counts=True)[1])[::-1]
    assert counts[0] > 5 * np.median(counts)  # Zipf: a head far above the median item
    pairs = np.unique(np.stack([a.user, a.item]), axis=1)
    assert pairs.shape[1] == len(a.user)  # as in ML-1M, no user has an item twice


def test_fetch_verifies_checksums_through_a_mirror(tmp_path, monkeypatch):
    mirror, cache = tmp_path / "mirror", tmp_path / "cache"
    mirror.mkdir()
    with zipfile.ZipFile(mirror / "ml-100k.zip", "w") as z:
        z.writestr("ml-100k/u.data", "1\t2\t3\t4\n1\t3\t3\t5\n1\t4\t3\t6\n")
    digest = hashlib.md5((mirror / "ml-100k.zip").read_bytes()).hexdigest()
    monkeypatch.setenv(datasets.MIRROR_ENV, mirror.as_uri())
    monkeypatch.setenv(datasets.CACHE_ENV, str(cache))
    with pytest.raises(DataError, match="does not match the expected"):
        prepare("ml-100k", tmp_path / "o")
    assert not list(cache.iterdir())  # nothing unverified is kept
    spec = datasets.MOVIELENS["ml-100k"]
    monkeypatch.setitem(datasets.MOVIELENS, "ml-100k", datasets.MovieLens(spec.archive, ("md5", digest), spec.member, spec.fmt))
    assert prepare("ml-100k", tmp_path / "o")["interactions"] == 3
    assert (cache / "ml-100k.zip").is_file()


def test_shared_movielens_files(shared_dir, tmp_path):
    small = prepare("ml-latest-small", tmp_path / "s", data_dir=str(shared_dir / "datasets"))
    assert (small["rows_read"], small["users"], small["items"]) == (100836, 610, 9724)
    k100 = prepare("ml-100k", tmp_path / "k", data_dir=str(shared_dir / "datasets"))
    assert (k100["rows_read"], k100["users"], k100["items"]) == (100000, 943, 1682)


def test_movie_genres_are_written_beside_the_splits_from_each_format(tmp_path):
    ratings = "".join(f"1::{i}::4::{i}\n" for i in (1, 2, 3))
    movies = "1::Toy Story (1995)::Animation|Children's|Comedy\n2::Heat (1995)::Action|Crime|Thriller\n3::Nothing (2000)::\n"
    with zipfile.ZipFile(tmp_path / "ml-1m.zip", "w") as z:
        z.writestr("ml-1m/ratings.dat", ratings)
        z.writestr("ml-1m/movies.dat", movies.encode("latin-1"))
    assert prepare("ml-1m", tmp_path / "a", data_dir=str(tmp_path))["items_with_features"] == 3
    rows = pq.read_table(tmp_path / "a" / "items.parquet").to_pylist()
    # ids number the sorted names: Action 0, Animation 1, Children's 2, Comedy 3, Crime 4, Thriller 5
    assert rows == [
        {"item_id": 1, "genres": ["Animation", "Children's", "Comedy"], "genre_ids": [1, 2, 3]},
        {"item_id": 2, "genres": ["Action", "Crime", "Thriller"], "genre_ids": [0, 4, 5]},
        {"item_id": 3, "genres": [], "genre_ids": []},
    ]
    csv_movies = 'movieId,title,genres\n7,"Comma, The (1999)",Drama|War\n8,Blank (2001),(no genres listed)\n'
    with zipfile.ZipFile(tmp_path / "ml-20m.zip", "w") as z:
        z.writestr("ml-20m/ratings.csv", "userId,movieId,rating,timestamp\n" + "".join(f"1,{i},4.0,{t}\n" for t, i in enumerate((7, 8, 7))))
        z.writestr("ml-20m/movies.csv", csv_movies)
    prepare("ml-20m", tmp_path / "b", data_dir=str(tmp_path))
    assert pq.read_table(tmp_path / "b" / "items.parquet").column("genres").to_pylist() == [["Drama", "War"], []]
    # a set given without its movies file has no side features, and no items.parquet
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "u.data").write_text("".join(f"3\t{i}\t4\t{i}\n" for i in range(4)))
    assert prepare("ml-100k", tmp_path / "d", data_dir=str(tmp_path / "c"))["items_with_features"] == 0
    assert not (tmp_path / "d" / "items.parquet").exists()


@pytest.mark.parametrize("fmt,text,message", [
    ("item", "1|Toy Story (1995)|01-Jan-1995||url|0|1\n", r"movies:1: expected 24 fields"),
    ("item", "1|T|d||u|" + "|".join(["0"] * 18) + "|2\n", r"movies:1: genre flags must be 0 or 1"),
    ("dat", "1::A::Drama\nx::B::Drama\n", r"movies:2: field 'movie_id': expected an integer, got 'x'"),
    ("csv", "movieId,title\n1,A\n", r"movies:1: expected the header"),
    ("csv", "movieId,title,genres\n1,A,Drama,extra\n", r"movies:2: expected 3 fields, got 4"),
])
def test_malformed_movie_files_name_the_line_and_field(fmt, text, message):
    from lightning_modules.item_features import parse_movies

    with pytest.raises(DataError, match=message):
        parse_movies(text.encode(), fmt, "movies")


def test_shared_movielens_genres(shared_dir, tmp_path):
    k100 = prepare("ml-100k", tmp_path / "k", data_dir=str(shared_dir / "datasets"))
    small = prepare("ml-latest-small", tmp_path / "s", data_dir=str(shared_dir / "datasets"))
    assert (k100["items_with_features"], small["items_with_features"]) == (1682, 9742)
    first = pq.read_table(tmp_path / "k" / "items.parquet").slice(0, 1).to_pylist()[0]
    assert first["item_id"] == 1 and first["genres"] == ["Animation", "Children's", "Comedy"]
    first = pq.read_table(tmp_path / "s" / "items.parquet").slice(0, 1).to_pylist()[0]
    assert first["genres"] == ["Adventure", "Animation", "Children", "Comedy", "Fantasy"]
