"""MLflow helpers: one run per pipeline execution, every step logs into it.

What a run carries besides metrics: MLflow's own context tags (user, source) and the code
version (`code_version_tags`), the prepared data as dataset inputs (`log_dataset`), and
the registered model with a signature, an input example, its requirements and the
project's code, linked to the run's final metrics (`register_export`).
"""
import os
import subprocess
import warnings
from importlib import metadata
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

EXPERIMENT = "hstu"
MODEL_NAME = "hstu"
DISTRIBUTION = "hstu"  # the project's own distribution (pyproject.toml)
COMMIT_ENV = "HSTU_GIT_COMMIT"  # the image's commit, set at build time (Dockerfile)
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# The packages the served model imports: carried with the model as code (MLflow code_paths)
MODEL_CODE = ("kernels", "lightning_modules")
# What the served model needs installed besides its code (versions pinned to this environment's)
MODEL_REQUIREMENTS = ("torch", "numpy", "safetensors", "pyarrow", "lightning", "mlflow")
SPLIT_CONTEXTS = {"train": "training", "valid": "validation", "test": "testing"}


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
        tags = {}
    tags |= code_version_tags()
    return client.create_run(exp_id, run_name=run_name, tags=resolve_tags(tags)).info.run_id


def resolve_tags(tags: dict) -> dict:
    """MLflow's context tags (user, source name and type, ...) under the given ones."""
    from mlflow.tracking.context.registry import resolve_tags as mlflow_context_tags

    return mlflow_context_tags(tags)


def code_version() -> str | None:
    """The commit the project runs from: the image's (COMMIT_ENV), else the checkout's."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_version_tags() -> dict:
    """mlflow.source.git.commit (what the UI shows as the run's code version) and the
    project's package version."""
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT

    tags = {"hstu.version": metadata.version(DISTRIBUTION)}
    if commit := code_version():
        tags[MLFLOW_GIT_COMMIT] = commit
    return tags


def log_dataset(tracking_uri: str, run_id: str, data_dir: str | Path, name: str) -> None:
    """The prepared splits as the run's dataset inputs (schema, row count, digest, source),
    each tagged with its use: training, validation, testing."""
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = []
    for split, context in SPLIT_CONTEXTS.items():
        path = (Path(data_dir) / f"{split}.parquet").resolve()
        with warnings.catch_warnings():  # MLflow's hints on integer columns and local sources: not ours to act on
            warnings.simplefilter("ignore", UserWarning)
            dataset = mlflow.data.from_pandas(pd.read_parquet(path), source=path.as_uri(), name=f"{name}-{split}")
            entity = dataset._to_mlflow_entity()  # (schema and profile are computed here)
        inputs.append(DatasetInput(entity, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)]))
    MlflowClient(tracking_uri).log_inputs(run_id, datasets=inputs)


def finish_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    MlflowClient(tracking_uri).set_terminated(run_id, status)


PIPELINE_RUN_TAG = "kfp.run_id"  # the Kubeflow Pipelines run an MLflow run belongs to


def open_pipeline_run(tracking_uri: str, run_id: str, pipeline_run: str, run_name: str, params: dict) -> str:
    """The MLflow run a pipeline run logs into: `run_id` when the caller made one (the
    local runner), else the run tagged with this pipeline run (a retried step finds the
    same one), else a new one; its parameters logged under pipeline_. No tracking URI,
    no run: returns ""."""
    if not tracking_uri:
        return ""
    client = MlflowClient(tracking_uri)
    if not run_id:
        exp = client.get_experiment_by_name(EXPERIMENT)
        found = client.search_runs([exp.experiment_id], f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run}'") if exp else []
        run_id = found[0].info.run_id if found else start_run(tracking_uri, run_name)
    client.set_tag(run_id, PIPELINE_RUN_TAG, pipeline_run)
    log_params(tracking_uri, run_id, {"pipeline_" + k: v for k, v in params.items()})
    return run_id


def close_pipeline_run(tracking_uri: str, pipeline_run: str, succeeded: bool) -> None:
    """Ends the MLflow run of a pipeline run (found by its tag): FINISHED or FAILED."""
    if not tracking_uri:
        return
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    for run in client.search_runs([exp.experiment_id], f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run}'") if exp else []:
        client.set_terminated(run.info.run_id, "FINISHED" if succeeded else "FAILED")


def log_params(tracking_uri: str, run_id: str, params: dict, prefix: str = "") -> None:
    """Parameters in one request."""
    from mlflow.entities import Param

    MlflowClient(tracking_uri).log_batch(run_id, params=[Param(prefix + k, str(v)) for k, v in params.items()])


def log_metrics(tracking_uri: str, run_id: str, metrics: dict, prefix: str = "", step: int = 0) -> None:
    """Metrics in one request, named as MLflow allows ('@' written '_at_')."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    MlflowClient(tracking_uri).log_batch(run_id, metrics=[
        Metric((prefix + k).replace("@", "_at_"), float(v), now, step) for k, v in metrics.items()
    ])


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


def input_example():
    """A request the served model answers (components/mlflow_model.py): histories, their
    times, top k."""
    import pandas as pd

    return pd.DataFrame({"history": [[1, 2, 3]], "timestamps": [[978300760, 978301968, 978302109]], "k": [10]})


def model_signature():
    """The served model's columns: `history` (item ids, oldest first), optional
    `timestamps` (the history's times) and `k`; out: one list of item ids per row."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema
    from mlflow.types.schema import Array

    return ModelSignature(
        inputs=Schema([
            ColSpec(Array(DataType.long), "history"),
            ColSpec(Array(DataType.long), "timestamps", required=False),
            ColSpec(DataType.long, "k", required=False),
        ]),
        outputs=Schema([ColSpec(Array(DataType.long))]),
    )


def _pinned(name: str) -> str:
    return f"{name}=={metadata.version(name).split('+')[0]}"  # local build tags (torch's +cpu) dropped


def model_requirements() -> list[str]:
    """MODEL_REQUIREMENTS pinned to the versions installed here, and Triton on Linux."""
    try:
        triton = _pinned("triton")
    except metadata.PackageNotFoundError:
        triton = "triton"
    return [_pinned(name) for name in MODEL_REQUIREMENTS] + [f"{triton}; platform_system == 'Linux'"]


def register_export(tracking_uri: str, run_id: str, export_dir: str | Path, step: int = 0, name: str = MODEL_NAME) -> str:
    """Logs the exported directory as a pyfunc model (defined from code: no pickle) with
    its signature, an input example, its requirements and the project's code, and
    registers it; returns the new registered version. The model is linked to the run's
    metrics logged at `step` (the pipeline logs its test metrics at the trained model's
    last step), which its page in MLflow shows."""
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(Path(__file__).with_name("mlflow_model.py")),
            artifacts={"export": str(export_dir)},
            code_paths=[str(PROJECT_ROOT / package) for package in MODEL_CODE],
            pip_requirements=model_requirements(),
            signature=model_signature(),
            input_example=input_example(),
            registered_model_name=name,
            step=step,
        )
    return str(info.registered_model_version)
