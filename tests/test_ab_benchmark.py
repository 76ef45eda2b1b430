"""benchmarks/ab.py: a benchmark script run from two checkouts (or more) in turn, its rows
gathered with their code and round."""
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.ab import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import argparse, json, pathlib
p = argparse.ArgumentParser()
p.add_argument("--size", type=int)
p.add_argument("--out")
a = p.parse_args()
log = pathlib.Path(__file__).parent / "runs.txt"
log.write_text(log.read_text() + "{name}\\n" if log.exists() else "{name}\\n")
print("timing {name}")
rows = [{{"shape": "small", "ms_mean": {ms} * a.size}}, {{"shape": "large", "ms_mean": {ms} * a.size * 10}}]
pathlib.Path(a.out).write_text(json.dumps({{"meta": {{"device": "cpu"}}, "results": rows}}))
"""


def checkout(tmp_path: Path, name: str, ms: float) -> Path:
    root = tmp_path / name
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "fake.py").write_text(SCRIPT.format(name=name, ms=ms))
    return root


def test_runs_alternate_and_rows_keep_their_code_and_round(tmp_path, capsys):
    old, new = checkout(tmp_path, "old", 2.0), checkout(tmp_path, "new", 1.5)
    out = main(["--against", str(old), "--this", str(new), "--rounds", "3", "--metric", "ms_mean",
                "--out", str(tmp_path / "ab.json"), "benchmarks/fake.py", "--size", "2"])
    # each checkout ran its own script, the other one first in every round
    assert (old / "benchmarks" / "runs.txt").read_text() == "old\n" * 3
    assert (new / "benchmarks" / "runs.txt").read_text() == "new\n" * 3
    got = json.loads(out.read_text())
    codes = [str(old), str(new)]  # (folders, not git checkouts: named by their paths)
    assert [(r["code"], r["round"]) for r in got["results"]] == [(c, i) for i in (1, 2, 3) for c in codes for _ in range(2)]
    assert [r["ms_mean"] for r in got["results"][:4]] == [4.0, 40.0, 3.0, 30.0]
    assert got["meta"]["device"] == "cpu" and "--size 2" in got["meta"]["command"]
    printed = capsys.readouterr().out
    assert f"[{codes[0]} 1] timing old" in printed and f"[{codes[1]} 3] timing new" in printed
    table = [line.split() for line in printed.splitlines() if line.startswith("large")]
    assert table == [["large", codes[0], "40", "40", "40"], ["large", codes[1], "30", "30", "30"]]


def test_several_checkouts_run_in_the_order_given_each_round(tmp_path, capsys):
    a, b, new = checkout(tmp_path, "a", 3.0), checkout(tmp_path, "b", 2.0), checkout(tmp_path, "new", 1.0)
    out = main(["--against", str(a), "--against", str(b), "--this", str(new), "--rounds", "2", "--metric", "ms_mean",
                "--out", str(tmp_path / "ab.json"), "benchmarks/fake.py", "--size", "1"])
    got = json.loads(out.read_text())
    codes = [str(a), str(b), str(new)]
    assert [(r["code"], r["round"]) for r in got["results"]] == [(c, i) for i in (1, 2) for c in codes for _ in range(2)]
    assert [r["ms_mean"] for r in got["results"] if r["shape"] == "small"] == [3.0, 2.0, 1.0] * 2
    assert got["meta"]["command"].startswith(f"python benchmarks/ab.py --against {a} --against {b} --rounds 2")
    assert list(got["meta"]["codes"]) == codes
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("small")]
    assert table == [["small", codes[0], "3", "3"], ["small", codes[1], "2", "2"], ["small", codes[2], "1", "1"]]


def test_a_failing_run_stops_with_its_script_named(tmp_path):
    old = checkout(tmp_path, "old", 1.0)
    new = tmp_path / "new"
    (new / "benchmarks").mkdir(parents=True)
    (new / "benchmarks" / "fake.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(SystemExit, match="fake.py --size 1: exit status 3"):
        main(["--against", str(old), "--this", str(new), "--out", str(tmp_path / "ab.json"), "benchmarks/fake.py", "--size", "1"])
    with pytest.raises(SystemExit, match="no such script"):
        main(["--against", str(old), "--this", str(new), "--out", str(tmp_path / "ab.json"), "benchmarks/none.py"])


def test_a_git_checkout_is_named_by_its_commit(tmp_path):
    old = checkout(tmp_path, "old", 1.0)
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(old), *cmd], check=True)
    rev = subprocess.run(["git", "-C", str(old), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    new = checkout(tmp_path, "new", 1.0)
    got = json.loads(main(["--against", str(old), "--this", str(new), "--rounds", "1", "--out", str(tmp_path / "ab.json"),
                           "benchmarks/fake.py", "--size", "1"]).read_text())
    # runs.txt, written by the run, is untracked: the tree still counts as clean
    assert got["results"][0]["code"] == rev and got["meta"]["codes"][rev] == str(old)
