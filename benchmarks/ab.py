"""One benchmark run on two versions of the code (or more), alternated on one machine.

    python benchmarks/ab.py --against DIR [--against DIR ...] [--this DIR] [--rounds 2] [--metric ms_mean] [--out PATH] SCRIPT [ARGS ...]

SCRIPT (a path inside the repository, say benchmarks/embedding_training.py) runs with ARGS
from DIR (another checkout, or `git archive REV | tar -x -C DIR`) and from this checkout
(or --this) in turn; ab.py's own options come before SCRIPT, and SCRIPT's --out is ab.py's
to set. Each run is a process of its own that imports its own checkout's code; --rounds
rounds, each DIR in the order given first in each (several --against time several
variants beside this checkout on one lease). Figures from one lease compare; figures from two leases of one
kind of machine move by a few percent, which is what alternating on one lease removes.

Each run writes its JSON (SCRIPT's --out, which the benchmarks that write results take) and
prints its output with its code's label in front. The result is one JSON of every run's
rows, each with `code` (the checkout's commit where it is a git checkout, else its path)
and `round`, under the first run's meta and the command; with --metric, a table of that
field per row and code, one column per round.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def code_label(root: Path) -> str:
    """The checkout's short commit (with '+' if its tree has changes), or its path."""
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return str(root)
    if Path(top.stdout.strip()).resolve() != root.resolve():  # a folder inside another repository
        return str(root)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return rev.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def run_once(root: Path, script: str, args: list[str], out: Path, label: str) -> dict:
    """SCRIPT from `root` with args and --out; its output printed line by line after label."""
    path = root / script
    if not path.is_file():
        raise SystemExit(f"{path}: no such script in {root}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # (its lines as they come, not at its exit)
    proc = subprocess.Popen([sys.executable, str(path), *args, "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        print(f"[{label}] {line}", end="")
    if proc.wait() != 0:
        raise SystemExit(f"{path} {' '.join(args)}: exit status {proc.returncode}")
    return json.loads(out.read_text())


def row_label(row: dict) -> str:
    """A row's name: its string and boolean fields, in order."""
    return " ".join(str(v) for v in row.values() if isinstance(v, (str, bool)))


def summary(rows: list[dict], metric: str, codes: list[str], rounds: int) -> str:
    """metric per row (in the order of one run's rows) and code, a column per round."""
    names, table = [], {}
    for r in rows:
        name = row_label({k: v for k, v in r.items() if k not in ("code", "round")})
        if name not in names:
            names.append(name)
        table.setdefault((name, r["code"]), {})[r["round"]] = r.get(metric)
    width = max(len(n) for n in names + codes)
    lines = [f"{'':<{width}}  {'code':<14}" + "".join(f"{f'round {i}':>12}" for i in range(1, rounds + 1))]
    for name in names:
        for code in codes:
            got = table.get((name, code), {})
            cells = "".join(f"{got[i]:>12.4g}" if isinstance(got.get(i), (int, float)) else f"{'-':>12}" for i in range(1, rounds + 1))
            lines.append(f"{name:<{width}}  {code:<14}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", type=Path, required=True, action="append",
                   help="another checkout (runs before this one in each round; repeat for more)")
    p.add_argument("--this", type=Path, default=HERE, help="the checkout timed against it (default: this one)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--metric", help="a row field to print per code and round (ms_mean, say)")
    p.add_argument("--out", type=Path, help="the combined JSON (default: benchmarks/results/<script>_ab.json)")
    p.add_argument("script", help="the benchmark, a path inside the repository")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    roots = [d.resolve() for d in a.against] + [a.this.resolve()]
    codes = [code_label(r) for r in roots]
    if len(set(codes)) < len(codes):
        codes = [f"{c} ({r})" for c, r in zip(codes, roots)]  # one commit in two places: name them apart
    rows, meta = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, a.rounds + 1):
            for root, code in zip(roots, codes):
                got = run_once(root, a.script, a.args, Path(tmp) / f"{len(rows)}.json", f"{code} {i}")
                meta = meta or got.get("meta", {})
                rows += [dict(r, code=code, round=i) for r in got["results"]]
    against = " ".join(f"--against {d}" for d in a.against)
    command = f"python benchmarks/ab.py {against} --rounds {a.rounds} {a.script} {' '.join(a.args)}".strip()
    out = a.out or HERE / "benchmarks" / "results" / f"{Path(a.script).stem}_ab.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {**meta, "command": command, "codes": dict(zip(codes, map(str, roots)))}, "results": rows}, indent=1))
    if a.metric:
        print(summary(rows, a.metric, codes, a.rounds))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
