"""The project against MLflow as a platform runs it: a real `mlflow server` on a real
PostgreSQL. A whole pipeline run logs what a user looks for first (final metrics, curves,
data, code version, system metrics, a servable registered model), and training outlives
the server going away mid-run."""
import json
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from conftest import check_run_page, free_port, start_mlflow_server, stop_server
from pipelines.cli import main as hstu

TINY = "--max-seq-len 16 --batch-size 8 --num-negatives 16"
EPOCHS = 40  # long enough to go on well after the server is back (a restart takes seconds)


def test_pipeline_run_on_a_postgres_backed_tracking_server(tmp_path, postgres, monkeypatch):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(postgres("pipeline"), tmp_path / "artifacts", port)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    try:
        work = tmp_path / "run"
        hstu(["run", "--dataset", "synthetic", "--synthetic-users", "48", "--work-dir", str(work), "--workers", "1",
              "--epochs", "2", "--baselines", "most-popular", "--train-args", TINY, "--tracking-uri", uri])
        results = json.loads((work / "metrics.json").read_text())
        client = MlflowClient(uri)
        run = client.get_run(results["run_id"])
        assert run.info.status == "FINISHED" and results["tracking_uri"] == uri
        assert run.data.metrics["test/ndcg_at_10"] == pytest.approx(results["model"]["ndcg@10"])
        assert len(client.get_metric_history(run.info.run_id, "val/ndcg_at_10")) == 2
        check_run_page(uri, run.info.run_id, work / "data")
        # the registered model serves from the registry, its artifacts through the server
        served = mlflow.pyfunc.load_model(f"models:/hstu/{run.data.params['registered_model_version']}")
        history = pd.read_parquet(work / "data" / "test.parquet")["item_ids"][0].tolist()[:-1]
        top = served.predict(pd.DataFrame({"history": [history], "k": [5]}))[0]
        assert len(top) == 5 and not set(top) & set(history)
    finally:
        stop_server(server)


def newest_epoch(checkpoints: Path) -> int:
    """The newest epoch checkpointed so far (-1: none). Training keeps only the newest two
    epochs' checkpoints (and the best), so a poll for one file by name can miss it."""
    return max((int(p.stem.split("=")[1]) for p in checkpoints.glob("epoch=*.ckpt")), default=-1)


def test_training_outlives_a_tracking_server_outage(tmp_path, postgres):
    data, out = tmp_path / "data", tmp_path / "train"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "60", "--out", str(data)])
    port, backend = free_port(), postgres("outage")
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(backend, tmp_path / "artifacts", port)
    train = subprocess.Popen(
        [sys.executable, "-m", "lightning_modules.train", "--data-dir", str(data), "--out-dir", str(out), "--epochs", str(EPOCHS),
         "--tracking-uri", uri, "--no-progress-bar", *TINY.split()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while newest_epoch(out / "checkpoints") < 0:  # one epoch logged with the server up
            assert train.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        stop_server(server)
        down_after = newest_epoch(out / "checkpoints")
        while newest_epoch(out / "checkpoints") < down_after + 2:  # two more trained without it
            assert train.poll() is None and time.monotonic() < deadline, "training stopped with the server"
            time.sleep(0.1)
        server = start_mlflow_server(backend, tmp_path / "artifacts", port)  # the same database: nothing lost
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
            stop_server(server)
    assert run.info.status == "FINISHED"
    assert len(epochs) == EPOCHS  # every epoch's validation, those of the outage included
    assert losses == sorted(set(losses)) and len(losses) >= EPOCHS * 7  # every step's loss (60 users / 8 per step)


def test_a_pipeline_run_without_a_run_id_opens_one_and_ends_it(tmp_path):
    """The cluster path (`hstu submit` with a tracking URI): the pipeline's first task makes
    the run, tagged with the Kubeflow run, a retried task finds the same one, and the exit
    task ends it FAILED when a step failed."""
    from components import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert tracking.open_pipeline_run("", "", "kfp-1", "x", {}) == ""  # no tracking URI: no run
    params = {"dataset": "ml-1m", "epochs": 3}
    run_id = tracking.open_pipeline_run(uri, "", "kfp-1", "ml-1m-hstu", params)
    assert tracking.open_pipeline_run(uri, "", "kfp-1", "ml-1m-hstu", params) == run_id
    other = tracking.open_pipeline_run(uri, "", "kfp-2", "ml-1m-hstu", params)
    assert other != run_id
    tracking.close_pipeline_run(uri, "kfp-1", succeeded=False)
    tracking.close_pipeline_run(uri, "kfp-2", succeeded=True)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and client.get_run(other).info.status == "FINISHED"
    assert run.info.run_name == "ml-1m-hstu" and run.data.params == {"pipeline_dataset": "ml-1m", "pipeline_epochs": "3"}
    assert run.data.tags[tracking.PIPELINE_RUN_TAG] == "kfp-1" and "mlflow.source.git.commit" in run.data.tags


def test_the_worker_logger_sends_at_most_once_a_second_and_everything_at_the_end(tmp_path):
    from lightning_modules.tracking_logger import BufferedMLFlowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = BufferedMLFlowLogger(experiment_name="hstu", tracking_uri=uri)
    calls = []
    send = logger.experiment.log_batch
    logger.experiment.log_batch = lambda **kw: (calls.append(len(kw["metrics"])), send(**kw))
    start = time.monotonic()
    for step in range(200):
        logger.log_metrics({"train/loss": 1.0 / (step + 1), "epoch": 0}, step=step)
    fast = time.monotonic() - start < 1.0
    logger.finalize("success")
    history = MlflowClient(uri).get_metric_history(logger.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(200)) and "epoch" not in MlflowClient(uri).get_run(logger.run_id).data.metrics
    assert sum(calls) == 200 and (len(calls) <= 3 or not fast)  # a request a second, not a step


def test_the_registered_models_code_defines_without_warnings():
    """MLflow wraps a PythonModel's predict when its class is defined and warns where the
    input has no type hint; the logged signature describes the input, and `hstu run`'s
    output carried that warning at every export and load."""
    # (MLflow's own modules warn at their import: imported before the recording; MLflow
    # catches what its wrapping raises, so the warnings are recorded, not made errors)
    code = (
        "import mlflow.pyfunc, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import components.mlflow_model\n"
        "print(len(caught), *(w.message for w in caught))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("0"), done.stdout
