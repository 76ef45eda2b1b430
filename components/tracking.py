"""MLflow helpers: one run per pipeline execution, every step logs into it."""
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

EXPERIMENT = "hstu"
MODEL_NAME = "hstu"


def default_tracking_uri(work_dir: str | Path) -> str:
    """The embedded default: a SQLite file in the work directory."""
    return f"sqlite:///{Path(work_dir).resolve() / 'mlflow.db'}"


def start_run(
    tracking_uri: str, run_name: str | None = None, experiment: str = EXPERIMENT, artifact_root: str | None = None,
    parent_run_id: str | None = None,
) -> str:
    """Creates a run (left open for the steps) and returns its id: the pipeline's, or a
    child of `parent_run_id` in the parent's experiment. A new experiment keeps its
    artifacts under `artifact_root` when given (else the server's default; for a SQLite
    store that would be ./mlruns of whatever directory is current)."""
    client = MlflowClient(tracking_uri)
    if parent_run_id:
        exp_id = client.get_run(parent_run_id).info.experiment_id
        tags = {"mlflow.parentRunId": parent_run_id}
    else:
        exp = client.get_experiment_by_name(experiment)
        location = Path(artifact_root).resolve().as_uri() if artifact_root else None
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment, artifact_location=location)
        tags = None
    return client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id


def finish_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    MlflowClient(tracking_uri).set_terminated(run_id, status)


def log_params(tracking_uri: str, run_id: str, params: dict, prefix: str = "") -> None:
    client = MlflowClient(tracking_uri)
    for k, v in params.items():
        client.log_param(run_id, prefix + k, v)


def log_metrics(tracking_uri: str, run_id: str, metrics: dict, prefix: str = "", step: int = 0) -> None:
    client = MlflowClient(tracking_uri)
    for k, v in metrics.items():
        client.log_metric(run_id, (prefix + k).replace("@", "_at_"), float(v), step=step)


def log_artifact(tracking_uri: str, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    MlflowClient(tracking_uri).log_artifact(run_id, str(path), artifact_path)


def plot_training_curve(tracking_uri: str, run_id: str, out_png: str | Path, metric: str = "train/loss") -> Path:
    """The run's loss history as a PNG (for the run's artifacts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = sorted(MlflowClient(tracking_uri).get_metric_history(run_id, metric), key=lambda m: m.step)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m.step for m in history], [m.value for m in history], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


def next_model_version(tracking_uri: str, name: str = MODEL_NAME) -> int:
    client = MlflowClient(tracking_uri)
    versions = [int(v.version) for v in client.search_model_versions(f"name='{name}'")]
    return max(versions, default=0) + 1


def register_export(tracking_uri: str, run_id: str, export_dir: str | Path, name: str = MODEL_NAME) -> str:
    """Logs the exported directory as a pyfunc model (defined from code: no pickle) and
    registers it; returns the new registered version."""
    mlflow.set_tracking_uri(tracking_uri)
    model_code = str(Path(__file__).with_name("mlflow_model.py"))
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=model_code,
            artifacts={"export": str(export_dir)},
            registered_model_name=name,
            pip_requirements=[],  # the project's own image / environment serves it
        )
    return str(info.registered_model_version)
