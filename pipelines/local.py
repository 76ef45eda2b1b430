"""Runs the pipeline on this machine: Kubeflow's local runner, worker processes here,
MLflow on a SQLite file in the work directory (unless a tracking URI is given)."""
import json
import os
import sys
import warnings
from pathlib import Path

import kfp.local

from components import tracking

from .pipeline import build


def run_local(
    work_dir: str,
    dataset: str = "synthetic",
    data_dir: str = "",
    input_file: str = "",
    workers: int = 1,
    epochs: int = 1,
    preset: str = "hstu",
    extra_args: str = "",
    patience: int = -1,
    baselines: str = "most-popular",
    tracking_uri: str = "",
    seed: int = 0,
    synthetic_users: int = 6040,
) -> dict:
    """Executes every step; returns and writes `<work_dir>/metrics.json`."""
    work = Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    embedded = not tracking_uri
    tracking_uri = tracking_uri or tracking.default_tracking_uri(work)
    # made here for its artifact location; the pipeline logs its parameters and ends it
    run_id = tracking.start_run(
        tracking_uri, run_name=f"{dataset}-{preset}", artifact_root=str(work / "mlartifacts") if embedded else None
    )
    # the local runner starts each step with `python3` from PATH: make it this interpreter
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(work / "kfp"))
    try:
        with warnings.catch_warnings():
            # the runner warns at every step that the components name the project's image, not
            # a Python one; running them in this interpreter, which holds the project as the
            # image does, is what a local run is
            warnings.filterwarnings("ignore", message="You may be attemping to run a task that uses custom or non-Python base image")
            build()(
                work_dir=str(work), dataset=dataset, data_dir=str(Path(data_dir).resolve()) if data_dir else "",
                input_file=str(Path(input_file).resolve()) if input_file else "", seed=seed,
                synthetic_users=synthetic_users, workers=workers, preset=preset, epochs=epochs, patience=patience,
                baselines=baselines, extra_args=extra_args, tracking_uri=tracking_uri, run_id=run_id,
            )
    except BaseException:
        tracking.finish_run(tracking_uri, run_id, "FAILED")  # where the runner stopped before the pipeline's exit task
        raise
    results = json.loads((work / "evaluation" / "metrics.json").read_text())
    results |= {"run_id": run_id, "tracking_uri": tracking_uri, "seed": seed}
    (work / "metrics.json").write_text(json.dumps(results, indent=2))
    return results
