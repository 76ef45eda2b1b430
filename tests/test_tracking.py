"""Training against a real `mlflow server` that goes away mid-run and comes back: the run
finishes, and the metrics logged while the server was away reach it once it is back."""
import socket
import subprocess
import sys
import time
import urllib.request

from mlflow.tracking import MlflowClient

from pipelines.cli import main as hstu

TINY = "--max-seq-len 16 --batch-size 8 --num-negatives 16"
EPOCHS = 40  # long enough to go on well after the server is back (a restart takes seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
         "--default-artifact-root", str(store / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
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
    raise TimeoutError("mlflow server did not start")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=30)


def test_training_outlives_a_tracking_server_outage(tmp_path):
    data, out, store = tmp_path / "data", tmp_path / "train", tmp_path / "mlflow"
    store.mkdir()
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "60", "--out", str(data)])
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(store, port)
    train = subprocess.Popen(
        [sys.executable, "-m", "lightning_modules.train", "--data-dir", str(data), "--out-dir", str(out), "--epochs", str(EPOCHS),
         "--tracking-uri", uri, "--no-progress-bar", *TINY.split()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "epoch=0000.ckpt").exists():  # one epoch logged with the server up
            assert train.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        stop(server)
        while not (out / "checkpoints" / "epoch=0002.ckpt").exists():  # two more trained without it
            assert train.poll() is None and time.monotonic() < deadline, "training stopped with the server"
            time.sleep(0.1)
        server = start_server(store, port)
        log, _ = train.communicate(timeout=300)
        assert train.returncode == 0, log[-3000:]
        assert "MLflow tracking server unreachable" in log and "MLflow tracking server back" in log
        client = MlflowClient(uri)
        run = client.search_runs([client.get_experiment_by_name("hstu").experiment_id])[0]
        epochs = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/ndcg_at_10"))
        losses = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    finally:
        train.kill()
        if server.poll() is None:
            stop(server)
    assert run.info.status == "FINISHED"
    assert len(epochs) == EPOCHS  # every epoch's validation, those of the outage included
    assert losses == sorted(set(losses)) and len(losses) >= EPOCHS * 7  # every step's loss (60 users / 8 per step)
