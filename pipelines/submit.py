"""`hstu submit`: the pipeline compiled, uploaded to a Kubeflow Pipelines endpoint (a new
version where a pipeline of that name exists) and started as a run, through `kfp.Client`.

The token for the endpoint comes from the environment (TOKEN_ENV), never from a flag, so
that it stays out of shell history and process lists.
"""
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .pipeline import DEFAULT_IMAGE, NAME, compile_pipeline

TOKEN_ENV = "KFP_TOKEN"
SUCCEEDED = "SUCCEEDED"
FINAL_STATES = (SUCCEEDED, "FAILED", "CANCELED", "SKIPPED")


@dataclass
class Submission:
    host: str
    parameters: dict = field(default_factory=dict)  # the pipeline's parameters (work_dir, dataset, ...)
    namespace: str = "kubeflow"
    experiment: str = "hstu"
    run_name: str | None = None
    pipeline_name: str = NAME
    image: str = DEFAULT_IMAGE
    pvc: str | None = None
    mount_path: str = "/workspace"


@dataclass
class Submitted:
    pipeline_id: str
    version_id: str
    run_id: str
    url: str


def submit(s: Submission, client) -> Submitted:
    """Compiles, uploads (or adds a version) and starts the run through a kfp.Client → its
    ids and UI address."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipeline(str(Path(tmp) / "pipeline.yaml"), s.image, s.pvc, s.mount_path)
        pipeline_id = client.get_pipeline_id(s.pipeline_name)
        if pipeline_id is None:
            pipeline_id = client.upload_pipeline(package, pipeline_name=s.pipeline_name).pipeline_id
            versions = client.list_pipeline_versions(pipeline_id, page_size=1, sort_by="created_at desc").pipeline_versions
            version_id = versions[0].pipeline_version_id
        else:
            version = client.upload_pipeline_version(package, f"{s.pipeline_name}-{stamp}", pipeline_id=pipeline_id)
            version_id = version.pipeline_version_id
    experiment = client.create_experiment(s.experiment, namespace=s.namespace)
    run = client.run_pipeline(
        experiment.experiment_id, s.run_name or f"{s.pipeline_name}-{stamp}", params=s.parameters,
        pipeline_id=pipeline_id, version_id=version_id,
    )
    return Submitted(pipeline_id, version_id, run.run_id, f"{s.host.rstrip('/')}/#/runs/details/{run.run_id}")


def wait(client, run_id: str, timeout_s: int, poll_s: float = 10.0) -> str:
    """The run's final state, polled every poll_s (TimeoutError after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = client.get_run(run_id).state
        if state in FINAL_STATES:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {state} after {timeout_s} s")
        time.sleep(poll_s)


def parse_parameters(pairs: list[str]) -> dict:
    """KEY=VALUE strings → the run's parameters (integers where they parse as such)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {pair!r}: expected KEY=VALUE")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out
