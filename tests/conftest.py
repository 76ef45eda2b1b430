import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Triton kernels run under Triton's interpreter where there is no GPU; set before any
# kernel module is imported (Triton reads it when a kernel is defined)
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_patch

    interpreter_patch.install()  # the interpreter without its language scan at every helper call

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))  # benchmarks/ (not an installed package) for the tests that reuse its helpers


def sequence_batch(lengths: list[int], dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A jagged batch as the HSTU model reads it, of sequences of these lengths: rows
    (total, dim), sorted timestamps (total,) and offsets (B + 1,), seeded."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(offsets[-1])
    return torch.randn(total, dim, generator=gen), torch.randint(0, 10**6, (total,), generator=gen).sort().values, offsets


def assert_same_rows(a, b) -> None:
    """Two DynamicEmbeddings hold the same rows (both tiers): keys and scores equal,
    embeddings and optimizer state to rounding (gradients summed in another order)."""
    ka, ea, sa, ca = a.export_rows()
    kb, eb, sb, cb = b.export_rows()
    oa, ob = ka.argsort(), kb.argsort()
    assert torch.equal(ka[oa], kb[ob]) and torch.equal(ca[oa], cb[ob])
    torch.testing.assert_close(ea[oa], eb[ob], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sa[oa], sb[ob], rtol=1e-5, atol=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, backend):
    device = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}  # NCCL: rank r on GPU r
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **device)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, fn, *args, backend: str = "gloo") -> None:
    """Runs fn(rank, world, *args) in `world` processes of a process group (gloo, or NCCL
    with a GPU each); fails if any process fails."""
    mp.start_processes(_worker, args=(world, free_port(), fn, args, backend), nprocs=world, join=True, start_method="spawn")


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, worker_id):
    """One whole pipeline run that the pipeline and serving tests read. Under pytest-xdist
    (make test) the test processes share it: the first to need it runs it, under a lock,
    the others wait."""
    from filelock import FileLock

    if worker_id == "master":  # no xdist: this session's own
        root = tmp_path_factory.mktemp("shared")
    else:  # the run's base directory, above each worker's own
        root = tmp_path_factory.getbasetemp().parent
    work = root / "pipeline-run"
    with FileLock(str(root / "pipeline-run.lock")):
        if not (work / "metrics.json").exists():
            import warnings

            from pipelines.cli import main as hstu

            with warnings.catch_warnings(record=True) as caught:  # (what the run warned of: warnings.txt)
                warnings.simplefilter("always")
                hstu(["run", "--dataset", "synthetic", "--synthetic-users", "48", "--work-dir", str(work),
                      "--workers", "1", "--epochs", "2", "--train-args", "--max-seq-len 16 --batch-size 8 --num-negatives 16"])
            (work / "warnings.txt").write_text("".join(f"{w.category.__name__}: {w.message}\n" for w in caught))
    return work


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "datasets").is_dir():
        pytest.skip("../shared/datasets is not present")
    return SHARED


@pytest.fixture
def poisoned_memory():
    """torch.empty returns NaN-filled memory (deterministic mode's fill), so that an output
    element a kernel leaves unwritten shows as NaN."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before)


# ---- real services: PostgreSQL and an MLflow tracking server -------------------------------
POSTGRES_USER = "mlflow"


def _postgres_bin(name: str) -> str | None:
    import glob
    import shutil

    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of this test process (Debian's `postgresql` package; .ci/run
    installs it) on a free local port, trust-authenticated for POSTGRES_USER, removed at
    the end. Yields a function that creates a database and returns its SQLAlchemy URI
    for psycopg. As root, the server runs as the `postgres` system user (initdb refuses root)."""
    import shutil
    import subprocess
    import tempfile

    initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="hstu-postgres-"))
    if as_user:
        shutil.chown(root, "postgres")
    data, port = root / "data", free_port()
    subprocess.run([*as_user, initdb, "-D", str(data), "-U", POSTGRES_USER, "-A", "trust", "--no-sync", "-E", "UTF8"],
                   check=True, capture_output=True)
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*as_user, pg_ctl, "-D", str(data), "-l", str(root / "log"), "-o", options, "-w", "start"],
                   check=True, capture_output=True)
    created = []

    def database(name: str) -> str:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={port} user={POSTGRES_USER} dbname=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return f"postgresql+psycopg://{POSTGRES_USER}@127.0.0.1:{port}/{name}"

    try:
        yield database
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def start_mlflow_server(backend_uri: str, artifacts: Path, port: int):
    """`mlflow server` on a backend store, serving its artifacts from `artifacts`; returns
    once it answers /health."""
    import subprocess
    import sys
    import time
    import urllib.request

    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri, "--artifacts-destination", str(artifacts),
         "--serve-artifacts", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            assert server.poll() is None, "mlflow server exited"
            time.sleep(0.5)
    server.kill()
    raise TimeoutError("mlflow server did not start")


def stop_server(server) -> None:
    server.terminate()
    server.wait(timeout=30)


def check_run_page(tracking_uri: str, run_id: str, data_dir, system_metrics: bool = True) -> None:
    """What the run's and the registered model's pages show: the code version and source,
    the prepared data as dataset inputs, system metrics, no `epoch` metric, and a model
    with a signature, its requirements and the run's final (test) metrics."""
    import json

    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    run = client.get_run(run_id)
    tags = run.data.tags
    assert tags["mlflow.user"] and tags["mlflow.source.name"] and tags["mlflow.source.git.commit"]
    assert tags["hstu.version"] == "0.1.0"
    contexts = {d.dataset.name: {t.value for t in d.tags} for d in run.inputs.dataset_inputs}
    assert contexts == {"synthetic-train": {"training"}, "synthetic-valid": {"validation"}, "synthetic-test": {"testing"}}
    train_input = next(d.dataset for d in run.inputs.dataset_inputs if d.dataset.name == "synthetic-train")
    assert json.loads(train_input.profile)["num_rows"] == len(pd.read_parquet(data_dir / "train.parquet"))
    assert "epoch" not in run.data.metrics
    if system_metrics:
        assert "system/cpu_utilization_percentage" in run.data.metrics and "system/system_memory_usage_megabytes" in run.data.metrics

    version = client.get_model_version("hstu", run.data.params["registered_model_version"])
    [output] = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    linked = {m.key: m.value for m in model.metrics}
    assert linked["test/hr_at_10"] == pytest.approx(run.data.metrics["test/hr_at_10"])  # the final metrics, not step 0's
    assert "data/users" not in linked
    info = mlflow.models.get_model_info(version.source)
    assert [c.name for c in info.signature.inputs.inputs] == ["history", "timestamps", "k"] and info.signature.outputs is not None
    requirements = mlflow.pyfunc.get_model_dependencies(version.source)
    with open(requirements) as f:
        names = {line.split("==")[0].split(";")[0].strip() for line in f if line.strip() and not line.startswith("-")}
    assert {"torch", "safetensors", "numpy", "mlflow"} <= names
